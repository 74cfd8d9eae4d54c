package placement

import (
	"fmt"
	"math"
	"math/rand"
	"slices"
	"strings"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// node builds a ledger of milli-GPUs with the given shares already placed
// (one per GPU index; 0 leaves the GPU idle).
func node(t testing.TB, name string, cpu int64, model string, used ...int64) *gpu.Node {
	t.Helper()
	var ds []*gpu.Device
	for i := range used {
		ds = append(ds, &gpu.Device{Index: i, UUID: fmt.Sprintf("%s-%d", name, i), Model: model, Total: 1000})
	}
	n := gpu.NewNode(name, cpu, 1<<20, ds...)
	for i, u := range used {
		if u == 0 {
			continue
		}
		if err := n.Assign(share(fmt.Sprintf("old%d", i), u, 0), []int{i}); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

func share(tenant string, milli, cpu int64) gpu.Request {
	return gpu.Request{Tenant: tenant, Devices: 1, CPU: cpu, Share: gpu.Share{Request: milli, Limit: milli, Mode: api.TimeSlicing}}
}

func TestPopularCoversAndRenormalises(t *testing.T) {
	half := Key{CPU: 4000, NumGPU: 1, Share: 500}
	two := Key{CPU: 8000, NumGPU: 2}
	t4 := Key{CPU: 1000, NumGPU: 1, Models: "T4"}
	cpuOnly := Key{CPU: 2000}
	keys := []Key{half, half, half, two, two, t4, cpuOnly, cpuOnly}
	shapes := Popular(keys, 0.8)
	if got := []Key{shapes[0].Key(), shapes[1].Key(), shapes[2].Key()}; len(shapes) != 3 || !slices.Equal(got, []Key{half, two, cpuOnly}) {
		t.Fatalf("shapes = %+v, want half, then the larger of the two pairs (8 CPUs, 2 GPUs), then CPU-only", shapes)
	}
	for i, want := range []float64{3.0 / 7, 2.0 / 7, 2.0 / 7} {
		if math.Abs(shapes[i].P-want) > 1e-12 {
			t.Errorf("P[%d] = %v, want %v after renormalising over the 7 covered tasks", i, shapes[i].P, want)
		}
	}
	if all := Popular(keys, 1); len(all) != 4 || all[3].Models[0] != "T4" {
		t.Errorf("full coverage: %+v", all)
	}
}

func TestFragmentationFollowsTheStudy(t *testing.T) {
	n := node(t, "n", 32000, "T4", 700, 200, 0, 0) // free: 300, 800, 1000, 1000
	half := Shape{CPU: 1000, NumGPU: 1, Share: 500, P: 0.4}
	two := Shape{CPU: 1000, NumGPU: 2, P: 0.2}
	v100 := Shape{CPU: 1000, NumGPU: 1, Models: []string{"V100M32"}, P: 0.2}
	cpuOnly := Shape{CPU: 1000, P: 0.2}
	// half fits; only GPU 0's 300 is too small for it.
	// two fits on GPUs 2 and 3; GPUs 0 and 1 (1100) cannot serve it.
	// v100 cannot run on T4s, cpuOnly uses no GPU: all 3100 is theirs.
	want := 0.4*300 + 0.2*1100 + 0.2*3100 + 0.2*3100
	if got := Fragmentation(n, []Shape{half, two, v100, cpuOnly}); math.Abs(got-want) > 1e-9 {
		t.Errorf("Fragmentation = %v, want %v", got, want)
	}
	hog := Shape{CPU: 40000, NumGPU: 1, Share: 100, P: 1}
	if got := Fragmentation(n, []Shape{hog}); got != 3100 {
		t.Errorf("without CPU for the shape all idle GPU is fragment: got %v, want 3100", got)
	}
	full := node(t, "full", 32000, "T4", 1000, 1000)
	if got := Fragmentation(full, []Shape{hog, half}); got != 0 {
		t.Errorf("a node without free GPU has no fragment, got %v", got)
	}
}

func TestCapacityViewCountsCopiesAndCPU(t *testing.T) {
	v := viewOf(node(t, "n", 10000, "G2", 0, 0, 0, 0)) // 4 idle GPUs, 10 CPUs
	s := Shape{CPU: 3000, NumGPU: 1, Share: 470, P: 1}
	// The GPUs hold 8 copies (2 each); the CPU feeds 3: 3×470 usable.
	unused, stranded := v.manyCopies([]Shape{s})
	if unused != 4000-3*470 {
		t.Errorf("unused = %v, want %v", unused, 4000-3*470)
	}
	if stranded != (8-3)*470 {
		t.Errorf("stranded = %v, want %v", stranded, (8-3)*470)
	}
	if got := v.frag([]Shape{s}); got != 0 {
		t.Errorf("FGD's one-copy view sees no fragment here, got %v", got)
	}
}

func TestFillerExpectsTheStreamOfShares(t *testing.T) {
	f := newFiller([]Shape{{NumGPU: 1, Share: 300, P: 0.5}, {NumGPU: 1, Share: 600, P: 0.5}})
	for _, c := range []struct {
		free int64
		want float64
	}{
		{299, 0}, {300, 300}, {599, 300},
		{600, 0.5*(300+300) + 0.5*600}, // 300 then another 300, or 600
		{900, 0.5*(300+f.expected(600)) + 0.5*(600+300)},
	} {
		if got := f.expected(c.free); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("expected(%d) = %v, want %v", c.free, got, c.want)
		}
	}
}

// A gap that only rare shares fit is expected to be filled in proportion
// to how often they come, not as surely as a gap common shares fit: the
// 190 that most of the stream leaves, which 3% of it fits, must not look
// nearly filled.
func TestFillerCountsRareSharesInProportion(t *testing.T) {
	f := newFiller([]Shape{{NumGPU: 1, Share: 810, P: 0.57}, {NumGPU: 1, Share: 160, P: 0.03}, {NumGPU: 1, Share: 470, P: 0.3}, {NumGPU: 1, Share: 0, P: 0.1}})
	// The share mass is 0.9 (the whole-GPU shape is no share): shares
	// that fit are rare below rareShares × 0.9 of it.
	floor := rareShares * 0.9
	for _, c := range []struct {
		free int64
		want float64
	}{
		{159, 0},
		{190, 160 * 0.03 / floor}, // only the 160s fit, and they are rare
		{470, (0.03*(160+f.expected(310)) + 0.3*470) / (0.03 + 0.3)}, // common enough: renormalised as before
	} {
		if got := f.expected(c.free); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("expected(%d) = %v, want %v", c.free, got, c.want)
		}
	}
}

func TestBestTakesTheFirstOfEqualScores(t *testing.T) {
	cands := []Candidate{{Node: 7, Choice: Choice{Score: 1}}, {Node: 3, Choice: Choice{Score: 2}}, {Node: 5, Choice: Choice{Score: 2}}}
	if b := Best(FGD{}, cands); cands[b].Node != 3 {
		t.Errorf("Best picked node %d, want 3 (first of the two best)", cands[b].Node)
	}
	if b := Best(FGD{}, nil); b != -1 {
		t.Errorf("Best of nothing = %d, want -1", b)
	}
	// BestFit normalises to whole points: 90 and 91 over a range of 0..200
	// both become 45, and the earlier wins.
	cands = []Candidate{{Node: 0, Choice: Choice{Score: 0}}, {Node: 1, Choice: Choice{Score: 91}}, {Node: 2, Choice: Choice{Score: 90.5}}, {Node: 3, Choice: Choice{Score: 200}}}
	if b := Best(BestFit{}, cands); cands[b].Node != 3 || cands[1].Score != 45 || cands[2].Score != 45 {
		t.Errorf("normalised = %+v", cands)
	}
}

func TestFGDScoresAsTheStudy(t *testing.T) {
	shapes := []Shape{{CPU: 1000, NumGPU: 1, P: 1}} // whole GPUs only
	n := node(t, "n", 32000, "T4", 600, 0)
	// Free is 400 and 1000; only GPU 0's 400 is fragment. A 300 share on
	// GPU 0 leaves 100 (fragment 400 → 100, a decrease of 300); on GPU 1 it
	// breaks the only idle GPU (fragment 400 → 1100).
	r := share("p", 300, 1000)
	fit, _ := n.Fit(r)
	c := FGD{Shapes: shapes}.Score(n, r, fit)
	want := math.Trunc(100 / (1 + math.Exp(-300.0/1000)))
	if !slices.Equal(c.Devices, []int{0}) || c.Score != want {
		t.Errorf("FGD chose %v with %v, want [0] with %v", c.Devices, c.Score, want)
	}
}

func TestOursKeepsIdleGPUsForWholeRequests(t *testing.T) {
	shapes := []Shape{{CPU: 1000, NumGPU: 1, Share: 400, P: 0.5}, {CPU: 1000, NumGPU: 2, P: 0.5}}
	p := NewOurs(shapes, Supply{})
	used := node(t, "used", 32000, "T4", 500, 0, 0)
	idle := node(t, "idle", 32000, "T4", 0, 0)
	idx, devices := Pick([]*gpu.Node{idle, used}, share("p", 400, 1000), p)
	if idx != 1 || !slices.Equal(devices, []int{0}) {
		t.Errorf("share went to node %d GPUs %v, want the used node's shared GPU 0", idx, devices)
	}
}

// Every policy, on random nodes and requests, chooses exactly the GPUs
// the request needs among those that fit, so the ledger accepts it.
func TestPoliciesChooseWhatTheLedgerAccepts(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	shapes := []Shape{{CPU: 2000, NumGPU: 1, Share: 300, P: 0.4}, {CPU: 8000, NumGPU: 2, P: 0.3}, {CPU: 4000, P: 0.3}}
	for _, name := range Names {
		p, err := New(name, shapes, StudyCapacity, Supply{CPU: 128000, GPUs: 8, Unit: 1000}, rng)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 300 {
			used := make([]int64, 1+rng.Intn(8))
			for g := range used {
				used[g] = []int64{0, 0, 1000, 100, 500, 900}[rng.Intn(6)]
			}
			n := node(t, "n", 64000, "T4", used...)
			var r gpu.Request
			switch rng.Intn(3) {
			case 0:
				r = share("x", int64(50+rng.Intn(900)), 1000)
			case 1:
				r = gpu.Request{Tenant: "x", Whole: 1 + rng.Intn(3), CPU: 2000}
			default:
				r = gpu.Request{Tenant: "x", CPU: 2000}
			}
			fit, unfit := n.Fit(r)
			if unfit != nil {
				continue
			}
			c := p.Score(n, r, fit)
			if math.IsNaN(c.Score) || math.IsInf(c.Score, 0) {
				t.Fatalf("%s: score %v for %+v on %v", name, c.Score, r, used)
			}
			if err := n.Assign(r, c.Devices); err != nil {
				t.Fatalf("%s case %d: %v (request %+v, node %v, chose %v)", name, i, err, r, used, c.Devices)
			}
		}
	}
}

func TestNewNamesTheKnownPolicies(t *testing.T) {
	_, err := New("tetris", nil, StudyCapacity, Supply{}, nil)
	if err == nil || !strings.Contains(err.Error(), `policy "tetris" is not known: use one of gpufrac, fgd, bestfit, gpupacking, dotprod, random`) {
		t.Errorf("err = %v", err)
	}
	if p, _ := New("", nil, StudyCapacity, Supply{}, nil); p.Name() != "gpufrac" {
		t.Errorf("the default policy is %s, want gpufrac", p.Name())
	}
}

// Spread gives room to burst; a pod without GPUs keeps off the nodes whose
// GPUs are idle, rather than crowd their hosts.
func TestSpreadKeepsCPUOnlyPodsOffIdleGPUs(t *testing.T) {
	busy := gpu.NewNode("busy", 0, 0, &gpu.Device{Index: 0, Total: 1000}, &gpu.Device{Index: 1, Total: 1000})
	if err := busy.Assign(gpu.Request{Tenant: "w", Whole: 1}, []int{0}); err != nil {
		t.Fatal(err)
	}
	idle := gpu.NewNode("idle", 0, 0, &gpu.Device{Index: 0, Total: 1000}, &gpu.Device{Index: 1, Total: 1000})
	none := gpu.NewNode("cpu", 0, 0)
	cpuOnly := gpu.Request{Tenant: "c", CPU: 1000}
	s := func(n *gpu.Node) float64 { return Spread{}.Score(n, cpuOnly, nil).Score }
	if !(s(none) > s(busy) && s(busy) > s(idle)) {
		t.Errorf("spread: no GPUs %v, one idle GPU %v, two idle GPUs %v: want them in that order", s(none), s(busy), s(idle))
	}
}

// The rank keeps its full weight while the workload asks for no more CPU
// per GPU than the cluster offers, and falls to a tie-breaker once it asks
// for 10% more: then CPU, not GPU fragmentation, limits what fits.
func TestRankWeighsLessWhenCPURunsOutFirst(t *testing.T) {
	cluster := Supply{CPU: 96000, GPUs: 8, Unit: 1000} // 12 CPUs per GPU
	for _, c := range []struct {
		name   string
		shapes []Shape
		supply Supply
		want   float64
	}{
		{"as much CPU per GPU as the cluster", []Shape{{CPU: 12000, NumGPU: 1, P: 1}}, cluster, 1},
		{"less", []Shape{{CPU: 4000, NumGPU: 2, P: 1}}, cluster, 1},
		{"5% more", []Shape{{CPU: 12600, NumGPU: 1, P: 1}}, cluster, 0.5},
		{"10% more", []Shape{{CPU: 13200, NumGPU: 1, P: 1}}, cluster, rankFloor},
		{"shares, sized in the supply's unit", []Shape{{CPU: 6600, NumGPU: 1, Share: 500, P: 0.5}, {CPU: 8000, P: 0.5}}, cluster, rankFloor},
		{"shares half as CPU-hungry", []Shape{{CPU: 3000, NumGPU: 1, Share: 500, P: 1}}, cluster, 1},
		{"no supply known", []Shape{{CPU: 64000, NumGPU: 1, P: 1}}, Supply{}, 1},
		{"no GPU demand", []Shape{{CPU: 8000, P: 1}}, cluster, 1},
		{"a share of two GPUs counts both", []Shape{{CPU: 13200, NumGPU: 2, Share: 500, P: 1}}, cluster, rankFloor},
		// Weighted by pod count, as the workload asks: (24000 + 9000) CPU
		// for 4.5 GPUs is 1.048 times the 7 CPUs per GPU offered. After
		// the multi-GPU reweighting it would be 1.31, the floor.
		{"pod-count weights, not the reweighted ones", []Shape{{CPU: 48000, NumGPU: 8, P: 0.5}, {CPU: 18000, NumGPU: 1, P: 0.5}},
			Supply{CPU: 56000, GPUs: 8, Unit: 1000}, (cpuBoundFull - 33000.0/4.5/7000) / (cpuBoundFull - cpuBoundFrom)},
	} {
		if got := rankScale(c.shapes, c.supply); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("%s: rank scale %v, want %v", c.name, got, c.want)
		}
	}
	// The scale is what the rank adds to a score: two nodes in the same
	// state differ by the scaled difference of their ranks.
	gap := func(p Ours) float64 {
		r := gpu.Request{Tenant: "w", Whole: 1, CPU: 1000}
		a := p.Score(node(t, "a", 96000, "T4", 0, 0), r, []int{0, 1})
		b := p.Score(node(t, "b", 96000, "T4", 0, 0), r, []int{0, 1})
		return a.Score - b.Score
	}
	gpuBound := []Shape{{CPU: 6000, NumGPU: 1, P: 1}}
	cpuBound := []Shape{{CPU: 24000, NumGPU: 1, P: 1}}
	full, floor := gap(NewOurs(gpuBound, cluster)), gap(NewOurs(cpuBound, cluster))
	want := rankWeight * (rank("b") - rank("a"))
	if want == 0 || math.Abs(full/want-1) > 1e-6 {
		t.Errorf("GPU-bound workload: nodes a and b differ by %v, want the full rank difference %v", full, want)
	}
	if math.Abs(floor/want-rankFloor) > 1e-6 {
		t.Errorf("CPU-bound workload: nodes a and b differ by %v, want %v of %v", floor, rankFloor, want)
	}
}
