package metrics

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/enforce/enforcetest"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

func TestNodeAndContainerMetrics(t *testing.T) {
	lib, drv, uuids := enforcetest.NewMachine(2)
	const cg = enforcetest.CgroupFS + "/kubepods/pod-a/ctr-1"
	// The container uses all of its 2Gi hard limit on the first GPU.
	drv.Set(uuids[0], cg, nvml.MemoryLimits_v1{SoftLimit: 1 << 30, HardLimit: 2 << 30, CurrentUsed: 2 << 30})
	drv.Set(uuids[1], cg, nvml.MemoryLimits_v1{SoftLimit: 1 << 30, HardLimit: 2 << 30, CurrentUsed: 512 << 20})

	m := New()
	m.Node(inventory.Inventory{GPUs: []inventory.GPU{{Index: 0, UUID: uuids[0], Product: "H100", MemoryMiB: 81920}}}, nodeapi.BackendDriver, true)
	m.Containers(lib, map[string]enforce.Lease{"c1": {Pod: "ml/llm", Container: "main", Cgroup: cg, Devices: uuids, RequestMiB: 1024, LimitMiB: 2048}})
	m.Tenants([]nriplugin.Tenant{
		{Pod: nriplugin.PodRef{Namespace: "ml", Name: "llm"}, Container: "main", Devices: uuids, RequestMiB: 1024, LimitMiB: 2048,
			Mode: "time-slicing", Backend: "driver", State: nriplugin.StateEnforced},
		{Pod: nriplugin.PodRef{Namespace: "ml", Name: "web"}, Container: "main", Devices: uuids[:1], RequestMiB: 512, LimitMiB: 512,
			Mode: "time-slicing", Backend: "driver", State: nriplugin.StateInjected},
	})
	m.GPUUse(lib, inventory.Inventory{GPUs: []inventory.GPU{{UUID: uuids[0]}}})
	m.ObserveHook("CreateContainer", 3*time.Millisecond)
	m.Count(EventRefused)
	m.Count(EventRefused)

	want := `
# HELP gpufrac_container_gpu_memory_cgroup_used_bytes GPU memory a fractional container's cgroup uses, per GPU, as the driver's per-cgroup limits account it (r615 driver backend only).
# TYPE gpufrac_container_gpu_memory_cgroup_used_bytes gauge
gpufrac_container_gpu_memory_cgroup_used_bytes{container="main",gpu_uuid="` + uuids[0] + `",namespace="ml",pod="llm"} 2.147483648e+09
gpufrac_container_gpu_memory_cgroup_used_bytes{container="main",gpu_uuid="` + uuids[1] + `",namespace="ml",pod="llm"} 5.36870912e+08
# HELP gpufrac_container_gpu_memory_limit_hits_total Resyncs at which a container's GPU memory use had reached its hard limit.
# TYPE gpufrac_container_gpu_memory_limit_hits_total counter
gpufrac_container_gpu_memory_limit_hits_total{container="main",gpu_uuid="` + uuids[0] + `",namespace="ml",pod="llm"} 1
# HELP gpufrac_memory_enforcement 1 for the memory-limit backend in effect (driver, toolkit, mps-pinned, off).
# TYPE gpufrac_memory_enforcement gauge
gpufrac_memory_enforcement{backend="driver"} 1
# HELP gpufrac_enforcement_events_total Containers refused, started without a GPU (fail-open), evicted for missing enforcement, left running without it (fail-open), whose soft limit could not be released, or stopped above their request on a GPU short of memory (burst_reclaimed).
# TYPE gpufrac_enforcement_events_total counter
gpufrac_enforcement_events_total{event="refused"} 2
`
	if err := testutil.GatherAndCompare(m.Registry, strings.NewReader(want),
		"gpufrac_container_gpu_memory_cgroup_used_bytes", "gpufrac_container_gpu_memory_limit_hits_total",
		"gpufrac_memory_enforcement", "gpufrac_enforcement_events_total"); err != nil {
		t.Error(err)
	}
	if got := testutil.ToFloat64(m.request.WithLabelValues("ml", "llm", "main", uuids[1])); got != 1<<30 {
		t.Errorf("request = %v", got)
	}
	if got := testutil.ToFloat64(m.ready); got != 1 {
		t.Errorf("ready = %v", got)
	}
	if got := testutil.ToFloat64(m.gpuRequest.WithLabelValues(uuids[0])); got != 1536<<20 {
		t.Errorf("GPU requested = %v, want the sum of both tenants", got)
	}
	if got := testutil.ToFloat64(m.state.WithLabelValues("ml", "web", "main", "driver", "injected")); got != 1 {
		t.Errorf("state gauge = %v", got)
	}
	if got := testutil.CollectAndCount(m.hook); got != 1 {
		t.Errorf("hook histogram series = %d", got)
	}

	// The container stopped: its lease is gone and so are its gauges.
	m.Containers(lib, nil)
	if n := testutil.CollectAndCount(m.cgroupUsed); n != 0 {
		t.Errorf("%d used-bytes series left after the container went away", n)
	}
}

// Each container's use is under its own pod's labels; a figure the driver
// cannot give has no series (its GPU says so), and a container gone has
// none left.
func TestUsageMetrics(t *testing.T) {
	m := New()
	a := usage.Tenant{Namespace: "ml", Pod: "a", Container: "main", Mode: "sm-sharing"}
	b := usage.Tenant{Namespace: "web", Pod: "b", Container: "side", Mode: "sm-sharing"}
	m.Usage("node-1", usage.Measurement{
		Containers: []usage.Container{
			{Tenant: a, GPU: "GPU-0", MemoryBytes: usage.Known(3 << 30), SMPercent: usage.Known(42)},
			{Tenant: b, GPU: "GPU-0", MemoryBytes: usage.Known(1 << 30), SMPercent: usage.Known(0)},
			{Tenant: b, GPU: "GPU-1"},
		},
		GPUs: []usage.GPU{{UUID: "GPU-0", UnattributedBytes: usage.Known(512 << 20), SMPercent: usage.Known(50), PerProcessMemory: true, PerProcessSM: true},
			{UUID: "GPU-1"}},
	}, 2*time.Millisecond)
	want := `
# HELP gpufrac_container_gpu_memory_used_bytes GPU memory a fractional container's processes hold on a GPU, summed from NVML's per-process lists (under MPS, what its clients allocated). Absent where the driver cannot list processes (gpufrac_gpu_usage_readable).
# TYPE gpufrac_container_gpu_memory_used_bytes gauge
gpufrac_container_gpu_memory_used_bytes{container="main",gpu_uuid="GPU-0",mode="sm-sharing",namespace="ml",node="node-1",pod="a"} 3.221225472e+09
gpufrac_container_gpu_memory_used_bytes{container="side",gpu_uuid="GPU-0",mode="sm-sharing",namespace="web",node="node-1",pod="b"} 1.073741824e+09
# HELP gpufrac_gpu_usage_readable 1 where the driver reports the per-process figure (memory: process lists; sm: utilisation samples) on a GPU, 0 where it cannot: its tenants' figures are then unknown, not zero.
# TYPE gpufrac_gpu_usage_readable gauge
gpufrac_gpu_usage_readable{figure="memory",gpu_uuid="GPU-0"} 1
gpufrac_gpu_usage_readable{figure="memory",gpu_uuid="GPU-1"} 0
gpufrac_gpu_usage_readable{figure="sm",gpu_uuid="GPU-0"} 1
gpufrac_gpu_usage_readable{figure="sm",gpu_uuid="GPU-1"} 0
`
	if err := testutil.GatherAndCompare(m.Registry, strings.NewReader(want), "gpufrac_container_gpu_memory_used_bytes", "gpufrac_gpu_usage_readable"); err != nil {
		t.Error(err)
	}
	if got := testutil.ToFloat64(m.sm.WithLabelValues("ml", "a", "main", "node-1", "GPU-0", "sm-sharing")); got != 42 {
		t.Errorf("SM = %v", got)
	}
	m.Usage("node-1", usage.Measurement{Containers: []usage.Container{{Tenant: a, GPU: "GPU-0", MemoryBytes: usage.Known(1)}}}, 0)
	if n := testutil.CollectAndCount(m.used); n != 1 {
		t.Errorf("%d used series after b went, want 1", n)
	}
}

// The Grafana dashboard the chart ships must only query metrics this
// package exports (a renamed metric would silently empty a panel), and
// has the tenants' use.
func TestDashboardQueriesExportedMetrics(t *testing.T) {
	data, err := os.ReadFile("../../../deploy/helm/gpufrac/dashboards/gpufrac-node.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	exported := map[string]bool{}
	for _, name := range New().Names() {
		exported[name] = true
	}
	metric := regexp.MustCompile(`gpufrac_[a-z_]+`)
	titles := map[string]bool{}
	for _, p := range dash.Panels {
		titles[p.Title] = true
		for _, target := range p.Targets {
			for _, name := range metric.FindAllString(target.Expr, -1) {
				name = strings.TrimSuffix(name, "_bucket")
				if !exported[name] {
					t.Errorf("panel %q queries %s, which the agent does not export", p.Title, name)
				}
			}
		}
	}
	if len(dash.Panels) < 8 {
		t.Errorf("%d panels", len(dash.Panels))
	}
	for _, want := range []string{"Tenant SM utilisation", "Tenant memory used / granted (request)", "Container GPU memory use vs limit"} {
		if !titles[want] {
			t.Errorf("the dashboard has no panel %q", want)
		}
	}
}
