// Package clusterview builds what `gpufrac top` shows: per node and per
// GPU, the compute mode, the fractional tenants with their request, limit
// and compute portion, the free memory, and the whole-GPU pods; and the
// cluster's GPU allocation and fragmentation. It reads pods and nodes as
// the API returns them and does no I/O.
package clusterview

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// View is the whole cluster.
type View struct {
	Nodes   []Node  `json:"nodes"`
	Summary Summary `json:"summary"`
	// Pending are the fractional pods not placed yet, by namespace/name.
	Pending []PendingPod `json:"pending"`
}

// PendingPod is a fractional pod no scheduler has placed.
type PendingPod struct {
	Pod string `json:"pod"` // namespace/name
	// Asks is what it asks for, as its annotations say it.
	Asks string `json:"asks"`
	// Reason is the scheduler's latest word on it: the message of the
	// pod's PodScheduled=False condition, which the scheduler rewrites at
	// every attempt, or else (WithReasons) of its latest FailedScheduling
	// event.
	Reason string `json:"reason,omitempty"`
	uid    string
}

// ReasonFailedScheduling is the reason of the events a scheduler records
// when it cannot place a pod.
const ReasonFailedScheduling = "FailedScheduling"

// Node is one node with GPUs.
type Node struct {
	Name      string `json:"name"`
	Model     string `json:"model"`
	GPUs      int    `json:"gpus"`
	MemoryMiB int64  `json:"memoryMiB"`
	// Ready is whether it takes fractions (gpu-fractioning.nvidia.com/Ready),
	// and ReadyReason and ReadyMessage the condition's reason and message.
	Ready        bool   `json:"ready"`
	ReadyReason  string `json:"readyReason,omitempty"`
	ReadyMessage string `json:"readyMessage,omitempty"`
	// Enforcement is the memory-limit backend the node agent reports in
	// effect (driver, toolkit, mps-pinned, none; "" when none reported).
	Enforcement string `json:"enforcement,omitempty"`
	// ReserveMiB is the memory per GPU the scheduler keeps back.
	ReserveMiB int64 `json:"reserveMiB"`
	// Shared are the GPUs fractions share, by UUID.
	Shared []GPU `json:"shared"`
	// Whole are the pods that hold whole GPUs.
	Whole []WholePod `json:"whole"`
	// Idle is how many GPUs nobody holds.
	Idle int `json:"idle"`
	// UsageAt is when its agent last measured its tenants' use (zero:
	// no reading, or one older than StaleUsage).
	UsageAt time.Time `json:"usageAt,omitzero"`
}

// GPU is a shared GPU.
type GPU struct {
	UUID    string          `json:"uuid"`
	Mode    api.ComputeMode `json:"mode"`
	Tenants []Tenant        `json:"tenants"`
	// FreeMiB is the schedulable memory (total − the scheduler's reserve)
	// no tenant's request holds: what the scheduler would still place.
	FreeMiB int64 `json:"freeMiB"`
	// SchedulableMiB is the GPU's memory less the reserve.
	SchedulableMiB int64 `json:"schedulableMiB"`
	// Use is the GPU's use as a whole, as its node's agent measured it.
	Use *api.GPUUsage `json:"use,omitempty"`
	// History is its use over the last hour, as for a tenant.
	History []Sample `json:"history,omitempty"`
	// ReclaimOrder are the tenants (namespace/name) the node agent would
	// stop, first to last, were the GPU short of memory now: those above
	// their request by their last reading (api.ReclaimOrder).
	ReclaimOrder []string `json:"reclaimOrder,omitempty"`
}

// Tenant is a fractional pod on a GPU.
type Tenant struct {
	Pod string `json:"pod"` // namespace/name; a claim's namespace/name/request
	// Claim is set for a share a ResourceClaim holds (DRA).
	Claim      bool  `json:"claim,omitempty"`
	RequestMiB int64 `json:"requestMiB"`
	LimitMiB   int64 `json:"limitMiB"`
	// Priority is the pod's (spec.priority), which orders burst reclaim.
	Priority int32 `json:"priority,omitempty"`
	// Portion is the sm-sharing compute share ("" for time-slicing).
	Portion string `json:"portion,omitempty"`
	// Annotations are the pod's GPU-fraction annotations: what it asked
	// for and what the scheduler decided.
	Annotations map[string]string `json:"annotations,omitempty"`
	// Resize says where a resize of its share stands (api.DescribeResize):
	// RequestMiB and LimitMiB are what it is charged until it is applied.
	Resize string `json:"resize,omitempty"`
	// Use is what it uses of the GPU, as its node's agent measured it
	// (api.UsageAnnotation); nil where there is no reading (an agent from
	// before, a reading gone stale) or the driver cannot say.
	Use *api.PodGPUUsage `json:"use,omitempty"`
	// Idle: over the window, it held under a tenth of its request and
	// computed nothing; NearLimit: it holds 90 % of its hard limit or more.
	Idle      bool `json:"idle,omitempty"`
	NearLimit bool `json:"nearLimit,omitempty"`
	// Advice is a resize its use over the window suggests (Advise).
	Advice *Advice `json:"advice,omitempty"`
	// History is its use over the last hour, where the dashboard keeps
	// one (History.Attach); top has none.
	History []Sample `json:"history,omitempty"`
}

// WholePod holds whole GPUs.
type WholePod struct {
	Pod  string `json:"pod"`
	GPUs int    `json:"gpus"`
}

// Summary is the cluster's GPU use.
type Summary struct {
	GPUs int `json:"gpus"`
	// AllocationPct is the memory held (tenants' requests, and whole GPUs
	// in full) over all GPU memory.
	AllocationPct float64 `json:"allocationPct"`
	// FragmentationPct is the free memory stranded on shared GPUs (where
	// no whole-GPU pod can go) over all free GPU memory.
	FragmentationPct float64 `json:"fragmentationPct"`
	// Pending counts fractional pods not yet placed.
	Pending int `json:"pending"`
	// TotalMiB is all GPU memory; AllocatedMiB what is held (as in
	// AllocationPct), FreeMiB what the scheduler could still place, and
	// StrandedMiB the part of it on shared GPUs.
	TotalMiB     int64 `json:"totalMiB"`
	AllocatedMiB int64 `json:"allocatedMiB"`
	FreeMiB      int64 `json:"freeMiB"`
	StrandedMiB  int64 `json:"strandedMiB"`
}

// Build makes the view from nodes and pods, read into ledgers as the
// scheduler reads them (package ledgers): the reservation pods, in the
// namespace each node's agent publishes, tell which GPU a group shares; each node's
// reserve is the one it publishes (api.LabelGPUMemoryReserve), so that
// free memory is what the scheduler would still place. claims are
// the cluster's ResourceClaims, whose DRA shares sit beside the pods'.
func Build(nodes []corev1.Node, pods []corev1.Pod, claims []resourceapi.ResourceClaim) View {
	v := View{Pending: []PendingPod{}}
	c := ledgers.Build(nodes, pods, claims)
	annotations := map[string]map[string]string{} // namespace/name → GPU-fraction annotations
	resizes := map[string]string{}                // namespace/name → api.DescribeResize
	priorities := map[string]int32{}              // namespace/name → spec.priority
	for i := range pods {
		p := &pods[i]
		if p.Spec.Priority != nil {
			priorities[p.Namespace+"/"+p.Name] = *p.Spec.Priority
		}
		if as, err := api.ParseAssignments(p.Annotations); err == nil && len(as) > 0 && p.Spec.NodeName != "" {
			resizes[p.Namespace+"/"+p.Name] = api.DescribeResize(p, as[0])
		}
		if p.Spec.NodeName == "" && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			if reqs, err := api.Parse(api.Intent(p)); err == nil && len(reqs) > 0 {
				v.Summary.Pending++
				v.Pending = append(v.Pending, PendingPod{Pod: p.Namespace + "/" + p.Name, Asks: asks(reqs), Reason: unschedulable(p), uid: string(p.UID)})
			}
		}
		for k, val := range p.Annotations {
			if api.IsFractionKey(k) || api.IsGroupsKey(k) {
				key := p.Namespace + "/" + p.Name
				if annotations[key] == nil {
					annotations[key] = map[string]string{}
				}
				annotations[key][k] = val
			}
		}
	}
	uses := map[string]api.NodeUsage{}
	for _, n := range nodes {
		if u, ok, err := api.UsageOf(&n); ok && err == nil && time.Since(u.At) < StaleUsage {
			uses[n.Name] = u
		}
	}
	conditions := map[string]corev1.NodeCondition{}
	enforcement := map[string]string{}
	silent := map[string]bool{}
	for _, n := range nodes {
		enforcement[n.Name] = api.MemoryEnforcement(&n)
		if cond, ok := api.FractioningCondition(&n); ok {
			conditions[n.Name] = cond
		}
		// Ready as last published, but unheard since: shown as the
		// scheduler sees it.
		if quiet, why := api.AgentSilent(&n, time.Now()); quiet {
			silent[n.Name] = true
			conditions[n.Name] = corev1.NodeCondition{Reason: "AgentSilent", Message: why}
		}
	}
	var held, total, free, stranded int64
	for _, ln := range c.Nodes {
		n := Node{Name: ln.Name, Model: ln.Inventory.Model, GPUs: ln.Inventory.Count, MemoryMiB: ln.Inventory.MemoryMiB, Ready: ln.Ready && !silent[ln.Name],
			ReadyReason: conditions[ln.Name].Reason, ReadyMessage: conditions[ln.Name].Message,
			Enforcement: enforcement[ln.Name], ReserveMiB: ln.Inventory.ReserveMiB}
		use, measured := uses[ln.Name]
		if measured {
			n.UsageAt = use.At
		}
		for _, t := range ln.Tenants {
			if t.Request.Whole > 0 {
				n.Whole = append(n.Whole, WholePod{Pod: t.Pod, GPUs: t.Request.Whole})
			}
		}
		if ln.Ledger != nil {
			for slot, d := range ln.Ledger.Devices {
				total += d.Total
				shares := d.Shares()
				switch {
				case len(shares) > 0:
					g := GPU{UUID: ln.UUID(slot), Mode: d.Mode(), FreeMiB: d.Free(), SchedulableMiB: d.Schedulable()}
					if g.UUID == "" {
						g.UUID = fmt.Sprintf("GPU %d", slot)
					}
					for i := range use.GPUs {
						if strings.EqualFold(use.GPUs[i].UUID, g.UUID) {
							g.Use = &use.GPUs[i]
						}
					}
					for key := range shares {
						t, ok := ln.Tenants[key]
						if !ok {
							t = &ledgers.Tenant{Pod: key} // every share is a tenant's; shown by its key if not
						}
						tenant := Tenant{Pod: t.Pod, Claim: t.Claim, RequestMiB: shares[key].Request, LimitMiB: shares[key].Limit, Annotations: annotations[t.Pod]}
						if !t.Claim {
							tenant.Resize, tenant.Priority = resizes[t.Pod], priorities[t.Pod]
						}
						if pu, ok := use.Of(t.Pod, g.UUID); ok && measured {
							tenant.Use = &pu
							tenant.Idle, tenant.NearLimit = idle(tenant), nearLimit(tenant)
						}
						if a := t.Assignment; a != nil && a.Mode == api.SMSharing && !a.Portion.IsZero() {
							tenant.Portion = a.Portion.String()
						}
						g.Tenants = append(g.Tenants, tenant)
					}
					slices.SortFunc(g.Tenants, func(a, b Tenant) int { return strings.Compare(a.Pod, b.Pod) })
					g.ReclaimOrder = reclaimOrder(g.Tenants)
					n.Shared = append(n.Shared, g)
					held += d.Charged()
					free += max(d.Free(), 0)
					stranded += max(d.Free(), 0)
				case d.Idle():
					n.Idle++
					free += d.Schedulable()
				case !ledgers.IsPlaceholder(d.Whole()):
					held += d.Total // a whole-GPU pod; a reservation pod's empty GPU is neither held nor free
				}
			}
		}
		slices.SortFunc(n.Shared, func(a, b GPU) int { return strings.Compare(a.UUID, b.UUID) })
		slices.SortFunc(n.Whole, func(a, b WholePod) int { return strings.Compare(a.Pod, b.Pod) })
		v.Nodes = append(v.Nodes, n)
		v.Summary.GPUs += n.GPUs
	}
	slices.SortFunc(v.Nodes, func(a, b Node) int { return cmp.Compare(a.Name, b.Name) })
	adviseAll(&v)
	slices.SortFunc(v.Pending, func(a, b PendingPod) int { return cmp.Compare(a.Pod, b.Pod) })
	v.Summary.TotalMiB, v.Summary.AllocatedMiB, v.Summary.FreeMiB, v.Summary.StrandedMiB = total, held, free, stranded
	if total > 0 {
		v.Summary.AllocationPct = round1(float64(held) * 100 / float64(total))
	}
	if free > 0 {
		v.Summary.FragmentationPct = round1(float64(stranded) * 100 / float64(free))
	}
	return v
}

func round1(x float64) float64 { return float64(int64(x*10+0.5)) / 10 }

// asks says what a pod's requests ask for, in a few words.
func asks(reqs []api.Request) string {
	var parts []string
	for _, r := range reqs {
		parts = append(parts, r.String())
	}
	return strings.Join(parts, "; ")
}

// unschedulable is the message of a pod's PodScheduled=False condition.
func unschedulable(p *corev1.Pod) string {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
			return c.Message
		}
	}
	return ""
}

// WithReasons gives each pending pod without a PodScheduled condition
// message the message of the latest FailedScheduling event about it (that
// very pod: by UID, so not a deleted namesake's). A scheduler that records
// events but sets no condition is still heard; where both exist the
// condition wins, since an event series keeps its first message while it
// counts repeats.
func WithReasons(v View, events []corev1.Event) View {
	latest := map[string]*corev1.Event{} // pod UID → event
	for i := range events {
		e := &events[i]
		if e.Reason != ReasonFailedScheduling || e.InvolvedObject.Kind != "Pod" || e.InvolvedObject.UID == "" {
			continue
		}
		key := string(e.InvolvedObject.UID)
		if old, ok := latest[key]; !ok || eventTime(e).After(eventTime(old)) {
			latest[key] = e
		}
	}
	out := v
	out.Pending = slices.Clone(v.Pending)
	for i, p := range out.Pending {
		if e, ok := latest[p.uid]; ok && p.Reason == "" {
			out.Pending[i].Reason = e.Message
		}
	}
	return out
}

// eventTime is when an event last happened, whichever of its clocks its
// reporter set.
func eventTime(e *corev1.Event) time.Time {
	var last time.Time
	if e.Series != nil {
		last = e.Series.LastObservedTime.Time
	}
	for _, t := range []time.Time{last, e.LastTimestamp.Time, e.EventTime.Time, e.FirstTimestamp.Time, e.CreationTimestamp.Time} {
		if !t.IsZero() {
			return t
		}
	}
	return time.Time{}
}

// Render writes the view for a terminal of 80 columns.
func Render(w io.Writer, v View) error {
	var b strings.Builder
	if len(v.Nodes) > 0 {
		fmt.Fprintf(&b, "    %-37s %7s %7s %7s\n", "tenant", "request", "limit", "used")
	}
	for _, n := range v.Nodes {
		state := "ready"
		if !n.Ready {
			state = "NOT READY for fractions"
		}
		fmt.Fprintf(&b, "%s  %d × %s %s  %s\n", clip(n.Name, 30), n.GPUs, clip(n.Model, 24), mib(n.MemoryMiB), state)
		for _, g := range n.Shared {
			fmt.Fprintf(&b, "  GPU %-20s %-12s free %8s of %s\n", clip(g.UUID, 20), g.Mode, mib(g.FreeMiB), mib(n.MemoryMiB))
			for _, t := range g.Tenants {
				portion := ""
				if t.Portion != "" {
					portion = "compute " + t.Portion
				}
				who := t.Pod
				if t.Claim {
					who = "claim " + who
				}
				if t.Resize != "" {
					portion = strings.TrimSpace(portion + "  " + t.Resize)
				}
				if t.Idle {
					portion = strings.TrimSpace(portion + "  idle")
				}
				if t.NearLimit {
					portion = strings.TrimSpace(portion + "  NEAR LIMIT")
				}
				if i := slices.Index(g.ReclaimOrder, t.Pod); i >= 0 && !t.Claim {
					// Above its request: where it stands should the GPU
					// run short of memory.
					portion = strings.TrimSpace(fmt.Sprintf("%s  reclaim #%d", portion, i+1))
				}
				line := fmt.Sprintf("    %-37s %7s %7s %7s  %s", clip(who, 37), mib(t.RequestMiB), mib(t.LimitMiB), used(t.Use), portion)
				b.WriteString(strings.TrimRight(line, " ") + "\n")
			}
		}
		for _, p := range n.Whole {
			fmt.Fprintf(&b, "  whole %-42s %d GPU(s)\n", clip(p.Pod, 42), p.GPUs)
		}
		fmt.Fprintf(&b, "  idle GPUs: %d\n", n.Idle)
	}
	s := v.Summary
	fmt.Fprintf(&b, "%d GPUs · allocated %.1f%% · fragmented %.1f%% of free · %d fraction(s) pending\n",
		s.GPUs, s.AllocationPct, s.FragmentationPct, s.Pending)
	_, err := io.WriteString(w, b.String())
	return err
}

// reclaimOrder is the order in which the node agent would stop a GPU's
// tenants were it short of memory (api.ReclaimOrder), by their last
// reading. A claim's share is left out: it is ordered by the pod that
// consumes it, which the view does not name.
func reclaimOrder(tenants []Tenant) []string {
	var bursts []api.Burst
	for _, t := range tenants {
		if !t.Claim && t.Use != nil && t.Use.UsedMiB != nil {
			bursts = append(bursts, api.Burst{Pod: t.Pod, Priority: t.Priority, RequestMiB: t.RequestMiB, UsedMiB: *t.Use.UsedMiB})
		}
	}
	var out []string
	for _, b := range api.ReclaimOrder(bursts) {
		out = append(out, b.Pod)
	}
	return out
}

// used prints a tenant's memory in use, "-" where unknown.
func used(u *api.PodGPUUsage) string {
	if u == nil || u.UsedMiB == nil {
		return "-"
	}
	return mib(*u.UsedMiB)
}

// mib prints MiB as GiB when it is a whole number of them.
func mib(v int64) string {
	if v != 0 && v%1024 == 0 {
		return fmt.Sprintf("%dGi", v/1024)
	}
	return fmt.Sprintf("%dMi", v)
}

// clip shortens s to n characters, marking the cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}
