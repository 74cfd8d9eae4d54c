// Package enforcetest gives tests a GPU machine whose driver keeps
// per-cgroup memory limits: go-nvml's mock devices with a limit table
// behind SetMemoryLimits_v1/GetMemoryLimits_v1. The real driver needs a
// GPU and the kernel's dmem controller, which test machines lack.
package enforcetest

import (
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Driver is the limit table.
type Driver struct {
	mu     sync.Mutex
	limits map[string]nvml.MemoryLimits_v1 // uuid + cgroup →
	calls  []Call
	// FailSet makes SetMemoryLimits_v1 fail on this GPU.
	FailSet string
}

// NewMachine returns n mock H100s sharing one limit table, and their UUIDs.
func NewMachine(n int) (*server.Server, *Driver, []string) {
	s := dgxh100.NewWithGPUs(gpus.Multiple(n, gpus.H100_SXM5_80GB)...)
	d := &Driver{limits: map[string]nvml.MemoryLimits_v1{}}
	var uuids []string
	for _, dev := range s.Devices {
		dev := dev.(*server.Device)
		uuid := dev.UUID
		uuids = append(uuids, uuid)
		dev.SetMemoryLimits_v1Func = func(cgroup string, soft, hard uint64) nvml.Return {
			d.mu.Lock()
			defer d.mu.Unlock()
			d.calls = append(d.calls, Call{GPU: uuid, Cgroup: cgroup, Soft: soft, Hard: hard})
			if uuid == d.FailSet {
				return nvml.ERROR_NOT_SUPPORTED
			}
			d.limits[uuid+cgroup] = nvml.MemoryLimits_v1{NameSpace: cgroup, SoftLimit: soft, HardLimit: hard}
			return nvml.SUCCESS
		}
		dev.GetMemoryLimits_v1Func = func(cgroup string) (nvml.MemoryLimits_v1, nvml.Return) {
			d.mu.Lock()
			defer d.mu.Unlock()
			return d.limits[uuid+cgroup], nvml.SUCCESS
		}
	}
	return s, d, uuids
}

// Call is one SetMemoryLimits_v1 call, as the driver received it.
type Call struct {
	GPU, Cgroup string
	Soft, Hard  uint64
}

// Calls returns every SetMemoryLimits_v1 call so far, in order.
func (d *Driver) Calls() []Call {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Call(nil), d.calls...)
}

// Get returns the limits of cgroup on a GPU.
func (d *Driver) Get(uuid, cgroup string) nvml.MemoryLimits_v1 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.limits[uuid+cgroup]
}

// Set overwrites the limits of cgroup on a GPU, as something outside
// gpufrac might.
func (d *Driver) Set(uuid, cgroup string, l nvml.MemoryLimits_v1) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.limits[uuid+cgroup] = l
}
