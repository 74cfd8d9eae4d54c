package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"sync"

	nriapi "github.com/containerd/nri/pkg/api"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// gather reads every fact the node judges a container by
// (injection.Container), once, from the runtime's view of it and the
// agent's state: the pod as resized, who consumes its DRA shares, and,
// only where the visibility check will ask, what it was granted.
func (p *Plugin) gather(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, cfg injection.Config) injection.Container {
	current, resized := p.podOf(pod)
	c := injection.Container{Pod: current, Resized: resized, Name: ctr.GetName(), Env: ctr.GetEnv(), Mounts: ctr.GetMounts(),
		UID: uidOf(ctr), UserNamespace: hasUserNamespace(ctr), SharedPID: sharesPIDNamespace(ctr)}
	if p.opts.MayEscalate != nil {
		c.MayEscalate = p.opts.MayEscalate(pod.GetNamespace(), pod.GetName(), pod.GetUid(), ctr.GetName())
	}
	for _, d := range ctr.GetCDIDevices() {
		c.CDIDevices = append(c.CDIDevices, d.GetName())
	}
	c.ShareHolder = p.shares.holder(shareUserOf(pod, ctr), injection.DRAShares(c.CDIDevices))
	if injection.NeedsGrant(c, cfg) {
		c.Grant.Read = true
		if p.opts.Grants == nil {
			c.Grant.Err = errors.New("this node agent reads no grants")
		} else {
			c.Grant.IDs, c.Grant.Err = p.opts.Grants(ctx, refOf(pod), ctr.GetName(), c.CDIDevices)
		}
	}
	return c
}

// running is what the node reads of a running container's limits on the
// driver backend: its cgroup, and, for a resized pod, what the driver
// holds it to (held; nil when not read).
type running struct {
	cgroup string
	held   *enforce.Limits
}

// judgeRunning is the audit of one running container: its facts, with
// what the driver holds it to where a resize changed its memory (a
// container created before the resize has the memory of then in its
// environment), and why it must not keep running ("" when it may).
func (p *Plugin) judgeRunning(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, cfg injection.Config) (injection.Decision, running, string) {
	c := p.gather(ctx, pod, ctr, cfg)
	// Whether it may become root by what its pod allows (escalation, a
	// shared process namespace) is judged when it is created, not once it
	// runs: a share created before these checks (an upgrade) keeps
	// running, and is judged at its next container. The webhook, failing
	// closed, refuses such pods before they reach a node.
	c.MayEscalate, c.SharedPID = nil, false
	var r running
	if cfg.Backend == nodeapi.BackendDriver && p.opts.NVML != nil && ctr.GetPid() > 0 {
		r.cgroup, _ = enforce.CgroupOf(p.opts.ProcRoot, int(ctr.GetPid()))
	}
	if r.cgroup != "" && c.Resized {
		if a, ok := assignmentOf(c); ok {
			held, err := enforce.Held(p.opts.NVML, r.cgroup, a.Devices)
			switch {
			case errors.Is(err, enforce.ErrLimitsDiffer):
				c.HeldErr = err
			case err != nil:
				// A read that failed says nothing of the limits: the
				// container keeps the memory it was created with on
				// record, and the resize loop reads them again when it acts.
				klog.FromContext(ctx).Error(err, "Cannot read a resized container's GPU memory limits back", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
			default:
				r.held = &held
			}
		}
	}
	d, reason := injection.Audit(c, cfg)
	if d.Assignment == nil && reason != "" {
		// Stopped by a check that leaves it no share (a root MPS client, a
		// share's second consumer): still a tenant until it is gone, so
		// that its eviction is retried and its MPS namespace kept.
		if a, ok := assignmentOf(c); ok {
			d.Assignment = &a
			if a.Mode == api.SMSharing {
				d.MPSNamespace = nodeapi.NamespaceName(c.Pod.UID, a.Container)
			}
		}
	}
	if errors.Is(d.Reason, injection.ErrGrantUnknown) {
		klog.FromContext(ctx).Error(d.Reason, "Cannot check a running container's GPUs against its grant", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
	}
	return d, r, reason
}

// assignmentOf is the container's share as its pod's annotations say.
func assignmentOf(c injection.Container) (api.Assignment, bool) {
	as, err := api.ParseAssignments(c.Pod.Annotations)
	if err != nil {
		return api.Assignment{}, false
	}
	for _, a := range as {
		if a.Container == c.Name {
			return a, true
		}
	}
	return api.Assignment{}, false
}

// podOf is the pod as the plugin decides on it: its sandbox's annotations,
// with the memory a resize has allocated since (Options.Resized), so that a
// container created after a resize (a restart) gets the memory the pod has
// now, not the memory it was placed with. resized says so.
func (p *Plugin) podOf(pod *nriapi.PodSandbox) (_ injection.Pod, resized bool) {
	annotations := pod.GetAnnotations()
	if p.opts.Resized != nil {
		if c, m, ok := p.opts.Resized(pod.GetNamespace(), pod.GetName(), pod.GetUid()); ok {
			annotations, resized = api.WithMemory(annotations, c, m), true
		}
	}
	return injection.Pod{UID: pod.GetUid(), Namespace: pod.GetNamespace(), Annotations: annotations}, resized
}

// uidOf is the container process's uid, nil where the runtime does not
// say (NRI before 0.10, containerd 1.7).
func uidOf(ctr *nriapi.Container) *uint32 {
	if u := ctr.GetUser(); u != nil {
		uid := u.GetUid()
		return &uid
	}
	return nil
}

// sharesPIDNamespace says whether the container joins a process
// namespace made before it: the runtime names one by path (the sandbox's
// with shareProcessNamespace, the target's for a debug container), and
// gives a container of its own a new one, with none.
func sharesPIDNamespace(ctr *nriapi.Container) bool {
	for _, ns := range ctr.GetLinux().GetNamespaces() {
		if ns.GetType() == "pid" && ns.GetPath() != "" {
			return true
		}
	}
	return false
}

func hasUserNamespace(ctr *nriapi.Container) bool {
	for _, ns := range ctr.GetLinux().GetNamespaces() {
		if ns.GetType() == "user" {
			return true
		}
	}
	return false
}

// shareUsers records which running container consumes each gpufrac DRA
// share (by its CDI device name): a share's limits go on each consumer's
// cgroup, and the allocator counted it once, so a second consumer at the
// same time would double it. The same container restarting, or another
// one after the first stopped (an init container, then the main one), is
// one consumer at a time.
type shareUsers struct {
	mu sync.Mutex
	m  map[string]shareUser // CDI device name →
}

type shareUser struct{ id, podUID, pod, container string }

func shareUserOf(pod *nriapi.PodSandbox, ctr *nriapi.Container) shareUser {
	return shareUser{id: ctr.GetId(), podUID: pod.GetUid(), pod: pod.GetNamespace() + "/" + pod.GetName(), container: ctr.GetName()}
}

// holder says which other running container consumes one of shares (CDI
// names, injection.DRAShares) already ("" for none).
func (s *shareUsers) holder(me shareUser, shares []string) string {
	if len(shares) == 0 {
		return "" // most containers: no share, nothing to look up
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conflict(me, shares)
}

func (s *shareUsers) conflict(me shareUser, shares []string) string {
	for _, name := range shares {
		if u, ok := s.m[name]; ok && u.id != me.id && (u.podUID != me.podUID || u.container != me.container) {
			return fmt.Sprintf("its gpufrac share %s is consumed already by container %q of pod %s, and a share is enforced on one container at a time (its limits would apply twice): give each container a claim of its own", name, u.container, u.pod)
		}
	}
	return ""
}

// claim records me as the consumer of shares, unless another running
// container consumes one already (checked again under the lock: two
// creations may race past holder).
func (s *shareUsers) claim(me shareUser, shares []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if msg := s.conflict(me, shares); msg != "" {
		return errors.New(msg)
	}
	if s.m == nil {
		s.m = map[string]shareUser{}
	}
	for _, n := range shares {
		s.m[n] = me
	}
	return nil
}

// release forgets the shares a stopped container consumed.
func (s *shareUsers) release(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for n, u := range s.m {
		if u.id == id {
			delete(s.m, n)
		}
	}
}

// claimShares carries out, for a container found running, the one effect
// the audit does (the others are the resync's): it records the container
// as its DRA shares' consumer, or says why it must go.
func (p *Plugin) claimShares(pod *nriapi.PodSandbox, ctr *nriapi.Container, d injection.Decision) string {
	for _, e := range d.Effects {
		if e.Kind != injection.EffectClaimShares {
			continue
		}
		if err := p.shares.claim(shareUserOf(pod, ctr), e.Shares); err != nil {
			return "running as a second consumer of a share: " + err.Error()
		}
	}
	return ""
}
