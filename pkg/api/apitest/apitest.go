// Package apitest builds the objects tests need (GPU nodes, placed tenant
// pods, reservation pods) the way the components write them: through
// pkg/api's codec (NodeReport, Decision, ReservationLabels,
// ReservedGPUWrite), never by spelling a key. A test that builds its
// objects here reads what production writes, and follows the codec when
// it changes.
package apitest

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// GPUNode is a node as the device plugin and gpufrac's node agent report
// it: inv.Count GPUs allocatable, inv's labels and the enforcement backend
// (NodeReport.Labels), and, when ready, the Fractioning condition True
// (none otherwise: an agent that has not reported).
func GPUNode(name string, inv api.Inventory, enforcement string, ready bool) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	for k, v := range (api.NodeReport{Inventory: inv, Enforcement: enforcement, ReserveMiB: inv.ReserveMiB}).Labels() {
		if v != nil {
			n.Labels[k] = *v
		}
	}
	n.Status.Allocatable = corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(int64(inv.Count), resource.DecimalSI)}
	if ready {
		n.Status.Conditions = []corev1.NodeCondition{{Type: api.ConditionFractioningReady, Status: corev1.ConditionTrue, Reason: "EnforcementAvailable"}}
	}
	return n
}

// Placed is a pod bound to node with a scheduler's decision for its one
// container a.Container: gpufrac's (Decision.Write, with its GPU groups)
// when groups are given, another scheduler's (the decision's per-container
// keys alone, as KAI's binder writes them) when none are.
func Placed(namespace, name, node string, a api.Assignment, groups ...string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, UID: types.UID("uid-" + name)}}
	p.Spec.NodeName = node
	p.Spec.Containers = []corev1.Container{{Name: a.Container}}
	if len(groups) == 0 {
		p.Annotations = a.Annotations()
		return p
	}
	annotations, labels := api.Decision{Assignment: a, Groups: groups}.Write(nil)
	p.Annotations, p.Labels = annotations.Apply(nil), labels.Apply(nil)
	return p
}

// Reservation is a reservation pod of group on node, in namespace, as the
// scheduler labels it (ReservationLabels) and, once uuid is not "", as the
// node agent annotates it (ReservedGPUWrite), holding one whole GPU.
func Reservation(namespace, node, group, uuid string, standing bool) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "gpufrac-" + node + "-" + group, Namespace: namespace,
		UID: types.UID("uid-gpufrac-" + node + "-" + group), Labels: api.ReservationLabels(group, standing)}}
	if uuid != "" {
		p.Annotations = api.ReservedGPUWrite(uuid).Apply(nil)
	}
	p.Spec.NodeName = node
	p.Spec.Containers = []corev1.Container{{Name: "reserve", Resources: corev1.ResourceRequirements{
		Limits: corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}}}}
	return p
}
