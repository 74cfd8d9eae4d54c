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
		"a GPU the node lacks":   {claimOn("n", "gpu-7-time-slicing", mem, ""), nodeCfg, "no GPU 7"},
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
