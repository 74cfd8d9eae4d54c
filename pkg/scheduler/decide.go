package scheduler

import (
	"fmt"
	"math"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// Ask is what one pod asks of a node: whole GPUs, or a fraction on each of
// Request.Devices GPUs, or no GPU at all; and CPU and memory, which the
// policies weigh (kube-scheduler's own plugins check that they fit).
type Ask struct {
	UID   types.UID
	Whole int
	// Fraction is set for a fractional pod.
	Fraction *api.Request
	// CPU (milli-CPU) and MemoryMiB are the pod's requests as
	// kube-scheduler counts them.
	CPU, MemoryMiB int64
	// Charged says the pod carries a GPU memory charge (api.ChargedMiB);
	// ChargeMiB is what of it is left for the annotation share once its
	// claims are counted. A share is never placed where it would hold more
	// than that: the namespace's quota counted the charge, not the share.
	Charged   bool
	ChargeMiB int64
	// DeviceGPUs is nvidia.com/gpu as kube-scheduler counts the pod's
	// requests (sidecars and init containers as NodeResourcesFit adds
	// them), against the node's allocatable; Whole is what the ledger
	// books.
	DeviceGPUs int64
}

// GPU says whether the pod asks for a GPU, whole or shared.
func (a Ask) GPU() bool { return a.Whole > 0 || a.Fraction != nil }

// Host is a node's CPU (milli-CPU) and memory (MiB): allocatable, and
// already requested by its pods, as kube-scheduler's NodeInfo counts them.
type Host struct {
	CPU, CPUUsed, MemoryMiB, MemoryUsedMiB int64
}

// Verdict is a node's answer to an Ask in Filter.
type Verdict struct {
	// Fits is true when the node can take the pod.
	Fits bool
	// Resolvable is false when no change of the GPUs' tenants would let
	// the pod in (no inventory, not ready, a share that resolves to 0).
	Resolvable bool
	// Reason is one line, the same for every node that fails the same way,
	// so that kube-scheduler's FailedScheduling event groups nodes by it.
	Reason string
}

// request is the ledger request for ask on ns, or why it has none.
func (c *Cache) request(ns *nodeState, ask Ask) (gpu.Request, api.Resolved, error) {
	r := gpu.Request{Tenant: string(ask.UID), CPU: ask.CPU, Memory: ask.MemoryMiB}
	if ask.Fraction == nil {
		r.Whole = ask.Whole
		return r, api.Resolved{}, nil
	}
	share, resolved, err := shareOn(*ask.Fraction, ns.Inventory)
	if err != nil {
		return r, resolved, err
	}
	r.Devices, r.Share = ask.Fraction.Devices, share
	return r, resolved, nil
}

// Filter says whether a node can take the pod, its whole GPUs counted by
// the ledger alone.
func (c *Cache) Filter(node string, ask Ask) Verdict {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ns, ok := c.nodes[node]
	return c.filter(ns, ok, ask, nil)
}

// FilterAt is Filter on the scheduler's snapshot of a node, applied first
// when it is newer than the Node this cache last recorded. The scheduler's
// queue and this cache follow the same informer through separate
// handlers, in no set order: a pod requeued by the update that made a
// node ready can be filtered before the cache has seen that update, and
// no later event would requeue it (only kube-scheduler's five-minute
// flush). A node the cache knows only from its pods takes the snapshot
// too; one it does not know at all is left to its Add event: a deleted
// node still in a snapshot must not come back.
//
// v is what the scheduler's NodeInfo and the cycle say beyond the cache:
// the device plugin's GPUs, and preemption's what-if (preempt.go).
func (c *Cache) FilterAt(node *corev1.Node, ask Ask, v view) Verdict {
	c.mu.RLock()
	ns, ok := c.nodes[node.Name]
	if ok && ns.seen != node && (ns.seen == nil || olderVersion(ns.seen.ResourceVersion, node.ResourceVersion)) {
		c.mu.RUnlock()
		c.SetNode(node)
		c.mu.RLock()
		ns, ok = c.nodes[node.Name]
	}
	defer c.mu.RUnlock()
	return c.filter(ns, ok, ask, &v)
}

// filter is Filter's verdict on a node's state (ok: the node is known),
// with v applied when given; the caller holds the read lock.
func (c *Cache) filter(ns *nodeState, ok bool, ask Ask, v *view) Verdict {
	ledger, reclaimable := (*gpu.Node)(nil), int64(0)
	if ok && ns.Ledger != nil {
		ledger = ns.Ledger
		if v != nil && v.whatIf.changes() {
			ledger, reclaimable = c.whatIfLedger(ns, *v)
		}
	}
	if ask.Fraction == nil {
		// Whole GPUs: the device plugin's, as kube-scheduler counts them
		// (with what a preemption would free), and on the ledger, where
		// the shared ones are kept out of reach.
		if v != nil {
			if verdict, fits := wholeVerdict(ask, *v, reclaimable); !fits {
				return verdict
			}
		}
		if ledger == nil {
			return Verdict{Fits: true}
		}
		r, _, _ := c.request(ns, ask)
		if _, unfit := ledger.Fit(r); unfit != nil {
			return Verdict{Resolvable: true, Reason: fmt.Sprintf("%s: fewer than %d idle GPUs (GPUs shared by fractions are not given whole)", gpu.ReasonWhole, ask.Whole)}
		}
		return Verdict{Fits: true}
	}
	switch {
	case !ok:
		return Verdict{Reason: "node has not reported its GPUs to gpufrac yet"}
	case !ns.Ready:
		return Verdict{Reason: ns.Why}
	}
	if theirs := ns.otherReservations; theirs != "" {
		// Its agent would never tell this scheduler's reservation pods
		// their GPU: the share would wait for ever. Set it once, alike.
		return Verdict{Reason: fmt.Sprintf("the node's agent finds reservation pods in namespace %s (its --reservation-namespace), and this scheduler creates them in %s (reservationNamespace): give both the same",
			theirs, c.args.ReservationNamespace)}
	}
	if silent, why := ns.heartbeat.Silent(c.now()); silent {
		// Ready as last published, but nobody has renewed it: a killed
		// agent clears nothing. One that starts again flips its
		// condition (AgentStarting, then Ready), which retries the pod.
		return Verdict{Resolvable: true, Reason: why}
	}
	if len(ns.Conflicts) > 0 {
		return Verdict{Resolvable: true, Reason: fmt.Sprintf("node has %d pod(s) holding GPUs that gpufrac cannot account for; it takes no fractions until they are gone (see gpufrac audit)", len(ns.Conflicts))}
	}
	r, resolved, err := c.request(ns, ask)
	if err != nil {
		return Verdict{Reason: err.Error()}
	}
	if ask.Charged && api.HeldMiB(resolved.LimitMiB, r.Devices) > ask.ChargeMiB {
		return Verdict{Reason: fmt.Sprintf("the share would hold more GPU memory on this node's GPUs than the %s charged to its namespace's quota (%s) when the pod was created, against the largest GPU known then; ask with gpu-memory to be charged exactly",
			api.FormatMiB(ask.ChargeMiB), api.ResourceGPUMemory)}
	}
	if _, unfit := ledger.Fit(r); unfit != nil {
		return Verdict{Resolvable: true, Reason: explain(unfit.Reason, r)}
	}
	return Verdict{Fits: true}
}

// explain words a rejection without the node's own figures, so that nodes
// rejecting a pod for the same reason read the same.
func explain(reason gpu.Reason, r gpu.Request) string {
	n := r.Devices
	switch reason {
	case gpu.ReasonModel:
		// The plugin asks for no model: the node has too few GPUs.
		return fmt.Sprintf("NotEnoughGPUs: the node has fewer than %d GPUs", n)
	case gpu.ReasonGPUs:
		return fmt.Sprintf("%s: fewer than %d GPU(s) with %dMi of memory free", reason, n, r.Share.Request)
	case gpu.ReasonMode:
		return fmt.Sprintf("%s: fewer than %d GPU(s) with %dMi free that are idle or already run %s", reason, n, r.Share.Request, r.Share.Mode)
	case gpu.ReasonUnheld:
		return fmt.Sprintf("%s: fewer than %d GPU(s) open to new shares (a GPU whose shares lost their reservation pod takes no new one until they end; see gpufrac audit)", reason, n)
	case gpu.ReasonCompute:
		return fmt.Sprintf("%s: fewer than %d GPU(s) with %d/1000 of their sm-sharing compute left", reason, n, r.Share.Portion)
	}
	return fmt.Sprintf("%s: the request does not fit", reason)
}

// Score rates the node for the pod with the policy; higher is better. The
// second result is false when the node cannot take the pod. A pod without
// GPUs is rated too, on every node: where it lands decides which GPUs its
// CPU and memory strand, as the simulator rates it.
func (c *Cache) Score(node string, ask Ask, policy placement.Policy, host Host) (float64, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	choice, ok := c.choose(node, ask, policy, host)
	return choice.Score, ok
}

// noGPUs is the ledger of a node without GPUs (or whose GPUs are not
// known yet), for rating pods that ask for none.
var noGPUs = gpu.NewNode("", 0, 0)

func (c *Cache) choose(node string, ask Ask, policy placement.Policy, host Host) (placement.Choice, bool) {
	ns, ok := c.nodes[node]
	ledger := noGPUs
	var r gpu.Request
	switch {
	case ok && ns.Ledger != nil:
		var err error
		if r, _, err = c.request(ns, ask); err != nil {
			return placement.Choice{}, false
		}
		ledger = ns.Ledger
	case ask.GPU():
		return placement.Choice{}, false
	default:
		r = gpu.Request{Tenant: string(ask.UID), CPU: ask.CPU, Memory: ask.MemoryMiB}
	}
	var view *gpu.Node
	if ok {
		ns.viewMu.Lock()
		defer ns.viewMu.Unlock()
		view = ledger.WithHostIn(&ns.view, host.CPU, host.CPUUsed, host.MemoryMiB, host.MemoryUsedMiB)
	} else {
		view = ledger.WithHost(host.CPU, host.CPUUsed, host.MemoryMiB, host.MemoryUsedMiB)
	}
	view.Name = node // the policies' rank is the node's, not the stand-in's
	fit, unfit := view.Fit(r)
	if unfit != nil {
		return placement.Choice{}, false
	}
	choice := policy.Score(view, r, fit)
	if math.IsNaN(choice.Score) {
		choice.Score = math.Inf(-1)
	}
	return choice, true
}

// Reserve assumes the pod on the node: the policy's GPUs, joining the GPU
// groups already on them or opening new ones. Whole-GPU pods are assumed
// too, so that no fraction is placed on their GPUs meanwhile.
func (c *Cache) Reserve(node, namespace, name string, ask Ask, policy placement.Policy, host Host) error {
	if !ask.GPU() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, held := c.where[ask.UID]; held {
		return fmt.Errorf("pod %s/%s already holds GPUs", namespace, name)
	}
	ns, ok := c.nodes[node]
	if !ok || ns.Ledger == nil {
		if ask.Fraction != nil {
			return fmt.Errorf("node %s has no GPU inventory", node)
		}
		return nil
	}
	choice, ok := c.choose(node, ask, policy, host)
	if !ok || len(choice.Devices) == 0 {
		return fmt.Errorf("pod %s/%s no longer fits node %s", namespace, name, node)
	}
	r, resolved, _ := c.request(ns, ask)
	// The ledger books GPUs; the host's CPU and memory are kube-scheduler's.
	r.CPU, r.Memory = 0, 0
	t := &ledgers.Tenant{Request: r, Pod: namespace + "/" + name}
	if ask.Fraction == nil {
		// Whole GPUs go where the policy chose (place would take the
		// lowest idle ones).
		if err := ns.Ledger.Assign(r, choice.Devices); err != nil {
			return err
		}
		c.register(ns, t)
		c.assumed[ask.UID] = true
		return nil
	}
	t.Assignment = &api.Assignment{Container: ask.Fraction.Container, RequestMiB: resolved.RequestMiB, LimitMiB: resolved.LimitMiB, Mode: r.Share.Mode}
	for _, slot := range preferHeld(ns, choice.Devices) {
		g := groupAt(ns, slot)
		if g == "" {
			// A new group opens on the GPU the policy chose.
			g = newGroup()
			ns.Groups[g] = slot
		}
		t.Groups = append(t.Groups, g)
	}
	c.add(ns, t)
	c.assumed[ask.UID] = true
	if why, conflict := ns.Conflicts[string(ask.UID)]; conflict {
		c.remove(ns, ask.UID)
		return fmt.Errorf("pod %s/%s cannot be assumed on node %s: %s", namespace, name, node, why)
	}
	return nil
}

// preferHeld swaps each idle GPU of the policy's choice that would open a
// new group for an idle GPU of the node whose reservation pod is kept for
// shares, while there is one: to a share, idle GPUs of a node are alike
// (one model, no tenant, no mode), but joining a kept group costs no new
// reservation pod (a create and the node agent's write), and the GPU no
// reservation pod holds stays free for whole-GPU pods.
func preferHeld(ns *nodeState, chosen []int) []int {
	out := slices.Clone(chosen)
	for i, slot := range out {
		if !ns.Ledger.Devices[slot].Idle() || groupAt(ns, slot) != "" {
			continue
		}
		for k, d := range ns.Ledger.Devices {
			if d.Idle() && !slices.Contains(out, k) && groupAt(ns, k) != "" {
				out[i] = k
				break
			}
		}
	}
	return out
}

// Reclaim makes room for a pod that asks for whole GPUs and fits none of
// the nodes only because idle reservation pods, kept for shares, hold
// GPUs there: on the node among nodes that needs the fewest, it retires
// that many (no share joins them again, nor does anything take their
// GPUs) and returns them for the caller to delete. It returns "" when no
// node would fit that way.
func (c *Cache) Reclaim(whole int, nodes []string) (string, []Orphan) {
	c.mu.Lock()
	defer c.mu.Unlock()
	best, need := "", 0
	for _, name := range slices.Sorted(slices.Values(nodes)) {
		ns, ok := c.nodes[name]
		if !ok || ns.Ledger == nil {
			continue
		}
		// GPUs retired and not yet gone count as free: the pod waits for
		// them rather than have more taken back.
		short := whole - ns.unheld() - ns.retiringCount()
		if short <= 0 || (best != "" && short >= need) || len(ns.keptIdle()) < short {
			continue // GPUs are not what it lacks here, another node needs fewer, or too few are kept
		}
		best, need = name, short
	}
	if best == "" {
		return "", nil
	}
	ns := c.nodes[best]
	var out []Orphan
	for _, g := range c.retireIdle(ns, need) {
		r := ns.Reservations[g]
		out = append(out, Orphan{Namespace: c.args.ReservationNamespace, Name: r.Name, UID: r.UID, node: best, group: g})
	}
	return best, out
}

// Unreserve forgets a pod this scheduler assumed and did not bind.
func (c *Cache) Unreserve(uid types.UID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if node, ok := c.where[uid]; ok && c.assumed[uid] {
		c.remove(c.node(node), uid)
	}
}

// Decision is what PreBind writes for a fractional pod.
type Decision struct {
	Node      string
	Container string
	Groups    []string
	Resolved  api.Resolved
	Mode      api.ComputeMode
	// Portion is in thousandths.
	Portion int64
}

// Decision returns the assumed decision for a pod.
func (c *Cache) Decision(uid types.UID) (Decision, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ns, t, ok := c.tenant(uid)
	if !ok || len(t.Groups) == 0 || t.Assignment == nil {
		return Decision{}, false
	}
	a := t.Assignment
	return Decision{Node: ns.Name, Container: a.Container, Groups: slices.Clone(t.Groups), Resolved: api.Resolved{RequestMiB: a.RequestMiB, LimitMiB: a.LimitMiB},
		Mode: t.Request.Share.Mode, Portion: t.Request.Share.Portion}, true
}

// ReservationState says whether a GPU group's reservation pod is known
// and, once the node agent has written it, its GPU's UUID.
func (c *Cache) ReservationState(node, group string) (known bool, uuid, failed string) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ns, ok := c.nodes[node]
	if !ok {
		return false, "", ""
	}
	r, ok := ns.Reservations[group]
	if !ok {
		return false, "", ""
	}
	return true, r.UUID, r.Failure
}

// Orphan is a reservation pod to delete: its GPU group has no tenant and
// takes none.
type Orphan struct {
	Namespace, Name string
	UID             types.UID
	node, group     string
}

// Orphans lists the reservation pods to delete (see orphan), so that
// their GPUs go back to the device plugin.
func (c *Cache) Orphans() []Orphan {
	c.mu.RLock()
	defer c.mu.RUnlock()
	var out []Orphan
	for name, ns := range c.nodes {
		for g, r := range ns.Reservations {
			if c.orphan(ns, g) {
				out = append(out, Orphan{Namespace: c.args.ReservationNamespace, Name: r.Name, UID: r.UID, node: name, group: g})
			}
		}
	}
	return out
}

// StillOrphan says whether an orphan still has no tenant: checked again
// just before it is deleted. An orphan's group is not joinable (see
// nodeState.joinable), so it never gains a tenant (and group names are
// never reused): the answer cannot change after this.
func (c *Cache) StillOrphan(o Orphan) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ns, ok := c.nodes[o.node]
	if !ok {
		return true
	}
	r, ok := ns.Reservations[o.group]
	return !ok || r.UID != o.UID || c.orphan(ns, o.group)
}

// orphan says whether a GPU group's reservation pod is to be deleted: no
// tenant, and no share may join it any more (it failed, it is being
// reclaimed for a whole-GPU pod, or it is a standing group the node no
// longer asks for). An idle reservation pod otherwise is kept: the next
// share on its GPU joins it.
func (c *Cache) orphan(ns *nodeState, g string) bool {
	// A standing pod the kubelet refused holds nothing: delete it, and
	// the collector makes it again.
	return !c.live(ns, g) && !ns.Joinable(g)
}

// live says whether a GPU group has a tenant.
func (c *Cache) live(ns *nodeState, g string) bool {
	slot, ok := ns.Groups[g]
	return ok && ns.Ledger != nil && shared(ns.Ledger.Devices[slot])
}

// Shapes returns the workload's typical shapes, as the FGD-like policies
// weigh them: every live pod the cache has seen, bound or still pending
// (the demand the policy plans for, as the simulator's estimate counts
// every pod of its trace), with its CPU and, per shape, the mean memory.
// A fraction is sized on the cluster's most common GPU. The capacity is
// the largest node's CPU and summed GPU memory, for the policies that
// normalise by it; the supply is every node's CPU and GPUs in all, with
// a whole GPU as that most common GPU.
func (c *Cache) Shapes() ([]placement.Shape, placement.Capacity, placement.Supply) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	capacity := placement.Capacity{CPU: 1, GPU: 1}
	var supply placement.Supply
	usable := map[int64]int{}
	for _, ns := range c.nodes {
		if ns.seen == nil {
			continue // no Node (yet, or any more): nothing to place on
		}
		capacity.CPU = max(capacity.CPU, ns.cpu)
		supply.CPU += ns.cpu
		if ns.Ledger == nil {
			continue
		}
		supply.GPUs += int64(len(ns.Ledger.Devices))
		var sum int64
		for _, d := range ns.Ledger.Devices {
			sum += d.Schedulable()
		}
		capacity.GPU = max(capacity.GPU, sum)
		usable[ns.Inventory.SchedulableMiB()]++
	}
	var common int64
	for mib, n := range usable {
		if n > usable[common] || (n == usable[common] && mib > common) {
			common = mib
		}
	}
	keys := make([]placement.Key, 0, len(c.workload))
	mems := make([]int64, 0, len(c.workload))
	for _, d := range c.workload {
		key := placement.Key{CPU: d.cpu, NumGPU: d.whole}
		if f := d.fraction; f != nil {
			mib, err := f.Memory.Resolve(common, 0)
			if err != nil {
				continue // no GPU known yet to size it on
			}
			key.NumGPU, key.Share = f.Devices, mib
		}
		keys, mems = append(keys, key), append(mems, d.memoryMiB)
	}
	supply.Unit = common
	return placement.WithMemory(placement.Popular(keys, placement.Coverage), keys, mems), capacity, supply
}
