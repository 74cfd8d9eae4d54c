package injection

import (
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/google/go-cmp/cmp"

	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

var cfg = Config{Backend: nodeapi.BackendDriver, HookPath: "/opt/gpufrac/bin/gpufrac", MPSRoot: "/run/gpufrac/mps", MPS: nodeapi.MPSv3, ShimDir: "/opt/gpufrac/lib",
	GPUMemoryMiB: 81920}

// Adjust is Decide on a node that does not fail open, as the table tests
// read it: the adjustment, or why the container is refused.
func Adjust(pod Pod, container string, env []string, cfg Config) (*nriapi.ContainerAdjustment, error) {
	d := Decide(pod, container, env, cfg)
	if d.Verdict == Refuse {
		return nil, d.Reason
	}
	return d.Adjustment, nil
}

// The mounts the table expects, as "source -> destination".
const (
	mainSocket = "/run/gpufrac/mps/pipe/control -> /run/nvidia/mps/control"
	shim       = "/opt/gpufrac/lib -> /usr/local/gpufrac/lib"
)

func TestAdjust(t *testing.T) {
	hostile := []string{
		"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_GPU_MEMORY_LIMIT=999999", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=250",
		"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G", "CUDA_MPS_PIPE_DIRECTORY=/tmp/evil", "LD_LIBRARY_PATH=/usr/lib/app:/opt/gpufrac-not",
		"HOME=/root",
	}
	tests := []struct {
		name      string
		ann       map[string]string
		container string
		env       []string
		wantEnv   map[string]string // the container's whole environment afterwards
		wantHook  []string          // hook env, nil for no hook
		wantMount []string          // destinations
		wantErr   string
	}{
		{
			name: "single device time-slicing, hostile env replaced",
			ann: map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-a",
				"nvidia.com/container.main.gpu-memory.request": "40448Mi", "nvidia.com/container.main.gpu-memory.limit": "40448Mi"},
			container: "main", env: hostile,
			wantEnv: map[string]string{
				"NVIDIA_VISIBLE_DEVICES": "GPU-a", "NVIDIA_GPU_MEMORY_REQUEST": "40448", "NVIDIA_GPU_MEMORY_LIMIT": "40448",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=40448M", "LD_LIBRARY_PATH": "/usr/local/gpufrac/lib:/usr/lib/app:/opt/gpufrac-not",
				"CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps", "HOME": "/root",
			},
			wantHook:  []string{"GPUFRAC_CONTAINER=main", "GPUFRAC_DEVICES=GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB=40448", "GPUFRAC_MEMORY_LIMIT_MIB=40448"},
			wantMount: []string{mainSocket, shim},
		},
		{
			name: "multi-device burst limit",
			ann: map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a,GPU-b",
				"nvidia.com/container.main.gpu-memory.request": "4Gi", "nvidia.com/container.main.gpu-memory.limit": "8Gi"},
			container: "main",
			wantEnv: map[string]string{
				"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b", "NVIDIA_GPU_MEMORY_REQUEST": "4096", "NVIDIA_GPU_MEMORY_LIMIT": "8192",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M,1=8192M", "LD_LIBRARY_PATH": "/usr/local/gpufrac/lib",
				"CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps",
			},
			wantHook:  []string{"GPUFRAC_CONTAINER=main", "GPUFRAC_DEVICES=GPU-a,GPU-b", "GPUFRAC_MEMORY_REQUEST_MIB=4096", "GPUFRAC_MEMORY_LIMIT_MIB=8192"},
			wantMount: []string{mainSocket, shim},
		},
		{
			name: "sm-sharing on a dotted container name (KAI-written keys)",
			ann: map[string]string{"nvidia.com/container.llm.v2.gpus.devices": "GPU-c",
				"nvidia.com/container.llm.v2.gpu-memory.request": "10Gi", "nvidia.com/container.llm.v2.gpu-compute.mode": "sm-sharing",
				"nvidia.com/container.llm.v2.gpu-compute.portion": "0.255"},
			container: "llm.v2", env: hostile,
			wantEnv: map[string]string{
				"NVIDIA_VISIBLE_DEVICES": "GPU-c", "NVIDIA_GPU_MEMORY_REQUEST": "10240", "NVIDIA_GPU_MEMORY_LIMIT": "10240",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M", "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps",
				"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "LD_LIBRARY_PATH": "/usr/local/gpufrac/lib:/usr/lib/app:/opt/gpufrac-not",
				"HOME": "/root",
			},
			wantHook:  []string{"GPUFRAC_CONTAINER=llm.v2", "GPUFRAC_DEVICES=GPU-c", "GPUFRAC_MEMORY_REQUEST_MIB=10240", "GPUFRAC_MEMORY_LIMIT_MIB=10240"},
			wantMount: []string{"/run/gpufrac/mps/pipe/gpufrac/" + nodeapi.NamespaceName("uid-1", "llm.v2") + " -> /run/nvidia/mps", shim},
		},
		{
			name: "tiny portion still gets one percent",
			ann: map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-c", "nvidia.com/container.main.gpu-memory.request": "1Gi",
				"nvidia.com/container.main.gpu-compute.mode": "sm-sharing", "nvidia.com/container.main.gpu-compute.portion": "0.004"},
			container: "main",
			wantEnv: map[string]string{
				"NVIDIA_VISIBLE_DEVICES": "GPU-c", "NVIDIA_GPU_MEMORY_REQUEST": "1024", "NVIDIA_GPU_MEMORY_LIMIT": "1024",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M", "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps",
				"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1", "LD_LIBRARY_PATH": "/usr/local/gpufrac/lib",
			},
			wantHook:  []string{"GPUFRAC_CONTAINER=main", "GPUFRAC_DEVICES=GPU-c", "GPUFRAC_MEMORY_REQUEST_MIB=1024", "GPUFRAC_MEMORY_LIMIT_MIB=1024"},
			wantMount: []string{"/run/gpufrac/mps/pipe/gpufrac/" + nodeapi.NamespaceName("uid-1", "main") + " -> /run/nvidia/mps", shim},
		},
		{
			name:      "sidecar of a fractional pod sees no GPU",
			ann:       map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi"},
			container: "sidecar", env: hostile,
			wantEnv: map[string]string{"NVIDIA_VISIBLE_DEVICES": "void", "LD_LIBRARY_PATH": "/usr/lib/app:/opt/gpufrac-not", "HOME": "/root"},
		},
		{
			name: "fraction never scheduled is refused", ann: map[string]string{"gpu-fraction": "0.5"}, container: "main",
			wantErr: `gpu-fraction "0.5" asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no nvidia.com/container.<container>.gpus.devices)`,
		},
		{
			name: "a key under the container prefix that carries no decision is refused", ann: map[string]string{"nvidia.com/container.main": "x"}, container: "main",
			wantErr: "the pod has GPU-fraction annotations but no scheduler decision (nvidia.com/container.<container>.gpus.devices): refusing to run it without limits",
		},
		{
			name: "named target without devices is refused", ann: map[string]string{"gpu-fraction": "0.5", "gpu-fraction-container-name": "main"}, container: "main",
			wantErr: `container "main": nvidia.com/container.main.gpus.devices "" is missing: the container asks for a GPU fraction but no scheduler has assigned it GPUs`,
		},
		{
			name:      "malformed decision is refused",
			ann:       map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "lots"},
			container: "main",
			wantErr:   `container "main": nvidia.com/container.main.gpu-memory.request "lots" must be a Kubernetes quantity such as 4Gi or 7680Mi`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			adj, err := Adjust(Pod{UID: "uid-1", Annotations: tt.ann}, tt.container, tt.env, cfg)
			if tt.wantErr != "" {
				if err == nil || err.Error() != tt.wantErr {
					t.Fatalf("error %v, want %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.wantEnv, ApplyEnv(tt.env, adj)); diff != "" {
				t.Errorf("environment (-want +got):\n%s", diff)
			}
			var hookEnv []string
			if hooks := adj.GetHooks().GetCreateRuntime(); len(hooks) > 0 {
				if len(hooks) != 1 || hooks[0].Path != cfg.HookPath || strings.Join(hooks[0].Args, " ") != cfg.HookPath+" hook apply-memory-limits" {
					t.Errorf("hooks = %v", hooks)
				}
				hookEnv = hooks[0].Env
			}
			if diff := cmp.Diff(tt.wantHook, hookEnv); diff != "" {
				t.Errorf("hook env (-want +got):\n%s", diff)
			}
			var mounts []string
			for _, m := range adj.GetMounts() {
				mounts = append(mounts, m.Source+" -> "+m.Destination)
			}
			if diff := cmp.Diff(tt.wantMount, mounts); diff != "" {
				t.Errorf("mounts (-want +got):\n%s", diff)
			}
		})
	}
}

func TestAdjustIgnoresOrdinaryPods(t *testing.T) {
	adj, err := Adjust(Pod{Annotations: map[string]string{"app": "web"}}, "main", []string{"NVIDIA_VISIBLE_DEVICES=all"}, cfg)
	if adj != nil || err != nil {
		t.Errorf("ordinary pod adjusted: %v, %v", adj, err)
	}
}

// Without the node's MPS daemon no fractional container starts: its
// request would not be guaranteed (memacct evicts only clients) nor its
// pinned limit applied. sm-sharing needs v3 namespaces.
func TestFractionsNeedTheMPSDaemon(t *testing.T) {
	smSharing := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-c", "nvidia.com/container.main.gpu-memory.request": "1Gi",
		"nvidia.com/container.main.gpu-compute.mode": "sm-sharing", "nvidia.com/container.main.gpu-compute.portion": "0.5"}
	timeSlicing := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-c", "nvidia.com/container.main.gpu-memory.request": "1Gi"}
	noRoot, down, legacy := cfg, cfg, cfg
	noRoot.MPSRoot = ""
	down.MPS = nodeapi.MPSNone
	legacy.MPS, legacy.Backend = nodeapi.MPSv2, nodeapi.BackendMPSPinned
	for _, tt := range []struct {
		name    string
		ann     map[string]string
		cfg     Config
		wantErr string
	}{
		{"no MPS directory", timeSlicing, noRoot, "no MPS directory configured"},
		{"daemon down, time-slicing", timeSlicing, down, "MPS control daemon is not running"},
		{"daemon down, sm-sharing", smSharing, down, "MPS control daemon is not running"},
		{"legacy daemon, sm-sharing", smSharing, legacy, "sm-sharing needs MPS v3 namespaces"},
	} {
		_, err := Adjust(Pod{UID: "uid-1", Annotations: tt.ann}, "main", nil, tt.cfg)
		if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("%s: error %v, want %q", tt.name, err, tt.wantErr)
		}
	}
	// The legacy interface still serves time-slicing for the pinned limit:
	// the daemon's pipe directory, which holds no namespaces there.
	adj, err := Adjust(Pod{UID: "uid-1", Annotations: timeSlicing}, "main", nil, legacy)
	if err != nil {
		t.Fatal(err)
	}
	if m := adj.GetMounts(); len(m) < 1 || m[0].Source != "/run/gpufrac/mps/pipe" || m[0].Destination != "/run/nvidia/mps" {
		t.Errorf("legacy time-slicing mounts %v", m)
	}
}

// No fractional container can reach another's namespace, the shared
// server's uncapped default namespace, or the directory holding them.
func TestNoContainerReachesAnotherNamespace(t *testing.T) {
	c := cfg
	c.ShimDir = ""
	root := nodeapi.PipeDir(c.MPSRoot)
	forbidden := []string{root, root + "/" + nodeapi.SharedServer, root + "/" + nodeapi.SharedServer + "/default", root + "/" + nodeapi.SharedServer + "/control"}
	seen := map[string]string{}
	for _, pod := range []string{"uid-1", "uid-2", "uid-3"} {
		for _, ctr := range []string{"main", "main2", "Main", "a.b", "a_b"} {
			for _, mode := range []string{"sm-sharing", "time-slicing"} {
				ann := map[string]string{"nvidia.com/container." + ctr + ".gpus.devices": "GPU-c",
					"nvidia.com/container." + ctr + ".gpu-memory.request": "1Gi", "nvidia.com/container." + ctr + ".gpu-compute.mode": mode,
					"nvidia.com/container." + ctr + ".gpu-compute.portion": "0.1"}
				if mode == "time-slicing" {
					delete(ann, "nvidia.com/container."+ctr+".gpu-compute.portion")
				}
				d := Decide(Pod{UID: pod, Annotations: ann}, ctr, nil, c)
				if d.Verdict != Run {
					t.Fatalf("%s/%s %s: %v", pod, ctr, mode, d.Reason)
				}
				mounts := d.Adjustment.GetMounts()
				if len(mounts) != 1 {
					t.Fatalf("%s/%s %s: mounts %v, want one MPS path", pod, ctr, mode, mounts)
				}
				src := mounts[0].Source
				for _, f := range forbidden {
					if src == f {
						t.Errorf("%s/%s %s mounts %s", pod, ctr, mode, src)
					}
				}
				if mode == "time-slicing" {
					if src != root+"/control" {
						t.Errorf("%s/%s time-slicing mounts %s, want the main socket", pod, ctr, src)
					}
					continue
				}
				if want := nodeapi.NamespaceDir(c.MPSRoot, d.MPSNamespace); src != want || d.MPSNamespace != nodeapi.NamespaceName(pod, ctr) {
					t.Errorf("%s/%s mounts %s (namespace %s), want %s", pod, ctr, src, d.MPSNamespace, want)
				}
				if other, dup := seen[src]; dup {
					t.Errorf("%s/%s and %s share namespace directory %s", pod, ctr, other, src)
				}
				seen[src] = pod + "/" + ctr
				if !regexp.MustCompile(`^[a-z0-9_]+$`).MatchString(d.MPSNamespace) || len(filepath.Join(src, "control")) > 83 {
					t.Errorf("namespace %q (socket %s): must be [a-z0-9_]+ and its socket path at most 83 characters", d.MPSNamespace, filepath.Join(src, "control"))
				}
			}
		}
	}
}

func TestFailOpenInjectsNoGPU(t *testing.T) {
	open := cfg
	open.FailOpen, open.Backend = true, nodeapi.BackendOff
	ann := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi"}
	d := Decide(Pod{Annotations: ann}, "main", nil, open)
	if d.Verdict != FailedOpen || d.Assignment != nil || d.Reason == nil {
		t.Fatalf("decision = %+v", d)
	}
	env := ApplyEnv([]string{"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_GPU_MEMORY_LIMIT=1"}, d.Adjustment)
	if diff := cmp.Diff(map[string]string{"NVIDIA_VISIBLE_DEVICES": "void"}, env); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// Only the compute mode or portion being unusable keeps the memory caps
// when failing open: the container runs capped, as a time-slicing tenant.
func TestFailOpenKeepsMemoryCapsWhenOnlyComputeIsUnreadable(t *testing.T) {
	open := cfg
	open.FailOpen = true
	for name, extra := range map[string]map[string]string{
		"bad mode":    {"nvidia.com/container.main.gpu-compute.mode": "mps"},
		"bad portion": {"nvidia.com/container.main.gpu-compute.mode": "sm-sharing", "nvidia.com/container.main.gpu-compute.portion": "50%"},
	} {
		t.Run(name, func(t *testing.T) {
			ann := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi",
				"nvidia.com/container.main.gpu-memory.limit": "2Gi"}
			for k, v := range extra {
				ann[k] = v
			}
			if d := Decide(Pod{Annotations: ann}, "main", nil, cfg); d.Verdict != Refuse {
				t.Fatalf("closed node: verdict %s, want refuse", d.Verdict)
			}
			d := Decide(Pod{Annotations: ann}, "main", nil, open)
			if d.Verdict != FailedOpen || d.Reason == nil || d.MPSNamespace != "" {
				t.Fatalf("decision = %+v", d)
			}
			env := ApplyEnv(nil, d.Adjustment)
			for k, want := range map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-a", "NVIDIA_GPU_MEMORY_REQUEST": "1024", "NVIDIA_GPU_MEMORY_LIMIT": "2048"} {
				if env[k] != want {
					t.Errorf("%s = %q, want %q (env %v)", k, env[k], want, env)
				}
			}
			if _, ok := env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; ok {
				t.Errorf("compute sharing injected: %v", env)
			}
			if len(d.Adjustment.GetHooks().GetCreateRuntime()) != 1 {
				t.Errorf("driver hook missing: %v", d.Adjustment.GetHooks())
			}
		})
	}
}

// Released KAI writes no .gpu-compute.portion: the node derives the
// share from the memory share and says so.
func TestSMSharingWithoutPortionDerivesItFromMemory(t *testing.T) {
	ann := map[string]string{"nvidia.com/container.main.gpus.devices": "k8s.device-plugin.nvidia.com/gpu=GPU-a",
		"nvidia.com/container.main.gpu-memory.request": "20Gi", "nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}
	c := cfg
	c.GPUMemoryMiB, c.GPUMemoryReserveMiB = 81920+1024, 1024
	d := Decide(Pod{UID: "uid-1", Annotations: ann}, "main", nil, c)
	if d.Verdict != Run || d.Assignment == nil || d.Assignment.Portion.String() != "0.25" || d.MPSNamespace == "" || len(d.Notes) != 1 {
		t.Fatalf("decision = %+v", d)
	}
	if !strings.Contains(d.Notes[0], "derived 0.25 from the memory share, 20480Mi of 81920Mi schedulable") {
		t.Errorf("note = %q", d.Notes[0])
	}
	env := ApplyEnv(nil, d.Adjustment)
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "25" || env["NVIDIA_VISIBLE_DEVICES"] != "k8s.device-plugin.nvidia.com/gpu=GPU-a" {
		t.Errorf("env = %v", env)
	}
	if hook := d.Adjustment.GetHooks().GetCreateRuntime()[0]; !slices.Contains(hook.Env, "GPUFRAC_DEVICES=GPU-a") {
		t.Errorf("the hook must get the bare UUID for NVML: %v", hook.Env)
	}

	c.GPUMemoryMiB = 0
	if d := Decide(Pod{UID: "uid-1", Annotations: ann}, "main", nil, c); d.Verdict != Refuse ||
		!strings.Contains(d.Reason.Error(), "needs the GPU's memory to derive a portion") {
		t.Errorf("unknown GPU memory: %+v", d)
	}
}

// BenchmarkAdjust is the work the NRI plugin does in CreateContainer.
func BenchmarkAdjust(b *testing.B) {
	ann := map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-a",
		"nvidia.com/container.main.gpu-memory.request": "40448Mi", "nvidia.com/container.main.gpu-memory.limit": "40448Mi",
		"nvidia.com/container.main.gpu-compute.mode": "time-slicing", "app": "llm", "team": "ml"}
	env := []string{"PATH=/usr/bin", "LD_LIBRARY_PATH=/usr/lib", "HOME=/root"}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Adjust(Pod{UID: "uid-1", Annotations: ann}, "main", env, cfg); err != nil {
			b.Fatal(err)
		}
	}
}

func TestChooseBackend(t *testing.T) {
	tests := []struct {
		flag       string
		capability nodeapi.Enforcement
		want       nodeapi.Backend
		wantErr    bool
	}{
		{"auto", nodeapi.EnforcementDriver, nodeapi.BackendDriver, false},
		{"auto", nodeapi.EnforcementMPSPinned, nodeapi.BackendMPSPinned, false},
		{"auto", nodeapi.EnforcementNone, nodeapi.BackendOff, false},
		{"driver", nodeapi.EnforcementDriver, nodeapi.BackendDriver, false},
		{"driver", nodeapi.EnforcementMPSPinned, nodeapi.BackendOff, true},
		{"toolkit", nodeapi.EnforcementDriver, nodeapi.BackendToolkit, false},
		{"toolkit", nodeapi.EnforcementNone, nodeapi.BackendOff, true},
		{"mps-pinned", nodeapi.EnforcementDriver, nodeapi.BackendMPSPinned, false},
		{"mps-pinned", nodeapi.EnforcementNone, nodeapi.BackendOff, true},
		{"off", nodeapi.EnforcementDriver, nodeapi.BackendOff, false},
		{"strict", nodeapi.EnforcementDriver, nodeapi.BackendOff, true},
	}
	for _, tt := range tests {
		got, err := ChooseBackend(tt.flag, tt.capability)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("ChooseBackend(%q, %q) = %q, %v; want %q, error %v", tt.flag, tt.capability, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestBackendsShapeTheInjection(t *testing.T) {
	for _, b := range []nodeapi.Backend{nodeapi.BackendToolkit, nodeapi.BackendMPSPinned} {
		c := cfg
		c.Backend = b
		// The toolkit's limits come with its CDI spec, which only a CDI name selects.
		ann := map[string]string{"nvidia.com/container.main.gpus.devices": "k8s.device-plugin.nvidia.com/gpu=GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi"}
		adj, err := Adjust(Pod{UID: "uid-1", Annotations: ann}, "main", nil, c)
		if err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if len(adj.GetHooks().GetCreateRuntime()) != 0 {
			t.Errorf("%s backend added the driver hook", b)
		}
		env := ApplyEnv(nil, adj)
		if env["NVIDIA_GPU_MEMORY_LIMIT"] != "1024" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != "0=1024M" {
			t.Errorf("%s backend env = %v", b, env)
		}
	}
	ann := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi"}
	for _, c := range []Config{{Backend: nodeapi.BackendOff}, {}, {Backend: nodeapi.BackendDriver}, {Backend: nodeapi.BackendToolkit}} {
		if _, err := Adjust(Pod{UID: "uid-1", Annotations: ann}, "main", nil, c); err == nil {
			t.Errorf("config %+v injected a fraction it cannot enforce", c)
		}
	}
}

// A variable both the image and the pod set cannot be changed: the runtime
// changes the first entry and puts the pod's back (ApplyEnv, as NRI's
// AdjustEnv does). Such a container is refused, failing open or not;
// a variable set once is replaced as always.
func TestDecideRefusesWhatTheRuntimeWouldUndo(t *testing.T) {
	ann := map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-a",
		"nvidia.com/container.main.gpu-memory.request": "40448Mi", "nvidia.com/container.main.gpu-memory.limit": "40448Mi"}
	image := []string{"NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin"}
	for _, failOpen := range []bool{false, true} {
		c := cfg
		c.FailOpen = failOpen
		d := Decide(Pod{UID: "u", Annotations: ann}, "main", append(image, "NVIDIA_VISIBLE_DEVICES=all"), c)
		if d.Verdict != Refuse || !strings.Contains(d.Reason.Error(), `container "main": NVIDIA_VISIBLE_DEVICES is set more than once ("all,all"`) {
			t.Errorf("fail-open %v: %s %v, want refused", failOpen, d.Verdict, d.Reason)
		}
		// The fraction's sidecar, which would be shown no GPU, likewise.
		d = Decide(Pod{UID: "u", Annotations: ann}, "sidecar", append(image, "NVIDIA_VISIBLE_DEVICES=GPU-b"), c)
		if d.Verdict != Refuse {
			t.Errorf("fail-open %v: sidecar %s, want refused", failOpen, d.Verdict)
		}
	}
	d := Decide(Pod{UID: "u", Annotations: ann}, "main", image, cfg)
	if d.Verdict != Run || ApplyEnv(image, d.Adjustment)["NVIDIA_VISIBLE_DEVICES"] != "GPU-a" {
		t.Errorf("set once: %s %v", d.Verdict, d.Reason)
	}
}

// A container's own thread percentage can only lower its share, so a valid
// one is kept: untouched for time-slicing, the ceiling where it is below
// the sm-sharing portion's; one MPS would not read as a share is dropped.
func TestOwnLowerThreadPercentageIsKept(t *testing.T) {
	timeSlicing := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "20Gi"}
	smSharing := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "20Gi",
		"nvidia.com/container.main.gpu-compute.mode": "sm-sharing", "nvidia.com/container.main.gpu-compute.portion": "0.25"}
	for _, tc := range []struct {
		name string
		ann  map[string]string
		own  string // "" for none
		want string // "-" for unset
	}{
		{"time-slicing keeps its own", timeSlicing, "30", "30"},
		{"time-slicing with none gets none", timeSlicing, "", "-"},
		{"time-slicing drops a value that is no share", timeSlicing, "0", "-"},
		{"time-slicing drops a non-number", timeSlicing, "half", "-"},
		{"sm-sharing keeps a lower own", smSharing, "10", "10"},
		{"sm-sharing caps a higher own at its portion", smSharing, "80", "25"},
		{"sm-sharing replaces an out-of-range own", smSharing, "250", "25"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var env []string
			if tc.own != "" {
				env = []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=" + tc.own}
			}
			d := Decide(Pod{UID: "u", Annotations: tc.ann}, "main", env, cfg)
			if d.Verdict != Run {
				t.Fatalf("%s: %v", d.Verdict, d.Reason)
			}
			got, ok := ApplyEnv(env, d.Adjustment)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
			if !ok {
				got = "-"
			}
			if got != tc.want {
				t.Errorf("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = %q, want %q", got, tc.want)
			}
		})
	}
}

// A time-slicing tenant reaches the MPS daemon's main socket read-only:
// connect() needs no write access to the mount.
func TestTimeSlicingControlSocketIsReadOnly(t *testing.T) {
	ann := map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi"}
	d := Decide(Pod{UID: "u", Annotations: ann}, "main", nil, cfg)
	for _, m := range d.Adjustment.GetMounts() {
		if m.Destination == "/run/nvidia/mps/control" {
			if !slices.Contains(m.Options, "ro") || slices.Contains(m.Options, "rw") {
				t.Errorf("control socket mounted %v, want read-only", m.Options)
			}
			return
		}
	}
	t.Errorf("no control socket mount: %v", d.Adjustment.GetMounts())
}
