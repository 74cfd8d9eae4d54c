package placement

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// movableIf moves the tenants whose name has the prefix.
func movableIf(prefix string) func(int, string) bool {
	return func(_ int, t string) bool { return strings.HasPrefix(t, prefix) }
}

// held is a G2 node whose GPUs hold one share each of the given sizes,
// tenants named old-<node>-<GPU> (tenants are unique across a cluster).
func held(t *testing.T, name string, used ...int64) *gpu.Node {
	t.Helper()
	n := node(t, name, 64000, "G2", make([]int64, len(used))...)
	for i, u := range used {
		if err := n.Assign(share(fmt.Sprintf("old-%s-%d", name, i), u, 0), []int{i}); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

func TestConsolidationFreesAGPUWithTheFewestMoves(t *testing.T) {
	// Six GPUs over three nodes each hold a quarter share: a whole GPU
	// fits nowhere. Moving one share frees a GPU; its share fits beside
	// another quarter.
	a := held(t, "a", 250, 250)
	b := held(t, "b", 250, 250)
	c := held(t, "c", 250, 250)
	nodes := []*gpu.Node{a, b, c}
	whole := gpu.Request{Tenant: "big", Whole: 1, CPU: 1000}
	if n, _ := Pick(nodes, whole, BestFit{}); n >= 0 {
		t.Fatal("setup: the whole GPU fits without moves")
	}
	cons := Consolidator{Policy: BestFit{}, MaxMoves: 4, Movable: movableIf("old")}
	plan, ok := cons.Plan(nodes, whole)
	if !ok {
		t.Fatal("no plan, want one move")
	}
	if len(plan.Moves) != 1 || plan.Node != 0 || !slices.Equal(plan.Devices, []int{0}) {
		t.Fatalf("plan = %+v, want node a's GPU 0 freed by one move", plan)
	}
	m := plan.Moves[0]
	if m.Tenant != "old-a-0" || m.From != 0 || (m.To == 0 && m.Devices[0] == 0) {
		t.Errorf("move = %+v, want old-a-0 off a's GPU 0, elsewhere", m)
	}
	// Applying the plan to the ledgers works as planned.
	if err := nodes[m.From].Release(m.Tenant); err != nil {
		t.Fatal(err)
	}
	if err := nodes[m.To].Assign(m.Request, m.Devices); err != nil {
		t.Fatalf("the move's room: %v", err)
	}
	if err := nodes[plan.Node].Assign(whole, plan.Devices); err != nil {
		t.Fatalf("the request's room: %v", err)
	}
	for _, n := range nodes {
		if err := n.Check(); err != nil {
			t.Error(err)
		}
	}
	if _, _, held := a.Held("big"); !held {
		t.Error("the whole GPU is not on a")
	}
}

func TestConsolidationMovesOnlyWhatMayMove(t *testing.T) {
	nodes := []*gpu.Node{held(t, "a", 250, 250), held(t, "b", 250, 250)}
	whole := gpu.Request{Tenant: "big", Whole: 1}
	if _, ok := (Consolidator{Policy: BestFit{}, MaxMoves: 4, Movable: movableIf("nobody")}).Plan(nodes, whole); ok {
		t.Error("a plan that moves tenants who did not opt in")
	}
	if _, ok := (Consolidator{Policy: BestFit{}, MaxMoves: 0, Movable: movableIf("old")}).Plan(nodes, whole); ok {
		t.Error("a plan with a budget of no moves")
	}
	// Two GPUs' worth asked: two moves, over a budget of one.
	two := gpu.Request{Tenant: "two", Whole: 2}
	if _, ok := (Consolidator{Policy: BestFit{}, MaxMoves: 1, Movable: movableIf("old")}).Plan(nodes, two); ok {
		t.Error("a plan over the budget")
	}
}

func TestConsolidationNeedsRoomForTheMovedTenants(t *testing.T) {
	// Every GPU is three quarters used: a moved 750 share fits nowhere, so
	// no plan, however many moves are allowed.
	nodes := []*gpu.Node{held(t, "a", 750, 750), held(t, "b", 750, 750)}
	if plan, ok := (Consolidator{Policy: BestFit{}, MaxMoves: 8, Movable: movableIf("old")}).Plan(nodes, gpu.Request{Tenant: "big", Whole: 1}); ok {
		t.Errorf("plan %+v moves a share that fits nowhere else", plan)
	}
}

func TestConsolidationForAShare(t *testing.T) {
	// A 600 share fits nowhere (each GPU has 500 free); moving one 500
	// share next to another 500 opens a GPU.
	nodes := []*gpu.Node{held(t, "a", 500), held(t, "b", 500)}
	ours := NewOurs([]Shape{{NumGPU: 1, Share: 500, P: 1}}, Supply{})
	plan, ok := (Consolidator{Policy: ours, MaxMoves: 2, Movable: movableIf("old")}).Plan(nodes, share("new", 600, 0))
	if !ok || len(plan.Moves) != 1 {
		t.Fatalf("plan = %+v, %v; want one move", plan, ok)
	}
	if m := plan.Moves[0]; m.From == m.To {
		t.Errorf("move = %+v, want it on the other node", m)
	}
}

func TestConsolidationMovesOnlyWhereTheMovedPodMayRun(t *testing.T) {
	// As in the first test, but the moved share may not run on b or c
	// (its pod's node selector, say): it must stay on a, on GPU 1.
	nodes := []*gpu.Node{held(t, "a", 250, 250), held(t, "b", 250, 250), held(t, "c", 250, 250)}
	cons := Consolidator{Policy: BestFit{}, MaxMoves: 4, Movable: movableIf("old"),
		MoveTo: func(_ string, node int, _ []string, r gpu.Request) (gpu.Request, bool) { return r, node == 0 }}
	plan, ok := cons.Plan(nodes, gpu.Request{Tenant: "big", Whole: 1})
	if !ok || len(plan.Moves) != 1 {
		t.Fatalf("plan = %+v, %v; want one move", plan, ok)
	}
	if m := plan.Moves[0]; m.To != 0 || plan.Node != 0 || slices.Contains(plan.Devices, m.Devices[0]) {
		t.Errorf("plan = %+v: the move must stay on a, off the GPU it frees", plan)
	}
	// Nowhere to go at all: no plan.
	cons.MoveTo = func(string, int, []string, gpu.Request) (gpu.Request, bool) { return gpu.Request{}, false }
	if plan, ok := cons.Plan(nodes, gpu.Request{Tenant: "big", Whole: 1}); ok {
		t.Errorf("plan %+v moves a pod that may run nowhere", plan)
	}
}

func TestConsolidationIgnoresPodsWithoutGPUs(t *testing.T) {
	nodes := []*gpu.Node{held(t, "a", 250, 250)}
	if plan, ok := (Consolidator{Policy: BestFit{}, MaxMoves: 4, Movable: movableIf("old")}).Plan(nodes, gpu.Request{Tenant: "cpu", CPU: 1 << 40}); ok {
		t.Errorf("plan %+v for a pod that asks for no GPU", plan)
	}
}

// BenchmarkConsolidationPlan is one plan over 1,000 nodes of 8 GPUs each
// holding one movable share, for a whole GPU that fits nowhere: "found",
// quarters that fit beside one another (one move); "none", 810 shares
// that fit nowhere else (every target refused, the case a full cluster
// pays on each try of a pod that waits).
func BenchmarkConsolidationPlan(b *testing.B) {
	for _, c := range []struct {
		name string
		size int64
	}{{"found", 250}, {"none", 810}} {
		b.Run(c.name, func(b *testing.B) {
			nodes := make([]*gpu.Node, 1000)
			for i := range nodes {
				nodes[i] = node(b, fmt.Sprintf("n%04d", i), 96000, "G2", make([]int64, 8)...)
				for g := range 8 {
					if err := nodes[i].Assign(share(fmt.Sprintf("old-%d-%d", i, g), c.size, 1000), []int{g}); err != nil {
						b.Fatal(err)
					}
				}
			}
			cons := Consolidator{Policy: NewOurs(benchShapes, Supply{}), MaxMoves: 4, Movable: movableIf("old")}
			r := gpu.Request{Tenant: "big", Whole: 1, CPU: 8000}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, ok := cons.Plan(nodes, r); ok != (c.name == "found") {
					b.Fatalf("plan found: %v", ok)
				}
			}
		})
	}
}
