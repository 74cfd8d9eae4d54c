package scheduler

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

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
	// where is the node of every tenant the cache holds (a pod, or a
	// claim's share), by ledger key: the tenant itself is the node's.
	where map[types.UID]string
	// assumed are the pods this scheduler reserved and has not seen bound.
	assumed map[types.UID]bool
	// dirty is closed and replaced whenever a GPU group may have become
	// empty, so that the collector looks for reservation pods to delete.
	dirty chan struct{}
	// workload is what every live pod asks, bound or pending, for the
	// placement policies that weigh the workload's typical shapes.
	workload map[types.UID]demand
	// claims are the ResourceClaims whose DRA shares the ledger holds
	// (SyncClaims), by claim UID.
	claims map[types.UID]claimHeld
	// now is the clock the agents' heartbeats are judged by (tests set it).
	now func() time.Time
	// resizes are the bound pods whose resize waits for a decision
	// (resize.go), as last seen; resizing are the grants booked whose
	// write the cache has not seen yet, with the memory granted.
	resizes  map[types.UID]*corev1.Pod
	resizing map[types.UID]api.Memory
	// freed counts the tenants removed: a scheduling cycle notes it at
	// PreFilter, and PostFilter asks whether a refusing node freed room
	// since (FreedSince).
	freed atomic.Uint64
}

// demand is what one pod of the workload asks: its CPU and memory, and
// whole GPUs or a fraction (unresolved: its size depends on the GPU).
type demand struct {
	cpu, memoryMiB int64
	whole          int
	fraction       *api.Request
}

// nodeState is one node's GPU tenancy (ledgers.Node, the model audit, top
// and the dashboard read too) with what only the scheduler needs.
type nodeState struct {
	ledgers.Node
	// cpu is the node's allocatable CPU in milli-CPU.
	cpu int64
	// seen is the Node object last applied (SetNode): one with an older
	// ResourceVersion is never applied over it. Kept as the object, not
	// its version, so that FilterAt's usual case (the snapshot holds the
	// informer's very object) costs a pointer comparison.
	seen *corev1.Node
	// freedAt is Cache.freed at this node's last tenant removal.
	freedAt uint64
	// heartbeat is seen's agent heartbeat (api.AgentHeartbeat).
	heartbeat api.Heartbeat
	// otherReservations is the reservation namespace seen's agent
	// publishes when it is not this scheduler's ("" when the same, or
	// none published).
	otherReservations string
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

// NewCache returns an empty cache.
func NewCache(args Args) *Cache {
	return &Cache{args: args, nodes: map[string]*nodeState{}, where: map[types.UID]string{}, assumed: map[types.UID]bool{},
		dirty: make(chan struct{}), workload: map[types.UID]demand{}, claims: map[types.UID]claimHeld{}, now: time.Now,
		resizes: map[types.UID]*corev1.Pod{}, resizing: map[types.UID]api.Memory{}}
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
		ns = &nodeState{Node: *ledgers.NewNode(name, api.Inventory{}), waiting: map[types.UID]*corev1.Pod{}}
		c.nodes[name] = ns
	}
	return ns
}

// tenant is the tenant of a ledger key, with its node; a read, safe
// under the read lock.
func (c *Cache) tenant(uid types.UID) (*nodeState, *ledgers.Tenant, bool) {
	ns, ok := c.nodes[c.where[uid]]
	if !ok {
		return nil, nil, false
	}
	t, ok := ns.Tenants[string(uid)]
	return ns, t, ok
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
	ns.heartbeat = api.AgentHeartbeat(node) // read once here, judged per pod in Filter
	ns.otherReservations = ""
	if theirs, labelled := api.ReservationNamespaceLabelled(node); labelled && theirs != c.args.ReservationNamespace {
		ns.otherReservations = theirs
	}
	ns.cpu = node.Status.Allocatable.Cpu().MilliValue()
	if standing := api.StandingGPUs(node, inv.Count); standing != ns.Standing {
		ns.Standing = standing
		for g := range ns.Reservations {
			ns.Settle(g) // a standing group no longer asked for is retired
		}
		c.markDirty() // the collector adds or removes standing reservation pods
	}
	changed := inv != ns.Inventory || (ns.Ledger == nil) != (inv.Count == 0 || inv.MemoryMiB == 0)
	ns.Ready, ns.Why = ready, why
	if changed {
		ns.Inventory = inv
		c.rebuild(ns)
	}
}

// olderVersion says whether ResourceVersion a is known to be older than
// b (resourceversion.CompareResourceVersion; a version it cannot compare,
// such as an unset one, is never older).
func olderVersion(a, b string) bool {
	cmp, err := resourceversion.CompareResourceVersion(a, b)
	return err == nil && cmp < 0
}

// DeleteNode marks a node gone, and keeps its pods: a Node deleted and
// registered again (a kubelet re-registering, a machine replaced under
// its name, before the pod garbage collector's quarantine ends) comes
// back with the pods still bound to it, and no pod event says so. Had
// the cache forgotten them, it would place shares on GPUs they hold (the
// soak found it: 10 GPUs held of 8). A pod the API does delete is
// forgotten by its own event, and a gone node left with nothing is
// dropped then. kube-scheduler's own cache keeps a removed node's pods
// the same way (backend/cache's RemoveNode).
func (c *Cache) DeleteNode(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ns, ok := c.nodes[name]
	if !ok {
		return
	}
	ns.seen, ns.Ready, ns.Why = nil, false, "the Node was deleted"
	c.dropIfGone(ns)
}

// dropIfGone forgets a node whose Node was deleted once nothing of it is
// left. Called with the lock held.
func (c *Cache) dropIfGone(ns *nodeState) {
	if ns.seen == nil && len(ns.Tenants) == 0 && len(ns.Reservations) == 0 && len(ns.waiting) == 0 && len(ns.Conflicts) == 0 {
		delete(c.nodes, ns.Name)
	}
}

// rebuild books every reservation pod and tenant of the node again on a
// fresh ledger (ledgers.Node.Relayout, in the order every reader fills
// one), then retries the pods waiting to be read.
func (c *Cache) rebuild(ns *nodeState) {
	ns.Relayout(true)
	for uid, pod := range ns.waiting {
		if t, err := c.tenantOf(pod, ns); err != nil {
			conflict(ns, uid, err)
		} else {
			delete(ns.waiting, uid)
			if t != nil {
				c.add(ns, t)
			}
		}
	}
}

// remove forgets a tenant and frees its GPUs.
func (c *Cache) remove(ns *nodeState, uid types.UID) {
	ns.freedAt = c.freed.Add(1)
	ns.Remove(string(uid))
	delete(c.where, uid)
	delete(c.assumed, uid)
	delete(c.resizes, uid)
	delete(c.resizing, uid)
	c.markDirty()
	// A conflict may have cleared now that room was freed.
	if len(ns.Conflicts) > 0 {
		c.rebuild(ns)
	}
}

// add records a tenant and places it on the node's ledger.
func (c *Cache) add(ns *nodeState, t *ledgers.Tenant) {
	c.where[types.UID(t.Request.Tenant)] = ns.Name
	ns.Add(t)
	if !t.Claim && slices.ContainsFunc(t.Groups, ledgers.IsStanding) {
		c.markDirty() // the collector writes what its standing GPU now holds
	}
}

// register records a tenant already on the ledger.
func (c *Cache) register(ns *nodeState, t *ledgers.Tenant) {
	ns.Tenants[t.Request.Tenant] = t
	c.where[types.UID(t.Request.Tenant)] = ns.Name
}

// setDemand records what a live pod asks for the workload estimate, or
// forgets a pod that asks nothing, has ended, or is a DaemonSet's (one per
// node whatever arrives: not part of the stream the policies plan for).
func (c *Cache) setDemand(pod *corev1.Pod, terminal bool) {
	d := demand{whole: api.WholeGPUs(&pod.Spec)}
	d.cpu, d.memoryMiB, _ = podRequests(pod)
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
	terminal := api.PodEnded(pod)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.setDemand(pod, terminal)
	node, known := c.where[pod.UID]
	if terminal || (pod.Spec.NodeName == "" && known && !c.assumed[pod.UID]) {
		if known {
			c.remove(c.node(node), pod.UID)
		} else if ns, ok := c.nodes[pod.Spec.NodeName]; ok {
			delete(ns.Conflicts, string(pod.UID))
			delete(ns.waiting, pod.UID)
		}
		return
	}
	if pod.Spec.NodeName == "" {
		return
	}
	if known && node == pod.Spec.NodeName {
		delete(c.assumed, pod.UID)     // bound where it was reserved: nothing else changes,
		c.learnGPUs(c.node(node), pod) // but the GPUs its decision names,
		c.seeResize(c.node(node), pod) // and its memory, when resized
		return
	}
	if known {
		c.remove(c.node(node), pod.UID)
	}
	ns := c.node(pod.Spec.NodeName)
	delete(ns.waiting, pod.UID)
	delete(ns.Conflicts, string(pod.UID))
	t, err := c.tenantOf(pod, ns)
	if err != nil {
		ns.waiting[pod.UID] = pod
		if ns.Ledger != nil {
			conflict(ns, pod.UID, err)
		}
		return
	}
	if t != nil {
		c.add(ns, t)
		c.seeResize(ns, pod)
	}
}

// learnGPUs records on a tenant the scheduler assumed the GPUs its
// decision names, once the pod shows it: with them, a GPU whose reservation
// pod is deleted under the tenant is closed to new shares
// (ledgers.Node.closeUnheld), instead of its group taking the next share
// and its pod being made again by name, maybe on another GPU.
func (c *Cache) learnGPUs(ns *nodeState, pod *corev1.Pod) {
	t := ns.Tenants[string(pod.UID)]
	if t == nil || len(t.UUIDs) > 0 || t.Request.Whole > 0 {
		return
	}
	if read, held, err := ns.ReadTenant(pod); err == nil && held && len(read.UUIDs) == len(t.Groups) {
		t.UUIDs = read.UUIDs
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
	delete(c.workload, pod.UID)
	if node, ok := c.where[pod.UID]; ok {
		ns := c.node(node)
		c.remove(ns, pod.UID)
		c.dropIfGone(ns)
		return
	}
	if ns, ok := c.nodes[pod.Spec.NodeName]; ok {
		delete(ns.Conflicts, string(pod.UID))
		delete(ns.waiting, pod.UID)
		c.dropIfGone(ns)
	}
}

// tenantOf says what a bound pod holds on its node: what the node reads
// of it (ledgers.Node.ReadTenant: whole GPUs, or the shares its scheduler
// wrote), or, for a fractional pod bound but not yet annotated, its
// request on the GPUs that fit it best. It returns nil for a pod that
// holds no GPU.
func (c *Cache) tenantOf(pod *corev1.Pod, ns *nodeState) (*ledgers.Tenant, error) {
	if t, held, err := ns.ReadTenant(pod); err == nil && held {
		return t, nil
	}
	reqs, err := api.Parse(api.Intent(pod))
	if err != nil || len(reqs) == 0 {
		return nil, err
	}
	// Bound but not annotated: charge its request where it fits best, so
	// the node is never over-committed while its decision is unknown.
	if ns.Ledger == nil {
		return nil, fmt.Errorf("pod %s/%s asks for a GPU fraction on a node without a GPU inventory", pod.Namespace, pod.Name)
	}
	share, resolved, err := shareOn(reqs[0], ns.Inventory)
	if err != nil {
		return nil, err
	}
	t := &ledgers.Tenant{Request: gpu.Request{Tenant: string(pod.UID), Devices: reqs[0].Devices, Share: share}, Pod: pod.Namespace + "/" + pod.Name,
		Assignment: &api.Assignment{Container: reqs[0].Container, RequestMiB: resolved.RequestMiB, LimitMiB: resolved.LimitMiB, Mode: share.Mode}}
	fit, unfit := ns.Ledger.Fit(t.Request)
	if unfit != nil {
		return nil, fmt.Errorf("pod %s/%s is bound without a GPU decision and does not fit: %w (%w)", pod.Namespace, pod.Name, unfit, errUndecided)
	}
	for _, slot := range fit[:t.Request.Devices] {
		g := groupAt(ns, slot)
		if g == "" {
			g = newGroup()
		}
		t.Groups = append(t.Groups, g)
	}
	return t, nil
}

// errUndecided marks a fractional pod bound without a GPU decision that
// does not fit its node: no trusted scheduler placed it (spec.nodeName, or
// another scheduler), and its node's agent refuses its containers, which
// it cannot run without a device list. It holds no GPU, so it is no
// conflict: one such pod must not close a node to every fraction (audit
// reports it, FractionWithoutDevices). One that fits is charged while its
// decision may still come.
var errUndecided = errors.New("no trusted scheduler placed it, and its node refuses its containers")

// conflict records why a pod cannot be booked on its node, which then
// takes no fractions, unless the pod holds nothing (errUndecided).
func conflict(ns *nodeState, uid types.UID, err error) {
	if errors.Is(err, errUndecided) {
		delete(ns.Conflicts, string(uid))
		return
	}
	ns.Conflicts[string(uid)] = err.Error()
}

// groupAt is the GPU group a new share on a slot joins: the live group
// there, or the idle group whose reservation pod holds it for shares; ""
// for none.
func groupAt(ns *nodeState, slot int) string {
	for g, s := range ns.Groups {
		if s == slot && (shared(ns.Ledger.Devices[slot]) || ns.Joinable(g)) {
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

// shareOn resolves a request on a node's GPUs: its memory in MiB and,
// for sm-sharing, a compute portion in proportion to the memory, so that
// memory that fits always brings compute that fits.
func shareOn(r api.Request, inv api.Inventory) (gpu.Share, api.Resolved, error) {
	resolved, err := r.Resolve(inv.MemoryMiB, inv.ReserveMiB)
	if err != nil {
		return gpu.Share{}, api.Resolved{}, err
	}
	share := gpu.Share{Request: resolved.RequestMiB, Limit: resolved.LimitMiB, Mode: r.Mode}
	if r.Mode == api.SMSharing {
		share.Portion = api.PortionOfMemory(resolved.RequestMiB, inv.SchedulableMiB()).Of(gpu.FullPortion)
	}
	return share, resolved, nil
}
