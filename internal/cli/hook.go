package cli

import (
	"fmt"
	"os"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/pkg/node/agent"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
)

func newHookCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hook",
		Short: "OCI runtime hooks the node agent's NRI plugin installs into fractional containers",
		Args:  cobra.NoArgs,
	}
	procRoot := agent.DefaultOptions().ProcRoot
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
	cmd.AddCommand(apply, newHookInstallCommand())
	return cmd
}

// newHookInstallCommand is the node agent's init container: the image has
// no shell, and a plain copy over a hook that runc is running fails.
func newHookInstallCommand() *cobra.Command {
	var binDir, libDir, library string
	cmd := &cobra.Command{
		Use:   "install",
		Short: "copy this binary (the hook) and the nvidia-smi view library to the host (the node agent's init container)",
		Long: `install copies the running gpufrac binary to --bin-dir/gpufrac, where the node
agent's hook spec points runc, and the nvidia-smi view library to
--lib-dir/libnvidia-ml.so.1, which fractional containers mount. Each file is
written beside the old one and renamed over it: a hook runc is executing and
a library containers have mapped are never changed under them.`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			self, err := os.Executable()
			if err != nil {
				return fmt.Errorf("gpufrac hook install: %w", err)
			}
			if err := enforce.Install(self, binDir, "gpufrac", 0o755); err != nil {
				return err
			}
			return enforce.Install(library, libDir, "libnvidia-ml.so.1", 0o644)
		},
	}
	cmd.Flags().StringVar(&binDir, "bin-dir", "/host/bin", "host directory for the hook binary (the chart's nodeAgent.hostBinDir, mounted)")
	cmd.Flags().StringVar(&libDir, "lib-dir", "/host/lib", "host directory for the nvidia-smi view library (the chart's nodeAgent.hostLibDir, mounted)")
	cmd.Flags().StringVar(&library, "library", "/usr/local/lib/gpufrac/libnvidia-ml.so.1", "the view library in the image")
	return cmd
}
