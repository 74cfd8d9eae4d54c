package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"syscall"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/node/agent"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
)

func newMPSDaemonCommand() *cobra.Command {
	var (
		root, control, procRoot, driver string
		opts                            mps.ConfigOptions
		probe, minReplace               time.Duration
		healthAddr                      string
	)
	cmd := &cobra.Command{
		Use:   "mps-daemon",
		Short: "Run and supervise the node's one MPS control daemon (the chart's <release>-mps DaemonSet)",
		Long: `mps-daemon runs the node's MPS control daemon for all its GPUs and keeps it
running. On driver r615 and later it starts MPS v3 (nvidia-cuda-mps-control
-p 3 -m -f -a CONFIG) from a configuration generated for the driver release:
memacct on (the server evicts a client over its soft limit when memory runs
short, which is what makes a memory request a guarantee), context sharing
with the default socket off (time-slicing containers keep contexts of their
own) and one shared server, "gpufrac", whose namespaces are the sm-sharing
containers. Keys of r620 are written only for an r620 driver. Older drivers
get the legacy interface, for the mps-pinned backend only.

The daemon is probed every --probe-interval; one that exits or stops
answering is replaced (with backoff) and the node agent, which manages the
namespaces, re-creates those of running containers and tells their pods.
It runs in a pod of its own (the chart's <release>-mps DaemonSet, never
rolled by an upgrade), so that the node agent's upgrades and restarts leave
the tenants' contexts alone, and in the host PID namespace, without which
memacct cannot see the clients' PIDs and cgroups. --health-addr serves
/readyz (200 while a daemon runs) and /healthz.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if probe < 100*time.Millisecond {
				return fmt.Errorf("--probe-interval %s: must be at least 100ms", probe)
			}
			if driver == "" {
				inv, err := inventory.Read(nvml.New())
				if err != nil {
					return fmt.Errorf("mps-daemon: the driver release decides the MPS interface: %w", err)
				}
				driver = inv.DriverVersion
			}
			major, err := mps.DriverMajor(driver)
			if err != nil {
				return fmt.Errorf("mps-daemon: %w", err)
			}
			d := mps.NewDaemon(control, root, major)
			d.Options, d.ProcRoot, d.ProbeInterval, d.MinReplaceInterval = opts, procRoot, probe, minReplace
			ctx := klog.NewContext(cmd.Context(), klog.Background())
			if healthAddr != "" {
				stop, err := serveDaemonHealth(ctx, healthAddr, root)
				if err != nil {
					return fmt.Errorf("mps-daemon: --health-addr %s: %w", healthAddr, err)
				}
				defer stop()
			}
			return d.Run(ctx)
		},
	}
	f := cmd.Flags()
	f.StringVar(&root, "mps-pipe-dir", agent.DefaultOptions().Injection.MPSRoot, "the node agent's --mps-pipe-dir: the daemon's pipe directory is PIPE-DIR/pipe, its logs PIPE-DIR/log")
	f.StringVar(&control, "mps-control", mps.DefaultBinary, "the MPS control program")
	f.StringVar(&procRoot, "proc-root", agent.DefaultOptions().ProcRoot, "the host's /proc, to find MPS servers left by a wedged daemon")
	f.StringVar(&driver, "driver-version", "", "the driver version, instead of asking NVML (for tests)")
	f.StringVar(&opts.Timeslice, "mps-timeslice", "", "[compute_policy] timeslice for every context (driver r620 and later; NVIDIA's example value: long); empty: the driver's default")
	f.BoolVar(&opts.AuditLog, "mps-audit-log", false, "turn on memacct's audit log")
	f.DurationVar(&probe, "probe-interval", 5*time.Second, "how often the daemon is asked for its servers; two missed answers make it wedged")
	f.StringVar(&healthAddr, "health-addr", "", "serve /readyz (200 while a daemon runs, 503 with the reason otherwise) and /healthz here; empty: none")
	f.DurationVar(&minReplace, "min-replace-interval", mps.DefaultMinReplaceInterval, "least time between two replacements of the daemon at the node agent's request (a wedged shared server): each ends every tenant's GPU context, so a tenant that wedges the server again and again cannot make that happen at will; a request within the interval waits, and the node is not ready meanwhile")
	return cmd
}

// serveDaemonHealth serves the supervisor's readiness: ready while a daemon
// runs, as its status file says (what the node agent reads too).
func serveDaemonHealth(ctx context.Context, addr, root string) (func(), error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		st, err := mps.ReadStatus(root)
		switch {
		case err != nil:
			http.Error(w, "no daemon status: "+err.Error(), http.StatusServiceUnavailable)
		case !st.Running || syscall.Kill(st.PID, 0) != nil: // a status left by an earlier pod's daemon
			http.Error(w, fmt.Sprintf("no MPS control daemon runs (generation %d; last exit: %s)", st.Generation, st.LastExit), http.StatusServiceUnavailable)
		default:
			_, _ = fmt.Fprintf(w, "MPS control daemon pid %d, generation %d, since %s\n", st.PID, st.Generation, st.Started.Format(time.RFC3339))
		}
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "The MPS daemon's health endpoint stopped")
		}
	}()
	return func() { _ = srv.Close() }, nil
}
