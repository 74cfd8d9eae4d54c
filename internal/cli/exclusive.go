package cli

import (
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/pkg/node/exclusive"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

func newExclusiveProcessCommand() *cobra.Command {
	var (
		stateDir, simulate string
		hold               []string
		restore            bool
	)
	cmd := &cobra.Command{
		Use:   "exclusive-process --state-dir DIR [--hold UUID,... | --restore]",
		Short: "Show, set or give back the compute modes the node agent keeps on GPUs shared through MPS",
		Long: `The node agent keeps the GPUs that fractions share through MPS in the
EXCLUSIVE_PROCESS compute mode (--exclusive-process), so that no process
outside MPS gets a context on them, and records in STATE-DIR/` + exclusive.StateFile + `
the mode each had before. This command does the same through NVML, for an
admin and for hack/gpu-proof.sh:

  (no flag)    print each GPU's compute mode and what gpufrac changed;
  --hold U,..  make these GPUs exclusive, and give every other GPU gpufrac
               changed its mode back (what the agent's resync does);
  --restore    give every GPU gpufrac changed its mode back: after the node
               agent is uninstalled, or to take a node out of sharing.

Only modes gpufrac changed are given back; one an admin set stays. Run it
as root where the agent runs, with the agent stopped.

Exit status: 0 done; 1 a GPU could not be set or given back (named).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if stateDir == "" {
				return &ExitError{Code: 2, Err: errors.New("exclusive-process: --state-dir is required: the node agent's --state-dir, where it records what it changed")}
			}
			if restore && len(hold) > 0 {
				return &ExitError{Code: 2, Err: errors.New("exclusive-process: --hold and --restore exclude each other")}
			}
			lib := nvml.New()
			if simulate != "" {
				var err error
				if lib, err = inventory.Simulated(simulate); err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("exclusive-process: %w", err)}
				}
			}
			inv, err := inventory.Read(lib)
			if err != nil {
				return &ExitError{Code: 1, Err: fmt.Errorf("exclusive-process: %w", err)}
			}
			k := exclusive.Open(lib, filepath.Join(stateDir, exclusive.StateFile))
			var failed []string
			if restore || len(hold) > 0 {
				shared := map[string]bool{}
				for _, u := range hold {
					shared[strings.TrimSpace(u)] = true
				}
				r := k.Sync(shared)
				for _, u := range slices.Sorted(maps.Keys(r.NotExclusive)) {
					failed = append(failed, fmt.Sprintf("GPU %s not made exclusive: %v", u, r.NotExclusive[u]))
				}
				for _, u := range slices.Sorted(maps.Keys(r.RestoreErr)) {
					failed = append(failed, fmt.Sprintf("GPU %s not given its mode back: %v", u, r.RestoreErr[u]))
				}
			}
			if err := k.StateErr(); err != nil {
				failed = append(failed, err.Error())
			}
			if err := printModes(cmd, lib, inv, k.Changed()); err != nil {
				failed = append(failed, err.Error())
			}
			if len(failed) > 0 {
				return &ExitError{Code: 1, Err: fmt.Errorf("exclusive-process: %s", strings.Join(failed, "; "))}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&stateDir, "state-dir", "", "the node agent's --state-dir")
	f.StringSliceVar(&hold, "hold", nil, "GPU UUIDs to make exclusive; every other GPU gpufrac changed gets its mode back")
	f.BoolVar(&restore, "restore", false, "give every GPU gpufrac changed its mode back")
	f.StringVar(&simulate, "simulate-gpus", "", "a go-nvml mock machine instead of NVML (for tests): "+inventory.MachineHelp())
	_ = f.MarkHidden("simulate-gpus")
	return cmd
}

// printModes prints one line per GPU: its mode, and what gpufrac changed.
func printModes(cmd *cobra.Command, lib nvml.Interface, inv inventory.Inventory, changed map[string]nvml.ComputeMode) error {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("NVML: %w", ret)
	}
	defer func() { _ = lib.Shutdown() }()
	out := cmd.OutOrStdout()
	for _, g := range inv.GPUs {
		mode := "unknown"
		if dev, ret := lib.DeviceGetHandleByUUID(g.UUID); ret == nvml.SUCCESS {
			if m, ret := dev.GetComputeMode(); ret == nvml.SUCCESS {
				mode = exclusive.Mode(m)
			}
		}
		note := ""
		if was, ok := changed[g.UUID]; ok {
			note = " (set by gpufrac; was " + exclusive.Mode(was) + ")"
		}
		fmt.Fprintf(out, "GPU %d %s: %s%s\n", g.Index, g.UUID, mode, note)
	}
	return nil
}
