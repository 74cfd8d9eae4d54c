package api

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// ResourceGPUMemory is the extended resource that charges a pod's GPU
// memory to its namespace's ResourceQuota (requests.gpufrac.io/gpu-memory):
// the admission webhook writes it on every pod that asks for a share,
// through annotations or through claims of gpufrac's driver, and replaces
// any value the pod's author wrote. It is charged at the hard limit, not
// the request: the most GPU memory the pod can ever hold is what a
// namespace's budget must bound.
//
// It is a charge, not a node's capacity: what fits is decided per GPU by
// the scheduler plugin's ledger, and hard limits may add up to more than a
// GPU's memory. Yet every counter of extended resources must accept it:
// kube-scheduler's NodeResourcesFit (gpufrac's profile ignores it in
// Filter, but its queueing hint counts it, and a pod it finds unfit there
// is not retried when the node changes), KAI's scheduler (no ignore list)
// and the kubelet's admission. So each GPU node advertises ChargeCapacity
// of it (the node agent, with its heartbeat), which no node's charges
// approach.
const ResourceGPUMemory corev1.ResourceName = "gpufrac.io/gpu-memory"

// ChargeCapacity is what a GPU node advertises of ResourceGPUMemory
// (capacity and allocatable): 4Pi, unbounded in practice (no node's GPUs
// add up to a hundredth of it), and the most the API server accepts with
// room to spare: it validates an extended resource in thousandths, which
// must fit an int64 (8Ei/1000), and so do KAI's sums.
var ChargeCapacity = resource.MustParse("4Pi")

// ChargeMiB is what an annotation share is charged to quota: its hard
// limit on each GPU, times its GPUs. A share of a GPU is charged as on
// the largest GPU the cluster reports (largestGPUMiB, its whole memory),
// since admission cannot know which GPU it will get; the scheduler then
// never places it where it would hold more than it was charged.
func (r Request) ChargeMiB(largestGPUMiB int64) (int64, error) {
	limit := r.Limit
	if limit.IsZero() {
		limit = r.Memory
	}
	if !limit.IsFraction() {
		return limit.MiB * int64(max(r.Devices, 1)), nil
	}
	if largestGPUMiB <= 0 {
		return 0, fmt.Errorf("container %q asks for a share of a GPU (%s), but no node reports its GPUs' memory yet (label %s), so the share cannot be charged to the namespace's GPU memory quota: ask with gpu-memory, or create the pod once GPU nodes have joined",
			r.Container, limit, LabelGPUMemory)
	}
	return limit.Fraction.Of(largestGPUMiB) * int64(max(r.Devices, 1)), nil
}

// IsZero reports whether a is unset.
func (a Amount) IsZero() bool { return a.MiB == 0 && a.Fraction.IsZero() }

// ClaimChargeMiB is what a ResourceClaim's shares of gpufrac's driver are
// charged to quota: for each request of one of its classes, the larger of
// its memory (as the allocator rounds it) and its hard limit, from the
// claim's ShareConfig or else its class's (classLimitMiB; nil: none); for
// a request with alternatives (firstAvailable), the largest of those. The
// node enforces exactly these figures (ClaimShareOf reads the same
// configs from the allocation).
func ClaimChargeMiB(spec resourceapi.ResourceClaimSpec, classLimitMiB func(class string) (int64, error)) (int64, error) {
	claimLimit := func(request string) (int64, error) {
		return lastLimit(len(spec.Devices.Config), func(i int) ([]string, *resourceapi.OpaqueDeviceConfiguration) {
			return spec.Devices.Config[i].Requests, spec.Devices.Config[i].Opaque
		}, request)
	}
	charge := func(name, class string, capacity *resourceapi.CapacityRequirements) (int64, error) {
		if class != DRAClassTimeSlicing && class != DRAClassSMSharing {
			return 0, nil
		}
		var mem int64
		if capacity != nil {
			if q, ok := capacity.Requests[DRACapacityMemory]; ok {
				mem = max((q.Value()+1<<20-1)>>20, DRAMinMemoryMiB)
			}
		}
		limit, err := claimLimit(name)
		if err == nil && limit == 0 && classLimitMiB != nil {
			limit, err = classLimitMiB(class)
		}
		if err != nil {
			return 0, fmt.Errorf("request %q: %w", name, err)
		}
		return max(mem, limit), nil
	}
	var total int64
	for _, r := range spec.Devices.Requests {
		var most int64
		if r.Exactly != nil {
			c, err := charge(r.Name, r.Exactly.DeviceClassName, r.Exactly.Capacity)
			if err != nil {
				return 0, err
			}
			most = c
		}
		for _, s := range r.FirstAvailable {
			c, err := charge(r.Name+"/"+s.Name, s.DeviceClassName, s.Capacity)
			if err != nil {
				return 0, err
			}
			most = max(most, c)
		}
		total += most
	}
	return total, nil
}

// ClassLimitMiB is the memory limit a DeviceClass's own ShareConfig
// gives its shares (0: none): the last of its configs of gpufrac's driver.
func ClassLimitMiB(class *resourceapi.DeviceClass) (int64, error) {
	limit, err := lastLimit(len(class.Spec.Config), func(i int) ([]string, *resourceapi.OpaqueDeviceConfiguration) {
		return nil, class.Spec.Config[i].Opaque
	}, "")
	if err != nil {
		return 0, fmt.Errorf("DeviceClass %s: %w", class.Name, err)
	}
	return limit, nil
}

// ChargedMiB is the GPU memory a pod was charged to quota, as
// ResourceQuota counts it (the regular containers' sum, or an init
// container's if larger), rounded up to a MiB; charged is false when the
// pod carries no charge at all (created before gpufrac charged quota, or
// by a path that does not).
func ChargedMiB(spec *corev1.PodSpec) (mib int64, charged bool) {
	amount := func(c corev1.Container) (int64, bool) {
		q, ok := c.Resources.Requests[ResourceGPUMemory]
		if !ok {
			q, ok = c.Resources.Limits[ResourceGPUMemory]
		}
		return (q.Value() + 1<<20 - 1) >> 20, ok
	}
	var sum int64
	for _, c := range spec.Containers {
		v, ok := amount(c)
		sum, charged = sum+v, charged || ok
	}
	for _, c := range spec.InitContainers {
		v, ok := amount(c)
		sum, charged = max(sum, v), charged || ok
	}
	return sum, charged
}

// ChargeQuantity is mib as the quantity the webhook writes (20Gi, 1500Mi).
func ChargeQuantity(mib int64) resource.Quantity {
	return *resource.NewQuantity(mib*mebibyte, resource.BinarySI)
}

// QuotaBoundsGPUMemory says whether a ResourceQuota's hard limits bound
// GPU memory: ResourceGPUMemory itself, or requests. or limits. of it (an
// extended resource is quota'd as requests.<name>; the others are read as
// well, should an admin write them).
func QuotaBoundsGPUMemory(hard corev1.ResourceList) bool {
	for name := range hard {
		if strings.TrimPrefix(strings.TrimPrefix(string(name), "requests."), "limits.") == string(ResourceGPUMemory) {
			return true
		}
	}
	return false
}
