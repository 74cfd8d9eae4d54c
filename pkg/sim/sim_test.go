package sim

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

const traceDir = "../../../shared/traces/alibaba-gpu-v2023"

func load(t *testing.T) ([]NodeSpec, []PodSpec) {
	t.Helper()
	open := func(name string) *os.File {
		f, err := os.Open(filepath.Join(traceDir, name))
		if err != nil {
			t.Fatalf("the Alibaba trace is expected beside the repository (../shared/traces): %v", err)
		}
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	nodes, err := LoadNodes(open("openb_node_list_gpu_node.csv"), "nodes")
	if err != nil {
		t.Fatal(err)
	}
	pods, err := LoadPods(open("openb_pod_list_default.csv"), "pods")
	if err != nil {
		t.Fatal(err)
	}
	return nodes, pods
}

func TestTheTraceLoadsAsTheStudyDescribes(t *testing.T) {
	nodes, pods := load(t)
	cluster := Cluster(nodes)
	gpus := 0
	for _, n := range cluster {
		gpus += len(n.Devices)
	}
	if len(cluster) != 1213 || gpus != 6212 {
		t.Errorf("%d GPU nodes with %d GPUs, want 1213 and 6212", len(cluster), gpus)
	}
	if len(pods) != 8152 {
		t.Errorf("%d pods, want 8152", len(pods))
	}
}

func TestWorkloadIsSeededAndPaddedToTune(t *testing.T) {
	_, pods := load(t)
	const capacity = 6212 * MilliGPU
	a, b, c := Workload(pods, 42, 1.3, capacity), Workload(pods, 42, 1.3, capacity), Workload(pods, 43, 1.3, capacity)
	if len(a) != len(b) || a[0].Name != b[0].Name || a[len(a)-1].Name != b[len(b)-1].Name {
		t.Error("the same seed gave different workloads")
	}
	if a[0].Name == c[0].Name && a[1].Name == c[1].Name && a[2].Name == c[2].Name {
		t.Error("different seeds gave the same order")
	}
	var total int64
	for _, p := range a {
		total += p.GPURequest()
	}
	limit := int64(1.3 * capacity)
	if total > limit || total < limit-8*MilliGPU {
		t.Errorf("total GPU request %d, want just under %d", total, limit)
	}
	if len(a) <= len(pods) {
		t.Errorf("workload of %d pods was not padded beyond the trace's %d", len(a), len(pods))
	}
}

func TestPopularShapesCoverAndRenormalise(t *testing.T) {
	pods := []PodSpec{
		{CPUMilli: 4000, NumGPU: 1, GPUMilli: 500}, {CPUMilli: 4000, NumGPU: 1, GPUMilli: 500}, {CPUMilli: 4000, NumGPU: 1, GPUMilli: 500},
		{CPUMilli: 8000, NumGPU: 2, GPUMilli: 1000}, {CPUMilli: 8000, NumGPU: 2, GPUMilli: 1000},
		{CPUMilli: 1000, NumGPU: 1, GPUMilli: 1000, GPUSpec: []string{"T4"}},
		{CPUMilli: 2000}, // CPU-only: left out
	}
	shapes := PopularShapes(pods, 0.8)
	if len(shapes) != 2 || shapes[0].GPUMilli != 500 || shapes[1].NumGPU != 2 {
		t.Fatalf("shapes = %+v", shapes)
	}
	if math.Abs(shapes[0].P-0.6) > 1e-9 || math.Abs(shapes[1].P-0.4) > 1e-9 {
		t.Errorf("P = %v, %v; want 0.6, 0.4 after renormalising", shapes[0].P, shapes[1].P)
	}
	if all := PopularShapes(pods, 1); len(all) != 3 {
		t.Errorf("full coverage kept %d shapes", len(all))
	}
}

func TestFragmentation(t *testing.T) {
	n := Cluster([]NodeSpec{{Name: "n", CPUMilli: 32000, MemoryMiB: 1 << 18, GPUs: 4, Model: "T4"}})[0]
	share := func(tenant string, milli int64, dev int) {
		t.Helper()
		r := gpu.Request{Tenant: tenant, Devices: 1, Share: gpu.Share{Request: milli, Limit: milli, Mode: api.TimeSlicing}}
		if err := n.Assign(r, []int{dev}); err != nil {
			t.Fatal(err)
		}
	}
	share("a", 700, 0) // GPU 0: 300 free
	share("b", 200, 1) // GPU 1: 800 free; GPUs 2, 3: 1000 free each
	half := Shape{CPUMilli: 1000, NumGPU: 1, GPUMilli: 500, P: 0.5}
	two := Shape{CPUMilli: 1000, NumGPU: 2, GPUMilli: 1000, P: 0.25}
	v100 := Shape{CPUMilli: 1000, NumGPU: 1, GPUMilli: 1000, GPUSpec: []string{"V100M32"}, P: 0.25}
	// half fits; only GPU 0's 300 is too small for it: 0.5 × 300.
	// two fits (GPUs 2 and 3); GPUs 0 and 1 are too small: 0.25 × 1100.
	// v100 cannot run on T4s: all 3100 idle: 0.25 × 3100.
	want := 0.5*300 + 0.25*1100 + 0.25*3100
	if got := Fragmentation(n, []Shape{half, two, v100}); math.Abs(got-want) > 1e-9 {
		t.Errorf("Fragmentation = %v, want %v", got, want)
	}
	// Out of CPU: nothing fits, everything idle is fragment.
	cpuHog := Shape{CPUMilli: 40000, NumGPU: 1, GPUMilli: 100, P: 1}
	if got := Fragmentation(n, []Shape{cpuHog}); got != 3100 {
		t.Errorf("Fragmentation without CPU = %v, want 3100", got)
	}
}

func TestBadCSVsNameTheProblem(t *testing.T) {
	_, err := LoadNodes(strings.NewReader("sn,cpu_milli,memory_mib,gpu,model\nn1,lots,1,1,T4\n"), "nodes.csv")
	if err == nil || !strings.Contains(err.Error(), `nodes.csv:2: cpu_milli "lots" must be a non-negative whole number`) {
		t.Errorf("bad number: %v", err)
	}
	if _, err := LoadPods(strings.NewReader("name,cpu_milli\np,1\n"), "pods.csv"); err == nil || !strings.Contains(err.Error(), `no "memory_mib" column`) {
		t.Errorf("missing column: %v", err)
	}
	if _, err := LoadPods(strings.NewReader("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np,1,1,1,1500,\n"), "pods.csv"); err == nil {
		t.Error("gpu_milli above 1000 accepted")
	}
}
