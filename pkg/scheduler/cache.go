package scheduler

import (
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// Cache is the scheduler's view of every GPU: which pods share it, which
// whole-GPU pod owns it, which reservation pod holds it. It is built only
// from pods and nodes as the API reports them (plus the choices this
// scheduler has reserved and not yet seen bound), so a restarted scheduler
// rebuilds it completely from its informers: there is no other store.
//
// GPUs are tracked as slots of a node's ledger. A slot has no identity of
// its own: a shared GPU is a GPU group, held by one reservation pod, and
// the physical GPU is whichever one the device plugin gave that pod. So
// slots are interchangeable, and only their number and tenants matter.
type Cache struct {
	args Args

	mu    sync.RWMutex
	nodes map[string]*nodeState
	pods  map[types.UID]*tenant
	// dirty is closed and replaced whenever a GPU group may have become
	// empty, so that the collector looks for reservation pods to delete.
	dirty chan struct{}
	// shapes counts the resolved shapes of the GPU tenants, for the
	// placement policies that weigh the workload's typical shapes.
	shapes map[shapeKey]int
}

type shapeKey struct {
	whole   int
	request int64
}

// nodeState is one node's GPUs.
type nodeState struct {
	inv    api.Inventory
	ready  bool
	why    string    // why fractions cannot land here, when !ready
	ledger *gpu.Node // nil without a GPU inventory
	// groups maps a GPU group to its slot in the ledger.
	groups map[string]int
	// reservations are the reservation pods on the node, by GPU group.
	reservations map[string]*reservation
	tenants      map[types.UID]*tenant
	// conflicts counts tenants the ledger could not place: pods the API
	// says are there though they do not fit (bound by someone else, or
	// the inventory shrank). The node takes no new fractions while any.
	conflicts map[types.UID]string
	// waiting are bound pods not yet turned into tenants: their node's
	// inventory was unknown, or they did not fit. Each rebuild retries.
	waiting map[types.UID]*corev1.Pod
}

// reservation is a reservation pod.
type reservation struct {
	name string
	uid  types.UID
	uuid string // the physical GPU, once the node agent has written it
	// failed is set when the kubelet refused the pod.
	failed string
}

// tenant is a pod holding GPUs on a node.
type tenant struct {
	uid       types.UID
	namespace string
	name      string
	node      string
	request   gpu.Request
	// groups are a fractional tenant's GPU groups, one per device.
	groups []string
	// container gets the GPUs (fractional tenants).
	container string
	// assumed is set from Reserve until the API shows the pod bound.
	assumed bool
	// resolved is the memory in MiB that PreBind writes.
	resolved api.Resolved
}

func placeholder(group string) string { return "reservation/" + group }

// NewCache returns an empty cache.
func NewCache(args Args) *Cache {
	return &Cache{args: args, nodes: map[string]*nodeState{}, pods: map[types.UID]*tenant{}, dirty: make(chan struct{}), shapes: map[shapeKey]int{}}
}

// Dirty returns a channel closed at the next change that may leave a
// reservation pod without tenants.
func (c *Cache) Dirty() <-chan struct{} {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.dirty
}

func (c *Cache) markDirty() {
	close(c.dirty)
	c.dirty = make(chan struct{})
}

func (c *Cache) node(name string) *nodeState {
	ns, ok := c.nodes[name]
	if !ok {
		ns = &nodeState{groups: map[string]int{}, reservations: map[string]*reservation{}, tenants: map[types.UID]*tenant{}, conflicts: map[types.UID]string{}, waiting: map[types.UID]*corev1.Pod{}}
		c.nodes[name] = ns
	}
	return ns
}

// SetNode records a node's inventory and readiness; when the inventory
// changes the node's ledger is rebuilt from its pods.
func (c *Cache) SetNode(node *corev1.Node) {
	inv, ready, why := api.InventoryOf(node)
	c.mu.Lock()
	defer c.mu.Unlock()
	ns := c.node(node.Name)
	changed := inv != ns.inv || (ns.ledger == nil) != (inv.Count == 0 || inv.MemoryMiB == 0)
	ns.ready, ns.why = ready, why
	if changed {
		ns.inv = inv
		c.rebuild(node.Name, ns)
	}
}

// DeleteNode forgets a node. Its pods are forgotten with it: the API
// deletes them or they come back with the node.
func (c *Cache) DeleteNode(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ns, ok := c.nodes[name]; ok {
		for uid, t := range ns.tenants {
			c.forgetShape(t)
			delete(c.pods, uid)
		}
		delete(c.nodes, name)
	}
}

// rebuild makes a fresh ledger for the node's inventory and places every
// reservation pod and tenant on it again: GPU groups first, then the
// whole-GPU pods.
func (c *Cache) rebuild(name string, ns *nodeState) {
	ns.ledger, ns.groups, ns.conflicts = nil, map[string]int{}, map[types.UID]string{}
	if ns.inv.Count > 0 && ns.inv.MemoryMiB > 0 {
		devices := make([]*gpu.Device, ns.inv.Count)
		for i := range devices {
			devices[i] = &gpu.Device{Index: i, Model: ns.inv.Model, Total: ns.inv.MemoryMiB, Reserve: c.args.Reserve(ns.inv.Model)}
		}
		ns.ledger = gpu.NewNode(name, 0, 0, devices...)
	}
	// Shares first, so whole-GPU pods take the slots left over.
	tenants := slices.SortedFunc(maps.Values(ns.tenants), func(a, b *tenant) int {
		return cmp.Compare(a.request.Whole, b.request.Whole)
	})
	for _, t := range tenants {
		c.place(ns, t)
	}
	for _, g := range slices.Sorted(maps.Keys(ns.reservations)) {
		c.holdIfEmpty(ns, g)
	}
	for uid, pod := range ns.waiting {
		if t, err := tenantOf(pod, ns, c.args); err != nil {
			ns.conflicts[uid] = err.Error()
		} else {
			delete(ns.waiting, uid)
			if t != nil {
				c.add(ns, t)
			}
		}
	}
}

// place puts a tenant on the node's ledger: a share on its groups' slots
// (a group seen for the first time takes the lowest idle slot), whole GPUs
// on the lowest idle slots. A tenant that does not fit is a conflict.
func (c *Cache) place(ns *nodeState, t *tenant) {
	if ns.ledger == nil {
		return // counted once the node reports its GPUs
	}
	var slots []int
	if t.request.Whole > 0 {
		fit, unfit := ns.ledger.Fit(t.request)
		if unfit != nil {
			ns.conflicts[t.uid] = unfit.Error()
			return
		}
		slots = fit[:t.request.Whole]
	} else {
		for _, g := range t.groups {
			slot, ok := ns.groups[g]
			if !ok {
				if slot = lowestIdle(ns.ledger, slots); slot < 0 {
					ns.conflicts[t.uid] = fmt.Sprintf("no idle GPU for GPU group %s", g)
					c.dropEmptyGroups(ns, t.groups)
					return
				}
				ns.groups[g] = slot
			}
			if ns.ledger.Devices[slot].Whole() == placeholder(g) {
				_ = ns.ledger.Release(placeholder(g))
			}
			slots = append(slots, slot)
		}
	}
	if err := ns.ledger.Assign(t.request, slots); err != nil {
		ns.conflicts[t.uid] = err.Error()
		c.dropEmptyGroups(ns, t.groups)
	}
}

// lowestIdle is the lowest idle slot not among taken, or -1.
func lowestIdle(n *gpu.Node, taken []int) int {
	for i, d := range n.Devices {
		if d.Idle() && !slices.Contains(taken, i) {
			return i
		}
	}
	return -1
}

// dropEmptyGroups forgets the slots of groups that hold nothing: no share,
// and no reservation pod.
func (c *Cache) dropEmptyGroups(ns *nodeState, groups []string) {
	for _, g := range groups {
		slot, ok := ns.groups[g]
		if !ok {
			continue
		}
		if ns.ledger.Devices[slot].Idle() {
			if _, held := ns.reservations[g]; held {
				c.holdIfEmpty(ns, g)
				continue
			}
			delete(ns.groups, g)
		}
	}
}

// holdIfEmpty keeps the slot of a reservation pod whose group has no
// tenants: the device plugin still holds that GPU for it, so no one may
// take it until the pod is gone (the collector deletes it).
func (c *Cache) holdIfEmpty(ns *nodeState, g string) {
	if ns.ledger == nil {
		return
	}
	slot, ok := ns.groups[g]
	if ok && !ns.ledger.Devices[slot].Idle() {
		return // tenants, or already held
	}
	if !ok {
		if slot = lowestIdle(ns.ledger, nil); slot < 0 {
			ns.conflicts[types.UID(placeholder(g))] = fmt.Sprintf("no idle GPU for reservation pod of GPU group %s", g)
			return
		}
		ns.groups[g] = slot
	}
	if err := ns.ledger.Assign(gpu.Request{Tenant: placeholder(g), Whole: 1}, []int{slot}); err != nil {
		ns.conflicts[types.UID(placeholder(g))] = err.Error()
	}
}

func (c *Cache) remove(ns *nodeState, t *tenant) {
	if _, conflict := ns.conflicts[t.uid]; conflict {
		delete(ns.conflicts, t.uid)
	} else if ns.ledger != nil {
		_ = ns.ledger.Release(string(t.uid))
		c.dropEmptyGroups(ns, t.groups)
	}
	delete(ns.tenants, t.uid)
	delete(c.pods, t.uid)
	c.forgetShape(t)
	c.markDirty()
	// A conflict may have cleared now that room was freed.
	if len(ns.conflicts) > 0 {
		c.rebuild(t.node, ns)
	}
}

// add records a tenant and places it on the node's ledger.
func (c *Cache) add(ns *nodeState, t *tenant) {
	c.register(ns, t)
	c.place(ns, t)
}

// register records a tenant already on the ledger (or not to be placed).
func (c *Cache) register(ns *nodeState, t *tenant) {
	ns.tenants[t.uid] = t
	c.pods[t.uid] = t
	c.shapes[t.shape()]++
}

func (t *tenant) shape() shapeKey {
	return shapeKey{whole: t.request.Whole, request: t.request.Share.Request}
}

func (c *Cache) forgetShape(t *tenant) {
	k := t.shape()
	if c.shapes[k]--; c.shapes[k] <= 0 {
		delete(c.shapes, k)
	}
}

// SetPod records a pod as the API reports it. Pending pods are ignored
// (unless this scheduler has reserved them), and so are pods that hold no
// GPU. A bound pod that holds GPUs is added; a terminated one is removed.
func (c *Cache) SetPod(pod *corev1.Pod) {
	if pod.Namespace == c.args.ReservationNamespace {
		c.setReservation(pod)
		return
	}
	terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	c.mu.Lock()
	defer c.mu.Unlock()
	old, known := c.pods[pod.UID]
	if terminal || (pod.Spec.NodeName == "" && known && !old.assumed) {
		if known {
			c.remove(c.node(old.node), old)
		} else if ns, ok := c.nodes[pod.Spec.NodeName]; ok {
			delete(ns.conflicts, pod.UID)
			delete(ns.waiting, pod.UID)
		}
		return
	}
	if pod.Spec.NodeName == "" {
		return
	}
	if known && old.node == pod.Spec.NodeName {
		old.assumed = false // bound where it was reserved: nothing else changes
		return
	}
	if known {
		c.remove(c.node(old.node), old)
	}
	ns := c.node(pod.Spec.NodeName)
	delete(ns.waiting, pod.UID)
	delete(ns.conflicts, pod.UID)
	t, err := tenantOf(pod, ns, c.args)
	if err != nil {
		ns.waiting[pod.UID] = pod
		if ns.ledger != nil {
			ns.conflicts[pod.UID] = err.Error()
		}
		return
	}
	if t != nil {
		c.add(ns, t)
	}
}

// DeletePod forgets a deleted pod.
func (c *Cache) DeletePod(pod *corev1.Pod) {
	if pod.Namespace == c.args.ReservationNamespace {
		c.deleteReservation(pod)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.pods[pod.UID]; ok {
		c.remove(c.node(t.node), t)
		return
	}
	if ns, ok := c.nodes[pod.Spec.NodeName]; ok {
		delete(ns.conflicts, pod.UID)
		delete(ns.waiting, pod.UID)
	}
}

// tenantOf says what a bound pod holds on its node: whole GPUs, the shares
// its scheduler wrote (on its GPU groups, or on the GPUs named by UUID
// when another scheduler placed it), or, for a fractional pod bound but
// not yet annotated, its request on the GPUs that fit it best. It returns
// nil for a pod that holds no GPU.
func tenantOf(pod *corev1.Pod, ns *nodeState, args Args) (*tenant, error) {
	t := &tenant{uid: pod.UID, namespace: pod.Namespace, name: pod.Name, node: pod.Spec.NodeName}
	t.request.Tenant = string(pod.UID)
	if n := api.WholeGPUs(&pod.Spec); n > 0 {
		t.request.Whole = n
		return t, nil
	}
	if assignments, err := api.ParseAssignments(pod.Annotations); err == nil && len(assignments) > 0 {
		a := assignments[0]
		t.container = a.Container
		t.request.Devices = len(a.Devices)
		t.request.Share = gpu.Share{Request: a.RequestMiB, Limit: a.LimitMiB, Mode: a.Mode, Portion: a.Portion.Of(gpu.FullPortion)}
		t.resolved = api.Resolved{RequestMiB: a.RequestMiB, LimitMiB: a.LimitMiB}
		if groups := api.SplitList(pod.Annotations[api.GPUGroupsAnnotation]); len(groups) == len(a.Devices) {
			t.groups = groups
			return t, nil
		}
		// Placed by another scheduler (KAI writes no groups of ours): the
		// GPU is the group, joined with the reservation pod holding it.
		for _, uuid := range a.Devices {
			t.groups = append(t.groups, groupOfUUID(ns, uuid))
		}
		return t, nil
	}
	reqs, err := api.Parse(api.Intent(pod))
	if err != nil || len(reqs) == 0 {
		return nil, err
	}
	// Bound but not annotated: charge its request where it fits best, so
	// the node is never over-committed while its decision is unknown.
	if ns.ledger == nil {
		return nil, fmt.Errorf("pod %s/%s asks for a GPU fraction on a node without a GPU inventory", pod.Namespace, pod.Name)
	}
	share, resolved, err := shareOn(reqs[0], ns, args)
	if err != nil {
		return nil, err
	}
	t.request.Devices, t.request.Share, t.resolved, t.container = reqs[0].Devices, share, resolved, reqs[0].Container
	fit, unfit := ns.ledger.Fit(t.request)
	if unfit != nil {
		return nil, fmt.Errorf("pod %s/%s is bound without a GPU decision and does not fit: %w", pod.Namespace, pod.Name, unfit)
	}
	for _, slot := range fit[:t.request.Devices] {
		g := groupAt(ns, slot)
		if g == "" {
			g = newGroup()
		}
		t.groups = append(t.groups, g)
	}
	return t, nil
}

func groupOfUUID(ns *nodeState, uuid string) string {
	for g, r := range ns.reservations {
		if r.uuid == uuid {
			return g
		}
	}
	return "uuid-" + strings.ToLower(uuid)
}

// groupAt is the live GPU group on a slot, or "".
func groupAt(ns *nodeState, slot int) string {
	for g, s := range ns.groups {
		if s == slot && shared(ns.ledger.Devices[slot]) {
			return g
		}
	}
	return ""
}

// shared says whether a GPU has fractional tenants (each charges a
// request above 0, so their sum says it without copying the shares).
func shared(d *gpu.Device) bool { return d.Charged() > 0 }

// newGroup names a new GPU group: short, lowercase and never used before.
// Never reused, so that a new group can never be mistaken for an old one
// whose reservation pod is still being collected: a pod that is placed
// again after a failed bind gets a new reservation pod, not the leftover.
func newGroup() string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("crypto/rand: %v", err)) // the runtime guarantees it does not fail
	}
	return strconv.FormatUint(binary.BigEndian.Uint64(b[:]), 36)
}

// shareOn resolves a request on the node's GPUs: its memory in MiB and,
// for sm-sharing, a compute portion in proportion to the memory, so that
// memory that fits always brings compute that fits.
func shareOn(r api.Request, ns *nodeState, args Args) (gpu.Share, api.Resolved, error) {
	reserve := args.Reserve(ns.inv.Model)
	resolved, err := r.Resolve(ns.inv.MemoryMiB, reserve)
	if err != nil {
		return gpu.Share{}, api.Resolved{}, err
	}
	share := gpu.Share{Request: resolved.RequestMiB, Limit: resolved.LimitMiB, Mode: r.Mode}
	if r.Mode == api.SMSharing {
		schedulable := max(ns.inv.MemoryMiB-reserve, 1)
		share.Portion = min(max(resolved.RequestMiB*gpu.FullPortion/schedulable, 1), gpu.FullPortion)
	}
	return share, resolved, nil
}
