package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/dra"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/publish"
)

// Each resync observes the node (hardware: what the GPUs, the MPS daemon
// and the cgroups say), decides from it and the flags what the node is
// (NodeConfig, a pure function), and hands that to each subscriber: the
// NRI plugin and the DRA driver (what they enforce), the MPS namespaces
// and evictions, the metrics, the Node object, the reservation pods and
// the DRA devices.

// hardware is what one resync reads of the node.
type hardware struct {
	inv       inventory.Inventory
	invErr    error
	mps       nodeapi.MPS
	mpsErr    error
	cgroupErr error
	// computeModeErr says why a GPU the node shares is not exclusive.
	computeModeErr error
	// stateErr says which of the agent's state files cannot be read.
	stateErr error
	// labels are the Node object's, as read.
	labels map[string]string
}

// NodeConfig is what the node is, for every subscriber: what the NRI
// plugin and the DRA driver enforce, and what the node publishes.
type NodeConfig struct {
	Injection injection.Config
	Publish   publish.State
}

// decide is the node's configuration from what was observed and the
// agent's options; standing is how many GPUs the node asks to have held
// for shares. It reads nothing and changes nothing.
func decide(hw hardware, opts Options, standing int, registered bool) NodeConfig {
	capability := nodeapi.EnforcementNone
	if hw.invErr == nil {
		capability = hw.inv.Capability()
	}
	backend, backendErr := injection.ChooseBackend(opts.MemoryLimits, capability)
	cgroupErr := hw.cgroupErr
	if !backend.DriverLimits() {
		cgroupErr = nil // only the driver's limits need the cgroup controller
	}
	cfg := opts.Injection
	cfg.Backend, cfg.MPS = backend, hw.mps
	if hw.mpsErr != nil || cgroupErr != nil {
		// Fail closed: containers whose enforcement cannot work are
		// refused (or, failing open, get no GPU), not started half-limited.
		cfg.MPS = nodeapi.MPSNone
		if cgroupErr != nil {
			cfg.Backend = nodeapi.BackendOff
		}
	}
	if hw.stateErr != nil {
		// Not knowing what it enforced is not enforcing: new fractional
		// containers are refused and the running ones are not judged
		// (the audit waits for a backend), as when the GPUs are unread.
		cfg.Backend = nodeapi.BackendUnset
	}
	if hw.invErr != nil {
		// Not knowing the GPUs is not knowing the backend: new fractional
		// containers are refused, and an audit of the running ones waits
		// (nriplugin's Synchronize) instead of finding them all
		// unenforceable and evicting the node.
		cfg.Backend = nodeapi.BackendUnset
	}
	if hw.invErr == nil && len(hw.inv.GPUs) > 0 {
		cfg.GPUMemoryMiB = hw.inv.GPUs[0].MemoryMiB // what the node publishes as nvidia.com/gpu.memory
	}
	cfg.GPUMemoryReserveMiB = reserveFor(opts, hw.product())
	return NodeConfig{Injection: cfg, Publish: publish.State{Inventory: hw.inv, InventoryErr: hw.invErr, NRIRegistered: registered,
		Backend: backend, BackendErr: backendErr, MPS: hw.mps, MPSErr: hw.mpsErr, CgroupErr: cgroupErr, ComputeModeErr: hw.computeModeErr, StateErr: hw.stateErr,
		FailOpen: opts.FailOpen, PublishGPULabels: opts.PublishGPULabels, StandingGPUs: standing, ReserveMiB: cfg.GPUMemoryReserveMiB,
		Heartbeat: HeartbeatBound(opts.ResyncPeriod), ReservationNamespace: opts.ReservationNamespace}}
}

// HeartbeatBound is how long an agent that resyncs every period may go
// unheard before schedulers stop sending fractions to its node: three
// periods, so that one slow or failed publish is no outage, and at least
// MinHeartbeatBound, so that a short period on a loaded machine is none
// either (the kubelet's own grace is 40 s).
func HeartbeatBound(period time.Duration) time.Duration { return max(3*period, MinHeartbeatBound) }

// MinHeartbeatBound is the least HeartbeatBound.
const MinHeartbeatBound = 30 * time.Second

// product is the node's GPU model as nvidia.com/gpu.product names it: the
// label (GPU Feature Discovery's, which the scheduler's users key by), or,
// before any is published, the GPUs' own name in its form, so that the
// first publish already carries the model's reserve.
func (hw hardware) product() string {
	if p := api.GPUProduct(hw.labels); p != "" || hw.invErr != nil || len(hw.inv.GPUs) == 0 {
		return p
	}
	return publish.ProductLabel(hw.inv.GPUs[0].Product)
}

// reserveFor is the reserve kept on GPUs of a product: per model when one
// is given for it, the global one otherwise. The node publishes it for
// every other reader.
func reserveFor(opts Options, product string) int64 {
	if v, ok := opts.GPUMemoryReserveMiBByModel[product]; ok {
		return v
	}
	return opts.Injection.GPUMemoryReserveMiB
}

// observe reads the node, and writes nothing: its GPUs, the Node object,
// the MPS daemon and the cgroups. An error is the Node object's: nothing
// can be published.
func (a *Agent) observe(ctx context.Context) (*corev1.Node, hardware, error) {
	hw := hardware{stateErr: a.stateErr}
	hw.inv, hw.invErr = inventory.Read(a.env.gpus())
	if hw.invErr != nil {
		klog.FromContext(ctx).Error(hw.invErr, "Cannot read the GPUs; the node is not ready for GPU fractions")
	}
	node, err := a.client.CoreV1().Nodes().Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, hw, fmt.Errorf("read the node: %w", err)
	}
	hw.labels = node.Labels
	hw.mps, hw.mpsErr = a.checkMPS(ctx, hw.inv, hw.invErr)
	hw.cgroupErr = a.env.checkCgroup()
	return node, hw, nil
}

// holdShares writes what the node holds for shares, from what observe
// read: each reservation pod is told its GPU (and so which GPUs are
// shared), and those GPUs are kept in EXCLUSIVE_PROCESS. It returns why a
// shared GPU is not exclusive. Nothing is written while the GPUs are
// unread.
func (a *Agent) holdShares(ctx context.Context, hw hardware) error {
	if hw.invErr != nil {
		return nil
	}
	if _, err := a.annotator.Sync(ctx); err != nil {
		klog.FromContext(ctx).Error(err, "Cannot annotate reservation pods")
	}
	return a.syncComputeModes(ctx)
}

// syncComputeModes puts the GPUs the reservation pods hold in
// EXCLUSIVE_PROCESS and gives the others it changed their mode back. It
// returns why a shared GPU is not exclusive.
func (a *Agent) syncComputeModes(ctx context.Context) error {
	if a.exclusive == nil {
		return nil
	}
	logger := klog.FromContext(ctx)
	r := a.exclusive.Sync(sharedGPUs(a.annotator.Held(), a.plugin.Tenants(), a.plugin.Audited()))
	for _, uuid := range r.Set {
		logger.Info("Set the compute mode of a GPU shared through MPS to EXCLUSIVE_PROCESS", "gpu", uuid)
	}
	for _, uuid := range r.Restored {
		logger.Info("Gave a GPU shared no more its compute mode back", "gpu", uuid)
	}
	for uuid, err := range r.RestoreErr {
		logger.Error(err, "Cannot give a GPU shared no more its compute mode back", "gpu", uuid)
	}
	if err := a.exclusive.StateErr(); err != nil {
		logger.Error(err, "The record of changed compute modes is unreadable")
	}
	return r.Err()
}

// sharedGPUs are the GPUs fractions share on the node: those its
// reservation pods hold, and those its fractional containers use, for a
// reservation pod can be gone (drained, deleted by hand) or in another
// scheduler's namespace while its tenants run, and their GPU must stay
// exclusive. Nil (unknown: nothing is given its mode back) while either
// half is unknown.
func sharedGPUs(held map[string]bool, tenants []nriplugin.Tenant, audited bool) map[string]bool {
	if held == nil || !audited {
		return nil
	}
	shared := maps.Clone(held)
	for _, t := range tenants {
		for _, uuid := range t.Devices {
			shared[uuid] = true
		}
	}
	return shared
}

// resync observes the node, holds the shared GPUs, decides what the node
// is, and has every subscriber apply that.
func (a *Agent) resync(ctx context.Context) {
	logger := klog.FromContext(ctx)
	node, hw, err := a.observe(ctx)
	if err != nil {
		logger.Error(err, "Cannot observe the node")
		a.setPublished(false)
		return
	}
	hw.computeModeErr = a.holdShares(ctx, hw)
	cfg := decide(hw, a.opts, a.standingGPUs(hw.inv, hw.invErr), a.plugin.Registered())
	a.enforce(cfg)
	if cfg.Publish.BackendErr != nil {
		logger.Error(cfg.Publish.BackendErr, "Cannot use the requested memory-limit backend; fractional containers are refused")
	}
	a.reconcileContainers(ctx, hw.mpsErr == nil)
	desired := publish.Compute(cfg.Publish, node.Labels)
	a.record(hw, cfg, desired.Condition.Status == corev1.ConditionTrue)
	measured, use, publishUse := a.measureUsage(logger, hw)
	a.reclaimBursts(ctx, logger, hw, measured)
	if err := publish.Apply(ctx, a.client, node, desired); err != nil {
		logger.Error(err, "Cannot publish the node's GPU-fraction state")
		a.setPublished(false)
		return
	}
	a.setPublished(true)
	if publishUse {
		if err := publish.ApplyAnnotations(ctx, a.client, node, use); err != nil {
			logger.Error(err, "Cannot publish the tenants' GPU use on the Node; the node's state and heartbeat are published")
		} else {
			a.usagePublished = time.Now()
		}
	}
	// A node closed to fractions offers no new DRA shares either.
	_, closed := api.FractionsClosed(node.Labels)
	a.offer(ctx, hw.invErr == nil && !closed, cfg)
}

// enforce hands the configuration to what enforces it: the NRI plugin
// (from the next container on) and the DRA driver.
func (a *Agent) enforce(cfg NodeConfig) {
	a.mu.Lock()
	pods := a.pods
	a.mu.Unlock()
	if pods != nil && !pods.synced() {
		// As while the GPUs are unread: new fractional containers are
		// refused and the running ones wait for their audit, which must
		// know what resizes changed since their sandboxes were made.
		cfg.Injection.Backend = nodeapi.BackendUnset
	}
	a.plugin.SetInjection(cfg.Injection)
	a.mu.Lock()
	a.draInv, a.draCfg = cfg.Publish.Inventory, cfg.Injection
	a.mu.Unlock()
}

// reconcileContainers deletes the MPS namespaces no container or prepared
// claim uses, and retries the evictions of containers that run
// unenforced. Only once the plugin is synchronized does it know every
// running container, and so which namespaces are claimed and which pods
// predate the daemon.
func (a *Agent) reconcileContainers(ctx context.Context, mpsUp bool) {
	if !a.plugin.Registered() {
		return
	}
	if mpsUp && a.mps != nil {
		live := a.plugin.LiveNamespaces()
		var preparedErr error
		if a.driver != nil {
			// A prepared claim's namespace is in use until the kubelet
			// unprepares it, container or not yet.
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
			klog.FromContext(ctx).Error(preparedErr, "Cannot read the prepared DRA claims; no MPS namespace is deleted this round")
		} else {
			a.plugin.ReconcileMPS(rctx, func(name string) bool { return live[name] })
		}
		cancel()
	}
	var started time.Time
	if mpsUp {
		a.mu.Lock()
		started = a.mpsStarted
		a.mu.Unlock()
	}
	a.plugin.Reverify(ctx)
	a.plugin.RetryEvictions(ctx, started)
	a.stopTenantsOnUnheldGPUs(ctx)
}

// stopTenantsOnUnheldGPUs stops the fractional containers whose GPU no
// reservation pod of the node (gpufrac's or KAI's) holds through the
// device plugin any more (their reservation pod was deleted under them:
// drained, deleted by hand), seen so at two resyncs in a row: the device
// plugin may give that GPU to a whole-GPU pod under them (which then holds
// it, but no share), and a reservation pod made again may hold another
// GPU, so their share would be silently moved. The audit reports the same
// (DeviceWithoutReservation).
func (a *Agent) stopTenantsOnUnheldGPUs(ctx context.Context) {
	if !a.plugin.Audited() {
		return
	}
	logger := klog.FromContext(ctx)
	allocated, err := a.env.allocatedGPUs(ctx)
	if err != nil {
		logger.Error(err, "Cannot read which GPUs the device plugin allocated; no tenant is judged on it this round")
		return
	}
	var stop []unheldTenant
	a.unheldSeen, stop = countUnheld(a.unheldSeen, unheldTenants(allocated, a.annotator.HeldByGroup(), a.plugin.Tenants()))
	for _, u := range stop {
		reason := fmt.Sprintf("its GPU %s is held by no reservation pod of the node for its share (its reservation pod is gone): the device plugin may give it to another pod, and the share will not be moved silently", u.gpu)
		logger.Info("Stopping a fractional container whose GPU is held no more", "pod", u.tenant.Pod.Namespace+"/"+u.tenant.Pod.Name, "container", u.tenant.Container, "gpu", u.gpu)
		a.plugin.Stop(ctx, u.tenant.Pod, u.tenant.Container, reason)
	}
}

// countUnheld counts the resyncs in a row each tenant was found unheld
// (seen: the counts so far) and says which to stop now: those found so at
// least twice (a stop that failed is asked again; one under way is not
// repeated, see Plugin.Stop).
func countUnheld(seen map[string]int, unheld map[string]unheldTenant) (map[string]int, []unheldTenant) {
	next := map[string]int{}
	var stop []unheldTenant
	for _, key := range slices.Sorted(maps.Keys(unheld)) {
		next[key] = seen[key] + 1
		if next[key] >= 2 {
			stop = append(stop, unheld[key])
		}
	}
	return next, stop
}

type unheldTenant struct {
	tenant nriplugin.Tenant
	gpu    string
}

// unheldTenants are the tenants using a GPU no reservation pod holds for
// them, by pod UID and container: for a share gpufrac's scheduler placed
// (its decision names its groups), its own group's reservation pod
// (byGroup: group to the GPU its pod holds); for another scheduler's, any
// reservation pod (allocated: by device ID). Nothing is judged where the
// allocation cannot be read as GPU UUIDs: an empty list (a kubelet that
// has not caught up), or a plugin that names devices by index; nor by
// group while the reservation pods could not be read (byGroup nil).
func unheldTenants(allocated map[string]bool, byGroup map[string]string, tenants []nriplugin.Tenant) map[string]unheldTenant {
	if len(allocated) == 0 {
		return nil
	}
	for id := range allocated {
		if !strings.HasPrefix(id, "GPU-") && !strings.HasPrefix(id, "MIG-") {
			return nil
		}
	}
	out := map[string]unheldTenant{}
	for _, t := range tenants {
		for i, uuid := range t.Devices {
			held := allocated[uuid]
			if byGroup != nil && len(t.Groups) == len(t.Devices) {
				held = strings.EqualFold(byGroup[t.Groups[i]], uuid)
			}
			if !held {
				out[t.Pod.UID+"/"+t.Container] = unheldTenant{tenant: t, gpu: uuid}
				break
			}
		}
	}
	return out
}

// record updates the metrics.
func (a *Agent) record(hw hardware, cfg NodeConfig, ready bool) {
	a.metrics.Node(hw.inv, cfg.Publish.Backend, ready)
	a.metrics.Tenants(a.plugin.Tenants())
	if a.leases != nil {
		a.metrics.Containers(a.env.gpus(), a.leases.All())
	}
	if hw.invErr == nil {
		a.metrics.GPUUse(a.env.gpus(), hw.inv)
	}
}

// offer publishes the DRA devices of the GPUs the standing reservation
// pods hold for shares (observe told each pod its GPU).
func (a *Agent) offer(ctx context.Context, gpusKnown bool, cfg NodeConfig) {
	logger := klog.FromContext(ctx)
	if a.draHelper == nil {
		return
	}
	offers := dra.Offers{}
	if gpusKnown {
		offers = dra.Offers(a.annotator.Standing())
	}
	if err := dra.Publish(ctx, a.draHelper, a.driver, cfg.Injection.GPUMemoryReserveMiB, offers); err != nil {
		logger.Error(err, "Cannot publish the node's DRA devices")
	}
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
		return a.env.withoutMPS(want)
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
		return nodeapi.MPSNone, fmt.Errorf("the MPS control daemon speaks %q, and driver r%d needs %q: replace the node's MPS daemon (gpufrac mps-replace NODE drains the node first)", status.Protocol, major, want)
	}
	if statusErr == nil {
		a.mu.Lock()
		a.mpsStarted = status.Started
		a.mu.Unlock()
		if status.ReplaceDeferred != "" {
			// The shared server is wedged and cannot be replaced yet: new
			// containers would hang on it. The running ones are left be.
			return nodeapi.MPSNone, fmt.Errorf("the MPS daemon's replacement is held back by its rate limit (mps-daemon --min-replace-interval): %s", status.ReplaceDeferred)
		}
	}
	return want, nil
}
