package api

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	kjson "sigs.k8s.io/json"
)

// The opaque configuration of gpufrac's DRA driver (gpu.gpufrac.io): what a
// ResourceClaim (or DeviceClass) passes in spec.devices.config[].opaque.
// parameters besides the share the allocator records (SPEC §5).
const (
	ShareConfigAPIVersion = "gpu.gpufrac.io/v1alpha1"
	ShareConfigKind       = "ShareConfig"
)

// ShareConfig is a claim's opaque configuration for a share.
type ShareConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// MemoryLimit is the hard limit the share may burst to, on each of its
	// GPUs; empty: the limit is the request (capacity.requests.memory).
	MemoryLimit string `json:"memoryLimit,omitempty"`
}

// ParseShareConfig reads a ShareConfig and returns its memory limit in MiB
// (0: none given). Unknown fields, another kind or version, and a limit
// that is not a positive quantity are errors naming the field.
func ParseShareConfig(raw []byte) (limitMiB int64, err error) {
	var c ShareConfig
	// As the API server reads objects: field names case-sensitive, unknown
	// and duplicate fields refused.
	strict, err := kjson.UnmarshalStrict(raw, &c, kjson.DisallowUnknownFields, kjson.DisallowDuplicateFields)
	if err == nil {
		err = JoinLine(strict...)
	}
	if err != nil {
		return 0, fmt.Errorf("opaque parameters of driver gpu.gpufrac.io: %s", strings.ReplaceAll(strings.TrimPrefix(err.Error(), "json: "), "\n", "; "))
	}
	if c.APIVersion != ShareConfigAPIVersion || c.Kind != ShareConfigKind {
		return 0, fmt.Errorf("opaque parameters of driver gpu.gpufrac.io: apiVersion %q, kind %q: must be %s, %s", c.APIVersion, c.Kind, ShareConfigAPIVersion, ShareConfigKind)
	}
	if c.MemoryLimit == "" {
		return 0, nil
	}
	q, err := resource.ParseQuantity(c.MemoryLimit)
	if err != nil || q.Sign() <= 0 || q.Value()>>20 <= 0 {
		return 0, fmt.Errorf("opaque parameters of driver gpu.gpufrac.io: memoryLimit %q: must be a quantity of at least 1Mi (20Gi, 30720Mi)", c.MemoryLimit)
	}
	return q.Value() >> 20, nil
}

// The DRA driver, its DeviceClasses (deploy/dra) and its devices'
// capacities: one for each compute mode, since a GPU runs one mode.
const (
	DRADriver = "gpu.gpufrac.io"
	// DRAShareCDIKind is the CDI kind of the driver's prepared shares: the
	// kubelet names a container's share <kind>=<claim UID>-<request>.
	DRAShareCDIKind     = DRADriver + "/share"
	DRAClassTimeSlicing = DRADriver
	DRAClassSMSharing   = "sm-sharing." + DRADriver
	DRACapacityMemory   = "memory"
	DRACapacityCompute  = "compute"
	// DRAMinMemoryMiB is the smallest share the driver's devices give: the
	// allocator raises a smaller request to it (their request policy). A
	// CUDA context alone takes a few hundred MiB; a smaller share only
	// fails later, inside the container.
	DRAMinMemoryMiB = 256
)

// JoinLine joins errs (nils skipped) into one error whose message is one
// line, the messages separated by "; "; nil if there are none.
func JoinLine(errs ...error) error {
	var msgs []string
	for _, e := range errs {
		if e != nil {
			msgs = append(msgs, e.Error())
		}
	}
	if len(msgs) == 0 {
		return nil
	}
	return errors.New(strings.Join(msgs, "; "))
}

// ValidateClaim checks what a ResourceClaim's spec asks of gpufrac's DRA
// driver (SPEC §5), so that a claim the node could not enforce fails at
// creation, not at the pod's start: each request of one of its classes
// asks for one device with its memory (and, for sm-sharing, compute as a
// whole percent from 1 to 100; for time-slicing none), and the driver's
// opaque config is a valid ShareConfig whose limit is at least the memory
// of every request it applies to. Requests of other classes are not its
// business. Errors name the field, the value and the rule.
func ValidateClaim(spec resourceapi.ResourceClaimSpec) error {
	var errs []error
	// The gpufrac requests, request or request/subrequest as a config's
	// requests name them, and the memory each is given in MiB: what it
	// asks, rounded up to a MiB and to the devices' minimum, as the
	// allocator rounds it.
	var names []string
	memory := map[string]int64{}
	check := func(path, name string, r resourceapi.ExactDeviceRequest) {
		sm := r.DeviceClassName == DRAClassSMSharing
		if !sm && r.DeviceClassName != DRAClassTimeSlicing {
			return
		}
		if r.AllocationMode == resourceapi.DeviceAllocationModeAll || r.Count > 1 {
			errs = append(errs, fmt.Errorf("%s: allocationMode %q, count %d: a request of %s is one share of one GPU; ask for more GPUs with more requests", path, r.AllocationMode, r.Count, r.DeviceClassName))
		}
		var req map[resourceapi.QualifiedName]resource.Quantity
		if r.Capacity != nil {
			req = r.Capacity.Requests
		}
		mem, ok := req[DRACapacityMemory]
		if !ok || mem.Value()>>20 <= 0 {
			errs = append(errs, fmt.Errorf("%s.capacity.requests.memory %q: a share of %s must name its memory, at least 1Mi (20Gi)", path, quantityString(req, DRACapacityMemory), r.DeviceClassName))
		} else {
			names = append(names, name)
			memory[name] = max((mem.Value()+1<<20-1)>>20, DRAMinMemoryMiB)
		}
		compute, hasCompute := req[DRACapacityCompute]
		switch {
		case sm && (!hasCompute || compute.Cmp(*resource.NewQuantity(compute.Value(), resource.DecimalSI)) != 0 || compute.Value() < 1 || compute.Value() > 100):
			errs = append(errs, fmt.Errorf("%s.capacity.requests.compute %q: an sm-sharing share must name its compute as a whole percent from 1 to 100", path, quantityString(req, DRACapacityCompute)))
		case !sm && hasCompute:
			errs = append(errs, fmt.Errorf("%s.capacity.requests.compute %q: a time-slicing share has no compute portion; use the %s class for sm-sharing", path, compute.String(), DRAClassSMSharing))
		}
		for _, k := range slices.Sorted(maps.Keys(req)) {
			if k != DRACapacityMemory && k != DRACapacityCompute {
				errs = append(errs, fmt.Errorf("%s.capacity.requests.%s: not a capacity of %s (memory, compute)", path, k, DRADriver))
			}
		}
	}
	for i, r := range spec.Devices.Requests {
		if r.Exactly != nil {
			check(fmt.Sprintf("spec.devices.requests[%d](%s)", i, r.Name), r.Name, *r.Exactly)
		}
		for j, s := range r.FirstAvailable {
			check(fmt.Sprintf("spec.devices.requests[%d].firstAvailable[%d](%s/%s)", i, j, r.Name, s.Name), r.Name+"/"+s.Name, resourceapi.ExactDeviceRequest{
				DeviceClassName: s.DeviceClassName, AllocationMode: s.AllocationMode, Count: s.Count, Capacity: s.Capacity})
		}
	}
	for i, c := range spec.Devices.Config {
		if c.Opaque == nil || c.Opaque.Driver != DRADriver {
			continue
		}
		limit, err := ParseShareConfig(c.Opaque.Parameters.Raw)
		if err != nil {
			errs = append(errs, fmt.Errorf("spec.devices.config[%d]: %w", i, err))
			continue
		}
		for _, name := range names {
			mem := memory[name]
			if limit > 0 && limit < mem && (len(c.Requests) == 0 || AppliesTo(c.Requests, name)) {
				errs = append(errs, fmt.Errorf("spec.devices.config[%d]: memoryLimit %dMi is below request %s's memory %dMi: the limit must be at least the request", i, limit, name, mem))
			}
		}
	}
	return JoinLine(errs...)
}

// AppliesTo says whether a config whose requests are names applies to
// request (request or request/subrequest): a main request's name covers
// its subrequests (resource.k8s.io/v1, DeviceClaimConfiguration.Requests).
func AppliesTo(names []string, request string) bool {
	main, _, _ := strings.Cut(request, "/")
	return slices.ContainsFunc(names, func(n string) bool { return n == request || n == main })
}

func quantityString(req map[resourceapi.QualifiedName]resource.Quantity, k resourceapi.QualifiedName) string {
	if q, ok := req[k]; ok {
		return q.String()
	}
	return ""
}

// DRADeviceName is the name of the driver's device for mode on the GPU of
// that UUID: the UUID lower-cased (a device name is a DNS label, and
// NVIDIA's UUIDs differ only by case from one: GPU-<hex with dashes>),
// then the mode. The name is what an allocation records, so naming the
// device by UUID, not index, keeps an allocation on its physical GPU when
// the node's indices change (a reboot that loses a GPU). ok is false for
// a UUID that cannot be a device name.
func DRADeviceName(uuid string, mode ComputeMode) (name string, ok bool) {
	name = strings.ToLower(uuid) + "-" + string(mode)
	if len(name) > 63 || !strings.HasPrefix(name, "gpu-") {
		return "", false
	}
	for _, r := range name {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '-' {
			return "", false
		}
	}
	return name, true
}

// ParseDRADevice is DRADeviceName's inverse: the GPU's UUID (lower-cased;
// compare it with strings.EqualFold) and the mode.
func ParseDRADevice(name string) (uuid string, mode ComputeMode, ok bool) {
	for _, m := range []ComputeMode{TimeSlicing, SMSharing} {
		if u, found := strings.CutSuffix(name, "-"+string(m)); found && strings.HasPrefix(u, "gpu-") && len(u) > len("gpu-") {
			return u, m, true
		}
	}
	return "", "", false
}

// ClaimShare is one share a ResourceClaim's allocation gives on a device
// of gpufrac's driver: the one reading of an allocation, for the node
// (which enforces it), the scheduler and the audit (which book it beside
// annotation shares on the same GPU).
type ClaimShare struct {
	// Node is the node whose pool the device is in (the driver names its
	// pool after the node).
	Node string
	// Request is the claim's request (request or request/subrequest).
	Request string
	// Assignment is the share: Devices holds the GPU's UUID as the device
	// name gives it (lower-cased), Container the request.
	Assignment Assignment
}

// ClaimShares reads the shares of gpufrac's driver in a claim's
// allocation: the GPU from the device name, the memory from
// consumedCapacity (the allocator's rounding included), the hard limit
// from the claim's ShareConfig (at least the request; the node checks it
// against the GPU), the mode from the device and, for sm-sharing, the
// portion from the consumed compute. A claim with no allocation gives
// none. An error names the share and what is wrong; the caller decides
// whether the rest still counts.
func ClaimShares(claim *resourceapi.ResourceClaim) ([]ClaimShare, error) {
	alloc := claim.Status.Allocation
	if alloc == nil {
		return nil, nil
	}
	var out []ClaimShare
	var errs []error
	for _, r := range alloc.Devices.Results {
		if r.Driver != DRADriver {
			continue
		}
		who := claim.Namespace + "/" + claim.Name + "/" + r.Request
		s, err := ClaimShareOf(r, alloc.Devices.Config)
		if err != nil {
			errs = append(errs, fmt.Errorf("claim share %q: %w", who, err))
			continue
		}
		out = append(out, s)
	}
	return out, errors.Join(errs...)
}

// ClaimShareOf reads one allocation result of the driver, with the
// allocation's configs (ClaimShares reads them all).
func ClaimShareOf(r resourceapi.DeviceRequestAllocationResult, configs []resourceapi.DeviceAllocationConfiguration) (ClaimShare, error) {
	s := ClaimShare{Node: r.Pool, Request: r.Request}
	uuid, mode, ok := ParseDRADevice(r.Device)
	if !ok {
		return s, fmt.Errorf("device %q is not one %s publishes (<GPU UUID>-<mode>)", r.Device, DRADriver)
	}
	memory, ok := r.ConsumedCapacity[DRACapacityMemory]
	if !ok {
		// Allocated without consumable capacity (DRAConsumableCapacity
		// off): the share is unknown, so nothing could enforce it.
		return s, errors.New("the allocation records no consumed memory; the cluster needs the DRAConsumableCapacity feature (on by default since Kubernetes 1.36)")
	}
	a := Assignment{Container: r.Request, Devices: []string{uuid}, Mode: mode}
	a.RequestMiB = (memory.Value() + 1<<20 - 1) >> 20
	if a.RequestMiB <= 0 {
		return s, fmt.Errorf("consumed memory %s: must be positive", memory.String())
	}
	a.LimitMiB = a.RequestMiB
	limit, err := configuredLimit(configs, r.Request)
	if err != nil {
		return s, err
	}
	if limit > 0 {
		if limit < a.RequestMiB {
			return s, fmt.Errorf("memoryLimit %dMi: must be at least the request (%dMi)", limit, a.RequestMiB)
		}
		a.LimitMiB = limit
	}
	if mode == SMSharing {
		compute := r.ConsumedCapacity[DRACapacityCompute]
		pct := compute.Value()
		if compute.MilliValue() != pct*1000 || pct < 1 || pct > 100 {
			return s, fmt.Errorf("consumed compute %s: must be a whole percent from 1 to 100", compute.String())
		}
		if a.Portion, err = ParseFraction(strconv.FormatFloat(float64(pct)/100, 'f', -1, 64)); err != nil {
			return s, fmt.Errorf("consumed compute %s: %w", compute.String(), err)
		}
	}
	s.Assignment = a
	return s, nil
}

// configuredLimit is the memory limit the allocation's opaque configs of
// the driver give request: the claim's own over its class's, the last of
// each (the allocator lists class entries first).
func configuredLimit(configs []resourceapi.DeviceAllocationConfiguration, request string) (int64, error) {
	return lastLimit(len(configs), func(i int) ([]string, *resourceapi.OpaqueDeviceConfiguration) {
		return configs[i].Requests, configs[i].Opaque
	}, request)
}

// lastLimit is the memory limit the last of n opaque configs of the
// driver that applies to request gives (0: none); at(i) is the i-th
// config's requests (none: all) and opaque part. The one reading of a
// ShareConfig's limit, for allocations, claims and classes alike.
func lastLimit(n int, at func(i int) ([]string, *resourceapi.OpaqueDeviceConfiguration), request string) (int64, error) {
	var limit int64
	for i := range n {
		requests, opaque := at(i)
		if opaque == nil || opaque.Driver != DRADriver || (len(requests) > 0 && !AppliesTo(requests, request)) {
			continue
		}
		l, err := ParseShareConfig(opaque.Parameters.Raw)
		if err != nil {
			return 0, err
		}
		if l > 0 {
			limit = l
		}
	}
	return limit, nil
}
