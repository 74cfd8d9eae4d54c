package cli

import (
	"fmt"
	"os"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
)

func newHookCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hook",
		Short: "OCI runtime hooks the node agent's NRI plugin installs into fractional containers",
		Args:  cobra.NoArgs,
	}
	procRoot := "/proc"
	apply := &cobra.Command{
		Use:   "apply-memory-limits",
		Short: "createRuntime hook: set the container cgroup's GPU memory limits in the driver (soft = request, hard = limit)",
		Long: `apply-memory-limits runs as an OCI createRuntime hook: the runtime passes the
container's state on stdin, after its cgroup exists and before its process
runs. It resolves the cgroup v2 path from the container's pid and, for each
GPU in GPUFRAC_DEVICES, sets soft = GPUFRAC_MEMORY_REQUEST_MIB and hard =
GPUFRAC_MEMORY_LIMIT_MIB through NVML's SetMemoryLimits_v1 (CUDA 13.4,
driver r615, kernel dmem controller), then reads them back. Any failure
exits non-zero with the GPU, cgroup and NVML error, which fails the
container's creation: a container never runs without its limits.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := enforce.RunHook(cmd.InOrStdin(), os.Getenv, procRoot, nvml.New()); err != nil {
				return &ExitError{Code: 1, Err: fmt.Errorf("gpufrac hook: %w", err)}
			}
			return nil
		},
	}
	apply.Flags().StringVar(&procRoot, "proc-root", procRoot, "where /proc is (for tests)")
	_ = apply.Flags().MarkHidden("proc-root")
	cmd.AddCommand(apply)
	return cmd
}
