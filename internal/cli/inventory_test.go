package cli

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// The inventory prints what the agent reads, one line per GPU in
// nvidia-smi -L's form, so that the two can be compared line by line.
func TestInventory(t *testing.T) {
	out, errOut, code := runCLI(t, "", "inventory", "--simulate-gpus", "dgxh100")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 10 || lines[0] != "driver 550.54.15, CUDA 12.4, enforcement mps-pinned" ||
		lines[1] != "enforcement mps-pinned: driver 550.54.15 with CUDA 12.4 is older than the r615 driver with CUDA 13.4 that per-cgroup limits need; "+
			"memory is capped per MPS client (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), which an MPS server does not evict" ||
		!strings.HasPrefix(lines[2], "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-") || !strings.HasSuffix(lines[2], ") 81920 MiB") {
		t.Errorf("exit %d, %q\n%s", code, errOut, out)
	}
	out, _, code = runCLI(t, "", "inventory", "--simulate-gpus", "dgxb200", "-o", "json")
	var inv struct {
		DriverVersion string
		GPUs          []struct{ UUID string }
		Capability    string
	}
	if err := json.Unmarshal([]byte(out), &inv); err != nil || code != 0 || len(inv.GPUs) != 8 || inv.Capability == "" {
		t.Errorf("json: %v, exit %d: %s", err, code, out)
	}
	cmd := NewRootCommand()
	cmd.SetArgs([]string{"inventory", "--simulate-gpus", "dgx-nope"})
	cmd.SetOut(&strings.Builder{})
	cmd.SetErr(&strings.Builder{})
	var exit *ExitError
	if err := cmd.Execute(); !errors.As(err, &exit) || exit.Code != 2 || !strings.Contains(err.Error(), `--simulate-gpus "dgx-nope": unknown machine; one of`) {
		t.Errorf("bad machine: %v", err)
	}
}
