package agent

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/metrics"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

// Burst reclaim policies (--burst-reclaim).
const (
	// BurstReclaimPriority stops, on a GPU short of memory, the
	// lowest-priority tenant above its request (api.ReclaimOrder).
	BurstReclaimPriority = "priority"
	// BurstReclaimOff leaves a GPU short of memory to the driver.
	BurstReclaimOff = "off"
)

// reclaimSlack is how long past a deletion's grace the memory of the pod
// is still waited for: the kubelet stops containers, then their
// processes exit.
const reclaimSlack = 30 * time.Second

// reclaimBursts stops, on each GPU whose free memory is below
// Options.BurstReclaimBelowPercent, the first tenant of api.ReclaimOrder:
// the lowest-priority one above its request, through the deletion every
// enforcement stop uses (Evict), with an event that names the pressure
// and the order. One tenant per GPU at a time: while a pod on the GPU that
// holds memory there is being deleted (at most its grace and
// reclaimSlack), that memory is about to come back, and the next reading
// says whether it was enough. The pod goes whole: it is stopped for a
// container above its request. Figures the driver cannot give are never
// taken for zero: a tenant whose use is unknown is not in the order, and
// a GPU whose use is unknown is not judged.
func (a *Agent) reclaimBursts(ctx context.Context, logger klog.Logger, hw hardware, m usage.Measurement) {
	if a.opts.BurstReclaim == BurstReclaimOff || hw.invErr != nil {
		return
	}
	a.mu.Lock()
	pods := a.pods
	a.mu.Unlock()
	if pods == nil || !pods.synced() {
		return // priorities unknown
	}
	totalMiB := map[string]int64{}
	for _, g := range hw.inv.GPUs {
		totalMiB[g.UUID] = g.MemoryMiB
	}
	bursts := map[string][]api.Burst{}
	refs := map[string]nriplugin.PodRef{}
	leaving := map[string]bool{} // GPUs whose memory a pod being deleted is about to give back
	present := map[string]bool{}
	now := time.Now()
	for _, c := range m.Containers {
		t := c.Tenant
		present[t.UID] = true
		holds := c.MemoryBytes.Known && c.MemoryBytes.Value > 0
		if asked, ok := a.reclaiming[t.UID]; ok {
			// Deleted by a reclaim: its memory comes back within the grace
			// the deletion gave, or never will by waiting.
			leaving[c.GPU] = leaving[c.GPU] || (holds && now.Before(asked.Add(a.opts.SecurityStopGrace+reclaimSlack)))
			continue
		}
		pod, ok := pods.pod(t.Namespace, t.Pod, t.UID)
		if !ok {
			continue
		}
		if pod.DeletionTimestamp != nil {
			// Its deadline is the deletion's (deletionTimestamp is when the
			// grace ends).
			leaving[c.GPU] = leaving[c.GPU] || (holds && now.Before(pod.DeletionTimestamp.Add(reclaimSlack)))
			continue
		}
		if !c.MemoryBytes.Known {
			continue
		}
		var priority int32
		if pod.Spec.Priority != nil {
			priority = *pod.Spec.Priority
		}
		key := t.Namespace + "/" + t.Pod
		bursts[c.GPU] = append(bursts[c.GPU], api.Burst{Pod: key, Container: t.Container, Priority: priority,
			RequestMiB: t.RequestMiB, UsedMiB: c.MemoryBytes.Value >> 20})
		refs[key] = nriplugin.PodRef{Namespace: t.Namespace, Name: t.Pod, UID: t.UID}
	}
	for uid := range a.reclaiming {
		if !present[uid] {
			delete(a.reclaiming, uid) // gone: its memory is back
		}
	}
	for _, g := range m.GPUs {
		total := totalMiB[g.UUID]
		if !g.MemoryBytes.Known || total == 0 || leaving[g.UUID] {
			continue
		}
		free := total - g.MemoryBytes.Value>>20
		if !api.UnderPressure(free, total, a.opts.BurstReclaimBelowPercent) {
			continue
		}
		order := api.ReclaimOrder(bursts[g.UUID])
		if len(order) == 0 {
			logger.V(2).Info("GPU short of memory, and no tenant uses more than its request: nothing to reclaim", "gpu", g.UUID, "freeMiB", free, "totalMiB", total)
			continue
		}
		victim := order[0]
		names := make([]string, len(order))
		for i, b := range order {
			names[i] = b.String()
		}
		why := fmt.Sprintf("GPU %s has %s free of %s, below %d%% (--burst-reclaim-below); container %s uses %s, %s above its request of %s, and is first to give memory back: lowest priority above its request, then furthest above it (order: %s)",
			g.UUID, api.FormatMiB(free), api.FormatMiB(total), a.opts.BurstReclaimBelowPercent, victim.Container, api.FormatMiB(victim.UsedMiB),
			api.FormatMiB(victim.Over()), api.FormatMiB(victim.RequestMiB), strings.Join(names, "; "))
		ref := refs[victim.Pod]
		stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := a.Evict(stopCtx, ref, why)
		cancel()
		if err != nil {
			logger.Error(err, "Cannot stop a bursting tenant of a GPU short of memory; trying again at the next resync", "pod", victim.Pod, "gpu", g.UUID)
			continue
		}
		a.reclaiming[ref.UID] = now
		a.metrics.Count(metrics.EventReclaimed)
		a.recorder.Eventf(podRef(ref), corev1.EventTypeWarning, "GPUMemoryReclaimed", "deleted: %s", why)
		logger.Info("Stopped a bursting tenant: its GPU is short of memory", "pod", victim.Pod, "gpu", g.UUID, "freeMiB", free, "order", names)
	}
}
