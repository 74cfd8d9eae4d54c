package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// reserveGPUs creates the reservation pod of each of the decision's GPU
// groups that has none, and waits (at most the bind timeout) until the
// node agent has written each one's GPU UUID.
func (p *Plugin) reserveGPUs(ctx context.Context, d Decision) ([]string, error) {
	client := p.handle.ClientSet()
	for _, g := range d.Groups {
		if known, _, _ := p.cache.ReservationState(d.Node, g); known {
			continue
		}
		pod := ReservationPod(p.args, d.Node, g)
		if _, err := client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return nil, fmt.Errorf("create reservation pod %s/%s for GPU group %s on node %s: %w", pod.Namespace, pod.Name, g, d.Node, err)
		}
	}
	var uuids []string
	var waitingFor string
	err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, p.args.BindTimeout.Duration, true, func(context.Context) (bool, error) {
		var err error
		uuids, waitingFor, err = p.reservedUUIDs(d)
		return waitingFor == "", err
	})
	if err != nil {
		if ctx.Err() == nil && wait.Interrupted(err) {
			return nil, fmt.Errorf("reservation pod %s/%s has no GPU UUID (annotation %s) after %s: is the gpufrac node agent running on node %s?",
				p.args.ReservationNamespace, waitingFor, api.ReservedGPUAnnotation, p.args.BindTimeout.Duration, d.Node)
		}
		return nil, err
	}
	return uuids, nil
}

// reservedUUIDs is the GPU of each of the decision's groups as its
// reservation pod names it, or the name of the first reservation pod not
// (yet) known with its GPU. A GPU the node side would refuse is an error:
// it is never written as a decision.
func (p *Plugin) reservedUUIDs(d Decision) (uuids []string, waitingFor string, err error) {
	uuids = make([]string, len(d.Groups))
	for i, g := range d.Groups {
		_, uuid, failed := p.cache.ReservationState(d.Node, g)
		if failed != "" {
			return nil, "", fmt.Errorf("GPU group %s on node %s: %s", g, d.Node, failed)
		}
		if uuid == "" {
			return nil, ReservationName(d.Node, g), nil
		}
		if _, kind, bad := api.ParseDeviceList(uuid); bad != "" || kind != "" {
			if bad == "" {
				bad = "a CDI name, where the node agent writes the bare UUID"
			}
			return nil, "", fmt.Errorf("reservation pod %s/%s reports GPU %q (annotation %s), which is not a GPU UUID: %s",
				p.args.ReservationNamespace, ReservationName(d.Node, g), uuid, api.ReservedGPUAnnotation, bad)
		}
		uuids[i] = uuid
	}
	return uuids, "", nil
}

// annotate writes the decision onto the pod with a patch (SPEC §2):
// devices, resolved memory in Mi, compute mode and, for sm-sharing, the
// compute portion; and the GPU groups, from which a restarted scheduler
// rebuilds its state.
func (p *Plugin) annotate(ctx context.Context, pod *corev1.Pod, d Decision, uuids []string) error {
	annotations, labels := d.write(uuids, p.args.CDIKind(), pod.Annotations)
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": annotations.MergePatch(),
		"labels":      labels.MergePatch(),
	}})
	if err != nil {
		return err
	}
	if _, err := p.handle.ClientSet().CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("write GPU decision on pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

// bind binds the pod with a Binding that carries its decision, which the
// API server copies onto the pod as it binds it: one write where a patch
// and a binding were two. The label is copied by API servers with
// PodTopologyLabelsAdmission (beta, on by default since Kubernetes 1.35);
// it is for people selecting the pods of a GPU, and nothing of gpufrac's
// reads it from a tenant.
func (p *Plugin) bind(ctx context.Context, pod *corev1.Pod, node string, d Decision, uuids []string) error {
	annotations, labels := d.write(uuids, p.args.CDIKind(), pod.Annotations)
	a, okA := annotations.Additive(pod.Annotations)
	l, okL := labels.Additive(pod.Labels)
	if !okA || !okL {
		// planBind chose this route only for a decision that removes
		// nothing the pod carries.
		return fmt.Errorf("pod %s/%s: its GPU decision must remove a key, which a Binding cannot", pod.Namespace, pod.Name)
	}
	binding := &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID, Annotations: a, Labels: l},
		Target:     corev1.ObjectReference{Kind: "Node", Name: node},
	}
	if err := p.handle.ClientSet().CoreV1().Pods(pod.Namespace).Bind(ctx, binding, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("bind pod %s/%s to node %s with its GPU decision: %w", pod.Namespace, pod.Name, node, err)
	}
	return nil
}

// bindRoute is how a fractional pod's decision reaches the API server.
type bindRoute int

const (
	// routeBinding: every GPU is named already (its group's reservation
	// pod says which); Bind's Binding carries the decision, PreBind is
	// skipped.
	routeBinding bindRoute = iota
	// routeReserveThenBinding: a GPU still lacks its reservation pod or
	// its name; Bind makes the pods, waits for the names, then binds with
	// the decision. PreBind is skipped.
	routeReserveThenBinding
	// routePreBindThenBinding: as routeReserveThenBinding, with the
	// waiting done in PreBind, so that kube-scheduler first tells
	// autoscalers (nominatedNodeName) about a pod already marked
	// unschedulable; or when the reservation pod reported a failure,
	// which PreBind reports.
	routePreBindThenBinding
	// routePreBindPatch: PreBind waits and patches the decision onto the
	// pod, and DefaultBinder binds it: when the decision must remove a
	// key (a Binding only adds), or when another bind plugin runs first.
	routePreBindPatch
)

// naming is where a decision's GPUs stand when the bind is planned.
type naming int

const (
	gpusNamed   naming = iota // every group's reservation pod names its GPU
	gpusWaiting               // some reservation pod is missing or unnamed
	gpusFailed                // a reservation pod failed or named a bad GPU
)

// planBind chooses the route: bindsFirst says this plugin's Bind runs
// before DefaultBinder; additive that the decision removes nothing the
// pod carries; marked that the pod is already marked unschedulable.
func planBind(bindsFirst, additive, marked bool, gpus naming) bindRoute {
	switch {
	case !bindsFirst || !additive:
		return routePreBindPatch
	case gpus == gpusNamed:
		return routeBinding
	case gpus == gpusWaiting && !marked:
		return routeReserveThenBinding
	}
	return routePreBindThenBinding
}

// bindPlan is the route chosen in PreBindPreFlight, with the decision and
// (once known) its GPUs, for PreBind and Bind to carry out.
type bindPlan struct {
	route    bindRoute
	decision Decision
	uuids    []string
}

// Clone implements fwk.StateData: the plan is the cycle's own; PreBind
// fills in the UUIDs it waited for, before Bind reads them.
func (b *bindPlan) Clone() fwk.StateData { return b }

const bindKey fwk.StateKey = Name + "/bind"

// preBinds says whether the route runs through PreBind.
func (r bindRoute) preBinds() bool { return r == routePreBindThenBinding || r == routePreBindPatch }

// assignment is the decision as the node side reads it, the devices named
// with cdiKind ("" for bare UUIDs).
func (d Decision) assignment(uuids []string, cdiKind string) api.Assignment {
	a := api.Assignment{Container: d.Container, Devices: uuids, CDIKind: cdiKind, RequestMiB: d.Resolved.RequestMiB, LimitMiB: d.Resolved.LimitMiB, Mode: d.Mode}
	if d.Mode == api.SMSharing {
		// Never 0: an sm-sharing portion is in (0, 1].
		a.Portion = api.Thousandths(max(d.Portion, 1))
	}
	return a
}

// write is the decision as the pod's annotations and labels change with
// it (api.Decision, the contract's one writer), given the annotations the
// pod has now.
func (d Decision) write(uuids []string, cdiKind string, current map[string]string) (annotations, labels api.Write) {
	return api.Decision{Assignment: d.assignment(uuids, cdiKind), Groups: d.Groups}.Write(current)
}

// deleteReservation deletes a reservation pod at once: it runs nothing
// but a sleep, and on a node without a kubelet (a simulated one) a
// graceful deletion would never finish.
func deleteReservation(ctx context.Context, client kubernetes.Interface, o Orphan) error {
	// The UID precondition: never a pod of the same name made since.
	opts := metav1.DeleteOptions{GracePeriodSeconds: new(int64)}
	if o.UID != "" {
		opts.Preconditions = &metav1.Preconditions{UID: &o.UID}
	}
	err := client.CoreV1().Pods(o.Namespace).Delete(ctx, o.Name, opts)
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return err
	}
	return nil
}
