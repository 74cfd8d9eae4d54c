package nriplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/enforce/enforcetest"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// runtime is the runtime side of NRI as containerd embeds it
// (pkg/adaptation), serving the real protocol on a unix socket.
type runtime struct {
	*adaptation.Adaptation
	socket string
}

func startRuntime(t *testing.T, pods []*nriapi.PodSandbox, ctrs []*nriapi.Container) *runtime {
	t.Helper()
	return startRuntimeAt(t, filepath.Join(t.TempDir(), "nri.sock"), pods, ctrs)
}

func startRuntimeAt(t *testing.T, sock string, pods []*nriapi.PodSandbox, ctrs []*nriapi.Container) *runtime {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{"plugins", "conf.d"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sync := func(ctx context.Context, cb adaptation.SyncCB) error {
		_, err := cb(ctx, pods, ctrs)
		return err
	}
	update := func(context.Context, []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error) { return nil, nil }
	a, err := adaptation.New("test-runtime", "1.0", sync, update, adaptation.WithSocketPath(sock),
		adaptation.WithPluginPath(filepath.Join(dir, "plugins")), adaptation.WithPluginConfigPath(filepath.Join(dir, "conf.d")))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	return &runtime{Adaptation: a, socket: sock}
}

// recorder is the Reporter and Evictor of the tests.
type recorder struct {
	mu                                                                                     sync.Mutex
	refused, failedOpen, evict, releaseFailed, enforced, unenforced, mpsRestarted, policed []string
	failEvictions                                                                          int
}

func (r *recorder) Policed(pod PodRef, c, detail string) {
	r.add(&r.policed, pod.Name+"/"+c+": "+detail)
}

func (r *recorder) Refused(pod PodRef, c string, err error) {
	r.add(&r.refused, pod.Name+"/"+c+": "+err.Error())
}
func (r *recorder) FailedOpen(pod PodRef, c string, err error) {
	r.add(&r.failedOpen, pod.Name+"/"+c)
}
func (r *recorder) Evicted(PodRef, string, string) {}
func (r *recorder) MPSRestarted(pod PodRef, c, detail string) {
	r.add(&r.mpsRestarted, pod.Name+"/"+c+": "+detail)
}
func (r *recorder) Unenforced(pod PodRef, c, reason string) {
	r.add(&r.unenforced, pod.Name+"/"+c+": "+reason)
}
func (r *recorder) Enforced(pod PodRef, c, detail string) {
	r.add(&r.enforced, pod.Name+"/"+c+": "+detail)
}
func (r *recorder) ReleaseFailed(pod PodRef, c string, err error) {
	r.add(&r.releaseFailed, pod.Name+"/"+c+": "+err.Error())
}
func (r *recorder) Evict(_ context.Context, pod PodRef, reason string) error {
	r.mu.Lock()
	if r.failEvictions > 0 {
		r.failEvictions--
		r.mu.Unlock()
		return errors.New("cannot evict: it would violate the disruption budget")
	}
	r.mu.Unlock()
	r.add(&r.evict, pod.Name+": "+reason)
	return nil
}
func (r *recorder) add(list *[]string, s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	*list = append(*list, s)
}
func (r *recorder) get(list *[]string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), *list...)
}

func startPlugin(t *testing.T, rt *runtime, opts Options) *Plugin {
	t.Helper()
	p := New(opts)
	connect(t, p, rt)
	return p
}

// connect runs p against rt until the test ends, and waits until the
// runtime invokes it.
func connect(t *testing.T, p *Plugin, rt *runtime) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, rt.socket) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Logf("plugin stopped: %v", err)
		}
	})
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return p.Registered(), nil
	}); err != nil {
		t.Fatalf("plugin did not register: %v", err)
	}
	// The runtime adds the plugin to its invocation list just after the
	// plugin's Synchronize returns: wait until creations reach it.
	probe := sandbox("probe", "probe", scheduled)
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: probe, Container: container("probe", "probe", "main")})
		return err == nil && len(resp.GetAdjust().GetEnv()) > 0, nil
	}); err != nil {
		t.Fatalf("runtime never invoked the plugin: %v", err)
	}
}

var cfg = injection.Config{Backend: nodeapi.BackendDriver, HookPath: "/opt/gpufrac/bin/gpufrac", MPSRoot: "/run/gpufrac/mps", MPS: nodeapi.MPSv3}

// startMPS runs the node's MPS daemon (the stand-in, as r615) under a
// short root until the test ends, and returns the root and a namespace
// manager over it.
func startMPS(t *testing.T) (string, *mps.Manager) {
	t.Helper()
	root := mpstest.ShortRoot(t)
	control, _ := mpstest.StartDaemon(t, root, 615)
	m, err := mps.OpenManager(control, filepath.Join(root, "namespaces.json"))
	if err != nil {
		t.Fatal(err)
	}
	return root, m
}

func sandbox(id, name string, annotations map[string]string) *nriapi.PodSandbox {
	return &nriapi.PodSandbox{Id: id, Name: name, Namespace: "ml", Uid: "uid-" + id, Annotations: annotations}
}

func container(id, pod, name string, env ...string) *nriapi.Container {
	return &nriapi.Container{Id: id, PodSandboxId: pod, Name: name, Env: env, State: nriapi.ContainerState_CONTAINER_RUNNING}
}

// smSharing is a 1Gi sm-sharing share of a quarter of GPU-a's SMs.
var smSharing = map[string]string{
	"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "1Gi",
	"nvidia.com/container.main.gpu-compute.mode": "sm-sharing", "nvidia.com/container.main.gpu-compute.portion": "0.25",
}

var scheduled = map[string]string{
	"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-a",
	"nvidia.com/container.main.gpu-memory.request": "40448Mi", "nvidia.com/container.main.gpu-memory.limit": "60672Mi",
}

func TestCreateContainerOverNRI(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec})
	ctx := context.Background()

	pod := sandbox("p1", "llm", scheduled)
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	ctr := container("c1", "p1", "main", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_GPU_MEMORY_LIMIT=80000", "PATH=/bin")
	resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	want := map[string]string{
		"NVIDIA_VISIBLE_DEVICES": "GPU-a", "NVIDIA_GPU_MEMORY_REQUEST": "40448", "NVIDIA_GPU_MEMORY_LIMIT": "60672",
		"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=60672M", "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps", "PATH": "/bin",
	}
	if diff := cmp.Diff(want, injection.ApplyEnv(ctr.Env, resp.GetAdjust())); diff != "" {
		t.Errorf("container environment (-want +got):\n%s", diff)
	}
	hooks := resp.GetAdjust().GetHooks().GetCreateRuntime()
	if len(hooks) != 1 || hooks[0].Path != cfg.HookPath {
		t.Errorf("createRuntime hooks = %v", hooks)
	}

	// Ordinary pods pass untouched.
	plain := sandbox("p2", "web", map[string]string{"app": "web"})
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: plain}); err != nil {
		t.Fatal(err)
	}
	resp, err = rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: plain, Container: container("c2", "p2", "web", "NVIDIA_VISIBLE_DEVICES=all")})
	if err != nil || len(resp.GetAdjust().GetEnv()) != 0 || len(resp.GetAdjust().GetHooks().GetCreateRuntime()) != 0 || len(resp.GetAdjust().GetMounts()) != 0 {
		t.Errorf("ordinary container adjusted: %v, %v", resp.GetAdjust(), err)
	}

	// A fraction without a scheduler decision fails closed: the runtime
	// gets an error and does not create the container.
	unscheduled := sandbox("p3", "sneaky", map[string]string{"gpu-fraction": "0.5"})
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: unscheduled}); err != nil {
		t.Fatal(err)
	}
	_, err = rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: unscheduled, Container: container("c3", "p3", "main")})
	if err == nil || !strings.Contains(err.Error(), `gpufrac: pod ml/sneaky container "main": its GPU fraction cannot be enforced: gpu-fraction "0.5" asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no nvidia.com/container.<container>.gpus.devices)`) {
		t.Errorf("unscheduled fraction: error %v", err)
	}
	if got := rec.get(&rec.refused); len(got) != 1 || !strings.HasPrefix(got[0], "sneaky/main: ") {
		t.Errorf("refusals reported: %v", got)
	}
}

// Every container outside a gpufrac share sees exactly what it was
// granted: an image's "all" on an ordinary pod becomes void, a whole-GPU
// pod's list its one GPU; the grant is asked only of containers that name
// GPUs, and one that cannot be read refuses the container (fail closed).
func TestEveryContainerSeesOnlyItsGrant(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	var asked []string
	var grantErr error
	grants := map[string][]string{"ml/trainer/main": {"GPU-b"}, "ml/share/main": {"GPU-c"}}
	c := cfg
	c.RestrictVisibility, c.VisibilityExempt = true, []string{"gpufrac-system", "gpu-operator"}
	startPlugin(t, rt, Options{Injection: c, Reporter: rec, Evictor: rec,
		Grants: func(_ context.Context, pod PodRef, c string, cdi []string) ([]string, error) {
			asked = append(asked, pod.Namespace+"/"+pod.Name+"/"+c)
			if pod.Name == "share" && (len(cdi) != 1 || cdi[0] != "gpu.gpufrac.io/share=uid-1-gpu") {
				return nil, fmt.Errorf("CDI devices %v", cdi)
			}
			return grants[pod.Namespace+"/"+pod.Name+"/"+c], grantErr
		}})
	ctx := context.Background()
	create := func(id, name string, ctr *nriapi.Container) (map[string]string, error) {
		pod := sandbox(id, name, nil)
		if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
			t.Fatal(err)
		}
		resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
		return injection.ApplyEnv(ctr.Env, resp.GetAdjust()), err
	}
	env, err := create("p1", "web", container("c1", "p1", "main", "NVIDIA_VISIBLE_DEVICES=all", "CUDA_VERSION=12.4"))
	if err != nil || env["NVIDIA_VISIBLE_DEVICES"] != "void" {
		t.Errorf("ordinary pod with a CUDA image: NVIDIA_VISIBLE_DEVICES=%q, err %v; want void", env["NVIDIA_VISIBLE_DEVICES"], err)
	}
	env, err = create("p2", "trainer", container("c2", "p2", "main", "NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b"))
	if err != nil || env["NVIDIA_VISIBLE_DEVICES"] != "GPU-b" {
		t.Errorf("whole-GPU pod naming a neighbour's GPU: NVIDIA_VISIBLE_DEVICES=%q, err %v; want its GPU-b", env["NVIDIA_VISIBLE_DEVICES"], err)
	}
	shareCtr := container("c3", "p3", "main", "NVIDIA_VISIBLE_DEVICES=GPU-c")
	shareCtr.CDIDevices = []*nriapi.CDIDevice{{Name: "gpu.gpufrac.io/share=uid-1-gpu"}}
	if env, err = create("p3", "share", shareCtr); err != nil || env["NVIDIA_VISIBLE_DEVICES"] != "GPU-c" {
		t.Errorf("a DRA share's consumer: NVIDIA_VISIBLE_DEVICES=%q, err %v; want its GPU-c untouched", env["NVIDIA_VISIBLE_DEVICES"], err)
	}
	if _, err = create("p4", "plain", container("c4", "p4", "main", "PATH=/bin")); err != nil {
		t.Errorf("a container naming no GPU: %v", err)
	}
	if want := []string{"ml/web/main", "ml/trainer/main", "ml/share/main"}; !slices.Equal(asked, want) {
		t.Errorf("grants asked for %v, want %v (never for a container naming no GPU)", asked, want)
	}
	if got := rec.get(&rec.policed); len(got) != 2 || !strings.Contains(got[0], `NVIDIA_VISIBLE_DEVICES="all" names GPUs not granted`) {
		t.Errorf("policed containers reported: %v", got)
	}

	// The node's GPU software keeps what it names: the agent's own pod
	// (its MPS daemon's NVIDIA_VISIBLE_DEVICES=all), NVIDIA's device plugin.
	infra := sandbox("p6", "gpufrac-node-agent-x", nil)
	infra.Namespace = "gpufrac-system"
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: infra}); err != nil {
		t.Fatal(err)
	}
	resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: infra, Container: container("c6", "p6", "mps", "NVIDIA_VISIBLE_DEVICES=all")})
	if env := injection.ApplyEnv([]string{"NVIDIA_VISIBLE_DEVICES=all"}, resp.GetAdjust()); err != nil || env["NVIDIA_VISIBLE_DEVICES"] != "all" {
		t.Errorf("a container of an exempt namespace: NVIDIA_VISIBLE_DEVICES=%q, err %v; want all, untouched", env["NVIDIA_VISIBLE_DEVICES"], err)
	}
	if slices.Contains(asked, "gpufrac-system/gpufrac-node-agent-x/mps") {
		t.Errorf("grants asked for a container of an exempt namespace: %v", asked)
	}

	grantErr = errors.New("kubelet PodResources List: connection refused")
	_, err = create("p5", "blind", container("c5", "p5", "main", "NVIDIA_VISIBLE_DEVICES=all"))
	if err == nil || !strings.Contains(err.Error(), `the container names GPUs (NVIDIA_VISIBLE_DEVICES="all") and which ones it was granted cannot be read: kubelet PodResources List: connection refused`) {
		t.Errorf("grant unreadable: err %v, want the container refused", err)
	}
}

// A fractional container (and a DRA share's consumer) is an MPS client;
// one that runs as root on the host could quit the node's daemon, and is
// refused unless the admin allows it. An ordinary pod as root is not asked.
func TestRootMPSClientsAreRefused(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec})
	ctx := context.Background()
	create := func(id string, ann map[string]string, uid uint32, cdi ...string) error {
		pod := sandbox(id, id, ann)
		if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
			t.Fatal(err)
		}
		ctr := container("c-"+id, id, "main")
		ctr.User = &nriapi.User{Uid: uid}
		for _, name := range cdi {
			ctr.CDIDevices = append(ctr.CDIDevices, &nriapi.CDIDevice{Name: name})
		}
		_, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
		return err
	}
	const why = "runs as root (uid 0, no user namespace)"
	if err := create("root-frac", scheduled, 0); err == nil || !strings.Contains(err.Error(), why) {
		t.Errorf("a root fraction: %v, want refused", err)
	}
	if err := create("root-share", nil, 0, "gpu.gpufrac.io/share=uid-1-gpu"); err == nil || !strings.Contains(err.Error(), why) {
		t.Errorf("a root DRA share consumer: %v, want refused", err)
	}
	if err := create("user-frac", scheduled, 1000); err != nil {
		t.Errorf("a fraction as uid 1000: %v", err)
	}
	if err := create("root-plain", nil, 0); err != nil {
		t.Errorf("an ordinary root pod: %v", err)
	}
}

// Issue 53: a client of the MPS daemon that may become root after its uid
// was checked is refused as a root one is: one sharing a process namespace
// (the pod's, or a debug container aimed at the share), one whose pod lets
// it gain privileges; in a user namespace neither is host root.
func TestMPSClientsThatMayBecomeRootAreRefused(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	escalates := map[string]bool{"escalating": true}
	open := cfg
	open.FailOpen = true
	startPlugin(t, rt, Options{Injection: open, Reporter: rec, Evictor: rec,
		MayEscalate: func(_, name, _, _ string) *bool { e := escalates[name]; return &e }})
	ctx := context.Background()
	create := func(id, name string, ann map[string]string, edit func(*nriapi.Container)) error {
		pod := sandbox(id, id, ann)
		if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
			t.Fatal(err)
		}
		ctr := container("c-"+id+"-"+name, id, name)
		ctr.User = &nriapi.User{Uid: 1000}
		if edit != nil {
			edit(ctr)
		}
		_, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
		return err
	}
	sharedPID := func(c *nriapi.Container) {
		if c.Linux == nil {
			c.Linux = &nriapi.LinuxContainer{}
		}
		c.Linux.Namespaces = append(c.Linux.Namespaces, &nriapi.LinuxNamespace{Type: "pid", Path: "/proc/4242/ns/pid"})
	}
	const shared = "shares its process namespace with another container"
	if err := create("shared", "main", scheduled, sharedPID); err == nil || !strings.Contains(err.Error(), shared) {
		t.Errorf("a fraction in a shared process namespace: %v, want refused", err)
	}
	// A debug container aimed at the share: refused, even on a node that
	// fails open (hiding its GPUs would not hide the share's files).
	if err := create("debugged", "debug", scheduled, sharedPID); err == nil || !strings.Contains(err.Error(), shared) {
		t.Errorf("a container sharing a fraction's process namespace: %v, want refused", err)
	}
	if err := create("escalating", "main", scheduled, nil); err == nil || !strings.Contains(err.Error(), "it may gain privileges") {
		t.Errorf("a fraction that may gain privileges: %v, want refused", err)
	}
	inUserNS := func(c *nriapi.Container) {
		sharedPID(c)
		escalates["userns"] = true
		c.Linux.Namespaces = append(c.Linux.Namespaces, &nriapi.LinuxNamespace{Type: "user"})
	}
	if err := create("userns", "main", scheduled, inUserNS); err != nil {
		t.Errorf("a fraction in a user namespace: %v", err)
	}
	if err := create("plain", "main", nil, sharedPID); err != nil {
		t.Errorf("an ordinary pod sharing its process namespace: %v", err)
	}
	if err := create("confined", "main", scheduled, nil); err != nil {
		t.Errorf("a fraction that cannot gain privileges: %v", err)
	}
}

// A DRA share is enforced on one container at a time: a second container
// consuming the same share (another container of the pod, or another pod)
// is refused while the first runs; the same container's restart, or a
// container after the first stopped (init, then main), is not.
func TestADRAShareHasOneConsumerAtATime(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec})
	ctx := context.Background()
	const share = "gpu.gpufrac.io/share=uid-1-gpu"
	pods := map[string]*nriapi.PodSandbox{}
	create := func(podID, id, name string) error {
		pod, ok := pods[podID]
		if !ok {
			pod = sandbox(podID, podID, nil)
			pods[podID] = pod
			if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
				t.Fatal(err)
			}
		}
		ctr := container(id, podID, name)
		ctr.CDIDevices = []*nriapi.CDIDevice{{Name: share}}
		_, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
		return err
	}
	stop := func(podID, id, name string) {
		ctr := container(id, podID, name)
		if _, err := rt.StopContainer(ctx, &nriapi.StopContainerRequest{Pod: pods[podID], Container: ctr}); err != nil {
			t.Fatal(err)
		}
	}
	if err := create("p1", "init-1", "setup"); err != nil {
		t.Fatalf("first consumer: %v", err)
	}
	stop("p1", "init-1", "setup")
	if err := create("p1", "main-1", "main"); err != nil {
		t.Fatalf("the main container after the init one stopped: %v", err)
	}
	if err := create("p1", "main-2", "main"); err != nil {
		t.Fatalf("the same container restarted: %v", err)
	}
	const why = `is consumed already by container "main" of pod ml/p1`
	if err := create("p1", "side-1", "sidecar"); err == nil || !strings.Contains(err.Error(), why) {
		t.Errorf("a second container of the pod on the same share: %v, want refused", err)
	}
	if err := create("p2", "other-1", "main"); err == nil || !strings.Contains(err.Error(), why) {
		t.Errorf("another pod on the same share: %v, want refused", err)
	}
}

// A fractional container's GPUs are put in EXCLUSIVE_PROCESS before it
// starts; where they cannot be, it is refused (no process outside MPS may
// share the GPU with it), and ordinary containers are never asked about.
func TestFractionsNeedAnExclusiveGPU(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	var asked [][]string
	refuse := errors.New("GPU GPU-a is not in EXCLUSIVE_PROCESS (NVML cannot set it from Default: ERROR_NO_PERMISSION)")
	var answer error
	c := cfg
	c.ExclusiveProcess = true
	startPlugin(t, rt, Options{Injection: c, Reporter: rec, Evictor: rec, EnsureExclusive: func(uuids []string) error {
		asked = append(asked, uuids)
		return answer
	}})
	ctx := context.Background()
	pod := sandbox("p1", "llm", scheduled)
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: container("c1", "p1", "main")}); err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	if len(asked) == 0 {
		t.Fatal("a fractional container started without its GPU made exclusive")
	}
	answer = refuse
	_, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: container("c2", "p1", "main")})
	if err == nil || !strings.Contains(err.Error(), refuse.Error()) {
		t.Errorf("a GPU that cannot be made exclusive: %v", err)
	}
	before := len(asked)
	plain := sandbox("p2", "web", map[string]string{"app": "web"})
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: plain}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: plain, Container: container("c3", "p2", "web")}); err != nil {
		t.Errorf("ordinary container: %v", err)
	}
	if len(asked) != before {
		t.Errorf("an ordinary container's GPUs were made exclusive: %v", asked[before:])
	}
	for _, a := range asked {
		if !cmp.Equal(a, []string{"GPU-a"}) {
			t.Errorf("asked to make exclusive: %v, want the decision's GPU-a", a)
		}
	}
	if got := rec.get(&rec.refused); len(got) != 1 || !strings.Contains(got[0], "EXCLUSIVE_PROCESS") {
		t.Errorf("refusals reported: %v", got)
	}
}

func TestFailOpenStartsWithoutGPU(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	startPlugin(t, rt, Options{Injection: cfg, FailOpen: true, Reporter: rec, Evictor: rec})
	ctx := context.Background()
	pod := sandbox("p1", "sneaky", map[string]string{"gpu-fraction": "0.5"})
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	ctr := container("c1", "p1", "main", "NVIDIA_VISIBLE_DEVICES=all")
	resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
	if err != nil {
		t.Fatalf("fail-open refused: %v", err)
	}
	if env := injection.ApplyEnv(ctr.Env, resp.GetAdjust()); env["NVIDIA_VISIBLE_DEVICES"] != "void" {
		t.Errorf("fail-open container sees GPUs: %v", env)
	}
	if got := rec.get(&rec.failedOpen); !cmp.Equal(got, []string{"sneaky/main"}) {
		t.Errorf("fail-open events: %v", got)
	}
}

// On (re)connection the runtime replays what runs; containers that were
// created without the injection are evicted, enforced ones are left alone.
func TestSynchronizeAuditsRunningContainers(t *testing.T) {
	enforcedEnv := []string{"NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_GPU_MEMORY_REQUEST=40448", "NVIDIA_GPU_MEMORY_LIMIT=60672", "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps"}
	notClient := enforcedEnv[:3] // created before every fractional container became an MPS client
	pods := []*nriapi.PodSandbox{
		sandbox("p1", "enforced", scheduled),
		sandbox("p2", "unenforced", scheduled),
		sandbox("p5", "no-mps", scheduled),
		sandbox("p3", "plain", nil),
		sandbox("p4", "forged", map[string]string{"gpu-fraction": "0.5"}),
	}
	ctrs := []*nriapi.Container{
		container("c1", "p1", "main", enforcedEnv...),
		container("c2", "p2", "main", "NVIDIA_VISIBLE_DEVICES=GPU-a"),
		container("c3", "p3", "web", "NVIDIA_VISIBLE_DEVICES=all"),
		container("c4", "p4", "main"),
		container("c5", "p5", "main", notClient...),
	}
	rt := startRuntime(t, pods, ctrs)
	rec := &recorder{}
	p := startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec})
	p.WaitForEvictions()
	want := []string{
		`unenforced: NVIDIA_GPU_MEMORY_REQUEST is "", want "40448"`,
		`forged: running although its GPU fraction cannot be enforced: gpu-fraction "0.5" asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no nvidia.com/container.<container>.gpus.devices)`,
		`no-mps: CUDA_MPS_PIPE_DIRECTORY is "", want "/run/nvidia/mps"`,
	}
	got := rec.get(&rec.evict)
	slices.Sort(got)
	slices.Sort(want)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("evictions (-want +got):\n%s", diff)
	}
}

// Issue 53: a container asked to stop (its pod's deletion accepted) that
// still runs KillAfter later is killed by the node itself; one whose pod
// is enforced never is, and one is killed only once.
func TestAContainerThatOutlivesItsStopIsKilled(t *testing.T) {
	enforcedEnv := []string{"NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_GPU_MEMORY_REQUEST=40448", "NVIDIA_GPU_MEMORY_LIMIT=60672", "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps"}
	pods := []*nriapi.PodSandbox{sandbox("p1", "enforced", scheduled), sandbox("p2", "unenforced", scheduled)}
	enforced, unenforced := container("c1", "p1", "main", enforcedEnv...), container("c2", "p2", "main", "NVIDIA_VISIBLE_DEVICES=GPU-a")
	enforced.Pid, unenforced.Pid = 101, 202
	rt := startRuntime(t, pods, []*nriapi.Container{enforced, unenforced})
	rec := &recorder{}
	var mu sync.Mutex
	var killed []uint32
	p := startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec, KillAfter: 50 * time.Millisecond,
		KillContainer: func(_ string, pid uint32) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			killed = append(killed, pid)
			return 3, nil
		}})
	p.WaitForEvictions()
	ctx := context.Background()
	p.RetryEvictions(ctx, time.Time{}) // asks again; too soon to kill
	mu.Lock()
	if len(killed) != 0 {
		t.Errorf("killed %v before KillAfter", killed)
	}
	mu.Unlock()
	time.Sleep(60 * time.Millisecond)
	p.RetryEvictions(ctx, time.Time{})
	p.RetryEvictions(ctx, time.Time{})
	p.WaitForEvictions()
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(killed, []uint32{202}) {
		t.Errorf("killed %v, want the unenforced container's 202 once", killed)
	}
}

// The node's own kill finds a container's cgroup from its first process
// and kills nothing when that PID now lives in another cgroup (reused).
func TestKillFindsTheContainersOwnCgroup(t *testing.T) {
	proc := t.TempDir()
	write := func(path, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(proc, path)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, path), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cgroupfs := t.TempDir()
	write("self/mountinfo", "30 1 0:26 / "+cgroupfs+" rw,nosuid shared:4 - cgroup2 cgroup2 rw\n")
	write("self/cgroup", "0::/\n")
	write("77/cgroup", "0::/kubepods/pod-1/ctr-abc\n")
	write("78/cgroup", "0::/kubepods/pod-2/ctr-other\n")
	if err := os.MkdirAll(filepath.Join(cgroupfs, "kubepods/pod-1/ctr-abc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cgroupfs, "kubepods/pod-1/ctr-abc/cgroup.procs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	p := New(Options{ProcRoot: proc})
	if n, err := p.killContainer("ctr-abc", 77); err != nil || n != 0 {
		t.Errorf("the container's own, empty cgroup: %d killed, %v", n, err)
	}
	if _, err := p.killContainer("ctr-abc", 78); !errors.Is(err, errContainerGone) {
		t.Errorf("a PID reused in another cgroup: %v, want errContainerGone", err)
	}
	if _, err := p.killContainer("ctr-abc", 79); !errors.Is(err, errContainerGone) {
		t.Errorf("a PID gone: %v, want errContainerGone", err)
	}
}

// With grants known, a container that started while the agent was away
// and sees GPUs it was not granted is stopped too; one whose grant covers
// what it names is left alone.
func TestSynchronizeStopsContainersSeeingUngrantedGPUs(t *testing.T) {
	pods := []*nriapi.PodSandbox{sandbox("p1", "web", nil), sandbox("p2", "trainer", nil)}
	ctrs := []*nriapi.Container{
		container("c1", "p1", "web", "NVIDIA_VISIBLE_DEVICES=all"),
		container("c2", "p2", "main", "NVIDIA_VISIBLE_DEVICES=GPU-b"),
	}
	rt := startRuntime(t, pods, ctrs)
	rec := &recorder{}
	c := cfg
	c.RestrictVisibility = true
	p := startPlugin(t, rt, Options{Injection: c, Reporter: rec, Evictor: rec,
		Grants: func(_ context.Context, pod PodRef, _ string, _ []string) ([]string, error) {
			if pod.Name == "trainer" {
				return []string{"GPU-b"}, nil
			}
			return nil, nil
		}})
	p.WaitForEvictions()
	want := []string{`web: running with GPUs it was not granted: NVIDIA_VISIBLE_DEVICES="all" names GPUs not granted to the container (all): set to "void"`}
	if diff := cmp.Diff(want, rec.get(&rec.evict)); diff != "" {
		t.Errorf("evictions (-want +got):\n%s", diff)
	}
}

// An agent that connects before it has read the GPUs does not know the
// node's backend yet, so every fractional container would look
// unenforceable. The audit waits for the backend, then evicts exactly the
// unenforced container: a restarted agent must not evict the node.
func TestSynchronizeBeforeTheBackendIsKnownWaitsForIt(t *testing.T) {
	enforcedEnv := []string{"NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_GPU_MEMORY_REQUEST=40448", "NVIDIA_GPU_MEMORY_LIMIT=60672", "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps"}
	pods := []*nriapi.PodSandbox{sandbox("p1", "enforced", scheduled), sandbox("p2", "unenforced", scheduled)}
	ctrs := []*nriapi.Container{container("c1", "p1", "main", enforcedEnv...), container("c2", "p2", "main", "NVIDIA_VISIBLE_DEVICES=GPU-a")}
	rt := startRuntime(t, pods, ctrs)
	rec := &recorder{}
	unknown := cfg
	unknown.Backend = nodeapi.BackendUnset
	p := New(Options{Injection: unknown, Reporter: rec, Evictor: rec})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, rt.socket) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("plugin stopped: %v", err)
		}
	})
	// Registered, and new fractional containers are refused meanwhile.
	probe := sandbox("probe", "probe", scheduled)
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: probe, Container: container("probe", "probe", "main")})
		return p.Registered() && err != nil && strings.Contains(err.Error(), "no memory-limit backend is in effect"), nil
	}); err != nil {
		t.Fatalf("the plugin did not register and refuse: %v", err)
	}
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 0 {
		t.Fatalf("evicted before the backend was known: %v", got)
	}
	p.SetInjection(unknown) // still unknown: still nothing
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 0 {
		t.Fatalf("evicted while the backend was still unknown: %v", got)
	}
	if p.Audited() {
		t.Error("Audited before the deferred audit ran: its tenants are not all known")
	}
	p.SetInjection(cfg)
	p.WaitForEvictions()
	if !p.Audited() || len(p.Tenants()) == 0 {
		t.Errorf("after the audit: Audited %v, tenants %v", p.Audited(), p.Tenants())
	}
	if got, want := rec.get(&rec.evict), []string{`unenforced: NVIDIA_GPU_MEMORY_REQUEST is "", want "40448"`}; !cmp.Equal(got, want) {
		t.Errorf("evictions once the backend is known = %v, want %v", got, want)
	}
	p.SetInjection(cfg) // the deferred audit runs once
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 1 {
		t.Errorf("the audit ran again: %v", got)
	}
}

func TestSynchronizeWithNothingRunningEvictsNothing(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec}).WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 0 {
		t.Errorf("evictions on an empty resync: %v", got)
	}
}

// When the runtime restarts, the plugin reconnects by itself and audits
// again what runs under the new runtime. The runtime runs in a child
// process that is killed, as a crashed containerd would be: only then do
// its connections really drop.
func TestServeReconnectsAfterRuntimeRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "nri.sock")
	first := startRuntimeProcess(t, sock, nil)
	rec := &recorder{}
	p := New(Options{Injection: cfg, Reporter: rec, Evictor: rec})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Serve(ctx, sock, 10*time.Millisecond, 100*time.Millisecond) }()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) { return cond(), nil }); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	waitFor("first registration", p.Registered)

	_ = first.Process.Kill()
	_ = first.Wait()
	waitFor("disconnect noticed", func() bool { return !p.Registered() })

	// The restarted runtime runs a container that started while no plugin
	// was connected.
	startRuntimeProcess(t, sock, &helperState{
		Pods: []*nriapi.PodSandbox{sandbox("p9", "started-while-away", scheduled)},
		Ctrs: []*nriapi.Container{container("c9", "p9", "main")},
	})
	waitFor("re-registration", p.Registered)
	waitFor("audit after reconnecting", func() bool { return len(rec.get(&rec.evict)) == 1 })
	if got := rec.get(&rec.evict)[0]; !strings.HasPrefix(got, "started-while-away: ") {
		t.Errorf("eviction = %q", got)
	}
}

// helperState is what a child-process runtime reports on synchronization.
type helperState struct {
	Pods []*nriapi.PodSandbox
	Ctrs []*nriapi.Container
}

const helperSocketEnv, helperStateEnv = "GPUFRAC_TEST_NRI_RUNTIME_SOCKET", "GPUFRAC_TEST_NRI_RUNTIME_STATE"

func startRuntimeProcess(t *testing.T, sock string, state *helperState) *exec.Cmd {
	t.Helper()
	if state == nil {
		state = &helperState{}
	}
	js, err := json.Marshal(state)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperSocketEnv+"="+sock, helperStateEnv+"="+string(js))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

func TestMain(m *testing.M) {
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:]))
	}
	if sock := os.Getenv(helperSocketEnv); sock != "" {
		runHelperRuntime(sock, os.Getenv(helperStateEnv))
		return
	}
	os.Exit(m.Run())
}

// runHelperRuntime is the child process: an NRI runtime until killed.
func runHelperRuntime(sock, stateJSON string) {
	var state helperState
	if err := json.Unmarshal([]byte(stateJSON), &state); err != nil {
		panic(err)
	}
	_ = os.Remove(sock) // left behind by the killed runtime
	dir, err := os.MkdirTemp("", "nri-helper")
	if err != nil {
		panic(err)
	}
	sync := func(ctx context.Context, cb adaptation.SyncCB) error {
		_, err := cb(ctx, state.Pods, state.Ctrs)
		return err
	}
	update := func(context.Context, []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error) { return nil, nil }
	r, err := adaptation.New("helper-runtime", "1.0", sync, update, adaptation.WithSocketPath(sock),
		adaptation.WithPluginPath(filepath.Join(dir, "plugins")), adaptation.WithPluginConfigPath(filepath.Join(dir, "conf.d")))
	if err != nil {
		panic(err)
	}
	if err := r.Start(); err != nil {
		panic(err)
	}
	select {}
}

// The driver backend's lifecycle: after start the limits the hook set are
// read back from the container's cgroup; a container without them is
// evicted; at stop the soft limit is released; leases survive a restart
// of the agent and are released for containers that vanished meanwhile.
func TestDriverLimitsVerifiedAfterStartAndReleasedAtStop(t *testing.T) {
	lib, drv, uuids := enforcetest.NewMachine(2)
	proc := enforcetest.Proc(t, map[int]string{101: "/kubepods/pod-a/ctr-1", 102: "/kubepods/pod-b/ctr-2"})
	// As NVML names them: the full sysfs paths.
	cgroups := map[int]string{101: enforcetest.CgroupFS + "/kubepods/pod-a/ctr-1", 102: enforcetest.CgroupFS + "/kubepods/pod-b/ctr-2"}
	leasePath := filepath.Join(t.TempDir(), "leases.json")
	leases, err := enforce.OpenLeases(leasePath)
	if err != nil {
		t.Fatal(err)
	}
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	p := New(Options{Injection: cfg, Reporter: rec, Evictor: rec, NVML: lib, ProcRoot: proc, Leases: leases})
	connect(t, p, rt)
	ctx := context.Background()

	annotations := func(uuid string) map[string]string {
		return map[string]string{"nvidia.com/container.main.gpus.devices": uuid,
			"nvidia.com/container.main.gpu-memory.request": "1Gi", "nvidia.com/container.main.gpu-memory.limit": "2Gi"}
	}
	// Container 1: the hook ran (the runtime would run it between create
	// and start), so its limits are in force.
	podA, ctr1 := sandbox("pa", "enforced", annotations(uuids[0])), container("c1", "pa", "main")
	ctr1.Pid = 101
	if err := enforce.Apply(lib, cgroups[101], enforce.Limits{Devices: []string{uuids[0]}, RequestMiB: 1024, LimitMiB: 2048}); err != nil {
		t.Fatal(err)
	}
	// Container 2: its limits are not in force.
	podB, ctr2 := sandbox("pb", "unenforced", annotations(uuids[1])), container("c2", "pb", "main")
	ctr2.Pid = 102
	for _, pc := range []struct {
		pod *nriapi.PodSandbox
		ctr *nriapi.Container
	}{{podA, ctr1}, {podB, ctr2}} {
		if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pc.pod}); err != nil {
			t.Fatal(err)
		}
		if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pc.pod, Container: pc.ctr}); err != nil {
			t.Fatal(err)
		}
		if err := rt.PostStartContainer(ctx, &nriapi.PostStartContainerRequest{Pod: pc.pod, Container: pc.ctr}); err != nil {
			t.Fatal(err)
		}
	}
	p.WaitForEvictions()
	evictions := rec.get(&rec.evict)
	if len(evictions) != 1 || !strings.HasPrefix(evictions[0], "unenforced: GPU memory limits not in force after start: GPU "+uuids[1]) {
		t.Fatalf("evictions = %v", evictions)
	}
	if ids := leases.IDs(); !cmp.Equal(ids, []string{"c1", "c2"}) {
		t.Errorf("leases = %v", ids)
	}
	states := map[string]string{}
	for _, tenant := range p.Tenants() {
		states[tenant.Pod.Name] = tenant.State
	}
	if diff := cmp.Diff(map[string]string{"enforced": StateEnforced, "unenforced": StateUnenforced, "probe": StateInjected}, states); diff != "" {
		t.Errorf("tenant states (-want +got):\n%s", diff)
	}
	if got := rec.get(&rec.enforced); len(got) != 1 || !strings.HasPrefix(got[0], "enforced/main: driver memory limits verified on cgroup "+cgroups[101]) {
		t.Errorf("enforced events = %v", got)
	}

	if _, err := rt.StopContainer(ctx, &nriapi.StopContainerRequest{Pod: podA, Container: ctr1}); err != nil {
		t.Fatal(err)
	}
	if got := drv.Get(uuids[0], cgroups[101]); got.SoftLimit != 0 || got.HardLimit != 2048<<20 {
		t.Errorf("after stop: %+v, want the soft limit released", got)
	}

	// The agent restarts: the lease of container 2 is still on disk. The
	// runtime now runs only some other container, so container 2 is gone
	// and its lease is released on synchronization.
	drv.Set(uuids[1], cgroups[102], nvml.MemoryLimits_v1{SoftLimit: 1 << 30, HardLimit: 2 << 30})
	reloaded, err := enforce.OpenLeases(leasePath)
	if err != nil || !cmp.Equal(reloaded.IDs(), []string{"c2"}) {
		t.Fatalf("reloaded leases = %v, %v", reloaded.IDs(), err)
	}
	rt2 := startRuntime(t, []*nriapi.PodSandbox{sandbox("px", "other", nil)}, []*nriapi.Container{container("cx", "px", "web")})
	p2 := New(Options{Injection: cfg, Reporter: rec, Evictor: rec, NVML: lib, ProcRoot: proc, Leases: reloaded})
	connect(t, p2, rt2)
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return len(reloaded.IDs()) == 0, nil
	}); err != nil {
		t.Fatalf("vanished container's lease not released: %v", reloaded.IDs())
	}
	if got := drv.Get(uuids[1], cgroups[102]); got.SoftLimit != 0 {
		t.Errorf("vanished container keeps its soft limit: %+v", got)
	}
}

// A read-back that fails (an NVML error, not a mismatch) is retried at the
// resyncs, so a transient error does not evict a healthy pod; one that
// keeps failing for maxVerifyTries tries does.
func TestTransientReadBackErrorsAreRetriedNotEvicted(t *testing.T) {
	lib, drv, uuids := enforcetest.NewMachine(1)
	proc := enforcetest.Proc(t, map[int]string{101: "/kubepods/pod-a/ctr-1", 102: "/kubepods/pod-b/ctr-2"})
	leases, err := enforce.OpenLeases(filepath.Join(t.TempDir(), "leases.json"))
	if err != nil {
		t.Fatal(err)
	}
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	p := New(Options{Injection: cfg, Reporter: rec, Evictor: rec, NVML: lib, ProcRoot: proc, Leases: leases})
	connect(t, p, rt)
	ctx := context.Background()
	start := func(id, name string, pid uint32, failGets int) {
		pod, ctr := sandbox("p"+id, name, map[string]string{"nvidia.com/container.main.gpus.devices": uuids[0],
			"nvidia.com/container.main.gpu-memory.request": "1Gi", "nvidia.com/container.main.gpu-memory.limit": "2Gi"}), container("c"+id, "p"+id, "main")
		ctr.Pid = pid
		cgroup := fmt.Sprintf("%s/kubepods/pod-%s/ctr-%s", enforcetest.CgroupFS, map[string]string{"1": "a", "2": "b"}[id], id)
		if err := enforce.Apply(lib, cgroup, enforce.Limits{Devices: uuids, RequestMiB: 1024, LimitMiB: 2048}); err != nil {
			t.Fatal(err)
		}
		if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
			t.Fatal(err)
		}
		if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr}); err != nil {
			t.Fatal(err)
		}
		drv.FailNextGets(failGets)
		if err := rt.PostStartContainer(ctx, &nriapi.PostStartContainerRequest{Pod: pod, Container: ctr}); err != nil {
			t.Fatal(err)
		}
	}
	state := func(name string) string {
		for _, tn := range p.Tenants() {
			if tn.Pod.Name == name {
				return tn.State
			}
		}
		return ""
	}
	start("1", "blip", 101, 1)
	if got := state("blip"); got != StateUnverified {
		t.Fatalf("after one failed read-back: %s, want %s", got, StateUnverified)
	}
	p.Reverify(ctx)
	p.WaitForEvictions()
	if got := state("blip"); got != StateEnforced || len(rec.get(&rec.evict)) != 0 {
		t.Fatalf("after a read-back that passed: %s, evictions %v", got, rec.get(&rec.evict))
	}

	start("2", "broken", 102, maxVerifyTries)
	for range maxVerifyTries - 1 {
		p.Reverify(ctx)
	}
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 1 || !strings.HasPrefix(got[0], fmt.Sprintf("broken: GPU memory limits could not be read back in %d tries", maxVerifyTries)) {
		t.Errorf("evictions %v, want broken's after %d tries", got, maxVerifyTries)
	}
}

// A container the plugin never saw created (a runtime without an NRI
// failure policy starts it when CreateContainer times out) is judged when
// it starts: a fraction without its injection is stopped, one that names
// no GPU is left alone.
func TestStartedWithoutCreationIsJudgedAtStart(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	p := startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec})
	ctx := context.Background()
	for _, pc := range []struct {
		pod *nriapi.PodSandbox
		ctr *nriapi.Container
	}{
		{sandbox("p1", "uninjected", scheduled), container("c1", "p1", "main", "NVIDIA_VISIBLE_DEVICES=all")},
		{sandbox("p2", "plain", nil), container("c2", "p2", "web", "PATH=/bin")},
	} {
		if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pc.pod}); err != nil {
			t.Fatal(err)
		}
		// No CreateContainer: as if it timed out.
		if err := rt.PostStartContainer(ctx, &nriapi.PostStartContainerRequest{Pod: pc.pod, Container: pc.ctr}); err != nil {
			t.Fatal(err)
		}
	}
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 1 || !strings.HasPrefix(got[0], `uninjected: NVIDIA_VISIBLE_DEVICES is "all", want "GPU-a"`) {
		t.Errorf("evictions %v, want only the uninjected fraction's", got)
	}
}

// An empty resync keeps the leases: it may be a runtime that has not
// caught up, and dropping them would leak every soft limit.
func TestEmptyResyncKeepsLeases(t *testing.T) {
	lib, _, uuids := enforcetest.NewMachine(1)
	leases, err := enforce.OpenLeases(filepath.Join(t.TempDir(), "leases.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := leases.Put("c1", enforce.Lease{Pod: "ml/x", Cgroup: enforcetest.CgroupFS + "/kubepods/x", Devices: uuids}); err != nil {
		t.Fatal(err)
	}
	rt := startRuntime(t, nil, nil)
	p := New(Options{Injection: cfg, NVML: lib, ProcRoot: t.TempDir(), Leases: leases})
	connect(t, p, rt)
	if ids := leases.IDs(); !cmp.Equal(ids, []string{"c1"}) {
		t.Errorf("leases after an empty resync = %v", ids)
	}
}

func TestCorruptLeasesAreNotDiscarded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "leases.json")
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := enforce.OpenLeases(path); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Errorf("corrupt leases: %v", err)
	}
}

// sm-sharing containers get a namespace of the node's MPS daemon, with
// their thread ceiling, before they start; their clients are drained at
// stop and the namespace is deleted at removal. A time-slicing container's
// clients (of the main socket) are found by cgroup and drained too. When
// the daemon is replaced, the running containers' namespaces come back
// and their pods are told.
func TestContainersAreClientsOfTheNodeMPSDaemon(t *testing.T) {
	root, m := startMPS(t)
	proc := enforcetest.Proc(t, map[int]string{7: "/kubepods/ts", 77: "/kubepods/ts", 88: "/kubepods/other"})
	rt := startRuntime(t, nil, nil)
	c := cfg
	c.MPSRoot, c.Backend = root, nodeapi.BackendMPSPinned
	rec := &recorder{}
	// The drains' MPS commands re-execute the test binary (mpstest): the
	// deadline leaves them room on a loaded machine; only the wedged
	// client below waits it out.
	p := New(Options{Injection: c, Reporter: rec, Evictor: rec, ProcRoot: proc, DrainTimeout: 3 * time.Second, MPS: m})
	connect(t, p, rt)
	ctx := context.Background()

	pod := sandbox("ps", "mps-tenant", smSharing)
	ctr := container("cs", "ps", "main")
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	name := nodeapi.NamespaceName(pod.GetUid(), "main")
	var source string
	for _, mt := range resp.GetAdjust().GetMounts() {
		if mt.Destination == nodeapi.ContainerPipeDir {
			source = mt.Source
		}
	}
	if source != nodeapi.NamespaceDir(root, name) {
		t.Errorf("MPS pipe directory mounted from %q, want the namespace's %q", source, nodeapi.NamespaceDir(root, name))
	}
	if _, err := os.Stat(filepath.Join(source, "control")); err != nil {
		t.Errorf("the namespace's socket is not there when the container starts: %v", err)
	}
	if got := mpstest.Ceiling(t, root, name); got != 25 {
		t.Errorf("namespace ceiling = %d, want 25", got)
	}

	tsPod := sandbox("pt", "ts-tenant", scheduled)
	tsCtr := container("ct", "pt", "main")
	tsCtr.Pid = 7
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: tsPod}); err != nil {
		t.Fatal(err)
	}
	if resp, err = rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: tsPod, Container: tsCtr}); err != nil {
		t.Fatal(err)
	}
	if mounts := resp.GetAdjust().GetMounts(); len(mounts) != 1 || mounts[0].Source != filepath.Join(nodeapi.PipeDir(root), "control") {
		t.Errorf("time-slicing mounts %v, want the main socket only", mounts)
	}

	// The daemon is replaced: its namespaces are gone until reconciled.
	st, _ := mps.ReadStatus(root)
	if err := syscall.Kill(st.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		s, _ := mps.ReadStatus(root)
		return s.Generation == 2 && s.Running && m.Control().Ping(ctx) == nil, nil
	}); err != nil {
		t.Fatal("no second daemon")
	}
	if got := mpstest.Ceiling(t, root, name); got != -1 {
		t.Fatalf("a new daemon kept namespace %s", name)
	}
	live := p.LiveNamespaces()
	p.ReconcileMPS(ctx, func(n string) bool { return live[n] })
	if got := mpstest.Ceiling(t, root, name); got != 25 {
		t.Errorf("after the restart the namespace's ceiling is %d, want 25", got)
	}
	// Their mounts name the old daemon's sockets: both pods are evicted,
	// and told why; a container created on the new daemon is not.
	st, _ = mps.ReadStatus(root)
	newPod := sandbox("pn", "new-tenant", scheduled)
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: newPod}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: newPod, Container: container("cn", "pn", "main")}); err != nil {
		t.Fatal(err)
	}
	rec.mu.Lock()
	rec.failEvictions = 1 // the first one is refused (as a disruption budget would), and retried
	rec.mu.Unlock()
	p.RetryEvictions(ctx, st.Started)
	p.WaitForEvictions()
	p.RetryEvictions(ctx, st.Started)
	p.WaitForEvictions()
	// (connect's probe pod is a fractional tenant too.)
	for _, pod := range []string{"mps-tenant", "ts-tenant", "probe"} {
		if got := rec.get(&rec.mpsRestarted); !slices.ContainsFunc(got, func(e string) bool { return strings.HasPrefix(e, pod+"/main: the node's MPS daemon started at") }) {
			t.Errorf("restart reports %v, want one for %s", got, pod)
		}
		if got := rec.get(&rec.evict); !slices.ContainsFunc(got, func(e string) bool {
			return strings.HasPrefix(e, pod+": the node's MPS daemon was replaced under it")
		}) {
			t.Errorf("evictions %v, want %s", got, pod)
		}
	}
	if got := rec.get(&rec.evict); len(got) != 3 {
		t.Errorf("evictions %v, want one per pod, and none of new-tenant", got)
	}
	if got := rec.get(&rec.mpsRestarted); len(got) != 3 {
		t.Errorf("restart reports %v, want one per pod", got)
	}
	// Evicted pods are not evicted again.
	p.RetryEvictions(ctx, st.Started)
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 3 {
		t.Errorf("evictions after another resync %v", got)
	}

	clients := filepath.Join(nodeapi.LogDir(root), "clients")
	if err := os.WriteFile(clients, []byte("101 gpufrac "+name+"\n77 gpufrac default\n88 gpufrac default\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.StopContainer(ctx, &nriapi.StopContainerRequest{Pod: pod, Container: ctr}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.StopContainer(ctx, &nriapi.StopContainerRequest{Pod: tsPod, Container: tsCtr}); err != nil {
		t.Fatal(err)
	}
	p.WaitForEvictions() // the drains run off the request
	if got, _ := os.ReadFile(clients); strings.TrimSpace(string(got)) != "88 gpufrac default" {
		t.Errorf("clients after both stops: %q, want only the other cgroup's 88", got)
	}
	ctr.State = nriapi.ContainerState_CONTAINER_STOPPED
	if err := p.RemoveContainer(ctx, pod, ctr); err != nil {
		t.Fatal(err)
	}
	if got := mpstest.Ceiling(t, root, name); got != -1 {
		t.Errorf("namespace %s still exists after the container's removal", name)
	}
	if got := m.List(); len(got) != 0 {
		t.Errorf("namespaces recorded after removal: %v", got)
	}

	// A client that never finishes terminating is a wedged shared server,
	// which the control daemon's own probe does not see: the plugin asks
	// for the daemon's replacement, and the supervisor does it.
	wedgedPod := sandbox("pw", "wedged", smSharing)
	wedgedCtr := container("cw", "pw", "main")
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: wedgedPod}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: wedgedPod, Container: wedgedCtr}); err != nil {
		t.Fatal(err)
	}
	st, _ = mps.ReadStatus(root)
	if err := os.WriteFile(clients, []byte("301 gpufrac "+nodeapi.NamespaceName(wedgedPod.GetUid(), "main")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(nodeapi.LogDir(root), "hang-terminate"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := rt.StopContainer(ctx, &nriapi.StopContainerRequest{Pod: wedgedPod, Container: wedgedCtr}); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("StopContainer took %s: the drain must not hold the NRI request", d)
	}
	p.WaitForEvictions()
	_ = os.Remove(filepath.Join(nodeapi.LogDir(root), "hang-terminate"))
	if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		s, _ := mps.ReadStatus(root)
		return s.Generation > st.Generation && strings.Contains(s.LastExit, "replaced at the node agent's request: MPS clients [301]"), nil
	}); err != nil {
		s, _ := mps.ReadStatus(root)
		t.Errorf("after a hanging termination the daemon was not replaced: %+v", s)
	}
}

// A daemon that does not answer refuses the sm-sharing container within
// the hook's budget, rather than starting it without its ceiling.
func TestSMSharingWithAnUnreachableDaemonIsRefused(t *testing.T) {
	mpstest.Use(t)
	root := mpstest.ShortRoot(t)
	m, err := mps.OpenManager(mps.Control{Binary: os.Args[0], Root: root, Protocol: nodeapi.MPSv3, Timeout: time.Second}, filepath.Join(root, "ns.json"))
	if err != nil {
		t.Fatal(err)
	}
	rt := startRuntime(t, nil, nil)
	c := cfg
	c.MPSRoot = root
	rec := &recorder{}
	p := New(Options{Injection: c, Reporter: rec, Evictor: rec, MPS: m})
	connect(t, p, rt)
	ctx := context.Background()
	pod := sandbox("pu", "unreachable", smSharing)
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	_, err = rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: container("cu", "pu", "main")})
	if err == nil || !strings.Contains(err.Error(), "MPS namespace "+nodeapi.NamespaceName(pod.GetUid(), "main")) {
		t.Errorf("sm-sharing with no daemon: %v, want a refusal naming the namespace", err)
	}
	if got := rec.get(&rec.refused); len(got) != 1 {
		t.Errorf("refusal Events %v", got)
	}
}

func TestSMSharingWithoutMPSIsRefused(t *testing.T) {
	rt := startRuntime(t, nil, nil)
	startPlugin(t, rt, Options{Injection: cfg})
	ctx := context.Background()
	pod := sandbox("ps", "mps-tenant", smSharing)
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	_, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: container("cs", "ps", "main")})
	if err == nil || !strings.Contains(err.Error(), "this node agent keeps none") {
		t.Errorf("sm-sharing without MPS: %v", err)
	}
}

// Failing open, a container whose limits are not in force is reported, not
// evicted.
func TestUnverifiedLimitsFailingOpenAreReportedNotEvicted(t *testing.T) {
	lib, _, uuids := enforcetest.NewMachine(1)
	proc := enforcetest.Proc(t, map[int]string{7: "/kubepods/x"})
	leases, err := enforce.OpenLeases(filepath.Join(t.TempDir(), "leases.json"))
	if err != nil {
		t.Fatal(err)
	}
	rt := startRuntime(t, nil, nil)
	rec := &recorder{}
	p := New(Options{Injection: cfg, FailOpen: true, Reporter: rec, Evictor: rec, NVML: lib, ProcRoot: proc, Leases: leases})
	connect(t, p, rt)
	ctx := context.Background()
	pod := sandbox("pu", "unverified", map[string]string{"nvidia.com/container.main.gpus.devices": uuids[0],
		"nvidia.com/container.main.gpu-memory.request": "1Gi"})
	ctr := container("cu", "pu", "main")
	ctr.Pid = 7
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr}); err != nil {
		t.Fatal(err)
	}
	if err := rt.PostStartContainer(ctx, &nriapi.PostStartContainerRequest{Pod: pod, Container: ctr}); err != nil {
		t.Fatal(err)
	}
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 0 {
		t.Errorf("evicted although the node fails open: %v", got)
	}
	if got := rec.get(&rec.unenforced); len(got) != 1 || !strings.HasPrefix(got[0], "unverified/main: GPU memory limits not in force") {
		t.Errorf("unenforced reports = %v", got)
	}
}

// A pod exactly as KAI Scheduler's binder leaves it — bare KAI keys, CDI
// device names, sm-sharing without a portion, the fraction on an init
// container — runs through the NRI protocol: the init container gets its
// share, with a portion derived from its memory share in its own MPS
// namespace and the Event saying so; the app container gets no GPU.
func TestKAIShapedPodRunsOverNRI(t *testing.T) {
	root, m := startMPS(t)
	rt := startRuntime(t, nil, nil)
	c := cfg
	c.Backend, c.MPSRoot, c.GPUMemoryMiB = nodeapi.BackendMPSPinned, root, 81920
	rec := &recorder{}
	p := New(Options{Injection: c, Reporter: rec, Evictor: rec, MPS: m})
	connect(t, p, rt)
	ctx := context.Background()

	pod := sandbox("pk", "kai", map[string]string{
		"gpu-fraction": "0.25", "gpu-fraction-container-name": "setup", "received-resource-type": "Fraction",
		"nvidia.com/container.setup.gpu-compute.mode":   "sm-sharing",
		"nvidia.com/container.setup.gpus.devices":       "k8s.device-plugin.nvidia.com/gpu=GPU-5d8f3b2a-1c4e-4f6a-9b7d-2e1f0a3c5b6d",
		"nvidia.com/container.setup.gpu-memory.request": "20Gi",
	})
	if err := rt.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod}); err != nil {
		t.Fatal(err)
	}
	initCtr := container("ck-init", "pk", "setup", "NVIDIA_VISIBLE_DEVICES=all")
	resp, err := rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: initCtr})
	if err != nil {
		t.Fatalf("init container refused: %v", err)
	}
	env := injection.ApplyEnv(initCtr.Env, resp.GetAdjust())
	for k, want := range map[string]string{
		"NVIDIA_VISIBLE_DEVICES":            "k8s.device-plugin.nvidia.com/gpu=GPU-5d8f3b2a-1c4e-4f6a-9b7d-2e1f0a3c5b6d",
		"NVIDIA_GPU_MEMORY_REQUEST":         "20480",
		"NVIDIA_GPU_MEMORY_LIMIT":           "20480",
		"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":  "0=20480M",
		"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
	} {
		if env[k] != want {
			t.Errorf("%s = %q, want %q", k, env[k], want)
		}
	}
	if got := mpstest.Ceiling(t, root, nodeapi.NamespaceName(pod.GetUid(), "setup")); got != 25 {
		t.Errorf("namespace ceiling = %d, want 25", got)
	}
	if got := rec.get(&rec.enforced); !slices.ContainsFunc(got, func(e string) bool {
		return strings.HasPrefix(e, "kai/setup: ") && strings.Contains(e, "derived 0.25 from the memory share")
	}) {
		t.Errorf("Events: %v, want kai/setup's saying the portion was derived", got)
	}
	app := container("ck-app", "pk", "main", "NVIDIA_VISIBLE_DEVICES=all")
	resp, err = rt.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: app})
	if err != nil {
		t.Fatal(err)
	}
	if env := injection.ApplyEnv(app.Env, resp.GetAdjust()); env["NVIDIA_VISIBLE_DEVICES"] != "void" {
		t.Errorf("the app container sees GPUs: %v", env)
	}
}

// A tenant keeps the GPU groups gpufrac's scheduler wrote, one per device,
// which the agent matches with its own group's reservation pod; another
// scheduler's decision (no groups, or not one per device) has none.
func TestTenantKeepsItsDecisionsGroups(t *testing.T) {
	d := injection.Decision{Assignment: &api.Assignment{Container: "main", Devices: []string{"GPU-a", "GPU-b"}}}
	for _, c := range []struct {
		groups string
		want   []string
	}{{"ga,gb", []string{"ga", "gb"}}, {"", nil}, {"ga", nil}} {
		ann := map[string]string{}
		if c.groups != "" {
			ann[api.GPUGroupsAnnotation] = c.groups
		}
		if got := tenantOf(sandbox("p", "pod", ann), d, "driver", StateEnforced, time.Time{}).Groups; !slices.Equal(got, c.want) {
			t.Errorf("groups %q: tenant's %v, want %v", c.groups, got, c.want)
		}
	}
}

// A resized pod (SPEC §7): its running containers are judged by what the
// driver holds them to, not by the memory in their environment (fixed
// when they were created, before the resize), and are resized in place;
// one the driver holds to nothing goes; one created after the resize (a
// restart) is created with the memory the pod has now.
func TestResizedPodsAreJudgedByTheDriverAndResizedInPlace(t *testing.T) {
	lib, drv, uuids := enforcetest.NewMachine(1)
	proc := enforcetest.Proc(t, map[int]string{201: "/kubepods/grown/ctr", 202: "/kubepods/bare/ctr"})
	grownCg, bareCg := enforcetest.CgroupFS+"/kubepods/grown/ctr", enforcetest.CgroupFS+"/kubepods/bare/ctr"
	placed := map[string]string{"nvidia.com/container.main.gpus.devices": uuids[0],
		"nvidia.com/container.main.gpu-memory.request": "1Gi", "nvidia.com/container.main.gpu-memory.limit": "1Gi"}
	createdEnv := []string{"NVIDIA_VISIBLE_DEVICES=" + uuids[0], "NVIDIA_GPU_MEMORY_REQUEST=1024", "NVIDIA_GPU_MEMORY_LIMIT=1024", "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps"}
	grown, bare := sandbox("pg", "grown", placed), sandbox("pb", "bare", placed)
	c1, c2 := container("c1", "pg", "main", createdEnv...), container("c2", "pb", "main", createdEnv...)
	c1.Pid, c2.Pid = 201, 202
	// The driver holds the grown pod's container to what it was created
	// with: the resize is granted, not applied yet. The bare one to nothing.
	if err := enforce.Apply(lib, grownCg, enforce.Limits{Devices: uuids, RequestMiB: 1024, LimitMiB: 1024}); err != nil {
		t.Fatal(err)
	}
	now := api.Memory{RequestMiB: 2048, LimitMiB: 3072}
	resized := func(_, name, _ string) (string, api.Memory, bool) {
		return "main", now, name == "grown" || name == "bare"
	}
	rt := startRuntime(t, []*nriapi.PodSandbox{grown, bare}, []*nriapi.Container{c1, c2})
	rec := &recorder{}
	p := startPlugin(t, rt, Options{Injection: cfg, Reporter: rec, Evictor: rec, NVML: lib, ProcRoot: proc, Resized: resized})
	p.WaitForEvictions()
	if got := rec.get(&rec.evict); len(got) != 1 || !strings.HasPrefix(got[0], "bare: a resized container's GPU memory limits are not in force: GPU "+uuids[0]+": cgroup "+bareCg+" has no memory limits") {
		t.Fatalf("evictions = %v, want the bare pod's only", got)
	}
	held, err := p.Resize("uid-pg", "main", now)
	if err != nil || !held {
		t.Fatalf("Resize: %v %v", held, err)
	}
	if got := drv.Get(uuids[0], grownCg); got.SoftLimit != 2048<<20 || got.HardLimit != 3072<<20 {
		t.Errorf("the driver holds %+v after the resize, want soft 2Gi, hard 3Gi", got)
	}
	if held, err := p.Resize("uid-pg", "main", now); err != nil || !held {
		t.Errorf("a second Resize to the same memory: %v %v", held, err)
	}

	// The container restarts: created with the memory the pod has now.
	resp, err := rt.CreateContainer(context.Background(), &nriapi.CreateContainerRequest{Pod: grown, Container: container("c3", "pg", "main")})
	if err != nil {
		t.Fatal(err)
	}
	env := injection.ApplyEnv(nil, resp.GetAdjust())
	if env["NVIDIA_GPU_MEMORY_REQUEST"] != "2048" || env["NVIDIA_GPU_MEMORY_LIMIT"] != "3072" {
		t.Errorf("a container created after the resize sees request %s, limit %s; want 2048, 3072", env["NVIDIA_GPU_MEMORY_REQUEST"], env["NVIDIA_GPU_MEMORY_LIMIT"])
	}
}
