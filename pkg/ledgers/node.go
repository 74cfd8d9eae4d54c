package ledgers

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Reservation is a reservation pod: the GPU group it holds, its GPU once
// the node agent names it, and where it is in its life (lifecycle.go).
type Reservation struct {
	Pod  string // namespace/name
	Name string
	UID  types.UID
	// Group is the GPU group it holds.
	Group string
	// UUID is the physical GPU, once the node agent has written it.
	UUID string
	// Held is a standing one's api.SharesHeldAnnotation, as last seen.
	Held    string
	Created time.Time
	State   GroupState
	// Failure says why the kubelet refused the pod, once it has.
	Failure string
}

// Node is one node's GPU tenancy, the one model of who holds which GPU:
// its inventory, its tenants (pods and claim shares), its reservation
// pods, and the ledger with its slots named by GPU group. The scheduler's
// cache keeps one per node and changes it as pods come and go (Add,
// Remove, SeeReservation, DeleteReservation, booking with Place, which
// keeps every invariant); Build makes one per node from a list (the same
// Adds, booked with Record, which keeps what the cluster reports) for
// audit, top, the dashboard and the demo.
type Node struct {
	Name      string
	Inventory api.Inventory
	Ready     bool
	// Why says why fractions cannot land here, when not Ready.
	Why string
	// Standing is how many GPUs the node asks to have held for shares
	// (api.LabelStandingGPUs).
	Standing int
	Layout
	// Tenants are the pods and claim shares holding GPUs here, by ledger
	// tenant (pod UID; <claim UID>/<request> for a claim's share).
	Tenants map[string]*Tenant
	// Reservations are the reservation pods here, by GPU group.
	Reservations map[string]*Reservation
	// WholeGPUs counts the GPUs pods and reservation pods ask the device
	// plugin for (Build's count).
	WholeGPUs int
}

// NewNode returns a node with no tenants over inv's GPUs (no ledger while
// their memory is unknown).
func NewNode(name string, inv api.Inventory) *Node {
	n := &Node{Name: name, Inventory: inv, Tenants: map[string]*Tenant{}, Reservations: map[string]*Reservation{}}
	n.Layout = NewLayout(name, n.usable())
	return n
}

// usable is the inventory the ledger is made of: none until the GPUs'
// memory is known.
func (n *Node) usable() api.Inventory {
	inv := n.Inventory
	if inv.MemoryMiB <= 0 {
		inv.Count = 0
	}
	return inv
}

// GroupOf is the group holding a GPU on this node: the reservation pod's
// that names it, or the group a tenant already booked names for it. A DRA
// device names its GPU lower-cased, so UUIDs compare without case.
func (n *Node) GroupOf(uuid string) (string, bool) {
	// Two reservation pods naming one GPU (one deleted and made again
	// while the other lingers): the one a share may still join, then the
	// least group name, whatever the map's order. A tenant names a GPU
	// nothing else holds for the tenants after it, so tenants agree on one
	// group per GPU.
	best, bestLive := "", false
	for g, r := range n.Reservations {
		if !strings.EqualFold(r.UUID, uuid) {
			continue
		}
		live := r.State != GroupFailed && r.State != GroupRetiring
		if best == "" || (live && !bestLive) || (live == bestLive && g < best) {
			best, bestLive = g, live
		}
	}
	if best != "" {
		return best, true
	}
	for _, t := range n.Tenants {
		for i, u := range t.UUIDs {
			if strings.EqualFold(u, uuid) && i < len(t.Groups) {
				return t.Groups[i], true
			}
		}
	}
	return "", false
}

// GroupOfOrOwn is GroupOf, or the GPU's own group when nothing holds it.
func (n *Node) GroupOfOrOwn(uuid string) string {
	if g, ok := n.GroupOf(uuid); ok {
		return g
	}
	return UUIDGroup(uuid)
}

// ReadTenant reads what a bound pod holds on this node (TenantOf).
func (n *Node) ReadTenant(pod *corev1.Pod) (*Tenant, bool, error) {
	t, held, err := TenantOf(pod, n.GroupOf, n.Inventory.SchedulableMiB())
	if err != nil || !held {
		return nil, held, err
	}
	return &t, true, nil
}

// Reserved says whether a GPU group has a reservation pod on the node.
func (n *Node) Reserved(g string) bool { _, ok := n.Reservations[g]; return ok }

// WantsStanding says whether g is a standing group the node asks for (its
// index below the node's Standing).
func (n *Node) WantsStanding(g string) bool {
	for i := range n.Standing {
		if g == StandingGroup(i) {
			return true
		}
	}
	return false
}

// Joinable says whether a share may join an idle group (Joinable of its
// reservation pod's state). A group that is not joinable never becomes so
// again, so that once empty it stays so and its pod may be deleted.
func (n *Node) Joinable(g string) bool {
	r := n.Reservations[g]
	return r != nil && Joinable(r.State, IsStanding(g), n.WantsStanding(g))
}

// Event applies a lifecycle event to a group's reservation pod and the
// ledger effects it has (Hold, Free, Settle); it returns the effects for
// the caller (Wake, Rebuild).
func (n *Node) Event(g string, e GroupEvent, seen Seen) Effects {
	r := n.Reservations[g]
	if r == nil {
		r = &Reservation{Group: g}
	}
	var fx Effects
	r.State, fx = Transition(r.State, e, seen, IsStanding(g))
	if r.State == GroupNone {
		delete(n.Reservations, g)
		delete(n.Conflicts, Placeholder(g))
	} else {
		n.Reservations[g] = r
	}
	if fx.Hold {
		n.Hold(g)
	}
	if fx.Free {
		n.Free(g)
	}
	if fx.Settle {
		n.Settle(g)
	}
	n.closeUnheld()
	return fx
}

// SeeReservation records a reservation pod as the API shows it (its slot
// stays held while it exists, and its annotation names the physical GPU).
// ok is false for a pod that names no group or node.
func (n *Node) SeeReservation(pod *corev1.Pod) (fx Effects, ok bool) {
	meta, ok := api.ReservationOf(pod)
	if !ok || pod.Spec.NodeName == "" {
		return Effects{}, false
	}
	r, seen := reservationOf(pod, meta)
	if old, known := n.Reservations[meta.Group]; known && (old.UID == pod.UID || old.UID == "") {
		r.State = old.State // a booked pod, or the same pod again; another pod of that name starts afresh
	}
	n.Reservations[meta.Group] = r
	return n.Event(meta.Group, EventSeen, seen), true
}

// reservationOf is a reservation pod as the model keeps it (state None),
// and how the API shows it, for EventSeen.
func reservationOf(pod *corev1.Pod, meta api.Reservation) (*Reservation, Seen) {
	r := &Reservation{Pod: pod.Namespace + "/" + pod.Name, Name: pod.Name, UID: pod.UID, Group: meta.Group, UUID: meta.GPU, Held: meta.Held, Created: pod.CreationTimestamp.Time}
	if pod.Status.Phase == corev1.PodFailed {
		r.Failure = fmt.Sprintf("reservation pod %s/%s failed: %s %s", pod.Namespace, pod.Name, pod.Status.Reason, pod.Status.Message)
	}
	return r, Seen{Named: r.UUID != "", Failed: r.Failure != "", Deleting: pod.DeletionTimestamp != nil}
}

// Settle retires a reservation pod's group that holds no tenant and that
// no share may join (see Joinable), so that nothing takes or joins its GPU
// until the pod is gone: one that failed, was retired, is being deleted,
// is a standing one the node no longer asks for, or found no GPU on the
// ledger (not a standing one: the node's standing pods are made again).
// Retiring sticks: such a group never becomes joinable again.
func (n *Node) Settle(g string) {
	r := n.Reservations[g]
	if r == nil || n.Ledger == nil {
		return
	}
	slot, ok := n.Groups[g]
	if !ok {
		if !IsStanding(g) {
			r.State, _ = Transition(r.State, EventRetire, Seen{}, false)
		}
		return
	}
	if n.Ledger.Devices[slot].Idle() && !n.Joinable(g) {
		if !IsStanding(g) || !n.WantsStanding(g) {
			r.State, _ = Transition(r.State, EventRetire, Seen{}, IsStanding(g))
		}
		n.Retire(g)
	}
}

// Add records a tenant and books it with Place (the scheduler's: keeping
// every invariant; one that does not fit is a conflict).
func (n *Node) Add(t *Tenant) {
	n.Tenants[t.Request.Tenant] = t
	n.Place(*t, n.Reserved)
	n.closeUnheld()
}

// Resize changes what a booked share tenant holds to t's share, in place
// on its GPUs (its groups do not change: a resize never moves a pod). A
// share the ledger cannot take is a conflict, as for Add.
func (n *Node) Resize(t *Tenant) {
	key := t.Request.Tenant
	old, ok := n.Tenants[key]
	if !ok {
		n.Add(t)
		return
	}
	t.Groups = old.Groups
	n.Tenants[key] = t
	if n.Ledger == nil {
		return
	}
	if _, held := n.Ledger.Holds(key); !held {
		n.Place(*t, n.Reserved)
		return
	}
	if err := n.Ledger.Resize(key, t.Request.Share); err != nil {
		n.Conflicts[key] = err.Error()
	}
}

// Remove forgets a tenant and gives its slots back; its groups settle.
func (n *Node) Remove(key string) {
	t, ok := n.Tenants[key]
	if !ok {
		return
	}
	n.Release(*t, n.Reserved)
	delete(n.Tenants, key)
	for _, g := range t.Groups {
		n.Settle(g)
	}
	n.closeUnheld()
}

// closeUnheld marks the GPUs no new share may join (gpu.Device.Closed):
// those where a tenant's decision names its GPU (a UUID) in a group that
// no reservation pod holds. The reservation pod was deleted under live
// tenants (kubectl drain --force, an admin): the device plugin may hand
// the GPU to anyone, and a reservation pod made again by the group's name
// could be given another GPU, so a new share would be booked here and run
// there. The tenants stay booked where they run until they end (their
// node agent stops them: no reservation pod of their group holds their
// GPU), and the audit names them. A share still being placed names no
// UUID yet: its group's reservation pod is being made, and others may
// join it. So do GPUs of another scheduler's tenants held by reservation
// pods gpufrac does not see (KAI's): a reservation pod of gpufrac's could
// not hold that GPU either.
func (n *Node) closeUnheld() {
	if n.Ledger == nil {
		return
	}
	closed := map[int]bool{}
	for _, t := range n.Tenants {
		for i, g := range t.Groups {
			if i >= len(t.UUIDs) || t.UUIDs[i] == "" || n.Reservations[g] != nil {
				continue
			}
			if slot, ok := n.Groups[g]; ok {
				closed[slot] = true
			}
		}
	}
	for i, d := range n.Ledger.Devices {
		d.Closed = closed[i]
	}
}

// Relayout books every tenant and reservation pod again on a fresh
// ledger, in the one order every reader uses (Layout.Fill): with Place
// (the scheduler's, settling every group after), or with Record (Build's).
func (n *Node) Relayout(place bool) {
	n.Layout = NewLayout(n.Name, n.usable())
	tenants := make([]Tenant, 0, len(n.Tenants))
	for _, t := range n.Tenants {
		tenants = append(tenants, *t)
	}
	n.Fill(tenants, slices.Collect(maps.Keys(n.Reservations)), place)
	if place {
		for g := range n.Reservations {
			n.Settle(g)
		}
	}
	n.closeUnheld()
}

// Build records every live bound pod and reservation pod on its node: the
// same Node the scheduler keeps, with its tenants added in the order of
// their keys and the ledger booked as the API reports it (Record): the
// view of what runs, with nothing dropped for breaking an invariant.
// Nodes without GPUs are left out, and so are pods on nodes the list does
// not hold.
//
// claims are the cluster's ResourceClaims: the shares of gpufrac's DRA
// driver they hold are tenants of the same GPUs, beside the pods'.
//
// A node's reservation pods are those in the namespace its agent
// publishes (api.ReservationNamespace).
func Build(nodes []corev1.Node, pods []corev1.Pod, claims []resourceapi.ResourceClaim) Cluster {
	c := Cluster{Nodes: map[string]*Node{}}
	reservations := map[string]string{} // node → its reservation namespace
	for i := range nodes {
		reservations[nodes[i].Name] = api.ReservationNamespace(&nodes[i])
		inv, ready, why := api.InventoryOf(&nodes[i])
		if inv.Count <= 0 {
			continue
		}
		n := NewNode(nodes[i].Name, inv)
		n.Ready, n.Why = ready, why
		c.Nodes[n.Name] = n
	}
	// A pod on its way out (a deletion timestamp) holds its GPU memory
	// until its containers have stopped, and the scheduler charges it so
	// until it is gone: so do these books. A reservation pod being deleted
	// holds its GPU for no new share.
	live := func(p *corev1.Pod) *Node {
		if p.Spec.NodeName == "" || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			return nil
		}
		return c.Nodes[p.Spec.NodeName]
	}
	for i := range pods {
		p := &pods[i]
		if n := live(p); n != nil && p.Namespace == reservations[n.Name] && p.DeletionTimestamp == nil {
			n.WholeGPUs += api.WholeGPUs(&p.Spec)
			if meta, ok := api.ReservationOf(p); ok {
				r, seen := reservationOf(p, meta)
				r.State, _ = Transition(GroupNone, EventSeen, seen, IsStanding(meta.Group))
				n.Reservations[meta.Group] = r
			}
		}
	}
	// Tenants in the order of their keys, so that which of two tenants
	// naming one GPU names its group for the other does not depend on the
	// list's order.
	order := make([]int, len(pods))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(tenantKey(&pods[a]), tenantKey(&pods[b])) })
	for _, i := range order {
		p := &pods[i]
		n := live(p)
		if n == nil || p.Namespace == reservations[n.Name] {
			continue
		}
		n.WholeGPUs += api.WholeGPUs(&p.Spec)
		t, held, err := n.ReadTenant(p)
		switch {
		case err != nil:
			c.Problems = append(c.Problems, Problem{Pod: p.Namespace + "/" + p.Name, Node: n.Name,
				NoDecision: !api.HasDecision(p.Annotations), Err: err})
		case held:
			n.Tenants[t.Request.Tenant] = t
		}
	}
	for i := range claims {
		ts, err := ClaimTenants(&claims[i])
		if err != nil {
			node := ""
			if len(ts) > 0 {
				node = ts[0].Node
			}
			c.Problems = append(c.Problems, Problem{Pod: "resourceclaim " + claims[i].Namespace + "/" + claims[i].Name, Node: node, Err: err})
		}
		for _, ct := range ts {
			if n := c.Nodes[ct.Node]; n != nil {
				t := ct.Tenant
				t.Groups = []string{n.GroupOfOrOwn(t.UUIDs[0])}
				n.Tenants[t.Request.Tenant] = &t
			}
		}
	}
	for _, n := range c.Nodes {
		n.Relayout(false)
	}
	slices.SortFunc(c.Problems, func(a, b Problem) int { return cmp.Compare(a.Pod, b.Pod) })
	return c
}

// tenantKey is the ledger key TenantOf gives a pod.
func tenantKey(p *corev1.Pod) string {
	if p.UID != "" {
		return string(p.UID)
	}
	return p.Namespace + "/" + p.Name
}
