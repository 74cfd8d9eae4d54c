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

// ChargeCapacityList is what a GPU node advertises of the charge, as its
// capacity and allocatable.
func ChargeCapacityList() corev1.ResourceList {
	return corev1.ResourceList{ResourceGPUMemory: ChargeCapacity.DeepCopy()}
}

// Charges says whether a container's resources (its requests or limits)
// carry a charge.
func Charges(list corev1.ResourceList) bool {
	_, ok := list[ResourceGPUMemory]
	return ok
}

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
		return HeldMiB(limit.MiB, r.Devices), nil
	}
	if largestGPUMiB <= 0 {
		return 0, fmt.Errorf("container %q asks for a share of a GPU (%s), but no node reports its GPUs' memory yet (label %s), so the share cannot be charged to the namespace's GPU memory quota: ask with gpu-memory, or create the pod once GPU nodes have joined",
			r.Container, limit, LabelGPUMemory)
	}
	return HeldMiB(limit.Fraction.Of(largestGPUMiB), r.Devices), nil
}

// HeldMiB is the most GPU memory a share holds, as quota charges it: its
// hard limit on each of its GPUs, times its GPUs.
func HeldMiB(limitMiB int64, devices int) int64 { return limitMiB * int64(max(devices, 1)) }

// The quota evaluator: what a pod is charged to its namespace's GPU
// memory quota, one definition for the webhook that writes the charge and
// the scheduler that places (and resizes) within it, as Kubernetes' own
// quota evaluators give admission and the quota controller one Usage. The
// callers read the cluster; what is charged is decided here.

// Usage is a pod's charge: its annotation share's, its claims of
// gpufrac's driver's, and whether it is charged at all (it asks for a
// share or names a claim).
type Usage struct {
	ShareMiB, ClaimsMiB int64
	Charged             bool
}

// MiB is the whole charge.
func (u Usage) MiB() int64 { return u.ShareMiB + u.ClaimsMiB }

// ClaimLookup finds the spec of one of a pod's claims (for a template, at
// admission, the spec the claim will have); found is false where there is
// none yet, which is charged nothing: the scheduler never places a pod
// whose shares hold more than its charge (ShareBudgetMiB).
type ClaimLookup func(pc corev1.PodResourceClaim) (spec *resourceapi.ResourceClaimSpec, found bool, err error)

// PodUsage is what the pod is charged: its annotation shares sized on the
// largest GPU the cluster reports (ChargeMiB), and its claims
// (ClaimsUsage).
func PodUsage(pod *corev1.Pod, largestGPUMiB int64, claims ClaimLookup, classLimitMiB func(class string) (int64, error)) (Usage, error) {
	u, err := ClaimsUsage(pod, claims, classLimitMiB)
	if err != nil {
		return Usage{}, err
	}
	reqs, perr := Parse(pod)
	if perr != nil || len(reqs) == 0 {
		return u, nil // refused by validation, or no share
	}
	u.Charged = true
	for _, r := range reqs {
		m, err := r.ChargeMiB(largestGPUMiB)
		if err != nil {
			return Usage{}, err
		}
		u.ShareMiB += m
	}
	return u, nil
}

// ClaimsUsage is what the pod's claims of gpufrac's driver are charged
// (ClaimChargeMiB each, looked up by claims; nil: none read). Charged says
// it names a claim that is gpufrac's, or not found yet.
func ClaimsUsage(pod *corev1.Pod, claims ClaimLookup, classLimitMiB func(class string) (int64, error)) (Usage, error) {
	var u Usage
	if claims == nil {
		return u, nil
	}
	for _, pc := range pod.Spec.ResourceClaims {
		if pc.ResourceClaimName == nil && pc.ResourceClaimTemplateName == nil {
			continue // the API server refuses such a pod
		}
		spec, found, err := claims(pc)
		if err != nil {
			return Usage{}, err
		}
		if !found {
			u.Charged = true // 0 for this claim: see ClaimLookup
			continue
		}
		m, err := ClaimChargeMiB(*spec, classLimitMiB)
		if err != nil {
			return Usage{}, fmt.Errorf("pod claim %q: %w", pc.Name, err)
		}
		u.Charged = u.Charged || m > 0
		u.ClaimsMiB += m
	}
	return u, nil
}

// ShareBudgetMiB is what the pod's annotation share may hold (HeldMiB)
// on the GPUs it is placed on or resized to: what it was charged when it
// was created (ChargedMiB) less what its claims hold (claimsMiB, from
// ClaimsUsage). charged is false for a pod created before gpufrac charged
// quota; a budget below 0 means its claims hold more than it was charged.
func ShareBudgetMiB(spec *corev1.PodSpec, claimsMiB int64) (budget int64, charged bool) {
	mib, charged := ChargedMiB(spec)
	return mib - claimsMiB, charged
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
				mem = max(ceilMiB(q.Value()), DRAMinMemoryMiB)
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
		return ceilMiB(q.Value()), ok
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

// ceilMiB is bytes in MiB, rounded up.
func ceilMiB(bytes int64) int64 { return (bytes + 1<<20 - 1) >> 20 }

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
