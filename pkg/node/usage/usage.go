// Package usage measures what each fractional container uses of its GPUs:
// memory and SM utilisation per process from NVML, joined to containers
// through each process's cgroup (PID → cgroup → container ID → pod), or
// from a deterministic model on a simulated node; and it remembers a
// window of readings per pod and GPU for percentiles (right-sizing).
//
// A figure the driver cannot give is unknown (Known false), never zero.
package usage

import (
	"cmp"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Tenant is one fractional container whose use is measured.
type Tenant struct {
	// ID is the container's runtime ID (what its cgroup is named after);
	// "" on a simulated node, where no container runs.
	ID                   string
	Namespace, Pod, UID  string
	Container            string
	Devices              []string
	RequestMiB, LimitMiB int64
	Mode                 api.ComputeMode
	// Load is the simulated load (api.SimulatedLoadAnnotation) of its pod;
	// read only on a simulated node.
	Load string
}

// PodKey is namespace/name.
func (t Tenant) PodKey() string { return t.Namespace + "/" + t.Pod }

// Figure is one measured value, or an unknown one.
type Figure struct {
	Value int64
	Known bool
}

// Known is a measured value.
func Known(v int64) Figure { return Figure{Value: v, Known: true} }

func (f Figure) ptr() *int64 {
	if !f.Known {
		return nil
	}
	v := f.Value
	return &v
}

// Container is one tenant's use of one GPU.
type Container struct {
	Tenant Tenant
	GPU    string
	// MemoryBytes is what its processes hold (NVML's usedGpuMemory,
	// summed); SMPercent their SM utilisation over the last sampling
	// period (NVML's process samples, summed, at most 100).
	MemoryBytes Figure
	SMPercent   Figure
	// Processes counts its processes on the GPU.
	Processes int
}

// GPU is one GPU's use as a whole.
type GPU struct {
	UUID        string
	MemoryBytes Figure
	// UnattributedBytes is what processes outside every fractional
	// container hold (whole-GPU pods, the MPS server, host processes).
	UnattributedBytes Figure
	SMPercent         Figure
	// PerProcessMemory and PerProcessSM say whether the driver lists the
	// GPU's processes and their utilisation samples: where it does not,
	// its tenants' figures are unknown.
	PerProcessMemory, PerProcessSM bool
}

// Measurement is one reading of the node.
type Measurement struct {
	At         time.Time
	Containers []Container
	GPUs       []GPU
}

// point is one reading of a pod on a GPU.
type point struct {
	at     time.Time
	memMiB Figure
	sm     Figure
}

// Window remembers the readings of the last Span, per pod and GPU (a
// pod's containers summed): what the percentiles of right-sizing read.
// Its memory is bounded by the span over the sampling period, per pod.
type Window struct {
	Span   time.Duration
	series map[string][]point // pod UID, pod and GPU, joined by NULs
	last   Measurement
}

// NewWindow remembers span of readings.
func NewWindow(span time.Duration) *Window {
	return &Window{Span: span, series: map[string][]point{}}
}

// Add records m; the series of pods m no longer has are dropped.
func (w *Window) Add(m Measurement) {
	now := map[string]point{}
	for _, c := range m.Containers {
		// By UID too: a pod re-created under its name (a StatefulSet's)
		// starts a history of its own.
		key := c.Tenant.UID + "\x00" + c.Tenant.PodKey() + "\x00" + c.GPU
		p, seen := now[key]
		if !seen {
			p = point{at: m.At, memMiB: Known(0), sm: Known(0)}
		}
		p.memMiB = add(p.memMiB, Figure{Value: c.MemoryBytes.Value >> 20, Known: c.MemoryBytes.Known})
		p.sm = add(p.sm, c.SMPercent)
		now[key] = p
	}
	for key := range w.series {
		if _, ok := now[key]; !ok {
			delete(w.series, key)
		}
	}
	cutoff := m.At.Add(-w.Span)
	for key, p := range now {
		w.series[key] = append(w.series[key], p)
		s := w.series[key]
		if first := slices.IndexFunc(s, func(q point) bool { return q.at.After(cutoff) }); first > 0 {
			w.series[key] = slices.Delete(s, 0, first)
		}
	}
	w.last = m
}

// add sums two figures; unknown wins: a sum with an unknown part is
// unknown.
func add(a, b Figure) Figure {
	return Figure{Value: a.Value + b.Value, Known: a.Known && b.Known}
}

// Summary is what the window knows, as the Node annotation carries it.
func (w *Window) Summary() api.NodeUsage {
	u := api.NodeUsage{At: w.last.At, WindowSeconds: int64(w.Span / time.Second)}
	for key, s := range w.series {
		parts := strings.SplitN(key, "\x00", 3)
		pod, gpu := parts[1], parts[2]
		cur := s[len(s)-1]
		pu := api.PodGPUUsage{Pod: pod, GPU: gpu, UsedMiB: cur.memMiB.ptr(), SMPercent: cur.sm.ptr(),
			SpanSeconds: int64(cur.at.Sub(s[0].at) / time.Second)}
		var mems, sms []int64
		for _, p := range s {
			if p.memMiB.Known {
				mems = append(mems, p.memMiB.Value)
			}
			if p.sm.Known {
				sms = append(sms, p.sm.Value)
			}
		}
		pu.Samples, pu.SMSamples = len(mems), len(sms)
		if len(mems) > 0 {
			p95, top := Percentile(mems, 95), slices.Max(mems)
			pu.P95MiB, pu.MaxMiB = &p95, &top
		}
		if len(sms) > 0 {
			var sum int64
			for _, v := range sms {
				sum += v
			}
			avg := int64(math.Round(float64(sum) / float64(len(sms))))
			pu.SMAvgPercent = &avg
		}
		u.Pods = append(u.Pods, pu)
	}
	slices.SortFunc(u.Pods, func(a, b api.PodGPUUsage) int { return cmp.Or(cmp.Compare(a.Pod, b.Pod), cmp.Compare(a.GPU, b.GPU)) })
	for _, g := range w.last.GPUs {
		mem := Figure{Value: g.MemoryBytes.Value >> 20, Known: g.MemoryBytes.Known}
		un := Figure{Value: g.UnattributedBytes.Value >> 20, Known: g.UnattributedBytes.Known}
		u.GPUs = append(u.GPUs, api.GPUUsage{UUID: g.UUID, UsedMiB: mem.ptr(), UnattributedMiB: un.ptr(), SMPercent: g.SMPercent.ptr()})
	}
	slices.SortFunc(u.GPUs, func(a, b api.GPUUsage) int { return cmp.Compare(a.UUID, b.UUID) })
	return u
}

// Percentile is the nearest-rank p-th percentile of values (not empty).
func Percentile(values []int64, p int) int64 {
	s := slices.Clone(values)
	slices.Sort(s)
	rank := int(math.Ceil(float64(p) / 100 * float64(len(s))))
	return s[min(max(rank, 1), len(s))-1]
}
