package cli

import (
	"encoding/json"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func newInventoryCommand() *cobra.Command {
	var (
		simulate string
		output   string
	)
	cmd := &cobra.Command{
		Use:   "inventory",
		Short: "Print this node's GPUs as the node agent reads them through NVML, and the enforcement they allow",
		Long: `Print what the node agent would publish for this machine: the driver and CUDA
versions, each GPU's index, UUID, product, memory and MIG mode, read through
NVML (libnvidia-ml.so.1), and the strongest memory enforcement they allow
(driver, mps-pinned or none). Compare it with nvidia-smi -L to check a node
before installing the agent; --simulate-gpus reads a go-nvml mock machine.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "" && output != "json" {
				return &ExitError{Code: 2, Err: fmt.Errorf("inventory: -o %q: the only output format is json", output)}
			}
			var lib nvml.Interface
			if simulate != "" {
				if err := inventory.CheckMachine(simulate); err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("inventory: %w", err)}
				}
				var err error
				if lib, err = inventory.Simulated(simulate); err != nil {
					return &ExitError{Code: 2, Err: err}
				}
			} else {
				lib = nvml.New()
			}
			inv, err := inventory.Read(lib)
			if err != nil {
				return &ExitError{Code: 1, Err: fmt.Errorf("inventory: %w", err)}
			}
			out := cmd.OutOrStdout()
			if output == "json" {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(struct {
					inventory.Inventory
					Capability       nodeapi.Enforcement
					CapabilityReason string
				}{inv, inv.Capability(), inv.CapabilityReason()})
			}
			fmt.Fprintf(out, "driver %s, CUDA %s, enforcement %s\n", inv.DriverVersion, inv.CUDAVersion(), inv.Capability())
			fmt.Fprintf(out, "enforcement %s: %s\n", inv.Capability(), inv.CapabilityReason())
			for _, g := range inv.GPUs {
				mig := ""
				if g.MIGEnabled {
					mig = " MIG"
				}
				fmt.Fprintf(out, "GPU %d: %s (UUID: %s) %d MiB%s\n", g.Index, g.Product, g.UUID, g.MemoryMiB, mig)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&simulate, "simulate-gpus", "", "read a go-nvml mock machine instead of NVML: "+inventory.MachineHelp())
	f.StringVarP(&output, "output", "o", "", "json for machines")
	return cmd
}
