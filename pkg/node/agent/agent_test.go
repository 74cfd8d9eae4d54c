package agent

import (
	"errors"
	"testing"
	"time"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
)

// The node derives sm-sharing portions with the reserve the scheduler
// charged with: per model by the node's product label, else the global one.
func TestReserveForFollowsTheSchedulersKeys(t *testing.T) {
	opts := Options{Injection: injection.Config{GPUMemoryReserveMiB: 256},
		GPUMemoryReserveMiBByModel: map[string]int64{"NVIDIA-H100-80GB-HBM3": 1024}}
	for product, want := range map[string]int64{"NVIDIA-H100-80GB-HBM3": 1024, "NVIDIA-A100-SXM4-80GB": 256, "": 256} {
		if got := reserveFor(opts, product); got != want {
			t.Errorf("product %q: reserve %d, want %d", product, got, want)
		}
	}
}

// decide is the node's configuration from what was observed, alone: the
// node fails closed on every error it reads.
func TestDecideFailsClosed(t *testing.T) {
	r615 := inventory.Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13040,
		GPUs: []inventory.GPU{{UUID: "GPU-1", Product: "NVIDIA H100 80GB HBM3", MemoryMiB: 81920}}}
	opts := Options{MemoryLimits: "auto", Injection: injection.Config{GPUMemoryReserveMiB: 512}}
	for _, tc := range []struct {
		name        string
		hw          hardware
		wantBackend nodeapi.Backend
		wantMPS     nodeapi.MPS
		cgroupErr   bool
	}{
		{"all well", hardware{inv: r615, mps: nodeapi.MPSv3}, nodeapi.BackendDriver, nodeapi.MPSv3, false},
		{"GPUs unread: backend unknown, containers wait", hardware{invErr: errors.New("nvml"), mpsErr: errors.New("driver unknown")}, nodeapi.BackendUnset, nodeapi.MPSNone, false},
		{"MPS down: no MPS", hardware{inv: r615, mpsErr: errors.New("no answer")}, nodeapi.BackendDriver, nodeapi.MPSNone, false},
		{"no cgroup controller: driver limits off", hardware{inv: r615, mps: nodeapi.MPSv3, cgroupErr: errors.New("cgroup v1")}, nodeapi.BackendOff, nodeapi.MPSNone, true},
	} {
		cfg := decide(tc.hw, opts, 2, true)
		if cfg.Injection.Backend != tc.wantBackend || cfg.Injection.MPS != tc.wantMPS || (cfg.Publish.CgroupErr != nil) != tc.cgroupErr {
			t.Errorf("%s: backend %q, MPS %q, cgroup error %v; want %q, %q, %v", tc.name, cfg.Injection.Backend, cfg.Injection.MPS, cfg.Publish.CgroupErr, tc.wantBackend, tc.wantMPS, tc.cgroupErr)
		}
		if cfg.Publish.StandingGPUs != 2 || cfg.Publish.ReserveMiB != 512 || cfg.Injection.GPUMemoryReserveMiB != 512 || !cfg.Publish.NRIRegistered {
			t.Errorf("%s: published %+v: want the standing count, the reserve and the registration passed on", tc.name, cfg.Publish)
		}
	}
	// Before the node carries a product label, the GPUs' own name picks the
	// model's reserve, so the first publish is already right.
	opts.GPUMemoryReserveMiBByModel = map[string]int64{"NVIDIA-H100-80GB-HBM3": 1024}
	if cfg := decide(hardware{inv: r615, mps: nodeapi.MPSv3}, opts, 0, true); cfg.Publish.ReserveMiB != 1024 {
		t.Errorf("unlabelled H100 node: reserve %d, want the model's 1024", cfg.Publish.ReserveMiB)
	}
	if cfg := decide(hardware{inv: r615, mps: nodeapi.MPSv3, labels: map[string]string{api.LabelGPUProduct: "other"}}, opts, 0, true); cfg.Publish.ReserveMiB != 512 {
		t.Errorf("node labelled another model: reserve %d, want the global 512", cfg.Publish.ReserveMiB)
	}
	// A shared GPU left out of EXCLUSIVE_PROCESS is said where the
	// scheduler reads it: the node's condition.
	notExclusive := errors.New("GPU GPU-1 is not in EXCLUSIVE_PROCESS")
	if cfg := decide(hardware{inv: r615, mps: nodeapi.MPSv3, computeModeErr: notExclusive}, opts, 0, true); !errors.Is(cfg.Publish.ComputeModeErr, notExclusive) {
		t.Errorf("a shared GPU not exclusive: published %v", cfg.Publish.ComputeModeErr)
	}
	// A state file the agent cannot read: new fractions are refused and
	// the running containers are not judged, the node says why.
	corrupt := errors.New("GPU memory leases leases.json are corrupt")
	if cfg := decide(hardware{inv: r615, mps: nodeapi.MPSv3, stateErr: corrupt}, opts, 0, true); cfg.Injection.Backend != nodeapi.BackendUnset || !errors.Is(cfg.Publish.StateErr, corrupt) {
		t.Errorf("unreadable state: backend %q, published %v", cfg.Injection.Backend, cfg.Publish.StateErr)
	}
	// The cgroup check matters only to the backends that set driver limits.
	opts.MemoryLimits = string(nodeapi.BackendMPSPinned)
	if cfg := decide(hardware{inv: r615, mps: nodeapi.MPSv3, cgroupErr: errors.New("cgroup v1")}, opts, 0, true); cfg.Injection.Backend != nodeapi.BackendMPSPinned || cfg.Publish.CgroupErr != nil {
		t.Errorf("mps-pinned on cgroup v1: backend %q, cgroup error %v; want mps-pinned and none", cfg.Injection.Backend, cfg.Publish.CgroupErr)
	}
}

func TestHeartbeatBound(t *testing.T) {
	for period, want := range map[time.Duration]time.Duration{30 * time.Second: 90 * time.Second, 2 * time.Second: 30 * time.Second, time.Minute: 3 * time.Minute} {
		if got := HeartbeatBound(period); got != want {
			t.Errorf("HeartbeatBound(%s) = %s, want %s", period, got, want)
		}
	}
	if cfg := decide(hardware{}, Options{ResyncPeriod: 20 * time.Second}, 0, true); cfg.Publish.Heartbeat != time.Minute {
		t.Errorf("published heartbeat bound %s, want 1m0s", cfg.Publish.Heartbeat)
	}
}

// A GPU stays exclusive while a fractional container uses it, also when
// no reservation pod on the node holds it any more (drained, or another
// scheduler's); and while either half is unknown, nothing is given back.
func TestSharedGPUs(t *testing.T) {
	held := map[string]bool{"GPU-held": true}
	tenants := []nriplugin.Tenant{{Devices: []string{"GPU-orphaned"}}, {Devices: []string{"GPU-held"}}}
	got := sharedGPUs(held, tenants, true)
	if len(got) != 2 || !got["GPU-held"] || !got["GPU-orphaned"] {
		t.Errorf("shared = %v, want the held GPU and the one a tenant uses", got)
	}
	if held["GPU-orphaned"] {
		t.Error("the annotator's set was changed")
	}
	if got := sharedGPUs(nil, tenants, true); got != nil {
		t.Errorf("reservation pods unread: %v, want unknown", got)
	}
	if got := sharedGPUs(held, nil, false); got != nil {
		t.Errorf("containers not yet audited: %v, want unknown", got)
	}
}

// A share gpufrac's scheduler placed is held only by its own group's
// reservation pod: its GPU given to another group's new reservation pod
// (the device plugin hands out a GPU whose pod was deleted under its
// shares) does not hold it, and the share is stopped rather than run
// beside the new ones, booked elsewhere. Another scheduler's share (no
// groups) is held by any reservation pod; with the groups unread, nothing
// is judged by group.
func TestSharesAreHeldOnlyByTheirOwnGroupsPod(t *testing.T) {
	tenants := []nriplugin.Tenant{
		{Pod: nriplugin.PodRef{UID: "u1", Name: "own"}, Container: "main", Devices: []string{"GPU-a"}, Groups: []string{"ga"}},
		{Pod: nriplugin.PodRef{UID: "u2", Name: "lost"}, Container: "main", Devices: []string{"GPU-b"}, Groups: []string{"gb"}},
		{Pod: nriplugin.PodRef{UID: "u3", Name: "kai"}, Container: "main", Devices: []string{"GPU-c"}},
	}
	allocated := map[string]bool{"GPU-a": true, "GPU-b": true, "GPU-c": true}
	// gb's pod is gone; a new group's pod was given GPU-b.
	byGroup := map[string]string{"ga": "gpu-a", "gnew": "GPU-b"}
	unheld := unheldTenants(allocated, byGroup, tenants)
	if len(unheld) != 1 || unheld["u2/main"].gpu != "GPU-b" {
		t.Errorf("unheld = %v, want only lost's GPU-b (held by another group's pod)", unheld)
	}
	if got := unheldTenants(allocated, nil, tenants); len(got) != 0 {
		t.Errorf("groups unread: %v judged by group, want none unheld", got)
	}
}

// A tenant whose GPU the device plugin allocated to no pod (its reservation
// pod deleted under it) is stopped once seen so at two resyncs in a row;
// nothing is judged on an allocation that is empty or not by UUID.
func TestTenantsOnUnheldGPUsAreStopped(t *testing.T) {
	tenants := []nriplugin.Tenant{
		{Pod: nriplugin.PodRef{UID: "u1", Name: "held"}, Container: "main", Devices: []string{"GPU-a"}},
		{Pod: nriplugin.PodRef{UID: "u2", Name: "lost"}, Container: "main", Devices: []string{"GPU-b"}},
	}
	allocated := map[string]bool{"GPU-a": true, "GPU-c": true}
	unheld := unheldTenants(allocated, nil, tenants)
	if len(unheld) != 1 || unheld["u2/main"].gpu != "GPU-b" {
		t.Fatalf("unheld = %v, want only lost's GPU-b", unheld)
	}
	if got := unheldTenants(map[string]bool{}, nil, tenants); got != nil {
		t.Errorf("an empty allocation judged: %v", got)
	}
	if got := unheldTenants(map[string]bool{"0": true}, nil, tenants); got != nil {
		t.Errorf("an allocation by index judged: %v", got)
	}
	seen, stop := countUnheld(nil, unheld)
	if len(stop) != 0 {
		t.Errorf("stopped at the first sighting: %v", stop)
	}
	seen, stop = countUnheld(seen, unheld)
	if len(stop) != 1 || stop[0].tenant.Pod.Name != "lost" {
		t.Errorf("second sighting stops %v, want lost", stop)
	}
	// Held again (a reservation pod re-made on the same GPU): the count
	// starts over.
	seen, _ = countUnheld(seen, nil)
	if _, stop = countUnheld(seen, unheld); len(stop) != 0 {
		t.Errorf("a tenant held again in between stopped at once: %v", stop)
	}
}
