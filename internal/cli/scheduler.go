package cli

import (
	"github.com/spf13/cobra"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"

	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// newSchedulerCommand is kube-scheduler itself, with the GPUFractions
// plugin compiled in: every kube-scheduler flag and configuration works.
func newSchedulerCommand() *cobra.Command {
	cmd := app.NewSchedulerCommand(app.WithPlugin(scheduler.Name, scheduler.New))
	cmd.Use = "scheduler"
	cmd.Short = "Run kube-scheduler with the GPUFractions plugin (every kube-scheduler flag applies)"
	cmd.Long = `Run kube-scheduler with the GPUFractions plugin compiled in.

Enable the plugin in a profile of a KubeSchedulerConfiguration passed with
--config (deploy/scheduler/config.yaml is an example: a profile named
gpufrac). Pods with schedulerName: gpufrac that ask for a GPU fraction are
placed on GPUs with the memory free, each shared GPU is held by a
reservation pod, and the decision is written onto the pod in the KAI
NvFractions annotations.

Plugin arguments (pluginConfig, name GPUFractions):
  policy                        gpufrac (default), fgd, bestfit, gpupacking, dotprod, spread
  reservationNamespace          namespace of reservation pods (default gpufrac-reservations)
  reservationImage              image reservation pods run (default registry.k8s.io/pause:3.10)
  reservationPriorityClassName  their priority class (default system-node-critical)
  bindTimeout                   wait for a reservation pod's GPU UUID (default 2m)
  deviceNaming                  uuid (default) or cdi
  leaderLease                   <namespace>/<name> of the leader-election Lease: with
                                several replicas only the leader writes outside a scheduling
                                cycle: reservation pods, resizes (unset: each)`
	return cmd
}
