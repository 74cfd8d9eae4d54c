package cli

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

func newUpCommand() *cobra.Command {
	var (
		nodes     int
		machine   string
		demo      bool
		keep      bool
		dir       string
		dashboard string
		standing  int
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run a local GPU-fraction cluster: etcd, kube-apiserver, webhook, scheduler, controller-manager, dashboard, simulated GPU nodes",
		Long: `Run gpufrac's whole stack on this machine, on loopback, until Ctrl-C (or
gpufrac down): the real etcd and kube-apiserver with RBAC and admission, the
admission webhook with a generated CA, gpufrac scheduler as the gpufrac
profile, kube-controller-manager (Deployments, Jobs, StatefulSets,
DaemonSets, claim templates; each controller with its own credentials), a
node agent per node in GPU-simulation mode (go-nvml's mock machines), and
KWOK as the nodes' kubelets: bound pods become Running (no container runs),
a Job's pods complete, and deleted pods go away; and gpufrac dashboard, whose
URL it prints (--dashboard). kube-apiserver,
kube-controller-manager, etcd and KWOK are built from source into bin/ the
first time (make kube-binaries kwok).

The node agents also run the DRA driver gpu.gpufrac.io (--dra-standing-gpus),
so ResourceClaims for GPU shares work beside annotated pods, on the same GPUs.

With --demo it applies every object of examples/ (Deployments and a DRA claim
included), waits for their pods to be placed, adds a claim on a GPU an
annotated pod already shares, prints the cluster view and an invalid pod's
refusal, then stops (or stays up with --keep). The kubeconfig is written to the
state directory (--dir; by default ~/.local/state/gpufrac/kubeconfig).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) (rerr error) {
			if standing < -1 {
				return fmt.Errorf("--dra-standing-gpus %d: must be -1 (all GPUs), 0 (no DRA) or a count", standing)
			}
			if nodes < 1 || nodes > 100 {
				return fmt.Errorf("--nodes %d: must be between 1 and 100", nodes)
			}
			if err := inventory.CheckMachine(machine); err != nil {
				return fmt.Errorf("--gpus: %w", err)
			}
			root, err := checkout.Root()
			if err != nil {
				return fmt.Errorf("gpufrac up runs from a gpufrac checkout (it uses deploy/ and bin/): %w", err)
			}
			self, err := os.Executable()
			if err != nil {
				return err
			}
			if dir == "" {
				if dir, err = localcluster.DefaultDir(); err != nil {
					return err
				}
			}
			// A closed terminal or pipe must not kill this process before
			// it has stopped the ones it started.
			signal.Ignore(syscall.SIGPIPE, syscall.SIGHUP)
			out := cmd.OutOrStdout()
			start := time.Now()
			fmt.Fprintf(out, "gpufrac up: %d node(s) × %s, state in %s\n", nodes, machine, dir)
			cluster, err := localcluster.Up(cmd.Context(), localcluster.Options{
				Dir: dir, Nodes: nodes, Machine: machine, Binary: self, Root: root, Progress: out, Dashboard: dashboard,
				DRAStandingGPUs: standing,
			})
			if err != nil {
				return err
			}
			defer func() {
				fmt.Fprintln(out, "gpufrac up: stopping dashboard, kube-controller-manager, scheduler, KWOK, node agents, webhook, kube-apiserver and etcd …")
				if err := cluster.Shutdown(); err != nil {
					fmt.Fprintf(out, "gpufrac up: %v; `gpufrac down` tries again\n", err)
					if rerr == nil {
						rerr = err
					}
					return
				}
				fmt.Fprintln(out, "gpufrac up: stopped; no process left")
			}()
			fmt.Fprintf(out, "gpufrac up: ready in %.1fs\n  export KUBECONFIG=%s\n  kubectl get nodes; bin/gpufrac top\n  dashboard: %s\n",
				time.Since(start).Seconds(), cluster.Kubeconfig, cluster.DashboardURL)
			if demo {
				if err := cluster.Demo(cmd.Context(), filepath.Join(root, "examples"), out); err != nil {
					return err
				}
				fmt.Fprintf(out, "\ngpufrac up --demo: done in %.1fs\n", time.Since(start).Seconds())
				if !keep {
					return nil
				}
				fmt.Fprintf(out, "  the dashboard: %s\n", cluster.DashboardURL)
			}
			fmt.Fprintln(out, "gpufrac up: running; Ctrl-C or `gpufrac down` stops it")
			<-cmd.Context().Done()
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&nodes, "nodes", 4, "simulated GPU nodes")
	f.StringVar(&machine, "gpus", "dgxh100"+inventory.DriverLimitsSuffix, "each node's GPUs, a go-nvml mock machine: "+inventory.MachineHelp()+" (the default: H100s on the CUDA 13.4 driver gpufrac is for; dgxh100 for an older one, with MPS pinned-memory limits)")
	f.BoolVar(&demo, "demo", false, "apply every object of examples/, show the placements and a refusal, then stop")
	f.BoolVar(&keep, "keep", false, "with --demo: stay up afterwards")
	f.StringVar(&dir, "dir", "", "state directory (default: $XDG_STATE_HOME/gpufrac, or ~/.local/state/gpufrac)")
	f.StringVar(&dashboard, "dashboard", "127.0.0.1:8080", "address of the dashboard (a free loopback port if taken)")
	f.IntVar(&standing, "dra-standing-gpus", -1, "GPUs per node held for shares and offered to DRA claims (driver gpu.gpufrac.io) beside annotation pods: -1 for all, 0 for no DRA (whole-GPU pods can use only the others)")
	return cmd
}

func newDownCommand() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "down",
		Short: "Stop the local cluster gpufrac up started",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				var err error
				if dir, err = localcluster.DefaultDir(); err != nil {
					return err
				}
			}
			report, err := localcluster.Stop(dir, localcluster.StopGrace)
			out := cmd.OutOrStdout()
			if len(report.Gone) > 0 {
				fmt.Fprintf(out, "gpufrac down: already gone (died, or replaced by a process up did not start): %s\n", procList(report.Gone))
			}
			if len(report.Stopped) > 0 {
				fmt.Fprintf(out, "gpufrac down: stopped %s\n", procList(report.Stopped))
			}
			if err != nil {
				return err
			}
			fmt.Fprintln(out, "gpufrac down: no process of that gpufrac up is left")
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "state directory (default: $XDG_STATE_HOME/gpufrac, or ~/.local/state/gpufrac)")
	return cmd
}

// procList names processes for a person: "etcd (pid 12), kube-apiserver (pid 13)".
func procList(procs []localcluster.Proc) string {
	names := make([]string, len(procs))
	for i, p := range procs {
		names[i] = p.String()
	}
	return strings.Join(names, ", ")
}

func newWaitCommand() *cobra.Command {
	var (
		dir     string
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "wait",
		Short: "Wait until the local cluster of gpufrac up is ready (for scripts: gpufrac up & gpufrac wait)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if timeout <= 0 {
				return fmt.Errorf("--timeout %v: must be positive", timeout)
			}
			if dir == "" {
				var err error
				if dir, err = localcluster.DefaultDir(); err != nil {
					return err
				}
			}
			if err := localcluster.WaitReady(cmd.Context(), dir, timeout); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "gpufrac wait: ready; export KUBECONFIG=%s\n", filepath.Join(dir, "kubeconfig"))
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "state directory (default: $XDG_STATE_HOME/gpufrac, or ~/.local/state/gpufrac)")
	cmd.Flags().DurationVar(&timeout, "timeout", 15*time.Minute, "how long to wait; the first up builds kube-apiserver and KWOK (minutes)")
	return cmd
}
