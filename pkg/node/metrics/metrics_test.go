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
# HELP gpufrac_container_gpu_memory_used_bytes GPU memory a fractional container's cgroup uses, per GPU, as the driver accounts it.
# TYPE gpufrac_container_gpu_memory_used_bytes gauge
gpufrac_container_gpu_memory_used_bytes{container="main",gpu_uuid="` + uuids[0] + `",namespace="ml",pod="llm"} 2.147483648e+09
gpufrac_container_gpu_memory_used_bytes{container="main",gpu_uuid="` + uuids[1] + `",namespace="ml",pod="llm"} 5.36870912e+08
# HELP gpufrac_container_gpu_memory_limit_hits_total Resyncs at which a container's GPU memory use had reached its hard limit.
# TYPE gpufrac_container_gpu_memory_limit_hits_total counter
gpufrac_container_gpu_memory_limit_hits_total{container="main",gpu_uuid="` + uuids[0] + `",namespace="ml",pod="llm"} 1
# HELP gpufrac_memory_enforcement 1 for the memory-limit backend in effect (driver, toolkit, mps-pinned, off).
# TYPE gpufrac_memory_enforcement gauge
gpufrac_memory_enforcement{backend="driver"} 1
# HELP gpufrac_enforcement_events_total Containers refused, started without a GPU (fail-open), evicted for missing enforcement, left running without it (fail-open), or whose soft limit could not be released.
# TYPE gpufrac_enforcement_events_total counter
gpufrac_enforcement_events_total{event="refused"} 2
`
	if err := testutil.GatherAndCompare(m.Registry, strings.NewReader(want),
		"gpufrac_container_gpu_memory_used_bytes", "gpufrac_container_gpu_memory_limit_hits_total",
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
	if n := testutil.CollectAndCount(m.used); n != 0 {
		t.Errorf("%d used-bytes series left after the container went away", n)
	}
}

// The Grafana dashboard in deploy/ must only query metrics this package
// exports (a renamed metric would silently empty a panel).
func TestDashboardQueriesExportedMetrics(t *testing.T) {
	data, err := os.ReadFile("../../../deploy/grafana/gpufrac-node.json")
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
	for _, p := range dash.Panels {
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
}
