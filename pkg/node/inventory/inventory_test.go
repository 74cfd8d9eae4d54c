package inventory

import (
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func TestReadSimulatedMachines(t *testing.T) {
	tests := []struct {
		machine   string
		product   string
		memoryMiB int64
	}{
		{"dgxa100", "A100", 40960},
		{"dgxh100", "H100", 81920},
		{"dgxh200", "H200", 144384},
		{"dgxb200", "B200", 184320},
	}
	for _, tt := range tests {
		t.Run(tt.machine, func(t *testing.T) {
			lib, err := Simulated(tt.machine)
			if err != nil {
				t.Fatal(err)
			}
			inv, err := Read(lib)
			if err != nil {
				t.Fatal(err)
			}
			if len(inv.GPUs) != 8 {
				t.Fatalf("%d GPUs, want 8", len(inv.GPUs))
			}
			seen := map[string]bool{}
			for i, g := range inv.GPUs {
				if g.Index != i || g.UUID == "" || seen[g.UUID] || !strings.Contains(g.Product, tt.product) || g.MemoryMiB != tt.memoryMiB || g.PCIBusID == "" {
					t.Errorf("GPU %d = %+v", i, g)
				}
				seen[g.UUID] = true
			}
			if inv.DriverVersion == "" || inv.CUDADriverVersion == 0 {
				t.Errorf("versions missing: %+v", inv)
			}
		})
	}
	if _, err := Simulated("dgx-9000"); err == nil || !strings.Contains(err.Error(), "unknown machine") {
		t.Errorf("unknown machine: %v", err)
	}
}

func TestCapabilityFollowsDriverAndCUDA(t *testing.T) {
	one := []GPU{{UUID: "GPU-a"}}
	tests := []struct {
		inv  Inventory
		want nodeapi.Enforcement
		why  string // in CapabilityReason
	}{
		{Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13040, GPUs: one}, nodeapi.EnforcementDriver, "driver 615.10.02 with CUDA 13.4 sets hard and soft"},
		{Inventory{DriverVersion: "620.01", CUDADriverVersion: 13050, GPUs: one}, nodeapi.EnforcementDriver, "driver 620.01 with CUDA 13.5"},
		{Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13030, GPUs: one}, nodeapi.EnforcementMPSPinned, "driver 615.10.02 with CUDA 13.3 is older than the r615 driver with CUDA 13.4"},
		{Inventory{DriverVersion: "550.54.15", CUDADriverVersion: 13040, GPUs: one}, nodeapi.EnforcementMPSPinned, "driver 550.54.15 with CUDA 13.4 is older"},
		{Inventory{DriverVersion: "garbage", CUDADriverVersion: 13040, GPUs: one}, nodeapi.EnforcementMPSPinned, "driver garbage"},
		{Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13040}, nodeapi.EnforcementNone, "NVML lists no GPU"},
		// MIG on any GPU: no fraction can be enforced, on r615 or before.
		{Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13040, GPUs: []GPU{{UUID: "GPU-a"}, {Index: 1, UUID: "GPU-b", MIGEnabled: true}}}, nodeapi.EnforcementNone, "GPU 1 has MIG enabled"},
		{Inventory{DriverVersion: "550.54.15", CUDADriverVersion: 12040, GPUs: []GPU{{UUID: "GPU-a", MIGEnabled: true}}}, nodeapi.EnforcementNone, "GPU 0 has MIG enabled"},
	}
	for _, tt := range tests {
		if got := tt.inv.Capability(); got != tt.want {
			t.Errorf("%+v: %s, want %s", tt.inv, got, tt.want)
		}
		if why := tt.inv.CapabilityReason(); !strings.Contains(why, tt.why) {
			t.Errorf("%+v: reason %q, want it to say %q", tt.inv, why, tt.why)
		}
	}
	if got := (Inventory{CUDADriverVersion: 13040}).CUDAVersion(); got != "13.4" {
		t.Errorf("CUDAVersion = %s", got)
	}
}

func TestReadFailsInsteadOfGuessing(t *testing.T) {
	missing := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
	_, err := Read(missing)
	if err == nil || !strings.HasPrefix(err.Error(), "nvmlInit: ") {
		t.Errorf("missing library: %v", err)
	}

	lib := dgxh100.NewWithGPUs(gpus.Multiple(2, gpus.H100_SXM5_80GB)...)
	lib.Devices[1].(*server.Device).GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
	_, err = Read(lib)
	if err == nil || !strings.HasPrefix(err.Error(), "GPU 1: nvmlDeviceGetMemoryInfo: ") {
		t.Errorf("lost GPU: %v", err)
	}
}

// The real library: on this machine (no driver) it must fail, never
// report GPUs. On a GPU node it reads the real devices.
func TestReadRealLibrary(t *testing.T) {
	inv, err := Read(nvml.New())
	if err != nil {
		t.Logf("real NVML unavailable, as expected without a driver: %v", err)
		if len(inv.GPUs) != 0 {
			t.Errorf("GPUs reported despite the error: %+v", inv)
		}
		return
	}
	if len(inv.GPUs) == 0 {
		t.Error("NVML initialised but reported no GPUs")
	}
	t.Logf("real inventory: %+v (enforcement %s)", inv, inv.Capability())
}

// A shape simulates a trace's node: its GPU count, model name and memory.
func TestSimulatedShape(t *testing.T) {
	lib, err := Simulated("3xG2@32000Mi")
	if err != nil {
		t.Fatal(err)
	}
	inv, err := Read(lib)
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 3 {
		t.Fatalf("got %d GPUs, want 3", len(inv.GPUs))
	}
	seen := map[string]bool{}
	for _, g := range inv.GPUs {
		if g.Product != "G2" || g.MemoryMiB != 32000 || seen[g.UUID] || g.PCIBusID == "" {
			t.Errorf("GPU %+v: want a distinct G2 with 32000MiB and a bus id", g)
		}
		seen[g.UUID] = true
	}
	for _, bad := range []string{"0xG2@32000Mi", "17xG2@1Mi", "8xG2@0Mi", "8xG2@32000", "8x@1Mi", "dgx", "8x G2@1Mi"} {
		if _, err := Simulated(bad); err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("Simulated(%q) = %v: want an error naming it", bad, err)
		}
	}
}

// --simulate-gpus never panics: a machine it accepts reads as an
// inventory of that many GPUs, anything else is a one-line error.
func FuzzSimulated(f *testing.F) {
	for _, s := range []string{"dgxh100", "8xG2@32000Mi", "16xA@1Mi", "0xG@1Mi", "99999999999999999999xG@1Mi", "8xG2@99999999999999999999Mi"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, machine string) {
		lib, err := Simulated(machine)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("a multi-line error: %q", err)
			}
			return
		}
		inv, err := Read(lib)
		if err != nil || len(inv.GPUs) == 0 || len(inv.GPUs) > 16 {
			t.Fatalf("Simulated(%q) accepted, read %d GPUs, %v", machine, len(inv.GPUs), err)
		}
	})
}

// Issue 54: a simulated node's GPUs are the same after a restart (a new
// library for the same node), as a real node's are, and no two nodes'
// GPUs share a UUID.
func TestSimulatedNodesKeepTheirGPUs(t *testing.T) {
	read := func(node string) []string {
		t.Helper()
		lib, err := SimulatedFor("dgxh100", node)
		if err != nil {
			t.Fatal(err)
		}
		inv, err := Read(lib)
		if err != nil {
			t.Fatal(err)
		}
		var uuids []string
		for _, g := range inv.GPUs {
			if !strings.HasPrefix(g.UUID, "GPU-") || len(g.UUID) != len("GPU-")+36 {
				t.Errorf("UUID %q is not in a GPU UUID's form", g.UUID)
			}
			uuids = append(uuids, g.UUID)
		}
		return uuids
	}
	first, again, other := read("gpu-node-1"), read("gpu-node-1"), read("gpu-node-2")
	if len(first) != 8 || !slices.Equal(first, again) {
		t.Errorf("gpu-node-1's GPUs after a restart: %v, before %v", again, first)
	}
	seen := map[string]bool{}
	for _, u := range append(first, other...) {
		if seen[u] {
			t.Errorf("UUID %s is two GPUs'", u)
		}
		seen[u] = true
	}
}
