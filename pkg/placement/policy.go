package placement

import (
	"cmp"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// Choice is a policy's rating of one node for a request: a score (higher
// is better) and the GPUs of the node the request would use.
type Choice struct {
	Score   float64
	Devices []int
}

// Policy rates placing a request on a node. fit is the node's GPUs that
// can take the request, as gpu.Node.Fit returned them (nil for a request
// without GPUs). Policies see one request at a time; FGD-like policies
// may also know the workload's shapes, never future requests.
type Policy interface {
	Name() string
	Score(n *gpu.Node, r gpu.Request, fit []int) Choice
}

// Normalizer is a policy whose raw scores are rescaled across the
// feasible nodes before the best is picked, as kube-scheduler's
// NormalizeScore does.
type Normalizer interface {
	Normalize(scores []float64)
}

// Candidate is a feasible node and the policy's choice on it.
type Candidate struct {
	Node int
	Choice
}

// Best returns the index in cands of the highest score, the first in
// candidate order on a tie, or -1 when cands is empty. The first, not a
// random one: the study's simulator settles ties by node order, which it
// randomises per seed, and so does our simulator; its published figures
// are reproduced only that way (random tie-breaking costs FGD about five
// points of allocation).
func Best(p Policy, cands []Candidate) int {
	if len(cands) == 0 {
		return -1
	}
	if nz, ok := p.(Normalizer); ok {
		scores := make([]float64, len(cands))
		for i, c := range cands {
			scores[i] = c.Score
		}
		nz.Normalize(scores)
		for i := range cands {
			cands[i].Score = scores[i]
		}
	}
	best := 0
	for i := 1; i < len(cands); i++ {
		if cands[i].Score > cands[best].Score {
			best = i
		}
	}
	return best
}

// Pick places r on the best node for p: it returns the node's index and
// the GPUs to use, or -1 when no node fits. Ties go to the earlier node.
func Pick(nodes []*gpu.Node, r gpu.Request, p Policy) (int, []int) {
	var cands []Candidate
	for i, n := range nodes {
		fit, unfit := n.Fit(r)
		if unfit != nil {
			continue
		}
		cands = append(cands, Candidate{Node: i, Choice: p.Score(n, r, fit)})
	}
	b := Best(p, cands)
	if b < 0 {
		return -1, nil
	}
	return cands[b].Node, cands[b].Devices
}

// need is how many GPUs r takes.
func need(r gpu.Request) int { return max(r.Whole, r.Devices) }

// lowestIdle takes the first k GPUs of fit in index order: whole-GPU
// requests go to the lowest-numbered idle GPUs, as the study's simulator
// allocates them.
func lowestIdle(fit []int, k int) []int { return slices.Clone(fit[:k]) }

// tightest takes the k GPUs of fit with the least free memory, the lower
// index first on a tie.
func tightest(n *gpu.Node, fit []int, k int) []int {
	byFree := slices.Clone(fit)
	slices.SortStableFunc(byFree, func(a, b int) int {
		return cmp.Compare(n.Devices[a].Free(), n.Devices[b].Free())
	})
	return byFree[:k]
}

// bestFitDevices is the study's default GPU choice ("best"): a share goes
// to the tightest GPUs that fit, whole GPUs to the lowest idle ones.
func bestFitDevices(n *gpu.Node, r gpu.Request, fit []int) []int {
	k := need(r)
	if k == 0 {
		return nil
	}
	if r.Whole > 0 {
		return lowestIdle(fit, k)
	}
	return tightest(n, fit, k)
}

// Random rates each feasible node at random, so the pick is uniform among
// them; a share goes to a random GPU that fits.
type Random struct{ Rng *rand.Rand }

// Name implements Policy.
func (Random) Name() string { return "random" }

// Score implements Policy.
func (p Random) Score(n *gpu.Node, r gpu.Request, fit []int) Choice {
	k := need(r)
	score := p.Rng.Float64()
	switch {
	case k == 0:
		return Choice{Score: score}
	case r.Whole > 0:
		return Choice{Score: score, Devices: lowestIdle(fit, k)}
	}
	shuffled := slices.Clone(fit)
	p.Rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	return Choice{Score: score, Devices: shuffled[:k]}
}

// Capacity is the largest node of a cluster, which BestFit and DotProd
// measure leftovers against: CPU in milli-CPU and GPU in the ledger's
// unit summed over the node's GPUs.
type Capacity struct{ CPU, GPU int64 }

// Supply is what a cluster's nodes offer in all, for gpufrac's policy to
// tell whether the workload will run out of CPU before GPUs: CPU in
// milli-CPU, GPUs counted whole, and Unit, a whole GPU in the unit that
// shapes' shares are in (milli-GPU in the simulator, MiB in the
// scheduler).
type Supply struct {
	CPU, GPUs, Unit int64
}

// StudyCapacity is the normalisation of the ATC '23 simulator: 128 CPUs
// and 8 GPUs of 1000 milli-GPU.
var StudyCapacity = Capacity{CPU: 128000, GPU: 8000}

// leftover returns the node's free CPU and summed free GPU after r.
func leftover(n *gpu.Node, r gpu.Request) (cpu, gpus float64) {
	v := viewOf(n)
	if v.cpuFree >= 0 {
		cpu = float64(v.cpuFree - r.CPU)
	}
	return cpu, float64(v.idle() - requested(n, r))
}

// requested is r's total GPU amount on n.
func requested(n *gpu.Node, r gpu.Request) int64 {
	if r.Whole > 0 && len(n.Devices) > 0 {
		return int64(r.Whole) * n.Devices[0].Schedulable()
	}
	return int64(r.Devices) * r.Share.Request
}

// BestFit prefers the node with the least CPU and GPU left after the
// placement, each normalised by the cluster's largest node and weighted
// equally.
type BestFit struct{ Max Capacity }

// Name implements Policy.
func (BestFit) Name() string { return "bestfit" }

// Score implements Policy.
func (p BestFit) Score(n *gpu.Node, r gpu.Request, fit []int) Choice {
	cpu, gpus := leftover(n, r)
	left := 0.5*cpu/float64(p.Max.CPU) + 0.5*gpus/float64(p.Max.GPU)
	return Choice{Score: math.Trunc((1 - left) * 100), Devices: bestFitDevices(n, r, fit)}
}

// Normalize rescales to 0–100 in whole points, as the study's plugin does.
func (BestFit) Normalize(scores []float64) { minMax(scores) }

func minMax(scores []float64) {
	lo, hi := slices.Min(scores), slices.Max(scores)
	for i, s := range scores {
		if hi == lo {
			scores[i] = 0
			continue
		}
		scores[i] = math.Trunc((s - lo) * 100 / (hi - lo))
	}
}

// DotProd is Tetris's alignment heuristic: it prefers the node whose
// leftover CPU and GPU are least aligned with the request.
type DotProd struct{ Max Capacity }

// Name implements Policy.
func (DotProd) Name() string { return "dotprod" }

// Score implements Policy.
func (p DotProd) Score(n *gpu.Node, r gpu.Request, fit []int) Choice {
	v := viewOf(n)
	cpuFree := float64(max(v.cpuFree, 0))
	mc, mg := float64(p.Max.CPU), float64(p.Max.GPU)
	dot := (cpuFree/mc*float64(r.CPU)/mc + float64(v.idle())/mg*float64(requested(n, r))/mg) / 2
	return Choice{Score: math.Trunc((1 - dot) * 100), Devices: bestFitDevices(n, r, fit)}
}

// GPUPacking prefers, in order: GPUs already shared, then idle GPUs on a
// node already in use, then an empty node.
type GPUPacking struct{}

// Name implements Policy.
func (GPUPacking) Name() string { return "gpupacking" }

// Score implements Policy.
func (GPUPacking) Score(n *gpu.Node, r gpu.Request, fit []int) Choice {
	k := need(r)
	if k == 0 {
		return Choice{}
	}
	devices := bestFitDevices(n, r, fit)
	idle := 0
	for _, d := range n.Devices {
		if d.Idle() {
			idle++
		}
	}
	if idle == len(n.Devices) {
		return Choice{Score: float64(max(100/3-idle, idle)), Devices: devices}
	}
	wholeUsed := 0
	var freePct int64
	for _, i := range devices {
		d := n.Devices[i]
		if d.Idle() {
			wholeUsed++
		}
		freePct += d.Free() * 100 / max(d.Schedulable(), 1)
	}
	if wholeUsed > 0 {
		return Choice{Score: float64(max(100/2-wholeUsed, 100/3)), Devices: devices}
	}
	return Choice{Score: float64(max(100-freePct/10, 100/2)), Devices: devices}
}

// FGD is fragmentation gradient descent (Weng et al., ATC '23): place
// where the node's expected fragmentation over the workload's shapes
// grows least. Scores are the study's: sigmoid of the decrease in whole
// GPUs, as integer points, so near-equal nodes tie and are picked at
// random.
type FGD struct{ Shapes []Shape }

// Name implements Policy.
func (FGD) Name() string { return "fgd" }

// Score implements Policy.
func (p FGD) Score(n *gpu.Node, r gpu.Request, fit []int) Choice {
	v := viewOf(n)
	before := v.frag(p.Shapes)
	unit := gpuUnit(v)
	points := func(after float64) float64 {
		return math.Trunc(100 / (1 + math.Exp(-(before-after)/unit)))
	}
	buf := make([]int64, len(v.free))
	if r.Devices == 1 {
		one := make([]int, 1)
		best, at := math.Inf(-1), -1
		for _, i := range fit {
			one[0] = i
			w := v.with(buf)
			w.take(r, one)
			if s := points(w.frag(p.Shapes)); s > best {
				best, at = s, i
			}
		}
		one[0] = at
		return Choice{Score: best, Devices: one}
	}
	devices := bestFitDevices(n, r, fit)
	w := v.with(buf)
	w.take(r, devices)
	return Choice{Score: points(w.frag(p.Shapes)), Devices: devices}
}

// gpuUnit is one whole GPU in the ledger's unit.
func gpuUnit(v view) float64 {
	if len(v.full) == 0 || v.full[0] == 0 {
		return 1
	}
	return float64(v.full[0])
}

// Names lists the policies New knows, our default first.
var Names = []string{"gpufrac", "fgd", "bestfit", "gpupacking", "dotprod", "random"}

// New returns the named policy. shapes is the workload estimate for the
// fragmentation-aware ones, capacity the normalisation for bestfit and
// dotprod, supply the cluster's totals for gpufrac's, rng the source of
// random's choices.
func New(name string, shapes []Shape, capacity Capacity, supply Supply, rng *rand.Rand) (Policy, error) {
	switch name {
	case "gpufrac", "":
		return NewOurs(shapes, supply), nil
	case "fgd":
		return FGD{Shapes: shapes}, nil
	case "bestfit":
		return BestFit{Max: capacity}, nil
	case "gpupacking":
		return GPUPacking{}, nil
	case "dotprod":
		return DotProd{Max: capacity}, nil
	case "random":
		return Random{Rng: rng}, nil
	}
	return nil, fmt.Errorf("policy %q is not known: use one of %s", name, strings.Join(Names, ", "))
}

// Spread is the opposite of packing: each request goes to the node with
// the most free GPU memory after it, and a share to the GPUs with the most
// free memory, so tenants get room to burst up to their limits.
type Spread struct{}

// Name implements Policy.
func (Spread) Name() string { return "spread" }

// Score implements Policy.
func (Spread) Score(n *gpu.Node, r gpu.Request, fit []int) Choice {
	k := need(r)
	v := viewOf(n)
	left := float64(v.idle() - requested(n, r))
	if k == 0 {
		// A pod without GPUs keeps off the GPUs' hosts: the fewer idle
		// GPUs its CPU and memory crowd, the better.
		return Choice{Score: -left}
	}
	if r.Whole > 0 {
		return Choice{Score: left, Devices: lowestIdle(fit, k)}
	}
	roomiest := slices.Clone(fit)
	slices.SortStableFunc(roomiest, func(a, b int) int { return cmp.Compare(n.Devices[b].Free(), n.Devices[a].Free()) })
	return Choice{Score: left, Devices: roomiest[:k]}
}
