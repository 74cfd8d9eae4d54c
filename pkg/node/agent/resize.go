package agent

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	corev1listers "k8s.io/client-go/listers/core/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// podWatch is the agent's view of its node's pods (a watch with
// spec.nodeName=<node>): for resizes (runResizes) and for the memory a
// resized pod's container is created with (nriplugin.Options.Resized).
type podWatch struct {
	factory informers.SharedInformerFactory
	lister  corev1listers.PodLister
	synced  toolscache.InformerSynced
	// kick wakes runResizes when a pod changes.
	kick chan struct{}
}

// watchPods starts the watch of the node's pods. It does not wait for the
// first list: until then the agent gives the NRI plugin no backend
// (Agent.enforce), so no fractional container is created or audited
// before the memory a resize gave its pod is known.
func (a *Agent) watchPods(ctx context.Context) *podWatch {
	w := &podWatch{kick: make(chan struct{}, 1)}
	w.factory = informers.NewSharedInformerFactoryWithOptions(a.client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = "spec.nodeName=" + a.opts.NodeName
	}))
	pods := w.factory.Core().V1().Pods()
	if err := pods.Informer().SetTransform(slimPod); err != nil {
		klog.FromContext(ctx).Error(err, "Cannot slim the node's cached pods; whole pods are kept")
	}
	wake := func(obj any) {
		if pod, ok := obj.(*corev1.Pod); ok && resizing(pod) {
			select {
			case w.kick <- struct{}{}:
			default:
			}
		}
	}
	if _, err := pods.Informer().AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: wake, UpdateFunc: func(_, obj any) { wake(obj) },
	}); err != nil {
		klog.FromContext(ctx).Error(err, "Cannot follow the node's pods; GPU resizes are not applied")
	}
	w.lister, w.synced = pods.Lister(), pods.Informer().HasSynced
	w.factory.Start(ctx.Done())
	return w
}

// slimPod keeps of a pod only what the agent reads of it (its resize, its
// decision, the grace its security stops may give it) before the informer
// caches it. A tenant's pods may be fat (256KiB of annotations, thousands
// of environment variables); whole, a node's worth of them would push the
// agent past its memory limit, and an agent killed for memory is the
// outage in which containers start unenforced.
func slimPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone: its object was slimmed when cached
	}
	slim := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID,
			ResourceVersion: pod.ResourceVersion, DeletionTimestamp: pod.DeletionTimestamp},
		Spec: corev1.PodSpec{NodeName: pod.Spec.NodeName, TerminationGracePeriodSeconds: pod.Spec.TerminationGracePeriodSeconds,
			HostUsers: pod.Spec.HostUsers, Priority: pod.Spec.Priority},
		Status: corev1.PodStatus{Phase: pod.Status.Phase},
	}
	// Of each container, its name and whether it may gain privileges.
	slimContainer := func(c corev1.Container) corev1.Container {
		out := corev1.Container{Name: c.Name}
		if sc := c.SecurityContext; sc != nil {
			out.SecurityContext = &corev1.SecurityContext{AllowPrivilegeEscalation: sc.AllowPrivilegeEscalation, Privileged: sc.Privileged}
		}
		return out
	}
	for _, c := range pod.Spec.InitContainers {
		slim.Spec.InitContainers = append(slim.Spec.InitContainers, slimContainer(c))
	}
	for _, c := range pod.Spec.Containers {
		slim.Spec.Containers = append(slim.Spec.Containers, slimContainer(c))
	}
	for _, e := range pod.Spec.EphemeralContainers {
		c := slimContainer(corev1.Container(e.EphemeralContainerCommon))
		slim.Spec.EphemeralContainers = append(slim.Spec.EphemeralContainers, corev1.EphemeralContainer{EphemeralContainerCommon: corev1.EphemeralContainerCommon(c), TargetContainerName: e.TargetContainerName})
	}
	for k, v := range pod.Annotations {
		if api.IsFractionKey(k) || api.IsDecisionKey(k) || api.IsResizeKey(k) || api.IsResizeRecordKey(k) || k == api.SimulatedLoadAnnotation {
			if slim.Annotations == nil {
				slim.Annotations = map[string]string{}
			}
			slim.Annotations[k] = v
		}
	}
	for _, c := range pod.Status.Conditions {
		if api.IsResizeCondition(c.Type) {
			slim.Status.Conditions = append(slim.Status.Conditions, c)
		}
	}
	return slim, nil
}

// grace is the grace period (seconds) the pod gives its containers, as the
// watch knows it; ok is false when it does not know the pod.
func (w *podWatch) grace(namespace, name, uid string) (int64, bool) {
	if w == nil || !w.synced() {
		return 0, false
	}
	pod, err := w.lister.Pods(namespace).Get(name)
	if err != nil || string(pod.UID) != uid || pod.Spec.TerminationGracePeriodSeconds == nil {
		return 0, false
	}
	return *pod.Spec.TerminationGracePeriodSeconds, true
}

// pod is the watched pod of that name and UID.
func (w *podWatch) pod(namespace, name, uid string) (*corev1.Pod, bool) {
	if w == nil || !w.synced() {
		return nil, false
	}
	pod, err := w.lister.Pods(namespace).Get(name)
	if err != nil || string(pod.UID) != uid {
		return nil, false
	}
	return pod, true
}

// mayEscalate is nriplugin.Options.MayEscalate: whether the container of
// the pod may gain privileges, as its spec says: true where it asks to
// (allowPrivilegeEscalation true, or privileged), false where it may not
// (allowPrivilegeEscalation false: Kubernetes sets no_new_privs); nil
// where the spec leaves it unset, or the watch does not know the pod or
// the container. Unset is not refused here: gpufrac's webhook sets it
// false on every share it admits, and a share admitted by another's
// (KAI's admission before gpufrac's node side) or before an upgrade would
// otherwise be refused at its every start.
func (w *podWatch) mayEscalate(namespace, name, uid, container string) *bool {
	if w == nil || !w.synced() {
		return nil
	}
	pod, err := w.lister.Pods(namespace).Get(name)
	if err != nil || string(pod.UID) != uid {
		return nil
	}
	judge := func(sc *corev1.SecurityContext) *bool {
		switch {
		case sc == nil:
			return nil
		case sc.Privileged != nil && *sc.Privileged, sc.AllowPrivilegeEscalation != nil && *sc.AllowPrivilegeEscalation:
			return ptr.To(true)
		case sc.AllowPrivilegeEscalation != nil:
			return ptr.To(false)
		}
		return nil
	}
	for _, c := range append(slices.Clone(pod.Spec.InitContainers), pod.Spec.Containers...) {
		if c.Name == container {
			return judge(c.SecurityContext)
		}
	}
	for _, e := range pod.Spec.EphemeralContainers {
		if e.Name == container {
			return judge(e.SecurityContext)
		}
	}
	return nil
}

// resized is nriplugin.Options.Resized: a resized pod's allocation now.
func (w *podWatch) resized(namespace, name, uid string) (string, api.Memory, bool) {
	if !w.synced() {
		return "", api.Memory{}, false
	}
	pod, err := w.lister.Pods(namespace).Get(name)
	if err != nil || string(pod.UID) != uid || !api.Resized(pod.Annotations) {
		return "", api.Memory{}, false
	}
	as, err := api.ParseAssignments(pod.Annotations)
	if err != nil || len(as) == 0 {
		return "", api.Memory{}, false
	}
	return as[0].Container, api.Memory{RequestMiB: as[0].RequestMiB, LimitMiB: as[0].LimitMiB}, true
}

// runResizes holds each running fractional container of a resized pod to
// what its scheduler last allocated (SPEC §7, api.Resize): when a resize
// is granted, the agent changes the running container's limits
// (nriplugin.Plugin.Resize) and records what it now enforces; when it
// cannot (the container already uses more than the new hard limit), it
// says so on the pod, changes nothing, and tries again at the next resync.
// A container of a resized pod created since (a restart) is created with
// the pod's memory now, and checked here all the same. Nothing here
// restarts a container.
func (a *Agent) runResizes(ctx context.Context, w *podWatch) {
	defer w.factory.Shutdown()
	if !toolscache.WaitForCacheSync(ctx.Done(), w.synced) {
		return
	}
	tick := time.NewTicker(a.opts.ResyncPeriod)
	defer tick.Stop()
	for {
		list, err := w.lister.List(labels.Everything())
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot list the node's pods")
		}
		for _, pod := range list {
			if resizing(pod) {
				a.applyResize(ctx, pod)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-w.kick:
		case <-tick.C:
		}
	}
}

// resizing says whether a pod has been resized, or its allocation
// differs from what its node says it enforces (api.Resize.Applying).
func resizing(pod *corev1.Pod) bool {
	if pod.DeletionTimestamp != nil || api.PodEnded(pod) {
		return false
	}
	as, err := api.ParseAssignments(pod.Annotations)
	if err != nil || len(as) == 0 {
		return false
	}
	r, _ := api.ResizeOf(pod.Annotations, as[0])
	return r.Applying() || api.Resized(pod.Annotations)
}

// applyResize holds a pod's running container to its allocation, and
// writes what came of it: the memory enforced and the InProgress
// condition Done, or the condition Error and an event.
func (a *Agent) applyResize(ctx context.Context, pod *corev1.Pod) {
	as, err := api.ParseAssignments(pod.Annotations)
	if err != nil || len(as) == 0 {
		return
	}
	r, _ := api.ResizeOf(pod.Annotations, as[0])
	to := r.Allocated
	held, how, err := a.env.holdResize(a.plugin, string(pod.UID), r.Container, to)
	logger := klog.FromContext(ctx).WithValues("pod", klog.KObj(pod), "container", r.Container)
	if err != nil {
		if c, ok := api.PodResizeCondition(pod, api.ConditionResizeInProgress); ok && c.Status == corev1.ConditionTrue && c.Reason == api.ReasonResizeError {
			return // said already; retried at each resync
		}
		cond := api.ResizeCondition(api.ConditionResizeInProgress, corev1.ConditionTrue, api.ReasonResizeError,
			fmt.Sprintf("node %s did not change the running container's limits to request %dMi, limit %dMi, and tries again at each resync: %v", a.opts.NodeName, to.RequestMiB, to.LimitMiB, err))
		if werr := a.writeResize(ctx, pod, api.Write{}, cond); werr != nil {
			logger.Error(werr, "Cannot report a refused GPU resize")
			return
		}
		a.recorder.Event(pod, corev1.EventTypeWarning, "GPUResizeRefused", cond.Message)
		logger.Info("Refused a GPU resize", "reason", err.Error())
		return
	}
	if !held {
		return // not running here yet
	}
	if c, ok := api.PodResizeCondition(pod, api.ConditionResizeInProgress); ok && r.Confirmed && !r.Applying() &&
		c.Status == corev1.ConditionFalse && c.Reason == api.ReasonResizeDone {
		return // recorded already
	}
	done := api.ResizeCondition(api.ConditionResizeInProgress, corev1.ConditionFalse, api.ReasonResizeDone,
		fmt.Sprintf("request %dMi, limit %dMi on each of its GPUs: %s", to.RequestMiB, to.LimitMiB, how))
	if err := a.writeResize(ctx, pod, api.EnforcedWrite(to), done); err != nil {
		logger.Error(err, "Cannot record an applied GPU resize; retrying")
		return
	}
	logger.Info("Applied a GPU resize", "requestMiB", to.RequestMiB, "limitMiB", to.LimitMiB)
}

// writeResize writes on the pod's status as the scheduler does
// (api.ResizeStatusPatch), conditioned on the version of the pod the
// agent acted on: a newer allocation makes it a conflict, and the next
// pass acts on that.
func (a *Agent) writeResize(ctx context.Context, pod *corev1.Pod, w api.Write, conditions ...corev1.PodCondition) error {
	patch, err := api.ResizeStatusPatch(pod, pod.ResourceVersion, w, metav1.Now(), conditions...)
	if err != nil {
		return err
	}
	_, err = a.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		return nil
	}
	return err
}
