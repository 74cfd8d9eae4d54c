// Package audit checks a cluster's pods and nodes against the scheduler's
// promises (SPEC §2): no GPU over-committed, one compute mode per GPU,
// sm-sharing portions summing to at most 1, every scheduled fractional
// pod carrying its devices, every device held by a reservation pod on the
// pod's node, no reservation pod without tenants, and no node handing out
// more GPUs than it has. It reads objects and returns findings; it does
// no I/O.
package audit

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// Kind names a violated invariant.
type Kind string

// The invariants.
const (
	OverCommitted  Kind = "GPUOverCommitted"
	MixedModes     Kind = "MixedComputeModes"
	ComputeOverOne Kind = "ComputePortionOverOne"
	NoDevices      Kind = "FractionWithoutDevices"
	BadDecision    Kind = "InvalidDecision"
	NoReservation  Kind = "DeviceWithoutReservation"
	OrphanReserve  Kind = "OrphanReservationPod"
	TooManyGPUs    Kind = "NodeGPUsOverCommitted"
	WholeShared    Kind = "WholeGPUShared"
	Unaccounted    Kind = "GPUsNotAccounted"
	// GroupsDisputed: a pod's gpufrac.io/gpu-groups disagrees with the
	// GPUs it holds (an edited annotation); its share is counted on its
	// GPUs, whatever the annotation says.
	GroupsDisputed Kind = "GPUGroupsDisputed"
)

// Violation is one broken invariant, with the objects involved.
type Violation struct {
	Kind    Kind
	Object  string // namespace/name of a pod, or node/GPU
	Message string
}

func (v Violation) String() string { return fmt.Sprintf("%s %s: %s", v.Kind, v.Object, v.Message) }

// Options tune the audit.
type Options struct {
	// OrphanGrace spares reservation pods younger than this: the
	// scheduler creates one before it binds its first tenant.
	OrphanGrace time.Duration
	// Now is the time orphans are judged at.
	Now time.Time
}

// ledgerKinds names the audit finding for each GPU promise the ledger
// keeps.
var ledgerKinds = map[gpu.ViolationKind]Kind{
	gpu.OverCommitted:  OverCommitted,
	gpu.MixedModes:     MixedModes,
	gpu.ComputeOverOne: ComputeOverOne,
	gpu.WholeShared:    WholeShared,
}

// Check returns every violation, sorted. The GPU invariants are the
// ledger's own (gpu.Node.Violations, on ledgers recorded from the pods as
// they are); the rest are about reservation pods and decisions.
//
// claims are the cluster's ResourceClaims: DRA shares of gpufrac's driver
// are tenants of the same GPUs as the pods' (nil: none).
func Check(nodes []corev1.Node, pods []corev1.Pod, claims []resourceapi.ResourceClaim, o Options) []Violation {
	var out []Violation
	add := func(kind Kind, object, format string, args ...any) {
		out = append(out, Violation{Kind: kind, Object: object, Message: fmt.Sprintf(format, args...)})
	}
	cluster := ledgers.Build(nodes, pods, claims)
	for _, p := range cluster.Problems {
		if p.NoDecision {
			add(NoDevices, p.Pod, "is bound to %s and asks for a GPU fraction, but carries no %s: the node will not run it", p.Node, api.SuffixDevices)
		} else {
			add(BadDecision, p.Pod, "%v", p.Err)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(cluster.Nodes)) {
		n := cluster.Nodes[name]
		podOf := func(tenant string) string {
			if t, ok := n.Tenants[tenant]; ok {
				return t.Pod
			}
			return tenant
		}
		if n.Ledger != nil {
			for _, v := range n.Ledger.Violations() {
				gpuName := n.UUID(v.Device)
				if gpuName == "" {
					gpuName = fmt.Sprintf("GPU %d", v.Device)
				}
				tenants := make([]string, len(v.Tenants))
				for i, t := range v.Tenants {
					tenants[i] = podOf(t)
				}
				slices.Sort(tenants)
				add(ledgerKinds[v.Kind], name+"/"+gpuName, "%s (memory in MiB): %v", v.Detail, tenants)
			}
		}
		for _, key := range slices.Sorted(maps.Keys(n.Conflicts)) {
			if _, pod := n.Tenants[key]; pod { // reservation pods: TooManyGPUs says it
				add(Unaccounted, podOf(key), "holds GPUs on %s that its %d GPUs cannot account for: %s", name, n.Inventory.Count, n.Conflicts[key])
			}
		}
		// A reservation pod is used when a tenant names its group or its GPU.
		usedGroups := map[string]bool{}
		reservedUUIDs := map[string]bool{}
		for _, r := range n.Reservations {
			if r.UUID != "" {
				reservedUUIDs[strings.ToLower(r.UUID)] = true // DRA devices name GPUs lower-cased
			}
		}
		for _, key := range slices.Sorted(maps.Keys(n.Tenants)) {
			t := n.Tenants[key]
			for _, d := range t.Disputed {
				add(GroupsDisputed, t.Pod, "on %s: %s; counted on the GPU", name, d)
			}
			for _, g := range t.Groups {
				usedGroups[g] = true
			}
			for _, uuid := range t.UUIDs {
				if !reservedUUIDs[strings.ToLower(uuid)] {
					add(NoReservation, t.Pod, "uses GPU %s on %s, which no reservation pod on that node holds: the device plugin may give it to another pod", uuid, name)
				}
			}
		}
		for _, g := range slices.Sorted(maps.Keys(n.Reservations)) {
			r := n.Reservations[g]
			// An idle reservation pod that names its GPU holds it for
			// shares on purpose: the next share on the node joins it,
			// and the scheduler deletes it for a whole-GPU pod that
			// needs the GPU (a standing one, ledgers.StandingGroup, is
			// kept even then). One never told its GPU holds a GPU nobody
			// can join.
			if usedGroups[g] || r.UUID != "" || o.Now.Sub(r.Created) < o.OrphanGrace {
				continue
			}
			add(OrphanReserve, r.Pod, "holds a GPU on %s for no pod, and has not been told which (is the node agent running?)", name)
		}
		if n.WholeGPUs > n.Inventory.Count {
			add(TooManyGPUs, name, "pods and reservation pods hold %d GPUs of %d allocatable", n.WholeGPUs, n.Inventory.Count)
		}
	}
	slices.SortFunc(out, func(a, b Violation) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(a.Object, b.Object), cmp.Compare(a.Message, b.Message))
	})
	return out
}

// OnNodes keeps the pods bound to one of the nodes, for an audit of part
// of a cluster.
func OnNodes(pods []corev1.Pod, nodes []corev1.Node) []corev1.Pod {
	names := map[string]bool{}
	for _, n := range nodes {
		names[n.Name] = true
	}
	var out []corev1.Pod
	for _, p := range pods {
		if names[p.Spec.NodeName] {
			out = append(out, p)
		}
	}
	return out
}

// Reclaims are, for each GPU whose tenants use more than their request by
// their node's last reading, the order in which its node agent would stop
// them were the GPU short of memory (api.ReclaimOrder), one line per GPU,
// sorted: no violation (a share may burst up to its limit while the GPU
// has room), but what an operator reads beside the audit.
func Reclaims(nodes []corev1.Node, pods []corev1.Pod, claims []resourceapi.ResourceClaim) []string {
	var out []string
	for _, n := range clusterview.Build(nodes, pods, claims).Nodes {
		for _, g := range n.Shared {
			if len(g.ReclaimOrder) == 0 {
				continue
			}
			out = append(out, fmt.Sprintf("reclaimed first on %s GPU %s, were it short of memory: %s", n.Name, g.UUID, strings.Join(g.ReclaimOrder, ", ")))
		}
	}
	slices.Sort(out)
	return out
}

// Resizes are the resizes of bound pods not yet granted and applied
// (api.DescribeResize), one line each, sorted: no violation (the ledger
// charges each pod the larger of what it was granted and what its node
// enforces), but what an operator reads beside the audit.
func Resizes(pods []corev1.Pod) []string {
	var out []string
	for i := range pods {
		p := &pods[i]
		if p.Spec.NodeName == "" || api.PodEnded(p) {
			continue
		}
		if as, err := api.ParseAssignments(p.Annotations); err == nil && len(as) > 0 {
			if d := api.DescribeResize(p, as[0]); d != "" {
				out = append(out, fmt.Sprintf("resizing %s/%s on %s: %s", p.Namespace, p.Name, p.Spec.NodeName, d))
			}
		}
	}
	slices.Sort(out)
	return out
}
