// Package agent runs the node agent: it reads the node's GPUs, keeps the
// node's GPU-fraction readiness and labels current, tells reservation pods
// which GPU they hold, and serves the NRI plugin that injects each
// fractional container's limits.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/internal/health"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/dra"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/exclusive"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/metrics"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/publish"
	"github.com/gpufrac/gpufrac/pkg/node/reservation"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

// Options configure the agent.
type Options struct {
	NodeName string
	// GPUMemoryReserveMiBByModel overrides Injection.GPUMemoryReserveMiB
	// for the node's GPU model (its nvidia.com/gpu.product label). The
	// reserve in effect is published on the node for every other reader
	// (api.LabelGPUMemoryReserve): this is the one place it is set.
	GPUMemoryReserveMiBByModel map[string]int64
	// SimulateGPUs names a go-nvml mock machine to use instead of the real
	// NVML library; the agent then also plays the kubelet's device plugin
	// for reservation pods and hosts an in-process NRI runtime endpoint,
	// since no kubelet or container runtime runs on a simulated node.
	SimulateGPUs string
	// NRISocket is the container runtime's NRI socket.
	NRISocket string
	// PodResourcesSocket is the kubelet's PodResources socket.
	PodResourcesSocket string
	// ReservationNamespace holds the reservation pods.
	ReservationNamespace string
	// ForeignReservationNamespaces hold another scheduler's reservation
	// pods (KAI's kai-resource-reservation): a share's GPU held by one of
	// them is held; held by any other pod (a whole-GPU workload), it is not.
	ForeignReservationNamespaces []string
	// StateDir holds the agent's sockets and state (the GPU memory leases).
	StateDir string
	// ProcRoot is where the host's /proc is, to find containers' cgroups.
	ProcRoot string
	// MPSControl is the MPS control program the agent runs to manage the
	// namespaces of the node's MPS daemon (which `gpufrac mps-daemon`
	// supervises).
	MPSControl string
	// CgroupRoot is the host's cgroup file system, to check that the
	// driver's per-cgroup limits can work.
	CgroupRoot       string
	FailOpen         bool
	PublishGPULabels bool
	// MemoryLimits is --memory-limits: auto or one of nodeapi.Backends.
	MemoryLimits string
	// Injection is the node's injection configuration; its Backend is
	// chosen by the agent from MemoryLimits and the driver. Its
	// ExclusiveProcess keeps the GPUs the node shares through MPS in
	// EXCLUSIVE_PROCESS (package exclusive), so that no process outside MPS
	// gets a context on them; its RestrictVisibility makes every container
	// of the node see only the GPUs granted to it.
	Injection    injection.Config
	HealthAddr   string
	ResyncPeriod time.Duration
	// UsageWindow is how far back the agent remembers its tenants' use
	// (a reading per resync), for the percentiles it publishes.
	UsageWindow time.Duration
	// UsagePublishPeriod is how often, at most, the Node's usage
	// annotation is rewritten: every write goes to every Node watcher, and
	// the heartbeat already writes the Node each resync.
	UsagePublishPeriod time.Duration
	// StopGrace is how long a stopping agent, its node already marked not
	// ready, keeps serving the runtime: the containers of pods placed just
	// before are still being created, and without the agent they would
	// start unadjusted (and be stopped by the next agent). 0: none.
	StopGrace time.Duration
	// SecurityStopGrace is the most grace the agent's deletions of a pod
	// give it (a container unenforced, a root MPS client, a share no
	// reservation holds), and at least 1s: the pod's own
	// terminationGracePeriodSeconds and preStop hooks are its tenant's,
	// and would otherwise decide how long an unenforced container keeps
	// running. Past it, and killMargin, a fractional container still
	// running unenforced (or on a replaced MPS daemon) is killed on the
	// node (its cgroup's processes).
	SecurityStopGrace time.Duration
	// BurstReclaim is the policy for a GPU short of memory while tenants
	// use more than their request (BurstReclaimPriority, or
	// BurstReclaimOff); BurstReclaimBelowPercent is the free memory, in
	// percent of the GPU's, below which it acts (reclaim.go).
	BurstReclaim             string
	BurstReclaimBelowPercent int
	// MetricsAddr serves /metrics over TLS to the callers MetricsAuth lets
	// through; "" serves no metrics.
	MetricsAddr string
	MetricsAuth health.Authorizer
	// DRA configures the second front door.
	DRA DRAOptions
}

// DRAOptions configure the node's DRA driver (pkg/node/dra).
type DRAOptions struct {
	Enabled bool
	// StandingGPUs is how many GPUs the node asks to have held for shares
	// (api.LabelStandingGPUs); -1 for all. Only those are offered claims.
	StandingGPUs int
	// PluginDir, RegistrarDir: the kubelet plugin's directories. When
	// empty: the kubelet's (DefaultDRAPluginDir, DefaultDRARegistrarDir),
	// or, on a simulated node, under StateDir.
	PluginDir, RegistrarDir string
	// CDIDir is where prepared claims' CDI specs go; when empty,
	// DefaultCDIDir, or under StateDir on a simulated node.
	CDIDir string
}

// Agent is one node's agent.
type Agent struct {
	opts   Options
	client kubernetes.Interface
	// env is the node the agent runs on, real or simulated (environment.go).
	env       environment
	boot      string // the host's boot ID, recorded with each lease
	annotator *reservation.Annotator
	plugin    *nriplugin.Plugin // set by Run, under mu: Ready may read it before
	recorder  record.EventRecorder
	metrics   *metrics.Metrics
	leases    *enforce.Leases // nil when its file cannot be read (stateErr)
	mps       *mps.Manager    // nil without an MPS root, or when its file cannot be read
	// stateErr says which of the agent's state files cannot be read, and
	// what to do: the node then takes no fractions.
	stateErr error
	// exclusive keeps the shared GPUs' compute mode; nil when
	// Injection.ExclusiveProcess is off.
	exclusive *exclusive.Keeper

	driver *dra.Driver
	// unheldSeen counts, by pod UID/container, the resyncs in a row that
	// found a tenant on a GPU no pod holds (stopTenantsOnUnheldGPUs).
	unheldSeen map[string]int
	draHelper  *kubeletplugin.Helper

	mu        sync.Mutex
	published bool // the last publish reached the API server
	// draInv and draCfg are the GPUs and injection as last read, for the
	// DRA driver (it enforces exactly as the NRI plugin does).
	draInv inventory.Inventory
	draCfg injection.Config
	// lastStanding is the standing GPU count last published.
	lastStanding int
	// pods is the watch of the node's pods (resize.go); until it has
	// listed them, the node creates no fractional container and audits
	// none (enforce): a resized pod's memory of now is not known yet.
	pods *podWatch
	// usage remembers what the tenants used over Options.UsageWindow
	// (usage.go); only resync touches it.
	usage *usage.Window
	// usagePublished is when the usage annotation was last handed to
	// publish (resync only).
	usagePublished time.Time
	// reclaiming are the pods burst reclaim deleted, by UID, until they
	// are gone from the readings (resync only).
	reclaiming map[string]time.Time
	// mpsStarted is when the node's MPS daemon started, as last seen:
	// containers created before it are evicted (see RetryEvictions).
	mpsStarted time.Time
}

// DefaultOptions are the node agent's defaults, written once: its flags
// start from them, and New fills in, from them, what a caller left unset
// of ProcRoot, MPSControl, CgroupRoot and MemoryLimits.
func DefaultOptions() Options {
	return Options{
		NRISocket:                    "/var/run/nri/nri.sock",
		PodResourcesSocket:           reservation.DefaultSocket,
		ReservationNamespace:         api.DefaultReservationNamespace,
		ForeignReservationNamespaces: []string{"kai-resource-reservation"},
		StateDir:                     "/var/lib/gpufrac",
		ProcRoot:                     "/proc",
		MPSControl:                   mps.DefaultBinary,
		CgroupRoot:                   "/sys/fs/cgroup",
		MemoryLimits:                 "auto",
		Injection: injection.Config{HookPath: "/opt/gpufrac/bin/gpufrac", MPSRoot: "/run/gpufrac/mps",
			RestrictVisibility: true, ExclusiveProcess: true},
		HealthAddr:         ":8082",
		MetricsAddr:        ":8443",
		ResyncPeriod:       30 * time.Second,
		UsageWindow:        time.Hour,
		UsagePublishPeriod: time.Minute,

		BurstReclaim:             BurstReclaimPriority,
		BurstReclaimBelowPercent: api.DefaultReclaimBelowPercent,
		StopGrace:                5 * time.Second,
		SecurityStopGrace:        10 * time.Second,
		DRA:                      DRAOptions{StandingGPUs: -1},
	}
}

// New builds an agent for opts over client.
func New(opts Options, client kubernetes.Interface) *Agent {
	d := DefaultOptions()
	opts.MemoryLimits = cmp.Or(opts.MemoryLimits, d.MemoryLimits)
	opts.ProcRoot = cmp.Or(opts.ProcRoot, d.ProcRoot)
	opts.MPSControl = cmp.Or(opts.MPSControl, d.MPSControl)
	opts.CgroupRoot = cmp.Or(opts.CgroupRoot, d.CgroupRoot)
	opts.UsageWindow = cmp.Or(opts.UsageWindow, d.UsageWindow)
	opts.UsagePublishPeriod = cmp.Or(opts.UsagePublishPeriod, d.UsagePublishPeriod)
	opts.BurstReclaim = cmp.Or(opts.BurstReclaim, d.BurstReclaim)
	opts.BurstReclaimBelowPercent = cmp.Or(opts.BurstReclaimBelowPercent, d.BurstReclaimBelowPercent)
	return &Agent{opts: opts, client: client, metrics: metrics.New(), usage: usage.NewWindow(opts.UsageWindow), reclaiming: map[string]time.Time{}}
}

// Run works until ctx ends, then marks the node not ready for fractions
// (nothing injects limits while the agent is away), serves the runtime
// StopGrace more, and returns.
func (a *Agent) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("node", a.opts.NodeName)
	// Everything the agent serves (the runtime, the kubelet's DRA plugin
	// registration, Events, the pods' watch) outlives the stop request by
	// StopGrace (see the loop below).
	stopRequested := ctx.Done()
	ctx, stopServing := context.WithCancel(klog.NewContext(context.WithoutCancel(ctx), logger))
	defer stopServing()
	if err := os.MkdirAll(a.opts.StateDir, 0o750); err != nil {
		return fmt.Errorf("state directory %s: %w", a.opts.StateDir, err)
	}
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: a.client.CoreV1().Events("")})
	defer broadcaster.Shutdown()
	a.recorder = broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "gpufrac-node-agent", Host: a.opts.NodeName})

	env, err := newEnvironment(ctx, a.opts)
	if err != nil {
		return err
	}
	defer env.stop()
	a.env = env
	a.annotator = &reservation.Annotator{Client: a.client, Node: a.opts.NodeName, Namespace: a.opts.ReservationNamespace, Source: env.devices()}
	if err := a.openState(ctx); err != nil {
		return err
	}
	// The node's pods, listed before the NRI plugin's first audit (see
	// enforce): a resized pod's containers are judged by its memory now.
	pods := a.watchPods(ctx)
	a.startPlugin(pods)
	if a.opts.DRA.Enabled {
		stop, err := a.startDRA(ctx)
		if err != nil {
			return err
		}
		defer stop()
	}
	wg := a.serve(ctx, pods)
	a.markStarting(logger)
	ticker := time.NewTicker(a.opts.ResyncPeriod)
	defer ticker.Stop()
	for {
		a.resync(ctx)
		select {
		case <-stopRequested:
			a.markStopped(logger)
			// Schedulers place nothing more here; pods placed just before
			// are having their containers created, through this agent
			// while it still serves.
			time.Sleep(a.opts.StopGrace)
			stopServing()
			wg.Wait()
			a.plugin.WaitForEvictions()
			return nil
		case <-ticker.C:
		}
	}
}

// openState reads the agent's state files: the GPU memory leases, the MPS
// namespaces a previous agent created, the compute modes it changed. A
// state file that cannot be read is not a crash loop: the agent keeps
// running, refuses fractions (it cannot release or account for what the
// file records) and says why through the node's readiness, until an admin
// has looked at the file and restarted it.
func (a *Agent) openState(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	leases, err := enforce.OpenLeases(filepath.Join(a.opts.StateDir, "leases.json"))
	if err != nil {
		logger.Error(err, "Cannot read the agent's state; the node takes no fractions until it is fixed")
		a.stateErr = errors.Join(a.stateErr, err)
	}
	a.leases = leases
	a.boot = enforce.BootID(a.opts.ProcRoot)
	if leases != nil {
		// What a reboot or a removed cgroup cleared is not released again.
		dropped, err := leases.Prune(a.boot, func(cgroup string) bool {
			_, err := os.Stat(cgroup)
			return !errors.Is(err, os.ErrNotExist)
		})
		if err != nil {
			logger.Error(err, "Cannot rewrite the GPU memory leases after dropping those a reboot or a removed cgroup cleared")
		}
		if len(dropped) > 0 {
			logger.Info("Dropped GPU memory leases whose limits are already gone (taken before the last boot, or their cgroup is removed)", "containers", dropped)
		}
	}
	// The namespaces a previous agent created stay claimed (its table is
	// read back); those of containers that are gone are deleted by the
	// first resync after the plugin's synchronization.
	if a.opts.Injection.MPSRoot != "" {
		if err := nodeapi.CheckRoot(a.opts.Injection.MPSRoot); err != nil {
			return err
		}
		control := mps.Control{Binary: a.opts.MPSControl, Root: a.opts.Injection.MPSRoot, Timeout: 10 * time.Second}
		m, err := mps.OpenManager(control, filepath.Join(a.opts.StateDir, "mps-namespaces.json"))
		if err != nil {
			logger.Error(err, "Cannot read the agent's state; the node takes no fractions until it is fixed")
			a.stateErr = errors.Join(a.stateErr, err)
		}
		a.mps = m
	}
	if a.opts.Injection.ExclusiveProcess {
		a.exclusive = exclusive.Open(a.env.gpus(), filepath.Join(a.opts.StateDir, exclusive.StateFile))
	}
	return nil
}

// startPlugin makes the NRI plugin. Until the first resync says which
// backend the driver allows, the backend is unset and fractional
// containers are refused.
func (a *Agent) startPlugin(pods *podWatch) {
	var ensureExclusive func([]string) error
	if a.exclusive != nil {
		ensureExclusive = a.exclusive.Ensure
	}
	plugin := nriplugin.New(nriplugin.Options{Injection: a.opts.Injection, Resized: pods.resized, MayEscalate: pods.mayEscalate,
		KillAfter: a.opts.SecurityStopGrace + killMargin, FailOpen: a.opts.FailOpen, Reporter: a, Evictor: a,
		NVML: a.env.gpus(), ProcRoot: a.opts.ProcRoot, Leases: a.leases, BootID: a.boot, MPS: a.mps, ObserveHook: a.metrics.ObserveHook,
		EnsureExclusive: ensureExclusive, Grants: a.grants})
	a.mu.Lock() // Ready may be asked from another goroutine at any time
	a.pods, a.plugin = pods, plugin
	a.mu.Unlock()
}

// serve runs the agent's servers until ctx ends: the NRI plugin, the
// health and metrics endpoints, and the resizes of the node's pods.
func (a *Agent) serve(ctx context.Context, pods *podWatch) *sync.WaitGroup {
	logger := klog.FromContext(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { a.plugin.Serve(ctx, a.env.nriSocket(), time.Second, 30*time.Second) })
	if a.opts.HealthAddr != "" {
		wg.Go(func() {
			if err := health.Serve(ctx, a.opts.HealthAddr, a.Ready, nil); err != nil {
				logger.Error(err, "Health endpoint failed")
			}
		})
	}
	if a.opts.MetricsAddr != "" {
		wg.Go(func() {
			handler := promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{})
			if err := health.ServeMetrics(ctx, a.opts.MetricsAddr, handler, a.opts.MetricsAuth); err != nil {
				logger.Error(err, "Metrics endpoint failed")
			}
		})
	}
	wg.Go(func() { a.runResizes(ctx, pods) })
	return &wg
}

// grants is what a container outside any gpufrac share was granted of
// the node's GPUs: what the device plugin allocated to it (the kubelet's
// PodResources) and the GPUs of the DRA shares among its CDI devices.
func (a *Agent) grants(ctx context.Context, pod nriplugin.PodRef, container string, cdiDevices []string) ([]string, error) {
	ids, err := a.env.containerDevices(ctx, pod.Namespace, pod.Name, container)
	if err != nil {
		return nil, err
	}
	if a.driver == nil {
		return ids, nil
	}
	shares, err := a.driver.Granted(cdiDevices)
	if err != nil {
		return nil, err
	}
	return append(ids, shares...), nil
}

// standingGPUs is how many GPUs the node asks to have held for shares.
// While the GPUs cannot be read it keeps asking for what it asked last:
// lowering the count would let the scheduler delete standing pods under
// the claims they hold, and hand their GPUs to the device plugin.
func (a *Agent) standingGPUs(inv inventory.Inventory, invErr error) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case !a.opts.DRA.Enabled:
		return 0
	case invErr != nil:
		return a.lastStanding
	}
	n := len(inv.GPUs)
	if s := a.opts.DRA.StandingGPUs; s >= 0 && s < n {
		n = s
	}
	a.lastStanding = n
	return n
}

// startDRA starts the DRA driver's kubelet plugin. Its devices are
// published by each resync, once the standing reservation pods say which
// GPUs are held for shares.
func (a *Agent) startDRA(ctx context.Context) (func(), error) {
	o := a.opts.DRA
	pluginDir, registrarDir, cdiDir := a.env.draDirs()
	o.PluginDir = cmp.Or(o.PluginDir, pluginDir)
	o.RegistrarDir = cmp.Or(o.RegistrarDir, registrarDir)
	o.CDIDir = cmp.Or(o.CDIDir, cdiDir)
	for _, dir := range []string{o.PluginDir, o.RegistrarDir, o.CDIDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, fmt.Errorf("DRA driver directory %s: %w", dir, err)
		}
	}
	a.driver = &dra.Driver{NodeName: a.opts.NodeName, CDIDir: o.CDIDir, MPS: a.mps, NoContainers: a.env.offersUnenforceable(), Node: func() (inventory.Inventory, injection.Config) {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.draInv, a.draCfg
	}}
	h, err := dra.Serve(ctx, a.driver, a.client, o.PluginDir, o.RegistrarDir, 0, nil)
	if err != nil {
		return nil, err
	}
	a.draHelper = h
	return h.Stop, nil
}

// markStopped tells schedulers to stop sending fractions here: with the
// agent gone, nothing injects their limits.
func (a *Agent) markStopped(logger klog.Logger) {
	if err := a.markNotReady(publish.ReasonStopped, "the gpufrac node agent is not running, so GPU-fraction limits cannot be injected"); err != nil {
		logger.Error(err, "Cannot mark the node not ready on shutdown")
	}
}

// markStarting says, before the first resync, that the agent has not yet
// checked the node. Besides being true, it makes the first resync's Ready
// a change of status: kube-scheduler retries pending pods on a node
// condition's status change, never on a heartbeat alone, so pods refused
// while the agent was silent would otherwise wait for its periodic flush.
func (a *Agent) markStarting(logger klog.Logger) {
	if err := a.markNotReady(publish.ReasonStarting, "the gpufrac node agent has just started and has not yet checked the node"); err != nil {
		logger.Error(err, "Cannot mark the node not ready while starting")
	}
}

func (a *Agent) markNotReady(reason, message string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d := publish.Desired{Condition: corev1.NodeCondition{Type: publish.ConditionReady, Status: corev1.ConditionFalse, Reason: reason, Message: message}}
	node, err := a.client.CoreV1().Nodes().Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if err == nil {
		err = publish.Apply(ctx, a.client, node, d)
	}
	return err
}

func (a *Agent) setPublished(ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.published = ok
}

// Ready reports nil once the plugin is registered and the node's state
// reached the API server, and otherwise why not.
func (a *Agent) Ready() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.plugin == nil:
		return errors.New("the agent has not started yet")
	case !a.plugin.Registered():
		return errors.New("NRI plugin not registered with the container runtime")
	case !a.published:
		return errors.New("node state not published to the API server")
	}
	return nil
}

func podRef(p nriplugin.PodRef) *corev1.ObjectReference {
	return &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: p.Namespace, Name: p.Name, UID: types.UID(p.UID)}
}

// Refused records an Event on the pod.
func (a *Agent) Refused(pod nriplugin.PodRef, container string, err error) {
	a.metrics.Count(metrics.EventRefused)
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUFractionRefused",
		"container %s not started: %v", container, err)
}

// Policed records an Event on the pod.
func (a *Agent) Policed(pod nriplugin.PodRef, container, detail string) {
	a.metrics.Count(metrics.EventPoliced)
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUAccessRestricted",
		"container %s sees only the GPUs granted to it: %s", container, detail)
}

// FailedOpen records an Event on the pod.
func (a *Agent) FailedOpen(pod nriplugin.PodRef, container string, err error) {
	a.metrics.Count(metrics.EventFailedOpen)
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUFractionFailedOpen",
		"container %s started WITHOUT a GPU (node fails open): its GPU fraction cannot be enforced: %v", container, err)
}

// Evicted records an Event on the pod.
func (a *Agent) Evicted(pod nriplugin.PodRef, container, reason string) {
	a.metrics.Count(metrics.EventEvicted)
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUFractionNotEnforced",
		"deleted, whatever its disruption budgets say: container %s runs without its GPU enforcement (%s)", container, reason)
}

// Enforced records a Normal Event on the pod: its limits are in force.
func (a *Agent) Enforced(pod nriplugin.PodRef, container, detail string) {
	a.recorder.Eventf(podRef(pod), corev1.EventTypeNormal, "GPUFractionEnforced", "container %s: %s", container, detail)
}

// Unenforced records a Warning Event on the pod.
func (a *Agent) Unenforced(pod nriplugin.PodRef, container, reason string) {
	a.metrics.Count(metrics.EventUnenforced)
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUFractionNotEnforced",
		"container %s runs WITHOUT verified GPU memory limits (the node fails open): %s", container, reason)
}

// MPSRestarted records a Warning Event on the pod: its container's MPS
// clients lost their GPU contexts and must restart their CUDA work.
func (a *Agent) MPSRestarted(pod nriplugin.PodRef, container, detail string) {
	a.metrics.Count(metrics.EventMPSRestarted)
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUFractionMPSRestarted",
		"container %s: its MPS clients lost their GPU contexts: %s", container, detail)
}

// ReleaseFailed records an Event on the pod.
func (a *Agent) ReleaseFailed(pod nriplugin.PodRef, container string, err error) {
	a.metrics.Count(metrics.EventReleaseFailed)
	if pod.Name == "" {
		return // a lease of a pod already gone: the agent's log has it
	}
	a.recorder.Eventf(podRef(pod), corev1.EventTypeWarning, "GPUMemoryReleaseFailed",
		"container %s stopped but its GPU soft limit could not be released: %v", container, err)
}

// killMargin is how long past its security grace a container the agent
// asked to stop may still run before the agent kills its processes: the
// kubelet's own stop takes a few seconds past the grace; one that has not
// acted by then is not going to (down, or cut off from the API).
const killMargin = 30 * time.Second

// Evict removes a pod found running without its enforcement: it deletes
// it (named by UID, so a new pod that took the name is never touched),
// not through the Eviction API, whose disruption budgets a tenant writes
// and could use to keep an unenforced container running for good. The
// node agent may delete only the pods of its own node (deploy/'s and the
// chart's own-node policy).
//
// The deletion gives the pod at most SecurityStopGrace to stop, whatever
// grace (or preStop hook) its tenant wrote: a container that started
// unenforced must not keep every GPU for as long as its tenant likes.
// The API server takes the shorter of this and a deletion under way.
func (a *Agent) Evict(ctx context.Context, pod nriplugin.PodRef, _ string) error {
	uid := types.UID(pod.UID)
	grace := int64(a.opts.SecurityStopGrace / time.Second)
	a.mu.Lock()
	pods := a.pods
	a.mu.Unlock()
	if own, ok := pods.grace(pod.Namespace, pod.Name, pod.UID); ok && own < grace {
		grace = own
	}
	// Never 0: a deletion without grace removes the pod from the API at
	// once, and with it its share from every book, while its containers
	// still run.
	grace = max(grace, 1)
	return a.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &uid}, GracePeriodSeconds: &grace})
}
