package scheduler

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
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
	meta, ok := api.ReservationOf(pod)
	if !ok || pod.Spec.NodeName == "" {
		return
	}
	group := meta.Group
	c.mu.Lock()
	defer c.mu.Unlock()
	ns := c.node(pod.Spec.NodeName)
	r := &reservation{name: pod.Name, uid: pod.UID, uuid: meta.GPU, held: meta.Held}
	if pod.Status.Phase == corev1.PodFailed {
		r.failure = fmt.Sprintf("reservation pod %s/%s failed: %s %s", pod.Namespace, pod.Name, pod.Status.Reason, pod.Status.Message)
	}
	if old, known := ns.reservations[group]; known {
		r.state = old.state
	}
	var fx ledgers.Effects
	r.state, fx = ledgers.Transition(r.state, ledgers.EventSeen,
		ledgers.Seen{Named: r.uuid != "", Failed: r.failure != "", Deleting: pod.DeletionTimestamp != nil}, ledgers.IsStanding(group))
	ns.reservations[group] = r
	if fx.Hold {
		ns.Hold(group)
	}
	if fx.Wake {
		c.markDirty()
	}
	if fx.Settle {
		ns.settle(group)
	}
}

func (c *Cache) deleteReservation(pod *corev1.Pod) {
	meta, _ := api.ReservationOf(pod)
	group := meta.Group
	c.mu.Lock()
	defer c.mu.Unlock()
	ns, ok := c.nodes[pod.Spec.NodeName]
	if !ok || ns.reservations[group] == nil || ns.reservations[group].name != pod.Name {
		return
	}
	fx := ns.reservations[group].event(ledgers.EventDeleted, group)
	delete(ns.reservations, group)
	delete(ns.Conflicts, placeholder(group))
	if fx.Wake {
		c.markDirty() // a standing pod the node lacks may take the GPU now
	}
	if ns.Ledger == nil {
		return
	}
	if fx.Free {
		// Held for shares with no tenant, or retired for a whole-GPU
		// pod: the GPU is free again.
		ns.Free(group)
	}
	if fx.Rebuild || len(ns.Conflicts) > 0 {
		c.rebuild(pod.Spec.NodeName, ns)
	}
}

// wantsStanding says whether g is a standing group the node asks for
// (its index below the node's api.LabelStandingGPUs).
func (ns *nodeState) wantsStanding(g string) bool {
	for i := range ns.standing {
		if g == ledgers.StandingGroup(i) {
			return true
		}
	}
	return false
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
		if ns.standing == 0 || ns.Ledger == nil {
			continue
		}
		idle := ns.unheld()
		missing := 0
		for i := 0; i < ns.standing; i++ {
			g := ledgers.StandingGroup(i)
			switch {
			case ns.reserved(g):
			case idle > 0:
				r := &reservation{name: ReservationName(name, g)}
				ns.reservations[g] = r
				if r.event(ledgers.EventBook, g).Hold {
					ns.Hold(g)
				}
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
		if !ledgers.IsStanding(g) && ns.Ledger.Devices[slot].Idle() && ns.joinable(g) {
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
	for g, r := range ns.reservations {
		if r.state == ledgers.GroupRetiring && !ledgers.IsStanding(g) {
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
			ns.reservations[g].event(ledgers.EventRetire, g)
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
	if r := ns.reservations[st.Group]; r != nil && r.state == ledgers.GroupBooked {
		if fx := r.event(ledgers.EventCreateFailed, st.Group); r.state == ledgers.GroupNone {
			delete(ns.reservations, st.Group)
			if fx.Rebuild {
				c.rebuild(st.Node, ns)
			}
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
		for g, r := range ns.reservations {
			slot, ok := ns.Groups[g]
			if !ledgers.IsStanding(g) || !ok || r.uid == "" || r.uuid == "" {
				continue // not a standing pod the API shows with its GPU yet
			}
			d := ns.Ledger.Devices[slot]
			var held api.SharesHeld
			for key, sh := range d.Shares() {
				if t := c.pods[types.UID(key)]; t != nil && t.claim {
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
			if held.String() != r.held {
				out = append(out, HeldUpdate{Namespace: c.args.ReservationNamespace, Name: r.name, UID: r.uid, Held: held})
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
