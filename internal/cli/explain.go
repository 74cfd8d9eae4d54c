package cli

import (
	"bufio"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/internal/explain"
	"github.com/gpufrac/gpufrac/pkg/node/agent"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func newExplainCommand() *cobra.Command {
	var o explain.Node
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
	f.StringVar(&o.MemoryLimits, "memory-limits", string(nodeapi.BackendDriver), "the node's memory-limit backend: driver, toolkit, mps-pinned, off, or auto (the strongest the --simulate-gpus machine's driver allows)")
	f.BoolVar(&o.FailOpen, "fail-open", false, "the node agent's --fail-open")
	agentDefaults := agent.DefaultOptions().Injection
	f.StringVar(&o.Injection.HookPath, "hook-path", agentDefaults.HookPath, "the node agent's --hook-path")
	f.StringVar(&o.Injection.MPSRoot, "mps-pipe-dir", agentDefaults.MPSRoot, "the node agent's --mps-pipe-dir")
	f.StringVar(&o.MPS, "mps", "auto", "the interface of the node's MPS daemon: v3 (driver r615 and later), v2 (older drivers), none (the daemon is down), or auto (v3 with the driver or toolkit backend, which need r615; else the --simulate-gpus machine's driver's)")
	f.StringVar(&o.Injection.ShimDir, "nvidia-smi-shim-dir", "", "the node agent's --nvidia-smi-shim-dir")
	f.Int64Var(&o.Injection.GPUMemoryReserveMiB, "gpu-memory-reserve-mib", 0, "the node agent's --gpu-memory-reserve-mib")
	f.StringVar(&o.SimulateGPUs, "simulate-gpus", "dgxh100", "the mock machine whose GPUs the node has: "+strings.Join(inventory.Machines, ", "))
	f.Int64Var(&o.GPUMemoryMiB, "gpu-memory-mib", 0, "memory per GPU, MiB, instead of the mock machine's")
	f.BoolVar(&o.Injection.RestrictVisibility, "restrict-gpu-visibility", agentDefaults.RestrictVisibility, "the node agent's --restrict-gpu-visibility")
	f.StringSliceVar(&o.Injection.VisibilityExempt, "gpu-visibility-exempt-namespaces", nil, "the node agent's --gpu-visibility-exempt-namespaces")
	f.BoolVar(&o.Injection.ExclusiveProcess, "exclusive-process", agentDefaults.ExclusiveProcess, "the node agent's --exclusive-process")
	f.BoolVar(&o.Injection.AllowRootMPSClients, "allow-root-mps-clients", false, "the node agent's --allow-root-mps-clients")
	return cmd
}

func runExplain(stdin io.Reader, stdout io.Writer, file string, o explain.Node) error {
	cfg, err := o.Config()
	if err != nil {
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %w", err)}
	}
	objs, err := readManifest(stdin, file)
	if err != nil {
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %w", err)}
	}
	out := bufio.NewWriter(stdout)
	code, pods, err := explain.Pods(out, objs, cfg)
	if ferr := out.Flush(); ferr != nil {
		return ferr
	}
	switch {
	case err != nil:
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %w", err)}
	case pods == 0:
		return &ExitError{Code: exitUnreadable, Err: fmt.Errorf("explain: %s holds no Pod (explain reads pods as scheduled: kubectl get pod NAME -o yaml)", file)}
	case code != 0:
		return &ExitError{Code: code}
	}
	return nil
}
