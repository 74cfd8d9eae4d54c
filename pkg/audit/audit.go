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
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
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
	// ReservationNamespace holds the reservation pods.
	ReservationNamespace string
	// ReserveMiB is the per-GPU memory the scheduler keeps back; a GPU is
	// over-committed when its tenants' requests exceed total − reserve.
	ReserveMiB func(model string) int64
	// OrphanGrace spares reservation pods younger than this: the
	// scheduler creates one before it binds its first tenant.
	OrphanGrace time.Duration
	// Now is the time orphans are judged at.
	Now time.Time
}

type gpuKey struct{ node, uuid string }

type gpuUse struct {
	tenants []string
	charged int64
	portion int64
	modes   map[api.ComputeMode]bool
}

// Check returns every violation, sorted.
func Check(nodes []corev1.Node, pods []corev1.Pod, o Options) []Violation {
	var out []Violation
	add := func(kind Kind, object, format string, args ...any) {
		out = append(out, Violation{Kind: kind, Object: object, Message: fmt.Sprintf(format, args...)})
	}
	nodeByName := map[string]*corev1.Node{}
	for i := range nodes {
		nodeByName[nodes[i].Name] = &nodes[i]
	}
	// The GPUs held by reservation pods, per node, and who uses them.
	reserved := map[gpuKey]*corev1.Pod{}
	gpusOnNode := map[string]int{}
	for i := range pods {
		pod := &pods[i]
		if pod.Spec.NodeName == "" || terminated(pod) {
			continue
		}
		gpusOnNode[pod.Spec.NodeName] += api.WholeGPUs(&pod.Spec)
		if pod.Namespace == o.ReservationNamespace {
			if uuid := pod.Annotations[api.ReservedGPUAnnotation]; uuid != "" {
				reserved[gpuKey{pod.Spec.NodeName, uuid}] = pod
			}
		}
	}
	used := map[gpuKey]*gpuUse{}
	// A reservation pod is used when a tenant names its group (node/group)
	// or its GPU (namespace/name of the reservation pod).
	usedGroups, usedReservations := map[string]bool{}, map[string]bool{}
	for i := range pods {
		pod := &pods[i]
		if pod.Namespace == o.ReservationNamespace || pod.Spec.NodeName == "" || terminated(pod) {
			continue
		}
		name := pod.Namespace + "/" + pod.Name
		assignments, err := api.ParseAssignments(pod.Annotations)
		if err != nil {
			if !api.HasContainerKey(pod.Annotations, api.SuffixDevices) {
				add(NoDevices, name, "is bound to %s and asks for a GPU fraction, but carries no %s: the node will not run it", pod.Spec.NodeName, api.SuffixDevices)
			} else {
				add(BadDecision, name, "%v", err)
			}
			continue
		}
		for _, g := range api.SplitList(pod.Annotations[api.GPUGroupsAnnotation]) {
			usedGroups[pod.Spec.NodeName+"/"+g] = true
		}
		for _, a := range assignments {
			for _, uuid := range a.Devices {
				k := gpuKey{pod.Spec.NodeName, uuid}
				r, ok := reserved[k]
				if !ok {
					add(NoReservation, name, "uses GPU %s on %s, which no reservation pod on that node holds: the device plugin may give it to another pod", uuid, pod.Spec.NodeName)
				} else {
					usedReservations[r.Namespace+"/"+r.Name] = true
				}
				u := used[k]
				if u == nil {
					u = &gpuUse{modes: map[api.ComputeMode]bool{}}
					used[k] = u
				}
				u.tenants = append(u.tenants, name)
				u.charged += a.RequestMiB
				u.portion += a.Portion.Of(gpu.FullPortion)
				u.modes[a.Mode] = true
			}
		}
	}
	for k, u := range used {
		object := k.node + "/" + k.uuid
		slices.Sort(u.tenants)
		if node := nodeByName[k.node]; node != nil {
			if mem, err := strconv.ParseInt(node.Labels[api.LabelGPUMemory], 10, 64); err == nil {
				reserve := int64(0)
				if o.ReserveMiB != nil {
					reserve = o.ReserveMiB(node.Labels[api.LabelGPUProduct])
				}
				if u.charged > mem-reserve {
					add(OverCommitted, object, "tenants request %dMi of %dMi schedulable (%dMi − %dMi reserve): %v", u.charged, mem-reserve, mem, reserve, u.tenants)
				}
			}
		}
		if len(u.modes) > 1 {
			add(MixedModes, object, "runs both %s and %s: %v", api.TimeSlicing, api.SMSharing, u.tenants)
		}
		if u.portion > gpu.FullPortion {
			add(ComputeOverOne, object, "sm-sharing portions sum to %d/1000: %v", u.portion, u.tenants)
		}
	}
	for i := range pods {
		r := &pods[i]
		name := r.Namespace + "/" + r.Name
		if r.Namespace != o.ReservationNamespace || r.Spec.NodeName == "" || terminated(r) ||
			usedReservations[name] || usedGroups[r.Spec.NodeName+"/"+r.Labels[api.GPUGroupLabel]] || o.Now.Sub(r.CreationTimestamp.Time) < o.OrphanGrace {
			continue
		}
		if uuid := r.Annotations[api.ReservedGPUAnnotation]; uuid != "" {
			add(OrphanReserve, name, "holds GPU %s on %s for no pod: the GPU is lost to the cluster until it is deleted", uuid, r.Spec.NodeName)
		} else {
			add(OrphanReserve, name, "holds a GPU on %s for no pod, and has not been told which", r.Spec.NodeName)
		}
	}
	for name, n := range gpusOnNode {
		node := nodeByName[name]
		if node == nil {
			continue
		}
		if q, ok := node.Status.Allocatable[api.ResourceGPU]; ok && int64(n) > q.Value() {
			add(TooManyGPUs, name, "pods and reservation pods hold %d GPUs of %d allocatable", n, q.Value())
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

func terminated(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed || pod.DeletionTimestamp != nil
}
