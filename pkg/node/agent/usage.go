package agent

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

// measureUsage reads what the node's tenants use of their GPUs (the
// environment's way: NVML and /proc, or the model), adds it to the
// window, exports it and returns the Node annotation that carries it to
// `gpufrac top` and the dashboard, once per UsagePublishPeriod (resync
// notes when a write succeeded, usagePublished); ok is
// false when the GPUs are not known or the period has not passed (the
// annotation is then left as it is).
func (a *Agent) measureUsage(logger klog.Logger, hw hardware) (m usage.Measurement, annotations map[string]*string, ok bool) {
	if hw.invErr != nil {
		// The GPUs unknown, so is their use: no figure stays exported.
		a.metrics.Usage(a.opts.NodeName, usage.Measurement{}, 0)
		return m, nil, false
	}
	gpus := make([]string, 0, len(hw.inv.GPUs))
	for _, g := range hw.inv.GPUs {
		gpus = append(gpus, g.UUID)
	}
	var tenants []usage.Tenant
	for _, t := range a.plugin.Tenants() {
		tenants = append(tenants, usage.Tenant{ID: t.ID, Namespace: t.Pod.Namespace, Pod: t.Pod.Name, UID: t.Pod.UID, Container: t.Container,
			Devices: t.Devices, RequestMiB: t.RequestMiB, LimitMiB: t.LimitMiB, Mode: t.Mode})
	}
	start := time.Now()
	m = a.env.measure(tenants, a.shareholders, gpus, start)
	a.metrics.Usage(a.opts.NodeName, m, time.Since(start))
	a.usage.Add(m)
	// Less half a resync: resyncs do not start to the millisecond, and a
	// period of a minute must not slip to a minute and a half.
	if start.Sub(a.usagePublished) < a.opts.UsagePublishPeriod-a.opts.ResyncPeriod/2 {
		return m, nil, false
	}
	annotations, err := api.UsageWrite(a.usage.Summary())
	if err != nil {
		logger.Error(err, "Cannot encode the tenants' GPU use")
		return m, nil, false
	}
	return m, annotations, true
}

// shareholders are the node's pods that hold shares, one tenant per
// container and its assignment, as their annotations say: what a
// simulated node, where no container runs, models (a real node never
// asks).
func (a *Agent) shareholders() []usage.Tenant {
	a.mu.Lock()
	pods := a.pods
	a.mu.Unlock()
	if pods == nil || !pods.synced() {
		return nil
	}
	list, err := pods.lister.List(labels.Everything())
	if err != nil {
		return nil
	}
	var out []usage.Tenant
	for _, p := range list {
		if p.Spec.NodeName != a.opts.NodeName || p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		as, err := api.ParseAssignments(p.Annotations)
		if err != nil {
			continue
		}
		for _, as := range as {
			out = append(out, usage.Tenant{Namespace: p.Namespace, Pod: p.Name, UID: string(p.UID), Container: as.Container,
				Devices: as.Devices, RequestMiB: as.RequestMiB, LimitMiB: as.LimitMiB, Mode: as.Mode, Load: api.SimulatedLoad(p.Annotations)})
		}
	}
	return out
}
