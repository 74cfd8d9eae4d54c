// Package metrics exports the node agent's Prometheus metrics: per GPU,
// per fractional container (memory request, limit and use under the
// driver backend), the enforcement in effect, and what the agent refused,
// evicted or failed to release.
package metrics

import (
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
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
	used        *prometheus.GaugeVec
	limitHits   *prometheus.CounterVec
	events      *prometheus.CounterVec
}

// New registers the collectors on a fresh registry.
func New() *Metrics {
	container := []string{"namespace", "pod", "container", "gpu_uuid"}
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
		used: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "gpufrac_container_gpu_memory_used_bytes",
			Help: "GPU memory a fractional container's cgroup uses, per GPU, as the driver accounts it."}, container),
		limitHits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gpufrac_container_gpu_memory_limit_hits_total",
			Help: "Resyncs at which a container's GPU memory use had reached its hard limit."}, container),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "gpufrac_enforcement_events_total",
			Help: "Containers refused, started without a GPU (fail-open), evicted for missing enforcement, or whose soft limit could not be released."},
			[]string{"event"}),
	}
	m.Registry.MustRegister(m.gpuMemory, m.enforcement, m.ready, m.request, m.limit, m.used, m.limitHits, m.events)
	return m
}

// Event kinds counted by Count.
const (
	EventRefused       = "refused"
	EventFailedOpen    = "fail_open"
	EventEvicted       = "evicted"
	EventReleaseFailed = "release_failed"
)

// Count records one enforcement event.
func (m *Metrics) Count(event string) { m.events.WithLabelValues(event).Inc() }

// Node records the GPUs, the backend and readiness.
func (m *Metrics) Node(inv inventory.Inventory, backend injection.Backend, ready bool) {
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

// Containers records every leased container's request and limit and, read
// from the driver through lib, its use; a use at the hard limit counts as a
// limit hit. Containers whose lease is gone disappear from the gauges.
func (m *Metrics) Containers(lib nvml.Interface, leases map[string]enforce.Lease) {
	m.request.Reset()
	m.limit.Reset()
	m.used.Reset()
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
			m.request.WithLabelValues(labels...).Set(float64(lease.RequestMiB) * mebibyte)
			m.limit.WithLabelValues(labels...).Set(float64(lease.LimitMiB) * mebibyte)
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
			m.used.WithLabelValues(labels...).Set(float64(got.CurrentUsed))
			if got.HardLimit > 0 && got.CurrentUsed >= got.HardLimit {
				m.limitHits.WithLabelValues(labels...).Inc()
			}
		}
	}
}
