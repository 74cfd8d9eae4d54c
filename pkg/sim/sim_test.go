package sim

import (
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
	seeded := func(seed int64) []PodSpec { return Workload(pods, rand.New(rand.NewSource(seed)), 1.3, capacity) }
	a, b, c := seeded(42), seeded(42), seeded(43)
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
