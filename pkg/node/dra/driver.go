package dra

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpufrac/gpufrac/internal/statefile"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// CDIKind is the CDI kind of the driver's prepared shares: the kubelet
// hands the runtime gpu.gpufrac.io/share=<claim UID>-<request>, and the
// runtime applies that device's edits from the claim's spec file.
const CDIKind = api.DRAShareCDIKind

// Driver is the node side of gpu.gpufrac.io, the kubelet plugin: it
// prepares an allocated claim by writing a CDI spec whose container edits
// enforce the share exactly as the NRI plugin enforces an annotated
// container's (injection.ShareEdits), creating the share's MPS namespace
// first for sm-sharing, and unprepares it by removing both.
//
// The spec files are the driver's checkpoint: one per prepared claim,
// named after its UID, holding what the claim was prepared with, so a
// restarted agent knows what it prepared (Prepared) and the kubelet's
// repeated calls are idempotent.
type Driver struct {
	NodeName string
	// CDIDir is where the runtime reads CDI specs (/var/run/cdi).
	CDIDir string
	// Node returns the node's inventory and injection configuration as
	// they are now (the NRI plugin's, so both front doors enforce alike).
	Node func() (inventory.Inventory, injection.Config)
	// MPS keeps the node's MPS namespaces; nil: sm-sharing claims fail.
	MPS *mps.Manager
	// NoContainers is set on a node where no container ever runs (a
	// simulated one, gpufrac up): its devices are published for the
	// scheduler though nothing could enforce them; preparing a claim
	// still fails closed.
	NoContainers bool

	helper  atomic.Pointer[kubeletplugin.Helper]
	dropped atomic.Bool // the API server dropped slice fields (HandleError)
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)

// PrepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devices, err := d.prepare(ctx, c)
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot prepare the claim", "claim", klog.KObj(c))
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return out, nil
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		out[c.UID] = d.Unprepare(ctx, c.UID)
	}
	return out, nil
}

// HandleError implements kubeletplugin.DRAPlugin: the helper's background
// errors (publishing ResourceSlices) are logged, and it retries them. One
// is not retried: an API server that dropped fields of the slices, the
// counters that keep a GPU's modes apart among them (DRAPartitionableDevices
// off). Then the node fails closed: it publishes no device and prepares no
// claim, for the modes could mix on a GPU.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
	var dropped *resourceslice.DroppedFieldsError
	if errors.As(err, &dropped) && !d.dropped.Swap(true) {
		if h := d.helper.Load(); h != nil {
			go func() {
				if err := h.PublishResources(ctx, Resources(d.NodeName, inventory.Inventory{}, 0, nil)); err != nil {
					klog.FromContext(ctx).Error(err, "Cannot withdraw the node's DRA devices")
				}
			}()
		}
	}
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin: device health is
// the node's condition (FractioningReady), not reported per device yet.
func (d *Driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// share is one prepared device result of a claim, as its spec file keeps
// it (in the spec's annotations), so that Unprepare and a restarted agent
// know which MPS namespace to remove.
type share struct {
	Request   string `json:"request"`
	Namespace string `json:"mpsNamespace,omitempty"`
}

const annotationShares = DriverName + "/shares"

func (d *Driver) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	if d.dropped.Load() {
		return nil, fmt.Errorf("claim %s/%s: the API server dropped fields of this node's ResourceSlices (the counters that keep a GPU's compute modes apart: is DRAPartitionableDevices on?), so no share is prepared here", claim.Namespace, claim.Name)
	}
	if n := len(claim.Status.ReservedFor); n > 1 {
		// Each consumer would get the whole share's limits and ceiling,
		// while the allocator counted the share once.
		return nil, fmt.Errorf("claim %s/%s: reserved for %d consumers: a gpufrac share is for one pod; give each pod a claim of its own (a ResourceClaimTemplate)", claim.Namespace, claim.Name, n)
	}
	inv, cfg := d.Node()
	before := d.preparedShares(claim.UID) // a repeated call: these are in use
	spec := cdispec.Spec{Kind: CDIKind}
	var devices []kubeletplugin.Device
	var shares []share
	var errs []error
	seen := map[string]bool{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != DriverName {
			continue
		}
		if seen[r.Request] {
			errs = append(errs, fmt.Errorf("claim share %q: more than one device for one request: a gpufrac request is one share of one GPU", claim.Namespace+"/"+claim.Name+"/"+r.Request))
			continue
		}
		seen[r.Request] = true
		a, err := d.assignment(claim, r, inv)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		namespace := ""
		if a.Mode == api.SMSharing {
			namespace = nodeapi.NamespaceName(string(claim.UID), r.Request)
		}
		edits, err := injection.ShareEdits(a, namespace, cfg)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if namespace != "" {
			if d.MPS == nil {
				errs = append(errs, fmt.Errorf("claim share %q: sm-sharing needs MPS namespaces, and this node agent keeps none", a.Container))
				continue
			}
			ns := mps.Namespace{Name: namespace, Threads: a.ActiveThreadPercentage(), Pod: claim.Namespace + "/" + claim.Name,
				PodUID: string(claim.UID), Container: r.Request}
			if err := d.MPS.Ensure(ctx, ns); err != nil {
				errs = append(errs, fmt.Errorf("claim share %q: %w", a.Container, err))
				continue
			}
		}
		// A subrequest's result is named request/subrequest; CDI device
		// names allow no '/', and a request name (a DNS label) no '.'.
		name := string(claim.UID) + "-" + strings.ReplaceAll(r.Request, "/", ".")
		spec.Devices = append(spec.Devices, cdispec.Device{Name: name, ContainerEdits: *edits})
		shares = append(shares, share{Request: r.Request, Namespace: namespace})
		devices = append(devices, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{CDIKind + "=" + name}, ShareID: r.ShareID})
	}
	if err := api.JoinLine(errs...); err != nil {
		// Nothing half-prepared stays behind: the namespaces this call made
		// for the claim's other requests go too (not those an earlier
		// preparation made, which may be in use), and the kubelet retries.
		return nil, api.JoinLine(err, d.removeNamespaces(ctx, newShares(shares, before)))
	}
	if len(devices) == 0 {
		return nil, fmt.Errorf("claim %s/%s has no device of driver %s", claim.Namespace, claim.Name, DriverName)
	}
	raw, err := json.Marshal(shares)
	if err != nil {
		return nil, err
	}
	spec.Annotations = map[string]string{annotationShares: string(raw)}
	if spec.Version, err = cdispec.MinimumRequiredVersion(&spec); err != nil {
		return nil, fmt.Errorf("claim %s/%s: CDI spec: %w", claim.Namespace, claim.Name, err)
	}
	body, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := statefile.Write(d.specPath(claim.UID), body); err != nil {
		return nil, api.JoinLine(fmt.Errorf("claim %s/%s: writing its CDI spec: %w", claim.Namespace, claim.Name, err), d.removeNamespaces(ctx, newShares(shares, before)))
	}
	return devices, nil
}

// assignment is the share the allocator gave one request of claim, in the
// terms both front doors enforce: the GPU, the memory (consumedCapacity,
// the allocator's rounding included), the limit from the claim's opaque
// config, the mode of the device and, for sm-sharing, the compute portion.
func (d *Driver) assignment(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult, inv inventory.Inventory) (api.Assignment, error) {
	who := claim.Namespace + "/" + claim.Name + "/" + r.Request
	a := api.Assignment{Container: who}
	if r.Pool != d.NodeName {
		return a, fmt.Errorf("claim share %q: allocated from pool %q, not this node's (%s)", who, r.Pool, d.NodeName)
	}
	s, err := api.ClaimShareOf(r, claim.Status.Allocation.Devices.Config)
	if err != nil {
		return a, fmt.Errorf("claim share %q: %w", who, err)
	}
	i := slices.IndexFunc(inv.GPUs, func(g inventory.GPU) bool { return strings.EqualFold(g.UUID, s.Assignment.Devices[0]) })
	if i < 0 {
		return a, fmt.Errorf("claim share %q: device %q: the node has no GPU %s now", who, r.Device, s.Assignment.Devices[0])
	}
	gpu := inv.GPUs[i]
	a = s.Assignment
	a.Container, a.Devices = who, []string{gpu.UUID}
	if a.LimitMiB > gpu.MemoryMiB {
		return a, fmt.Errorf("claim share %q: memoryLimit %dMi: must be at least the request (%dMi) and at most the GPU's memory (%dMi)", who, a.LimitMiB, a.RequestMiB, gpu.MemoryMiB)
	}
	return a, nil
}

// Unprepare removes what preparing claim uid made: its MPS namespaces,
// then its CDI spec. A claim never prepared here is no error.
func (d *Driver) Unprepare(ctx context.Context, uid types.UID) error {
	raw, err := os.ReadFile(d.specPath(uid))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	shares, err := sharesOf(raw)
	if err != nil {
		// Its namespaces are unknown; the agent's MPS reconciliation
		// deletes those no prepared claim holds.
		klog.FromContext(ctx).Error(err, "A prepared claim's CDI spec is corrupt; removing it", "path", d.specPath(uid))
	}
	if err := d.removeNamespaces(ctx, shares); err != nil {
		return err // the spec stays, so the kubelet's retry finds the namespaces again
	}
	if err := os.Remove(d.specPath(uid)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func (d *Driver) removeNamespaces(ctx context.Context, shares []share) error {
	var errs []error
	for _, s := range shares {
		if s.Namespace != "" && d.MPS != nil {
			errs = append(errs, d.MPS.Remove(ctx, s.Namespace, ""))
		}
	}
	return api.JoinLine(errs...)
}

// sharesOf reads the shares a prepared claim's spec records.
func sharesOf(raw []byte) ([]share, error) {
	var spec cdispec.Spec
	var shares []share
	if err := json.Unmarshal(raw, &spec); err != nil {
		return nil, fmt.Errorf("CDI spec: %w", err)
	}
	if err := json.Unmarshal([]byte(spec.Annotations[annotationShares]), &shares); err != nil {
		return nil, fmt.Errorf("CDI spec annotation %s: %w", annotationShares, err)
	}
	return shares, nil
}

// preparedShares are the shares an earlier preparation of the claim
// recorded; none if it was not prepared (or its spec is unreadable).
func (d *Driver) preparedShares(uid types.UID) []share {
	raw, err := os.ReadFile(d.specPath(uid))
	if err != nil {
		return nil
	}
	shares, _ := sharesOf(raw)
	return shares
}

// newShares are the shares of now that were not in before.
func newShares(now, before []share) []share {
	var out []share
	for _, s := range now {
		if !slices.Contains(before, s) {
			out = append(out, s)
		}
	}
	return out
}

// Prepared lists the claims this node has prepared (their spec files), for
// a restarted agent to reconcile, and the MPS namespaces they hold.
func (d *Driver) Prepared() (map[types.UID][]string, error) {
	entries, err := os.ReadDir(d.CDIDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[types.UID][]string{}
	for _, e := range entries {
		uid, ok := strings.CutPrefix(strings.TrimSuffix(e.Name(), ".json"), specPrefix)
		if !ok || !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		raw, err := os.ReadFile(filepath.Join(d.CDIDir, e.Name()))
		if err != nil {
			return nil, err
		}
		shares, err := sharesOf(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", e.Name(), err)
		}
		var namespaces []string
		for _, s := range shares {
			if s.Namespace != "" {
				namespaces = append(namespaces, s.Namespace)
			}
		}
		out[types.UID(uid)] = namespaces
	}
	return out, nil
}

const specPrefix = "gpu.gpufrac.io-"

func (d *Driver) specPath(uid types.UID) string {
	return filepath.Join(d.CDIDir, specPrefix+string(uid)+".json")
}

// Enforceable says whether the node can enforce a DRA share now: a memory
// backend that binds a share that is not NVIDIA's device-plugin device
// (driver limits, or MPS pinned limits) and a running MPS daemon. While it
// cannot, the node publishes no device, so no claim is allocated here.
func Enforceable(cfg injection.Config) bool {
	return (cfg.Backend == nodeapi.BackendDriver || cfg.Backend == nodeapi.BackendMPSPinned) && cfg.MPS != nodeapi.MPSNone && cfg.MPSRoot != ""
}

// Serve starts the driver's kubelet plugin: its gRPC service in
// pluginDir, its registration with the kubelet in registrarDir, and the
// node's ResourceSlices (Publish, with offers). Stop it with the helper's
// Stop.
func Serve(ctx context.Context, d *Driver, client kubernetes.Interface, pluginDir, registrarDir string, reserveMiB int64, offers Offers) (*kubeletplugin.Helper, error) {
	h, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(DriverName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(d.NodeName),
		kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.RegistrarDirectoryPath(registrarDir),
	)
	if err != nil {
		return nil, fmt.Errorf("DRA driver %s: %w", DriverName, err)
	}
	d.helper.Store(h)
	if err := Publish(ctx, h, d, reserveMiB, offers); err != nil {
		h.Stop()
		return nil, err
	}
	return h, nil
}

// Publish (re)publishes the node's devices as they are now: every GPU it
// offers and can enforce a share of, none while it cannot (Enforceable;
// a node where no container ever runs publishes them all the same). The helper writes only what changed.
func Publish(ctx context.Context, h *kubeletplugin.Helper, d *Driver, reserveMiB int64, offers Offers) error {
	inv, cfg := d.Node()
	if (!Enforceable(cfg) && !d.NoContainers) || d.dropped.Load() {
		if len(inv.GPUs) > 0 {
			klog.FromContext(ctx).V(2).Info("DRA driver: no device published: the node cannot enforce a share now (a memory backend that binds one, and a running MPS daemon) or the API server dropped the slices' counters",
				"backend", cfg.Backend, "mps", cfg.MPS)
		}
		inv.GPUs = nil
	}
	if err := h.PublishResources(ctx, Resources(d.NodeName, inv, reserveMiB, offers)); err != nil {
		return fmt.Errorf("DRA driver %s: publishing the node's devices: %w", DriverName, err)
	}
	return nil
}

// Granted is what a container's CDI device names (as the kubelet handed
// them to the runtime) grant it of the node's GPUs: for each device of a
// share this driver prepared, the GPUs its spec shows the container
// (NVIDIA_VISIBLE_DEVICES of its edits). Other devices grant nothing
// here: their own edits carry what they give.
func (d *Driver) Granted(cdiNames []string) ([]string, error) {
	var out []string
	for _, full := range cdiNames {
		name, ok := strings.CutPrefix(full, CDIKind+"=")
		if !ok {
			continue
		}
		entries, err := os.ReadDir(d.CDIDir)
		if err != nil {
			return nil, fmt.Errorf("CDI device %s: %w", full, err)
		}
		found := false
		for _, e := range entries {
			uid, ok := strings.CutPrefix(strings.TrimSuffix(e.Name(), ".json"), specPrefix)
			if !ok || !strings.HasPrefix(name, uid+"-") {
				continue
			}
			raw, err := os.ReadFile(filepath.Join(d.CDIDir, e.Name()))
			if err != nil {
				return nil, fmt.Errorf("CDI device %s: %w", full, err)
			}
			var spec cdispec.Spec
			if err := json.Unmarshal(raw, &spec); err != nil {
				return nil, fmt.Errorf("CDI device %s: its spec %s: %w", full, e.Name(), err)
			}
			for _, dev := range spec.Devices {
				if dev.Name != name {
					continue
				}
				found = true
				for _, kv := range dev.ContainerEdits.Env {
					if v, ok := strings.CutPrefix(kv, nodeapi.EnvVisibleDevices+"="); ok {
						out = append(out, strings.Split(v, ",")...)
					}
				}
			}
		}
		if !found {
			return nil, fmt.Errorf("CDI device %s: this node prepared no such share", full)
		}
	}
	return out, nil
}
