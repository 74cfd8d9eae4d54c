package publish

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func gpus(n int, product string, mib int64) []inventory.GPU {
	out := make([]inventory.GPU, n)
	for i := range out {
		out[i] = inventory.GPU{Index: i, UUID: "GPU-" + string(rune('a'+i)), Product: product, MemoryMiB: mib}
	}
	return out
}

func TestCompute(t *testing.T) {
	h100 := inventory.Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13040, GPUs: gpus(8, "NVIDIA H100 80GB HBM3", 81920)}
	old := inventory.Inventory{DriverVersion: "550.54.15", CUDADriverVersion: 12040, GPUs: gpus(2, "NVIDIA A100-SXM4-40GB", 40960)}
	tests := []struct {
		name       string
		state      State
		current    map[string]string
		wantStatus corev1.ConditionStatus
		wantReason string
		wantLabels map[string]string // nil-valued entries are not expected
	}{
		{"driver enforcement, labels published", State{Inventory: h100, Backend: nodeapi.BackendDriver, NRIRegistered: true, PublishGPULabels: true}, nil,
			corev1.ConditionTrue, ReasonReady, map[string]string{
				LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver",
				api.LabelGPUCount: "8", api.LabelGPUMemory: "81920", api.LabelGPUProduct: "NVIDIA-H100-80GB-HBM3", LabelInventoryOwner: "agent"}},
		{"GFD's labels left alone", State{Inventory: h100, Backend: nodeapi.BackendDriver, NRIRegistered: true, PublishGPULabels: true}, map[string]string{api.LabelGPUProduct: "NVIDIA-H100-80GB-HBM3"},
			corev1.ConditionTrue, ReasonReady, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"older driver: weak MPS limits", State{Inventory: old, Backend: nodeapi.BackendMPSPinned, NRIRegistered: true}, nil,
			corev1.ConditionTrue, ReasonReady, map[string]string{LabelDriverVersion: "550.54.15", LabelCUDAVersion: "12.4", api.LabelMemoryEnforcement: "mps-pinned"}},
		{"NRI plugin not registered", State{Inventory: h100, Backend: nodeapi.BackendDriver}, nil,
			corev1.ConditionFalse, ReasonNRI, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"NVML fails", State{InventoryErr: errors.New("nvmlInit: ERROR_LIBRARY_NOT_FOUND"), NRIRegistered: true, PublishGPULabels: true}, nil,
			corev1.ConditionFalse, ReasonNVMLError, map[string]string{api.LabelMemoryEnforcement: "none"}},
		{"no GPUs even with fail-open", State{Inventory: inventory.Inventory{DriverVersion: "615.1", CUDADriverVersion: 13040}, NRIRegistered: true, FailOpen: true}, nil,
			corev1.ConditionFalse, ReasonNoGPUs, map[string]string{LabelDriverVersion: "615.1", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "none"}},
		{"mixed models", State{Inventory: inventory.Inventory{DriverVersion: "615.1", CUDADriverVersion: 13040,
			GPUs: append(gpus(1, "A", 1), gpus(1, "B", 2)...)}, Backend: nodeapi.BackendDriver, NRIRegistered: true}, nil,
			corev1.ConditionFalse, ReasonMixedGPUs, map[string]string{LabelDriverVersion: "615.1", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"MIG on a GPU, even failing open", State{Inventory: inventory.Inventory{DriverVersion: "615.10.02", CUDADriverVersion: 13040,
			GPUs: append(gpus(1, "NVIDIA H100 80GB HBM3", 81920), inventory.GPU{Index: 1, UUID: "GPU-m", Product: "NVIDIA H100 80GB HBM3", MemoryMiB: 81920, MIGEnabled: true})},
			Backend: nodeapi.BackendOff, NRIRegistered: true, FailOpen: true}, nil,
			corev1.ConditionFalse, ReasonMIG, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "none"}},
		{"toolkit backend", State{Inventory: h100, Backend: nodeapi.BackendToolkit, NRIRegistered: true}, nil,
			corev1.ConditionTrue, ReasonReady, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "toolkit"}},
		{"driver asked for on an old driver", State{Inventory: old, Backend: nodeapi.BackendOff, BackendErr: errors.New("--memory-limits=driver needs r615"), NRIRegistered: true}, nil,
			corev1.ConditionFalse, ReasonBackend, map[string]string{LabelDriverVersion: "550.54.15", LabelCUDAVersion: "12.4", api.LabelMemoryEnforcement: "none"}},
		{"MPS daemon down, even failing open", State{Inventory: h100, Backend: nodeapi.BackendDriver, NRIRegistered: true, FailOpen: true,
			MPSErr: errors.New("the MPS control daemon does not answer")}, nil,
			corev1.ConditionFalse, ReasonMPS, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"cgroup v1", State{Inventory: h100, Backend: nodeapi.BackendDriver, MPS: nodeapi.MPSv3, NRIRegistered: true,
			CgroupErr: errors.New("cgroup v1: driver memory limits need cgroup v2")}, nil,
			corev1.ConditionFalse, ReasonCgroup, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"a shared GPU not exclusive, even failing open", State{Inventory: old, Backend: nodeapi.BackendMPSPinned, MPS: nodeapi.MPSv2, NRIRegistered: true, FailOpen: true,
			ComputeModeErr: errors.New("GPU GPU-a is not in EXCLUSIVE_PROCESS (ERROR_NO_PERMISSION)")}, nil,
			corev1.ConditionFalse, ReasonComputeMode, map[string]string{LabelDriverVersion: "550.54.15", LabelCUDAVersion: "12.4", api.LabelMemoryEnforcement: "mps-pinned"}},
		{"state unreadable, even failing open", State{Inventory: h100, Backend: nodeapi.BackendUnset, MPS: nodeapi.MPSv3, NRIRegistered: true, FailOpen: true,
			StateErr: errors.New("GPU memory leases /var/lib/gpufrac/leases.json are corrupt")}, nil,
			corev1.ConditionFalse, ReasonState, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "none"}},
		{"enforcement off", State{Inventory: h100, Backend: nodeapi.BackendOff, NRIRegistered: true}, nil,
			corev1.ConditionFalse, ReasonNoEnforcement, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "none"}},
		{"the reserve is published", State{Inventory: h100, Backend: nodeapi.BackendDriver, NRIRegistered: true, ReserveMiB: 1024}, nil,
			corev1.ConditionTrue, ReasonReady, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver", api.LabelGPUMemoryReserve: "1024"}},
		{"the heartbeat bound is published", State{Inventory: h100, Backend: nodeapi.BackendDriver, NRIRegistered: true, Heartbeat: 90 * time.Second}, nil,
			corev1.ConditionTrue, ReasonReady, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver", api.LabelGPUMemoryReserve: "0", api.LabelAgentHeartbeat: "90"}},
		{"closed to new fractions: not ready for other schedulers", State{Inventory: h100, Backend: nodeapi.BackendDriver, NRIRegistered: true}, map[string]string{api.LabelFractionsClosed: "mps-replace"},
			corev1.ConditionFalse, ReasonClosed, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"closed, and not ready for a reason of its own: that reason", State{Inventory: h100, Backend: nodeapi.BackendDriver}, map[string]string{api.LabelFractionsClosed: "mps-replace"},
			corev1.ConditionFalse, ReasonNRI, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "driver"}},
		{"enforcement off, failing open", State{Inventory: h100, Backend: nodeapi.BackendOff, NRIRegistered: true, FailOpen: true}, nil,
			corev1.ConditionTrue, ReasonFailOpen, map[string]string{LabelDriverVersion: "615.10.02", LabelCUDAVersion: "13.4", api.LabelMemoryEnforcement: "none"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := Compute(tt.state, tt.current)
			if d.Condition.Type != ConditionReady || d.Condition.Status != tt.wantStatus || d.Condition.Reason != tt.wantReason || d.Condition.Message == "" {
				t.Errorf("condition = %+v, want %s/%s", d.Condition, tt.wantStatus, tt.wantReason)
			}
			got := map[string]string{}
			for k, v := range d.Labels {
				if v != nil {
					got[k] = *v
				}
			}
			if _, set := tt.wantLabels[api.LabelGPUMemoryReserve]; !set {
				// Every node publishes its reserve, 0 when none is set.
				tt.wantLabels[api.LabelGPUMemoryReserve] = "0"
			}
			if diff := cmp.Diff(tt.wantLabels, got); diff != "" {
				t.Errorf("labels (-want +got):\n%s", diff)
			}
		})
	}
}

func TestLabelValue(t *testing.T) {
	for in, want := range map[string]string{
		"NVIDIA H100 80GB HBM3":   "NVIDIA-H100-80GB-HBM3",
		"Mock NVIDIA A100 (40GB)": "Mock-NVIDIA-A100-40GB",
		"  weird__":               "weird",
	} {
		if got := labelValue(in); got != want {
			t.Errorf("labelValue(%q) = %q, want %q", in, got, want)
		}
	}
}
