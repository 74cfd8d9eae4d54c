// Package ledgers is the one model of GPU tenancy: who holds which GPU on
// a node (Node: tenants, reservation pods and their lifecycle, the ledger
// with its slots named by GPU group), read from nodes, pods and claims as
// the API reports them. The scheduler's cache keeps a Node per node and
// changes it as objects come and go (placing tenants, so keeping every
// invariant); Build makes the same Nodes from lists for `gpufrac audit`
// (which records tenants as they are, so the ledger's own Violations say
// what a cluster breaks), `gpufrac top`, the dashboard and the replay. It
// is pure: objects in, ledgers out.
//
// A ledger's slots have no identity of their own. A shared GPU is a GPU
// group, held by one reservation pod, and the physical GPU is whichever
// the device plugin gave that pod; so a slot is named by its group, and
// by the GPU's UUID once a decision or a reservation pod says it.
package ledgers

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// Tenant is what one pod holds on its node.
type Tenant struct {
	// Request is what the ledger books; Request.Tenant is the pod's UID
	// (its namespace/name when it has none).
	Request gpu.Request
	// Groups are a share tenant's GPU groups, one per device.
	Groups []string
	// UUIDs are the GPUs of a share tenant's decision, one per device.
	UUIDs []string
	// Pod is namespace/name.
	Pod string
	// Assignment is a share tenant's decision; nil for whole GPUs.
	Assignment *api.Assignment
	// Claim is set for a share a ResourceClaim holds (DRA), whose Pod
	// is then the claim's namespace/name/request.
	Claim bool
	// Disputed says where the groups the pod's decision names disagree
	// with the GPUs it holds (an edited annotation): the GPUs win.
	Disputed []string
}

// Placeholder is the ledger tenant that holds the GPU of a reservation
// pod being deleted (Layout.Retire): the device plugin still holds the GPU
// for it, so nobody may take it, and no share may join it.
func Placeholder(group string) string { return placeholderPrefix + group }

const placeholderPrefix = "reservation/"

// IsPlaceholder reports whether a ledger tenant is a reservation pod's
// placeholder rather than a pod.
func IsPlaceholder(tenant string) bool { return strings.HasPrefix(tenant, placeholderPrefix) }

// UUIDGroup names the group of a GPU known only by its UUID: a pod placed
// by another scheduler (KAI writes no groups of ours), whose GPU no
// reservation pod of ours names.
func UUIDGroup(uuid string) string { return "uuid-" + strings.ToLower(uuid) }

// StandingGroup names the i-th GPU group a node holds for sharing at all
// times: a node that serves DRA claims asks (api.LabelStandingGPUs) for
// that many GPUs held against the device plugin, so that claims, which
// name physical GPUs the device plugin knows nothing of, land only on
// GPUs no whole-GPU pod can be given. Annotation shares join them too:
// one GPU, one ledger, both front doors. Random group names (the
// scheduler's) never hold a '-', so neither this nor UUIDGroup can
// collide with one.
func StandingGroup(i int) string { return standingPrefix + strconv.Itoa(i) }

const standingPrefix = "standing-"

// IsStanding reports whether a group is a standing one (StandingGroup):
// its slot is held for shares even while it has none, and its
// reservation pod outlives its tenants.
func IsStanding(group string) bool { return strings.HasPrefix(group, standingPrefix) }

// GroupOf names the GPU group of a GPU by its UUID on a node: known is
// true when something that cannot be forged from the pod says it (a
// reservation pod, whose GPU the node agent wrote, or a tenant already
// booked on that GPU).
type GroupOf func(uuid string) (group string, known bool)

// TenantOf reads what a bound pod holds: whole GPUs, or the shares its
// scheduler wrote. A share's GPU groups are derived from its GPUs, joined
// with what holds them on the node (groupOf); the groups a decision names
// (gpufrac's GPUGroupsAnnotation, which a pod's author can edit) are only
// a label, used for a GPU nothing on the node knows yet, and a group that
// disagrees with the GPU is recorded in Tenant.Disputed. A GPU known by
// nothing is its own group (UUIDGroup: another scheduler's pod). An
// sm-sharing share its scheduler gave no portion (released KAI) is charged
// the portion the node derives from its memory share of schedulableMiB.
// held is false for a pod that holds no GPU; err says why a pod that asks
// for a fraction carries no readable decision.
func TenantOf(pod *corev1.Pod, groupOf GroupOf, schedulableMiB int64) (t Tenant, held bool, err error) {
	t = Tenant{Request: gpu.Request{Tenant: string(pod.UID)}, Pod: pod.Namespace + "/" + pod.Name}
	if t.Request.Tenant == "" {
		t.Request.Tenant = t.Pod // a manifest read from a file has no UID
	}
	if n := api.WholeGPUs(&pod.Spec); n > 0 {
		t.Request.Whole = n
		return t, true, nil
	}
	assignments, err := api.ParseAssignments(pod.Annotations)
	if err != nil || len(assignments) == 0 {
		return Tenant{}, false, err
	}
	a := assignments[0]
	t.Assignment = &a
	t.UUIDs = a.Devices
	t.Request.Devices = len(a.Devices)
	// A resize the node has not applied yet is charged at the larger of
	// its old and new memory (api.Resize.Charged); a resize key that
	// cannot be read changes nothing here (admission refuses it).
	r, _ := api.ResizeOf(pod.Annotations, a)
	charged := r.Charged()
	t.Request.Share = gpu.Share{Request: charged.RequestMiB, Limit: charged.LimitMiB, Mode: a.Mode, Portion: a.Portion.Of(gpu.FullPortion)}
	if a.Mode == api.SMSharing && a.Portion.IsZero() {
		if schedulableMiB <= 0 {
			return Tenant{}, false, fmt.Errorf("pod %s is sm-sharing without a compute portion, which is derived from its node's GPU memory, not known yet", t.Pod)
		}
		t.Request.Share.Portion = api.PortionOfMemory(a.RequestMiB, schedulableMiB).Of(gpu.FullPortion)
	}
	annotated := api.DecisionGroups(pod.Annotations)
	if len(annotated) != len(a.Devices) {
		annotated = nil // another scheduler's decision, or one cut short
	}
	for i, uuid := range a.Devices {
		g, known := groupOf(uuid)
		switch {
		case known && annotated != nil && annotated[i] != g:
			t.Disputed = append(t.Disputed, fmt.Sprintf("%s names GPU group %s for GPU %s, which group %s holds", api.GPUGroupsAnnotation, annotated[i], uuid, g))
		case !known && annotated != nil:
			g = annotated[i]
		case !known:
			g = UUIDGroup(uuid)
		}
		t.Groups = append(t.Groups, g)
	}
	return t, true, nil
}

// ClaimTenant is one share a ResourceClaim holds, on its node.
type ClaimTenant struct {
	Node string
	// Tenant is keyed <claim UID>/<request>; its one UUID is the GPU's as
	// the device names it, and its group is the caller's to name
	// (groupOf(uuid) on the node), as for a pod of another scheduler.
	Tenant Tenant
}

// ClaimTenants reads the shares a claim's allocation holds on gpufrac's
// DRA devices (api.ClaimShares), pending allocations included when the
// caller passes the scheduler's in-flight view of the claim. A share that
// cannot be read is an error, and the rest still count.
func ClaimTenants(claim *resourceapi.ResourceClaim) ([]ClaimTenant, error) {
	shares, err := api.ClaimShares(claim)
	out := make([]ClaimTenant, 0, len(shares))
	seen := map[string]bool{}
	for i, s := range shares {
		a := s.Assignment
		key := string(claim.UID) + "/" + s.Request
		if seen[key] {
			// Two devices for one request (the node refuses to prepare
			// it): both are counted, each under a key of its own.
			key += "/" + strconv.Itoa(i)
		}
		seen[key] = true
		out = append(out, ClaimTenant{Node: s.Node, Tenant: Tenant{
			Request: gpu.Request{Tenant: key, Devices: 1, Share: gpu.Share{Request: a.RequestMiB, Limit: a.LimitMiB, Mode: a.Mode, Portion: a.Portion.Of(gpu.FullPortion)}},
			UUIDs:   a.Devices, Pod: claim.Namespace + "/" + claim.Name + "/" + s.Request, Assignment: &a, Claim: true,
		}})
	}
	return out, err
}

// Layout is one node's ledger with its slots named by GPU group.
type Layout struct {
	// Ledger is nil while the node's GPU inventory is unknown.
	Ledger *gpu.Node
	// Groups maps a GPU group to its slot.
	Groups map[string]int
	// Conflicts are the tenants (and reservation placeholders) the
	// ledger could not book, with why.
	Conflicts map[string]string
}

// NewLayout returns an empty layout over the node's GPUs, each of
// inv.MemoryMiB with inv.ReserveMiB kept back; without GPUs it has no ledger.
func NewLayout(name string, inv api.Inventory) Layout {
	l := Layout{Groups: map[string]int{}, Conflicts: map[string]string{}}
	if inv.Count > 0 {
		devices := make([]*gpu.Device, inv.Count)
		for i := range devices {
			devices[i] = &gpu.Device{Index: i, Model: inv.Model, Total: inv.MemoryMiB, Reserve: inv.ReserveMiB}
		}
		l.Ledger = gpu.NewNode(name, 0, 0, devices...)
	}
	return l
}

// booker books a request on slots: gpu.Node.Assign (keeping every
// invariant) or gpu.Node.Record (keeping what the cluster reports).
type booker func(n *gpu.Node, r gpu.Request, slots []int) error

func assign(n *gpu.Node, r gpu.Request, slots []int) error { return n.Assign(r, slots) }
func record(n *gpu.Node, r gpu.Request, slots []int) error { return n.Record(r, slots) }

// Place books a tenant, keeping the ledger's invariants: a share on its
// groups' slots (a group seen for the first time takes the lowest idle
// slot, releasing its reservation placeholder), whole GPUs on the lowest
// idle slots. A tenant that does not fit is a conflict. reserved says
// which groups have a reservation pod, whose slots outlive their tenants.
func (l *Layout) Place(t Tenant, reserved func(group string) bool) {
	l.book(t, reserved, assign)
}

// Record books a tenant as the cluster reports it, fitting or not (see
// gpu.Node.Record); only a tenant with no slot left is a conflict.
func (l *Layout) Record(t Tenant) {
	l.book(t, func(string) bool { return false }, record)
}

func (l *Layout) book(t Tenant, reserved func(string) bool, book booker) {
	if l.Ledger == nil {
		return // counted once the node reports its GPUs
	}
	key := t.Request.Tenant
	var slots []int
	if t.Request.Whole > 0 {
		fit, unfit := l.Ledger.Fit(t.Request)
		if unfit != nil {
			l.Conflicts[key] = unfit.Error()
			return
		}
		slots = fit[:t.Request.Whole]
	} else {
		for _, g := range t.Groups {
			slot, ok := l.Groups[g]
			if !ok {
				if slot = lowestIdle(l.Ledger, slots); slot < 0 {
					l.Conflicts[key] = fmt.Sprintf("no idle GPU for GPU group %s", g)
					l.DropEmpty(t.Groups, reserved)
					return
				}
				l.Groups[g] = slot
				l.Ledger.Devices[slot].SharedOnly = IsStanding(g)
			}
			if l.Ledger.Devices[slot].Whole() == Placeholder(g) {
				_ = l.Ledger.Release(Placeholder(g))
			}
			slots = append(slots, slot)
		}
	}
	if err := book(l.Ledger, t.Request, slots); err != nil {
		l.Conflicts[key] = err.Error()
		l.DropEmpty(t.Groups, reserved)
	}
}

// lowestIdle is the lowest idle slot not among taken, or -1. A standing
// group's slot is never idle for another group: the device plugin holds
// its GPU, so a new group's reservation pod is given another.
func lowestIdle(n *gpu.Node, taken []int) int {
	for i, d := range n.Devices {
		if d.Idle() && !d.SharedOnly && !slices.Contains(taken, i) {
			return i
		}
	}
	return -1
}

// DropEmpty forgets the slots of groups that hold nothing: no share, and
// no reservation pod (whose slot it holds again).
func (l *Layout) DropEmpty(groups []string, reserved func(group string) bool) {
	for _, g := range groups {
		slot, ok := l.Groups[g]
		if !ok {
			continue
		}
		if d := l.Ledger.Devices[slot]; d.Idle() {
			if reserved(g) {
				l.Hold(g)
				continue
			}
			d.SharedOnly = false
			delete(l.Groups, g)
		}
	}
}

// Hold keeps the slot of a reservation pod whose group has no tenants,
// marked as held for shares (gpu.Device.SharedOnly): the reservation pod
// is kept for the GPU's life, so a share may join its group again without
// a new reservation pod (a create and the node agent's write), while no
// whole-GPU pod may have the GPU until the scheduler deletes the pod to
// make room (Retire).
func (l *Layout) Hold(g string) {
	if l.Ledger == nil {
		return
	}
	slot, ok := l.Groups[g]
	if ok && (!l.Ledger.Devices[slot].Idle() || l.Ledger.Devices[slot].SharedOnly) {
		return // tenants, or already held
	}
	if !ok {
		if slot = lowestIdle(l.Ledger, nil); slot < 0 {
			l.Conflicts[Placeholder(g)] = fmt.Sprintf("no idle GPU for reservation pod of GPU group %s", g)
			return
		}
		l.Groups[g] = slot
	}
	l.Ledger.Devices[slot].SharedOnly = true
}

// Retire holds a group's slot for a reservation pod being deleted: with a
// placeholder, so that neither a share nor a whole-GPU pod takes the GPU
// before the device plugin has it back. Only an idle group is retired.
func (l *Layout) Retire(g string) bool {
	slot, ok := l.Groups[g]
	if l.Ledger == nil || !ok {
		return false
	}
	d := l.Ledger.Devices[slot]
	if d.Whole() == Placeholder(g) {
		return true
	}
	if !d.Idle() {
		return false
	}
	d.SharedOnly = false
	if err := l.Ledger.Assign(gpu.Request{Tenant: Placeholder(g), Whole: 1}, []int{slot}); err != nil {
		d.SharedOnly = true
		return false
	}
	return true
}

// Free gives back the slot of a group whose reservation pod is gone: held
// for shares with no tenant, or retired with its placeholder. A group
// with tenants keeps its slot (they still use the GPU).
func (l *Layout) Free(g string) {
	slot, ok := l.Groups[g]
	if l.Ledger == nil || !ok {
		return
	}
	d := l.Ledger.Devices[slot]
	switch {
	case d.Idle():
		d.SharedOnly = false
		delete(l.Groups, g)
	case d.Whole() == Placeholder(g):
		_ = l.Ledger.Release(Placeholder(g))
		delete(l.Groups, g)
	}
}

// Release returns a tenant's slots; its groups' slots are dropped unless
// reserved.
func (l *Layout) Release(t Tenant, reserved func(group string) bool) {
	if _, conflict := l.Conflicts[t.Request.Tenant]; conflict {
		delete(l.Conflicts, t.Request.Tenant)
		return
	}
	if l.Ledger != nil {
		_ = l.Ledger.Release(t.Request.Tenant)
		l.DropEmpty(t.Groups, reserved)
	}
}

// Fill books tenants and holds the reservation groups on a fresh layout,
// in the one order every reader uses: shares first (so whole-GPU pods take
// the slots left over), then whole GPUs, then the reservation pods whose
// groups have no tenant. place books with Place or, when false, Record.
func (l *Layout) Fill(tenants []Tenant, reservations []string, place bool) {
	reserved := func(g string) bool { return slices.Contains(reservations, g) }
	sorted := slices.SortedFunc(slices.Values(tenants), func(a, b Tenant) int {
		return cmp.Or(cmp.Compare(a.Request.Whole, b.Request.Whole), cmp.Compare(a.Request.Tenant, b.Request.Tenant))
	})
	for _, t := range sorted {
		if place {
			l.Place(t, reserved)
		} else {
			l.Record(t)
		}
	}
	for _, g := range slices.Sorted(slices.Values(reservations)) {
		l.Hold(g)
	}
}

// UUID is the physical GPU on a slot, when a decision or a reservation
// pod names it; "" otherwise.
func (n *Node) UUID(slot int) string {
	for g, s := range n.Groups {
		if s != slot {
			continue
		}
		if r, ok := n.Reservations[g]; ok && r.UUID != "" {
			return r.UUID
		}
		for _, t := range n.Tenants {
			if i := slices.Index(t.Groups, g); i >= 0 && i < len(t.UUIDs) {
				return t.UUIDs[i]
			}
		}
	}
	return ""
}

// Problem is a bound pod whose GPUs cannot be read: it asks for a
// fraction and carries no readable decision.
type Problem struct {
	Pod  string // namespace/name
	Node string
	// NoDecision is set when no scheduler has written devices at all.
	NoDecision bool
	Err        error
}

// Cluster is every node with GPUs, its ledger recorded from the pods.
type Cluster struct {
	Nodes    map[string]*Node
	Problems []Problem
}
