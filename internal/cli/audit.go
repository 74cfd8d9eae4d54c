package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpufrac/gpufrac/pkg/audit"
)

func newAuditCommand() *cobra.Command {
	var (
		kubeconfig  string
		orphanGrace time.Duration
		selector    string
	)
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Check every GPU's tenants against gpufrac's guarantees; exit 1 on any violation",
		Long: `Read the cluster's nodes and pods and report every violation of the
scheduler's guarantees (SPEC §2), one per line:

  GPUOverCommitted           tenants' memory requests exceed the GPU's schedulable memory
  MixedComputeModes          a GPU runs both time-slicing and sm-sharing
  ComputePortionOverOne      sm-sharing portions on a GPU sum above 1
  FractionWithoutDevices     a bound fractional pod carries no .gpus.devices
  InvalidDecision            a bound fractional pod's decision cannot be read
  DeviceWithoutReservation   a pod uses a GPU no reservation pod on its node holds
  OrphanReservationPod       a reservation pod holds a GPU for no pod
  NodeGPUsOverCommitted      a node's pods hold more GPUs than it has

Exit status: 0 when clean, 1 on any violation, 2 when the cluster cannot be read.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, err := clusterClient(kubeconfig)
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("audit: %w", err)}
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Minute)
			defer cancel()
			if _, err := labels.Parse(selector); err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("audit: --node-selector %q: %w", selector, err)}
			}
			nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: selector})
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("audit: list nodes: %w", err)}
			}
			pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("audit: list pods: %w", err)}
			}
			if selector != "" {
				pods.Items = audit.OnNodes(pods.Items, nodes.Items)
			}
			claims, err := listClaims(ctx, client)
			if err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("audit: %w", err)}
			}
			found := audit.Check(nodes.Items, pods.Items, claims, audit.Options{
				OrphanGrace: orphanGrace,
				Now:         time.Now(),
			})
			out := cmd.OutOrStdout()
			for _, v := range found {
				fmt.Fprintln(out, v)
			}
			for _, r := range audit.Resizes(pods.Items) {
				fmt.Fprintln(out, r)
			}
			for _, r := range audit.Reclaims(nodes.Items, pods.Items, claims) {
				fmt.Fprintln(out, r)
			}
			if len(found) > 0 {
				return &ExitError{Code: 1, Err: fmt.Errorf("audit: %d violation(s) on %d node(s) and %d pod(s)", len(found), len(nodes.Items), len(pods.Items))}
			}
			fmt.Fprintf(out, "audit: clean: %d node(s), %d pod(s)\n", len(nodes.Items), len(pods.Items))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
	f.StringVar(&selector, "node-selector", "", "audit only the nodes with these labels (e.g. pool=gpu-a), and the pods on them")
	f.DurationVar(&orphanGrace, "orphan-grace", time.Minute, "spare reservation pods younger than this (the scheduler creates one just before it binds)")
	return cmd
}

// clusterClient connects as a person's tools do: --kubeconfig, else
// $KUBECONFIG, ~/.kube/config, or in-cluster.
func clusterClient(kubeconfig string) (kubernetes.Interface, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	config, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, nil).ClientConfig()
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(config)
}
