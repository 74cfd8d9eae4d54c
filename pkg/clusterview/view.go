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

	corev1 "k8s.io/api/core/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// View is the whole cluster.
type View struct {
	Nodes   []Node  `json:"nodes"`
	Summary Summary `json:"summary"`
}

// Node is one node with GPUs.
type Node struct {
	Name      string `json:"name"`
	Model     string `json:"model"`
	GPUs      int    `json:"gpus"`
	MemoryMiB int64  `json:"memoryMiB"`
	// Ready is whether it takes fractions (gpu-fractioning.nvidia.com/Ready).
	Ready bool `json:"ready"`
	// Shared are the GPUs fractions share, by UUID.
	Shared []GPU `json:"shared"`
	// Whole are the pods that hold whole GPUs.
	Whole []WholePod `json:"whole"`
	// Idle is how many GPUs nobody holds.
	Idle int `json:"idle"`
}

// GPU is a shared GPU.
type GPU struct {
	UUID    string          `json:"uuid"`
	Mode    api.ComputeMode `json:"mode"`
	Tenants []Tenant        `json:"tenants"`
	// FreeMiB is the schedulable memory (total − the scheduler's reserve)
	// no tenant's request holds: what the scheduler would still place.
	FreeMiB int64 `json:"freeMiB"`
}

// Tenant is a fractional pod on a GPU.
type Tenant struct {
	Pod        string `json:"pod"` // namespace/name
	RequestMiB int64  `json:"requestMiB"`
	LimitMiB   int64  `json:"limitMiB"`
	// Portion is the sm-sharing compute share ("" for time-slicing).
	Portion string `json:"portion,omitempty"`
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
}

// Build makes the view from nodes and pods, read into ledgers as the
// scheduler reads them (package ledgers): reservationNamespace holds the
// reservation pods, which tell which GPU a group shares, and reserve is
// the per-GPU memory the scheduler keeps back (by model; nil for none), so
// that free memory is what the scheduler would still place.
func Build(nodes []corev1.Node, pods []corev1.Pod, reservationNamespace string, reserve func(model string) int64) View {
	var v View
	c := ledgers.Build(nodes, pods, ledgers.Options{ReservationNamespace: reservationNamespace, Reserve: reserve})
	for i := range pods {
		p := &pods[i]
		if p.Spec.NodeName == "" && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			if reqs, err := api.Parse(api.Intent(p)); err == nil && len(reqs) > 0 {
				v.Summary.Pending++
			}
		}
	}
	var held, total, free, stranded int64
	for _, ln := range c.Nodes {
		n := Node{Name: ln.Name, Model: ln.Inventory.Model, GPUs: ln.Inventory.Count, MemoryMiB: ln.Inventory.MemoryMiB, Ready: ln.Ready}
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
					g := GPU{UUID: ln.UUID(slot), Mode: d.Mode(), FreeMiB: d.Free()}
					if g.UUID == "" {
						g.UUID = fmt.Sprintf("GPU %d", slot)
					}
					for key := range shares {
						t := ln.Tenants[key]
						tenant := Tenant{Pod: t.Pod, RequestMiB: shares[key].Request, LimitMiB: shares[key].Limit}
						if a := t.Assignment; a != nil && a.Mode == api.SMSharing && !a.Portion.IsZero() {
							tenant.Portion = a.Portion.String()
						}
						g.Tenants = append(g.Tenants, tenant)
					}
					slices.SortFunc(g.Tenants, func(a, b Tenant) int { return strings.Compare(a.Pod, b.Pod) })
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
	if total > 0 {
		v.Summary.AllocationPct = round1(float64(held) * 100 / float64(total))
	}
	if free > 0 {
		v.Summary.FragmentationPct = round1(float64(stranded) * 100 / float64(free))
	}
	return v
}

func round1(x float64) float64 { return float64(int64(x*10+0.5)) / 10 }

// Render writes the view for a terminal of 80 columns.
func Render(w io.Writer, v View) error {
	var b strings.Builder
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
				fmt.Fprintf(&b, "    %-38s %8s %8s  %s\n", clip(t.Pod, 38), mib(t.RequestMiB), mib(t.LimitMiB), portion)
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
