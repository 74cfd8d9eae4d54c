// Package cli holds the gpufrac subcommands. Each command is a thin
// adapter: flags and output here, decisions in pkg/.
package cli

import (
	"fmt"

	"github.com/spf13/cobra"
)

// ExitError asks main to exit with Code after the command has printed what
// it found; Err, when set, is printed first.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err != nil {
		return e.Err.Error()
	}
	return fmt.Sprintf("exit status %d", e.Code)
}

func (e *ExitError) Unwrap() error { return e.Err }

// NewRootCommand builds the gpufrac command tree.
func NewRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "gpufrac",
		Short: "Fractions of a GPU for Kubernetes pods, with an enforced memory share",
		Long: `gpufrac gives Kubernetes workloads a fraction of a GPU with a real, enforced
memory share. Pods ask with annotations (gpu-fraction, gpu-memory, ...); the
scheduler side places them, the node side enforces the limits.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newValidateCommand(), newWebhookCommand(), newNodeAgentCommand(), newHookCommand(), newSimCommand(), newReplayCommand(), newSchedulerCommand(), newAuditCommand(), newTopCommand(), newUpCommand(), newWaitCommand(), newDownCommand(), newExplainCommand(), newDashboardCommand(), newInventoryCommand(), newUsageCommand(), newMPSDaemonCommand(), newMPSReplaceCommand(), newExclusiveProcessCommand())
	return root
}
