package scheduler

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/resourceversion"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
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
	// workload is what every live pod asks, bound or pending, for the
	// placement policies that weigh the workload's typical shapes.
	workload map[types.UID]demand
	// claims are the ResourceClaims whose DRA shares the ledger holds
	// (SyncClaims), by claim UID.
	claims map[types.UID]claimHeld
}

// demand is what one pod of the workload asks: its CPU and memory, and
// whole GPUs or a fraction (unresolved: its size depends on the GPU).
type demand struct {
	cpu, memoryMiB int64
	whole          int
	fraction       *api.Request
}

// nodeState is one node's GPUs.
type nodeState struct {
	inv api.Inventory
	// cpu is the node's allocatable CPU in milli-CPU.
	cpu   int64
	ready bool
	why   string // why fractions cannot land here, when !ready
	// seen is the Node object last applied (SetNode): one with an older
	// ResourceVersion is never applied over it. Kept as the object, not
	// its version, so that FilterAt's usual case (the snapshot holds the
	// informer's very object) costs a pointer comparison.
	seen *corev1.Node
	// Layout is the node's ledger (nil without a GPU inventory), its slots
	// by GPU group, and its conflicts: tenants the ledger could not place,
	// pods the API says are there though they do not fit (bound by
	// someone else, or the inventory shrank). The node takes no new
	// fractions while any.
	ledgers.Layout
	// reservations are the reservation pods on the node, by GPU group.
	reservations map[string]*reservation
	// standing is how many GPUs the node asks to have held for shares at
	// all times (api.LabelStandingGPUs, for its DRA driver): the
	// collector keeps a reservation pod for each (ledgers.StandingGroup).
	standing int
	tenants  map[types.UID]*tenant
	// waiting are bound pods not yet turned into tenants: their node's
	// inventory was unknown, or they did not fit. Each rebuild retries.
	waiting map[types.UID]*corev1.Pod
	// viewMu guards view, the node's ledger seen with its host's CPU and
	// memory (gpu.Node.WithHostIn), kept so that rating a node allocates
	// nothing; the cache's read lock alone lets two ratings of one node
	// run at once.
	viewMu sync.Mutex
	view   gpu.Node
}

// reservation is a reservation pod.
type reservation struct {
	name string
	uid  types.UID
	uuid string // the physical GPU, once the node agent has written it
	// held is a standing one's api.SharesHeldAnnotation, as last seen.
	held string
	// state is where the pod is in its life (ledgers.Transition).
	state ledgers.GroupState
	// failure says why the kubelet refused the pod, once it has.
	failure string
}

// event applies a lifecycle event to a group's reservation pod and
// returns the effects for the caller to apply.
func (r *reservation) event(e ledgers.GroupEvent, g string) ledgers.Effects {
	var fx ledgers.Effects
	r.state, fx = ledgers.Transition(r.state, e, ledgers.Seen{}, ledgers.IsStanding(g))
	return fx
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
	// claim is set for a share a ResourceClaim holds (DRA): uid is then
	// <claim UID>/<request>, and only SyncClaims adds or removes it.
	claim bool
	uuid  string // a claim share's GPU, as its device names it
}

func placeholder(group string) string { return ledgers.Placeholder(group) }

// lt is the tenant as the ledger layout books it.
func (t *tenant) lt() ledgers.Tenant { return ledgers.Tenant{Request: t.request, Groups: t.groups} }

// reserved says whether a GPU group has a reservation pod on the node.
func (ns *nodeState) reserved(g string) bool { _, ok := ns.reservations[g]; return ok }

// NewCache returns an empty cache.
func NewCache(args Args) *Cache {
	return &Cache{args: args, nodes: map[string]*nodeState{}, pods: map[types.UID]*tenant{}, dirty: make(chan struct{}), workload: map[types.UID]demand{}, claims: map[types.UID]claimHeld{}}
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
		ns = &nodeState{Layout: ledgers.NewLayout(name, api.Inventory{}), reservations: map[string]*reservation{}, tenants: map[types.UID]*tenant{}, waiting: map[types.UID]*corev1.Pod{}}
		c.nodes[name] = ns
	}
	return ns
}

// SetNode records a node's inventory and readiness; when the inventory
// changes the node's ledger is rebuilt from its pods. A Node older than
// the one last recorded (FilterAt may have applied a newer one) is ignored.
func (c *Cache) SetNode(node *corev1.Node) {
	inv, ready, why := api.InventoryOf(node)
	c.mu.Lock()
	defer c.mu.Unlock()
	ns := c.node(node.Name)
	if ns.seen != nil && olderVersion(node.ResourceVersion, ns.seen.ResourceVersion) {
		return
	}
	ns.seen = node
	ns.cpu = node.Status.Allocatable.Cpu().MilliValue()
	if standing := api.StandingGPUs(node, inv.Count); standing != ns.standing {
		ns.standing = standing
		for g := range ns.reservations {
			ns.settle(g) // a standing group no longer asked for is retired
		}
		c.markDirty() // the collector adds or removes standing reservation pods
	}
	changed := inv != ns.inv || (ns.Ledger == nil) != (inv.Count == 0 || inv.MemoryMiB == 0)
	ns.ready, ns.why = ready, why
	if changed {
		ns.inv = inv
		c.rebuild(node.Name, ns)
	}
}

// olderVersion says whether ResourceVersion a is known to be older than
// b (resourceversion.CompareResourceVersion; a version it cannot compare,
// such as an unset one, is never older).
func olderVersion(a, b string) bool {
	cmp, err := resourceversion.CompareResourceVersion(a, b)
	return err == nil && cmp < 0
}

// DeleteNode forgets a node. Its pods are forgotten with it: the API
// deletes them or they come back with the node.
func (c *Cache) DeleteNode(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ns, ok := c.nodes[name]; ok {
		for uid := range ns.tenants {
			delete(c.pods, uid)
		}
		delete(c.nodes, name)
	}
}

// rebuild makes a fresh ledger for the node's inventory and places every
// reservation pod and tenant on it again, in the order every ledger
// reader fills one (ledgers.Layout.Fill).
func (c *Cache) rebuild(name string, ns *nodeState) {
	inv := ns.inv
	if inv.MemoryMiB <= 0 {
		inv.Count = 0 // no ledger until the GPUs' memory is known
	}
	ns.Layout = ledgers.NewLayout(name, inv)
	tenants := make([]ledgers.Tenant, 0, len(ns.tenants))
	for _, t := range ns.tenants {
		tenants = append(tenants, t.lt())
	}
	ns.Fill(tenants, slices.Collect(maps.Keys(ns.reservations)), true)
	for g := range ns.reservations {
		ns.settle(g)
	}
	for uid, pod := range ns.waiting {
		if t, err := tenantOf(pod, ns, c.args); err != nil {
			ns.Conflicts[string(uid)] = err.Error()
		} else {
			delete(ns.waiting, uid)
			if t != nil {
				c.add(ns, t)
			}
		}
	}
}

func (c *Cache) remove(ns *nodeState, t *tenant) {
	ns.Release(t.lt(), ns.reserved)
	delete(ns.tenants, t.uid)
	delete(c.pods, t.uid)
	for _, g := range t.groups {
		ns.settle(g)
	}
	c.markDirty()
	// A conflict may have cleared now that room was freed.
	if len(ns.Conflicts) > 0 {
		c.rebuild(t.node, ns)
	}
}

// add records a tenant and places it on the node's ledger.
func (c *Cache) add(ns *nodeState, t *tenant) {
	c.register(ns, t)
	ns.Place(t.lt(), ns.reserved)
	if !t.claim && slices.ContainsFunc(t.groups, ledgers.IsStanding) {
		c.markDirty() // the collector writes what its standing GPU now holds
	}
}

// register records a tenant already on the ledger (or not to be placed).
func (c *Cache) register(ns *nodeState, t *tenant) {
	ns.tenants[t.uid] = t
	c.pods[t.uid] = t
}

// setDemand records what a live pod asks for the workload estimate, or
// forgets a pod that asks nothing, has ended, or is a DaemonSet's (one per
// node whatever arrives: not part of the stream the policies plan for).
func (c *Cache) setDemand(pod *corev1.Pod, terminal bool) {
	d := demand{whole: api.WholeGPUs(&pod.Spec)}
	d.cpu, d.memoryMiB = podRequests(pod)
	if reqs, err := api.Parse(api.Intent(pod)); err == nil && len(reqs) > 0 {
		d.fraction = &reqs[0]
	}
	daemon := slices.ContainsFunc(pod.OwnerReferences, func(o metav1.OwnerReference) bool { return o.Kind == "DaemonSet" })
	if terminal || daemon || (d == demand{}) {
		delete(c.workload, pod.UID)
		return
	}
	c.workload[pod.UID] = d
}

// SetPod records a pod as the API reports it. Pending pods are ignored
// (unless this scheduler has reserved them), and so are pods that hold no
// GPU. A bound pod that holds GPUs is added; a terminated one is removed.
func (c *Cache) SetPod(pod *corev1.Pod) {
	if pod.Namespace == c.args.ReservationNamespace {
		c.setReservation(pod)
		return
	}
	terminal := podEnded(pod)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.setDemand(pod, terminal)
	old, known := c.pods[pod.UID]
	if terminal || (pod.Spec.NodeName == "" && known && !old.assumed) {
		if known {
			c.remove(c.node(old.node), old)
		} else if ns, ok := c.nodes[pod.Spec.NodeName]; ok {
			delete(ns.Conflicts, string(pod.UID))
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
	delete(ns.Conflicts, string(pod.UID))
	t, err := tenantOf(pod, ns, c.args)
	if err != nil {
		ns.waiting[pod.UID] = pod
		if ns.Ledger != nil {
			ns.Conflicts[string(pod.UID)] = err.Error()
		}
		return
	}
	if t != nil {
		c.add(ns, t)
	}
}

// podEnded says whether a pod has ended, so that it holds no GPU.
func podEnded(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

// DeletePod forgets a deleted pod.
func (c *Cache) DeletePod(pod *corev1.Pod) {
	if pod.Namespace == c.args.ReservationNamespace {
		c.deleteReservation(pod)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.workload, pod.UID)
	if t, ok := c.pods[pod.UID]; ok {
		c.remove(c.node(t.node), t)
		return
	}
	if ns, ok := c.nodes[pod.Spec.NodeName]; ok {
		delete(ns.Conflicts, string(pod.UID))
		delete(ns.waiting, pod.UID)
	}
}

// tenantOf says what a bound pod holds on its node: what ledgers.TenantOf
// reads (whole GPUs, or the shares its scheduler wrote), or, for a
// fractional pod bound but not yet annotated, its request on the GPUs that
// fit it best. It returns nil for a pod that holds no GPU.
func tenantOf(pod *corev1.Pod, ns *nodeState, args Args) (*tenant, error) {
	t := &tenant{uid: pod.UID, namespace: pod.Namespace, name: pod.Name, node: pod.Spec.NodeName}
	if lt, held, err := ledgers.TenantOf(pod, ns.groupOfUUID, ns.inv.SchedulableMiB()); err == nil && held {
		t.request, t.groups = lt.Request, lt.Groups
		if a := lt.Assignment; a != nil {
			t.container = a.Container
			t.resolved = api.Resolved{RequestMiB: a.RequestMiB, LimitMiB: a.LimitMiB}
		}
		return t, nil
	}
	t.request.Tenant = string(pod.UID)
	reqs, err := api.Parse(api.Intent(pod))
	if err != nil || len(reqs) == 0 {
		return nil, err
	}
	// Bound but not annotated: charge its request where it fits best, so
	// the node is never over-committed while its decision is unknown.
	if ns.Ledger == nil {
		return nil, fmt.Errorf("pod %s/%s asks for a GPU fraction on a node without a GPU inventory", pod.Namespace, pod.Name)
	}
	share, resolved, err := shareOn(reqs[0], ns, args)
	if err != nil {
		return nil, err
	}
	t.request.Devices, t.request.Share, t.resolved, t.container = reqs[0].Devices, share, resolved, reqs[0].Container
	fit, unfit := ns.Ledger.Fit(t.request)
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

// groupOfUUID joins a GPU named by UUID with the reservation pod holding
// it (a pod placed by another scheduler names no groups of ours; a DRA
// device names its GPU lower-cased).
func (ns *nodeState) groupOfUUID(uuid string) string {
	for g, r := range ns.reservations {
		if strings.EqualFold(r.uuid, uuid) {
			return g
		}
	}
	return ledgers.UUIDGroup(uuid)
}

// groupAt is the GPU group a new share on a slot joins: the live group
// there, or the idle group whose reservation pod holds it for shares; ""
// for none.
func groupAt(ns *nodeState, slot int) string {
	for g, s := range ns.Groups {
		if s == slot && (shared(ns.Ledger.Devices[slot]) || ns.joinable(g)) {
			return g
		}
	}
	return ""
}

// settle retires a reservation pod's group that holds no tenant and that
// no share may join (see joinable), so that nothing takes or joins its GPU
// until the pod is gone: one that failed, was retired, is being deleted,
// is a standing one the node no longer asks for, or found no GPU on the
// ledger (not a standing one: the node's standing pods are made again).
// Retiring sticks: such a group never becomes joinable again.
func (ns *nodeState) settle(g string) {
	r := ns.reservations[g]
	if r == nil || ns.Ledger == nil {
		return
	}
	slot, ok := ns.Groups[g]
	if !ok {
		if !ledgers.IsStanding(g) {
			r.event(ledgers.EventRetire, g)
		}
		return
	}
	if ns.Ledger.Devices[slot].Idle() && !ns.joinable(g) {
		if !ledgers.IsStanding(g) || !ns.wantsStanding(g) {
			r.event(ledgers.EventRetire, g)
		}
		ns.Retire(g)
	}
}

// joinable says whether a share may join an idle group: its reservation
// pod is kept and not failed, not being deleted (Reclaim), and, for a
// standing group, one the node still asks for. A group that is not
// joinable never becomes so again, so that once empty it stays so and the
// collector may delete it.
func (ns *nodeState) joinable(g string) bool {
	r := ns.reservations[g]
	return r != nil && ledgers.Joinable(r.state, ledgers.IsStanding(g), ns.wantsStanding(g))
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
	resolved, err := r.Resolve(ns.inv.MemoryMiB, ns.inv.ReserveMiB)
	if err != nil {
		return gpu.Share{}, api.Resolved{}, err
	}
	share := gpu.Share{Request: resolved.RequestMiB, Limit: resolved.LimitMiB, Mode: r.Mode}
	if r.Mode == api.SMSharing {
		share.Portion = api.PortionOfMemory(resolved.RequestMiB, ns.inv.SchedulableMiB()).Of(gpu.FullPortion)
	}
	return share, resolved, nil
}
