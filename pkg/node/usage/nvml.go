package usage

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Sampler reads the GPUs' processes through NVML and joins each to its
// container through /proc (the agent runs in the host's PID namespace,
// so NVML's PIDs are its own).
//
// What NVML says, and so what each figure means (nvml.h):
//   - nvmlDeviceGetComputeRunningProcesses lists the processes with a
//     compute context on a GPU; each one's usedGpuMemory is "all of the
//     memory used by the application". Under MPS that is the MPS server's
//     process, whose memory is the shared context every client runs in.
//   - nvmlDeviceGetMPSComputeRunningProcesses lists the "processes with a
//     Multi-Process Service (MPS) compute context on a device": the MPS
//     clients, each with the memory it allocated. So under MPS a tenant's
//     figure is per client (what its own processes allocated), and the
//     server's shared context is the GPU's unattributed memory.
//   - nvmlDeviceGetProcessUtilization returns one sample "per process
//     running, that had some non-zero utilization during the last sample
//     period", newer than the last timestamp seen; NVML_ERROR_NOT_FOUND
//     when none is: every process was idle (0 %, not unknown).
//
// A call that fails (NOT_SUPPORTED on a driver or GPU that cannot say)
// leaves that figure unknown for every tenant of the GPU.
type Sampler struct {
	Lib nvml.Interface
	// ProcRoot is where /proc is ("/proc" on a node).
	ProcRoot string
	// lastSeen is, per GPU, the newest utilisation sample read.
	lastSeen map[string]uint64
}

// process is one process on a GPU.
type process struct {
	mem uint64
	// memUnknown: the driver listed the process without its memory
	// (usedGpuMemory is NVML_VALUE_NOT_AVAILABLE).
	memUnknown bool
	sm         int64
	smSamples  int
	mpsClient  bool
	// container is the container its cgroup names ("" for none); exited:
	// NVML lists it and /proc does not (it is counted nowhere).
	container string
	exited    bool
}

// smPercent is the mean of its samples since the last reading (none: it
// was idle).
func (p *process) smPercent() int64 {
	if p.smSamples == 0 {
		return 0
	}
	return p.sm / int64(p.smSamples)
}

// notAvailable is NVML_VALUE_NOT_AVAILABLE as an unsigned long long: what
// nvml.h says usedGpuMemory holds where the driver does not know it.
const notAvailable = ^uint64(0)

// gpuRead is what NVML said of one GPU.
type gpuRead struct {
	procs    map[uint32]*process
	memKnown bool
	smKnown  bool
	// clientSMUnknown: MPS clients run here and the driver's samples name
	// none of them, only other PIDs (the MPS server's): the work a client
	// does is not told apart, so its SM is unknown, not 0.
	clientSMUnknown bool
	usedBytes       Figure
	utilPercent     Figure
}

// smKnownFor says whether p's SM figure is one: the GPU has samples, and p
// is not an MPS client whose work the samples do not tell apart.
func (r *gpuRead) smKnownFor(p *process) bool {
	return r.smKnown && (!p.mpsClient || !r.clientSMUnknown)
}

// open initialises NVML for one reading; the caller shuts it down.
func (s *Sampler) open() error {
	if s.Lib == nil {
		return fmt.Errorf("no NVML library")
	}
	if ret := s.Lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("nvmlInit: %s", nvml.ErrorString(ret))
	}
	if s.lastSeen == nil {
		s.lastSeen = map[string]uint64{}
	}
	return nil
}

// readAll reads every GPU (by lower-case UUID) and joins each process to
// its container, each /proc/<pid>/cgroup read once: a PID gone from /proc
// has exited (NVML may list it a moment longer).
func (s *Sampler) readAll(gpus []string) map[string]*gpuRead {
	reads := map[string]*gpuRead{}
	type owner struct {
		container string
		exited    bool
	}
	owners := map[uint32]owner{}
	for _, uuid := range gpus {
		r := s.read(uuid)
		for pid, p := range r.procs {
			o, seen := owners[pid]
			if !seen {
				raw, err := os.ReadFile(filepath.Join(s.ProcRoot, strconv.FormatUint(uint64(pid), 10), "cgroup"))
				o = owner{container: ContainerID(string(raw)), exited: err != nil}
				owners[pid] = o
			}
			p.container, p.exited = o.container, o.exited
		}
		reads[strings.ToLower(uuid)] = r
	}
	return reads
}

// Measure reads tenants' use of their GPUs, and each GPU's.
func (s *Sampler) Measure(tenants []Tenant, gpus []string, now time.Time) Measurement {
	m := Measurement{At: now}
	if s.open() != nil {
		for _, uuid := range gpus {
			m.GPUs = append(m.GPUs, GPU{UUID: uuid})
		}
		for _, t := range tenants {
			for _, uuid := range t.Devices {
				m.Containers = append(m.Containers, Container{Tenant: t, GPU: uuid})
			}
		}
		return m
	}
	defer func() { _ = s.Lib.Shutdown() }()
	reads := s.readAll(gpus)
	attributed := map[string]map[uint32]bool{} // GPU (lower case) → PIDs of tenants
	for _, t := range tenants {
		for _, uuid := range t.Devices {
			c := Container{Tenant: t, GPU: uuid}
			key := strings.ToLower(uuid)
			r := reads[key]
			if r != nil && t.ID != "" {
				c.MemoryBytes.Known, c.SMPercent.Known = r.memKnown, r.smKnown
				for pid, p := range r.procs {
					if p.exited || p.container != t.ID {
						continue
					}
					if attributed[key] == nil {
						attributed[key] = map[uint32]bool{}
					}
					attributed[key][pid] = true
					c.Processes++
					c.MemoryBytes.Value += int64(p.mem)
					c.MemoryBytes.Known = c.MemoryBytes.Known && !p.memUnknown
					c.SMPercent.Known = c.SMPercent.Known && r.smKnownFor(p)
					c.SMPercent.Value += p.smPercent()
				}
				c.SMPercent.Value = min(c.SMPercent.Value, 100)
			}
			m.Containers = append(m.Containers, c)
		}
	}
	for _, uuid := range gpus {
		key := strings.ToLower(uuid)
		r := reads[key]
		g := GPU{UUID: uuid, MemoryBytes: r.usedBytes, SMPercent: r.utilPercent, PerProcessMemory: r.memKnown, PerProcessSM: r.smKnown && !r.clientSMUnknown}
		if r.memKnown {
			g.UnattributedBytes = Known(0)
			for pid, p := range r.procs {
				if !p.exited && !attributed[key][pid] {
					g.UnattributedBytes.Value += int64(p.mem)
					g.UnattributedBytes.Known = g.UnattributedBytes.Known && !p.memUnknown
				}
			}
		}
		m.GPUs = append(m.GPUs, g)
	}
	return m
}

// read asks NVML about one GPU.
func (s *Sampler) read(uuid string) *gpuRead {
	r := &gpuRead{procs: map[uint32]*process{}}
	dev, ret := s.Lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return r
	}
	if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
		r.usedBytes = Known(int64(mem.Used))
	}
	if u, ret := dev.GetUtilizationRates(); ret == nvml.SUCCESS {
		r.utilPercent = Known(int64(u.Gpu))
	}
	note := func(infos []nvml.ProcessInfo, mpsClient bool) {
		for _, info := range infos {
			p := r.procs[info.Pid]
			if p == nil {
				p = &process{}
				r.procs[info.Pid] = p
			}
			// A client listed by both calls is counted once.
			if info.UsedGpuMemory == notAvailable {
				p.memUnknown = true
			} else {
				p.mem = max(p.mem, info.UsedGpuMemory)
			}
			p.mpsClient = p.mpsClient || mpsClient
		}
	}
	compute, ret := dev.GetComputeRunningProcesses()
	if ret == nvml.SUCCESS {
		r.memKnown = true
		note(compute, false)
	}
	if clients, ret := dev.GetMPSComputeRunningProcesses(); ret == nvml.SUCCESS {
		r.memKnown = true
		note(clients, true)
	}
	samples, ret := dev.GetProcessUtilization(s.lastSeen[uuid])
	switch ret {
	case nvml.SUCCESS:
		r.smKnown = true
		for _, sample := range samples {
			s.lastSeen[uuid] = max(s.lastSeen[uuid], sample.TimeStamp)
			p := r.procs[sample.Pid]
			if p == nil {
				p = &process{}
				r.procs[sample.Pid] = p
			}
			p.sm += int64(sample.SmUtil)
			p.smSamples++
		}
	case nvml.ERROR_NOT_FOUND:
		r.smKnown = true // no process was busy since the last sample
	}
	clients, clientSamples, otherSamples := 0, 0, 0
	for _, p := range r.procs {
		switch {
		case p.mpsClient:
			clients++
			clientSamples += p.smSamples
		default:
			otherSamples += p.smSamples
		}
	}
	r.clientSMUnknown = clients > 0 && clientSamples == 0 && otherSamples > 0
	return r
}

// Process is one process on a GPU as NVML lists it, with the container
// its cgroup names ("" for none), as `gpufrac usage` prints it.
type Process struct {
	GPU string `json:"gpu"`
	PID uint32 `json:"pid"`
	// MemoryBytes is unknown (nil) where the driver does not say.
	MemoryBytes *uint64 `json:"memoryBytes,omitempty"`
	// SMPercent is unknown (nil) where the driver gives no samples.
	SMPercent *int64 `json:"smPercent,omitempty"`
	MPSClient bool   `json:"mpsClient"`
	Container string `json:"container,omitempty"`
	// Exited: NVML lists it, /proc does not (it is not counted).
	Exited bool `json:"exited,omitempty"`
}

// Processes lists every process on gpus, each joined to its container,
// as Measure sees them; nil with the reason where NVML cannot start.
func (s *Sampler) Processes(gpus []string) ([]Process, error) {
	if err := s.open(); err != nil {
		return nil, err
	}
	defer func() { _ = s.Lib.Shutdown() }()
	reads := s.readAll(gpus)
	var out []Process
	for _, uuid := range gpus {
		r := reads[strings.ToLower(uuid)]
		for pid, p := range r.procs {
			proc := Process{GPU: uuid, PID: pid, MPSClient: p.mpsClient, Container: p.container, Exited: p.exited}
			if !p.memUnknown {
				mem := p.mem
				proc.MemoryBytes = &mem
			}
			if r.smKnownFor(p) {
				sm := p.smPercent()
				proc.SMPercent = &sm
			}
			out = append(out, proc)
		}
	}
	slices.SortFunc(out, func(a, b Process) int { return cmp.Or(cmp.Compare(a.GPU, b.GPU), cmp.Compare(a.PID, b.PID)) })
	return out, nil
}

// containerID matches the runtime's container ID in a cgroup path
// element: 64 hex digits, as containerd, CRI-O and Docker name them,
// alone (cgroupfs: /kubepods/burstable/pod<uid>/<id>) or in a systemd
// scope (cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope).
var containerID = regexp.MustCompile(`(?:^|[-:])([0-9a-f]{64})(?:\.scope)?$`)

// ContainerID is the container a process is in, from the content of its
// /proc/<pid>/cgroup: the ID in the unified (cgroup v2) line's path, or
// else in a v1 line's; in the innermost path element that names one, since
// a container's processes may sit in a cgroup below its own (crun with the
// systemd driver puts them in <scope>/container; a workload may make its
// own). "" for a process in no container.
func ContainerID(procCgroup string) string {
	var v1 string
	for _, line := range strings.Split(procCgroup, "\n") {
		hierarchy, rest, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		_, path, ok := strings.Cut(rest, ":")
		if !ok {
			continue
		}
		id := innermostID(path)
		if id == "" {
			continue
		}
		if hierarchy == "0" {
			return id
		}
		if v1 == "" {
			v1 = id
		}
	}
	return v1
}

// innermostID is the container ID in the deepest element of a cgroup path
// that names one.
func innermostID(path string) string {
	elems := strings.Split(path, "/")
	for i := len(elems) - 1; i >= 0; i-- {
		if m := containerID.FindStringSubmatch(elems[i]); m != nil {
			return m[1]
		}
	}
	return ""
}
