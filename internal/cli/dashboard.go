package cli

import (
	"fmt"
	"net"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/internal/dashboard"
)

func newDashboardCommand() *cobra.Command {
	var (
		kubeconfig string
		listen     string
		hosts      []string
	)
	cmd := &cobra.Command{
		Use:   "dashboard",
		Short: "Serve a read-only web view of the cluster's GPUs, updated as pods come and go",
		Long: `Serve a read-only web page of the cluster's GPUs, as gpufrac top shows them:
per node and GPU the compute mode, each fractional tenant's memory request
(solid) and burst room up to its limit (hatched), sm-sharing portions, the
free schedulable memory and the reserve, whole-GPU pods, idle GPUs, the
node's readiness and enforcement backend; the cluster's allocation and
stranded memory; and the pending fractional pods with the scheduler's own
reason. Clicking a tenant shows its annotations.

It watches pods, nodes and FailedScheduling events (get, list and watch are
all it needs) and pushes each change to open pages. Everything it serves is
in the binary. /api/view is the view as JSON (gpufrac top -o json, with the
reasons).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, err := clusterClient(kubeconfig)
			if err != nil {
				return fmt.Errorf("dashboard: %w", err)
			}
			l, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("dashboard: --listen %q: %w", listen, err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "gpufrac dashboard: http://%s/\n", l.Addr())
			srv := dashboard.New(dashboard.Options{Client: client, AllowedHosts: hosts})
			return srv.Run(klog.NewContext(cmd.Context(), klog.Background()), l)
		},
	}
	f := cmd.Flags()
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
	f.StringVar(&listen, "listen", "127.0.0.1:8080", "address to serve on (host:port; port 0 picks a free one)")
	f.StringSliceVar(&hosts, "allowed-host", nil, "host names (no port) it answers besides localhost and loopback IPs, e.g. its Service's DNS names or an Ingress host; any other Host is refused, against DNS rebinding")
	return cmd
}
