package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/audit"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
	"github.com/gpufrac/gpufrac/pkg/node/dra"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/reservation"
)

// deviceClass applies the shipped DeviceClass.
func deviceClass(t *testing.T) {
	t.Helper()
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "deploy", "dra", "deviceclass.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for i, doc := range strings.Split(string(raw), "\n---\n") {
		var dc resourceapi.DeviceClass
		if err := yaml.UnmarshalStrict([]byte(doc), &dc); err != nil {
			t.Fatalf("deploy/dra/deviceclass.yaml, object %d: %v", i+1, err)
		}
		if _, err := shared.admin.ResourceV1().DeviceClasses().Create(context.Background(), &dc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
}

// publishSlices runs the driver's ResourceSlice controller for node, as the node
// agent would, over the devices of a go-nvml mock machine, and waits until
// the API server holds the slice.
func publishSlices(t *testing.T, node, machine string, reserveMiB int64) (inventory.Inventory, []resourceapi.Device) {
	t.Helper()
	inv := simulatedInventory(t, machine)
	devices := dra.Devices(inv, reserveMiB)
	resources := dra.Resources(node, inv, reserveMiB, dra.OfferAll(inv))
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, 10)
	c, err := resourceslice.StartController(ctx, resourceslice.Options{
		DriverName: dra.DriverName,
		KubeClient: shared.admin,
		Owner:      &resourceslice.Owner{APIVersion: "v1", Kind: "Node", Name: node},
		Resources:  &resources,
		ErrorHandler: func(_ context.Context, err error, msg string) {
			select {
			case errs <- fmt.Errorf("%s: %w", msg, err):
			default:
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		c.Stop()
		_ = shared.admin.ResourceV1().ResourceSlices().DeleteCollection(context.Background(), metav1.DeleteOptions{},
			metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	})
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		select {
		case err := <-errs:
			return false, err // the API server refused the slice: the device model is invalid
		default:
		}
		list, err := shared.admin.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
		if err != nil {
			return false, err
		}
		published := 0
		for _, sl := range list.Items {
			published += len(sl.Spec.Devices)
		}
		return len(list.Items) == len(resources.Pools[node].Slices) && published == len(devices), nil
	})
	if err != nil {
		t.Fatalf("node %s: its ResourceSlice was not published: %v", node, err)
	}
	return inv, devices
}

// simulatedInventory is what the node agent reads from a go-nvml mock
// machine.
func simulatedInventory(t testing.TB, machine string) inventory.Inventory {
	t.Helper()
	lib, err := inventory.Simulated(machine)
	if err != nil {
		t.Fatal(err)
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		t.Fatal(err)
	}
	return inv
}

// draScenario runs a scheduler of its own (gpufrac-<name>) with the
// DeviceClasses applied, and makes the scenario's namespace and its one
// 8-GPU node, <name>-0, labelled scenario=<name>.
func draScenario(t *testing.T, name string) (ns, node string) {
	t.Helper()
	e := schedulerEnv(t)
	e.startScheduler(t, "gpufrac-"+name, nil)
	deviceClass(t)
	ns, node = namespace(t, name), name+"-0"
	gpuNode(t, node, name, 8, 81920, true)
	cleanUp(t, ns, node)
	return ns, node
}

func memoryClaim(ns, name, memory, compute string) *resourceapi.ResourceClaim {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: dra.DriverName}
	if compute != "" {
		req.DeviceClassName = "sm-sharing." + dra.DriverName
	}
	if memory != "" || compute != "" {
		req.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		if memory != "" {
			req.Capacity.Requests[dra.CapacityMemory] = resource.MustParse(memory)
		}
		if compute != "" {
			req.Capacity.Requests[dra.CapacityCompute] = resource.MustParse(compute)
		}
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &req}},
		}},
	}
}

func claimPod(ns, name, scheduler, scenario, claim string) *corev1.Pod {
	p := workload(ns, name, scheduler, scenario, nil)
	p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
	p.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	return p
}

// allocation waits until the claim is allocated and returns its one
// device result.
func allocation(t *testing.T, ns, name string) resourceapi.DeviceRequestAllocationResult {
	t.Helper()
	var claim *resourceapi.ResourceClaim
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		c, err := shared.admin.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		claim = c
		return c.Status.Allocation != nil, nil
	})
	if err != nil {
		t.Fatalf("claim %s/%s not allocated: %v", ns, name, err)
	}
	results := claim.Status.Allocation.Devices.Results
	if len(results) != 1 {
		t.Fatalf("claim %s: want one device result, got %+v", name, results)
	}
	return results[0]
}

// kube-scheduler's own allocator hands out shares of the driver's devices:
// the API server accepts the device model (multi-allocatable GPUs with a
// memory and a compute capacity), claims that fit share a GPU and carry
// the share they consume, the request policy raises a tiny request to the
// minimum, and a claim that fits no GPU's remaining memory stays pending.
func TestDRAClaimsShareAGPUByMemory(t *testing.T) {
	ns, node := draScenario(t, "dra-share")
	inv, devices := publishSlices(t, node, "dgxh100", 1024)
	if len(devices) != 16 {
		t.Fatalf("want 16 devices for the mock H100 machine (a device per mode per GPU), got %d", len(devices))
	}
	schedulable := devices[0].Capacity[dra.CapacityMemory].Value
	if want := resource.MustParse(fmt.Sprintf("%dMi", inv.GPUs[0].MemoryMiB-1024)); schedulable.Cmp(want) != 0 {
		t.Fatalf("device memory %s: want the GPU's memory less the reserve, %s", schedulable.String(), want.String())
	}

	claims := shared.admin.ResourceV1().ResourceClaims(ns)
	ctx := context.Background()
	// Two 39Gi shares fit one GPU's 79 GiB (the mock H100's 80 GiB less
	// the reserve), three do not, whatever order the scheduler takes the
	// pods in: eight GPUs hold sixteen, and a seventeenth finds no room.
	var names []string
	for i := range 8 {
		for j, size := range []string{"39Gi", "39Gi"} {
			name := fmt.Sprintf("c-%d-%d", i, j)
			if _, err := claims.Create(ctx, memoryClaim(ns, name, size, ""), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			create(t, claimPod(ns, "p-"+name, "gpufrac-dra-share", "dra-share", name))
			names = append(names, name)
		}
	}
	used := map[string]int64{}
	for _, name := range names {
		placed(t, ns, "p-"+name)
		r := allocation(t, ns, name)
		if r.Driver != dra.DriverName || r.Pool != node {
			t.Fatalf("claim %s allocated %s/%s, want driver %s pool %s", name, r.Driver, r.Pool, dra.DriverName, node)
		}
		if r.ShareID == nil || *r.ShareID == "" {
			t.Errorf("claim %s: a share of a multi-allocatable device has no shareID", name)
		}
		mem := r.ConsumedCapacity[dra.CapacityMemory]
		used[r.Device] += mem.Value()
		if compute := r.ConsumedCapacity[dra.CapacityCompute]; !compute.IsZero() {
			t.Errorf("claim %s (time-slicing, no compute asked) consumed compute %s", name, compute.String())
		}
	}
	for device, bytes := range used {
		if bytes > schedulable.Value() {
			t.Errorf("device %s: claims consume %d bytes of its %d", device, bytes, schedulable.Value())
		}
	}
	if len(used) != 8 {
		t.Errorf("claims used %d GPUs, want all 8 (two shares each): %v", len(used), used)
	}

	if _, err := claims.Create(ctx, memoryClaim(ns, "too-much", "39Gi", ""), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	create(t, claimPod(ns, "p-too-much", "gpufrac-dra-share", "dra-share", "too-much"))
	pending(t, ns, "p-too-much")

	// Freeing a share makes room: the pending claim lands where it was.
	if err := shared.admin.CoreV1().Pods(ns).Delete(ctx, "p-c-3-0", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	// No controller-manager runs here to drop the deleted pod from the
	// claim's reservedFor and deallocate it: do what it does.
	freed, err := claims.Get(ctx, "c-3-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	freed.Status = resourceapi.ResourceClaimStatus{}
	if _, err := claims.UpdateStatus(ctx, freed, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	placed(t, ns, "p-too-much")

	// A request below the minimum is raised to it.
	if _, err := claims.Create(ctx, memoryClaim(ns, "tiny", "100Mi", ""), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	create(t, claimPod(ns, "p-tiny", "gpufrac-dra-share", "dra-share", "tiny"))
	placed(t, ns, "p-tiny")
	got := allocation(t, ns, "tiny").ConsumedCapacity[dra.CapacityMemory]
	if want := resource.MustParse(fmt.Sprintf("%dMi", dra.MinMemoryMiB)); got.Cmp(want) != 0 {
		t.Errorf("a 100Mi claim consumed %s, want the minimum %s", got.String(), want.String())
	}
}

// A GPU runs one compute mode: once a time-slicing claim holds a GPU, no
// sm-sharing claim is given it (and the other way round), while claims of
// one mode share their GPUs; sm-sharing claims split a GPU's compute, at
// most 100 percent.
func TestDRAClaimsNeverMixModesOnAGPU(t *testing.T) {
	ns, node := draScenario(t, "dra-modes")
	inv, _ := publishSlices(t, node, "dgxh100", 0)
	claims := shared.admin.ResourceV1().ResourceClaims(ns)
	ctx := context.Background()
	type share struct{ memory, compute string }
	// Interleaved, so that each mode's claims arrive while the other's
	// hold GPUs: the allocator tries devices first fit, in the slice's
	// order (GPU 0's time-slicing device, its sm-sharing one, GPU 1's…), so the first
	// sm-sharing claim would take GPU 0 beside the time-slicing one, and
	// the last time-slicing claim (GPU 0 full) GPU 1, were the modes not
	// exclusive.
	shares := []share{{"20Gi", ""}, {"10Gi", "50"}, {"20Gi", ""}, {"10Gi", "50"}, {"20Gi", ""}, {"10Gi", "30"}, {"20Gi", ""}, {"10Gi", "30"}, {"10Gi", "30"},
		{"20Gi", ""}}
	var last string
	modes := map[string]map[api.ComputeMode]bool{} // GPU → modes held
	compute := map[string]int64{}
	for i, sh := range shares {
		name := fmt.Sprintf("c-%d", i)
		if _, err := claims.Create(ctx, memoryClaim(ns, name, sh.memory, sh.compute), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		create(t, claimPod(ns, "p-"+name, "gpufrac-dra-modes", "dra-modes", name))
		placed(t, ns, "p-"+name)
		r := allocation(t, ns, name)
		gpu, mode, ok := api.ParseDRADevice(r.Device)
		if !ok {
			t.Fatalf("claim %s: device %q is not <GPU UUID>-<mode>", name, r.Device)
		}
		if want := map[bool]api.ComputeMode{true: api.SMSharing, false: api.TimeSlicing}[sh.compute != ""]; mode != want {
			t.Errorf("claim %s asked for %s, got device %s", name, want, r.Device)
		}
		if modes[gpu] == nil {
			modes[gpu] = map[api.ComputeMode]bool{}
		}
		modes[gpu][mode] = true
		last = r.Device
		c := r.ConsumedCapacity[dra.CapacityCompute]
		compute[gpu] += c.Value()
	}
	for gpu, m := range modes {
		if len(m) > 1 {
			t.Errorf("GPU %s holds claims of both modes: %v", gpu, m)
		}
		if compute[gpu] > 100 {
			t.Errorf("GPU %s: sm-sharing claims hold %d%% of its compute", gpu, compute[gpu])
		}
	}
	// 20Gi × 4 fills GPU 0's memory; 50+50 GPU 1's compute, 30×3 most of
	// GPU 2's; the fifth 20Gi claim skips both sm-sharing GPUs for GPU 3.
	if len(modes) != 4 || last != dra.DeviceName(inv.GPUs[3].UUID, api.TimeSlicing) {
		t.Errorf("claims on %d GPUs (%v), the last on %s: want 4, the last on GPU 3 (each mode packing its own GPUs)", len(modes), modes, last)
	}
}

// The API server accepts the slices of a node with more GPUs than one
// slice may describe (counter sets and shared devices are capped per
// slice): a dry run of each, as the ResourceSlice controller writes them.
func TestDRASlicesOfALargeNodeAreValid(t *testing.T) {
	inv := inventory.Inventory{DriverVersion: "615.43.02"}
	for i := range 40 {
		inv.GPUs = append(inv.GPUs, inventory.GPU{Index: i, UUID: fmt.Sprintf("GPU-%d", i), Product: "NVIDIA H100 80GB HBM3", MemoryMiB: 81920})
	}
	const node = "dra-large-0"
	gpuNode(t, node, "dra-large", 40, 81920, true)
	pool := dra.Resources(node, inv, 0, dra.OfferAll(inv)).Pools[node]
	for i, s := range pool.Slices {
		slice := &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", node, i)},
			Spec: resourceapi.ResourceSliceSpec{
				Driver:         dra.DriverName,
				Pool:           resourceapi.ResourcePool{Name: node, ResourceSliceCount: int64(len(pool.Slices))},
				NodeName:       ptr.To(node),
				Devices:        s.Devices,
				SharedCounters: s.SharedCounters,
			},
		}
		if _, err := shared.admin.ResourceV1().ResourceSlices().Create(context.Background(), slice, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
			t.Errorf("slice %d of %d (%d counter sets, %d devices): %v", i+1, len(pool.Slices), len(s.SharedCounters), len(s.Devices), err)
		}
	}
	if len(pool.Slices) != 7 {
		t.Errorf("40 GPUs in %d slices, want 5 of counter sets (8 each) and 2 of devices (32 GPUs each)", len(pool.Slices))
	}
}

// The driver's kubelet plugin, over its real gRPC API as the kubelet calls
// it: preparing claims the real allocator gave this node writes CDI
// specs whose edits are what the NRI plugin injects for an annotated
// container with the same share (the claim's opaque memoryLimit as the
// hard limit), creates an sm-sharing share's MPS namespace with its
// compute ceiling first; a restarted agent finds what it prepared and
// prepares again alike; unpreparing removes both.
func TestDRAKubeletPluginPreparesShares(t *testing.T) {
	ns, node := draScenario(t, "dra-prep")
	t.Cleanup(func() {
		_ = shared.admin.ResourceV1().ResourceSlices().DeleteCollection(context.Background(), metav1.DeleteOptions{},
			metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	})

	root := mpstest.ShortRoot(t)
	// The fake MPS control is this test binary, exec'd for every probe:
	// large and race-instrumented beside a kube-apiserver and a scheduler,
	// it can take longer than the unit tests' 500ms to answer, and two such
	// probes had the supervisor replace a daemon that was merely slow
	// (make test, once: the claim's prepare then met the restart).
	control, _ := mpstest.StartDaemon(t, root, 615, func(d *mps.Daemon) { d.CommandTimeout = 5 * time.Second })
	openMPS := func() *mps.Manager {
		m, err := mps.OpenManager(control, filepath.Join(root, "namespaces.json"))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	inv := simulatedInventory(t, "dgxh100")
	cfg := injection.Config{Backend: nodeapi.BackendDriver, HookPath: "/opt/gpufrac/bin/gpufrac", MPSRoot: root, MPS: nodeapi.MPSv3,
		ShimDir: "/opt/gpufrac/lib", GPUMemoryMiB: inv.GPUs[0].MemoryMiB}
	cdiDir := t.TempDir()
	newDriver := func() *dra.Driver {
		return &dra.Driver{NodeName: node, CDIDir: cdiDir, MPS: openMPS(),
			Node: func() (inventory.Inventory, injection.Config) { return inv, cfg }}
	}
	pluginDir, registrarDir := mpstest.ShortRoot(t), mpstest.ShortRoot(t)
	ctx := context.Background()
	h, err := dra.Serve(ctx, newDriver(), shared.admin, pluginDir, registrarDir, 0, dra.OfferAll(inv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Stop)

	claims := shared.admin.ResourceV1().ResourceClaims(ns)
	ts := memoryClaim(ns, "ts", "20Gi", "")
	ts.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{
		Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: dra.DriverName,
			Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"30Gi"}`)}},
	}}}
	sm := memoryClaim(ns, "sm", "10Gi", "25")
	uids := map[string]types.UID{}
	for _, c := range []*resourceapi.ResourceClaim{ts, sm} {
		created, err := claims.Create(ctx, c, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		uids[c.Name] = created.UID
		create(t, claimPod(ns, "p-"+c.Name, "gpufrac-dra-prep", "dra-prep", c.Name))
		placed(t, ns, "p-"+c.Name)
	}
	results := map[string]resourceapi.DeviceRequestAllocationResult{"ts": allocation(t, ns, "ts"), "sm": allocation(t, ns, "sm")}

	conn, err := grpc.NewClient("unix://"+filepath.Join(pluginDir, "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	kubelet := drapb.NewDRAPluginClient(conn)
	request := func() []*drapb.Claim {
		return []*drapb.Claim{{Namespace: ns, Name: "ts", Uid: string(uids["ts"])}, {Namespace: ns, Name: "sm", Uid: string(uids["sm"])}}
	}
	prepare := func() map[string][]string {
		t.Helper()
		resp, err := kubelet.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: request()})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for name, uid := range uids {
			r := resp.Claims[string(uid)]
			if r == nil || r.Error != "" || len(r.Devices) != 1 {
				t.Fatalf("claim %s: prepare answered %v", name, r)
			}
			out[name] = r.Devices[0].CdiDeviceIds
		}
		return out
	}
	ids := prepare()

	for name, uid := range uids {
		if want := []string{dra.CDIKind + "=" + string(uid) + "-gpu"}; !slices.Equal(ids[name], want) {
			t.Errorf("claim %s: CDI devices %v, want %v", name, ids[name], want)
		}
		var spec cdispec.Spec
		raw, err := os.ReadFile(filepath.Join(cdiDir, "gpu.gpufrac.io-"+string(uid)+".json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(raw, &spec); err != nil || len(spec.Devices) != 1 || spec.Kind != dra.CDIKind {
			t.Fatalf("claim %s: CDI spec %s: %v", name, raw, err)
		}
		// What the NRI plugin injects for the same share on an annotated pod.
		r := results[name]
		mem := r.ConsumedCapacity[dra.CapacityMemory]
		a := api.Assignment{Container: "main", RequestMiB: mem.Value() >> 20, Mode: api.TimeSlicing}
		uuid, _, _ := api.ParseDRADevice(r.Device)
		index := slices.IndexFunc(inv.GPUs, func(g inventory.GPU) bool { return strings.EqualFold(g.UUID, uuid) })
		if index < 0 {
			t.Fatalf("claim %s: device %s names no GPU of the node", name, r.Device)
		}
		a.Devices = []string{inv.GPUs[index].UUID}
		a.LimitMiB = map[string]int64{"ts": 30720, "sm": 10240}[name]
		namespace := ""
		if name == "sm" {
			a.Mode, a.Portion = api.SMSharing, mustFraction(t, "0.25")
			namespace = nodeapi.NamespaceName(string(uid), "gpu")
		}
		d := injection.Decide(injection.Pod{UID: "pod-of-" + string(uid), Annotations: a.Annotations()}, "main", []string{nodeapi.EnvLibraryPath + "=" + injection.ImageLibraryPath}, cfg)
		if d.Verdict != injection.Run {
			t.Fatalf("the NRI path refuses %s's share: %v", name, d.Reason)
		}
		want := injection.OutcomeOfNRI(nil, d.Adjustment)
		got := injection.OutcomeOfCDI(nil, &spec.Devices[0].ContainerEdits)
		// The two differ by design in what names the tenant: the hook's
		// container label, and the namespace (the pod's UID and container
		// for NRI, the claim's UID and request for DRA).
		fixNames := func(o injection.Outcome, who, pipe string) string {
			b, _ := json.Marshal(o)
			s := strings.ReplaceAll(string(b), who, "<tenant>")
			if pipe != "" {
				s = strings.ReplaceAll(s, pipe, "<namespace>")
			}
			return s
		}
		nriNS := ""
		if namespace != "" {
			nriNS = nodeapi.NamespaceName("pod-of-"+string(uid), "main")
		}
		if w, g := fixNames(want, nodeapi.EnvHookContainer+"=main", nriNS), fixNames(got, nodeapi.EnvHookContainer+"="+ns+"/"+name+"/gpu", namespace); w != g {
			t.Errorf("claim %s: CDI edits differ from the NRI injection:\nNRI %s\nCDI %s", name, w, g)
		}
		if name == "sm" {
			if c := mpstest.Ceiling(t, root, namespace); c != 25 {
				t.Errorf("sm-sharing claim: MPS namespace %s has ceiling %d, want 25", namespace, c)
			}
		}
	}

	// A restarted agent: a new driver over the same directory and MPS
	// table knows both claims, and the kubelet's repeated call is answered
	// alike.
	h.Stop()
	d2 := newDriver()
	prepared, err := d2.Prepared()
	if err != nil || len(prepared) != 2 || len(prepared[uids["sm"]]) != 1 {
		t.Fatalf("after a restart the driver knows %v (%v), want both claims, the sm-sharing one with its namespace", prepared, err)
	}
	h2, err := dra.Serve(ctx, d2, shared.admin, pluginDir, registrarDir, 0, dra.OfferAll(inv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h2.Stop)
	if again := prepare(); !maps.EqualFunc(again, ids, slices.Equal) {
		t.Errorf("prepared again: %v, want %v", again, ids)
	}

	resp, err := kubelet.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: request()})
	if err != nil {
		t.Fatal(err)
	}
	for name, uid := range uids {
		if r := resp.Claims[string(uid)]; r == nil || r.Error != "" {
			t.Errorf("claim %s: unprepare answered %v", name, r)
		}
		if _, err := os.Stat(filepath.Join(cdiDir, "gpu.gpufrac.io-"+string(uid)+".json")); !os.IsNotExist(err) {
			t.Errorf("claim %s: its CDI spec is still there after unprepare (%v)", name, err)
		}
	}
	if c := mpstest.Ceiling(t, root, nodeapi.NamespaceName(string(uids["sm"]), "gpu")); c != -1 {
		t.Errorf("the sm-sharing claim's MPS namespace is still there after unprepare (ceiling %d)", c)
	}
}

func mustFraction(t *testing.T, s string) api.Fraction {
	t.Helper()
	f, err := api.ParseFraction(s)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// The webhook refuses, at creation, a claim or claim template for
// gpufrac's classes that a node could not enforce, with the field, the
// value and the rule; claims for other drivers pass unread.
func TestDRAWebhookRefusesClaimsTheNodeCannotEnforce(t *testing.T) {
	ns := namespace(t, "dra-webhook")
	ctx := context.Background()
	noCompute := memoryClaim(ns, "no-compute", "10Gi", "")
	noCompute.Spec.Devices.Requests[0].Exactly.DeviceClassName = "sm-sharing." + dra.DriverName
	_, err := shared.alice.ResourceV1().ResourceClaims(ns).Create(ctx, noCompute, metav1.CreateOptions{})
	if err == nil || !strings.Contains(err.Error(), `spec.devices.requests[0](gpu).capacity.requests.compute "": an sm-sharing share must name its compute`) {
		t.Errorf("an sm-sharing claim without compute: %v", err)
	}
	low := memoryClaim(ns, "", "20Gi", "")
	low.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{
		Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: dra.DriverName,
			Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"10Gi"}`)}},
	}}}
	tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "low-limit", Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: low.Spec}}
	_, err = shared.alice.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{})
	if err == nil || !strings.Contains(err.Error(), "spec.spec.devices.config[0]: memoryLimit 10240Mi is below request gpu's memory 20480Mi") {
		t.Errorf("a template whose limit is below its request: %v", err)
	}
	if _, err := shared.alice.ResourceV1().ResourceClaims(ns).Create(ctx, memoryClaim(ns, "ok", "20Gi", ""), metav1.CreateOptions{}); err != nil {
		t.Errorf("a valid claim: %v", err)
	}
	other := memoryClaim(ns, "other", "", "")
	other.Spec.Devices.Requests[0].Exactly.DeviceClassName = "gpu.example.com"
	if _, err := shared.alice.ResourceV1().ResourceClaims(ns).Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Errorf("another driver's claim: %v", err)
	}
}

// One ledger for both front doors: on a node whose two GPUs are held for
// shares (standing reservation pods), claims and annotation pods of 30Gi
// arrive interleaved, with the scheduler killed and restarted midway. Each
// 80Gi GPU takes two, so four of the six are placed and two stay pending,
// whichever door they came through, and the audit (claims included) finds
// nothing over-committed. The node's slices are republished, as the node
// agent does, from what the standing pods say annotation shares hold.
func TestDRAClaimsAndAnnotationPodsShareOneLedger(t *testing.T) {
	const name = "dra-mixed"
	e := schedulerEnv(t)
	sched := e.startScheduler(t, "gpufrac-"+name, nil)
	deviceClass(t)
	ns, node := namespace(t, name), name+"-0"
	gpuNode(t, node, name, 2, 81920, true)
	cleanUp(t, ns, node)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	setStanding := func(v *string) {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]*string{api.LabelStandingGPUs: v}}})
		if _, err := shared.admin.CoreV1().Nodes().Patch(context.Background(), node, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	two := "2"
	setStanding(&two)
	t.Cleanup(func() { setStanding(nil) }) // before the reservation pods go, so none come back

	// The GPUs as the test's device plugin names them for reservation pods.
	inv := inventory.Inventory{DriverVersion: "615.10.01"}
	for i := range 2 {
		inv.GPUs = append(inv.GPUs, inventory.GPU{Index: i, UUID: fmt.Sprintf("GPU-%x-%d", node, i), Product: "NVIDIA-H100-80GB-HBM3", MemoryMiB: 81920})
	}
	resources := dra.Resources(node, inv, 0, nil)
	sliceCtl, err := resourceslice.StartController(ctx, resourceslice.Options{DriverName: dra.DriverName, KubeClient: shared.admin,
		Owner: &resourceslice.Owner{APIVersion: "v1", Kind: "Node", Name: node}, Resources: &resources})
	if err != nil {
		t.Fatal(err)
	}
	defer sliceCtl.Stop()
	// The node agent's part: read the standing reservation pods, publish.
	annotator := &reservation.Annotator{Client: shared.admin, Node: node, Namespace: reservationNS, Source: noDevices{}}
	go func() {
		for ctx.Err() == nil {
			if _, err := annotator.Sync(ctx); err == nil {
				r := dra.Resources(node, inv, 0, dra.Offers(annotator.Standing()))
				sliceCtl.Update(&r)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		return len(annotator.Standing()) == 2, nil
	}); err != nil {
		t.Fatalf("the node's two GPUs were never held by standing reservation pods: %v (%v)", err, reservationPods(t, node))
	}

	scheduler := "gpufrac-" + name
	annotated := func(i int) *corev1.Pod {
		return workload(ns, fmt.Sprintf("pod-%d", i), scheduler, name, map[string]string{api.KeyMemory: "30720"})
	}
	claims := shared.admin.ResourceV1().ResourceClaims(ns)
	for i := range 6 {
		if i == 3 {
			sched.kill()
			sched = e.startScheduler(t, scheduler, nil)
		}
		if i%2 == 0 {
			c := fmt.Sprintf("claim-%d", i)
			if _, err := claims.Create(ctx, memoryClaim(ns, c, "30Gi", ""), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			create(t, claimPod(ns, fmt.Sprintf("pod-%d", i), scheduler, name, c))
		} else {
			create(t, annotated(i))
		}
	}
	bound := func() (n int) {
		pods, err := shared.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods.Items {
			if p.Spec.NodeName != "" {
				n++
			}
		}
		return n
	}
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(context.Context) (bool, error) {
		return bound() >= 4, nil
	}); err != nil {
		sched.dumpLog(t)
		t.Fatalf("%d of 6 pods placed, want 4 (two 30Gi shares on each 80Gi GPU)", bound())
	}
	time.Sleep(3 * time.Second) // what would over-commit has had its chance
	if n := bound(); n != 4 {
		sched.dumpLog(t)
		t.Errorf("%d of 6 pods placed: want exactly 4, two 30Gi shares on each of two 80Gi GPUs", n)
	}
	nodes, err := shared.admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "scenario=" + name})
	if err != nil {
		t.Fatal(err)
	}
	pods, err := shared.admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	all, err := claims.List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	view := ledgers.Build(nodes.Items, audit.OnNodes(pods.Items, nodes.Items), all.Items)
	n := view.Nodes[node]
	kinds := map[bool]int{}
	for _, ten := range n.Tenants {
		kinds[ten.Claim]++
	}
	if kinds[true] == 0 || kinds[false] == 0 || kinds[true]+kinds[false] != 4 {
		t.Errorf("tenants on the node: %d claims and %d annotation pods; want 4 in all, from both doors", kinds[true], kinds[false])
	}
	for slot, d := range n.Ledger.Devices {
		if d.Charged() > d.Schedulable() {
			t.Errorf("GPU %d: %dMi charged of %dMi", slot, d.Charged(), d.Schedulable())
		}
	}
	if v := audit.Check(nodes.Items, audit.OnNodes(pods.Items, nodes.Items), all.Items, audit.Options{Now: time.Now()}); len(v) > 0 {
		t.Errorf("audit after the burst: %v", v)
	}
}

// noDevices is a kubelet that reports no device: the test's device plugin
// names the reservation pods' GPUs.
type noDevices struct{}

func (noDevices) Devices(context.Context, []corev1.Pod) (map[string][]string, error) { return nil, nil }
