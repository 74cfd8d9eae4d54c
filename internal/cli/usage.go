package cli

import (
	"encoding/json"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

func newUsageCommand() *cobra.Command {
	var (
		procRoot string
		output   string
	)
	cmd := &cobra.Command{
		Use:   "usage",
		Short: "Print every process on this node's GPUs as the node agent measures it: memory, SM, MPS client, container",
		Long: `Print what the node agent reads of this machine's GPU processes at each
resync: per GPU, each process NVML lists (compute processes and MPS clients),
its memory and SM utilisation, and the container its cgroup names (the join
the agent makes to pods; docs/metrics.md). Run it on a node, or in the agent's
pod (host PID namespace), to see what a tenant's figures are made of. A process
NVML still lists after it exited is marked so and not counted.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "" && output != "json" {
				return &ExitError{Code: 2, Err: fmt.Errorf("usage: -o %q: the only output format is json", output)}
			}
			lib := nvml.New()
			inv, err := inventory.Read(lib)
			if err != nil {
				return &ExitError{Code: 1, Err: fmt.Errorf("usage: %w", err)}
			}
			gpus := make([]string, 0, len(inv.GPUs))
			for _, g := range inv.GPUs {
				gpus = append(gpus, g.UUID)
			}
			procs, err := (&usage.Sampler{Lib: lib, ProcRoot: procRoot}).Processes(gpus)
			if err != nil {
				return &ExitError{Code: 1, Err: fmt.Errorf("usage: %w", err)}
			}
			out := cmd.OutOrStdout()
			if output == "json" {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(procs)
			}
			if len(procs) == 0 {
				_, err := fmt.Fprintf(out, "no process on the %d GPU(s)\n", len(gpus))
				return err
			}
			for _, p := range procs {
				sm, kind, ctr := "unknown", "compute", p.Container
				if p.SMPercent != nil {
					sm = fmt.Sprintf("%d%%", *p.SMPercent)
				}
				if p.MPSClient {
					kind = "mps-client"
				}
				if ctr == "" {
					ctr = "-"
				}
				if p.Exited {
					ctr = "exited (not counted)"
				}
				mem := "unknown"
				if p.MemoryBytes != nil {
					mem = fmt.Sprintf("%dMi", *p.MemoryBytes>>20)
				}
				fmt.Fprintf(out, "%s pid %d %s memory %s SM %s container %s\n", p.GPU, p.PID, kind, mem, sm, ctr)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&procRoot, "proc-root", "/proc", "where the host's /proc is")
	f.StringVarP(&output, "output", "o", "", "json for machines")
	return cmd
}
