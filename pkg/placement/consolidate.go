package placement

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// Consolidator plans moving running tenants that may move so that a
// request that fits nowhere fits on one node (KAI Scheduler's
// consolidation, for fractions: a whole-GPU pod waits while GPUs each hold
// a small share). A plan is made only when it provably works on the
// ledgers: the request fits the target once the moved tenants are gone,
// and every moved tenant fits somewhere else, placed by Policy in turn,
// the request already booked. It never moves more than MaxMoves tenants.
//
// The planner is pure: the simulator applies a plan to its ledgers, the
// scheduler evicts the moved pods (their controllers make them again) and
// holds the target for the pending pod.
type Consolidator struct {
	Policy Policy
	// MaxMoves is the most tenants one plan may move; 0 plans nothing.
	MaxMoves int
	// Movable says whether the tenant on node may be moved (an opt-in,
	// a priority rule); nil moves nothing.
	Movable func(node int, tenant string) bool
	// Emptied, if set, is told of a copy of a node's ledger with tenants
	// released, before the request is fitted there: the scheduler opens
	// GPUs that only an idle reservation pod would hold.
	Emptied func(node int, l *gpu.Node)
	// On, if set, is the request as it stands on a node (a fraction's
	// memory depends on the GPU's), false where it cannot go at all; nil
	// asks the same everywhere.
	On func(node int, r gpu.Request) (gpu.Request, bool)
	// MoveTo, if set, is a moved tenant's request as it would stand on
	// node (its share's memory there), false where it cannot go at all
	// (its pod's node selector, taints, the host's CPU and memory with
	// the plan's earlier moves there: moved, the tenants it moves to that
	// node before this one); nil lets it go wherever its GPU room fits.
	MoveTo func(tenant string, node int, moved []string, r gpu.Request) (gpu.Request, bool)
}

// Move is one tenant moved from node From to node To's Devices.
type Move struct {
	Tenant   string
	From, To int
	Request  gpu.Request
	Devices  []int
}

// Plan is a consolidation: the moves, then the request on Node's Devices.
type Plan struct {
	Node    int
	Devices []int
	Moves   []Move
}

// Plan returns the plan for r over nodes (indices into nodes) that moves
// the fewest tenants, the earliest target node on a tie, and whether
// there is one. Nodes are only read.
func (c Consolidator) Plan(nodes []*gpu.Node, r gpu.Request) (Plan, bool) {
	if c.MaxMoves <= 0 || c.Movable == nil || c.Policy == nil {
		return Plan{}, false
	}
	type target struct {
		node    int
		r       gpu.Request
		tenants []string
	}
	var targets []target
	for i, n := range nodes {
		ri, ok := r, true
		if c.On != nil {
			ri, ok = c.On(i, r)
		}
		if !ok || ri.Devices > 1 || (ri.Whole == 0 && ri.Devices == 0) {
			continue // shares of several GPUs are not planned for; a pod without GPUs has nothing to gain
		}
		if t, ok := c.toFree(i, n, ri); ok && len(t) > 0 && len(t) <= c.MaxMoves {
			targets = append(targets, target{i, ri, t})
		}
	}
	slices.SortStableFunc(targets, func(a, b target) int { return cmp.Compare(len(a.tenants), len(b.tenants)) })
	// A moved tenant must fit some node as the cluster stands (the target
	// too, on GPUs the plan does not free): its pod is made again and
	// scheduled like any other. Checked once per kind of request, before
	// a plan is booked in full.
	fits := map[string]bool{}
	roomFor := func(req gpu.Request) bool {
		key := fmt.Sprintf("%d/%d/%d/%d/%d/%s/%d/%v", req.CPU, req.Memory, req.Whole, req.Devices, req.Share.Request, req.Share.Mode, req.Share.Portion, req.Models)
		ok, seen := fits[key]
		if !seen {
			req.Tenant = "consolidation-check"
			ok = slices.ContainsFunc(nodes, func(n *gpu.Node) bool {
				_, unfit := n.Fit(req)
				return unfit == nil
			})
			fits[key] = ok
		}
		return ok
	}
	tried := 0
	for _, t := range targets {
		if !slices.ContainsFunc(t.tenants, func(tenant string) bool {
			req, _, _ := nodes[t.node].Held(tenant)
			return !roomFor(req)
		}) {
			if plan, ok := c.try(nodes, t.r, t.node, t.tenants); ok {
				return plan, true
			}
			if tried++; tried == maxTargets {
				break
			}
		}
	}
	return Plan{}, false
}

// maxTargets bounds the plans booked in full for one request, as KAI's
// consolidation bounds the jobs it tries (--max-consolidation-preemptees):
// each costs a pass of the policy over every node per moved tenant.
const maxTargets = 16

// toFree picks the fewest movable tenants of node i whose leaving lets r
// fit there by its GPUs (whole GPUs: the k GPUs with the fewest tenants,
// every one movable; a share: the GPU freed by the fewest moves, its
// largest movable shares first).
func (c Consolidator) toFree(i int, n *gpu.Node, r gpu.Request) ([]string, bool) {
	movable := func(d *gpu.Device) ([]string, bool) {
		if d.Whole() != "" || (len(r.Models) > 0 && !slices.Contains(r.Models, d.Model)) {
			return nil, false
		}
		var ts []string
		for t := range d.Shares() {
			if !c.Movable(i, t) {
				return nil, false
			}
			ts = append(ts, t)
		}
		slices.Sort(ts)
		return ts, true
	}
	if r.Whole > 0 {
		var costs [][]string
		for _, d := range n.Devices {
			if d.Idle() && d.SharedOnly {
				continue // held for shares for good: no move opens it
			}
			if ts, ok := movable(d); ok {
				costs = append(costs, ts)
			}
		}
		if len(costs) < r.Whole {
			return nil, false
		}
		slices.SortStableFunc(costs, func(a, b []string) int { return cmp.Compare(len(a), len(b)) })
		var out []string
		for _, ts := range costs[:r.Whole] {
			out = append(out, ts...)
		}
		slices.Sort(out) // a share over several GPUs moves once
		return slices.Compact(out), true
	}
	var best []string
	found := false
	for _, d := range n.Devices {
		if d.Whole() != "" || (len(r.Models) > 0 && !slices.Contains(r.Models, d.Model)) {
			continue
		}
		shares := d.Shares()
		var ts []string
		for t := range shares {
			if c.Movable(i, t) {
				ts = append(ts, t)
			}
		}
		slices.SortFunc(ts, func(a, b string) int {
			return cmp.Or(cmp.Compare(shares[b].Request, shares[a].Request), cmp.Compare(a, b))
		})
		free, mode := d.Free(), r.Share.Mode
		var out []string
		for _, t := range ts {
			if free >= r.Share.Request && !modeClash(shares, out, mode) {
				break
			}
			out = append(out, t)
			free += shares[t].Request
		}
		if len(out) == 0 || free < r.Share.Request || modeClash(shares, out, mode) {
			continue // room without moves that Fit refuses (held, closed), or none with them
		}
		if !found || len(out) < len(best) {
			best, found = out, true
		}
	}
	return best, found
}

// modeClash says whether a share of another compute mode stays on the GPU
// once gone have left.
func modeClash(shares map[string]gpu.Share, gone []string, mode api.ComputeMode) bool {
	for t, s := range shares {
		if s.Mode != mode && !slices.Contains(gone, t) {
			return true
		}
	}
	return false
}

// try books the plan on copies of the nodes it touches: the tenants off
// the target, r onto it, each moved tenant (largest first) where Policy
// places it among the nodes that fit it.
func (c Consolidator) try(nodes []*gpu.Node, r gpu.Request, ti int, tenants []string) (Plan, bool) {
	copies := map[int]*gpu.Node{}
	at := func(i int) *gpu.Node {
		if l, ok := copies[i]; ok {
			return l
		}
		return nodes[i]
	}
	own := func(i int) *gpu.Node {
		if _, ok := copies[i]; !ok {
			copies[i] = nodes[i].Clone()
		}
		return copies[i]
	}
	target := own(ti)
	moves := make([]Move, 0, len(tenants))
	for _, t := range tenants {
		req, _, ok := target.Held(t)
		if !ok || target.Release(t) != nil {
			return Plan{}, false
		}
		moves = append(moves, Move{Tenant: t, From: ti, Request: req})
	}
	if c.Emptied != nil {
		c.Emptied(ti, target)
	}
	fit, unfit := target.Fit(r)
	if unfit != nil {
		return Plan{}, false
	}
	devices := c.Policy.Score(target, r, fit).Devices
	if err := target.Assign(r, devices); err != nil {
		return Plan{}, false
	}
	slices.SortStableFunc(moves, func(a, b Move) int { return cmp.Compare(size(b.Request), size(a.Request)) })
	landed := map[int][]string{} // moved tenants booked per node
	for m := range moves {
		var cands []Candidate
		var reqs []gpu.Request
		for i := range nodes {
			req, ok := moves[m].Request, true
			if c.MoveTo != nil {
				req, ok = c.MoveTo(moves[m].Tenant, i, landed[i], req)
			}
			if !ok {
				continue
			}
			n := at(i)
			if fit, unfit := n.Fit(req); unfit == nil {
				cands = append(cands, Candidate{Node: i, Choice: c.Policy.Score(n, req, fit)})
				reqs = append(reqs, req)
			}
		}
		b := Best(c.Policy, cands)
		if b < 0 {
			return Plan{}, false
		}
		to := cands[b]
		if err := own(to.Node).Assign(reqs[b], to.Devices); err != nil {
			return Plan{}, false
		}
		landed[to.Node] = append(landed[to.Node], moves[m].Tenant)
		moves[m].To, moves[m].Devices, moves[m].Request = to.Node, to.Devices, reqs[b]
	}
	return Plan{Node: ti, Devices: devices, Moves: moves}, true
}

// size orders moved tenants: whole GPUs, then the larger share, first.
func size(r gpu.Request) int64 {
	return int64(r.Whole)*1e12 + int64(r.Devices)*r.Share.Request
}
