package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/reservation"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

// The kubelet's directories for the DRA driver's plugin and CDI specs on
// a real node, where --dra-plugin-dir, --dra-registrar-dir and
// --dra-cdi-dir do not say otherwise.
const (
	DefaultDRAPluginDir    = "/var/lib/kubelet/plugins/" + api.DRADriver
	DefaultDRARegistrarDir = "/var/lib/kubelet/plugins_registry"
	DefaultCDIDir          = "/var/run/cdi"
)

// environment is the node the agent runs on, chosen once at start: a
// real node (NVML, the kubelet's PodResources and directories, the
// container runtime's NRI socket) or a simulated one (realNode,
// simulatedNode). Each answers in its own way; nothing else in the agent
// asks which it runs on.
type environment interface {
	// gpus is the GPUs' management library.
	gpus() nvml.Interface
	// devices tells which GPU the device plugin gave each reservation pod.
	devices() reservation.Source
	// containerDevices are the NVIDIA devices the device plugin allocated
	// to a container (none where no container runs).
	containerDevices(ctx context.Context, namespace, pod, container string) ([]string, error)
	// allocatedGPUs are the NVIDIA devices the device plugin allocated to
	// any pod of the node, reservation pods of any scheduler included
	// (none where no container runs: no tenant is then found unheld).
	allocatedGPUs(ctx context.Context) (map[string]bool, error)
	// nriSocket is the NRI endpoint the plugin registers with.
	nriSocket() string
	// draDirs are the DRA driver's plugin, registrar and CDI directories
	// unless flags name others.
	draDirs() (plugin, registrar, cdi string)
	// checkCgroup says why the driver's per-cgroup limits cannot work
	// here (nil where no container runs: nothing needs them).
	checkCgroup() error
	// withoutMPS is what the agent has of MPS when it runs no daemon:
	// want (the driver's protocol) where no container runs, an error
	// otherwise.
	withoutMPS(want nodeapi.MPS) (nodeapi.MPS, error)
	// holdResize holds pod uid's running container to its resized memory
	// (held: it is now), and says how.
	holdResize(p *nriplugin.Plugin, uid, container string, to api.Memory) (held bool, how string, err error)
	// offersUnenforceable: the DRA driver publishes its devices for the
	// scheduler even while nothing could enforce a share (where no
	// container ever runs, nothing would use one); preparing a claim
	// still fails closed.
	offersUnenforceable() bool
	// measure reads what tenants use of the GPUs: through NVML and /proc
	// on a real node (the NRI plugin's tenants, by container ID); from the
	// usage model on a simulated one, which runs no container (the
	// node's pods that hold shares, as pods lists them).
	measure(tenants []usage.Tenant, pods func() []usage.Tenant, gpus []string, now time.Time) usage.Measurement
	// stop releases what the environment opened.
	stop()
}

// newEnvironment opens the node the options name: simulated with
// --simulate-gpus, real otherwise.
func newEnvironment(ctx context.Context, opts Options) (environment, error) {
	// Each constructor's nil on error is returned as a nil interface.
	if opts.SimulateGPUs != "" {
		n, err := newSimulatedNode(ctx, opts)
		if err != nil {
			return nil, err
		}
		return n, nil
	}
	n, err := newRealNode(opts)
	if err != nil {
		return nil, err
	}
	return n, nil
}

// realNode is a node with GPUs, a kubelet and a container runtime.
type realNode struct {
	opts    Options
	lib     nvml.Interface
	source  *reservation.Kubelet
	sampler *usage.Sampler
}

func newRealNode(opts Options) (*realNode, error) {
	source, err := reservation.DialKubelet(opts.PodResourcesSocket)
	if err != nil {
		return nil, err
	}
	lib := nvml.New()
	return &realNode{opts: opts, lib: lib, source: source, sampler: &usage.Sampler{Lib: lib, ProcRoot: opts.ProcRoot}}, nil
}

func (n *realNode) gpus() nvml.Interface        { return n.lib }
func (n *realNode) devices() reservation.Source { return n.source }
func (n *realNode) containerDevices(ctx context.Context, namespace, pod, container string) ([]string, error) {
	return n.source.ContainerDevices(ctx, namespace, pod, container)
}
func (n *realNode) allocatedGPUs(ctx context.Context) (map[string]bool, error) {
	return n.source.Allocated(ctx, append([]string{n.opts.ReservationNamespace}, n.opts.ForeignReservationNamespaces...)...)
}
func (n *realNode) nriSocket() string { return n.opts.NRISocket }
func (n *realNode) draDirs() (string, string, string) {
	return DefaultDRAPluginDir, DefaultDRARegistrarDir, DefaultCDIDir
}
func (n *realNode) checkCgroup() error { return enforce.CheckCgroup(n.opts.CgroupRoot) }
func (n *realNode) withoutMPS(nodeapi.MPS) (nodeapi.MPS, error) {
	return nodeapi.MPSNone, errors.New("the node agent has no MPS directory (--mps-pipe-dir)")
}
func (n *realNode) holdResize(p *nriplugin.Plugin, uid, container string, to api.Memory) (bool, string, error) {
	held, err := p.Resize(uid, container, to)
	return held, "the running container is held to it (not restarted)", err
}
func (n *realNode) offersUnenforceable() bool { return false }
func (n *realNode) measure(tenants []usage.Tenant, _ func() []usage.Tenant, gpus []string, now time.Time) usage.Measurement {
	return n.sampler.Measure(tenants, gpus, now)
}
func (n *realNode) stop() { _ = n.source.Close() }

// simulatedNode is a node of a local cluster: GPUs from a go-nvml mock
// machine, the agent itself playing the device plugin for reservation
// pods, and an in-process NRI runtime endpoint, since no kubelet or
// container runtime runs there. Its directories are under the state
// directory: the agents of a local cluster on one host must not share one
// socket (they raced to bind it, and one failed) nor write into the host's
// kubelet's.
type simulatedNode struct {
	lib     nvml.Interface
	sim     *reservation.Simulated
	dir     string
	runtime *adaptation.Adaptation
}

func newSimulatedNode(ctx context.Context, opts Options) (*simulatedNode, error) {
	lib, err := inventory.SimulatedFor(opts.SimulateGPUs, opts.NodeName)
	if err != nil {
		return nil, err
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		return nil, err
	}
	sim := &reservation.Simulated{}
	for _, g := range inv.GPUs {
		sim.GPUs = append(sim.GPUs, g.UUID)
	}
	n := &simulatedNode{lib: lib, sim: sim, dir: opts.StateDir}
	n.runtime, err = startSimulatedRuntime(n.nriSocket(), opts.StateDir)
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Simulating: GPUs from a go-nvml mock machine, reservation pods get GPUs from the agent itself, and the NRI plugin registers with an in-process NRI runtime endpoint (no containers run here)",
		"machine", opts.SimulateGPUs, "gpus", len(inv.GPUs), "nriSocket", n.nriSocket())
	return n, nil
}

func (n *simulatedNode) gpus() nvml.Interface        { return n.lib }
func (n *simulatedNode) devices() reservation.Source { return n.sim }
func (n *simulatedNode) containerDevices(context.Context, string, string, string) ([]string, error) {
	return nil, nil
}
func (n *simulatedNode) allocatedGPUs(context.Context) (map[string]bool, error) { return nil, nil }
func (n *simulatedNode) nriSocket() string                                      { return filepath.Join(n.dir, "nri.sock") }
func (n *simulatedNode) draDirs() (string, string, string) {
	return filepath.Join(n.dir, "dra-plugin"), filepath.Join(n.dir, "dra-registry"), filepath.Join(n.dir, "cdi")
}
func (n *simulatedNode) checkCgroup() error { return nil }
func (n *simulatedNode) withoutMPS(want nodeapi.MPS) (nodeapi.MPS, error) {
	return want, nil
}
func (n *simulatedNode) holdResize(*nriplugin.Plugin, string, string, api.Memory) (bool, string, error) {
	return true, "a simulated node runs no container: recorded as applied", nil
}
func (n *simulatedNode) offersUnenforceable() bool { return true }
func (n *simulatedNode) measure(_ []usage.Tenant, pods func() []usage.Tenant, gpus []string, now time.Time) usage.Measurement {
	return usage.Model{}.Measure(pods(), gpus, now)
}
func (n *simulatedNode) stop() { n.runtime.Stop() }

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
