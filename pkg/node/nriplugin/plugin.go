// Package nriplugin is the node agent's NRI plugin: at container creation
// it injects exactly what the pod's scheduler decision says (through
// package injection), refuses fractional containers it cannot enforce, and
// on every (re)connection audits the containers already running.
package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// Name and index the plugin registers with; the index orders it after
// device plugins' own NRI injections, so its values win.
const (
	Name  = "gpufrac"
	Index = "90"
)

// PodRef names a pod for events and evictions.
type PodRef struct {
	Namespace, Name, UID string
}

func refOf(pod *nriapi.PodSandbox) PodRef {
	return PodRef{Namespace: pod.GetNamespace(), Name: pod.GetName(), UID: pod.GetUid()}
}

// Reporter records what the plugin did to a pod, as Kubernetes Events and
// metrics.
type Reporter interface {
	// Refused: a fractional container was not allowed to start.
	Refused(pod PodRef, container string, err error)
	// FailedOpen: a fractional container starts with no GPU because the
	// node is configured to fail open.
	FailedOpen(pod PodRef, container string, err error)
	// Evicted: a running container lacked its enforcement and its pod was
	// evicted.
	Evicted(pod PodRef, container, reason string)
	// ReleaseFailed: a stopped container's soft limit could not be
	// released, so its reservation stays charged up the cgroup tree.
	ReleaseFailed(pod PodRef, container string, err error)
	// Enforced: a fractional container got its limits (detail says how).
	Enforced(pod PodRef, container, detail string)
	// Unenforced: a container runs without verified limits and, the node
	// failing open, keeps running.
	Unenforced(pod PodRef, container, reason string)
	// MPSRestarted: the node's MPS daemon was replaced under a running
	// container, whose MPS clients lost their contexts.
	MPSRestarted(pod PodRef, container, detail string)
	// Policed: a container outside any gpufrac share named GPUs it was
	// not granted, and now sees only its grant (detail says what changed).
	Policed(pod PodRef, container, detail string)
}

// Evictor removes a pod that must not keep running, whatever disruption
// budgets say (the agent deletes it): an unenforced container is stopped,
// not negotiated with.
type Evictor interface {
	Evict(ctx context.Context, pod PodRef, reason string) error
}

// Options configure the plugin.
type Options struct {
	Injection injection.Config
	// Resized, when set, says the memory a pod's fractional container is
	// allocated now, where a resize changed it (api.Resized) since the pod's
	// sandbox was made: the runtime gives the plugin the sandbox's
	// annotations, the pod's at that time. ok is false otherwise, and when
	// the pod is not known (yet).
	Resized func(namespace, name, uid string) (container string, m api.Memory, ok bool)
	// KillAfter is how long after the node asked for a pod to go (its
	// eviction) a container that must stop may still run before the node
	// kills its processes itself; 0: never. KillContainer kills every
	// process of container id, whose first process is pid, and says how
	// many (nil: its cgroup's, checked to be the container's).
	KillAfter     time.Duration
	KillContainer func(id string, pid uint32) (int, error)
	// MayEscalate says, from the pod's spec as the API has it, whether the
	// named container may gain privileges (injection.Container.MayEscalate);
	// nil (the func or its answer): not known.
	MayEscalate func(namespace, name, uid, container string) *bool
	// FailOpen starts unenforceable fractional containers with no GPU
	// instead of refusing them.
	FailOpen bool
	Reporter Reporter
	Evictor  Evictor
	// NVML, ProcRoot and Leases serve the driver backend's lifecycle:
	// after start the limits are read back from the container's cgroup
	// (found through ProcRoot/<pid>/cgroup), and at stop its soft limit is
	// released. Leases remember which cgroup holds which GPUs across
	// restarts of the agent. Nil NVML or Leases disables both.
	NVML     nvml.Interface
	ProcRoot string
	Leases   *enforce.Leases
	// BootID is the host's boot ID, recorded with each lease so that a
	// restarted agent knows which limits a reboot already cleared.
	BootID string
	// MPS keeps the sm-sharing containers' namespaces of the node's MPS
	// daemon; nil refuses sm-sharing containers.
	MPS *mps.Manager
	// DrainTimeout bounds how long a stopped container's MPS clients may
	// take to terminate (default DefaultDrainTimeout).
	DrainTimeout time.Duration
	// ObserveHook, when set, receives how long each NRI hook took.
	ObserveHook func(hook string, d time.Duration)
	// EnsureExclusive puts a fractional container's GPUs in
	// EXCLUSIVE_PROCESS before it starts, where the node keeps them so
	// (injection.Config.ExclusiveProcess; the resync does it too, but a
	// container may come first); its error refuses the container.
	EnsureExclusive func(uuids []string) error
	// Grants tells which GPUs a container outside any gpufrac share was
	// granted (the device plugin's allocation, its DRA shares, from
	// cdiDevices as the kubelet named them), where the node polices what
	// containers see (injection.Config.RestrictVisibility). Its error
	// refuses a container that names GPUs: what it may see is unknown.
	Grants func(ctx context.Context, pod PodRef, container string, cdiDevices []string) ([]string, error)
}

// Plugin implements the NRI hooks the node agent needs.
type Plugin struct {
	opts       Options
	injection  atomic.Pointer[injection.Config]
	registered atomic.Bool
	tenants    tenants
	shares     shareUsers

	// Evictions run off the NRI request (whose deadline is 2 s), one per
	// pod at a time; a failed one is retried by RetryEvictions.
	evictions sync.WaitGroup
	// background are the other goroutines of hooks (client drains).
	background sync.WaitGroup
	evictMu    sync.Mutex
	evicting   map[string]bool // pod UID

	// deferred is the runtime's container list of a Synchronize that came
	// before the node's memory-limit backend was known: audited by the
	// SetInjection that makes it known.
	auditMu  sync.Mutex
	deferred *audit
}

// audit is one Synchronize's view of the runtime.
type audit struct {
	logger klog.Logger
	pods   []*nriapi.PodSandbox
	ctrs   []*nriapi.Container
}

// Tenants lists the fractional containers the plugin knows of, with their
// enforcement state.
func (p *Plugin) Tenants() []Tenant { return p.tenants.list() }

func (p *Plugin) observe(hook string, start time.Time) {
	if p.opts.ObserveHook != nil {
		p.opts.ObserveHook(hook, time.Since(start))
	}
}

// New returns a plugin; Run connects it to the runtime.
func New(opts Options) *Plugin {
	p := &Plugin{opts: opts}
	p.SetInjection(opts.Injection)
	return p
}

// SetInjection replaces the node configuration used from the next
// container on, e.g. once the agent knows which memory-limit backend the
// driver allows.
// The plugin's FailOpen option wins over cfg's.
//
// The first one that names a backend runs the audit a Synchronize had to
// defer (see Synchronize).
func (p *Plugin) SetInjection(cfg injection.Config) {
	cfg.FailOpen = p.opts.FailOpen
	p.auditMu.Lock()
	defer p.auditMu.Unlock()
	p.injection.Store(&cfg)
	if cfg.Backend == nodeapi.BackendUnset || p.deferred == nil {
		return
	}
	a := p.deferred
	p.deferred = nil
	a.logger.Info("Auditing the runtime's containers now that the node's memory-limit backend is known", "backend", cfg.Backend, "containers", len(a.ctrs))
	p.audit(klog.NewContext(context.Background(), a.logger), a.pods, a.ctrs)
}

// Registered reports whether the runtime has accepted the plugin and
// synchronized it (from then on it sees every container creation), for
// the node's readiness.
func (p *Plugin) Registered() bool { return p.registered.Load() }

// Audited reports whether the plugin knows every fractional container
// that runs: registered, and its audit of the runtime's list not waiting
// for a backend. Until then Tenants may miss running ones.
func (p *Plugin) Audited() bool {
	p.auditMu.Lock()
	defer p.auditMu.Unlock()
	return p.registered.Load() && p.deferred == nil
}

// Run registers with the runtime over its NRI socket and serves until ctx
// ends or the runtime goes away.
func (p *Plugin) Run(ctx context.Context, socketPath string) error {
	s, err := stub.New(p, stub.WithPluginName(Name), stub.WithPluginIdx(Index), stub.WithSocketPath(socketPath),
		stub.WithOnClose(func() {
			p.registered.Store(false)
			// The next connection's Synchronize brings a fresh list.
			p.auditMu.Lock()
			p.deferred = nil
			p.auditMu.Unlock()
		}),
		// Fail closed: by default a request the plugin does not answer in
		// time proceeds without it (a fractional container would start
		// with no limits) and the plugin is dropped. With this the request
		// fails and the plugin stays registered.
		stub.WithFailurePolicy(&nriapi.FailurePolicy{FailRequest: true, KeepConnected: true}))
	if err != nil {
		return fmt.Errorf("NRI plugin: %w", err)
	}
	defer p.registered.Store(false)
	return s.Run(ctx)
}

// Serve keeps the plugin connected until ctx ends, reconnecting with
// exponential backoff (from minBackoff to maxBackoff) whenever the runtime
// goes away, as it does when containerd restarts. Each reconnection
// synchronizes, and so audits what runs.
func (p *Plugin) Serve(ctx context.Context, socketPath string, minBackoff, maxBackoff time.Duration) {
	logger := klog.FromContext(ctx)
	backoff := minBackoff
	for ctx.Err() == nil {
		start := time.Now()
		err := p.Run(ctx, socketPath)
		if ctx.Err() != nil {
			return
		}
		if time.Since(start) > time.Minute {
			backoff = minBackoff // it was connected for a while: a fresh failure
		}
		logger.Info("NRI plugin disconnected from the runtime; reconnecting", "socket", socketPath, "err", err, "after", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, maxBackoff)
	}
}

// Configure is called when the runtime accepts the plugin.
func (p *Plugin) Configure(ctx context.Context, _, runtime, version string) (stub.EventMask, error) {
	klog.FromContext(ctx).Info("Registered with the container runtime", "runtime", runtime, "version", version)
	return 0, nil // the stub subscribes to the events this type implements
}

// CreateContainer judges the container once (injection.Judge, what
// `gpufrac explain` prints and the audit applies too), carries out the
// decision's effects before the container starts, and answers the
// runtime: its adjustment, or its refusal. Whatever fails on the way
// refuses the container (or, failing open, starts it without a GPU).
func (p *Plugin) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	defer p.observe("CreateContainer", time.Now())
	cfg := *p.injection.Load()
	d := injection.Judge(p.gather(ctx, pod, ctr, cfg), cfg)
	for _, e := range d.Effects {
		if err := p.carryOut(ctx, pod, ctr, e); err != nil {
			d = d.Failed(e, fmt.Errorf("container %q: %w", ctr.GetName(), err), cfg)
			break
		}
	}
	return p.answer(ctx, pod, ctr, d, cfg)
}

// carryOut does one effect of a container's decision.
func (p *Plugin) carryOut(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, e injection.Effect) error {
	switch e.Kind {
	case injection.EffectMPSNamespace:
		return p.ensureNamespace(ctx, pod, ctr, e)
	case injection.EffectExclusive:
		if p.opts.EnsureExclusive == nil {
			return errors.New("the node keeps its shared GPUs in EXCLUSIVE_PROCESS, and this plugin cannot set a compute mode")
		}
		return p.opts.EnsureExclusive(e.Devices)
	case injection.EffectClaimShares:
		return p.shares.claim(shareUserOf(pod, ctr), e.Shares)
	}
	return fmt.Errorf("no way to carry out %q", e.Kind)
}

// answer records and reports what became of a container at creation, and
// gives the runtime its adjustment or refusal.
func (p *Plugin) answer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, d injection.Decision, cfg injection.Config) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	ref, logger := refOf(pod), klog.FromContext(ctx).WithValues("pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
	if d.Policed != "" {
		logger.Info("The container names GPUs it was not granted; it sees only its grant", "change", d.Policed)
		if p.opts.Reporter != nil {
			p.opts.Reporter.Policed(ref, ctr.GetName(), d.Policed)
		}
	}
	switch d.Verdict {
	case injection.Run:
		if d.Assignment != nil {
			state := StateEnforced
			if cfg.Backend == nodeapi.BackendDriver {
				state = StateInjected // verified after start
			}
			p.tenants.set(ctr.GetId(), tenantOf(pod, d, string(cfg.Backend), state, time.Now()))
			if state == StateEnforced && p.opts.Reporter != nil {
				p.opts.Reporter.Enforced(ref, ctr.GetName(), withNotes(fmt.Sprintf("memory limits injected for the %s backend", cfg.Backend), d.Notes))
			}
		}
		return d.Adjustment, nil, nil
	case injection.FailedOpen:
		logger.Info("Starting the container although its fraction cannot be enforced as written: the node fails open", "reason", d.Reason.Error(), "notes", d.Notes)
		if p.opts.Reporter != nil {
			p.opts.Reporter.FailedOpen(ref, ctr.GetName(), fmt.Errorf("%w; %s", d.Reason, strings.Join(d.Notes, "; ")))
		}
		if d.Assignment != nil {
			p.tenants.set(ctr.GetId(), tenantOf(pod, d, string(cfg.Backend), StateFailOpen, time.Now()))
		}
		return d.Adjustment, nil, nil
	}
	if api.AsksForFraction(pod.GetAnnotations()) {
		d.Reason = fmt.Errorf("its GPU fraction cannot be enforced: %w", d.Reason)
	}
	logger.Info("Refusing the container", "reason", d.Reason.Error())
	if p.opts.Reporter != nil {
		p.opts.Reporter.Refused(ref, ctr.GetName(), d.Reason)
	}
	return nil, nil, fmt.Errorf("gpufrac: pod %s/%s container %q: %w", pod.GetNamespace(), pod.GetName(), ctr.GetName(), d.Reason)
}

func withNotes(detail string, notes []string) string {
	if len(notes) == 0 {
		return detail
	}
	return detail + "; " + strings.Join(notes, "; ")
}

// StopContainer releases the stopped container's soft limit before its
// cgroup goes away, and terminates what is left of its MPS clients in the
// background. The runtime calls it once the container's processes were
// signalled, so this cannot prevent a client killed mid-kernel from
// wedging the shared server; a termination that does not finish is taken
// as that wedge, and the daemon is replaced (see drain). It never fails
// the stop, and is bounded inside NRI's request timeout.
func (p *Plugin) StopContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	defer p.observe("StopContainer", time.Now())
	p.forgetDeferred(ctr.GetId())
	p.shares.release(ctr.GetId())
	tenant, known := p.tenants.get(ctr.GetId())
	p.tenants.remove(ctr.GetId())
	// The soft limit first: it must not stay charged up the cgroup tree.
	p.release(ctx, refOf(pod), ctr.GetId(), ctr.GetName())
	if known && p.opts.MPS != nil {
		p.drain(ctx, pod, ctr, tenant.Namespace)
	}
	return nil, nil
}

// RemoveContainer deletes the removed container's MPS namespace.
func (p *Plugin) RemoveContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	defer p.observe("RemoveContainer", time.Now())
	p.shares.release(ctr.GetId())
	if p.opts.MPS == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, mpsHookBudget)
	defer cancel()
	name := nodeapi.NamespaceName(pod.GetUid(), ctr.GetName())
	if err := p.opts.MPS.Remove(ctx, name, ctr.GetId()); err != nil {
		klog.FromContext(ctx).Error(err, "Cannot delete the removed container's MPS namespace; the next reconciliation retries", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
	}
	return nil
}

// Synchronize audits the containers that run already when the plugin
// (re)connects: any fractional container created without its injection
// (the agent was down, or the plugin was not registered yet) is evicted so
// it comes back enforced. An empty list is taken as it is: nothing is
// wiped or assumed.
func (p *Plugin) Synchronize(ctx context.Context, pods []*nriapi.PodSandbox, ctrs []*nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	p.auditMu.Lock()
	if p.injection.Load().Backend == nodeapi.BackendUnset {
		// The agent has not read the GPUs yet: every fractional container
		// would look unenforceable and be evicted. New containers are
		// refused meanwhile; the running ones are judged once it knows.
		logger := klog.FromContext(ctx)
		logger.Info("Deferring the audit of the runtime's containers until the node's memory-limit backend is known", "containers", len(ctrs))
		p.deferred = &audit{logger: logger, pods: pods, ctrs: ctrs}
		p.auditMu.Unlock()
		p.registered.Store(true)
		return nil, nil
	}
	p.deferred = nil // a reconnection's list supersedes an older one
	// Under the lock: a SetInjection meanwhile must not change the
	// configuration halfway through the list.
	p.audit(ctx, pods, ctrs)
	p.auditMu.Unlock()
	p.registered.Store(true)
	return nil, nil
}

// forgetDeferred drops a container that stopped from a deferred audit's
// list, which would otherwise judge it as still running.
func (p *Plugin) forgetDeferred(id string) {
	p.auditMu.Lock()
	defer p.auditMu.Unlock()
	if p.deferred == nil {
		return
	}
	p.deferred.ctrs = slices.DeleteFunc(slices.Clone(p.deferred.ctrs), func(c *nriapi.Container) bool { return c.GetId() == id })
}

// audit judges every running container of the runtime against what
// CreateContainer would have made of it now: one whose fraction is not in
// force is evicted, and leases of containers that are gone are released.
func (p *Plugin) audit(ctx context.Context, pods []*nriapi.PodSandbox, ctrs []*nriapi.Container) {
	logger := klog.FromContext(ctx)
	byID := make(map[string]*nriapi.PodSandbox, len(pods))
	for _, pod := range pods {
		byID[pod.GetId()] = pod
	}
	evicted := map[string]bool{}
	live := map[string]bool{}
	cfg := *p.injection.Load()
	for _, ctr := range ctrs {
		pod := byID[ctr.GetPodSandboxId()]
		if pod == nil || evicted[pod.GetId()] || ctr.GetState() != nriapi.ContainerState_CONTAINER_RUNNING {
			continue
		}
		live[ctr.GetId()] = true
		d, r, reason := p.judgeRunning(ctx, pod, ctr, cfg)
		if reason == "" {
			// A restarted agent learns who consumes each share (a second
			// consumer found running was judged above).
			reason = p.claimShares(pod, ctr, d)
		}
		if d.Assignment != nil {
			p.tenants.set(ctr.GetId(), runningTenant(pod, ctr, d, r, string(cfg.Backend), reason))
		}
		if reason == "" {
			continue
		}
		logger.Info("Evicting a pod whose GPU fraction is not enforced", "pod", pod.GetNamespace()+"/"+pod.GetName(),
			"container", ctr.GetName(), "reason", reason)
		evicted[pod.GetId()] = true
		p.evict(ctx, refOf(pod), ctr.GetName(), reason)
	}
	if len(ctrs) > 0 {
		p.tenants.retain(live)
	}
	p.releaseVanished(ctx, byID, ctrs)
}
