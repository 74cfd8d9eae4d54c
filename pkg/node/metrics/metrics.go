// Package metrics exports the node agent's Prometheus metrics: per GPU,
// per fractional container (memory request, limit and use under the
// driver backend), the enforcement in effect, and what the agent refused,
// evicted or failed to release.
package metrics

import (
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

const mebibyte = float64(1 << 20)

// Metrics are the agent's collectors, registered on Registry.
type Metrics struct {
	Registry *prometheus.Registry

	gpuMemory   *prometheus.GaugeVec
	enforcement *prometheus.GaugeVec
	ready       prometheus.Gauge
	request     *prometheus.GaugeVec
	limit       *prometheus.GaugeVec
	cgroupUsed  *prometheus.GaugeVec
	used        *prometheus.GaugeVec
	sm          *prometheus.GaugeVec
	gpuUnowned  *prometheus.GaugeVec
	gpuSM       *prometheus.GaugeVec
	readable    *prometheus.GaugeVec
	sampleTime  prometheus.Gauge
	// usageSeries are the label sets Usage last set, per vector.
	usageSeries map[*prometheus.GaugeVec]map[string][]string
	limitHits   *prometheus.CounterVec
	events      *prometheus.CounterVec
	state       *prometheus.GaugeVec
	gpuRequest  *prometheus.GaugeVec
	gpuLimit    *prometheus.GaugeVec
	gpuUsed     *prometheus.GaugeVec
	gpuMode     *prometheus.GaugeVec
	hook        *prometheus.HistogramVec
	collectors  []prometheus.Collector
}

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

// Names lists the names of every metric the agent exports.
func (m *Metrics) Names() []string {
	descs := make(chan *prometheus.Desc, 64)
	go func() {
		for _, c := range m.collectors {
			c.Describe(descs)
		}
		close(descs)
	}()
	var names []string
	for d := range descs {
		if match := fqName.FindStringSubmatch(d.String()); match != nil {
			names = append(names, match[1])
		}
	}
	return names
}

// New registers the collectors on a fresh registry.
func New() *Metrics {
	container := []string{"namespace", "pod", "container", "gpu_uuid"}
	// Labelled as dcgm-exporter and kube-state-metrics label a pod's
	// container, plus its GPU and compute mode.
	usageLabels := []string{"namespace", "pod", "container", "node", "gpu_uuid", "mode"}
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		gpuMemory: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_memory_total_bytes",
			Help: "Memory of each GPU of the node."}, []string{"gpu_uuid", "gpu_index", "product"}),
		enforcement: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_memory_enforcement",
			Help: "1 for the memory-limit backend in effect (driver, toolkit, mps-pinned, off)."}, []string{"backend"}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{Name: "gpufrac_node_ready",
			Help: "1 while the node reports gpu-fractioning.nvidia.com/Ready=True."}),
		request: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_gpu_memory_request_bytes",
			Help: "Guaranteed (soft-limit) GPU memory of a fractional container, per GPU."}, container),
		limit: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_gpu_memory_limit_bytes",
			Help: "Hard GPU memory limit of a fractional container, per GPU."}, container),
		cgroupUsed: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_gpu_memory_cgroup_used_bytes",
			Help: "GPU memory a fractional container's cgroup uses, per GPU, as the driver's per-cgroup limits account it (r615 driver backend only)."}, container),
		used: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_gpu_memory_used_bytes",
			Help: "GPU memory a fractional container's processes hold on a GPU, summed from NVML's per-process lists (under MPS, what its clients allocated). Absent where the driver cannot list processes (gpufrac_gpu_usage_readable)."}, usageLabels),
		sm: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_gpu_sm_utilization_percent",
			Help: "SM utilisation of a fractional container's processes on a GPU over the last sampling period, summed from NVML's per-process samples (0-100). Absent where the driver gives no samples (gpufrac_gpu_usage_readable)."}, usageLabels),
		gpuUnowned: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_memory_unattributed_bytes",
			Help: "GPU memory held by processes outside every fractional container: whole-GPU pods, the MPS server's shared context, host processes."}, []string{"gpu_uuid"}),
		gpuSM: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_utilization_percent",
			Help: "Percent of the last sampling period in which a kernel ran on each GPU, as NVML reports it."}, []string{"gpu_uuid"}),
		readable: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_usage_readable",
			Help: "1 where the driver reports the per-process figure (memory: process lists; sm: utilisation samples) on a GPU, 0 where it cannot: its tenants' figures are then unknown, not zero."}, []string{"gpu_uuid", "figure"}),
		sampleTime: prometheus.NewGauge(prometheus.GaugeOpts{Name: "gpufrac_usage_sample_duration_seconds",
			Help: "How long the last reading of the tenants' use took (NVML and /proc)."}),
		limitHits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gpufrac_container_gpu_memory_limit_hits_total",
			Help: "Resyncs at which a container's GPU memory use had reached its hard limit."}, container),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gpufrac_enforcement_events_total",
			Help: "Containers refused, started without a GPU (fail-open), evicted for missing enforcement, left running without it (fail-open), whose soft limit could not be released, or stopped above their request on a GPU short of memory (burst_reclaimed)."},
			[]string{"event"}),
		state: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_enforcement",
			Help: "1 for each fractional container with its memory-limit backend and enforcement state (injected, enforced, unenforced, fail_open)."},
			[]string{"namespace", "pod", "container", "backend", "state"}),
		gpuRequest: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_memory_requested_bytes",
			Help: "Sum of the fractional containers' guaranteed memory on each GPU."}, []string{"gpu_uuid"}),
		gpuLimit: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_memory_limited_bytes",
			Help: "Sum of the fractional containers' hard limits on each GPU."}, []string{"gpu_uuid"}),
		gpuUsed: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_memory_used_bytes",
			Help: "Memory in use on each GPU, as NVML reports it."}, []string{"gpu_uuid"}),
		gpuMode: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_gpu_compute_mode",
			Help: "1 for the compute mode (time-slicing, sm-sharing) of each GPU's fractional tenants."}, []string{"gpu_uuid", "mode"}),
		hook: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "gpufrac_nri_hook_duration_seconds",
			Help:    "Time the NRI plugin takes per hook (CreateContainer runs inside the runtime's creation deadline).",
			Buckets: []float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2}}, []string{"hook"}),
	}
	m.collectors = []prometheus.Collector{m.gpuMemory, m.enforcement, m.ready, m.request, m.limit, m.cgroupUsed, m.used, m.sm, m.gpuUnowned, m.gpuSM, m.readable, m.sampleTime, m.limitHits, m.events,
		m.state, m.gpuRequest, m.gpuLimit, m.gpuUsed, m.gpuMode, m.hook}
	m.Registry.MustRegister(m.collectors...)
	return m
}

// Event kinds counted by Count.
const (
	EventRefused       = "refused"
	EventFailedOpen    = "fail_open"
	EventEvicted       = "evicted"
	EventReleaseFailed = "release_failed"
	EventUnenforced    = "unenforced"
	EventMPSRestarted  = "mps_restarted"
	EventPoliced       = "policed"
	// EventReclaimed: a tenant above its request stopped on a GPU short
	// of memory (burst reclaim).
	EventReclaimed = "burst_reclaimed"
)

// Count records one enforcement event.
func (m *Metrics) Count(event string) { m.events.WithLabelValues(event).Inc() }

// ObserveHook records one NRI hook's duration.
func (m *Metrics) ObserveHook(hook string, d time.Duration) {
	m.hook.WithLabelValues(hook).Observe(d.Seconds())
}

// Tenants records every fractional container's request, limit and
// enforcement state, and each GPU's requested and limited memory and mode.
func (m *Metrics) Tenants(tenants []nriplugin.Tenant) {
	m.state.Reset()
	m.request.Reset()
	m.limit.Reset()
	m.gpuRequest.Reset()
	m.gpuLimit.Reset()
	m.gpuMode.Reset()
	for _, t := range tenants {
		m.state.WithLabelValues(t.Pod.Namespace, t.Pod.Name, t.Container, t.Backend, t.State).Set(1)
		for _, uuid := range t.Devices {
			labels := []string{t.Pod.Namespace, t.Pod.Name, t.Container, uuid}
			m.request.WithLabelValues(labels...).Set(float64(t.RequestMiB) * mebibyte)
			m.limit.WithLabelValues(labels...).Set(float64(t.LimitMiB) * mebibyte)
			m.gpuRequest.WithLabelValues(uuid).Add(float64(t.RequestMiB) * mebibyte)
			m.gpuLimit.WithLabelValues(uuid).Add(float64(t.LimitMiB) * mebibyte)
			m.gpuMode.WithLabelValues(uuid, string(t.Mode)).Set(1)
		}
	}
}

// GPUUse records each GPU's memory in use, read through lib.
func (m *Metrics) GPUUse(lib nvml.Interface, inv inventory.Inventory) {
	m.gpuUsed.Reset()
	if lib == nil || lib.Init() != nvml.SUCCESS {
		return
	}
	defer func() { _ = lib.Shutdown() }()
	for _, g := range inv.GPUs {
		dev, ret := lib.DeviceGetHandleByUUID(g.UUID)
		if ret != nvml.SUCCESS {
			continue
		}
		if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			m.gpuUsed.WithLabelValues(g.UUID).Set(float64(mem.Used))
		}
	}
}

// Node records the GPUs, the backend and readiness.
func (m *Metrics) Node(inv inventory.Inventory, backend nodeapi.Backend, ready bool) {
	m.gpuMemory.Reset()
	for _, g := range inv.GPUs {
		m.gpuMemory.WithLabelValues(g.UUID, strconv.Itoa(g.Index), g.Product).Set(float64(g.MemoryMiB) * mebibyte)
	}
	m.enforcement.Reset()
	if backend != "" {
		m.enforcement.WithLabelValues(string(backend)).Set(1)
	}
	if ready {
		m.ready.Set(1)
	} else {
		m.ready.Set(0)
	}
}

// Containers records, for every container holding driver limits, its use
// as the driver accounts it, read through lib; a use at the hard limit
// counts as a limit hit. Containers whose lease is gone disappear.
func (m *Metrics) Containers(lib nvml.Interface, leases map[string]enforce.Lease) {
	m.cgroupUsed.Reset()
	if len(leases) == 0 {
		return
	}
	initialised := lib != nil && lib.Init() == nvml.SUCCESS
	if initialised {
		defer func() { _ = lib.Shutdown() }()
	}
	for _, lease := range leases {
		ns, pod, _ := strings.Cut(lease.Pod, "/")
		for _, uuid := range lease.Devices {
			labels := []string{ns, pod, lease.Container, uuid}
			if !initialised {
				continue
			}
			dev, ret := lib.DeviceGetHandleByUUID(uuid)
			if ret != nvml.SUCCESS {
				continue
			}
			got, ret := dev.GetMemoryLimits_v1(lease.Cgroup)
			if ret != nvml.SUCCESS {
				continue
			}
			m.cgroupUsed.WithLabelValues(labels...).Set(float64(got.CurrentUsed))
			if got.HardLimit > 0 && got.CurrentUsed >= got.HardLimit {
				m.limitHits.WithLabelValues(labels...).Inc()
			}
		}
	}
}

// Usage records one reading of what the tenants on node use: a figure the
// driver cannot give has no series (and its GPU says so in
// gpufrac_gpu_usage_readable), a container gone has none left.
func (m *Metrics) Usage(node string, r usage.Measurement, took time.Duration) {
	// Set, then delete what is gone, rather than reset and refill: a
	// scrape in between would see the series missing, and an alert's
	// "for" would start again.
	next := map[*prometheus.GaugeVec]map[string][]string{}
	set := func(v *prometheus.GaugeVec, value float64, labels ...string) {
		v.WithLabelValues(labels...).Set(value)
		if next[v] == nil {
			next[v] = map[string][]string{}
		}
		next[v][strings.Join(labels, "\x00")] = labels
	}
	m.sampleTime.Set(took.Seconds())
	for _, c := range r.Containers {
		t := c.Tenant
		labels := []string{t.Namespace, t.Pod, t.Container, node, c.GPU, string(t.Mode)}
		if c.MemoryBytes.Known {
			set(m.used, float64(c.MemoryBytes.Value), labels...)
		}
		if c.SMPercent.Known {
			set(m.sm, float64(c.SMPercent.Value), labels...)
		}
	}
	for _, g := range r.GPUs {
		if g.UnattributedBytes.Known {
			set(m.gpuUnowned, float64(g.UnattributedBytes.Value), g.UUID)
		}
		if g.SMPercent.Known {
			set(m.gpuSM, float64(g.SMPercent.Value), g.UUID)
		}
		set(m.readable, b2f(g.PerProcessMemory), g.UUID, "memory")
		set(m.readable, b2f(g.PerProcessSM), g.UUID, "sm")
	}
	for _, v := range []*prometheus.GaugeVec{m.used, m.sm, m.gpuUnowned, m.gpuSM, m.readable} {
		for key, labels := range m.usageSeries[v] {
			if _, still := next[v][key]; !still {
				v.DeleteLabelValues(labels...)
			}
		}
	}
	m.usageSeries = next
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
