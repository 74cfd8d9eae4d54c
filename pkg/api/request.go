package api

import (
	"fmt"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// ComputeMode is how a container shares a GPU's compute with its neighbours.
// A GPU runs one mode at a time.
type ComputeMode string

const (
	// TimeSlicing gives each tenant the whole GPU in turns (the default).
	TimeSlicing ComputeMode = "time-slicing"
	// SMSharing runs tenants concurrently under MPS, each with a share of
	// the streaming multiprocessors.
	SMSharing ComputeMode = "sm-sharing"
)

// ParseComputeMode accepts exactly the two mode names; blank is invalid.
func ParseComputeMode(s string) (ComputeMode, bool) {
	switch m := ComputeMode(s); m {
	case TimeSlicing, SMSharing:
		return m, true
	}
	return "", false
}

// Amount is GPU memory on one GPU: either absolute (MiB > 0) or a share of
// the GPU's schedulable memory (Fraction in (0,1)), never both. The share is
// resolved to MiB only once a node is chosen, since it depends on the GPU.
type Amount struct {
	MiB      int64
	Fraction Fraction
}

// IsFraction reports whether a is a share of a GPU rather than an absolute size.
func (a Amount) IsFraction() bool { return a.MiB == 0 && !a.Fraction.IsZero() }

// String renders a as it is normalised: "4096Mi" or "0.5".
func (a Amount) String() string {
	if a.IsFraction() {
		return a.Fraction.String()
	}
	return strconv.FormatInt(a.MiB, 10) + "Mi"
}

// Resolve turns a into MiB on a GPU with totalMiB of memory of which
// reserveMiB is kept back for the driver: floor((total − reserve) × fraction)
// for a share, the size itself otherwise. A share that resolves to nothing
// is an error, never a zero-sized grant.
func (a Amount) Resolve(totalMiB, reserveMiB int64) (int64, error) {
	if !a.IsFraction() {
		if a.MiB <= 0 {
			return 0, fmt.Errorf("memory amount %dMi must be greater than 0", a.MiB)
		}
		return a.MiB, nil
	}
	usable := totalMiB - reserveMiB
	mib := a.Fraction.Of(usable)
	if mib <= 0 {
		return 0, fmt.Errorf("fraction %s of a GPU with %dMi of memory and %dMi reserved resolves to %dMi: the share must resolve to at least 1Mi",
			a.Fraction, totalMiB, reserveMiB, mib)
	}
	return mib, nil
}

// Request is what one container asks for on each of its GPUs. Memory and
// Limit have the same kind (both absolute or both shares) and
// Memory ≤ Limit.
type Request struct {
	// Container is the name of the container that gets the GPUs.
	Container string
	// Memory is guaranteed on each assigned GPU; the scheduler charges it.
	Memory Amount
	// Limit is the hard cap the container may burst to on each GPU.
	Limit Amount
	// Mode is the compute-sharing mode.
	Mode ComputeMode
	// Devices is how many distinct GPUs of one node the container gets,
	// each with Memory free.
	Devices int
}

// Resolved is a Request's memory in MiB on a concrete GPU.
type Resolved struct {
	RequestMiB int64
	LimitMiB   int64
}

// Resolve turns r's request and limit into MiB on a GPU of totalMiB memory
// with reserveMiB held back (see Amount.Resolve).
func (r Request) Resolve(totalMiB, reserveMiB int64) (Resolved, error) {
	req, err := r.Memory.Resolve(totalMiB, reserveMiB)
	if err != nil {
		return Resolved{}, fmt.Errorf("container %q: request: %w", r.Container, err)
	}
	limit, err := r.Limit.Resolve(totalMiB, reserveMiB)
	if err != nil {
		return Resolved{}, fmt.Errorf("container %q: limit: %w", r.Container, err)
	}
	return Resolved{RequestMiB: req, LimitMiB: limit}, nil
}

// String is the normalised form printed by `gpufrac validate`, e.g.
// container=main request=0.5 limit=0.75 mode=time-slicing devices=1.
func (r Request) String() string {
	return fmt.Sprintf("container=%s request=%s limit=%s mode=%s devices=%d",
		r.Container, r.Memory, r.Limit, r.Mode, r.Devices)
}

// WholeGPUs is how many whole GPUs a pod asks the device plugin for: the
// sum over its containers, or more if an init container asks more (they
// run one at a time). Extended resources have requests equal to limits.
func WholeGPUs(spec *corev1.PodSpec) int {
	amount := func(c corev1.Container) int {
		q, ok := c.Resources.Limits[ResourceGPU]
		if !ok {
			q = c.Resources.Requests[ResourceGPU]
		}
		return int(q.Value())
	}
	n := 0
	for _, c := range spec.Containers {
		n += amount(c)
	}
	for _, c := range spec.InitContainers {
		n = max(n, amount(c))
	}
	return n
}

// FormatMiB renders mib as KAI's admission and binder write memory: a
// canonical Kubernetes quantity, so 2048 is "2Gi" and 2000 is "2000Mi".
func FormatMiB(mib int64) string {
	return resource.NewQuantity(mib*mebibyte, resource.BinarySI).String()
}

// PortionOfMemory is the sm-sharing compute portion that matches a memory
// share: request ÷ schedulable, in thousandths rounded down, at least
// 0.001 and at most 1. gpufrac's scheduler assigns portions so (memory that
// fits then brings compute that fits), and the node side derives one so
// for a pod whose scheduler wrote none (released KAI).
func PortionOfMemory(requestMiB, schedulableMiB int64) Fraction {
	return Thousandths(min(max(requestMiB*1000/max(schedulableMiB, 1), 1), 1000))
}
