package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
)

// The node's MPS daemon: each sm-sharing container's namespace, and the
// clients a stopped container leaves.

// ensureNamespace creates an sm-sharing container's MPS namespace, with
// its thread ceiling, before the container's first client can attach.
func (p *Plugin) ensureNamespace(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, e injection.Effect) error {
	if p.opts.MPS == nil {
		return errors.New("sm-sharing needs MPS namespaces, and this node agent keeps none")
	}
	ctx, cancel := context.WithTimeout(ctx, mpsHookBudget)
	defer cancel()
	return p.opts.MPS.Ensure(ctx, mps.Namespace{Name: e.Namespace, Threads: e.Threads,
		Pod: pod.GetNamespace() + "/" + pod.GetName(), PodUID: pod.GetUid(), Container: ctr.GetName(), ContainerID: ctr.GetId()})
}

// ReconcileMPS makes the MPS daemon's namespaces those of the running
// containers (live): claimed ones a restarted daemon dropped are created
// again with their ceilings (for the containers' restarts until their pods
// are evicted, see RetryEvictions), unclaimed ones are deleted.
func (p *Plugin) ReconcileMPS(ctx context.Context, live func(name string) bool) {
	if p.opts.MPS == nil {
		return
	}
	r, err := p.opts.MPS.Reconcile(ctx, live)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Cannot reconcile the MPS namespaces; retrying at the next resync")
	}
	if len(r.Recreated) > 0 || len(r.Deleted) > 0 {
		klog.FromContext(ctx).Info("Reconciled the MPS namespaces", "recreated", len(r.Recreated), "deleted", r.Deleted)
	}
}

// LiveNamespaces are the MPS namespaces of the containers the plugin
// knows run.
func (p *Plugin) LiveNamespaces() map[string]bool {
	live := map[string]bool{}
	for _, t := range p.tenants.list() {
		if t.Namespace != "" {
			live[t.Namespace] = true
		}
	}
	return live
}

// drain terminates the container's MPS clients: those routed to its
// namespace, and those whose cgroup is the container's (time-slicing
// clients of the main socket).
func (p *Plugin) drain(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, namespace string) {
	cgroup := ""
	if ctr.GetPid() > 0 {
		cgroup, _ = enforce.CgroupOf(p.opts.ProcRoot, int(ctr.GetPid()))
	}
	ref, name, logger := pod.GetNamespace()+"/"+pod.GetName(), ctr.GetName(), klog.FromContext(ctx)
	deadline := p.opts.DrainTimeout
	if deadline <= 0 {
		deadline = DefaultDrainTimeout
	}
	// Off the NRI request: terminating a client waits for its work to
	// drain, which can take longer than the request may.
	p.background.Add(1)
	go func() {
		defer p.background.Done()
		ctx, cancel := context.WithTimeout(klog.NewContext(context.Background(), logger), deadline)
		defer cancel()
		left, err := p.opts.MPS.Drain(ctx, func(c mps.Client) bool {
			if namespace != "" && c.Namespace == namespace {
				return true
			}
			if cgroup == "" {
				return false
			}
			cg, err := enforce.CgroupOf(p.opts.ProcRoot, c.PID)
			return err == nil && cg == cgroup
		})
		if err != nil {
			logger.Error(err, "Cannot terminate the stopped container's MPS clients", "pod", ref, "container", name, "left", left)
		}
		if len(left) == 0 {
			return
		}
		// A client that does not finish terminating is how a wedged shared
		// server shows (KAI's node operator, measured on r615, with the
		// same 30 s): its other clients fail or hang while the control
		// daemon still answers. The daemon is replaced, and the pods on it
		// are evicted once the new one runs (RetryEvictions).
		why := fmt.Sprintf("MPS clients %v of stopped container %s %s did not finish terminating within %s", left, ref, name, deadline)
		logger.Info("The shared MPS server looks wedged; asking for the daemon's replacement", "reason", why)
		if rerr := p.opts.MPS.RequestReplace(why); rerr != nil {
			logger.Error(rerr, "Cannot ask for the wedged MPS daemon's replacement")
		}
	}()
}

// DefaultDrainTimeout is how long a stopped container's MPS clients may
// take to terminate before the shared server is taken as wedged.
const DefaultDrainTimeout = 30 * time.Second

// mpsHookBudget bounds the MPS work of one NRI request: creating a
// namespace, draining clients, deleting a namespace. NRI's default request
// timeout is 2 s, after which (with the plugin's failure policy) the
// request fails; this leaves the rest of the hook time to finish.
const mpsHookBudget = 1500 * time.Millisecond
