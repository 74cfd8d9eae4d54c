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
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
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
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/metrics"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/publish"
	"github.com/gpufrac/gpufrac/pkg/node/reservation"
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
	// chosen by the agent from MemoryLimits and the driver.
	Injection    injection.Config
	HealthAddr   string
	ResyncPeriod time.Duration
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
	opts     Options
	client   kubernetes.Interface
	plugin   *nriplugin.Plugin
	recorder record.EventRecorder
	metrics  *metrics.Metrics
	leases   *enforce.Leases
	mps      *mps.Manager

	driver    *dra.Driver
	draHelper *kubeletplugin.Helper

	mu        sync.Mutex
	published bool // the last publish reached the API server
	// draInv and draCfg are the GPUs and injection as last read, for the
	// DRA driver (it enforces exactly as the NRI plugin does).
	draInv inventory.Inventory
	draCfg injection.Config
	// lastStanding is the standing GPU count last published.
	lastStanding int
	// mpsStarted is when the node's MPS daemon started, as last seen:
	// containers created before it are evicted (see RetryEvictions).
	mpsStarted time.Time
}

// New builds an agent for opts over client.
func New(opts Options, client kubernetes.Interface) *Agent {
	if opts.MemoryLimits == "" {
		opts.MemoryLimits = "auto"
	}
	if opts.ProcRoot == "" {
		opts.ProcRoot = "/proc"
	}
	if opts.MPSControl == "" {
		opts.MPSControl = mps.DefaultBinary
	}
	if opts.CgroupRoot == "" {
		opts.CgroupRoot = "/sys/fs/cgroup"
	}
	a := &Agent{opts: opts, client: client, metrics: metrics.New()}
	// Until the first inventory says which backend the driver allows, the
	// backend is unset and fractional containers are refused.
	a.plugin = nriplugin.New(nriplugin.Options{Injection: opts.Injection, FailOpen: opts.FailOpen, Reporter: a, Evictor: a,
		ObserveHook: a.metrics.ObserveHook})
	return a
}

// Run works until ctx ends, then marks the node not ready for fractions
// (nothing injects limits while the agent is away) and returns.
func (a *Agent) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("node", a.opts.NodeName)
	ctx = klog.NewContext(ctx, logger)
	if err := os.MkdirAll(a.opts.StateDir, 0o750); err != nil {
		return fmt.Errorf("state directory %s: %w", a.opts.StateDir, err)
	}

	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: a.client.CoreV1().Events("")})
	defer broadcaster.Shutdown()
	a.recorder = broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "gpufrac-node-agent", Host: a.opts.NodeName})

	lib, annotator, nriSocket, stopRuntime, err := a.backends(ctx)
	if err != nil {
		return err
	}
	defer stopRuntime()
	leases, err := enforce.OpenLeases(filepath.Join(a.opts.StateDir, "leases.json"))
	if err != nil {
		return err
	}
	a.plugin.EnableLimitLifecycle(lib, a.opts.ProcRoot, leases)
	a.leases = leases
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
			return err
		}
		a.mps = m
		a.plugin.EnableMPS(m)
	}

	if a.opts.DRA.Enabled {
		stop, err := a.startDRA(ctx)
		if err != nil {
			return err
		}
		defer stop()
	}

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); a.plugin.Serve(ctx, nriSocket, time.Second, 30*time.Second) }()
	if a.opts.HealthAddr != "" {
		wg.Add(1)
		go func() {
			defer wg.Done()
			metricsHandler := promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{})
			if err := health.Serve(ctx, a.opts.HealthAddr, a.Ready, map[string]http.Handler{"/metrics": metricsHandler}); err != nil {
				logger.Error(err, "Health endpoint failed")
			}
		}()
	}

	ticker := time.NewTicker(a.opts.ResyncPeriod)
	defer ticker.Stop()
	for {
		a.resync(ctx, lib, annotator)
		select {
		case <-ctx.Done():
			a.markStopped(logger)
			wg.Wait()
			a.plugin.WaitForEvictions()
			return nil
		case <-ticker.C:
		}
	}
}

// backends picks the GPU library, the reservation device source and the
// NRI endpoint: real ones, or simulated ones for a node without a GPU.
func (a *Agent) backends(ctx context.Context) (nvml.Interface, *reservation.Annotator, string, func(), error) {
	logger := klog.FromContext(ctx)
	annotator := &reservation.Annotator{Client: a.client, Node: a.opts.NodeName, Namespace: a.opts.ReservationNamespace}
	if a.opts.SimulateGPUs == "" {
		source, err := reservation.DialKubelet(a.opts.PodResourcesSocket)
		if err != nil {
			return nil, nil, "", nil, err
		}
		annotator.Source = source
		return nvml.New(), annotator, a.opts.NRISocket, func() { _ = source.Close() }, nil
	}
	lib, err := inventory.Simulated(a.opts.SimulateGPUs)
	if err != nil {
		return nil, nil, "", nil, err
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		return nil, nil, "", nil, err
	}
	sim := &reservation.Simulated{}
	for _, g := range inv.GPUs {
		sim.GPUs = append(sim.GPUs, g.UUID)
	}
	annotator.Simulated = sim
	socket := filepath.Join(a.opts.StateDir, "nri.sock")
	runtime, err := startSimulatedRuntime(socket, a.opts.StateDir)
	if err != nil {
		return nil, nil, "", nil, err
	}
	logger.Info("Simulating: GPUs from a go-nvml mock machine, reservation pods get GPUs from the agent itself, and the NRI plugin registers with an in-process NRI runtime endpoint (no containers run here)",
		"machine", a.opts.SimulateGPUs, "gpus", len(inv.GPUs), "nriSocket", socket)
	return lib, annotator, socket, runtime.Stop, nil
}

// reserveFor is the reserve the scheduler keeps on this node's GPUs: per
// model when one is given for the product label the node carries (the
// scheduler keys it by that label too), the global one otherwise.
func reserveFor(opts Options, labels map[string]string) int64 {
	if v, ok := opts.GPUMemoryReserveMiBByModel[labels[publish.LabelGPUProduct]]; ok {
		return v
	}
	return opts.Injection.GPUMemoryReserveMiB
}

// startSimulatedRuntime serves the runtime side of NRI (containerd's own
// adaptation library) where no container runtime exists.
func startSimulatedRuntime(socket, dir string) (*adaptation.Adaptation, error) {
	_ = os.Remove(socket)
	noSync := func(ctx context.Context, cb adaptation.SyncCB) error { _, err := cb(ctx, nil, nil); return err }
	noUpdate := func(context.Context, []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error) { return nil, nil }
	r, err := adaptation.New("gpufrac-simulated-runtime", "0", noSync, noUpdate, adaptation.WithSocketPath(socket),
		adaptation.WithPluginPath(filepath.Join(dir, "nri-plugins")), adaptation.WithPluginConfigPath(filepath.Join(dir, "nri-conf.d")))
	if err != nil {
		return nil, fmt.Errorf("simulated NRI runtime: %w", err)
	}
	if err := r.Start(); err != nil {
		return nil, fmt.Errorf("simulated NRI runtime: %w", err)
	}
	return r, nil
}

// resync reads the GPUs, publishes the node's state and annotates
// reservation pods.
func (a *Agent) resync(ctx context.Context, lib nvml.Interface, annotator *reservation.Annotator) {
	logger := klog.FromContext(ctx)
	inv, invErr := inventory.Read(lib)
	if invErr != nil {
		logger.Error(invErr, "Cannot read the GPUs; the node is not ready for GPU fractions")
	}
	node, err := a.client.CoreV1().Nodes().Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if err != nil {
		logger.Error(err, "Cannot read the node")
		a.setPublished(false)
		return
	}
	capability := nodeapi.EnforcementNone
	if invErr == nil {
		capability = inv.Capability()
	}
	backend, backendErr := injection.ChooseBackend(a.opts.MemoryLimits, capability)
	mpsProtocol, mpsErr := a.checkMPS(ctx, inv, invErr)
	var cgroupErr error
	if backend.DriverLimits() && a.opts.SimulateGPUs == "" {
		cgroupErr = enforce.CheckCgroup(a.opts.CgroupRoot)
	}
	cfg := a.opts.Injection
	cfg.Backend, cfg.MPS = backend, mpsProtocol
	if mpsErr != nil || cgroupErr != nil {
		// Fail closed: containers whose enforcement cannot work are
		// refused (or, failing open, get no GPU), not started half-limited.
		cfg.MPS = nodeapi.MPSNone
		if cgroupErr != nil {
			cfg.Backend = nodeapi.BackendOff
		}
	}
	if invErr != nil {
		// Not knowing the GPUs is not knowing the backend: new fractional
		// containers are refused, and an audit of the running ones waits
		// (nriplugin's Synchronize) instead of finding them all
		// unenforceable and evicting the node.
		cfg.Backend = nodeapi.BackendUnset
	}
	if invErr == nil && len(inv.GPUs) > 0 {
		cfg.GPUMemoryMiB = inv.GPUs[0].MemoryMiB // what the node publishes as nvidia.com/gpu.memory
	}
	cfg.GPUMemoryReserveMiB = reserveFor(a.opts, node.Labels)
	a.plugin.SetInjection(cfg)
	a.mu.Lock()
	a.draInv, a.draCfg = inv, cfg
	a.mu.Unlock()
	if backendErr != nil {
		logger.Error(backendErr, "Cannot use the requested memory-limit backend; fractional containers are refused")
	}
	state := publish.State{Inventory: inv, InventoryErr: invErr, NRIRegistered: a.plugin.Registered(),
		Backend: backend, BackendErr: backendErr, MPS: mpsProtocol, MPSErr: mpsErr, CgroupErr: cgroupErr,
		FailOpen: a.opts.FailOpen, PublishGPULabels: a.opts.PublishGPULabels, StandingGPUs: a.standingGPUs(inv, invErr), ReserveMiB: cfg.GPUMemoryReserveMiB}
	if a.plugin.Registered() {
		// Only once synchronized does the plugin know every running
		// container, and so which namespaces are claimed and which pods
		// predate the daemon.
		if mpsErr == nil && a.mps != nil {
			live := a.plugin.LiveNamespaces()
			var preparedErr error
			if a.driver != nil {
				// A prepared claim's namespace is in use until the
				// kubelet unprepares it, container or not yet.
				var prepared map[types.UID][]string
				prepared, preparedErr = a.driver.Prepared()
				for _, names := range prepared {
					for _, n := range names {
						live[n] = true
					}
				}
			}
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if preparedErr != nil {
				logger.Error(preparedErr, "Cannot read the prepared DRA claims; no MPS namespace is deleted this round")
			} else {
				a.plugin.ReconcileMPS(rctx, func(name string) bool { return live[name] })
			}
			cancel()
		}
		var started time.Time
		if mpsErr == nil {
			a.mu.Lock()
			started = a.mpsStarted
			a.mu.Unlock()
		}
		a.plugin.RetryEvictions(ctx, started)
	}
	desired := publish.Compute(state, node.Labels)
	a.metrics.Node(inv, backend, desired.Condition.Status == corev1.ConditionTrue)
	a.metrics.Tenants(a.plugin.Tenants())
	a.metrics.Containers(lib, a.leases.All())
	if invErr == nil {
		a.metrics.GPUUse(lib, inv)
	}
	if err := publish.Apply(ctx, a.client, node, desired); err != nil {
		logger.Error(err, "Cannot publish the node's GPU-fraction state")
		a.setPublished(false)
		return
	}
	a.setPublished(true)
	if invErr == nil {
		if _, err := annotator.Sync(ctx); err != nil {
			logger.Error(err, "Cannot annotate reservation pods")
		}
	}
	if a.draHelper != nil {
		offers := dra.Offers{}
		if invErr == nil {
			offers = dra.Offers(annotator.Standing())
		}
		if err := dra.Publish(ctx, a.draHelper, a.driver, cfg.GPUMemoryReserveMiB, offers); err != nil {
			logger.Error(err, "Cannot publish the node's DRA devices")
		}
	}
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

// The kubelet's directories for the DRA driver's plugin and CDI specs on
// a real node, where --dra-plugin-dir, --dra-registrar-dir and
// --dra-cdi-dir do not say otherwise.
const (
	DefaultDRAPluginDir    = "/var/lib/kubelet/plugins/" + api.DRADriver
	DefaultDRARegistrarDir = "/var/lib/kubelet/plugins_registry"
	DefaultCDIDir          = "/var/run/cdi"
)

// startDRA starts the DRA driver's kubelet plugin. Its devices are
// published by each resync, once the standing reservation pods say which
// GPUs are held for shares.
func (a *Agent) startDRA(ctx context.Context) (func(), error) {
	o := a.opts.DRA
	plugin, registrar, cdi := DefaultDRAPluginDir, DefaultDRARegistrarDir, DefaultCDIDir
	if a.opts.SimulateGPUs != "" {
		// No kubelet calls a simulated node's plugin; it serves all the
		// same, from the node's own directories: the agents of a local
		// cluster on one host must not share one socket (they raced to
		// bind it, and one failed) nor write into the host's kubelet's.
		plugin = filepath.Join(a.opts.StateDir, "dra-plugin")
		registrar = filepath.Join(a.opts.StateDir, "dra-registry")
		cdi = filepath.Join(a.opts.StateDir, "cdi")
	}
	o.PluginDir = cmp.Or(o.PluginDir, plugin)
	o.RegistrarDir = cmp.Or(o.RegistrarDir, registrar)
	o.CDIDir = cmp.Or(o.CDIDir, cdi)
	for _, dir := range []string{o.PluginDir, o.RegistrarDir, o.CDIDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, fmt.Errorf("DRA driver directory %s: %w", dir, err)
		}
	}
	a.driver = &dra.Driver{NodeName: a.opts.NodeName, CDIDir: o.CDIDir, MPS: a.mps, Simulated: a.opts.SimulateGPUs != "", Node: func() (inventory.Inventory, injection.Config) {
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

// checkMPS says which interface the node's MPS daemon speaks, or why it
// cannot serve fractional containers, and notes when it started.
func (a *Agent) checkMPS(ctx context.Context, inv inventory.Inventory, invErr error) (nodeapi.MPS, error) {
	if invErr != nil {
		return nodeapi.MPSNone, fmt.Errorf("the driver release is unknown: %w", invErr)
	}
	major, err := mps.DriverMajor(inv.DriverVersion)
	if err != nil {
		return nodeapi.MPSNone, err
	}
	want := mps.ProtocolFor(major)
	if a.mps == nil {
		if a.opts.SimulateGPUs != "" {
			return want, nil // a simulated node without MPS: no containers run there
		}
		return nodeapi.MPSNone, errors.New("the node agent has no MPS directory (--mps-pipe-dir)")
	}
	a.mps.SetProtocol(want)
	status, statusErr := mps.ReadStatus(a.opts.Injection.MPSRoot)
	if err := a.mps.Control().Ping(ctx); err != nil {
		why := status.LastExit
		if errors.Is(statusErr, os.ErrNotExist) {
			why = mps.ErrNoDaemon.Error()
		} else if statusErr != nil {
			why = statusErr.Error()
		}
		return nodeapi.MPSNone, fmt.Errorf("the MPS control daemon does not answer (%w); its supervisor's last word: %s", err, why)
	}
	if statusErr == nil && status.Protocol != want {
		return nodeapi.MPSNone, fmt.Errorf("the MPS control daemon speaks %q, and driver r%d needs %q: restart the node agent's mps container", status.Protocol, major, want)
	}
	if statusErr == nil {
		a.mu.Lock()
		a.mpsStarted = status.Started
		a.mu.Unlock()
	}
	return want, nil
}

// markStopped tells schedulers to stop sending fractions here: with the
// agent gone, nothing injects their limits.
func (a *Agent) markStopped(logger klog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d := publish.Desired{Condition: corev1.NodeCondition{Type: publish.ConditionReady, Status: corev1.ConditionFalse,
		Reason: "AgentStopped", Message: "the gpufrac node agent is not running, so GPU-fraction limits cannot be injected"}}
	node, err := a.client.CoreV1().Nodes().Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if err == nil {
		err = publish.Apply(ctx, a.client, node, d)
	}
	if err != nil {
		logger.Error(err, "Cannot mark the node not ready on shutdown")
	}
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
		"container %s not started: its GPU fraction cannot be enforced: %v", container, err)
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
		"evicted: container %s runs without its GPU-fraction enforcement (%s)", container, reason)
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

// Evict evicts a pod through the Eviction API.
func (a *Agent) Evict(ctx context.Context, pod nriplugin.PodRef, _ string) error {
	uid := types.UID(pod.UID)
	return a.client.PolicyV1().Evictions(pod.Namespace).Evict(ctx, &policyv1.Eviction{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace},
		// Never evict a new pod that took the old one's name.
		DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}},
	})
}
