package sim

import (
	"bytes"
	"slices"
	"strings"
	"testing"
)

func TestSliceIsASeedsWorkloadOfPodsThatMayRunThere(t *testing.T) {
	nodes, pods := load(t)
	slice, workload, err := Slice(nodes, pods, "G2", 32, 42, 1.3)
	if err != nil {
		t.Fatal(err)
	}
	if len(slice) != 32 || !slices.IsSortedFunc(slice, func(a, b NodeSpec) int { return strings.Compare(a.Name, b.Name) }) {
		t.Fatalf("%d nodes, want the first 32 G2 nodes by name", len(slice))
	}
	var total int64
	names := map[string]bool{}
	for _, p := range workload {
		if len(p.GPUSpec) > 0 || p.CPUMilli > 96000 || p.NumGPU > 8 || names[p.Name] {
			t.Fatalf("pod %+v: want distinct names, no GPU spec and a shape a G2 node can hold", p)
		}
		names[p.Name] = true
		total += p.GPURequest()
	}
	capacity := int64(32 * 8 * MilliGPU)
	if float64(total) > 1.3*float64(capacity) || float64(total) < 1.2*float64(capacity) {
		t.Errorf("the workload asks %d milli-GPU, want just under 1.3 × %d", total, capacity)
	}
	// A pod whose spec excludes G2 never makes the slice.
	for _, p := range pods {
		if len(p.GPUSpec) > 0 && !slices.Contains(p.GPUSpec, "G2") {
			for _, q := range workload {
				if strings.HasSuffix(q.Name, "-"+p.Name) {
					t.Fatalf("pod %s (spec %v) is in the G2 slice", p.Name, p.GPUSpec)
				}
			}
		}
	}
	_, again, _ := Slice(nodes, pods, "G2", 32, 42, 1.3)
	_, other, _ := Slice(nodes, pods, "G2", 32, 43, 1.3)
	if !slices.EqualFunc(workload, again, podsEqual) || slices.EqualFunc(workload, other, podsEqual) {
		t.Error("a slice must be a function of its seed")
	}
	// The CSVs read back as written.
	var nb, pb bytes.Buffer
	if err := WriteNodes(&nb, slice); err != nil {
		t.Fatal(err)
	}
	if err := WritePods(&pb, workload); err != nil {
		t.Fatal(err)
	}
	n2, err := LoadNodes(&nb, "nodes")
	if err != nil {
		t.Fatal(err)
	}
	p2, err := LoadPods(&pb, "pods")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(n2, slice) || !slices.EqualFunc(p2, workload, podsEqual) {
		t.Error("the slice's CSVs do not read back as written")
	}
	if _, _, err := Slice(nodes, pods, "G2", 10000, 42, 1.3); err == nil || !strings.Contains(err.Error(), "G2") {
		t.Errorf("a slice larger than the trace: %v, want an error naming the model", err)
	}
}

func podsEqual(a, b PodSpec) bool {
	return a.Name == b.Name && a.CPUMilli == b.CPUMilli && a.MemoryMiB == b.MemoryMiB && a.NumGPU == b.NumGPU &&
		a.GPUMilli == b.GPUMilli && slices.Equal(a.GPUSpec, b.GPUSpec)
}

// Replaying the simulator's own placements gives the simulator's figures:
// the live harness reports exactly what the simulator would.
func TestReplayedReproducesAGivenRun(t *testing.T) {
	nodes, pods := load(t)
	slice, workload, err := Slice(nodes, pods, "G2", 8, 7, 1.3)
	if err != nil {
		t.Fatal(err)
	}
	for _, policy := range []string{"gpufrac", "fgd"} {
		run, err := Run(slice, workload, Config{Policy: policy, Seed: 7, Given: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(run.Placed) != len(workload) || run.Unscheduled == 0 {
			t.Fatalf("%s: %d placements for %d pods, %d unscheduled: want one each and some left out at 130%%", policy, len(run.Placed), len(workload), run.Unscheduled)
		}
		// Group names are the live scheduler's own: rename them.
		placed := slices.Clone(run.Placed)
		for i := range placed {
			if placed[i].Group != "" {
				placed[i].Group = "g" + placed[i].Group + "x"
			}
		}
		got, err := Replayed(slice, workload, placed, policy, 0)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got.Samples, run.Samples) || got.Unscheduled != run.Unscheduled {
			t.Errorf("%s: the replayed samples differ from the run's", policy)
		}
	}
	// Two shares of one group that overflow its GPU are an over-commit.
	two := []PodSpec{{Name: "a", CPUMilli: 1, MemoryMiB: 1, NumGPU: 1, GPUMilli: 600}, {Name: "b", CPUMilli: 1, MemoryMiB: 1, NumGPU: 1, GPUMilli: 600}}
	_, err = Replayed(slice, two, []Placement{{Node: slice[0].Name, Group: "g"}, {Node: slice[0].Name, Group: "g"}}, "gpufrac", 0)
	if err == nil || !strings.Contains(err.Error(), "over-committed") {
		t.Errorf("an over-committed GPU: %v, want an error saying so", err)
	}
}
