package dra

import (
	"fmt"
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

func machine(n int) inventory.Inventory {
	inv := inventory.Inventory{DriverVersion: "615.43.02"}
	for i := range n {
		inv.GPUs = append(inv.GPUs, inventory.GPU{Index: i, UUID: fmt.Sprintf("GPU-%d", i), Product: "NVIDIA H100 80GB HBM3", MemoryMiB: 81920})
	}
	return inv
}

// Each GPU is two shared devices, one per mode, both drawing on the GPU's
// one mode counter; only the sm-sharing device offers compute.
func TestDevicesOnePerModeSharingTheGPUsCounter(t *testing.T) {
	devs := Devices(machine(2), 1024)
	if len(devs) != 4 {
		t.Fatalf("got %d devices, want 4", len(devs))
	}
	for i, d := range devs {
		gpu, mode := i/2, []string{"time-slicing", "sm-sharing"}[i%2]
		if d.Name != fmt.Sprintf("gpu-%d-%s", gpu, mode) || *d.Attributes[AttrMode].StringValue != mode {
			t.Errorf("device %d is %s (%s), want gpu-%d-%s", i, d.Name, *d.Attributes[AttrMode].StringValue, gpu, mode)
		}
		if d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations {
			t.Errorf("%s: not shareable", d.Name)
		}
		if len(d.ConsumesCounters) != 1 || d.ConsumesCounters[0].CounterSet != fmt.Sprintf("gpu-%d", gpu) {
			t.Errorf("%s: consumes %+v, want its GPU's counter set", d.Name, d.ConsumesCounters)
		}
		mem := d.Capacity[CapacityMemory].Value
		if mem.Value() != (81920-1024)<<20 {
			t.Errorf("%s: memory %s, want the GPU's less the reserve", d.Name, mem.String())
		}
		_, compute := d.Capacity[CapacityCompute]
		if compute != (mode == "sm-sharing") {
			t.Errorf("%s: offers compute %v", d.Name, compute)
		}
		if v := d.Attributes[AttrDriverVersion].VersionValue; v == nil || *v != "615.43.2" {
			t.Errorf("%s: driver version %v, want 615.43.2", d.Name, v)
		}
	}
}

// A GPU nothing can enforce a share of is not published; a node with none
// publishes its pool empty.
func TestDevicesLeaveOutWhatCannotBeShared(t *testing.T) {
	inv := machine(3)
	inv.GPUs[1].MIGEnabled = true
	inv.GPUs[2].MemoryMiB = 1024 + MinMemoryMiB - 1
	devs := Devices(inv, 1024)
	if len(devs) != 2 || devs[0].Name != "gpu-0-time-slicing" {
		t.Fatalf("got %d devices (%v), want only GPU 0's two", len(devs), devs)
	}
	pool := Resources("n", machine(0), 0, OfferAll(machine(0))).Pools["n"]
	if len(pool.Slices) != 1 || len(pool.Slices[0].Devices) != 0 || len(pool.Slices[0].SharedCounters) != 0 {
		t.Fatalf("a node without GPUs: pool %+v, want one empty slice", pool)
	}
}

// The API server's per-slice limits: counter sets and devices in separate
// slices, at most 8 counter sets and 64 shared devices a slice.
func TestResourcesSplitAtTheAPIsLimits(t *testing.T) {
	for _, n := range []int{1, 8, 9, 32, 33, 40} {
		pool := Resources("n", machine(n), 0, OfferAll(machine(n))).Pools["n"]
		sets, devices := 0, 0
		for i, s := range pool.Slices {
			if len(s.SharedCounters) > 0 && len(s.Devices) > 0 {
				t.Errorf("%d GPUs, slice %d: counters and devices together", n, i)
			}
			if len(s.SharedCounters) > resourceapi.ResourceSliceMaxCounterSets || len(s.Devices) > resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures {
				t.Errorf("%d GPUs, slice %d: %d counter sets, %d devices", n, i, len(s.SharedCounters), len(s.Devices))
			}
			sets += len(s.SharedCounters)
			devices += len(s.Devices)
		}
		if sets != n || devices != 2*n {
			t.Errorf("%d GPUs: %d counter sets and %d devices, want %d and %d", n, sets, devices, n, 2*n)
		}
	}
}

func TestSemver(t *testing.T) {
	for in, want := range map[string]string{"615.43.02": "615.43.2", "580.65": "580.65.0", "": "", "615": "", "615.x.1": "", "1.2.3.4": "", "-1.2.3": ""} {
		got, ok := semver(in)
		if got != want || ok != (want != "") {
			t.Errorf("semver(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
}

// Only offered GPUs are published, less what annotation shares hold, and
// without the device of the mode they do not use.
func TestResourcesOfferWhatAnnotationSharesLeave(t *testing.T) {
	inv := machine(3)
	offers := Offers{
		inv.GPUs[0].UUID: {MemoryMiB: 20480, Mode: api.TimeSlicing},
		inv.GPUs[1].UUID: {MemoryMiB: 10240, Mode: api.SMSharing, Portion: 255},
	}
	var devices []string
	memory := map[string]int64{}
	compute := map[string]int64{}
	for _, s := range Resources("n", inv, 1024, offers).Pools["n"].Slices {
		for _, d := range s.Devices {
			devices = append(devices, d.Name)
			q := d.Capacity[CapacityMemory].Value
			memory[d.Name] = q.Value() >> 20
			if c, ok := d.Capacity[CapacityCompute]; ok {
				compute[d.Name] = c.Value.Value()
			}
		}
	}
	ts0, sm1 := DeviceName(inv.GPUs[0].UUID, api.TimeSlicing), DeviceName(inv.GPUs[1].UUID, api.SMSharing)
	if !slices.Equal(devices, []string{ts0, sm1}) {
		t.Fatalf("devices %v, want only %s and %s (GPU 2 is not offered; each offered GPU keeps its shares' mode)", devices, ts0, sm1)
	}
	if memory[ts0] != inv.GPUs[0].MemoryMiB-1024-20480 || memory[sm1] != inv.GPUs[1].MemoryMiB-1024-10240 {
		t.Errorf("memory offered %v: want each GPU's schedulable memory less its annotation shares", memory)
	}
	if compute[sm1] != 74 {
		t.Errorf("compute offered on %s: %d%%, want 74 (25.5%% held, rounded to what is surely left)", sm1, compute[sm1])
	}
	full := Offers{inv.GPUs[0].UUID: {MemoryMiB: inv.GPUs[0].MemoryMiB - 1024 - MinMemoryMiB + 1, Mode: api.TimeSlicing}}
	for _, s := range Resources("n", inv, 1024, full).Pools["n"].Slices {
		if len(s.Devices) > 0 {
			t.Errorf("a GPU with less than the minimum share left publishes %d devices", len(s.Devices))
		}
	}
}
