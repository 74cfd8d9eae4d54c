package api

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Burst reclaim (docs/scheduler.md): a share may use more than its
// request, up to its limit, while its GPU has memory to spare. When the
// GPU runs short, some tenant must give memory back, or an allocation of
// one within its request fails. On r615 the driver's MPS accounting
// would evict some client over its soft limit, of its own choosing; the
// node agent chooses first, by this order, which the agent, `gpufrac top`
// and the dashboard share.

// Burst is a tenant's standing for burst reclaim on one GPU.
type Burst struct {
	// Pod is namespace/name; Container its container.
	Pod, Container string
	// Priority is the pod's (spec.priority; 0 when unset).
	Priority int32
	// RequestMiB is its guaranteed share; UsedMiB what it uses.
	RequestMiB, UsedMiB int64
}

// Over is how far above its request the tenant uses.
func (b Burst) Over() int64 { return b.UsedMiB - b.RequestMiB }

// String is the tenant as an order lists it.
func (b Burst) String() string {
	return fmt.Sprintf("%s (priority %d, %s above its request)", b.Pod, b.Priority, FormatMiB(b.Over()))
}

// ReclaimOrder is the order in which the tenants of one GPU are stopped
// under memory pressure: only those above their request, the lowest
// priority first, then the one furthest above its request, then by name
// (so every reader agrees). A tenant within its request is never in it:
// its memory is guaranteed.
func ReclaimOrder(tenants []Burst) []Burst {
	out := slices.DeleteFunc(slices.Clone(tenants), func(b Burst) bool { return b.Over() <= 0 })
	slices.SortFunc(out, func(a, b Burst) int {
		return cmp.Or(cmp.Compare(a.Priority, b.Priority), cmp.Compare(b.Over(), a.Over()),
			strings.Compare(a.Pod, b.Pod), strings.Compare(a.Container, b.Container))
	})
	return out
}

// DefaultReclaimBelowPercent is the free memory, in percent of a GPU's,
// below which the node agent reclaims bursts (--burst-reclaim-below).
const DefaultReclaimBelowPercent = 5

// UnderPressure says whether a GPU with freeMiB of totalMiB free is below
// belowPercent free.
func UnderPressure(freeMiB, totalMiB int64, belowPercent int) bool {
	return totalMiB > 0 && freeMiB*100 < totalMiB*int64(belowPercent)
}
