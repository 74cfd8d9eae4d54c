package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/containerd/nri/pkg/adaptation"
	nriapi "github.com/containerd/nri/pkg/api"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/reservation"
)

// The kubelet's directories for the DRA driver's plugin and CDI specs on
// a real node, where --dra-plugin-dir, --dra-registrar-dir and
// --dra-cdi-dir do not say otherwise.
const (
	DefaultDRAPluginDir    = "/var/lib/kubelet/plugins/" + api.DRADriver
	DefaultDRARegistrarDir = "/var/lib/kubelet/plugins_registry"
	DefaultCDIDir          = "/var/run/cdi"
)

// environment is where the agent's node comes from, chosen once at start:
// a real node (NVML, the kubelet's PodResources and directories, the
// container runtime's NRI socket) or a simulated one (realNode,
// simulatedNode). Nothing else in the agent asks which it runs on.
type environment struct {
	// nvml is the GPUs' management library.
	nvml nvml.Interface
	// devices tells which GPU the device plugin gave each reservation pod.
	devices reservation.Source
	// containerDevices are the NVIDIA devices the device plugin allocated
	// to a container; nil where no container runs.
	containerDevices func(ctx context.Context, namespace, pod, container string) ([]string, error)
	// allocatedGPUs are the NVIDIA devices the device plugin allocated to
	// any pod of the node (reservation pods of any scheduler included);
	// nil where no container runs.
	allocatedGPUs func(ctx context.Context) (map[string]bool, error)
	// nriSocket is the NRI endpoint the plugin registers with.
	nriSocket string
	// draPluginDir, draRegistrarDir, cdiDir are the DRA driver's
	// directories unless flags name others.
	draPluginDir, draRegistrarDir, cdiDir string
	// containers is false where no container ever runs: the DRA driver
	// then prepares claims it could not enforce (nothing would use them).
	containers bool
	// checkCgroup says why the driver's per-cgroup limits cannot work
	// here; nil where no container runs.
	checkCgroup func() error
	// withoutMPS is what the agent has of MPS when it runs no daemon:
	// want (the driver's protocol) where no container runs, an error
	// otherwise.
	withoutMPS func(want nodeapi.MPS) (nodeapi.MPS, error)
	// stop releases what the environment opened.
	stop func()
}

// newEnvironment opens the node the options name: simulated with
// --simulate-gpus, real otherwise.
func newEnvironment(ctx context.Context, opts Options) (*environment, error) {
	if opts.SimulateGPUs != "" {
		return simulatedNode(ctx, opts)
	}
	return realNode(opts)
}

// realNode is a node with GPUs, a kubelet and a container runtime.
func realNode(opts Options) (*environment, error) {
	source, err := reservation.DialKubelet(opts.PodResourcesSocket)
	if err != nil {
		return nil, err
	}
	return &environment{
		nvml: nvml.New(), devices: source, containerDevices: source.ContainerDevices, allocatedGPUs: func(ctx context.Context) (map[string]bool, error) {
			return source.Allocated(ctx, append([]string{opts.ReservationNamespace}, opts.ForeignReservationNamespaces...)...)
		}, nriSocket: opts.NRISocket,
		draPluginDir: DefaultDRAPluginDir, draRegistrarDir: DefaultDRARegistrarDir, cdiDir: DefaultCDIDir,
		containers:  true,
		checkCgroup: func() error { return enforce.CheckCgroup(opts.CgroupRoot) },
		withoutMPS: func(nodeapi.MPS) (nodeapi.MPS, error) {
			return nodeapi.MPSNone, errors.New("the node agent has no MPS directory (--mps-pipe-dir)")
		},
		stop: func() { _ = source.Close() },
	}, nil
}

// simulatedNode is a node of a local cluster: GPUs from a go-nvml mock
// machine, the agent itself playing the device plugin for reservation
// pods, and an in-process NRI runtime endpoint, since no kubelet or
// container runtime runs there. Its directories are under the state
// directory: the agents of a local cluster on one host must not share one
// socket (they raced to bind it, and one failed) nor write into the host's
// kubelet's.
func simulatedNode(ctx context.Context, opts Options) (*environment, error) {
	lib, err := inventory.Simulated(opts.SimulateGPUs)
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
	socket := filepath.Join(opts.StateDir, "nri.sock")
	runtime, err := startSimulatedRuntime(socket, opts.StateDir)
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Simulating: GPUs from a go-nvml mock machine, reservation pods get GPUs from the agent itself, and the NRI plugin registers with an in-process NRI runtime endpoint (no containers run here)",
		"machine", opts.SimulateGPUs, "gpus", len(inv.GPUs), "nriSocket", socket)
	return &environment{
		nvml: lib, devices: sim, nriSocket: socket,
		draPluginDir: filepath.Join(opts.StateDir, "dra-plugin"), draRegistrarDir: filepath.Join(opts.StateDir, "dra-registry"),
		cdiDir:     filepath.Join(opts.StateDir, "cdi"),
		withoutMPS: func(want nodeapi.MPS) (nodeapi.MPS, error) { return want, nil },
		stop:       runtime.Stop,
	}, nil
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
