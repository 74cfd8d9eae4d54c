package api

import (
	"fmt"
	"strconv"

	corev1 "k8s.io/api/core/v1"
)

// Inventory is what a node reports of its GPUs: the node agent's labels
// and the device plugin's allocatable count.
type Inventory struct {
	// Count is the GPUs the device plugin offers (allocatable nvidia.com/gpu).
	Count int
	// MemoryMiB is each GPU's memory.
	MemoryMiB int64
	Model     string
	// ReserveMiB is kept back on each GPU (LabelGPUMemoryReserve): what
	// shares divide is MemoryMiB − ReserveMiB.
	ReserveMiB int64
}

// SchedulableMiB is what shares of one GPU divide: its memory less the
// reserve.
func (inv Inventory) SchedulableMiB() int64 { return inv.MemoryMiB - inv.ReserveMiB }

// InventoryOf reads a node's GPU inventory. ready is whether the node
// takes fractional pods; when it does not, why says so in words that
// tell an operator what to check. A node without GPUs has a zero Count.
func InventoryOf(node *corev1.Node) (inv Inventory, ready bool, why string) {
	if q, ok := node.Status.Allocatable[ResourceGPU]; ok {
		inv.Count = int(q.Value())
	}
	inv.Model = node.Labels[LabelGPUProduct]
	if inv.Count <= 0 {
		return inv, false, fmt.Sprintf("node has no allocatable %s", ResourceGPU)
	}
	raw, ok := node.Labels[LabelGPUMemory]
	if !ok {
		return inv, false, fmt.Sprintf("node has no %s label: its GPU inventory is unknown (is the gpufrac node agent running?)", LabelGPUMemory)
	}
	mem, err := strconv.ParseInt(raw, 10, 64)
	if err != nil || mem <= 0 {
		return inv, false, fmt.Sprintf("node label %s=%q must be a positive number of MiB", LabelGPUMemory, raw)
	}
	inv.MemoryMiB = mem
	if raw, ok := node.Labels[LabelGPUMemoryReserve]; ok {
		reserve, err := strconv.ParseInt(raw, 10, 64)
		if err != nil || reserve < 0 || reserve >= mem {
			return inv, false, fmt.Sprintf("node label %s=%q must be a number of MiB from 0 to below the GPU's %d", LabelGPUMemoryReserve, raw, mem)
		}
		inv.ReserveMiB = reserve
	}
	if raw, ok := node.Labels[LabelGPUCount]; !ok {
		return inv, false, fmt.Sprintf("node has no %s label: its GPU inventory is unknown (is the gpufrac node agent running?)", LabelGPUCount)
	} else if n, err := strconv.Atoi(raw); err != nil || n <= 0 {
		return inv, false, fmt.Sprintf("node label %s=%q must be a positive count", LabelGPUCount, raw)
	} else if n < inv.Count {
		// The device plugin never offers GPUs the agent did not see; if
		// it does, trust the smaller figure.
		inv.Count = n
	}
	if inv.Model == "" {
		return inv, false, fmt.Sprintf("node has no %s label: its GPU inventory is unknown (is the gpufrac node agent running?)", LabelGPUProduct)
	}
	if by, closed := FractionsClosed(node.Labels); closed {
		return inv, false, fmt.Sprintf("node is closed to new fractions (label %s=%s): its shares are being drained, e.g. for a replacement of its MPS daemon (gpufrac mps-replace)", LabelFractionsClosed, by)
	}
	for _, c := range node.Status.Conditions {
		if c.Type != ConditionFractioningReady {
			continue
		}
		if c.Status == corev1.ConditionTrue {
			return inv, true, ""
		}
		return inv, false, fmt.Sprintf("node condition %s is %s (%s: %s)", ConditionFractioningReady, c.Status, c.Reason, c.Message)
	}
	return inv, false, fmt.Sprintf("node does not report the condition %s (is the gpufrac node agent running?)", ConditionFractioningReady)
}

// StandingGPUs is how many GPUs a node asks to have held for shares
// (LabelStandingGPUs): at most its count of GPUs; 0 when the label is
// absent or not a count (a label the scheduler cannot read holds nothing:
// the node's driver then offers no GPU, so nothing is over-committed).
func StandingGPUs(node *corev1.Node, count int) int {
	n, err := strconv.Atoi(node.Labels[LabelStandingGPUs])
	if err != nil || n < 0 {
		return 0
	}
	return min(n, max(count, 0))
}
