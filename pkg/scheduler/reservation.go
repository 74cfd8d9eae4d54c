package scheduler

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// Labels on reservation pods.
const (
	labelManagedBy  = "app.kubernetes.io/managed-by"
	labelComponent  = "app.kubernetes.io/component"
	managedBy       = "gpufrac-scheduler"
	componentHolder = "gpu-reservation"
)

// ReservationName is the reservation pod of a GPU group on a node:
// gpufrac-<node>-<group>, with the node part shortened and a hash added
// when the whole would exceed a pod name's 253 characters.
func ReservationName(node, group string) string {
	const limit = 253
	name := "gpufrac-" + node + "-" + group
	if len(name) <= limit {
		return name
	}
	sum := sha256.Sum256([]byte(node))
	suffix := "-" + hex.EncodeToString(sum[:4]) + "-" + group
	return (name[:limit-len(suffix)]) + suffix
}

// ReservationPod is the pod that holds one shared GPU against the device
// plugin: it asks for one nvidia.com/gpu, is bound straight to the node
// (no scheduler runs it, so no one can place it elsewhere), tolerates
// every taint so that the node's taints never evict a GPU from under its
// tenants, and runs at high priority so that nothing preempts it.
func ReservationPod(args Args, node, group string) *corev1.Pod {
	one := resource.MustParse("1")
	noPrivilege := false
	nonRoot := true
	labels := api.ReservationLabels(group, ledgers.IsStanding(group))
	labels[labelManagedBy] = managedBy
	labels[labelComponent] = componentHolder
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      ReservationName(node, group),
			Namespace: args.ReservationNamespace,
			Labels:    labels,
		},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			PriorityClassName:             args.ReservationPriorityClassName,
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			TerminationGracePeriodSeconds: new(int64),
			AutomountServiceAccountToken:  &noPrivilege,
			EnableServiceLinks:            &noPrivilege,
			Containers: []corev1.Container{{
				Name:  "reserve",
				Image: args.ReservationImage,
				Resources: corev1.ResourceRequirements{
					Limits:   corev1.ResourceList{api.ResourceGPU: one},
					Requests: corev1.ResourceList{api.ResourceGPU: one},
				},
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: &noPrivilege,
					RunAsNonRoot:             &nonRoot,
					RunAsUser:                new(int64(65535)),
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
			}},
		},
	}
}

// setReservation records a reservation pod: its group's slot stays held
// while it exists, and its annotation names the physical GPU.
func (c *Cache) setReservation(pod *corev1.Pod) {
	if _, ok := api.ReservationOf(pod); !ok || pod.Spec.NodeName == "" {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if fx, _ := c.node(pod.Spec.NodeName).SeeReservation(pod); fx.Wake {
		c.markDirty()
	}
}

func (c *Cache) deleteReservation(pod *corev1.Pod) {
	meta, _ := api.ReservationOf(pod)
	c.mu.Lock()
	defer c.mu.Unlock()
	ns, ok := c.nodes[pod.Spec.NodeName]
	if !ok || ns.Reservations[meta.Group] == nil || ns.Reservations[meta.Group].Name != pod.Name {
		return
	}
	fx := ns.Event(meta.Group, ledgers.EventDeleted, ledgers.Seen{})
	if fx.Wake {
		c.markDirty() // a standing pod the node lacks may take the GPU now
	}
	if ns.Ledger != nil && (fx.Rebuild || len(ns.Conflicts) > 0) {
		c.rebuild(ns)
	}
	c.dropIfGone(ns)
}

// Standing is a standing reservation pod a node asks for and lacks.
type Standing struct{ Node, Group string }

// TakeStanding lists the standing reservation pods the nodes ask for and
// lack, as many per node as it has idle GPUs a device plugin could give
// them (one asked for where whole-GPU pods hold every GPU would only fail
// on the kubelet), and books each at once, before its pod exists: until
// the informer shows the pod, a share placed meanwhile would otherwise
// take the idle GPU it is meant for, and the node would hold one GPU more
// than it has. The caller creates the pods, and calls DropStanding for
// one it could not create.
func (c *Cache) TakeStanding() []Standing {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []Standing
	for name, ns := range c.nodes {
		// A node whose Node is gone gets no new pods: they would be bound
		// to nothing, and the pod garbage collector would delete them.
		if ns.Standing == 0 || ns.Ledger == nil || ns.seen == nil {
			continue
		}
		idle := ns.unheld()
		missing := 0
		for i := 0; i < ns.Standing; i++ {
			g := ledgers.StandingGroup(i)
			switch {
			case ns.Reserved(g):
			case idle > 0:
				ns.Event(g, ledgers.EventBook, ledgers.Seen{})
				ns.Reservations[g].Name = ReservationName(name, g)
				out = append(out, Standing{Node: name, Group: g})
				idle--
			default:
				missing++
			}
		}
		// A GPU that an idle reservation pod of an ordinary group keeps
		// (a share placed before the standing pods existed) goes to a
		// standing one the node lacks: retired here, its pod is the
		// collector's to delete, and a later pass takes the GPU.
		if missing -= ns.retiringCount(); missing > 0 {
			c.retireIdle(ns, missing)
		}
	}
	return out
}

// keptIdle lists the node's idle groups of ordinary reservation pods that
// a share may still join, in the order of their names: the GPUs that
// Reclaim and TakeStanding may take back.
func (ns *nodeState) keptIdle() []string {
	var idle []string
	for g, slot := range ns.Groups {
		if !ledgers.IsStanding(g) && ns.Ledger.Devices[slot].Idle() && ns.Joinable(g) {
			idle = append(idle, g)
		}
	}
	slices.Sort(idle)
	return idle
}

// unheld is how many of the node's GPUs nothing holds: no tenant, and no
// reservation pod (what the device plugin could still give a pod).
func (ns *nodeState) unheld() int {
	n := 0
	for _, d := range ns.Ledger.Devices {
		if d.Idle() && !d.SharedOnly {
			n++
		}
	}
	return n
}

// retiringCount is how many of the node's ordinary reservation pods are
// retired and not yet gone: GPUs about to come free.
func (ns *nodeState) retiringCount() int {
	n := 0
	for g, r := range ns.Reservations {
		if r.State == ledgers.GroupRetiring && !ledgers.IsStanding(g) {
			n++
		}
	}
	return n
}

// retireIdle retires up to n of the node's keptIdle groups: from now on
// no share joins them and nothing takes their GPUs, and their pods are
// the collector's to delete. It returns the groups retired.
func (c *Cache) retireIdle(ns *nodeState, n int) []string {
	var retired []string
	for _, g := range ns.keptIdle() {
		if len(retired) == n {
			break
		}
		if ns.Retire(g) {
			ns.Event(g, ledgers.EventRetire, ledgers.Seen{})
			retired = append(retired, g)
		}
	}
	if len(retired) > 0 {
		c.markDirty()
	}
	return retired
}

// DropStanding forgets a standing reservation TakeStanding booked whose
// pod could not be created; the collector tries again.
func (c *Cache) DropStanding(st Standing) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ns, ok := c.nodes[st.Node]
	if !ok {
		return
	}
	if r := ns.Reservations[st.Group]; r != nil && r.State == ledgers.GroupBooked {
		if fx := ns.Event(st.Group, ledgers.EventCreateFailed, ledgers.Seen{}); fx.Rebuild {
			c.rebuild(ns)
		}
	}
}

// HeldUpdate is a standing reservation pod whose SharesHeldAnnotation is
// not what the ledger holds.
type HeldUpdate struct {
	Namespace, Name string
	UID             types.UID
	Held            api.SharesHeld
}

// HeldUpdates lists the standing reservation pods whose annotation of
// what annotation shares hold of their GPU (api.SharesHeldAnnotation) is
// out of date: the node's DRA driver offers claims only the rest.
func (c *Cache) HeldUpdates() []HeldUpdate {
	c.mu.RLock()
	defer c.mu.RUnlock()
	var out []HeldUpdate
	for _, ns := range c.nodes {
		if ns.Ledger == nil {
			continue
		}
		for g, r := range ns.Reservations {
			slot, ok := ns.Groups[g]
			if !ledgers.IsStanding(g) || !ok || r.UID == "" || r.UUID == "" {
				continue // not a standing pod the API shows with its GPU yet
			}
			d := ns.Ledger.Devices[slot]
			var held api.SharesHeld
			for key, sh := range d.Shares() {
				if t := ns.Tenants[key]; t != nil && t.Claim {
					continue // the allocator counts claims itself
				}
				held.MemoryMiB += sh.Request
				held.Portion += sh.Portion
				held.Mode = sh.Mode
			}
			if len(ns.Conflicts) > 0 || len(ns.waiting) > 0 {
				// Pods the ledger could not place hold memory it does not
				// see: offer claims nothing here until they are placed.
				held.MemoryMiB = d.Schedulable()
			}
			if held.String() != r.Held {
				out = append(out, HeldUpdate{Namespace: c.args.ReservationNamespace, Name: r.Name, UID: r.UID, Held: held})
			}
		}
	}
	return out
}

// writeHeld patches a standing reservation pod's SharesHeldAnnotation,
// only the pod of that UID.
func writeHeld(ctx context.Context, client kubernetes.Interface, u HeldUpdate) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":         u.UID,
		"annotations": u.Held.Write().MergePatch(),
	}})
	if err != nil {
		return err
	}
	_, err = client.CoreV1().Pods(u.Namespace).Patch(ctx, u.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}
