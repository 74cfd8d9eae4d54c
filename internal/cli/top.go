package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/clusterview"
)

func newTopCommand() *cobra.Command {
	var (
		kubeconfig string
		output     string
		advise     bool
	)
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Show every GPU: its mode, fractional tenants (request, limit, compute), free memory, whole-GPU pods",
		Long: `Show the cluster's GPUs as gpufrac sees them: per node and per shared GPU,
the compute mode, the fractional tenants with their memory request and limit and
sm-sharing compute portion, what each uses now (as its node's agent measured
it; "-" where there is no reading or the driver cannot say), and the free
memory; the whole-GPU pods and idle GPUs; and a summary line with the GPU
memory allocated and the share of free memory stranded on shared GPUs.

With --advise, it also suggests resizes from the 95th percentile of each
tenant's use over the agents' window (--usage-window, default 1h) against its
request, never below what it holds now, each with the kubectl line that asks
for it (docs/resize.md).

As a kubectl plugin: put a link named kubectl-gpufrac to this binary on your
PATH, then run "kubectl gpufrac top".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "" && output != "json" {
				return &ExitError{Code: 2, Err: fmt.Errorf("top: -o %q: the only output format is json", output)}
			}
			client, err := clusterClient(kubeconfig)
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("top: %w", err)}
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), time.Minute)
			defer cancel()
			nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("top: list nodes: %w", err)}
			}
			pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("top: list pods: %w", err)}
			}
			claims, err := listClaims(ctx, client)
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("top: %w", err)}
			}
			view := clusterview.Build(nodes.Items, pods.Items, claims)
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(view)
			}
			if err := clusterview.Render(cmd.OutOrStdout(), view); err != nil || !advise {
				return err
			}
			_, _ = fmt.Fprintln(cmd.OutOrStdout())
			return clusterview.RenderAdvice(cmd.OutOrStdout(), view)
		},
	}
	f := cmd.Flags()
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
	f.StringVarP(&output, "output", "o", "", "json for machines (with each tenant's use and advice)")
	f.BoolVar(&advise, "advise", false, "also suggest resizes from each tenant's use over the agents' window, with the kubectl line for each")
	return cmd
}
