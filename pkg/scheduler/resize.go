package scheduler

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// A resize (SPEC §7, api.Resize) is decided here: on the pod's own GPUs,
// never elsewhere. A shrink always fits; a grow fits when each of its GPUs
// has the difference free. A grow that does not fit now waits (Deferred)
// and is tried again whenever memory is freed on the cache (markDirty); one
// that never can (larger than the GPU, a node whose backend cannot change
// a running container's limit) is Infeasible. A granted resize is booked
// at once, before its write, as Reserve books a new pod.

// resizeVerdict is the scheduler's answer to a pod's resize.
type resizeVerdict struct {
	// grant is set when the resize fits and is booked.
	grant bool
	// withdrawn is set when the pod asks for nothing more and its Pending
	// condition still says it waits: the condition is to be cleared.
	withdrawn bool
	// reason is api.ReasonResizeDeferred or api.ReasonResizeInfeasible
	// when not granted; message says why, for the condition and event,
	// and starts with target, which names the resize asked.
	reason, message, target string
	assignment              api.Assignment
	resize                  api.Resize
}

// seeResize keeps a bound tenant's booking equal to what its pod says it
// holds (a resize granted, or the node confirming one, changes it), and
// tracks the pods whose resize waits for the scheduler, or whose Pending
// condition must be cleared. A grant booked ahead of its write
// (resizing) holds until the pod shows the memory granted. Called with the
// lock held.
func (c *Cache) seeResize(ns *nodeState, pod *corev1.Pod) {
	uid := pod.UID
	t := ns.Tenants[string(uid)]
	if t == nil || t.Assignment == nil || t.Claim || len(t.UUIDs) == 0 {
		delete(c.resizes, uid)
		return
	}
	read, held, err := ns.ReadTenant(pod)
	if err != nil || !held {
		return
	}
	granted, booked := c.resizing[uid]
	if booked && read.Assignment.RequestMiB == granted.RequestMiB && read.Assignment.LimitMiB == granted.LimitMiB {
		delete(c.resizing, uid) // the grant's write has landed
		booked = false
	}
	if !booked && read.Request.Share != t.Request.Share {
		freed := read.Request.Share.Request < t.Request.Share.Request
		ns.Resize(read)
		if freed {
			c.markDirty() // a deferred grow may fit now
		}
	}
	r, rerr := api.ResizeOf(pod.Annotations, *read.Assignment)
	pending, _ := api.PodResizeCondition(pod, api.ConditionResizePending)
	if rerr == nil && (r.Wanted() || pending.Status == corev1.ConditionTrue) {
		// Any change of a waiting pod may be what it waits for (its node
		// applied the previous resize, its resize was changed).
		c.markDirty()
		c.resizes[uid] = pod
		return
	}
	delete(c.resizes, uid)
}

// Resizes are the pods whose resize the scheduler has yet to decide or to
// grant, as last seen.
func (c *Cache) Resizes() []*corev1.Pod {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return slices.Collect(maps.Values(c.resizes))
}

// quota bounds a resize where the pod's namespace has a ResourceQuota on
// GPU memory: its quota counted the pod's charge (api.ChargedMiB) when it
// was created, and a running pod's resources cannot be charged again, so
// its limit may grow only within the charge (mib, what of it is left for
// the annotation share; 0 for a pod created before gpufrac charged quota).
type quota struct {
	bounded bool
	mib     int64
}

// decideResize decides a pod's resize on its GPUs and, when it fits,
// books it (undone by undoResize if its write fails). ok is false for a
// pod the cache holds no share of, or whose resize no longer waits.
func (c *Cache) decideResize(pod *corev1.Pod, q quota) (v resizeVerdict, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ns, t, held := c.tenant(pod.UID)
	if !held || t.Assignment == nil || t.Claim || ns.Ledger == nil {
		return v, false
	}
	if _, booked := c.resizing[pod.UID]; booked {
		return v, false // granted, its write not seen yet
	}
	assignments, err := api.ParseAssignments(pod.Annotations)
	if err != nil || len(assignments) == 0 {
		return v, false
	}
	v.assignment = assignments[0]
	r, err := api.ResizeOf(pod.Annotations, v.assignment)
	v.resize = r
	v.target = fmt.Sprintf("%s to request %dMi, limit %dMi", r.Container, r.Desired.RequestMiB, r.Desired.LimitMiB)
	infeasible := func(format string, args ...any) (resizeVerdict, bool) {
		v.reason, v.message = api.ReasonResizeInfeasible, v.target+": "+fmt.Sprintf(format, args...)
		return v, true
	}
	switch {
	case err != nil:
		return infeasible("%v", err)
	case !r.Wanted():
		pending, _ := api.PodResizeCondition(pod, api.ConditionResizePending)
		v.withdrawn = pending.Status == corev1.ConditionTrue
		return v, v.withdrawn
	case len(api.DecisionGroups(pod.Annotations)) == 0:
		// KAI's binder, say: its scheduler keeps its own books of this
		// GPU, which a grant here would not change.
		return infeasible("the pod was placed by another scheduler, which keeps its own account of its GPU; only pods gpufrac placed are resized")
	}
	if backend := api.MemoryEnforcement(ns.seen); !resizable(backend) {
		return infeasible("node %s enforces GPU memory with %q, which cannot change a running container's limit (only gpufrac's driver backend can); recreate the pod with the new memory", ns.Name, backend)
	}
	if devices := len(v.assignment.Devices); q.bounded && r.Desired.LimitMiB > r.Allocated.LimitMiB && api.HeldMiB(r.Desired.LimitMiB, devices) > q.mib {
		return infeasible("a limit of %dMi on each of its %d GPU(s) is more than the %s charged to its namespace's GPU memory quota (%s) when the pod was created, which a running pod cannot be charged again; recreate the pod with the memory it needs",
			r.Desired.LimitMiB, devices, api.FormatMiB(q.mib), api.ResourceGPUMemory)
	}
	if r.Applying() {
		// One resize at a time: until the node holds the container to
		// the last grant, it may hold it to any of the two, and the next
		// grant could not say which it replaces.
		v.reason = api.ReasonResizeDeferred
		v.message = fmt.Sprintf("%s: node %s has not yet applied the previous resize (to request %dMi, limit %dMi; it holds the container to request %dMi, limit %dMi); this one is decided once it has (see %s)",
			v.target, ns.Name, r.Allocated.RequestMiB, r.Allocated.LimitMiB, r.Enforced.RequestMiB, r.Enforced.LimitMiB, api.ConditionResizeInProgress)
		return v, true
	}
	// Once granted the pod is charged the larger of the new memory and
	// what its node enforces until it applies it (api.Resize.Charged).
	share := t.Request.Share
	share.Request = max(r.Desired.RequestMiB, r.Enforced.RequestMiB)
	share.Limit = max(r.Desired.LimitMiB, r.Enforced.LimitMiB)
	key := t.Request.Tenant
	if unfit := ns.Ledger.FitResize(key, share); unfit != nil {
		v.reason = api.ReasonResizeDeferred
		if unfit.Reason != gpu.ReasonGPUs {
			v.reason = api.ReasonResizeInfeasible
		}
		v.message = fmt.Sprintf("%s on node %s does not fit its GPUs: %s", v.target, ns.Name, unfit)
		return v, true
	}
	grown := *t
	grown.Request.Share = share
	ns.Resize(&grown)
	c.resizing[pod.UID] = r.Desired
	v.grant = true
	return v, true
}

// undoResize gives back a grant whose write failed: the tenant is booked
// as its pod says again.
func (c *Cache) undoResize(pod *corev1.Pod) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.resizing, pod.UID)
	ns, t, held := c.tenant(pod.UID)
	if !held || t.Claim {
		return
	}
	if read, ok, err := ns.ReadTenant(pod); err == nil && ok {
		ns.Resize(read)
		c.markDirty()
	}
}

// resizable says whether a node's memory-limit backend can change a
// running container's limit: the driver's per-cgroup limits set by
// gpufrac's hook can (through NVML on the container's cgroup, as at
// creation). The MPS server's pinned-memory limit is read by a client
// when it starts; the toolkit backend's limits are set by NVIDIA's hook,
// and the agent does not know the cgroup it set them on.
func resizable(backend string) bool { return backend == "driver" }

// resize decides one pod's resize and writes the outcome: the new
// decision with its conditions in one write of the pod's status (which
// keeps annotation changes, and which no tenant role may write), or the
// Pending condition and an event when the resize waits or cannot be.
// The pod is the informer's latest.
func (p *Plugin) resize(ctx context.Context, pod *corev1.Pod) error {
	var q quota
	if q.bounded = p.quotaBounds(pod.Namespace); q.bounded {
		claimsMiB, err := p.claimsChargeMiB(pod)
		if err != nil {
			return err
		}
		// Uncharged (created before gpufrac charged quota): 0, no growth.
		q.mib, _ = api.ShareBudgetMiB(&pod.Spec, claimsMiB)
	}
	v, ok := p.cache.decideResize(pod, q)
	if !ok {
		return nil
	}
	r := v.resize
	if v.withdrawn {
		cond := api.ResizeCondition(api.ConditionResizePending, corev1.ConditionFalse, api.ReasonResizeAllocated,
			fmt.Sprintf("asks for no more than it is allocated: request %dMi, limit %dMi", r.Allocated.RequestMiB, r.Allocated.LimitMiB))
		return p.writeResize(ctx, pod, api.Write{}, cond)
	}
	if !v.grant {
		if c, found := api.PodResizeCondition(pod, api.ConditionResizePending); found && c.Status == corev1.ConditionTrue && c.Reason == v.reason &&
			strings.HasPrefix(c.Message, v.target+":") {
			return nil // said already; the figures in its message may have moved, which is no news
		}
		cond := api.ResizeCondition(api.ConditionResizePending, corev1.ConditionTrue, v.reason, v.message)
		if err := p.writeResize(ctx, pod, api.Write{}, cond); err != nil {
			return err
		}
		p.handle.EventRecorder().Eventf(pod, nil, corev1.EventTypeWarning, "GPUResize"+v.reason, "Resize", v.message)
		return nil
	}
	write := api.ResizeDecision(v.assignment, r, r.Desired)
	pending := api.ResizeCondition(api.ConditionResizePending, corev1.ConditionFalse, api.ReasonResizeAllocated,
		fmt.Sprintf("granted request %dMi, limit %dMi on each of its GPUs (%s)", r.Desired.RequestMiB, r.Desired.LimitMiB, strings.Join(v.assignment.Devices, ",")))
	progress := api.ResizeCondition(api.ConditionResizeInProgress, corev1.ConditionTrue, api.ReasonResizeApplying,
		fmt.Sprintf("waiting for node %s to hold the running container to request %dMi, limit %dMi (it holds it to request %dMi, limit %dMi)",
			pod.Spec.NodeName, r.Desired.RequestMiB, r.Desired.LimitMiB, r.Enforced.RequestMiB, r.Enforced.LimitMiB))
	if err := p.writeResize(ctx, pod, write, pending, progress); err != nil {
		p.cache.undoResize(pod)
		return err
	}
	return nil
}

// quotaBounds says whether a namespace's ResourceQuotas bound GPU memory
// (api.ResourceGPUMemory): a pod's charge then counts against a budget,
// and its share may grow only within it. Until the quotas are read (or
// where they cannot be), every namespace is taken to be bounded.
func (p *Plugin) quotaBounds(namespace string) bool {
	if p.quotas == nil || !p.quotasSynced() {
		return true
	}
	quotas, err := p.quotas.ResourceQuotas(namespace).List(labels.Everything())
	if err != nil {
		return true
	}
	for _, rq := range quotas {
		if api.QuotaBoundsGPUMemory(rq.Spec.Hard) {
			return true
		}
	}
	return false
}

// writeResize writes annotations and conditions on a pod in one write of
// its status (api.ResizeStatusPatch).
func (p *Plugin) writeResize(ctx context.Context, pod *corev1.Pod, w api.Write, conditions ...corev1.PodCondition) error {
	patch, err := api.ResizeStatusPatch(pod, "", w, metav1.Now(), conditions...)
	if err != nil {
		return err
	}
	_, err = p.handle.ClientSet().CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("write the GPU resize of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

// resizeAll decides every waiting resize, each on the informer's latest
// copy of its pod; the collector calls it only while this replica leads.
func (p *Plugin) resizeAll(ctx context.Context, logger klog.Logger) {
	waiting := p.cache.Resizes()
	if len(waiting) == 0 {
		return
	}
	lister := p.handle.SharedInformerFactory().Core().V1().Pods().Lister()
	for _, seen := range waiting {
		pod, err := lister.Pods(seen.Namespace).Get(seen.Name)
		if err != nil || pod.UID != seen.UID {
			continue // gone: DeletePod forgets it
		}
		if err := p.resize(ctx, pod); err != nil {
			logger.Error(err, "Could not write a GPU resize; retrying later", "pod", klog.KObj(pod))
		}
	}
}
