package dra

import (
	"context"
	"os"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

var nodeCfg = injection.Config{Backend: nodeapi.BackendDriver, HookPath: "/opt/gpufrac/bin/gpufrac", MPSRoot: "/run/gpufrac/mps", MPS: nodeapi.MPSv3}

func claimOn(pool, device string, consumed map[resourceapi.QualifiedName]string, config string) *resourceapi.ResourceClaim {
	r := resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: DriverName, Pool: pool, Device: device}
	if consumed != nil {
		r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{}
		for k, v := range consumed {
			r.ConsumedCapacity[k] = resource.MustParse(v)
		}
	}
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: "c", UID: "uid-1"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{r}}}}}
	if config != "" {
		c.Status.Allocation.Devices.Config = []resourceapi.DeviceAllocationConfiguration{{Source: resourceapi.AllocationConfigSourceClaim,
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: DriverName,
				Parameters: runtime.RawExtension{Raw: []byte(config)}}}}}
	}
	return c
}

// Every allocation the driver cannot enforce as given fails the claim's
// preparation with a reason, and leaves no CDI spec behind.
func TestPrepareRefusesWhatItCannotEnforce(t *testing.T) {
	mem := map[resourceapi.QualifiedName]string{CapacityMemory: "20Gi"}
	limit := func(l string) string {
		return `{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"` + l + `"}`
	}
	off := nodeCfg
	off.Backend = nodeapi.BackendOff
	for name, tc := range map[string]struct {
		claim *resourceapi.ResourceClaim
		cfg   injection.Config
		want  string
	}{
		"another node's pool":    {claimOn("other", "gpu-0-time-slicing", mem, ""), nodeCfg, `pool "other"`},
		"not our device":         {claimOn("n", "gpu-zero", mem, ""), nodeCfg, `device "gpu-zero"`},
		"a GPU the node lacks":   {claimOn("n", "gpu-7-time-slicing", mem, ""), nodeCfg, "the node has no GPU gpu-7"},
		"no consumed capacity":   {claimOn("n", "gpu-0-time-slicing", nil, ""), nodeCfg, "DRAConsumableCapacity"},
		"a bad config":           {claimOn("n", "gpu-0-time-slicing", mem, `{"kind":"Nope"}`), nodeCfg, "must be gpu.gpufrac.io/v1alpha1"},
		"limit below request":    {claimOn("n", "gpu-0-time-slicing", mem, limit("10Gi")), nodeCfg, "at least the request"},
		"limit over the GPU":     {claimOn("n", "gpu-0-time-slicing", mem, limit("100Gi")), nodeCfg, "at most the GPU's memory"},
		"sm-sharing, no compute": {claimOn("n", "gpu-0-sm-sharing", mem, ""), nodeCfg, "consumed compute 0"},
		"sm-sharing, no MPS": {claimOn("n", "gpu-0-sm-sharing", map[resourceapi.QualifiedName]string{CapacityMemory: "1Gi", CapacityCompute: "30"}, ""),
			nodeCfg, "keeps none"},
		"limits off": {claimOn("n", "gpu-0-time-slicing", mem, ""), off, "enforces no GPU memory limits"},
	} {
		t.Run(name, func(t *testing.T) {
			d := &Driver{NodeName: "n", CDIDir: t.TempDir(), Node: func() (inventory.Inventory, injection.Config) { return machine(1), tc.cfg }}
			res, err := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{tc.claim})
			if err != nil {
				t.Fatal(err)
			}
			got := res[tc.claim.UID]
			if got.Err == nil || !strings.Contains(got.Err.Error(), tc.want) || len(got.Devices) > 0 {
				t.Fatalf("prepare: %+v; want an error saying %q", got, tc.want)
			}
			if files, _ := os.ReadDir(d.CDIDir); len(files) > 0 {
				t.Errorf("a refused claim left %d files in the CDI directory", len(files))
			}
		})
	}
}

// The node publishes no device while it cannot enforce a share.
func TestEnforceable(t *testing.T) {
	noMPS, pinned, toolkit := nodeCfg, nodeCfg, nodeCfg
	noMPS.MPS, pinned.Backend, toolkit.Backend = nodeapi.MPSNone, nodeapi.BackendMPSPinned, nodeapi.BackendToolkit
	for cfg, want := range map[*injection.Config]bool{&nodeCfg: true, &pinned: true, &noMPS: false, &toolkit: false, {}: false} {
		if got := Enforceable(*cfg); got != want {
			t.Errorf("Enforceable(%+v) = %v, want %v", *cfg, got, want)
		}
	}
}

// A subrequest's share is prepared under a valid CDI name, with the limit
// a config for its main request gives.
func TestPrepareSubrequestTakesItsMainRequestsConfig(t *testing.T) {
	c := claimOn("n", "gpu-0-time-slicing", map[resourceapi.QualifiedName]string{CapacityMemory: "20Gi"},
		`{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"30Gi"}`)
	c.Status.Allocation.Devices.Results[0].Request = "gpu/small"
	c.Status.Allocation.Devices.Config[0].Requests = []string{"gpu"}
	d := &Driver{NodeName: "n", CDIDir: t.TempDir(), Node: func() (inventory.Inventory, injection.Config) { return machine(1), nodeCfg }}
	res, _ := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{c})
	got := res[c.UID]
	if got.Err != nil || len(got.Devices) != 1 || got.Devices[0].CDIDeviceIDs[0] != CDIKind+"=uid-1-gpu.small" {
		t.Fatalf("prepare: %+v", got)
	}
	raw, err := os.ReadFile(d.specPath(c.UID))
	if err != nil || !strings.Contains(string(raw), nodeapi.EnvHookLimitMiB+"=30720") {
		t.Errorf("spec %s (%v): want the hook's limit 30720 MiB", raw, err)
	}
}

// What would multiply a share, or mix modes, is refused.
func TestPrepareRefusesSharesItCannotKeepApart(t *testing.T) {
	mem := map[resourceapi.QualifiedName]string{CapacityMemory: "1Gi"}
	shared := claimOn("n", "gpu-0-time-slicing", mem, "")
	shared.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "a", UID: "a"}, {Resource: "pods", Name: "b", UID: "b"}}
	twice := claimOn("n", "gpu-0-time-slicing", mem, "")
	r := twice.Status.Allocation.Devices.Results[0]
	r.Device = "gpu-1-time-slicing"
	twice.Status.Allocation.Devices.Results = append(twice.Status.Allocation.Devices.Results, r)
	for name, tc := range map[string]struct {
		claim *resourceapi.ResourceClaim
		want  string
	}{
		"two consumers":            {shared, "reserved for 2 consumers"},
		"two devices, one request": {twice, "more than one device for one request"},
	} {
		d := &Driver{NodeName: "n", CDIDir: t.TempDir(), Node: func() (inventory.Inventory, injection.Config) { return machine(2), nodeCfg }}
		res, _ := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{tc.claim})
		if err := res[tc.claim.UID].Err; err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one saying %q", name, err, tc.want)
		}
	}
	// The API server dropped the counters: the node fails closed.
	d := &Driver{NodeName: "n", CDIDir: t.TempDir(), Node: func() (inventory.Inventory, injection.Config) { return machine(1), nodeCfg }}
	d.HandleError(context.Background(), &resourceslice.DroppedFieldsError{}, "publishing")
	ok := claimOn("n", "gpu-0-time-slicing", mem, "")
	res, _ := d.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{ok})
	if err := res[ok.UID].Err; err == nil || !strings.Contains(err.Error(), "DRAPartitionableDevices") {
		t.Errorf("after dropped fields: error %v, want a refusal naming DRAPartitionableDevices", err)
	}
}
