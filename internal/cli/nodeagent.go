package cli

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/internal/health"
	"github.com/gpufrac/gpufrac/pkg/node/agent"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func newNodeAgentCommand() *cobra.Command {
	opts := agent.DefaultOptions()
	var kubeconfig string
	cmd := &cobra.Command{
		Use:   "node-agent --node-name NODE",
		Short: "Run the node agent: GPU inventory, readiness, reservation GPU identity, NRI injection of limits",
		Long: `node-agent runs on every GPU node (a DaemonSet). It

  - reads the node's GPUs through NVML and publishes the node condition
    gpu-fractioning.nvidia.com/Ready, the enforcement the node can do
    (gpufrac.io/memory-enforcement: driver, mps-pinned or none) and, with
    --publish-gpu-labels, nvidia.com/gpu.count/.memory/.product where GPU
    Feature Discovery has not;
  - annotates reservation pods with the UUID of the GPU the kubelet gave
    them (PodResources API);
  - registers an NRI plugin with the container runtime that injects each
    fractional container's devices and limits, refuses the ones it cannot
    enforce (or, with --fail-open, starts them with no GPU) and evicts
    fractional containers found running without enforcement.

With --simulate-gpus=MACHINE (` + inventory.MachineHelp() + `) the GPUs come from
go-nvml's mock machines, the agent assigns reservation pods their GPUs
itself, and it hosts an in-process NRI runtime endpoint: for local clusters
with no GPU, kubelet or container runtime.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if opts.NodeName == "" {
				return errors.New("--node-name is required (in a DaemonSet: the downward API's spec.nodeName)")
			}
			if opts.Injection.GPUMemoryReserveMiB < 0 {
				return fmt.Errorf("--gpu-memory-reserve-mib %d: must be 0 or more", opts.Injection.GPUMemoryReserveMiB)
			}
			for model, v := range opts.GPUMemoryReserveMiBByModel {
				if v < 0 {
					return fmt.Errorf("--gpu-memory-reserve-mib-by-model %s=%d: must be 0 or more", model, v)
				}
			}
			if err := nodeapi.CheckBackendFlag(opts.MemoryLimits); err != nil {
				return err
			}
			if opts.DRA.StandingGPUs < -1 {
				return fmt.Errorf("--dra-standing-gpus %d: must be -1 (all GPUs) or a count", opts.DRA.StandingGPUs)
			}
			if opts.UsagePublishPeriod <= 0 {
				return fmt.Errorf("--usage-publish-period %s must be positive", opts.UsagePublishPeriod)
			}
			if opts.UsageWindow < opts.ResyncPeriod {
				return fmt.Errorf("--usage-window %s must be at least --resync-period (%s): it holds a reading per resync", opts.UsageWindow, opts.ResyncPeriod)
			}
			if opts.BurstReclaim != agent.BurstReclaimPriority && opts.BurstReclaim != agent.BurstReclaimOff {
				return fmt.Errorf("--burst-reclaim %q: must be %s (stop the lowest-priority tenant above its request on a GPU short of memory) or %s", opts.BurstReclaim, agent.BurstReclaimPriority, agent.BurstReclaimOff)
			}
			if opts.BurstReclaimBelowPercent < 1 || opts.BurstReclaimBelowPercent > 50 {
				return fmt.Errorf("--burst-reclaim-below %d: must be a percentage of a GPU's memory from 1 to 50", opts.BurstReclaimBelowPercent)
			}
			if opts.ResyncPeriod < time.Second {
				return fmt.Errorf("--resync-period %s must be at least 1s", opts.ResyncPeriod)
			}
			if opts.StopGrace < 0 || opts.StopGrace > 20*time.Second {
				return fmt.Errorf("--stop-grace %s: must be from 0 to 20s (a pod's default termination grace period is 30s, and stopping takes more than the grace)", opts.StopGrace)
			}
			if opts.SecurityStopGrace < time.Second || opts.SecurityStopGrace > 5*time.Minute || opts.SecurityStopGrace%time.Second != 0 {
				return fmt.Errorf("--security-stop-grace %s: must be whole seconds from 1s to 5m (0 would remove the pod from the API, and its share from every book, before its containers stop; more leaves an unenforced container running as long)", opts.SecurityStopGrace)
			}
			cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
				&clientcmd.ClientConfigLoadingRules{ExplicitPath: kubeconfig}, &clientcmd.ConfigOverrides{}).ClientConfig()
			if err != nil {
				return fmt.Errorf("kubeconfig: %w", err)
			}
			client, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				return err
			}
			if opts.MetricsAddr != "" {
				if opts.MetricsAuth, err = health.KubernetesAuthorizer(cfg); err != nil {
					return fmt.Errorf("--metrics-addr: %w", err)
				}
			}
			return agent.New(opts, client).Run(klog.NewContext(cmd.Context(), klog.Background()))
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.NodeName, "node-name", "", "the node this agent runs on (required)")
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, then $KUBECONFIG)")
	f.StringVar(&opts.SimulateGPUs, "simulate-gpus", "", "use a go-nvml mock machine instead of the GPUs: "+inventory.MachineHelp())
	f.StringVar(&opts.NRISocket, "nri-socket", opts.NRISocket, "the container runtime's NRI socket")
	f.StringVar(&opts.PodResourcesSocket, "pod-resources-socket", opts.PodResourcesSocket, "the kubelet's PodResources socket")
	f.StringVar(&opts.ReservationNamespace, "reservation-namespace", opts.ReservationNamespace, "namespace of the reservation pods")
	f.StringSliceVar(&opts.ForeignReservationNamespaces, "foreign-reservation-namespace", opts.ForeignReservationNamespaces,
		"namespaces of another scheduler's reservation pods (KAI's): a share's GPU they hold is held; one held by any other pod is not, and its share is stopped; repeatable")
	f.StringVar(&opts.StateDir, "state-dir", opts.StateDir, "directory for the agent's state (GPU memory leases) and sockets")
	f.StringVar(&opts.ProcRoot, "proc-root", opts.ProcRoot, "the host's /proc (run with hostPID, or mount it), to find containers' cgroups")
	f.BoolVar(&opts.FailOpen, "fail-open", false, "start fractional containers that cannot be enforced WITHOUT a GPU instead of refusing them")
	f.StringVar(&opts.MemoryLimits, "memory-limits", opts.MemoryLimits, "how to enforce GPU memory limits: auto (the strongest the driver allows), driver (gpufrac's hook; r615/CUDA 13.4), toolkit (NVIDIA Container Toolkit's CDI hook), mps-pinned (MPS client limit only; weak) or off (node not ready for fractions unless --fail-open)")
	f.StringSliceVar(&opts.Injection.VisibilityExempt, "gpu-visibility-exempt-namespaces", nil, "namespaces whose pods keep every GPU they name despite --restrict-gpu-visibility: the node's GPU software (NVIDIA's device plugin, DCGM, the node agent's own namespace); only admins may create pods there")
	f.BoolVar(&opts.Injection.RestrictVisibility, "restrict-gpu-visibility", opts.Injection.RestrictVisibility, "make every container on the node see only the GPUs granted to it (its gpufrac share, the device plugin's allocation read through the kubelet's PodResources API, its DRA shares): any other NVIDIA_VISIBLE_DEVICES value, such as a CUDA image's \"all\" on a pod that asked for no GPU, becomes the grant or \"void\"")
	f.BoolVar(&opts.Injection.ExclusiveProcess, "exclusive-process", opts.Injection.ExclusiveProcess, "keep the GPUs that fractions share through MPS in the EXCLUSIVE_PROCESS compute mode (and give them their mode back when shared no more), so that no process outside MPS escapes its share; needs root and the GPUs' device nodes")
	f.BoolVar(&opts.PublishGPULabels, "publish-gpu-labels", false, "set nvidia.com/gpu.count/.memory/.product where GPU Feature Discovery has not")
	f.StringVar(&opts.Injection.HookPath, "hook-path", opts.Injection.HookPath, "gpufrac binary on the host, run as the createRuntime hook that applies memory limits; empty: no hook")
	f.StringVar(&opts.Injection.MPSRoot, "mps-pipe-dir", opts.Injection.MPSRoot, "host directory of the node's MPS control daemon (run by `gpufrac mps-daemon`): its pipe directory, with the sm-sharing containers' namespaces, is PIPE-DIR/pipe")
	f.StringVar(&opts.MPSControl, "mps-control", opts.MPSControl, "the MPS control program, to manage the daemon's namespaces")
	f.StringVar(&opts.CgroupRoot, "cgroup-root", opts.CgroupRoot, "the host's cgroup file system (mount it read-only), to check for cgroup v2 with the dmem or misc controller")
	f.BoolVar(&opts.Injection.AllowRootMPSClients, "allow-root-mps-clients", false, "let fractional containers (every one an MPS client) run as root outside a user namespace; the MPS control daemon obeys root's administrative commands (quit), so by default such a container is refused")
	f.StringVar(&opts.Injection.ShimDir, "nvidia-smi-shim-dir", "", "host directory of the nvidia-smi view library; empty: not mounted")
	f.StringToInt64Var(&opts.GPUMemoryReserveMiBByModel, "gpu-memory-reserve-mib-by-model", nil, "per GPU model (the node's nvidia.com/gpu.product label), MODEL=MIB,... overriding --gpu-memory-reserve-mib")
	f.Int64Var(&opts.Injection.GPUMemoryReserveMiB, "gpu-memory-reserve-mib", 0, "MiB kept back on each GPU, the one place it is set: published on the node as gpufrac.io/gpu-memory-reserve-mib, which the scheduler, audit, top and the dashboard read; an sm-sharing pod placed without a compute portion, as released KAI places them, gets request ÷ (GPU memory − reserve)")
	f.StringVar(&opts.HealthAddr, "health-addr", opts.HealthAddr, "address of /healthz and /readyz (plain HTTP, for the kubelet's probes); empty disables")
	f.StringVar(&opts.MetricsAddr, "metrics-addr", opts.MetricsAddr, "address of /metrics, over TLS (a self-signed certificate) for callers with a token the API server accepts and the right to get the non-resource URL /metrics (the chart's gpufrac-metrics-reader role); empty disables")
	f.DurationVar(&opts.ResyncPeriod, "resync-period", opts.ResyncPeriod, "how often to re-read the GPUs, republish and annotate reservation pods (and read what the tenants use)")
	f.DurationVar(&opts.UsagePublishPeriod, "usage-publish-period", opts.UsagePublishPeriod, "how often, at most, the tenants' use is rewritten on the Node (annotation gpufrac.io/gpu-usage) for gpufrac top and the dashboard; /metrics has every reading")
	f.StringVar(&opts.BurstReclaim, "burst-reclaim", opts.BurstReclaim, "what to do when a GPU runs short of memory while tenants use more than their request: priority (stop the lowest-priority one above its request first, then the one furthest above it; never one within its request) or off (leave it to the driver)")
	f.IntVar(&opts.BurstReclaimBelowPercent, "burst-reclaim-below", opts.BurstReclaimBelowPercent, "free memory, in percent of a GPU's, below which --burst-reclaim acts")
	f.DurationVar(&opts.UsageWindow, "usage-window", opts.UsageWindow, "how far back the agent remembers its tenants' GPU use (a reading per resync, in memory) for the percentiles it publishes on the Node (gpufrac top --advise)")
	f.DurationVar(&opts.SecurityStopGrace, "security-stop-grace", opts.SecurityStopGrace, "the most grace the agent's deletions give a pod it must stop (a container unenforced, a root MPS client, a share no reservation holds), whatever terminationGracePeriodSeconds or preStop hook its tenant wrote")
	f.DurationVar(&opts.StopGrace, "stop-grace", opts.StopGrace, "how long a stopping agent, its node already marked not ready, keeps serving the runtime for the containers of pods placed just before (keep it below the pod's termination grace period)")
	f.BoolVar(&opts.DRA.Enabled, "dra", false, "also serve GPU shares through Dynamic Resource Allocation (driver gpu.gpufrac.io): publish the node's shared GPUs as ResourceSlices and prepare claims as the NRI plugin injects annotated containers (Kubernetes 1.36+)")
	f.IntVar(&opts.DRA.StandingGPUs, "dra-standing-gpus", opts.DRA.StandingGPUs, "with --dra, how many of the node's GPUs to hold for shares at all times (claims and annotation shares; no whole-GPU pod gets them): -1 for all")
	// Empty defaults: the agent picks the kubelet's directories on a real
	// node and its own state directory on a simulated one, so that the
	// agents of a local cluster never share (or touch) the host's.
	f.StringVar(&opts.DRA.PluginDir, "dra-plugin-dir", "", "with --dra, the kubelet plugin's directory (its gRPC socket); default "+agent.DefaultDRAPluginDir+", or STATE-DIR/dra-plugin with --simulate-gpus")
	f.StringVar(&opts.DRA.RegistrarDir, "dra-registrar-dir", "", "with --dra, the kubelet's plugin registration directory; default "+agent.DefaultDRARegistrarDir+", or STATE-DIR/dra-registry with --simulate-gpus")
	f.StringVar(&opts.DRA.CDIDir, "dra-cdi-dir", "", "with --dra, where the container runtime reads CDI specs: prepared claims' specs go there; default "+agent.DefaultCDIDir+", or STATE-DIR/cdi with --simulate-gpus")
	return cmd
}
