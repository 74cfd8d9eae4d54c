package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
)

// Evictions: a pod that must not keep running is deleted, off any NRI
// request, one eviction per pod at a time.

// RetryEvictions evicts, off any NRI request, the pods that must not keep
// running and are not yet on their way out: those whose containers run
// unenforced (a failed eviction is retried here), and, mpsStarted being
// when the node's MPS daemon started, those whose containers were created
// before it. Those containers' mounts name an older daemon's sockets and
// directories, so a CUDA process they start next would not reach MPS at
// all: no memacct, no ceiling, no pinned limit. Their pods are told why,
// and come back on the new daemon. A container whose creation time the
// runtime did not give is not taken as stale.
//
// A pod asked to go that still runs KillAfter later (the API refused or
// could not be reached, or no kubelet acts on the deletion) has its
// container's processes killed by the node itself: an unenforced
// container stops when the node says, not when its tenant allows.
func (p *Plugin) RetryEvictions(ctx context.Context, mpsStarted time.Time) {
	now := time.Now()
	for id, t := range p.tenants.ids() {
		stale := !mpsStarted.IsZero() && !t.started.IsZero() && t.started.Before(mpsStarted)
		mustStop := stale || (t.State == StateUnenforced && !p.opts.FailOpen)
		if mustStop && t.stopAsked.IsZero() {
			p.tenants.update(id, func(t *Tenant) { t.stopAsked = now })
			t.stopAsked = now
		}
		if mustStop && p.opts.KillAfter > 0 && !t.killed && t.pid > 0 && now.Sub(t.stopAsked) >= p.opts.KillAfter {
			p.kill(ctx, id, t)
		}
		if t.evicted {
			continue
		}
		switch {
		case stale:
			detail := fmt.Sprintf("the node's MPS daemon started at %s, after the container (created %s); its MPS mounts name the old daemon",
				mpsStarted.UTC().Format(time.RFC3339), t.started.UTC().Format(time.RFC3339))
			if !t.mpsReported && p.opts.Reporter != nil {
				p.opts.Reporter.MPSRestarted(t.Pod, t.Container, detail)
			}
			p.tenants.update(id, func(t *Tenant) { t.mpsReported = true })
			p.evict(ctx, t.Pod, t.Container, "the node's MPS daemon was replaced under it: "+detail)
		case t.State == StateUnenforced && !p.opts.FailOpen:
			p.evict(ctx, t.Pod, t.Container, "it runs without its GPU-fraction enforcement")
		}
	}
}

// kill stops a container whose pod was asked to go KillAfter ago and
// still runs: every process of its cgroup gets SIGKILL. The kubelet then
// sees it exited, and the pod's deletion (or the next) completes.
func (p *Plugin) kill(ctx context.Context, id string, t Tenant) {
	logger := klog.FromContext(ctx).WithValues("pod", t.Pod.Namespace+"/"+t.Pod.Name, "container", t.Container)
	killContainer := p.opts.KillContainer
	if killContainer == nil {
		killContainer = p.killContainer
	}
	n, err := killContainer(id, t.pid)
	switch {
	case errors.Is(err, errContainerGone):
		p.tenants.update(id, func(t *Tenant) { t.killed = true })
		logger.V(2).Info("A container that must stop is gone already", "reason", err.Error())
		return
	case err != nil:
		logger.Error(err, "Cannot kill a container that must stop; retrying at the next resync")
		return
	}
	p.tenants.update(id, func(t *Tenant) { t.killed = true })
	reason := fmt.Sprintf("its pod was asked to go %s ago and it still ran: the node killed its %d process(es)", time.Since(t.stopAsked).Round(time.Second), n)
	logger.Info("Killed a container that must stop", "reason", reason)
	if p.opts.Reporter != nil {
		p.opts.Reporter.Evicted(t.Pod, t.Container, reason)
	}
}

// errContainerGone: the process a container started with is gone, or its
// PID now belongs to another cgroup (reused): nothing of it is left to kill.
var errContainerGone = errors.New("the container's first process is gone")

// killContainer kills every process of container id's cgroup, found from
// its first process (pid) and checked to be the container's own (its
// path names the container ID, as containerd's cgroups do): a PID reused
// by another process after the container ended must kill nothing.
func (p *Plugin) killContainer(id string, pid uint32) (int, error) {
	cgroup, err := enforce.CgroupOf(p.opts.ProcRoot, int(pid))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, errContainerGone
	}
	if err != nil {
		return 0, err
	}
	if !strings.Contains(cgroup, id) {
		return 0, fmt.Errorf("%w: pid %d is in cgroup %s, not the container's", errContainerGone, pid, cgroup)
	}
	return enforce.KillCgroup(cgroup)
}

// evict asks for the pod's eviction in the background, with a deadline of
// its own (not the NRI request's), unless one is under way; on success its
// containers are marked evicted and the pod is told, on failure
// RetryEvictions tries again.
func (p *Plugin) evict(ctx context.Context, pod PodRef, container, reason string) {
	p.evictMu.Lock()
	if p.evicting == nil {
		p.evicting = map[string]bool{}
	}
	if p.evicting[pod.UID] {
		p.evictMu.Unlock()
		return
	}
	p.evicting[pod.UID] = true
	p.evictMu.Unlock()
	logger := klog.FromContext(ctx)
	p.evictions.Add(1)
	go func() {
		defer p.evictions.Done()
		defer func() {
			p.evictMu.Lock()
			delete(p.evicting, pod.UID)
			p.evictMu.Unlock()
		}()
		ctx, cancel := context.WithTimeout(klog.NewContext(context.Background(), logger), 30*time.Second)
		defer cancel()
		if p.opts.Evictor != nil {
			if err := p.opts.Evictor.Evict(ctx, pod, reason); err != nil {
				logger.Error(err, "Eviction failed; retrying at the next resync", "pod", pod.Namespace+"/"+pod.Name, "reason", reason)
				return
			}
		}
		for id, t := range p.tenants.ids() {
			if t.Pod.UID == pod.UID {
				p.tenants.update(id, func(t *Tenant) { t.evicted = true })
			}
		}
		if p.opts.Reporter != nil {
			p.opts.Reporter.Evicted(pod, container, reason)
		}
	}()
}

// Stop removes a pod that must not keep running, off the caller's
// request (the agent's resync), with the reason for its Event.
func (p *Plugin) Stop(ctx context.Context, pod PodRef, container, reason string) {
	for _, t := range p.tenants.ids() {
		if t.Pod.UID == pod.UID && t.evicted {
			return // on its way out already
		}
	}
	p.evict(ctx, pod, container, reason)
}

// WaitForEvictions waits until the evictions and client drains asked for
// so far were tried.
func (p *Plugin) WaitForEvictions() {
	p.background.Wait()
	p.evictions.Wait()
}
