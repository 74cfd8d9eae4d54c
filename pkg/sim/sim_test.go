package sim

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// traceDir is the trace as the repository carries it (its README says
// where each file comes from and on what terms).
const traceDir = "../../traces/alibaba-gpu-v2023"

func load(t testing.TB) ([]NodeSpec, []PodSpec) { return loadTrace(t, "default") }

// loadTrace reads a trace of the repository's, or a mix derived from one
// as gpufrac sim --variant derives it when named like default+multigpu50.
func loadTrace(t testing.TB, trace string) ([]NodeSpec, []PodSpec) {
	t.Helper()
	trace, variant, derived := strings.Cut(trace, "+")
	open := func(name string) *os.File {
		f, err := os.Open(filepath.Join(traceDir, name))
		if err != nil {
			t.Fatalf("the Alibaba trace is part of the repository (traces/alibaba-gpu-v2023): %v", err)
		}
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	nodes, err := LoadNodes(open("openb_node_list_gpu_node.csv"), "nodes")
	if err != nil {
		t.Fatal(err)
	}
	pods, err := LoadPods(open("openb_pod_list_"+trace+".csv"), trace)
	if err != nil {
		t.Fatal(err)
	}
	if derived {
		v, err := VariantNamed(variant)
		if err != nil {
			t.Fatal(err)
		}
		if pods, err = v.Derive(pods, VariantSeed); err != nil {
			t.Fatal(err)
		}
	}
	return nodes, pods
}

// TestTraceFilesMatchTheirChecksums keeps the data the figures are measured
// on byte-for-byte the upstream files: every CSV in the folder is listed in
// SHA256SUMS and hashes to its entry.
func TestTraceFilesMatchTheirChecksums(t *testing.T) {
	sums, err := os.Open(filepath.Join(traceDir, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sums.Close() }()
	want := map[string]string{}
	lines := bufio.NewScanner(sums)
	for lines.Scan() {
		sum, name, ok := strings.Cut(lines.Text(), "  ")
		if !ok {
			t.Fatalf("SHA256SUMS: line %q is not \"<sha256>  <file>\"", lines.Text())
		}
		want[name] = sum
	}
	if err := lines.Err(); err != nil {
		t.Fatal(err)
	}
	err = filepath.WalkDir(traceDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(path) != ".csv" {
			return err
		}
		name, _ := filepath.Rel(traceDir, path)
		if _, listed := want[filepath.ToSlash(name)]; !listed {
			t.Errorf("%s is not in SHA256SUMS", name)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for name, sum := range want {
		data, err := os.ReadFile(filepath.Join(traceDir, name))
		if err != nil {
			t.Errorf("SHA256SUMS lists %s: %v", name, err)
			continue
		}
		if got := sha256.Sum256(data); hex.EncodeToString(got[:]) != sum {
			t.Errorf("%s: sha256 %x, SHA256SUMS says %s", name, got, sum)
		}
	}
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

func TestPodsWithoutGPUSpecAndInconsistentRows(t *testing.T) {
	pods, err := LoadPods(strings.NewReader("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,4000,100,2,1000\np2,1000,1,0,0\n"), "multigpu.csv")
	if err != nil || len(pods) != 2 || pods[0].GPURequest() != 2000 || pods[0].GPUSpec != nil {
		t.Fatalf("pods = %+v, %v", pods, err)
	}
	for row, want := range map[string]string{
		"p,1,1,2,500,":  "num_gpu 2 with gpu_milli 500: a pod of several GPUs must take them whole",
		"p,1,1,1,0,":    "num_gpu 1 with gpu_milli 0: both must be 0 or both positive",
		"p,1,1,0,300,":  "num_gpu 0 with gpu_milli 300",
		"p,1,1,1,1500,": "gpu_milli 1500 must be at most 1000",
	} {
		_, err := LoadPods(strings.NewReader("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"+row+"\n"), "pods.csv")
		if err == nil || !strings.Contains(err.Error(), "pods.csv:2: "+want) {
			t.Errorf("%s: err = %v, want %q", row, err, want)
		}
	}
}

func TestWorkloadThinsATraceAboveTune(t *testing.T) {
	_, pods := load(t)
	const capacity = 6212 * MilliGPU
	w := Workload(pods, rand.New(rand.NewSource(42)), 0.5, capacity)
	var total int64
	for _, p := range w {
		total += p.GPURequest()
	}
	if total > capacity/2 || total < capacity/2-8*MilliGPU || len(w) >= len(pods) {
		t.Errorf("thinned to %d pods asking %d milli-GPU, want just under %d", len(w), total, capacity/2)
	}
}

func TestParseSeeds(t *testing.T) {
	for in, want := range map[string][]int64{"42": {42}, "42-44": {42, 43, 44}, "1,3-4,3": {1, 3, 4}} {
		got, err := ParseSeeds(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("ParseSeeds(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "x", "5-3", "-1", "1-"} {
		if _, err := ParseSeeds(bad); err == nil || !strings.Contains(err.Error(), "must be a whole number or a range") {
			t.Errorf("ParseSeeds(%q) err = %v", bad, err)
		}
	}
}

func TestDiscreteCurveAveragesEachRoundedPercent(t *testing.T) {
	r := Result{CapacityMilli: 1000, Samples: []Sample{
		{ArrivedMilli: 4, AllocMilli: 4, Frag: 100},       // 0.4% → 0
		{ArrivedMilli: 6, AllocMilli: 6, Frag: 200},       // 0.6% → 1
		{ArrivedMilli: 14, AllocMilli: 10, Frag: 300},     // 1.4% → 1
		{ArrivedMilli: 35, AllocMilli: 30, Frag: 400},     // 3.5% → 4 (half to even)
		{ArrivedMilli: 1300, AllocMilli: 950, Frag: 10.5}, // 130%
	}}
	c := r.Discrete(130)
	if !slices.Equal(c.Arrived[:5], []int{0, 1, 2, 3, 4}) {
		t.Fatalf("arrived = %v", c.Arrived[:6])
	}
	// Percent 2 has no sample: the study averages its neighbours 1 and 3
	// (3 has none), so the two samples of 1%.
	for pct, want := range map[int]float64{0: 0.4, 1: 0.8, 2: 0.8, 3: 3, 4: 3, 130: 95} {
		if got := c.At(c.Alloc, pct); got != want {
			t.Errorf("alloc at %d%% = %v, want %v", pct, got, want)
		}
	}
	if got, want := c.At(c.Frag, 1), 25.0; got != want {
		t.Errorf("frag at 1%% = %v, want %v (mean of 20%% and 30%%)", got, want)
	}
	if got, want := c.At(c.FragRate, 130), 21.0; got != want {
		t.Errorf("frag rate at 130%% = %v, want %v (10.5 of 50 idle)", got, want)
	}
	if !math.IsNaN(c.At(c.Alloc, 50)) {
		t.Error("a percent without samples nearby has a value")
	}
}

func TestRunIsSeededAndKeepsTheLedgerConsistent(t *testing.T) {
	nodes := []NodeSpec{{Name: "b", CPUMilli: 16000, MemoryMiB: 65536, GPUs: 2, Model: "T4"}, {Name: "a", CPUMilli: 64000, MemoryMiB: 65536, GPUs: 4, Model: "V100M32"}}
	pods := []PodSpec{
		{Name: "s1", CPUMilli: 2000, MemoryMiB: 100, NumGPU: 1, GPUMilli: 500},
		{Name: "s2", CPUMilli: 2000, MemoryMiB: 100, NumGPU: 1, GPUMilli: 300},
		{Name: "w2", CPUMilli: 8000, MemoryMiB: 100, NumGPU: 2, GPUMilli: 1000},
		{Name: "v", CPUMilli: 1000, MemoryMiB: 100, NumGPU: 1, GPUMilli: 1000, GPUSpec: []string{"V100M32"}},
		{Name: "c", CPUMilli: 6000, MemoryMiB: 100},
	}
	for _, policy := range []string{"gpufrac", "fgd", "bestfit", "gpupacking", "dotprod", "random"} {
		a, err := Run(nodes, pods, Config{Policy: policy, Seed: 7, Tune: 1.3}, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := Run(nodes, pods, Config{Policy: policy, Seed: 7, Tune: 1.3}, nil)
		if !slices.Equal(a.Samples, b.Samples) {
			t.Errorf("%s: the same seed gave different runs", policy)
		}
		last := a.Samples[len(a.Samples)-1]
		if last.AllocMilli > a.CapacityMilli || last.ArrivedMilli > int64(1.3*float64(a.CapacityMilli)) {
			t.Errorf("%s: allocated %d, arrived %d of capacity %d", policy, last.AllocMilli, last.ArrivedMilli, a.CapacityMilli)
		}
		if a.Unscheduled == 0 || a.Unscheduled == a.Pods {
			t.Errorf("%s: %d of %d pods unscheduled; at 130%% some must fail and some fit", policy, a.Unscheduled, a.Pods)
		}
	}
	if _, err := Run(nodes, pods, Config{Policy: "nope", Seed: 1, Tune: 1}, nil); err == nil {
		t.Error("an unknown policy ran")
	}
	if _, err := Run([]NodeSpec{{Name: "cpu", CPUMilli: 1000}}, pods, Config{Seed: 1, Tune: 1}, nil); err == nil {
		t.Error("a cluster without GPUs ran")
	}
}

// A Given run replays the list as it stands: every pod once, in order,
// whatever the seed or tune, so that a live run of the same list pairs
// with it.
func TestGivenOrderReplaysTheListAsListed(t *testing.T) {
	nodes := []NodeSpec{{Name: "b", CPUMilli: 16000, MemoryMiB: 65536, GPUs: 2, Model: "T4"}, {Name: "a", CPUMilli: 64000, MemoryMiB: 65536, GPUs: 4, Model: "V100M32"}}
	pods := []PodSpec{
		{Name: "z", CPUMilli: 8000, MemoryMiB: 100, NumGPU: 2, GPUMilli: 1000},
		{Name: "s1", CPUMilli: 2000, MemoryMiB: 100, NumGPU: 1, GPUMilli: 500},
		{Name: "c", CPUMilli: 6000, MemoryMiB: 100},
		{Name: "v", CPUMilli: 1000, MemoryMiB: 100, NumGPU: 1, GPUMilli: 1000, GPUSpec: []string{"V100M32"}},
		{Name: "s2", CPUMilli: 2000, MemoryMiB: 100, NumGPU: 1, GPUMilli: 300},
	}
	for _, policy := range []string{"gpufrac", "fgd", "bestfit"} {
		a, err := Run(nodes, pods, Config{Policy: policy, Seed: 1, Tune: 1.3, Given: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if a.Pods != len(pods) || len(a.Samples) != len(pods) || !a.Given || a.Tune != 0 {
			t.Fatalf("%s: %d pods, %d samples, given %v, tune %v; want the %d listed, given, no tune", policy, a.Pods, len(a.Samples), a.Given, a.Tune, len(pods))
		}
		var arrived int64
		for i, p := range pods {
			arrived += p.GPURequest()
			if a.Samples[i].ArrivedMilli != arrived {
				t.Fatalf("%s: after pod %d (%s) %d milli-GPU arrived, want %d: not the listed order", policy, i, p.Name, a.Samples[i].ArrivedMilli, arrived)
			}
		}
		b, err := Run(nodes, pods, Config{Policy: policy, Seed: 99, Tune: 0.5, Given: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(a.Samples, b.Samples) {
			t.Errorf("%s: another seed or tune changed a given-order run", policy)
		}
	}
}

func TestCurvesAndPublishedFigures(t *testing.T) {
	r := Result{Policy: "fgd", Seed: 42, CapacityMilli: 100, Samples: []Sample{{ArrivedMilli: 1, AllocMilli: 1, Frag: 2}}}
	var buf bytes.Buffer
	if err := WriteCurves(&buf, []Result{r}); err != nil {
		t.Fatal(err)
	}
	// One sample at 1%: 0% and 2% take it from their neighbour.
	want := "policy,seed,arrived_pct,alloc_pct,frag_amount_pct,frag_rate_pct\n" +
		"fgd,42,0,1.00,2.00,2.02\nfgd,42,1,1.00,2.00,2.02\nfgd,42,2,1.00,2.00,2.02\n"
	if got := buf.String(); got != want {
		t.Errorf("curves.csv =\n%s\nwant\n%s", got, want)
	}
	table := "workload,sc_policy,tune,seed,total_gpus,0,1,130\nw,06-FGD,1.3,42,10,0.1,1.0,90\nw,06-FGD,1.3,43,10,0.3,1.0,92\nother,06-FGD,1.3,42,10,5,5,5\n"
	p, err := LoadPublished(strings.NewReader(table), "w")
	if err != nil || p["06-FGD"][130] != 91 || p["06-FGD"][0] != 0.2 || !math.IsNaN(p["06-FGD"][50]) {
		t.Errorf("published = %v, %v", p["06-FGD"][:2], err)
	}
	if _, err := LoadPublished(strings.NewReader("a,b\n1,2\n"), "w"); err == nil {
		t.Error("a table that is not the study's was accepted")
	}
	buf.Reset()
	if err := PlotAllocation(&buf, "t", []Result{r}, p); err != nil || !bytes.HasPrefix(buf.Bytes(), []byte("\x89PNG")) {
		t.Errorf("plot: %v, %d bytes", err, buf.Len())
	}
}

func FuzzLoadPods(f *testing.F) {
	f.Add("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np,4000,1,1,500,T4|A10\n")
	f.Add("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,4000.0,1,8,1000\n")
	f.Fuzz(func(t *testing.T, in string) {
		pods, err := LoadPods(strings.NewReader(in), "f.csv")
		if err != nil {
			return
		}
		for _, p := range pods {
			if p.GPUMilli > MilliGPU || p.CPUMilli < 0 || (p.NumGPU > 1 && p.GPUMilli != MilliGPU) || (p.NumGPU == 0) != (p.GPUMilli == 0) {
				t.Fatalf("accepted an inconsistent pod %+v", p)
			}
			_ = p.Request("t")
		}
	})
}
