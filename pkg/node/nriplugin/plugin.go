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
	// EnsureExclusive, when set, puts a fractional container's GPUs in
	// EXCLUSIVE_PROCESS before it starts (the resync does it too, but a
	// container may come first); its error refuses the container.
	EnsureExclusive func(uuids []string) error
	// Grants, when set, tells which GPUs a container outside any gpufrac
	// share was granted (the device plugin's allocation, its DRA shares,
	// from cdiDevices as the kubelet named them): every such container
	// is made to see exactly those (injection.Police). Its error refuses
	// a container that names GPUs: what it may see is unknown.
	Grants func(ctx context.Context, pod PodRef, container string, cdiDevices []string) ([]string, error)
	// VisibilityExempt are namespaces whose containers outside any share
	// keep the GPUs they name: the node's GPU software, which must see
	// every GPU (NVIDIA's device plugin, DCGM, GPU Feature Discovery, and
	// gpufrac's own agent and MPS daemon, whose pod the agent would
	// otherwise evict, and itself with it, as long as it runs). Only
	// admins create pods there.
	VisibilityExempt []string
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

// CreateContainer injects the container's GPU share, or refuses it, as
// injection.Decide says (the function `gpufrac explain` prints): plan,
// then create the container's MPS namespace, then record it. Whatever
// fails on the way refuses the container (or, failing open, starts it
// without a GPU) through the one path at the end.
func (p *Plugin) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	defer p.observe("CreateContainer", time.Now())
	cfg := *p.injection.Load()
	current, _ := p.podOf(pod)
	d := injection.Decide(current, ctr.GetName(), ctr.GetEnv(), cfg)
	if d.MPSNamespace != "" {
		if err := p.ensureNamespace(ctx, pod, ctr, d); err != nil {
			// Started without its namespace, its compute ceiling would be
			// missing: refused, or on a fail-open node no GPU.
			d = injection.Unenforceable(cfg, err)
		}
	}
	if d.Verdict == injection.Run && (d.Assignment != nil || usesShare(ctr)) {
		if err := injection.CheckMPSClientUser(uidOf(ctr), hasUserNamespace(ctr), cfg); err != nil {
			d = injection.Unenforceable(cfg, fmt.Errorf("container %q: %w", ctr.GetName(), err))
		}
	}
	if d.Verdict == injection.Run && usesShare(ctr) {
		if err := p.shares.claim(pod, ctr); err != nil {
			d = injection.Decision{Verdict: injection.Refuse, Reason: fmt.Errorf("container %q: %w", ctr.GetName(), err)}
		}
	}
	if d.Verdict == injection.Run && d.Assignment != nil && p.opts.EnsureExclusive != nil {
		if err := p.opts.EnsureExclusive(d.Assignment.Devices); err != nil {
			// In another mode, a process of any container could take
			// the GPU's memory outside MPS: refused, or no GPU.
			d = injection.Unenforceable(cfg, err)
		}
	}
	ref, logger := refOf(pod), klog.FromContext(ctx).WithValues("pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
	if d.Verdict == injection.Run && d.Assignment == nil && d.Adjustment == nil {
		adj, note, err := p.police(ctx, ref, ctr)
		if err != nil {
			d = injection.Decision{Verdict: injection.Refuse, Reason: err}
		} else if adj != nil {
			logger.Info("The container names GPUs it was not granted; it sees only its grant", "change", note)
			if p.opts.Reporter != nil {
				p.opts.Reporter.Policed(ref, ctr.GetName(), note)
			}
			d.Adjustment = adj
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

// claim records ctr as the consumer of its shares, or says which running
// container consumes one already.
func (s *shareUsers) claim(pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]shareUser{}
	}
	me := shareUser{id: ctr.GetId(), podUID: pod.GetUid(), pod: pod.GetNamespace() + "/" + pod.GetName(), container: ctr.GetName()}
	var names []string
	for _, d := range ctr.GetCDIDevices() {
		if !strings.HasPrefix(d.GetName(), api.DRADriver+"/share=") {
			continue
		}
		if u, ok := s.m[d.GetName()]; ok && u.id != me.id && (u.podUID != me.podUID || u.container != me.container) {
			return fmt.Errorf("its gpufrac share %s is consumed already by container %q of pod %s, and a share is enforced on one container at a time (its limits would apply twice): give each container a claim of its own", d.GetName(), u.container, u.pod)
		}
		names = append(names, d.GetName())
	}
	for _, n := range names {
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

// usesShare says whether the kubelet handed the container a gpufrac DRA
// share: its CDI edits make it an MPS client as an annotated fraction is.
func usesShare(ctr *nriapi.Container) bool {
	for _, d := range ctr.GetCDIDevices() {
		if strings.HasPrefix(d.GetName(), api.DRADriver+"/share=") {
			return true
		}
	}
	return false
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

func hasUserNamespace(ctr *nriapi.Container) bool {
	for _, ns := range ctr.GetLinux().GetNamespaces() {
		if ns.GetType() == "user" {
			return true
		}
	}
	return false
}

// police is injection.Police for a container outside any gpufrac share:
// nil when it names no GPU beyond its grant. The grant is read only for a
// container that names GPUs at all (most name none).
func (p *Plugin) police(ctx context.Context, pod PodRef, ctr *nriapi.Container) (*nriapi.ContainerAdjustment, string, error) {
	if p.opts.Grants == nil || slices.Contains(p.opts.VisibilityExempt, pod.Namespace) {
		return nil, "", nil
	}
	if adj, _, err := injection.Police(ctr.GetEnv(), ctr.GetMounts(), nil); adj == nil && err == nil {
		return nil, "", nil
	}
	var cdi []string
	for _, d := range ctr.GetCDIDevices() {
		cdi = append(cdi, d.GetName())
	}
	granted, err := p.opts.Grants(ctx, pod, ctr.GetName(), cdi)
	if err != nil {
		return nil, "", fmt.Errorf("the container names GPUs (%s=%q) and %w: %w",
			nodeapi.EnvVisibleDevices, envValue(ctr.GetEnv(), nodeapi.EnvVisibleDevices), errGrantUnknown, err)
	}
	return injection.Police(ctr.GetEnv(), ctr.GetMounts(), granted)
}

// errGrantUnknown is police's error when what a container was granted
// cannot be read (not what it names).
var errGrantUnknown = errors.New("which ones it was granted cannot be read")

func withNotes(detail string, notes []string) string {
	if len(notes) == 0 {
		return detail
	}
	return detail + "; " + strings.Join(notes, "; ")
}

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
		if _, reason := p.judge(ctx, pod, ctr); reason != "" {
			klog.FromContext(ctx).Info("Stopping a container that started without what the node injects", "pod", pod.GetNamespace()+"/"+pod.GetName(),
				"container", ctr.GetName(), "reason", reason)
			p.evict(ctx, refOf(pod), ctr.GetName(), reason)
		}
		return nil
	}
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
	return injection.Pod{UID: pod.GetUid(), Annotations: annotations}, resized
}

// ensureNamespace creates an sm-sharing container's MPS namespace, with
// its thread ceiling, before the container's first client can attach.
func (p *Plugin) ensureNamespace(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, d injection.Decision) error {
	container := d.Assignment.Container
	if p.opts.MPS == nil {
		return fmt.Errorf("container %q: sm-sharing needs MPS namespaces, and this node agent keeps none", container)
	}
	ctx, cancel := context.WithTimeout(ctx, mpsHookBudget)
	defer cancel()
	ns := mps.Namespace{Name: d.MPSNamespace, Threads: d.Assignment.ActiveThreadPercentage(),
		Pod: pod.GetNamespace() + "/" + pod.GetName(), PodUID: pod.GetUid(), Container: container, ContainerID: ctr.GetId()}
	if err := p.opts.MPS.Ensure(ctx, ns); err != nil {
		return fmt.Errorf("container %q: %w", container, err)
	}
	return nil
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

// RetryEvictions evicts, off any NRI request, the pods that must not keep
// running and are not yet on their way out: those whose containers run
// unenforced (a failed eviction is retried here), and, mpsStarted being
// when the node's MPS daemon started, those whose containers were created
// before it. Those containers' mounts name an older daemon's sockets and
// directories, so a CUDA process they start next would not reach MPS at
// all: no memacct, no ceiling, no pinned limit. Their pods are told why,
// and come back on the new daemon. A container whose creation time the
// runtime did not give is not taken as stale.
func (p *Plugin) RetryEvictions(ctx context.Context, mpsStarted time.Time) {
	for id, t := range p.tenants.ids() {
		if t.evicted {
			continue
		}
		stale := !mpsStarted.IsZero() && !t.started.IsZero() && t.started.Before(mpsStarted)
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

// decide is injection.Decide for a container the runtime reports.
func (p *Plugin) decide(pod *nriapi.PodSandbox, ctr *nriapi.Container) (injection.Decision, bool) {
	current, resized := p.podOf(pod)
	return injection.Decide(current, ctr.GetName(), ctr.GetEnv(), *p.injection.Load()), resized
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
	backend := string(p.injection.Load().Backend)
	for _, ctr := range ctrs {
		pod := byID[ctr.GetPodSandboxId()]
		if pod == nil || evicted[pod.GetId()] || ctr.GetState() != nriapi.ContainerState_CONTAINER_RUNNING {
			continue
		}
		live[ctr.GetId()] = true
		d, reason := p.judge(ctx, pod, ctr)
		if reason == "" && usesShare(ctr) {
			// A restarted agent learns who consumes each share; a second
			// consumer found running goes.
			if err := p.shares.claim(pod, ctr); err != nil {
				reason = "running as a second consumer of a share: " + err.Error()
			}
		}
		if d.Assignment != nil {
			var created time.Time
			if ns := ctr.GetCreatedAt(); ns > 0 {
				created = time.Unix(0, ns)
			}
			t := tenantOf(pod, d, backend, StateEnforced, created)
			if reason == "" {
				reason = p.heldTo(ctx, &t, pod, ctr)
			}
			if reason != "" {
				t.State = StateUnenforced
			}
			p.tenants.set(ctr.GetId(), t)
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

// heldTo learns, on the driver backend, a running container's cgroup (a
// resize changes its limits there) and, for a resized pod, what the driver
// holds it to, which may be the memory of before the resize (not applied
// yet, or refused) or after: t's memory becomes that. A resized pod's
// container the driver holds to nothing is unenforced: the reason says so.
func (p *Plugin) heldTo(ctx context.Context, t *Tenant, pod *nriapi.PodSandbox, ctr *nriapi.Container) string {
	if t.Backend != string(nodeapi.BackendDriver) || p.opts.NVML == nil || ctr.GetPid() <= 0 {
		return ""
	}
	cgroup, err := enforce.CgroupOf(p.opts.ProcRoot, int(ctr.GetPid()))
	if err != nil {
		return ""
	}
	t.cgroup = cgroup
	if _, resized := p.podOf(pod); !resized {
		return ""
	}
	held, err := enforce.Held(p.opts.NVML, cgroup, t.Devices)
	if errors.Is(err, enforce.ErrLimitsDiffer) {
		return "a resized container's GPU memory limits are not in force: " + err.Error()
	}
	if err != nil {
		// A read that failed says nothing of the limits: the container
		// keeps the memory it was created with on record, and the resize
		// loop reads them again when it acts.
		klog.FromContext(ctx).Error(err, "Cannot read a resized container's GPU memory limits back", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
		return ""
	}
	t.RequestMiB, t.LimitMiB = int64(held.RequestMiB), int64(held.LimitMiB)
	t.assignment.RequestMiB, t.assignment.LimitMiB = t.RequestMiB, t.LimitMiB
	return ""
}

// judge is what CreateContainer would have made of a container that runs
// already (its decision now), and why it must not run as it does ("" when
// it may): its fraction not in force, or GPUs it was not granted. A grant
// that cannot be read now is judged later, not guessed.
func (p *Plugin) judge(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (injection.Decision, string) {
	d, resized := p.decide(pod, ctr)
	// Only the driver backend's limits can be read back in place of the
	// environment's memory (heldTo); a resize is refused elsewhere.
	reason := missingEnforcement(d, ctr, resized && p.injection.Load().Backend == nodeapi.BackendDriver)
	if d.Verdict == injection.Run && d.Assignment == nil && d.Adjustment == nil {
		adj, note, err := p.police(ctx, refOf(pod), ctr)
		switch {
		case errors.Is(err, errGrantUnknown):
			klog.FromContext(ctx).Error(err, "Cannot check a running container's GPUs against its grant", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
		case err != nil:
			reason = "running with GPUs it was not granted: " + err.Error()
		case adj != nil:
			reason = "running with GPUs it was not granted: " + note
		}
	}
	return d, reason
}

// missingEnforcement compares a running container's environment with what
// CreateContainer would have injected (d); "" means it is enforced (or needs
// nothing, or failed open as the node allows).
//
// A resized pod's container may have been created before the resize, with
// the memory of then in its environment (a process's environment does not
// change): its memory is not judged by its environment, but by what the
// driver holds it to (audit).
func missingEnforcement(d injection.Decision, ctr *nriapi.Container, resized bool) string {
	if d.Verdict == injection.Refuse {
		return "running although its GPU fraction cannot be enforced: " + d.Reason.Error()
	}
	if d.Adjustment == nil {
		return ""
	}
	// The container's environment must already be what the injection
	// would make it, for the variables that carry the limits.
	want := injection.ApplyEnv(ctr.GetEnv(), d.Adjustment)
	for _, key := range []string{nodeapi.EnvVisibleDevices, nodeapi.EnvMemoryRequest, nodeapi.EnvMemoryLimit, nodeapi.EnvMPSThreads, nodeapi.EnvMPSPipeDirectory} {
		if resized && (key == nodeapi.EnvMemoryRequest || key == nodeapi.EnvMemoryLimit) {
			continue
		}
		if got := envValue(ctr.GetEnv(), key); got != want[key] {
			return fmt.Sprintf("%s is %q, want %q", key, got, want[key])
		}
	}
	return ""
}

func envValue(env []string, key string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v
		}
	}
	return ""
}
