package api

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestInventoryOf(t *testing.T) {
	node := func(allocatable string, labels map[string]string, cond corev1.ConditionStatus) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: labels}}
		if allocatable != "" {
			n.Status.Allocatable = corev1.ResourceList{ResourceGPU: resource.MustParse(allocatable)}
		}
		if cond != "" {
			n.Status.Conditions = []corev1.NodeCondition{{Type: ConditionFractioningReady, Status: cond, Reason: "NoDriver", Message: "driver 550"}}
		}
		return n
	}
	full := func() map[string]string {
		return map[string]string{LabelGPUMemory: "81559", LabelGPUCount: "8", LabelGPUProduct: "NVIDIA-H100-80GB-HBM3"}
	}
	without := func(key string) map[string]string { l := full(); delete(l, key); return l }
	with := func(key, value string) map[string]string { l := full(); l[key] = value; return l }
	h100 := Inventory{Count: 8, MemoryMiB: 81559, Model: "NVIDIA-H100-80GB-HBM3"}
	for _, tt := range []struct {
		name      string
		node      *corev1.Node
		wantInv   Inventory
		wantReady bool
		wantWhy   string
	}{
		{"ready", node("8", full(), corev1.ConditionTrue), h100, true, ""},
		{"the device plugin offers fewer than the agent saw", node("6", full(), corev1.ConditionTrue), Inventory{Count: 6, MemoryMiB: 81559, Model: h100.Model}, true, ""},
		{"the device plugin offers more than the agent saw", node("9", full(), corev1.ConditionTrue), h100, true, ""},
		{"no GPUs", node("", full(), corev1.ConditionTrue), Inventory{Model: h100.Model}, false, "node has no allocatable nvidia.com/gpu"},
		{"no memory label", node("8", without(LabelGPUMemory), corev1.ConditionTrue), Inventory{Count: 8, Model: h100.Model}, false,
			"node has no nvidia.com/gpu.memory label: its GPU inventory is unknown (is the gpufrac node agent running?)"},
		{"memory not a number", node("8", with(LabelGPUMemory, "80Gi"), corev1.ConditionTrue), Inventory{Count: 8, Model: h100.Model}, false,
			`node label nvidia.com/gpu.memory="80Gi" must be a positive number of MiB`},
		{"count not positive", node("8", with(LabelGPUCount, "0"), corev1.ConditionTrue), Inventory{Count: 8, MemoryMiB: 81559, Model: h100.Model}, false,
			`node label nvidia.com/gpu.count="0" must be a positive count`},
		{"the node's reserve", node("8", with(LabelGPUMemoryReserve, "1024"), corev1.ConditionTrue), Inventory{Count: 8, MemoryMiB: 81559, Model: h100.Model, ReserveMiB: 1024}, true, ""},
		{"a reserve that is not a number", node("8", with(LabelGPUMemoryReserve, "1Gi"), corev1.ConditionTrue), Inventory{Count: 8, MemoryMiB: 81559, Model: h100.Model}, false,
			`node label gpufrac.io/gpu-memory-reserve-mib="1Gi" must be a number of MiB from 0 to below the GPU's 81559`},
		{"a reserve of the whole GPU", node("8", with(LabelGPUMemoryReserve, "81559"), corev1.ConditionTrue), Inventory{Count: 8, MemoryMiB: 81559, Model: h100.Model}, false,
			`node label gpufrac.io/gpu-memory-reserve-mib="81559" must be a number of MiB from 0 to below the GPU's 81559`},
		{"not ready", node("8", full(), corev1.ConditionFalse), h100, false,
			"node condition gpu-fractioning.nvidia.com/Ready is False (NoDriver: driver 550)"},
		{"closed to new fractions, ready otherwise", node("8", with(LabelFractionsClosed, "mps-replace"), corev1.ConditionTrue), h100, false,
			"node is closed to new fractions (label gpufrac.io/fractions-closed=mps-replace): its shares are being drained, e.g. for a replacement of its MPS daemon (gpufrac mps-replace)"},
		{"no condition", node("8", full(), ""), h100, false,
			"node does not report the condition gpu-fractioning.nvidia.com/Ready (is the gpufrac node agent running?)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			inv, ready, why := InventoryOf(tt.node)
			if inv != tt.wantInv || ready != tt.wantReady || why != tt.wantWhy {
				t.Errorf("InventoryOf = %+v, %v, %q\n want %+v, %v, %q", inv, ready, why, tt.wantInv, tt.wantReady, tt.wantWhy)
			}
		})
	}
}
