package usage

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/google/go-cmp/cmp"

	"github.com/gpufrac/gpufrac/pkg/api"
)

func id(n int) string { return fmt.Sprintf("%064x", n) }

func TestContainerIDFromCgroup(t *testing.T) {
	for _, tt := range []struct {
		name, content, want string
	}{
		{"systemd driver, cgroup v2", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-" + id(1) + ".scope\n", id(1)},
		{"cgroupfs, read from another cgroup namespace", "0::/../kubepods/besteffort/pod5678/" + id(2) + "\n", id(2)},
		{"CRI-O", "0::/kubepods.slice/kubepods-pod9.slice/crio-" + id(3) + ".scope\n", id(3)},
		{"Docker", "0::/system.slice/docker-" + id(4) + ".scope\n", id(4)},
		{"hybrid: the unified line wins", "12:memory:/kubepods/pod1/" + id(5) + "\n0::/kubepods/pod1/" + id(6) + "\n", id(6)},
		{"cgroup v1 only", "12:memory:/kubepods/pod1/" + id(7) + "\n11:pids:/kubepods/pod1/" + id(7) + "\n", id(7)},
		{"crun's container sub-cgroup under the scope", "0::/kubepods.slice/kubepods-pod1.slice/crio-" + id(10) + ".scope/container\n", id(10)},
		{"a workload's own sub-cgroup", "0::/kubepods/pod1/" + id(11) + "/workers/w1\n", id(11)},
		{"a host service", "0::/system.slice/sshd.service\n", ""},
		{"the pod's cgroup itself", "0::/kubepods/besteffort/pod" + id(8)[:32] + "\n", ""},
		{"a longer hex name is no ID", "0::/x/" + id(9) + "a\n", ""},
		{"empty", "", ""},
	} {
		if got := ContainerID(tt.content); got != tt.want {
			t.Errorf("%s: ContainerID = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func FuzzContainerID(f *testing.F) {
	f.Add("0::/kubepods/pod1/" + id(1) + "\n")
	f.Add("12:memory:/a/cri-containerd-" + id(2) + ".scope")
	f.Add(":::\n::")
	hex64 := regexp.MustCompile(`^[0-9a-f]{64}$`)
	f.Fuzz(func(t *testing.T, content string) {
		got := ContainerID(content)
		if got != "" && (!hex64.MatchString(got) || !strings.Contains(content, got)) {
			t.Fatalf("ContainerID(%q) = %q: not an ID the content holds", content, got)
		}
	})
}

// proc writes a /proc with a cgroup file per PID.
func proc(t testing.TB, cgroups map[uint32]string) string {
	t.Helper()
	root := t.TempDir()
	for pid, content := range cgroups {
		dir := filepath.Join(root, fmt.Sprint(pid))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// gpu is a mock GPU whose processes, MPS clients and samples a test sets.
type gpu struct {
	compute, clients []nvml.ProcessInfo
	samples          []nvml.ProcessUtilizationSample
	computeRet       nvml.Return
	clientsRet       nvml.Return
	samplesRet       nvml.Return
	lastSeen         []uint64
}

func machine(gpus map[string]*gpu) *mock.Interface {
	devs := map[string]*mock.Device{}
	for uuid, g := range gpus {
		devs[uuid] = &mock.Device{
			GetMemoryInfoFunc:       func() (nvml.Memory, nvml.Return) { return nvml.Memory{Used: 5 << 30}, nvml.SUCCESS },
			GetUtilizationRatesFunc: func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 40}, nvml.SUCCESS },
			GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
				return g.compute, g.computeRet
			},
			GetMPSComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
				return g.clients, g.clientsRet
			},
			GetProcessUtilizationFunc: func(last uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
				g.lastSeen = append(g.lastSeen, last)
				var out []nvml.ProcessUtilizationSample
				for _, s := range g.samples {
					if s.TimeStamp > last {
						out = append(out, s)
					}
				}
				if g.samplesRet == nvml.SUCCESS && len(out) == 0 {
					return nil, nvml.ERROR_NOT_FOUND
				}
				return out, g.samplesRet
			},
		}
	}
	return &mock.Interface{
		InitFunc:     func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc: func() nvml.Return { return nvml.SUCCESS },
		DeviceGetHandleByUUIDFunc: func(uuid string) (nvml.Device, nvml.Return) {
			if d, ok := devs[uuid]; ok {
				return d, nvml.SUCCESS
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
	}
}

// Two containers' processes on one GPU, each under its own pod; the MPS
// server's, a host process's and an exited PID's are nobody's, and the
// exited one is not counted at all.
func TestSamplerJoinsProcessesToContainers(t *testing.T) {
	const g0 = "GPU-0"
	root := proc(t, map[uint32]string{
		101: "0::/../kubepods/pod-a/" + id(1) + "\n",
		103: "0::/../kubepods/pod-a/" + id(1) + "\n",
		102: "0::/kubepods.slice/cri-containerd-" + id(2) + ".scope\n",
		200: "0::/system.slice/nvidia-mps.service\n",
		// 300 has exited: NVML still lists it.
	})
	g := &gpu{
		compute: []nvml.ProcessInfo{{Pid: 200, UsedGpuMemory: 500 << 20}, {Pid: 300, UsedGpuMemory: 7 << 30}},
		clients: []nvml.ProcessInfo{{Pid: 101, UsedGpuMemory: 1 << 30}, {Pid: 103, UsedGpuMemory: 256 << 20}, {Pid: 102, UsedGpuMemory: 3 << 30}},
		samples: []nvml.ProcessUtilizationSample{{Pid: 101, TimeStamp: 10, SmUtil: 30}, {Pid: 101, TimeStamp: 20, SmUtil: 50},
			{Pid: 102, TimeStamp: 20, SmUtil: 5}},
	}
	s := &Sampler{Lib: machine(map[string]*gpu{g0: g}), ProcRoot: root}
	a := Tenant{ID: id(1), Namespace: "ml", Pod: "a", Container: "main", Devices: []string{g0}, RequestMiB: 4096, LimitMiB: 8192}
	b := Tenant{ID: id(2), Namespace: "ml", Pod: "b", Container: "main", Devices: []string{g0}, RequestMiB: 4096, LimitMiB: 4096}
	c := Tenant{ID: id(3), Namespace: "web", Pod: "c", Container: "side", Devices: []string{g0}}
	m := s.Measure([]Tenant{a, b, c}, []string{g0}, time.Unix(100, 0))
	want := []Container{
		{Tenant: a, GPU: g0, MemoryBytes: Known(1<<30 + 256<<20), SMPercent: Known(40), Processes: 2},
		{Tenant: b, GPU: g0, MemoryBytes: Known(3 << 30), SMPercent: Known(5), Processes: 1},
		{Tenant: c, GPU: g0, MemoryBytes: Known(0), SMPercent: Known(0)},
	}
	if diff := cmp.Diff(want, m.Containers); diff != "" {
		t.Errorf("containers (-want +got):\n%s", diff)
	}
	wantGPU := []GPU{{UUID: g0, MemoryBytes: Known(5 << 30), UnattributedBytes: Known(500 << 20), SMPercent: Known(40), PerProcessMemory: true, PerProcessSM: true}}
	if diff := cmp.Diff(wantGPU, m.GPUs); diff != "" {
		t.Errorf("GPUs (-want +got):\n%s", diff)
	}
	// The next reading asks only for samples after the newest seen, and
	// with none, every process was idle: 0 %, not unknown.
	m = s.Measure([]Tenant{a}, []string{g0}, time.Unix(130, 0))
	if last := g.lastSeen[len(g.lastSeen)-1]; last != 20 {
		t.Errorf("asked for samples after %d, want 20", last)
	}
	if got := m.Containers[0].SMPercent; got != Known(0) {
		t.Errorf("SM with no new sample = %+v, want a known 0", got)
	}
}

// Processes lists what Measure joins, one line per process: `gpufrac
// usage`'s view.
func TestProcessesListsEveryProcessWithItsContainer(t *testing.T) {
	root := proc(t, map[uint32]string{101: "0::/kubepods/pod-a/" + id(1) + "\n", 200: "0::/system.slice/x.service\n"})
	g := &gpu{compute: []nvml.ProcessInfo{{Pid: 200, UsedGpuMemory: 1 << 20}, {Pid: 300, UsedGpuMemory: 2 << 20}},
		clients: []nvml.ProcessInfo{{Pid: 101, UsedGpuMemory: 3 << 30}},
		samples: []nvml.ProcessUtilizationSample{{Pid: 101, TimeStamp: 5, SmUtil: 60}}}
	got, err := (&Sampler{Lib: machine(map[string]*gpu{"GPU-0": g}), ProcRoot: root}).Processes([]string{"GPU-0"})
	if err != nil {
		t.Fatal(err)
	}
	sm := func(v int64) *int64 { return &v }
	mem := func(v uint64) *uint64 { return &v }
	want := []Process{
		{GPU: "GPU-0", PID: 101, MemoryBytes: mem(3 << 30), SMPercent: sm(60), MPSClient: true, Container: id(1)},
		{GPU: "GPU-0", PID: 200, MemoryBytes: mem(1 << 20), SMPercent: sm(0)},
		{GPU: "GPU-0", PID: 300, MemoryBytes: mem(2 << 20), SMPercent: sm(0), Exited: true},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("processes (-want +got):\n%s", diff)
	}
	if _, err := (&Sampler{}).Processes(nil); err == nil {
		t.Error("no library: no error")
	}
}

// What the driver lists without a figure stays unknown: a process whose
// memory is NVML_VALUE_NOT_AVAILABLE, and MPS clients' SM where the
// driver's samples name only the server.
func TestFiguresTheDriverDoesNotGiveAreUnknown(t *testing.T) {
	root := proc(t, map[uint32]string{
		101: "0::/kubepods/pod-a/" + id(1) + "\n",
		102: "0::/kubepods/pod-b/" + id(2) + "\n",
		500: "0::/system.slice/nvidia-mps.service\n",
	})
	g := &gpu{
		compute: []nvml.ProcessInfo{{Pid: 500, UsedGpuMemory: 300 << 20}},
		clients: []nvml.ProcessInfo{{Pid: 101, UsedGpuMemory: ^uint64(0)}, {Pid: 102, UsedGpuMemory: 1 << 30}},
		samples: []nvml.ProcessUtilizationSample{{Pid: 500, TimeStamp: 9, SmUtil: 70}},
	}
	s := &Sampler{Lib: machine(map[string]*gpu{"GPU-0": g}), ProcRoot: root}
	a := Tenant{ID: id(1), Namespace: "ml", Pod: "a", Container: "main", Devices: []string{"GPU-0"}}
	b := Tenant{ID: id(2), Namespace: "ml", Pod: "b", Container: "main", Devices: []string{"GPU-0"}}
	m := s.Measure([]Tenant{a, b}, []string{"GPU-0"}, time.Unix(1, 0))
	if c := m.Containers[0]; c.MemoryBytes.Known {
		t.Errorf("a's memory %+v: NOT_AVAILABLE read as a figure", c.MemoryBytes)
	}
	if c := m.Containers[1]; c.MemoryBytes != Known(1<<30) || c.SMPercent.Known {
		t.Errorf("b: memory %+v (want 1Gi), SM %+v (want unknown: the samples name only the MPS server)", c.MemoryBytes, c.SMPercent)
	}
	if gpu := m.GPUs[0]; gpu.PerProcessSM || gpu.UnattributedBytes != Known(300<<20) {
		t.Errorf("GPU: per-process SM %v (want false), unattributed %+v", gpu.PerProcessSM, gpu.UnattributedBytes)
	}
}

// A driver that lists no processes or samples leaves the figures
// unknown: never zero.
func TestUnreadableFiguresAreUnknown(t *testing.T) {
	const g0 = "GPU-0"
	g := &gpu{computeRet: nvml.ERROR_NOT_SUPPORTED, clientsRet: nvml.ERROR_NOT_SUPPORTED, samplesRet: nvml.ERROR_NOT_SUPPORTED}
	s := &Sampler{Lib: machine(map[string]*gpu{g0: g}), ProcRoot: proc(t, nil)}
	a := Tenant{ID: id(1), Namespace: "ml", Pod: "a", Container: "main", Devices: []string{g0}}
	m := s.Measure([]Tenant{a}, []string{g0}, time.Unix(100, 0))
	if c := m.Containers[0]; c.MemoryBytes.Known || c.SMPercent.Known {
		t.Errorf("container figures %+v: want unknown", c)
	}
	if g := m.GPUs[0]; g.UnattributedBytes.Known || g.PerProcessMemory || g.PerProcessSM {
		t.Errorf("GPU %+v: want per-process figures unknown", g)
	}
	// No library at all: everything unknown, every tenant still listed.
	m = (&Sampler{}).Measure([]Tenant{a}, []string{g0}, time.Unix(100, 0))
	if len(m.Containers) != 1 || m.Containers[0].MemoryBytes.Known || m.GPUs[0].MemoryBytes.Known {
		t.Errorf("without NVML: %+v", m)
	}
	w := NewWindow(time.Hour)
	w.Add(m)
	if u := w.Summary(); len(u.Pods) != 1 || u.Pods[0].UsedMiB != nil || u.Pods[0].P95MiB != nil {
		t.Errorf("summary of unknown figures: %+v", u.Pods)
	}
}

func reading(at time.Time, mib ...int64) Measurement {
	m := Measurement{At: at}
	for i, v := range mib {
		m.Containers = append(m.Containers, Container{Tenant: Tenant{Namespace: "ml", Pod: fmt.Sprint("p", i), Container: "main"}, GPU: "GPU-0",
			MemoryBytes: Known(v << 20), SMPercent: Known(v % 100)})
	}
	return m
}

func TestWindowKeepsTheSpanAndSummarises(t *testing.T) {
	w := NewWindow(10 * time.Minute)
	start := time.Unix(1000, 0)
	// 30 readings, 30 s apart: the first ten fall out of the window.
	for i := range 30 {
		w.Add(reading(start.Add(time.Duration(i)*30*time.Second), int64(100+i), 7))
	}
	u := w.Summary()
	if len(u.Pods) != 2 || u.WindowSeconds != 600 {
		t.Fatalf("summary: %+v", u)
	}
	p := u.Pods[0]
	// Readings 10..29 remain (the 9th is exactly 10 min old, and out):
	// 110..129, whose nearest-rank p95 is the 19th, 128.
	if p.Samples != 20 || *p.UsedMiB != 129 || *p.MaxMiB != 129 || *p.P95MiB != 128 || p.SpanSeconds != 570 {
		t.Errorf("pod p0: samples %d used %d max %d p95 %d span %d", p.Samples, *p.UsedMiB, *p.MaxMiB, *p.P95MiB, p.SpanSeconds)
	}
	// A pod no longer measured is forgotten.
	w.Add(reading(start.Add(30*30*time.Second), 5))
	if u := w.Summary(); len(u.Pods) != 1 || u.Pods[0].Pod != "ml/p0" {
		t.Errorf("after p1 went: %+v", u.Pods)
	}
}

func TestPercentile(t *testing.T) {
	for _, tt := range []struct {
		values []int64
		p      int
		want   int64
	}{
		{[]int64{5}, 95, 5},
		{[]int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 95, 10},
		{[]int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 50, 5},
		{[]int64{10, 1}, 0, 1},
	} {
		if got := Percentile(tt.values, tt.p); got != tt.want {
			t.Errorf("Percentile(%v, %d) = %d, want %d", tt.values, tt.p, got, tt.want)
		}
	}
}

// The model is a function of the tenant and the time; its loads are what
// their names say, and readings a resync apart differ.
func TestModelLoads(t *testing.T) {
	at := time.Unix(1_800_000_000, 0)
	tenant := func(load string) Tenant {
		return Tenant{Namespace: "ml", Pod: load, Container: "main", Devices: []string{"GPU-0"}, RequestMiB: 10240, LimitMiB: 20480, Load: load}
	}
	for _, tt := range []struct {
		load           string
		lowMiB, highMB int64
		smLow, smHigh  int64
	}{
		{LoadIdle, 300, 520, 0, 0},
		{LoadSteady, 4500, 6300, 29, 41},
		{LoadBusy, 9000, 10240, 80, 95},
		{LoadBursty, 3400, 20480, 9, 91},
	} {
		for i := range 40 {
			now := at.Add(time.Duration(i) * 17 * time.Second)
			c := Model{}.Measure([]Tenant{tenant(tt.load)}, []string{"GPU-0"}, now).Containers[0]
			if mib := c.MemoryBytes.Value >> 20; mib < tt.lowMiB || mib > tt.highMB || c.SMPercent.Value < tt.smLow || c.SMPercent.Value > tt.smHigh {
				t.Errorf("%s at %s: %d MiB, SM %d%%; want %d..%d MiB, %d..%d%%", tt.load, now, mib, c.SMPercent.Value, tt.lowMiB, tt.highMB, tt.smLow, tt.smHigh)
			}
		}
		a := Model{}.Measure([]Tenant{tenant(tt.load)}, nil, at)
		b := Model{}.Measure([]Tenant{tenant(tt.load)}, nil, at)
		c := Model{}.Measure([]Tenant{tenant(tt.load)}, nil, at.Add(30*time.Second))
		if !cmp.Equal(a, b) {
			t.Errorf("%s: the model is not deterministic", tt.load)
		}
		if cmp.Equal(a.Containers[0].MemoryBytes, c.Containers[0].MemoryBytes) {
			t.Errorf("%s: readings 30 s apart are equal", tt.load)
		}
	}
	// Without an annotation, the pod's name picks a load, always the same.
	if a, b := LoadOf(Tenant{Namespace: "x", Pod: "y"}), LoadOf(Tenant{Namespace: "x", Pod: "y", Load: "unknown"}); a != b || a == "" {
		t.Errorf("LoadOf: %q, %q", a, b)
	}
}

// BenchmarkMeasure is one reading of a node's fractional containers,
// eight per GPU, each with one process: NVML's calls (the mock's, so the
// figure is the agent's own work, not the driver's), a /proc/<pid>/cgroup
// read per process, the window's percentiles and the Node annotation. 64
// containers is the figure; 8 the baseline it scales from.
func BenchmarkMeasure(b *testing.B) {
	for _, containers := range []int{8, 64} {
		b.Run(fmt.Sprintf("containers=%d", containers), func(b *testing.B) { benchmarkMeasure(b, containers) })
	}
}

func benchmarkMeasure(b *testing.B, containers int) {
	cgroups := map[uint32]string{}
	gpus := map[string]*gpu{}
	var uuids []string
	var tenants []Tenant
	for n := range containers {
		uuid := fmt.Sprintf("GPU-%d", n/8)
		state := gpus[uuid]
		if state == nil {
			state = &gpu{}
			gpus[uuid] = state
			uuids = append(uuids, uuid)
		}
		pid := uint32(1000 + n)
		cgroups[pid] = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + fmt.Sprint(n) + ".slice/cri-containerd-" + id(n) + ".scope\n"
		state.clients = append(state.clients, nvml.ProcessInfo{Pid: pid, UsedGpuMemory: uint64(n) << 24})
		state.samples = append(state.samples, nvml.ProcessUtilizationSample{Pid: pid, TimeStamp: uint64(n + 1), SmUtil: 10})
		tenants = append(tenants, Tenant{ID: id(n), UID: fmt.Sprint("uid-", n), Namespace: "ml", Pod: fmt.Sprint("p", n), Container: "main",
			Devices: []string{uuid}, RequestMiB: 4096, LimitMiB: 8192})
	}
	s := &Sampler{Lib: machine(gpus), ProcRoot: proc(b, cgroups)}
	w := NewWindow(time.Hour)
	at := time.Unix(0, 0)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		s.lastSeen = nil // every sample is new, as in a fresh period
		w.Add(s.Measure(tenants, uuids, at.Add(time.Duration(i)*30*time.Second)))
		if _, err := api.UsageWrite(w.Summary()); err != nil {
			b.Fatal(err)
		}
	}
}
