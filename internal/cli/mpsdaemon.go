package cli

import (
	"fmt"
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
	)
	cmd := &cobra.Command{
		Use:   "mps-daemon",
		Short: "Run and supervise the node's one MPS control daemon (the node agent's mps container)",
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
It runs in a container of its own beside the agent, so an agent restart
leaves the tenants' contexts alone, and in the host PID namespace, without
which memacct cannot see the clients' PIDs and cgroups.`,
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
			return d.Run(klog.NewContext(cmd.Context(), klog.Background()))
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
	f.DurationVar(&minReplace, "min-replace-interval", mps.DefaultMinReplaceInterval, "least time between two replacements of the daemon at the node agent's request (a wedged shared server): each ends every tenant's GPU context, so a tenant that wedges the server again and again cannot make that happen at will; a request within the interval waits, and the node is not ready meanwhile")
	return cmd
}
