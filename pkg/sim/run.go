package sim

import (
	"fmt"
	"math"
	"math/rand"
	"strconv"
	"strings"
	"time"

	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// Coverage is the share of pods whose shapes make the workload estimate
// (the study's "typical pods" threshold), the scheduler's too.
const Coverage = placement.Coverage

// Config is one simulated run.
type Config struct {
	Policy string
	Seed   int64
	Tune   float64
	// Given replays the pods as listed, each once: no shuffle, no padding
	// or thinning to Tune (which is then unused), and ties between nodes
	// go to the earlier by name. A live run can place the very same
	// sequence, so the two pair up. The seed still seeds the policy.
	Given bool
	// Consolidate is the most pods one pending pod may have moved to make
	// it fit (placement.Consolidator); 0 moves none. Only Movable pods
	// move.
	Consolidate int
}

// Sample is the cluster after one pod arrived (placed or not).
type Sample struct {
	ArrivedMilli int64
	AllocMilli   int64
	// Frag is the cluster's fragmentation amount in milli-GPU.
	Frag float64
}

// Result is one run: a sample per arriving pod.
type Result struct {
	Policy        string
	Seed          int64
	Tune          float64 // 0 for a Given run
	Given         bool
	Pods          int
	Unscheduled   int
	CapacityMilli int64
	Samples       []Sample
	// Placed is, for a Given run, where each pod went (as a live replay
	// reports it, a share's group named by its GPU's index), so that a
	// live run can be compared with it pod by pod.
	Placed []Placement
	// Consolidate is the run's budget of moves per pending pod; Moves the
	// pods moved, Consolidated the pods placed thanks to them.
	Consolidate, Moves, Consolidated int
	Elapsed                          time.Duration
}

// Run replays the workload of SPEC §4 on the GPU nodes with one policy.
// The seeded generator is drawn from in the study's order (one draw, the
// shuffle, the padding, the node order, then ties), so a run is
// reproducible; ties between nodes go to the earlier in that order, as
// in the study. A Given run replays the pods as listed instead (see
// Config.Given). progress, if not nil, is called now and then with the
// pods placed so far and the total.
func Run(nodeSpecs []NodeSpec, pods []PodSpec, cfg Config, progress func(done, total int)) (Result, error) {
	start := time.Now()
	nodes := Cluster(nodeSpecs)
	var capacity int64
	supply := placement.Supply{Unit: MilliGPU}
	for _, n := range nodes {
		capacity += int64(len(n.Devices)) * MilliGPU
		supply.CPU += n.CPU
		supply.GPUs += int64(len(n.Devices))
	}
	if capacity == 0 {
		return Result{}, fmt.Errorf("the node list has no GPU nodes")
	}
	rng := rand.New(rand.NewSource(cfg.Seed))
	workload := pods
	if !cfg.Given {
		rng.Int() // the study logs one draw before shuffling
		workload = Workload(pods, rng, cfg.Tune, capacity)
	}
	keys := make([]placement.Key, len(pods))
	mems := make([]int64, len(pods))
	for i, p := range pods {
		keys[i], mems[i] = p.Shape(), p.MemoryMiB
	}
	// The study's shapes have no memory; gpufrac's policy also knows each
	// shape's mean memory, so that it sees GPUs a node's memory strands.
	shapes := placement.Popular(keys, Coverage)
	policy, err := placement.New(cfg.Policy, placement.WithMemory(shapes, keys, mems), placement.StudyCapacity, supply, rng)
	if err != nil {
		return Result{}, err
	}
	// The study renames the name-sorted nodes with a seeded random prefix
	// and its scheduler settles ties by node order: ties here go to the
	// node earliest in a seeded permutation, drawn where the study draws
	// it. This order reproduces the published per-seed figures closely.
	var order []int
	if cfg.Given {
		order = make([]int, len(nodes))
		for i := range order {
			order[i] = i
		}
	} else {
		order = rng.Perm(len(nodes))
	}

	s := newState(nodes, policy, shapes)
	tune := cfg.Tune
	if cfg.Given {
		tune = 0
	}
	res := Result{Policy: policy.Name(), Seed: cfg.Seed, Tune: tune, Given: cfg.Given, Pods: len(workload), CapacityMilli: capacity,
		Samples: make([]Sample, 0, len(workload)), Consolidate: cfg.Consolidate}
	// Consolidation weighs the nodes in the run's order, so that its ties
	// go where the policy's do.
	ordered := make([]*gpu.Node, len(order))
	for i, ni := range order {
		ordered[i] = nodes[ni]
	}
	movable := map[string]bool{}
	cons := placement.Consolidator{Policy: policy, MaxMoves: cfg.Consolidate,
		Movable: func(_ int, tenant string) bool { return movable[tenant] }}
	var arrived, alloc int64
	cands := make([]placement.Candidate, 0, len(nodes))
	for i, p := range workload {
		if progress != nil && i%256 == 0 {
			progress(i, len(workload))
		}
		arrived += p.GPURequest()
		r := p.Request(fmt.Sprintf("%s#%d", p.Name, i))
		key := keyOf(p)
		cands = cands[:0]
		for _, ni := range order {
			if c, ok := s.rate(ni, key, r); ok {
				cands = append(cands, placement.Candidate{Node: ni, Choice: c})
			}
		}
		b := placement.Best(policy, cands)
		if b < 0 && cfg.Consolidate > 0 {
			if plan, ok := cons.Plan(ordered, r); ok {
				if err := s.apply(order, plan); err != nil {
					return Result{}, fmt.Errorf("pod %s: %w", p.Name, err)
				}
				res.Moves += len(plan.Moves)
				res.Consolidated++
				cands = append(cands[:0], placement.Candidate{Node: order[plan.Node], Choice: placement.Choice{Devices: plan.Devices}})
				b = 0
			}
		}
		if b < 0 {
			res.Unscheduled++
			if cfg.Given {
				res.Placed = append(res.Placed, Placement{})
			}
		} else {
			c := cands[b]
			if err := nodes[c.Node].Assign(r, c.Devices); err != nil {
				return Result{}, fmt.Errorf("pod %s: the policy chose what the ledger refuses: %w", p.Name, err)
			}
			movable[r.Tenant] = p.Movable
			s.changed(c.Node)
			alloc += p.GPURequest()
			if cfg.Given {
				pl := Placement{Node: nodes[c.Node].Name}
				if r.Devices > 0 {
					pl.Group = strconv.Itoa(c.Devices[0])
				}
				res.Placed = append(res.Placed, pl)
			}
		}
		res.Samples = append(res.Samples, Sample{ArrivedMilli: arrived, AllocMilli: alloc, Frag: s.frag})
	}
	if progress != nil {
		progress(len(workload), len(workload))
	}
	res.Elapsed = time.Since(start)
	return res, nil
}

// podKey identifies pods that every policy rates alike on a given node.
type rateKey struct {
	cpu, mem, milli int64
	num             int
	spec            string
}

func keyOf(p PodSpec) rateKey {
	return rateKey{cpu: p.CPUMilli, mem: p.MemoryMiB, milli: p.GPUMilli, num: p.NumGPU, spec: strings.Join(p.GPUSpec, "|")}
}

type rating struct {
	ok     bool
	choice placement.Choice
}

// state is the run's bookkeeping: each node's fragmentation and, since a
// node's ratings change only when a pod lands on it, a cache of ratings
// per pod shape, dropped when the node changes. The cache is what makes
// a 10,000-pod run over 1,213 nodes take seconds; the ratings themselves
// are the policy's.
type state struct {
	nodes    []*gpu.Node
	policy   placement.Policy
	shapes   []placement.Shape
	cache    []map[rateKey]rating
	nodeFrag []float64
	frag     float64
	cached   bool
}

func newState(nodes []*gpu.Node, policy placement.Policy, shapes []placement.Shape) *state {
	s := &state{nodes: nodes, policy: policy, shapes: shapes, cache: make([]map[rateKey]rating, len(nodes)), nodeFrag: make([]float64, len(nodes))}
	_, random := policy.(placement.Random)
	s.cached = !random
	for i, n := range nodes {
		s.cache[i] = map[rateKey]rating{}
		s.nodeFrag[i] = placement.Fragmentation(n, s.shapes)
		s.frag += s.nodeFrag[i]
	}
	return s
}

func (s *state) rate(ni int, key rateKey, r gpu.Request) (placement.Choice, bool) {
	if s.cached {
		if c, ok := s.cache[ni][key]; ok {
			return c.choice, c.ok
		}
	}
	n := s.nodes[ni]
	var c rating
	if fit, unfit := n.Fit(r); unfit == nil {
		c = rating{ok: true, choice: s.policy.Score(n, r, fit)}
	}
	if s.cached {
		s.cache[ni][key] = c
	}
	return c.choice, c.ok
}

// apply moves a consolidation plan's tenants (its node indices are into
// order), leaving the room the plan made for the pending pod.
func (s *state) apply(order []int, plan placement.Plan) error {
	// Every tenant leaves before any lands, as the plan was booked.
	for _, m := range plan.Moves {
		if err := s.nodes[order[m.From]].Release(m.Tenant); err != nil {
			return fmt.Errorf("consolidation: %w", err)
		}
		s.changed(order[m.From])
	}
	for _, m := range plan.Moves {
		if err := s.nodes[order[m.To]].Assign(m.Request, m.Devices); err != nil {
			return fmt.Errorf("consolidation moved %s where the ledger refuses it: %w", m.Tenant, err)
		}
		s.changed(order[m.To])
	}
	return nil
}

func (s *state) changed(ni int) {
	clear(s.cache[ni])
	f := placement.Fragmentation(s.nodes[ni], s.shapes)
	s.frag += f - s.nodeFrag[ni]
	s.nodeFrag[ni] = f
}

// Curve is a run discretised as the study reports it: for each whole
// percent of arrived workload, the mean allocation and fragmentation (in
// % of the cluster's GPUs) over the pods that arrived at that percent,
// rounded half to even.
type Curve struct {
	Arrived []int
	Alloc   []float64
	Frag    []float64
	// FragRate is the fragmentation amount as a % of the idle GPUs.
	FragRate []float64
}

// Discrete returns the run's curve for 0..maxPct arrived.
func (r Result) Discrete(maxPct int) Curve {
	sumA := make([]float64, maxPct+1)
	sumF := make([]float64, maxPct+1)
	sumR := make([]float64, maxPct+1)
	cnt := make([]int, maxPct+1)
	capacity := float64(r.CapacityMilli)
	for _, s := range r.Samples {
		pct := int(math.RoundToEven(float64(s.ArrivedMilli) / capacity * 100))
		if pct < 0 || pct > maxPct {
			continue
		}
		sumA[pct] += math.Round(float64(s.AllocMilli)/capacity*1e4) / 100
		sumF[pct] += s.Frag / capacity * 100
		if idle := capacity - float64(s.AllocMilli); idle > 0 {
			sumR[pct] += s.Frag / idle * 100
		}
		cnt[pct]++
	}
	var c Curve
	for pct := 0; pct <= maxPct; pct++ {
		a, f, fr, n := sumA[pct], sumF[pct], sumR[pct], cnt[pct]
		if n == 0 { // the study falls back to the neighbouring percents
			for _, q := range []int{pct - 1, pct + 1} {
				if q >= 0 && q <= maxPct {
					a, f, fr, n = a+sumA[q], f+sumF[q], fr+sumR[q], n+cnt[q]
				}
			}
		}
		if n == 0 {
			continue
		}
		c.Arrived = append(c.Arrived, pct)
		c.Alloc = append(c.Alloc, math.Round(a/float64(n)*100)/100)
		c.Frag = append(c.Frag, math.Round(f/float64(n)*100)/100)
		c.FragRate = append(c.FragRate, math.Round(fr/float64(n)*100)/100)
	}
	return c
}

// At returns the curve's value at pct arrived (NaN when it has none).
func (c Curve) At(values []float64, pct int) float64 {
	for i, a := range c.Arrived {
		if a == pct {
			return values[i]
		}
	}
	return math.NaN()
}
