package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
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

// annotate writes the decision onto the pod (SPEC §2): devices, resolved
// memory in Mi, compute mode and, for sm-sharing, the compute portion;
// and the GPU groups, from which a restarted scheduler rebuilds its state.
func (p *Plugin) annotate(ctx context.Context, pod *corev1.Pod, d Decision, uuids []string) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": decisionPatch(d, uuids, p.args.CDIKind(), pod.Annotations),
		"labels":      decisionLabels(d),
	}})
	if err != nil {
		return err
	}
	if _, err := p.handle.ClientSet().CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("write GPU decision on pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

// decisionBinding is what Bind writes with a fractional pod's Binding:
// the decision's annotations and its GPU-group label; or, with reserve,
// that Bind must first make the decision's reservation pods and wait for
// their GPUs (PreBind, which would have, was skipped).
type decisionBinding struct {
	annotations, labels map[string]string
	reserve             bool
}

// Clone implements fwk.StateData; it is never changed once written.
func (b *decisionBinding) Clone() fwk.StateData { return b }

const bindKey fwk.StateKey = Name + "/binding"

// bindingOf is the decision as a Binding's annotations and labels, or
// false when it must remove a key the pod has (a Binding's annotations
// can only add and overwrite): then PreBind patches the pod instead. The
// label is copied by API servers with PodTopologyLabelsAdmission (beta,
// on by default since Kubernetes 1.35); it is for people selecting the
// pods of a GPU, and nothing of gpufrac's reads it from a tenant.
func bindingOf(d Decision, uuids []string, cdiKind string, pod *corev1.Pod) (*decisionBinding, bool) {
	b := &decisionBinding{annotations: map[string]string{}}
	for k, v := range decisionPatch(d, uuids, cdiKind, pod.Annotations) {
		s, isString := v.(string)
		if !isString {
			if _, present := pod.Annotations[k]; present {
				return nil, false
			}
			continue
		}
		b.annotations[k] = s
	}
	for k, v := range decisionLabels(d) {
		if s, isString := v.(string); isString {
			b.labels = map[string]string{k: s}
		} else if _, present := pod.Labels[k]; present {
			return nil, false
		}
	}
	return b, true
}

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

// decisionPatch is what PreBind merges into the pod's annotations: the
// decision as api.Assignment writes it, the GPU groups, and which memory
// keys the decision added to the current ones (api.Intent's to remove). A nil value
// removes a key: a stale compute portion when the mode is time-slicing.
func decisionPatch(d Decision, uuids []string, cdiKind string, current map[string]string) map[string]any {
	out := map[string]any{
		api.ContainerKey(d.Container, api.SuffixComputePortion): nil,
		api.GPUGroupsAnnotation:                                 strings.Join(d.Groups, ","),
		api.ResolvedKeysAnnotation:                              api.ResolvedMemoryKeys(current, d.Container, current[api.ResolvedKeysAnnotation]),
	}
	for k, v := range d.assignment(uuids, cdiKind).Annotations() {
		out[k] = v
	}
	return out
}

func decisionLabels(d Decision) map[string]any {
	if len(d.Groups) == 1 {
		return map[string]any{api.GPUGroupLabel: d.Groups[0]}
	}
	return map[string]any{api.GPUGroupLabel: nil}
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
