package cli

import (
	"fmt"
	"slices"

	"github.com/spf13/cobra"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/gpufrac/gpufrac/pkg/admission"
	"github.com/gpufrac/gpufrac/pkg/api"
)

func newWebhookCommand() *cobra.Command {
	opts := admission.ServerOptions{Identity: admission.Identity{}}
	var kubeconfig string
	quota := true
	cmd := &cobra.Command{
		Use:   "webhook",
		Short: "Serve the admission webhooks: validate fractions, normalise shorthands, guard scheduler-owned keys",
		Long: `webhook serves two admission webhooks over TLS (deploy/webhook registers them):

  ` + admission.ValidatePath + `  rejects pods and workload templates whose GPU-fraction annotations break
             a rule (the same rules and messages as 'gpufrac validate'), and denies
             anyone but the scheduler setting, changing or removing the keys the
             scheduler owns, or changing a scheduled pod's fraction, and refuses
             a fractional pod created with spec.nodeName or for a scheduler not
             in --trusted-scheduler, or gaining a fraction by an update;
  ` + admission.MutatePath + `    writes the canonical per-container keys from the pod-level shorthands,
             labels fractional pods ` + admission.SelectionLabel + `=true, with
             --scheduler-name sends them to that scheduler, and charges every
             pod that asks for a GPU share (annotations or claims of gpufrac's
             driver) its GPU memory as the extended resource ` + string(api.ResourceGPUMemory) + `,
             so that a ResourceQuota on requests.` + string(api.ResourceGPUMemory) + ` bounds
             a namespace (docs/security.md, "GPU memory quota").

It reads nodes' GPU memory labels (to size a share of a GPU) and the claims,
claim templates and device classes pods name (to size their shares).

The certificate and key (tls.crt, tls.key in --cert-dir) are reloaded when
they change.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// The scheduler fractional pods are sent to is trusted to
			// place them, whatever --trusted-scheduler says.
			if opts.SchedulerName != "" && !slices.Contains(opts.Identity.Schedulers, opts.SchedulerName) {
				opts.Identity.Schedulers = append(opts.Identity.Schedulers, opts.SchedulerName)
			}
			ctx := cmd.Context()
			logger := klog.FromContext(ctx)
			ctrllog.SetLogger(logger)
			if quota {
				client, err := clusterClient(kubeconfig)
				if err != nil {
					return err
				}
				charger, synced := admission.NewCharger(ctx, client)
				opts.Charger = charger
				// Until the nodes are read, a share of a GPU would be refused
				// as if no GPU node had joined: wait for them first.
				if !toolscache.WaitForCacheSync(ctx.Done(), synced) {
					return fmt.Errorf("webhook: could not read the nodes' GPU memory labels: %w", ctx.Err())
				}
			} else {
				logger.Info("Not charging GPU shares to quota (--gpu-memory-quota=false): a namespace's ResourceQuota does not bound its GPU memory")
				opts.Charger = admission.Charger{Off: true}
			}
			return admission.NewServer(opts).Start(klog.NewContext(ctx, logger))
		},
	}
	f := cmd.Flags()
	f.BoolVar(&quota, "gpu-memory-quota", true, "charge every GPU share (annotations, claims) to its namespace as "+string(api.ResourceGPUMemory)+", which a ResourceQuota bounds; false only where no GPU node advertises it (gpufrac's node agent does; NVIDIA's node operator does not): schedulers then find no node for a charged pod")
	f.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
	f.StringVar(&opts.Host, "host", "", "address to serve the webhooks on (default: all)")
	f.IntVar(&opts.Port, "port", 9443, "TLS port of the webhooks")
	f.StringVar(&opts.CertDir, "cert-dir", "/etc/gpufrac/webhook-certs", "directory holding tls.crt and tls.key (reloaded on change)")
	f.StringVar(&opts.HealthAddr, "health-addr", ":8081", "address of /healthz and /readyz (plain HTTP); empty disables")
	f.StringSliceVar(&opts.Identity.Users, "scheduler-user", []string{admission.DefaultSchedulerUser},
		"user names allowed to write scheduler-owned keys (service accounts as system:serviceaccount:NS:NAME); repeatable")
	f.StringSliceVar(&opts.Identity.NodeAgents, "node-agent-user", []string{admission.DefaultNodeAgentUser},
		"user names of the node agents, the only ones allowed to record what a node enforces after a resize ("+api.EnforcedAnnotation+"); repeatable")
	f.StringVar(&opts.SchedulerName, "scheduler-name", "", "schedulerName to give fractional pods that use the default scheduler (empty: leave it)")
	f.StringSliceVar(&opts.Identity.Schedulers, "trusted-scheduler", []string{"gpufrac"},
		"schedulerNames trusted to place GPU fractions (with --scheduler-name's), each a name or a glob (gpufrac-*): a fractional pod created for another, or with spec.nodeName, is refused; repeatable (KAI: kai-scheduler)")
	f.BoolVar(&opts.Identity.AllowRootMPSClients, "allow-root-mps-clients", false,
		"the node agents' --allow-root-mps-clients: let a pod holding a GPU share gain privileges (allowPrivilegeEscalation, privileged), share its process namespace and be debugged with a targeted ephemeral container outside a user namespace; by default the webhook sets allowPrivilegeEscalation false on its containers and refuses the rest, since a client of the node's MPS daemon that becomes root may quit it")
	return cmd
}
