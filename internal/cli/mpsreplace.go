package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/internal/drain"
)

func newMPSReplaceCommand() *cobra.Command {
	var (
		kubeconfig string
		opts       drain.Options
	)
	cmd := &cobra.Command{
		Use:   "mps-replace NODE",
		Short: "Drain a node's GPU shares and replace its MPS daemon (a new image or MPS setting, a wedged daemon)",
		Long: `mps-replace replaces a node's MPS control daemon, which every tenant's GPU
context lives in, the way a node is drained: it closes the node to new
fractions (label gpufrac.io/fractions-closed: the scheduler places none, the
node agent reports it not ready to other schedulers and offers no DRA
shares), evicts the node's shares (annotated fractions, gpufrac DRA claims)
through the Eviction API, so their PodDisruptionBudgets are honoured,
retrying refused evictions until --timeout, then deletes the daemon's pod
(the chart's <release>-mps DaemonSet, updateStrategy OnDelete, starts one
from its current template: a new image, a changed nodeAgent.mps value), waits
for it and for the node agent to report the node ready, and reopens the node.

Shares a budget still holds at --timeout keep running: the daemon is not
replaced, the node stays closed, and the command fails naming them. Run it
again once their owners can spare them, or --reopen. Other pods on the node
are not touched.

--drain-only stops after the evictions and leaves the node closed (before a
GPU driver upgrade, which replaces the daemon itself); --reopen only reopens.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.Timeout <= 0 || opts.ReadyTimeout <= 0 {
				return fmt.Errorf("--timeout %s, --ready-timeout %s: must be positive", opts.Timeout, opts.ReadyTimeout)
			}
			if opts.DrainOnly && opts.Reopen {
				return fmt.Errorf("--drain-only and --reopen: choose one")
			}
			client, err := clusterClient(kubeconfig)
			if err != nil {
				return err
			}
			opts.Node, opts.Out = args[0], cmd.OutOrStdout()
			return drain.Run(cmd.Context(), client, opts)
		},
	}
	f := cmd.Flags()
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
	f.StringVarP(&opts.Namespace, "namespace", "n", "gpufrac-system", "the gpufrac release's namespace, where the MPS daemon pods run")
	f.StringVar(&opts.Selector, "selector", "app.kubernetes.io/name=gpufrac-mps", "label selector of the MPS daemon pods (the chart's: app.kubernetes.io/name=<fullname>-mps)")
	f.DurationVar(&opts.Timeout, "timeout", 10*time.Minute, "how long evictions refused by disruption budgets are retried")
	f.DurationVar(&opts.ReadyTimeout, "ready-timeout", 5*time.Minute, "how long to wait for the new daemon and the node agent")
	f.DurationVar(&opts.Poll, "poll", 2*time.Second, "how often refused evictions are retried and readiness checked")
	f.BoolVar(&opts.DrainOnly, "drain-only", false, "close the node and evict its shares, and stop there")
	f.BoolVar(&opts.Reopen, "reopen", false, "only reopen the node to fractions")
	return cmd
}
