// Package inventory reads a node's GPUs through NVML: the real library on
// a GPU node, or one of go-nvml's mock machines (--simulate-gpus) for local
// clusters and tests. Both go through the same code; nothing here invents
// a GPU when the library fails.
package inventory

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// GPU is one physical GPU as the node sees it.
type GPU struct {
	Index      int
	UUID       string
	PCIBusID   string
	Product    string
	MemoryMiB  int64
	MIGEnabled bool
}

// Inventory is what a node has.
type Inventory struct {
	DriverVersion string
	// CUDADriverVersion is NVML's integer form: 13040 is CUDA 13.4.
	CUDADriverVersion int
	GPUs              []GPU
}

// Driver-enforced limits need both CUDA 13.4 and an r615 driver.
const (
	minLimitsCUDA   = 13040
	minLimitsDriver = 615
)

// Capability is the enforcement inv allows. None with a MIG-enabled GPU:
// a fraction is of a whole GPU's memory, which MIG has split into
// instances, and MPS v3 memory partitioning does not support MIG
// (NVIDIA MPS, "MPS v3 Memory Partitioning": "MIG is explicitly
// unsupported"), so nothing would enforce the share.
func (inv Inventory) Capability() nodeapi.Enforcement {
	if len(inv.GPUs) == 0 || inv.MIGEnabled() >= 0 {
		return nodeapi.EnforcementNone
	}
	major, _, _ := strings.Cut(inv.DriverVersion, ".")
	if m, err := strconv.Atoi(major); err == nil && m >= minLimitsDriver && inv.CUDADriverVersion >= minLimitsCUDA {
		return nodeapi.EnforcementDriver
	}
	return nodeapi.EnforcementMPSPinned
}

// CapabilityReason says in one line why inv allows Capability and not
// more: what an operator needs to read before trusting the node's limits.
func (inv Inventory) CapabilityReason() string {
	switch inv.Capability() {
	case nodeapi.EnforcementDriver:
		return fmt.Sprintf("driver %s with CUDA %s sets hard and soft memory limits per container cgroup", inv.DriverVersion, inv.CUDAVersion())
	case nodeapi.EnforcementMPSPinned:
		return fmt.Sprintf("driver %s with CUDA %s is older than the r%d driver with CUDA %d.%d that per-cgroup limits need; "+
			"memory is capped per MPS client (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), which an MPS server does not evict", inv.DriverVersion, inv.CUDAVersion(),
			minLimitsDriver, minLimitsCUDA/1000, minLimitsCUDA%1000/10)
	}
	if len(inv.GPUs) == 0 {
		return "NVML lists no GPU"
	}
	return fmt.Sprintf("GPU %d has MIG enabled: MPS memory partitioning does not support MIG, so no fraction of it can be enforced", inv.MIGEnabled())
}

// MIGEnabled is the index of the first GPU with MIG enabled, or -1.
func (inv Inventory) MIGEnabled() int {
	for _, g := range inv.GPUs {
		if g.MIGEnabled {
			return g.Index
		}
	}
	return -1
}

// CUDAVersion renders CUDADriverVersion as "13.4".
func (inv Inventory) CUDAVersion() string {
	return fmt.Sprintf("%d.%d", inv.CUDADriverVersion/1000, inv.CUDADriverVersion%1000/10)
}

// Machines are the simulated machines --simulate-gpus accepts by name.
// It also takes a shape, COUNTxMODEL@MEMORYMi (e.g. 8xG2@32000Mi): COUNT
// GPUs named MODEL with MEMORY MiB each, for replaying a trace whose
// nodes are none of those machines.
var Machines = []string{"dgxa100", "dgxh100", "dgxh200", "dgxb200"}

// MachineHelp lists what --simulate-gpus accepts, for flag help.
func MachineHelp() string {
	return strings.Join(Machines, ", ") + ", or COUNTxMODEL@MEMORYMi (e.g. 8xG2@32000Mi); with " + DriverLimitsSuffix + " (dgxh100" + DriverLimitsSuffix + ") on a driver with per-cgroup memory limits"
}

// DriverLimitsSuffix after a machine's name makes its mock report the
// first driver with per-cgroup memory limits (r615, CUDA 13.4) instead of
// the mock's own (r550): its node then uses the driver backend, as a node
// of the CUDA 13.4 era would, where the mocks' default is an older node
// with MPS pinned-memory limits only.
const DriverLimitsSuffix = "+r615"

// Driver and CUDA versions of a DriverLimitsSuffix machine.
const (
	simulatedLimitsDriver = "615.00"
	simulatedLimitsCUDA   = minLimitsCUDA
)

// shapeMachine is COUNTxMODEL@MEMORYMi.
var shapeMachine = regexp.MustCompile(`^([0-9]+)x([A-Za-z0-9][A-Za-z0-9._-]*)@([0-9]+)Mi$`)

// maxShapeGPUs bounds a shape's GPU count: no server has more.
const maxShapeGPUs = 16

// CheckMachine says whether --simulate-gpus accepts machine, and if not
// why, in one line.
func CheckMachine(machine string) error {
	machine = strings.TrimSuffix(machine, DriverLimitsSuffix)
	if slices.Contains(Machines, machine) {
		return nil
	}
	m := shapeMachine.FindStringSubmatch(machine)
	if m == nil {
		return fmt.Errorf("--simulate-gpus %q: unknown machine; one of %s", machine, MachineHelp())
	}
	count, err1 := strconv.Atoi(m[1])
	mem, err2 := strconv.ParseInt(m[3], 10, 64)
	switch {
	case err1 != nil || count < 1 || count > maxShapeGPUs:
		return fmt.Errorf("--simulate-gpus %q: the GPU count %s must be between 1 and %d", machine, m[1], maxShapeGPUs)
	case err2 != nil || mem < 1 || mem > 1<<30:
		return fmt.Errorf("--simulate-gpus %q: the memory %sMi must be between 1Mi and %dMi", machine, m[3], 1<<30)
	}
	return nil
}

// Simulated returns the NVML library of a go-nvml mock machine whose GPUs
// get new UUIDs at every call (the mock's own): for a view that nothing
// outlives. A simulated node's agent uses SimulatedFor.
func Simulated(machine string) (nvml.Interface, error) {
	return SimulatedFor(machine, "")
}

// SimulatedFor returns the NVML library of a go-nvml mock machine as node
// has it: PCI bus ids, which the mocks leave empty, are filled in as
// 0000:<index+0x18>:00.0 so that every GPU is addressable like a real one,
// and (node not "") each GPU's UUID is derived from the node's name and
// its index, so that the node's GPUs are the same ones after an agent's
// restart, as a real node's are: its books, reservation pods and state
// file name them. Two nodes' GPUs never share a UUID.
func SimulatedFor(machine, node string) (nvml.Interface, error) {
	if err := CheckMachine(machine); err != nil {
		return nil, err
	}
	base, limits := strings.CutSuffix(machine, DriverLimitsSuffix)
	var s *server.Server
	switch base {
	case "dgxa100":
		s = dgxa100.New()
	case "dgxh100":
		s = dgxh100.New()
	case "dgxh200":
		s = dgxh200.New()
	case "dgxb200":
		s = dgxb200.New()
	default:
		// A shape: H100s renamed and resized, on dgxh100's driver.
		m := shapeMachine.FindStringSubmatch(base)
		count, _ := strconv.Atoi(m[1])
		mem, _ := strconv.ParseUint(m[3], 10, 64)
		gpu := gpus.H100_SXM5_80GB
		gpu.Name, gpu.MemoryMB = m[2], mem
		s = dgxh100.NewWithGPUs(gpus.Multiple(count, gpu)...)
	}
	if limits {
		s.SystemGetDriverVersionFunc = func() (string, nvml.Return) { return simulatedLimitsDriver, nvml.SUCCESS }
		s.SystemGetCudaDriverVersionFunc = func() (int, nvml.Return) { return simulatedLimitsCUDA, nvml.SUCCESS }
	}
	for i, d := range s.Devices {
		dev, ok := d.(*server.Device)
		if !ok {
			continue
		}
		simulateComputeMode(dev)
		if node != "" {
			dev.UUID = simulatedUUID(node, i)
		}
		busID := fmt.Sprintf("0000:%02x:00.0", 0x18+i)
		base := dev.GetPciInfoFunc
		dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			p, ret := base()
			for j := range busID {
				p.BusId[j] = int8(busID[j])
			}
			return p, ret
		}
	}
	return s, nil
}

// simulatedUUID is GPU index of node's UUID: GPU- and the first 16 bytes
// of SHA-256(node/index), in a UUID's form.
func simulatedUUID(node string, index int) string {
	h := sha256.Sum256([]byte(node + "/" + strconv.Itoa(index)))
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// Read initialises lib, reads every GPU and shuts the library down again.
// Any NVML failure is returned as an error naming the call: the caller
// reports the node not ready rather than guessing.
func Read(lib nvml.Interface) (Inventory, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return Inventory{}, nvmlError("nvmlInit", ret)
	}
	defer func() { _ = lib.Shutdown() }() // nothing to do if releasing the library fails
	var inv Inventory
	var ret nvml.Return
	if inv.DriverVersion, ret = lib.SystemGetDriverVersion(); ret != nvml.SUCCESS {
		return Inventory{}, nvmlError("nvmlSystemGetDriverVersion", ret)
	}
	if inv.CUDADriverVersion, ret = lib.SystemGetCudaDriverVersion(); ret != nvml.SUCCESS {
		return Inventory{}, nvmlError("nvmlSystemGetCudaDriverVersion", ret)
	}
	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return Inventory{}, nvmlError("nvmlDeviceGetCount", ret)
	}
	for i := range count {
		gpu, err := readDevice(lib, i)
		if err != nil {
			return Inventory{}, err
		}
		inv.GPUs = append(inv.GPUs, gpu)
	}
	slices.SortFunc(inv.GPUs, func(a, b GPU) int { return a.Index - b.Index })
	return inv, nil
}

func readDevice(lib nvml.Interface, i int) (GPU, error) {
	dev, ret := lib.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		return GPU{}, nvmlError(fmt.Sprintf("nvmlDeviceGetHandleByIndex(%d)", i), ret)
	}
	g := GPU{Index: i}
	if g.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
		return GPU{}, nvmlError(fmt.Sprintf("GPU %d: nvmlDeviceGetUUID", i), ret)
	}
	if g.Product, ret = dev.GetName(); ret != nvml.SUCCESS {
		return GPU{}, nvmlError(fmt.Sprintf("GPU %d: nvmlDeviceGetName", i), ret)
	}
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return GPU{}, nvmlError(fmt.Sprintf("GPU %d: nvmlDeviceGetMemoryInfo", i), ret)
	}
	g.MemoryMiB = int64(mem.Total >> 20)
	pci, ret := dev.GetPciInfo()
	if ret != nvml.SUCCESS {
		return GPU{}, nvmlError(fmt.Sprintf("GPU %d: nvmlDeviceGetPciInfo", i), ret)
	}
	g.PCIBusID = cString(pci.BusId[:])
	// A GPU without MIG support answers NOT_SUPPORTED, which means "not
	// enabled". Enabled, the node takes no fractions (Capability).
	if current, _, ret := dev.GetMigMode(); ret == nvml.SUCCESS {
		g.MIGEnabled = current == nvml.DEVICE_MIG_ENABLE
	} else if !errors.Is(ret, nvml.ERROR_NOT_SUPPORTED) {
		return GPU{}, nvmlError(fmt.Sprintf("GPU %d: nvmlDeviceGetMigMode", i), ret)
	}
	return g, nil
}

func cString(b []int8) string {
	var s strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		s.WriteByte(byte(c))
	}
	return s.String()
}

// simulateComputeMode gives a mock GPU a compute mode that NVML reads and
// sets (the mocks have none), starting in Default as a real GPU does.
func simulateComputeMode(dev *server.Device) {
	var mu sync.Mutex
	mode := nvml.COMPUTEMODE_DEFAULT
	dev.GetComputeModeFunc = func() (nvml.ComputeMode, nvml.Return) {
		mu.Lock()
		defer mu.Unlock()
		return mode, nvml.SUCCESS
	}
	dev.SetComputeModeFunc = func(m nvml.ComputeMode) nvml.Return {
		if m < nvml.COMPUTEMODE_DEFAULT || m >= nvml.COMPUTEMODE_COUNT {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		mu.Lock()
		defer mu.Unlock()
		mode = m
		return nvml.SUCCESS
	}
}

// nvmlError converts an NVML return code at the boundary into an error
// naming the call; Return.Error works without the library loaded.
func nvmlError(call string, ret nvml.Return) error {
	return fmt.Errorf("%s: %w (NVML return %d)", call, ret, int32(ret))
}
