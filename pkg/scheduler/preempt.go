package scheduler

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// Preemption goes through kube-scheduler's own DefaultPreemption, which
// weighs each candidate node by removing every lower-priority pod from a
// copy of it, checking that the preemptor then fits, and adding the pods
// back, most important first, as long as it still fits; what it could
// not add back are the victims (PDB-protected ones are tried first).
// The framework tells the plugins what it removes and adds through the
// PreFilter extensions, on a copy of the cycle state made for that node
// ("AddPod is called by the framework while trying to evaluate the impact
// of adding podToAdd to the node": kube-scheduler/framework, interface.go;
// DefaultPreemption.SelectVictimsOnNode). It asks the same of a node with
// nominated pods: RunFilterPluginsWithNominatedPods adds each pod
// nominated there with a priority at least the pod's before filtering it,
// so the room a preemptor freed is held for it.
//
// This plugin keeps its own ledger rather than count from NodeInfo, so it
// records those removals and additions in the cycle state (whatIfs), and
// Filter weighs a node's ledger with them applied (Cache.FilterAt). Each
// change is recorded by pod UID, never applied to the cache: the cache's
// ledger is what runs, and a preemption that is weighed and not chosen
// changes nothing.

// whatIf is what preemption's simulation changed on one node.
type whatIf struct {
	// removed are the pods weighed as victims, with the ledger tenants
	// each one's end frees: its own share or GPUs, and the shares of the
	// claims only it uses (the claim is deallocated once its last consumer
	// goes: the resourceclaim controller's syncClaim).
	removed map[types.UID][]string
	// added are pods booked on top of the node's tenants: pods nominated
	// to it (a preemptor waiting for its victims to go).
	added map[types.UID]*corev1.Pod
}

func (w *whatIf) changes() bool { return w != nil && len(w.removed)+len(w.added) > 0 }

// whatIfs are the simulation's changes by node. The framework clones the
// cycle state for each node it weighs, so the clone is deep.
type whatIfs map[string]*whatIf

// Clone implements fwk.StateData.
func (ws whatIfs) Clone() fwk.StateData {
	out := make(whatIfs, len(ws))
	for node, w := range ws {
		c := &whatIf{removed: make(map[types.UID][]string, len(w.removed)), added: maps.Clone(w.added)}
		for uid, keys := range w.removed {
			c.removed[uid] = slices.Clone(keys)
		}
		out[node] = c
	}
	return out
}

const whatIfKey fwk.StateKey = Name + "/what-if"

// readWhatIf is the simulation's changes on a node; nil when none.
func readWhatIf(state fwk.CycleState, node string) *whatIf {
	raw, err := state.Read(whatIfKey)
	if err != nil {
		return nil
	}
	ws, _ := raw.(whatIfs)
	return ws[node]
}

// editWhatIf is the node's changes in state, made when absent.
func editWhatIf(state fwk.CycleState, node string) *whatIf {
	var ws whatIfs
	if raw, err := state.Read(whatIfKey); err == nil {
		ws, _ = raw.(whatIfs)
	}
	if ws == nil {
		ws = whatIfs{}
		state.Write(whatIfKey, ws)
	}
	w, ok := ws[node]
	if !ok {
		w = &whatIf{removed: map[types.UID][]string{}, added: map[types.UID]*corev1.Pod{}}
		ws[node] = w
	}
	return w
}

// PreFilterExtensions implements fwk.PreFilterPlugin: preemption's what-if
// removals and additions, which Filter weighs on the node's ledger.
func (p *Plugin) PreFilterExtensions() fwk.PreFilterExtensions { return p }

// AddPod implements fwk.PreFilterExtensions: a victim reprieved, or a
// nominated pod whose room is held.
func (p *Plugin) AddPod(_ context.Context, state fwk.CycleState, _ *corev1.Pod, info fwk.PodInfo, nodeInfo fwk.NodeInfo) *fwk.Status {
	if nodeInfo.Node() == nil {
		return fwk.NewStatus(fwk.Error, "node not found")
	}
	pod, node := info.GetPod(), nodeInfo.Node().Name
	if pod.Namespace == p.args.ReservationNamespace {
		return nil // their GPUs are their groups', which the tenants decide
	}
	w := editWhatIf(state, node)
	if _, ok := w.removed[pod.UID]; ok {
		delete(w.removed, pod.UID)
		return nil
	}
	if p.cache.Holds(pod.UID, node) {
		return nil // already a tenant there (assumed, or bound)
	}
	w.added[pod.UID] = pod
	return nil
}

// RemovePod implements fwk.PreFilterExtensions: a pod weighed as a victim.
func (p *Plugin) RemovePod(_ context.Context, state fwk.CycleState, _ *corev1.Pod, info fwk.PodInfo, nodeInfo fwk.NodeInfo) *fwk.Status {
	if nodeInfo.Node() == nil {
		return fwk.NewStatus(fwk.Error, "node not found")
	}
	pod, node := info.GetPod(), nodeInfo.Node().Name
	if pod.Namespace == p.args.ReservationNamespace {
		// Never lower than a preemptor (system-node-critical), so never
		// weighed; a group's pod goes when its tenants have (Reclaim).
		return nil
	}
	w := editWhatIf(state, node)
	if _, ok := w.added[pod.UID]; ok {
		delete(w.added, pod.UID)
		return nil
	}
	w.removed[pod.UID] = append([]string{string(pod.UID)}, p.claimTenantsFreedBy(pod)...)
	return nil
}

// claimTenantsFreedBy are the ledger tenants of the pod's claims of
// gpufrac's driver that only it uses: its end deallocates them. A claim
// shared with another pod stays allocated.
func (p *Plugin) claimTenantsFreedBy(pod *corev1.Pod) []string {
	if len(pod.Spec.ResourceClaims) == 0 || p.handle == nil || p.handle.SharedDRAManager() == nil {
		return nil
	}
	dra := p.handle.SharedDRAManager()
	var keys []string
	for i := range pod.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[i])
		if err != nil || name == nil {
			continue
		}
		claim, err := dra.ResourceClaims().Get(pod.Namespace, *name)
		if err != nil || !ours(claim) {
			continue
		}
		if r := claim.Status.ReservedFor; len(r) != 1 || r[0].UID != pod.UID {
			continue
		}
		keys = append(keys, p.cache.claimTenants(claim.UID)...)
	}
	return keys
}

// claimTenants are the ledger tenants of a claim's shares.
func (c *Cache) claimTenants(uid types.UID) []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	var keys []string
	for _, s := range c.claims[uid].shares {
		keys = append(keys, s.tenant.Request.Tenant)
	}
	return keys
}

// Holds says whether a pod is a tenant of the node in the cache.
func (c *Cache) Holds(uid types.UID, node string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	n, ok := c.where[uid]
	return ok && n == node
}

// Behind says whether the cache still holds a tenant pod on one of the
// nodes that the scheduler's snapshot no longer shows there (its
// namespace/name and node): the snapshot has seen it leave, this cache
// not yet. Claim shares are not pods, and are left out; so are the pairs
// ignore names.
func (c *Cache) Behind(nodes []fwk.NodeInfo, ignore func(uid types.UID, pod, node string) bool) (pod, node string, behind bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, info := range nodes {
		ns, ok := c.nodes[info.Node().Name]
		if !ok || len(ns.Tenants) == 0 {
			continue
		}
		present := make(map[string]bool, len(info.GetPods()))
		for _, pi := range info.GetPods() {
			present[string(pi.GetPod().UID)] = true
		}
		for key, t := range ns.Tenants {
			if !t.Claim && !present[key] && (ignore == nil || !ignore(types.UID(key), t.Pod, ns.Name)) {
				return t.Pod, ns.Name, true
			}
		}
	}
	return "", "", false
}

// waitForCache says whether the cache is behind the scheduler's snapshot
// on one of the nodes that refused pod (Behind), and if so has pod woken
// when that node's pods next change. The snapshot and this cache follow
// the same informer through separate handlers, so a pod just gone (a
// preemption's victim) may have left the one and not the other yet.
// Weighed then, preemption would evict more for room already free, and
// reclaiming would find nothing idle; and nothing else would retry the
// pod when the cache catches up (the queue saw the deletion already).
//
// The lag is of milliseconds; a pod seen behind for longer than
// behindBound is not waited for again (the two are apart for another
// reason, which must not stop preemption and reclaiming on its node for
// good), and is logged.
func (p *Plugin) waitForCache(pod *corev1.Pod, nodes []fwk.NodeInfo) (gone, node string, behind bool) {
	now := time.Now()
	gone, node, behind = p.cache.Behind(nodes, func(uid types.UID, pod, node string) bool {
		if p.stillOn(uid, pod, node) {
			return true // the snapshot is behind, not the cache: bound since it was taken
		}
		p.waitingMu.Lock()
		defer p.waitingMu.Unlock()
		key := pod + "@" + node
		since, seen := p.behindSince[key]
		if !seen {
			if p.behindSince == nil {
				p.behindSince = map[string]time.Time{}
			}
			p.behindSince[key] = now
			return false
		}
		if now.Sub(since) > behindBound {
			klog.Background().V(2).Info("The GPU cache holds a pod the scheduler's snapshot has not shown on its node for a while; weighing the node without waiting for it", "pod", pod, "node", node, "since", since)
			return true
		}
		return false
	})
	if !behind {
		return "", "", false
	}
	p.waitingMu.Lock()
	if p.waiting == nil {
		p.waiting = map[string]map[types.UID]*corev1.Pod{}
	}
	if p.waiting[node] == nil {
		p.waiting[node] = map[types.UID]*corev1.Pod{}
	}
	p.waiting[node][pod.UID] = pod
	p.waitingMu.Unlock()
	if _, _, still := p.cache.Behind(nodes, func(_ types.UID, pd, nd string) bool { return pd != gone || nd != node }); !still {
		p.wake(node) // caught up meanwhile: the queue requeues the pod once its cycle ends
	}
	return gone, node, true
}

// stillOn says whether the pod informer, which every handler follows,
// still shows the pod live on the node: a tenant the snapshot lacks was
// then bound after the snapshot was taken (by another scheduler, or
// spec.nodeName), and the cache is ahead, not behind. The informer's store
// changes before its handlers run, so a pod gone from it is one whose
// deletion the cache is about to see.
func (p *Plugin) stillOn(uid types.UID, pod, node string) bool {
	if p.pods == nil {
		return false
	}
	ns, name, _ := strings.Cut(pod, "/")
	got, err := p.pods.Pods(ns).Get(name)
	return err == nil && got.UID == uid && got.Spec.NodeName == node && !api.PodEnded(got)
}

// behindBound is how long a pod the cache holds and the snapshot does not
// is waited for.
const behindBound = 10 * time.Second

// wake moves the pods waiting for the cache on a node back to the
// scheduling queue.
func (p *Plugin) wake(node string) {
	p.waitingMu.Lock()
	pods := p.waiting[node]
	delete(p.waiting, node)
	for key := range p.behindSince {
		if strings.HasSuffix(key, "@"+node) {
			delete(p.behindSince, key)
		}
	}
	p.waitingMu.Unlock()
	if len(pods) == 0 || p.handle == nil {
		return
	}
	byName := make(map[string]*corev1.Pod, len(pods))
	for _, pod := range pods {
		byName[pod.Namespace+"/"+pod.Name] = pod
	}
	p.handle.Activate(klog.Background(), byName)
}

// Freed is the count of tenants removed so far, as a cycle notes it.
func (c *Cache) Freed() uint64 { return c.freed.Load() }

// FreedSince names a node among nodes that lost a tenant after the count
// since was taken: its verdict in this cycle's Filter may be stale.
func (c *Cache) FreedSince(nodes []fwk.NodeInfo, since uint64) (string, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, info := range nodes {
		if ns, ok := c.nodes[info.Node().Name]; ok && ns.freedAt > since {
			return ns.Name, true
		}
	}
	return "", false
}

// view is what Filter weighs a node with beyond the cache: the
// simulation's changes, and the node's whole GPUs as kube-scheduler
// counts them (NodeInfo, from which preemption removes its victims).
type view struct {
	whatIf *whatIf
	// gpusFree is nvidia.com/gpu allocatable less requested; gpus is
	// what is allocatable.
	gpus, gpusFree int64
	// terminating are the node's pods being deleted (a preemptor's
	// victims among them): a nominated pod is held the room they free.
	terminating []types.UID
}

// viewOf reads a node's view from the cycle state and its NodeInfo.
func viewOf(state fwk.CycleState, nodeInfo fwk.NodeInfo) view {
	v := view{whatIf: readWhatIf(state, nodeInfo.Node().Name)}
	v.gpus = nodeInfo.GetAllocatable().GetScalarResources()[api.ResourceGPU]
	v.gpusFree = v.gpus - nodeInfo.GetRequested().GetScalarResources()[api.ResourceGPU]
	if v.whatIf != nil && len(v.whatIf.added) > 0 {
		for _, pi := range nodeInfo.GetPods() {
			if pi.GetPod().DeletionTimestamp != nil {
				v.terminating = append(v.terminating, pi.GetPod().UID)
			}
		}
	}
	return v
}

// whatIfLedger is a copy of the node's ledger with the simulation's
// changes applied, and how many GPUs held by reservation pods would come
// back (groups the removals empty, whose pods Reclaim deletes for a
// whole-GPU pod; a standing group's never does). Called with the read
// lock held.
func (c *Cache) whatIfLedger(ns *nodeState, v view) (*gpu.Node, int64) {
	l := ns.Ledger.Clone()
	var reclaimable int64
	if len(v.whatIf.removed) > 0 {
		for _, keys := range v.whatIf.removed {
			for _, key := range keys {
				_ = l.Release(key) // a tenant of another node, or none: nothing here
			}
		}
		reclaimable = reclaimIdle(ns, l)
	}
	// Room for the nominated pods, most important first, on the GPUs that
	// fit each the tightest; counted as if the pods being deleted were
	// gone, since that is what a waiting preemptor is waiting for. One
	// that fits even so nowhere holds nothing: it waits for more than is
	// going.
	added := slices.SortedFunc(maps.Values(v.whatIf.added), func(a, b *corev1.Pod) int {
		return cmp.Or(cmp.Compare(corev1helpers.PodPriority(b), corev1helpers.PodPriority(a)), cmp.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name))
	})
	for _, pod := range added {
		r, ok := c.requestOfPod(ns, pod)
		if !ok {
			continue
		}
		if r.Whole > 0 {
			// Its victims gone, the GPU they left is held by its idle
			// reservation pod until Reclaim deletes it for this pod: the
			// pod's, not a share's to join.
			reclaimIdle(ns, l)
		}
		room := l
		if len(v.terminating) > 0 {
			room = l.Clone()
			for _, uid := range v.terminating {
				_ = room.Release(string(uid))
			}
			if r.Whole > 0 {
				reclaimIdle(ns, room)
			}
		}
		fit, unfit := room.Fit(r)
		if unfit != nil {
			continue
		}
		_ = l.Record(r, tightest(room, fit, max(r.Whole, r.Devices)))
	}
	return l, reclaimable
}

// reclaimIdle opens to whole-GPU pods, on l (a copy of ns's ledger), the
// idle GPUs that only a reservation pod holds (its group empty; or
// retired, its pod being deleted), which Reclaim deletes for a whole-GPU
// pod; a standing group's never. It returns how many: GPUs NodeInfo
// counts as the device plugin's, which come back.
func reclaimIdle(ns *nodeState, l *gpu.Node) int64 {
	standing, reserved := map[int]bool{}, map[int]bool{}
	for g, slot := range ns.Groups {
		standing[slot] = standing[slot] || ledgers.IsStanding(g)
		reserved[slot] = reserved[slot] || ns.Reserved(g)
	}
	var n int64
	for i, d := range l.Devices {
		if ledgers.IsPlaceholder(d.Whole()) {
			_ = l.Release(d.Whole()) // retired: its pod is being deleted
		}
		if !d.Idle() {
			continue
		}
		d.Closed = false // it opens once its tenants are gone
		if reserved[i] && !standing[i] {
			d.SharedOnly = false
			n++
		}
	}
	return n
}

// requestOfPod is the ledger request of a pod that is not the one being
// scheduled (a nominated pod), on ns.
func (c *Cache) requestOfPod(ns *nodeState, pod *corev1.Pod) (gpu.Request, bool) {
	ask := Ask{UID: pod.UID, Whole: api.WholeGPUs(&pod.Spec)}
	if reqs, err := api.Parse(api.Intent(pod)); err == nil && len(reqs) > 0 {
		ask.Whole, ask.Fraction = 0, &reqs[0]
	}
	if !ask.GPU() {
		return gpu.Request{}, false
	}
	r, _, err := c.request(ns, ask)
	return r, err == nil
}

// tightest are the n GPUs of fit with the least memory free, for room
// held: it leaves the roomiest GPUs to the pods filtered meanwhile.
func tightest(n *gpu.Node, fit []int, need int) []int {
	out := slices.Clone(fit)
	slices.SortStableFunc(out, func(a, b int) int { return cmp.Compare(n.Devices[a].Free(), n.Devices[b].Free()) })
	return out[:need]
}

// wholeVerdict checks whole GPUs against kube-scheduler's count of the
// device plugin's GPUs (the profile leaves nvidia.com/gpu to this plugin:
// NodeResourcesFit's ignoredResources, deploy/scheduler/config.yaml), so
// that GPUs a preemption frees by emptying a reservation pod's group
// count, which NodeInfo, where reservation pods are never removed, cannot
// show. reclaimable are those GPUs.
func wholeVerdict(ask Ask, v view, reclaimable int64) (Verdict, bool) {
	switch n := max(ask.DeviceGPUs, int64(ask.Whole)); {
	case v.gpus < n:
		return Verdict{Reason: fmt.Sprintf("%s: the node has fewer than %d %s", gpu.ReasonWhole, ask.Whole, api.ResourceGPU)}, false
	case v.gpusFree+reclaimable < n:
		return Verdict{Resolvable: true, Reason: fmt.Sprintf("%s: fewer than %d %s free", gpu.ReasonWhole, ask.Whole, api.ResourceGPU)}, false
	}
	return Verdict{Fits: true}, true
}
