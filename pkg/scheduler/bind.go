package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
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
	uuids := make([]string, len(d.Groups))
	var waitingFor string
	err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, p.args.BindTimeout.Duration, true, func(context.Context) (bool, error) {
		for i, g := range d.Groups {
			_, uuid, failed := p.cache.ReservationState(d.Node, g)
			if failed != "" {
				return false, fmt.Errorf("GPU group %s on node %s: %s", g, d.Node, failed)
			}
			if uuid == "" {
				waitingFor = ReservationName(d.Node, g)
				return false, nil
			}
			uuids[i] = uuid
		}
		return true, nil
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

// annotate writes the decision onto the pod (SPEC §2): devices, resolved
// memory in Mi, compute mode and, for sm-sharing, the compute portion;
// and the GPU groups, from which a restarted scheduler rebuilds its state.
func (p *Plugin) annotate(ctx context.Context, pod *corev1.Pod, d Decision, uuids []string) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": DecisionAnnotations(d, uuids),
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

// DecisionAnnotations are the annotations PreBind writes, as a merge
// patch: a nil value removes a key (a stale compute portion).
func DecisionAnnotations(d Decision, uuids []string) map[string]any {
	key := func(suffix string) string { return api.ContainerKey(d.Container, suffix) }
	out := map[string]any{
		key(api.SuffixDevices):        strings.Join(uuids, ","),
		key(api.SuffixMemoryRequest):  strconv.FormatInt(d.Resolved.RequestMiB, 10) + "Mi",
		key(api.SuffixMemoryLimit):    strconv.FormatInt(d.Resolved.LimitMiB, 10) + "Mi",
		key(api.SuffixComputeMode):    string(d.Mode),
		key(api.SuffixComputePortion): nil,
		api.GPUGroupsAnnotation:       strings.Join(d.Groups, ","),
	}
	if d.Mode == api.SMSharing {
		out[key(api.SuffixComputePortion)] = Portion(d.Portion)
	}
	return out
}

func decisionLabels(d Decision) map[string]any {
	if len(d.Groups) == 1 {
		return map[string]any{api.GPUGroupLabel: d.Groups[0]}
	}
	return map[string]any{api.GPUGroupLabel: nil}
}

// Portion writes thousandths as a decimal in (0,1]: 250 → "0.25".
func Portion(thousandths int64) string {
	thousandths = min(max(thousandths, 1), gpu.FullPortion)
	if thousandths == gpu.FullPortion {
		return "1"
	}
	return strings.TrimRight(fmt.Sprintf("0.%03d", thousandths), "0")
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
