package cli

import (
	"bufio"
	"fmt"
	"io"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/manifest"
	"github.com/gpufrac/gpufrac/pkg/node/agent"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// Exit codes of `gpufrac explain`.
const (
	exitWouldRefuse = 1 // a container would not be allowed to start
)

type explainOptions struct {
	memoryLimits string
	failOpen     bool
	simulateGPUs string
	gpuMemoryMiB int64
	mps          string
	cfg          injection.Config
}

func newExplainCommand() *cobra.Command {
	var o explainOptions
	cmd := &cobra.Command{
		Use:   "explain FILE|-",
		Short: "Show what the node agent would do to a scheduled pod's containers",
		Long: `explain reads pod manifests as they stand after scheduling (kubectl get pod -o
yaml, with the scheduler's annotations) and prints, per container and init
container, exactly what gpufrac's node agent would do when the runtime creates
it: the environment it sets and removes, the mounts, the createRuntime hook,
the MPS namespace and what is done before it starts — or why it refuses the
container. It runs the very judgement the agent's NRI plugin runs at creation
and in its audit (injection.Judge), with the node's settings given as flags
and the GPU inventory of a go-nvml mock machine. What only the node knows is
taken as follows: the GPUs the device plugin allocates a container are
<allocated-1>..<allocated-N> for its nvidia.com/gpu limit, no other running
container consumes its DRA shares, and no resize happened since it was placed.

For each container it prints a header line, then what is done:
  <namespace>/<name> container <c>: RUN | FAIL-OPEN | REFUSE[: reason]

Exit status: 0 when every container would run (failing open counts: it
runs), 1 when any would be refused, 2 when the input cannot be read or holds
no Pod.`,
		Example: `  kubectl get pod llm-0 -o yaml | gpufrac explain -
  gpufrac explain --memory-limits toolkit --fail-open pod.yaml`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runExplain(cmd.InOrStdin(), cmd.OutOrStdout(), args[0], o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.memoryLimits, "memory-limits", string(nodeapi.BackendDriver), "the node's memory-limit backend: driver, toolkit, mps-pinned, off, or auto (the strongest the --simulate-gpus machine's driver allows)")
	f.BoolVar(&o.failOpen, "fail-open", false, "the node agent's --fail-open")
	agentDefaults := agent.DefaultOptions().Injection
	f.StringVar(&o.cfg.HookPath, "hook-path", agentDefaults.HookPath, "the node agent's --hook-path")
	f.StringVar(&o.cfg.MPSRoot, "mps-pipe-dir", agentDefaults.MPSRoot, "the node agent's --mps-pipe-dir")
	f.StringVar(&o.mps, "mps", "auto", "the interface of the node's MPS daemon: v3 (driver r615 and later), v2 (older drivers), none (the daemon is down), or auto (v3 with the driver or toolkit backend, which need r615; else the --simulate-gpus machine's driver's)")
	f.StringVar(&o.cfg.ShimDir, "nvidia-smi-shim-dir", "", "the node agent's --nvidia-smi-shim-dir")
	f.Int64Var(&o.cfg.GPUMemoryReserveMiB, "gpu-memory-reserve-mib", 0, "the node agent's --gpu-memory-reserve-mib")
	f.StringVar(&o.simulateGPUs, "simulate-gpus", "dgxh100", "the mock machine whose GPUs the node has: "+strings.Join(inventory.Machines, ", "))
	f.Int64Var(&o.gpuMemoryMiB, "gpu-memory-mib", 0, "memory per GPU, MiB, instead of the mock machine's")
	f.BoolVar(&o.cfg.RestrictVisibility, "restrict-gpu-visibility", agentDefaults.RestrictVisibility, "the node agent's --restrict-gpu-visibility")
	f.StringSliceVar(&o.cfg.VisibilityExempt, "gpu-visibility-exempt-namespaces", nil, "the node agent's --gpu-visibility-exempt-namespaces")
	f.BoolVar(&o.cfg.ExclusiveProcess, "exclusive-process", agentDefaults.ExclusiveProcess, "the node agent's --exclusive-process")
	f.BoolVar(&o.cfg.AllowRootMPSClients, "allow-root-mps-clients", false, "the node agent's --allow-root-mps-clients")
	return cmd
}

func runExplain(stdin io.Reader, stdout io.Writer, file string, o explainOptions) error {
	cfg, err := o.nodeConfig()
	if err != nil {
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %w", err)}
	}
	objs, err := readManifest(stdin, file)
	if err != nil {
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %w", err)}
	}
	out := bufio.NewWriter(stdout)
	code, pods := 0, 0
	for _, obj := range objs {
		if obj.Kind != "Pod" {
			continue
		}
		if obj.Err != nil {
			if err := out.Flush(); err != nil {
				return err
			}
			return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %s/%s: %w", obj.Namespace, obj.Name, obj.Err)}
		}
		pods++
		if c := explainPod(out, obj, cfg); c > code {
			code = c
		}
	}
	if err := out.Flush(); err != nil {
		return err
	}
	if pods == 0 {
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %s holds no Pod (explain reads pods as scheduled: kubectl get pod NAME -o yaml)", file)}
	}
	if code != 0 {
		return &ExitError{Code: code}
	}
	return nil
}

// nodeConfig is the injection configuration a node agent with these flags
// would use on the mock machine.
func (o explainOptions) nodeConfig() (injection.Config, error) {
	cfg := o.cfg
	cfg.FailOpen = o.failOpen
	if cfg.GPUMemoryReserveMiB < 0 {
		return cfg, fmt.Errorf("--gpu-memory-reserve-mib %d: must be 0 or more", cfg.GPUMemoryReserveMiB)
	}
	if err := nodeapi.CheckBackendFlag(o.memoryLimits); err != nil {
		return cfg, err
	}
	lib, err := inventory.Simulated(o.simulateGPUs)
	if err != nil {
		return cfg, err
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		return cfg, err
	}
	cfg.Backend = nodeapi.Backend(o.memoryLimits)
	if o.memoryLimits == "auto" {
		// As the agent resolves it; an explicit choice is taken as given,
		// to show a node configured so.
		cfg.Backend, _ = injection.ChooseBackend("auto", inv.Capability())
	}
	if len(inv.GPUs) > 0 {
		cfg.GPUMemoryMiB = inv.GPUs[0].MemoryMiB
	}
	switch o.mps {
	case "auto":
		// The driver and toolkit backends need r615, which has MPS v3; a
		// node shown with one of them has v3 whatever the mock's driver.
		major, err := mps.DriverMajor(inv.DriverVersion)
		if err != nil {
			return cfg, err
		}
		if cfg.Backend.DriverLimits() {
			major = max(major, mps.ReleaseV3)
		}
		cfg.MPS = mps.ProtocolFor(major)
	case string(nodeapi.MPSv3), string(nodeapi.MPSv2):
		cfg.MPS = nodeapi.MPS(o.mps)
	case "none":
		cfg.MPS = nodeapi.MPSNone
	default:
		return cfg, fmt.Errorf("--mps %q: must be auto, v3, v2 or none", o.mps)
	}
	if o.gpuMemoryMiB != 0 {
		if o.gpuMemoryMiB < 0 {
			return cfg, fmt.Errorf("--gpu-memory-mib %d: must be more than 0", o.gpuMemoryMiB)
		}
		cfg.GPUMemoryMiB = o.gpuMemoryMiB
	}
	return cfg, nil
}

// explainPod prints the decision for each of the pod's containers, init
// containers first (the order the kubelet creates them in), and returns
// its exit code.
func explainPod(out io.Writer, obj manifest.Object, cfg injection.Config) int {
	ns := obj.Namespace
	if ns == "" {
		ns = "default"
	}
	pod := injection.Pod{UID: string(obj.Meta.UID), Namespace: ns, Annotations: obj.Template.Annotations}
	if pod.UID == "" {
		pod.UID = "<pod-uid>"
	}
	code := 0
	containers := append(slices.Clone(obj.Template.Spec.InitContainers), obj.Template.Spec.Containers...)
	for i, c := range containers {
		kind := "container"
		if i < len(obj.Template.Spec.InitContainers) {
			kind = "init container"
		}
		fact := containerFacts(pod, obj.Template.Spec, c, cfg)
		d := injection.Judge(fact, cfg)
		head := fmt.Sprintf("%s/%s %s %s", ns, obj.Name, kind, c.Name)
		switch d.Verdict {
		case injection.Refuse:
			fmt.Fprintf(out, "%s: REFUSE: %v\n", head, d.Reason)
			code = exitWouldRefuse
			continue
		case injection.FailedOpen:
			fmt.Fprintf(out, "%s: FAIL-OPEN: %v\n", head, d.Reason)
		default:
			fmt.Fprintf(out, "%s: RUN\n", head)
		}
		printDecision(out, d)
		if d.Assignment != nil && fact.UID == nil && !fact.UserNamespace && !cfg.AllowRootMPSClients {
			fmt.Fprintln(out, "  note: the manifest does not say its user (runAsUser): the node refuses it if its image runs it as root (uid 0), as a client of the node's MPS daemon")
		}
	}
	return code
}

func printDecision(out io.Writer, d injection.Decision) {
	if d.Adjustment == nil {
		fmt.Fprintln(out, "  nothing changed: the pod asks for no GPU fraction")
		for _, e := range d.Effects {
			if e.Kind == injection.EffectClaimShares {
				fmt.Fprintf(out, "  dra: the container is the one consumer of %s\n", strings.Join(e.Shares, ","))
			}
		}
		return
	}
	if a := d.Assignment; a != nil {
		share := fmt.Sprintf("  share: %s on %s, request %dMi, limit %dMi", a.Mode, strings.Join(a.Devices, ","), a.RequestMiB, a.LimitMiB)
		if !a.Portion.IsZero() {
			share += fmt.Sprintf(", compute portion %s", a.Portion)
		}
		fmt.Fprintln(out, share)
	} else {
		fmt.Fprintln(out, "  share: none (the container is shown no GPU)")
	}
	var set, removed []string
	for _, kv := range d.Adjustment.GetEnv() {
		if k, gone := nriapi.IsMarkedForRemoval(kv.Key); gone {
			removed = append(removed, k)
		} else {
			set = append(set, kv.Key+"="+kv.Value)
		}
	}
	// A key removed and then set is replaced: list it once, as set.
	removed = slices.DeleteFunc(removed, func(k string) bool {
		return slices.ContainsFunc(set, func(kv string) bool { return strings.HasPrefix(kv, k+"=") })
	})
	for _, kv := range set {
		fmt.Fprintf(out, "  env set: %s\n", kv)
	}
	for _, k := range removed {
		fmt.Fprintf(out, "  env removed: %s\n", k)
	}
	for _, m := range d.Adjustment.GetMounts() {
		fmt.Fprintf(out, "  mount: %s -> %s (%s, %s)\n", m.Source, m.Destination, m.Type, strings.Join(m.Options, ","))
	}
	for _, h := range d.Adjustment.GetHooks().GetCreateRuntime() {
		fmt.Fprintf(out, "  hook createRuntime: %s env %s\n", strings.Join(h.Args, " "), strings.Join(h.Env, " "))
	}
	if d.Policed != "" {
		fmt.Fprintf(out, "  visibility: %s\n", d.Policed)
	}
	for _, e := range d.Effects {
		switch e.Kind {
		case injection.EffectMPSNamespace:
			fmt.Fprintf(out, "  mps: namespace %s, active-thread ceiling %d%%, set before the container starts\n", e.Namespace, e.Threads)
		case injection.EffectExclusive:
			fmt.Fprintf(out, "  compute mode: %s kept in EXCLUSIVE_PROCESS before the container starts\n", strings.Join(e.Devices, ","))
		case injection.EffectClaimShares:
			fmt.Fprintf(out, "  dra: the container is the one consumer of %s\n", strings.Join(e.Shares, ","))
		}
	}
	for _, n := range d.Notes {
		fmt.Fprintf(out, "  note: %s\n", n)
	}
}

// containerEnv is the container's literal environment, KEY=VALUE, as the
// runtime will pass it (values from ConfigMaps or fields are not known
// here and are left out).
func containerEnv(c corev1.Container) []string {
	var env []string
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env = append(env, e.Name+"="+e.Value)
		}
	}
	return env
}

// containerFacts are the facts the node judges container c by, as far as
// a manifest tells them: its literal environment, its user (runAsUser;
// unknown where neither the container nor the pod says), its user
// namespace (hostUsers: false), and, where the node polices it, its grant
// as the device plugin would allocate it (placeholders, one per
// nvidia.com/gpu of its limits).
func containerFacts(pod injection.Pod, spec corev1.PodSpec, c corev1.Container, cfg injection.Config) injection.Container {
	fact := injection.Container{Pod: pod, Name: c.Name, Env: containerEnv(c), UserNamespace: spec.HostUsers != nil && !*spec.HostUsers}
	if sc := c.SecurityContext; sc != nil && sc.RunAsUser != nil {
		uid := uint32(*sc.RunAsUser)
		fact.UID = &uid
	} else if psc := spec.SecurityContext; psc != nil && psc.RunAsUser != nil {
		uid := uint32(*psc.RunAsUser)
		fact.UID = &uid
	}
	if injection.NeedsGrant(fact, cfg) {
		fact.Grant.Read = true
		n := c.Resources.Limits.Name(api.ResourceGPU, resource.DecimalSI).Value()
		for i := range n {
			fact.Grant.IDs = append(fact.Grant.IDs, fmt.Sprintf("<allocated-%d>", i+1))
		}
	}
	return fact
}
