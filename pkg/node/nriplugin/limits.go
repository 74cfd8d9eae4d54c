package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// The driver backend's lifecycle of a container's limits: read back after
// start, recorded as a lease, released at stop.

// PostStartContainer verifies, for the driver backend, that the limits the
// hook set are in force on the started container's cgroup, and records
// the lease to release at stop. A container whose limits are not in force
// is evicted so it restarts enforced (fail closed); a node that fails open
// reports it and lets it run.
func (p *Plugin) PostStartContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	defer p.observe("PostStartContainer", time.Now())
	cfg := p.injection.Load()
	tenant, ok := p.tenants.get(ctr.GetId())
	if !ok {
		// Not seen at creation: a runtime whose NRI has no failure policy
		// (containerd 1.7) starts a container whose CreateContainer timed
		// out without its adjustment. Judged now as the audit would (not
		// before the node's backend is known: see Synchronize).
		if cfg.Backend == nodeapi.BackendUnset {
			return nil
		}
		d, _, reason := p.judgeRunning(ctx, pod, ctr, *cfg)
		if reason == "" {
			reason = p.claimShares(pod, ctr, d)
		}
		if reason != "" {
			klog.FromContext(ctx).Info("Stopping a container that started without what the node injects", "pod", pod.GetNamespace()+"/"+pod.GetName(),
				"container", ctr.GetName(), "reason", reason)
			p.evict(ctx, refOf(pod), ctr.GetName(), reason)
		}
		return nil
	}
	p.tenants.update(ctr.GetId(), func(t *Tenant) { t.pid = ctr.GetPid() })
	if cfg.Backend != nodeapi.BackendDriver || p.opts.NVML == nil || p.opts.Leases == nil {
		return nil
	}
	if tenant.State != StateInjected {
		return nil // refused, or failed open
	}
	a := tenant.assignment
	logger := klog.FromContext(ctx).WithValues("pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
	limits := enforce.Limits{Container: a.Container, Devices: a.Devices, RequestMiB: uint64(a.RequestMiB), LimitMiB: uint64(a.LimitMiB)}
	cgroup, err := enforce.CgroupOf(p.opts.ProcRoot, int(ctr.GetPid()))
	if err == nil {
		lease := enforce.Lease{Pod: pod.GetNamespace() + "/" + pod.GetName(), Container: a.Container, Cgroup: cgroup,
			Devices: a.Devices, RequestMiB: limits.RequestMiB, LimitMiB: limits.LimitMiB, Boot: p.opts.BootID}
		if perr := p.opts.Leases.Put(ctr.GetId(), lease); perr != nil {
			logger.Error(perr, "Cannot record the GPU memory lease; its soft limit may not be released at stop")
		}
		err = enforce.Verify(p.opts.NVML, cgroup, limits)
	}
	p.verified(ctx, ctr.GetId(), cgroup, err)
	return nil
}

// maxVerifyTries bounds how many times a started container's limits may
// fail to be read back (NVML errors, not a mismatch): the first at start,
// the rest at the agent's resyncs. A transient NVML error must not evict a
// healthy pod; one that persists cannot be told from missing limits.
const maxVerifyTries = 3

// verified records the outcome of reading a started container's limits
// back: enforced; a mismatch (or an unknown cgroup) is unenforced at once;
// a failed read is retried by Reverify until maxVerifyTries.
func (p *Plugin) verified(ctx context.Context, id, cgroup string, err error) {
	tenant, ok := p.tenants.get(id)
	if !ok {
		return
	}
	logger := klog.FromContext(ctx).WithValues("pod", tenant.Pod.Namespace+"/"+tenant.Pod.Name, "container", tenant.Container)
	a := tenant.assignment
	if err == nil {
		p.tenants.update(id, func(t *Tenant) { t.State, t.cgroup = StateEnforced, cgroup })
		if p.opts.Reporter != nil {
			p.opts.Reporter.Enforced(tenant.Pod, tenant.Container, withNotes(fmt.Sprintf("driver memory limits verified on cgroup %s: request %dMi, limit %dMi on %s",
				cgroup, a.RequestMiB, a.LimitMiB, strings.Join(a.Devices, ",")), tenant.notes))
		}
		return
	}
	tries := tenant.verifyTries + 1
	if cgroup != "" && !errors.Is(err, enforce.ErrLimitsDiffer) && tries < maxVerifyTries {
		logger.Info("Cannot read the container's GPU memory limits back yet; retrying at the next resync", "try", tries, "reason", err.Error())
		p.tenants.update(id, func(t *Tenant) { t.State, t.cgroup, t.verifyTries = StateUnverified, cgroup, tries })
		return
	}
	p.tenants.update(id, func(t *Tenant) { t.State, t.cgroup, t.verifyTries = StateUnenforced, cgroup, tries })
	reason := "GPU memory limits not in force after start: " + err.Error()
	if !errors.Is(err, enforce.ErrLimitsDiffer) && cgroup != "" {
		reason = fmt.Sprintf("GPU memory limits could not be read back in %d tries: %v", tries, err)
	}
	if p.opts.FailOpen {
		logger.Info("GPU memory limits not in force; the node fails open, so the container keeps running", "reason", reason)
		if p.opts.Reporter != nil {
			p.opts.Reporter.Unenforced(tenant.Pod, tenant.Container, reason)
		}
		return
	}
	logger.Info("Evicting a pod whose GPU memory limits are not in force", "reason", reason)
	p.evict(ctx, tenant.Pod, tenant.Container, reason)
}

// Reverify reads back, off any NRI request, the limits of started
// containers whose first read-back failed (StateUnverified).
func (p *Plugin) Reverify(ctx context.Context) {
	if p.opts.NVML == nil {
		return
	}
	for id, t := range p.tenants.ids() {
		if t.State != StateUnverified {
			continue
		}
		a := t.assignment
		err := enforce.Verify(p.opts.NVML, t.cgroup, enforce.Limits{Container: a.Container, Devices: a.Devices,
			RequestMiB: uint64(a.RequestMiB), LimitMiB: uint64(a.LimitMiB)})
		p.verified(ctx, id, t.cgroup, err)
	}
}

func (p *Plugin) release(ctx context.Context, pod PodRef, id, name string) {
	if p.opts.NVML == nil || p.opts.Leases == nil {
		return
	}
	logger := klog.FromContext(ctx)
	lease, ok, err := p.opts.Leases.Take(id)
	if err != nil {
		logger.Error(err, "Cannot update the GPU memory leases")
	}
	if !ok {
		return
	}
	if err := enforce.Release(p.opts.NVML, lease.Cgroup, lease.Devices); err != nil {
		logger.Error(err, "Cannot release a stopped container's GPU soft limit", "pod", lease.Pod, "container", name)
		if p.opts.Reporter != nil {
			p.opts.Reporter.ReleaseFailed(pod, name, err)
		}
	}
}

// releaseVanished releases the leases of containers the runtime no longer
// runs (they stopped while the agent was away); their MPS namespaces go at
// the agent's next reconciliation, off the NRI request. An
// empty list from the runtime is not taken as "nothing runs": state is
// then kept.
func (p *Plugin) releaseVanished(ctx context.Context, pods map[string]*nriapi.PodSandbox, ctrs []*nriapi.Container) {
	if len(ctrs) == 0 {
		return
	}
	if p.opts.Leases == nil {
		return
	}
	running := map[string]bool{}
	for _, c := range ctrs {
		if c.GetState() != nriapi.ContainerState_CONTAINER_STOPPED {
			running[c.GetId()] = true
		}
	}
	for _, id := range p.opts.Leases.IDs() {
		if !running[id] {
			p.release(ctx, PodRef{}, id, id)
		}
	}
}
