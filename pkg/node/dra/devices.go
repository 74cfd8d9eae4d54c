// Package dra is the node agent's second front door: a Dynamic Resource
// Allocation driver, gpu.gpufrac.io, whose devices are the node's GPUs,
// each allocatable many times over by memory (and, for sm-sharing, by
// compute), so that kube-scheduler's own allocator can hand out shares of
// a GPU through ResourceClaims (KEP-5075, consumable capacity: beta and on
// by default since Kubernetes 1.36).
//
// This file is what the driver publishes: one ResourceSlice per node, one
// device per GPU.
package dra

import (
	"fmt"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

// DriverName is the driver's name, the DeviceClass's and the opaque
// config's.
const DriverName = api.DRADriver

// The device's capacities: a claim asks for them in
// spec.devices.requests[].exactly.capacity.requests.
const (
	// CapacityMemory is the GPU's schedulable memory (total less the
	// node's per-GPU reserve), the share a claim is guaranteed.
	CapacityMemory resourceapi.QualifiedName = api.DRACapacityMemory
	// CapacityCompute is the GPU's compute in percent. Only sm-sharing
	// claims ask for it; a time-slicing claim consumes none.
	CapacityCompute resourceapi.QualifiedName = api.DRACapacityCompute
)

// The device's attributes, for a claim's or a DeviceClass's CEL
// selectors (device.attributes["gpu.gpufrac.io"].uuid, …).
const (
	AttrUUID          resourceapi.QualifiedName = "uuid"
	AttrIndex         resourceapi.QualifiedName = "index"
	AttrProduct       resourceapi.QualifiedName = "productName"
	AttrMemoryMiB     resourceapi.QualifiedName = "memoryMiB"
	AttrDriverVersion resourceapi.QualifiedName = "driverVersion"
)

// MinMemoryMiB is the smallest memory a claim is given: a request below it
// is raised to it (the allocator's validRange), as is a claim that names
// no memory at all.
const MinMemoryMiB = api.DRAMinMemoryMiB

// AttrMode is the device's compute mode, api.TimeSlicing or api.SMSharing.
const AttrMode resourceapi.QualifiedName = "computeMode"

// modeCounter is the counter each mode's device of a GPU consumes one of,
// from the GPU's counter set of one: the allocator charges a shared
// device's counters once, while any claim holds it (the structured
// allocator's checkAvailableCounters and deviceCapacityInUse), so while a
// claim holds one mode's device the other mode's cannot be allocated.
const modeCounter = "mode"

// Per-slice limits of resource.k8s.io/v1: counter sets and devices that
// consume counters or are shared are capped per ResourceSlice.
const (
	maxCounterSets    = resourceapi.ResourceSliceMaxCounterSets
	gpusPerDeviceSlab = resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures / 2 // a device per mode
)

// DeviceName is the name of the device for mode on the GPU of that UUID
// (api.DRADeviceName: the UUID lower-cased, then the mode). usable leaves
// out GPUs whose UUID cannot name a device.
func DeviceName(uuid string, mode api.ComputeMode) string {
	name, _ := api.DRADeviceName(uuid, mode)
	return name
}

// counterSet is the GPU's counter set: its UUID lower-cased, a DNS label.
func counterSet(uuid string) string { return strings.ToLower(uuid) }

// Devices is what the node publishes for one GPU, twice: a device per
// compute mode (time-slicing first, the default), that many claims may
// share, of which only one at a time can be held (see modeCounter). Each
// offers the GPU's schedulable memory (MemoryMiB less reserveMiB, the
// scheduler's per-GPU reserve for this model); the sm-sharing one also
// offers 100 percent of compute, which its claims split. A GPU with MIG
// enabled, or too small to give the minimum share, is left out: nothing
// could enforce a share of it.
func Devices(inv inventory.Inventory, reserveMiB int64) []resourceapi.Device {
	return devicesOf(inv, usable(inv, reserveMiB), reserveMiB)
}

func devicesOf(inv inventory.Inventory, gpus []inventory.GPU, reserveMiB int64) []resourceapi.Device {
	var out []resourceapi.Device
	for _, g := range gpus {
		for _, mode := range []api.ComputeMode{api.TimeSlicing, api.SMSharing} {
			out = append(out, device(inv, g, reserveMiB, mode))
		}
	}
	return out
}

func usable(inv inventory.Inventory, reserveMiB int64) []inventory.GPU {
	var out []inventory.GPU
	for _, g := range inv.GPUs {
		_, named := api.DRADeviceName(g.UUID, api.TimeSlicing)
		if !g.MIGEnabled && g.MemoryMiB-reserveMiB >= MinMemoryMiB && named {
			out = append(out, g)
		}
	}
	return out
}

func device(inv inventory.Inventory, g inventory.GPU, reserveMiB int64, mode api.ComputeMode) resourceapi.Device {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrUUID:      {StringValue: ptr.To(g.UUID)},
		AttrIndex:     {IntValue: ptr.To(int64(g.Index))},
		AttrProduct:   {StringValue: ptr.To(g.Product)},
		AttrMemoryMiB: {IntValue: ptr.To(g.MemoryMiB)},
		AttrMode:      {StringValue: ptr.To(string(mode))},
	}
	if v, ok := semver(inv.DriverVersion); ok {
		attrs[AttrDriverVersion] = resourceapi.DeviceAttribute{VersionValue: ptr.To(v)}
	}
	capacity := map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
		CapacityMemory: {
			Value: mib(g.MemoryMiB - reserveMiB),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    ptr.To(mib(MinMemoryMiB)),
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(mib(MinMemoryMiB)), Step: ptr.To(mib(1))},
			},
		},
	}
	if mode == api.SMSharing {
		// A claim that names no compute gets the least, one percent; the
		// webhook asks sm-sharing claims to name it.
		one := resource.MustParse("1")
		capacity[CapacityCompute] = resourceapi.DeviceCapacity{
			Value: resource.MustParse("100"),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    &one,
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: &one, Step: &one},
			},
		}
	}
	return resourceapi.Device{
		Name:                     DeviceName(g.UUID, mode),
		Attributes:               attrs,
		Capacity:                 capacity,
		AllowMultipleAllocations: ptr.To(true),
		ConsumesCounters: []resourceapi.DeviceCounterConsumption{{
			CounterSet: counterSet(g.UUID),
			Counters:   map[string]resourceapi.Counter{modeCounter: {Value: resource.MustParse("1")}},
		}},
	}
}

// Held is what annotation shares hold of a GPU the node offers claims
// (the scheduler writes it on the GPU's standing reservation pod): the
// scheduler books both front doors on one ledger, and the allocator sees
// the annotation shares only through what the node publishes.
type Held = api.SharesHeld

// Offers is what the node offers claims: by GPU UUID (any case), the GPUs
// held for sharing (standing reservation pods hold them against the
// device plugin, so no whole-GPU pod can be given one) with what
// annotation shares hold of each. A GPU not listed is not offered.
type Offers map[string]Held

// OfferAll offers every GPU of inv, nothing held: for a node where only
// claims share GPUs.
func OfferAll(inv inventory.Inventory) Offers {
	o := Offers{}
	for _, g := range inv.GPUs {
		o[g.UUID] = Held{}
	}
	return o
}

func (o Offers) of(uuid string) (Held, bool) {
	for u, h := range o {
		if strings.EqualFold(u, uuid) {
			return h, true
		}
	}
	return Held{}, false
}

// Resources is the node's whole publication: one pool, named after the
// node. The API server keeps counter sets and devices in separate slices,
// so the pool holds the GPUs' counter sets (eight a slice) and then their
// devices (64 a slice), in GPU order: the allocator tries slices by name
// and devices in order, first fit, so shares pack onto the first GPUs.
// Only offered GPUs are published, each with the memory (and compute)
// annotation shares leave, and without the device of the mode they do
// not use; a GPU they leave less than the minimum share of publishes no
// device. A node without a GPU it can enforce a share of publishes the
// pool empty, so that the allocator places no claim there (an empty pool,
// unlike no pool, shows the driver is running).
func Resources(nodeName string, inv inventory.Inventory, reserveMiB int64, offers Offers) resourceslice.DriverResources {
	var gpus []inventory.GPU
	for _, g := range usable(inv, reserveMiB) {
		if _, ok := offers.of(g.UUID); ok {
			gpus = append(gpus, g)
		}
	}
	var slices []resourceslice.Slice
	for lo := 0; lo < len(gpus); lo += maxCounterSets {
		var sets []resourceapi.CounterSet
		for _, g := range gpus[lo:min(lo+maxCounterSets, len(gpus))] {
			sets = append(sets, resourceapi.CounterSet{Name: counterSet(g.UUID),
				Counters: map[string]resourceapi.Counter{modeCounter: {Value: resource.MustParse("1")}}})
		}
		slices = append(slices, resourceslice.Slice{SharedCounters: sets})
	}
	var devices []resourceapi.Device
	for _, g := range gpus {
		held, _ := offers.of(g.UUID)
		devices = append(devices, offered(inv, g, reserveMiB, held)...)
	}
	for lo := 0; lo < len(devices); lo += 2 * gpusPerDeviceSlab {
		slices = append(slices, resourceslice.Slice{Devices: devices[lo:min(lo+2*gpusPerDeviceSlab, len(devices))]})
	}
	if len(slices) == 0 {
		slices = []resourceslice.Slice{{}}
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{nodeName: {Slices: slices}}}
}

// offered is a GPU's devices less what annotation shares hold.
func offered(inv inventory.Inventory, g inventory.GPU, reserveMiB int64, held Held) []resourceapi.Device {
	left := g.MemoryMiB - reserveMiB - held.MemoryMiB
	if left < MinMemoryMiB {
		return nil
	}
	var out []resourceapi.Device
	for _, mode := range []api.ComputeMode{api.TimeSlicing, api.SMSharing} {
		if held.Mode != "" && held.Mode != mode {
			continue
		}
		d := device(inv, g, reserveMiB, mode)
		d.Capacity[CapacityMemory] = withValue(d.Capacity[CapacityMemory], mib(left))
		if mode == api.SMSharing {
			percent := (1000 - held.Portion) / 10 // whole percent left, rounded down
			if percent < 1 {
				continue
			}
			d.Capacity[CapacityCompute] = withValue(d.Capacity[CapacityCompute], *resource.NewQuantity(percent, resource.DecimalSI))
		}
		out = append(out, d)
	}
	return out
}

func withValue(c resourceapi.DeviceCapacity, v resource.Quantity) resourceapi.DeviceCapacity {
	c.Value = v
	return c
}

func mib(n int64) resource.Quantity { return *resource.NewQuantity(n<<20, resource.BinarySI) }

// semver turns NVIDIA's driver version (615.43.02) into the semantic
// version a version attribute must be (615.43.2): leading zeros are not
// allowed there.
func semver(v string) (string, bool) {
	parts := strings.Split(v, ".")
	if len(parts) < 2 || len(parts) > 3 {
		return "", false
	}
	for len(parts) < 3 {
		parts = append(parts, "0")
	}
	out := make([]string, 3)
	for i, p := range parts {
		n, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return "", false
		}
		out[i] = strconv.FormatUint(n, 10)
	}
	return fmt.Sprintf("%s.%s.%s", out[0], out[1], out[2]), true
}
