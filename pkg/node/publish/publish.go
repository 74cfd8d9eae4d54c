// Package publish tells the cluster what a node can do for GPU fractions:
// the readiness condition the scheduler waits for, the GPU inventory
// labels, and the enforcement the node is capable of. What to publish is a
// pure function of the agent's state; Apply writes it.
package publish

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"regexp"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// ConditionReady is the node condition schedulers read (KAI's key).
const ConditionReady corev1.NodeConditionType = api.ConditionFractioningReady

// Labels. The nvidia.com/gpu.* ones are GPU Feature Discovery's: the agent
// sets them only with --publish-gpu-labels and only where GFD has not.
const (
	LabelDriverVersion  = "gpufrac.io/driver-version"
	LabelCUDAVersion    = "gpufrac.io/cuda-version"
	LabelInventoryOwner = "gpufrac.io/gpu-labels" // "agent" when the agent wrote nvidia.com/gpu.*
)

// Reasons of the Ready condition.
const (
	ReasonReady         = "EnforcementAvailable"
	ReasonFailOpen      = "FailOpen"
	ReasonNVMLError     = "NVMLUnavailable"
	ReasonNoGPUs        = "NoGPUs"
	ReasonNRI           = "NRIPluginNotRegistered"
	ReasonNoEnforcement = "NoMemoryEnforcement"
	ReasonBackend       = "MemoryLimitsUnavailable"
	ReasonMixedGPUs     = "MixedGPUModels"
	ReasonMIG           = "MIGEnabled"
	ReasonMPS           = "MPSDaemonUnavailable"
	ReasonCgroup        = "CgroupUnsupported"
	ReasonComputeMode   = "ComputeModeNotExclusive"
	ReasonState         = "AgentStateUnreadable"
	// ReasonStarting and ReasonStopped are the agent's own, outside a
	// resync: just started, and stopped in order.
	ReasonStarting = "AgentStarting"
	ReasonStopped  = "AgentStopped"
	// ReasonClosed: the node carries api.LabelFractionsClosed.
	ReasonClosed = "ClosedToFractions"
)

// State is what the agent knows about its node.
type State struct {
	Inventory    inventory.Inventory
	InventoryErr error
	// NRIRegistered: the runtime has accepted the NRI plugin.
	NRIRegistered bool
	// Backend is the memory-limit backend in effect; BackendErr says why
	// the one the operator asked for cannot be used.
	Backend    nodeapi.Backend
	BackendErr error
	// MPS is the interface of the node's MPS daemon; MPSErr says why it
	// cannot serve (down, wedged, the wrong interface), which makes the
	// node not ready: every fractional container must be its client.
	MPS    nodeapi.MPS
	MPSErr error
	// CgroupErr says why the driver's per-cgroup limits cannot work here
	// (cgroup v1, no dmem or misc controller), for the backends that set
	// them.
	CgroupErr error
	// ComputeModeErr says why a GPU the node shares through MPS is not in
	// EXCLUSIVE_PROCESS (package exclusive): a process outside MPS could
	// use it past every share.
	ComputeModeErr error
	// StateErr says which of the agent's state files cannot be read (and
	// what to do): what it enforced is unknown, so it takes no fractions.
	StateErr error
	// FailOpen: the operator lets unenforceable containers run without a GPU.
	FailOpen bool
	// PublishGPULabels: write nvidia.com/gpu.* where GFD has not.
	PublishGPULabels bool
	// StandingGPUs is how many GPUs the node asks to have held for shares
	// (its DRA driver's); 0 removes the label.
	StandingGPUs int
	// ReserveMiB is the memory kept back on each GPU, published for every
	// reader of the node's GPUs (api.LabelGPUMemoryReserve).
	ReserveMiB int64
	// Heartbeat is how long the agent may go unheard before schedulers
	// stop sending fractions here (api.LabelAgentHeartbeat).
	Heartbeat time.Duration
	// ReservationNamespace is where the agent finds the reservation pods,
	// published for every other reader (api.LabelReservationNamespace).
	ReservationNamespace string
}

// Desired is what the node should carry.
type Desired struct {
	Condition corev1.NodeCondition
	// Labels to set; a nil value removes the label.
	Labels map[string]*string
}

// Compute decides the condition and labels for state, given the labels the
// node has now (to leave GPU Feature Discovery's alone).
func Compute(s State, current map[string]string) Desired {
	status, reason, message := readiness(s)
	if by, closed := api.FractionsClosed(current); closed && status == corev1.ConditionTrue {
		status, reason, message = corev1.ConditionFalse, ReasonClosed, fmt.Sprintf("closed to new fractions (label %s=%s) while its shares are drained; running shares keep their enforcement", api.LabelFractionsClosed, by)
	}
	d := Desired{
		Condition: corev1.NodeCondition{Type: ConditionReady, Status: status, Reason: reason, Message: message},
		Labels:    map[string]*string{},
	}
	report := api.NodeReport{Enforcement: "none", Standing: s.StandingGPUs, ReserveMiB: s.ReserveMiB, Heartbeat: s.Heartbeat, ReservationNamespace: s.ReservationNamespace}
	if s.InventoryErr == nil {
		d.Labels[LabelDriverVersion] = ptr(labelValue(s.Inventory.DriverVersion))
		d.Labels[LabelCUDAVersion] = ptr(s.Inventory.CUDAVersion())
		if s.Backend != "" && s.Backend != nodeapi.BackendOff {
			report.Enforcement = string(s.Backend)
		}
	}
	gfdOwned := api.InventoryLabelled(current) && current[LabelInventoryOwner] != "agent"
	if s.PublishGPULabels && !gfdOwned && s.InventoryErr == nil && len(s.Inventory.GPUs) > 0 {
		g := s.Inventory.GPUs[0]
		report.Inventory = api.Inventory{Count: len(s.Inventory.GPUs), MemoryMiB: g.MemoryMiB, Model: labelValue(g.Product)}
		d.Labels[LabelInventoryOwner] = ptr("agent")
	}
	maps.Copy(d.Labels, report.Labels())
	return d
}

func readiness(s State) (corev1.ConditionStatus, string, string) {
	switch {
	case s.StateErr != nil:
		// Not even failing open: the agent does not know what it
		// enforced, nor what it must release.
		return corev1.ConditionFalse, ReasonState, "the node agent cannot read its state, so it takes no fractions: " + s.StateErr.Error() + "; then restart the agent (delete its pod)"
	case s.InventoryErr != nil:
		return corev1.ConditionFalse, ReasonNVMLError, "cannot read the GPUs: " + s.InventoryErr.Error()
	case len(s.Inventory.GPUs) == 0:
		return corev1.ConditionFalse, ReasonNoGPUs, "NVML reports no GPUs on this node"
	case mixedModels(s.Inventory.GPUs):
		return corev1.ConditionFalse, ReasonMixedGPUs, "the GPUs differ in model or memory, which the per-node inventory labels cannot describe"
	case s.Inventory.MIGEnabled() >= 0:
		// Not even with fail-open: a fraction of a MIG-split GPU's memory is
		// not there to give.
		return corev1.ConditionFalse, ReasonMIG, fmt.Sprintf("GPU %d has MIG enabled: gpufrac shares whole GPUs and MPS v3 memory partitioning does not support MIG; disable MIG on this node's GPUs, or keep fractions off it", s.Inventory.MIGEnabled())
	case !s.NRIRegistered:
		return corev1.ConditionFalse, ReasonNRI, "the gpufrac NRI plugin is not registered with the container runtime, so limits cannot be injected"
	}
	versions := fmt.Sprintf("driver %s, CUDA %s, MPS %s", s.Inventory.DriverVersion, s.Inventory.CUDAVersion(), mpsName(s.MPS))
	switch {
	case (s.Backend == nodeapi.BackendOff || s.Backend == "") && s.FailOpen:
		return corev1.ConditionTrue, ReasonFailOpen, "no memory enforcement in effect; fail-open is configured, so fractional containers run without a GPU"
	case s.BackendErr != nil:
		return corev1.ConditionFalse, ReasonBackend, s.BackendErr.Error()
	case s.Backend == nodeapi.BackendOff || s.Backend == "":
		return corev1.ConditionFalse, ReasonNoEnforcement, "no GPU memory enforcement is in effect on this node (" + versions + ")"
	// Not even failing open: these would start containers whose limits
	// look set and are not.
	case s.MPSErr != nil:
		return corev1.ConditionFalse, ReasonMPS, "every fractional container is a client of the node's MPS daemon (memacct guarantees its request, the server applies its pinned limit), and the daemon is unavailable: " + s.MPSErr.Error()
	case s.CgroupErr != nil:
		return corev1.ConditionFalse, ReasonCgroup, s.CgroupErr.Error()
	case s.ComputeModeErr != nil:
		return corev1.ConditionFalse, ReasonComputeMode, s.ComputeModeErr.Error() + "; fractions are refused until the node agent can set it (it needs root and the GPUs' device nodes; --exclusive-process=false turns this off)"
	case s.Backend == nodeapi.BackendMPSPinned:
		return corev1.ConditionTrue, ReasonReady, "memory limits: MPS pinned-memory limits only (" + versions +
			"; driver enforcement needs r615 and CUDA 13.4); a process can bypass them"
	case s.Backend == nodeapi.BackendToolkit:
		return corev1.ConditionTrue, ReasonReady, "memory limits: driver-enforced per container by NVIDIA Container Toolkit's CDI hook (" + versions + ")"
	}
	return corev1.ConditionTrue, ReasonReady, "memory limits: driver-enforced per container by the gpufrac hook (" + versions + ")"
}

func mpsName(m nodeapi.MPS) string {
	if m == nodeapi.MPSNone {
		return "none"
	}
	return string(m)
}

func mixedModels(gpus []inventory.GPU) bool {
	for _, g := range gpus[1:] {
		if g.Product != gpus[0].Product || g.MemoryMiB != gpus[0].MemoryMiB {
			return true
		}
	}
	return false
}

var (
	labelUnsafe = regexp.MustCompile(`[^A-Za-z0-9._-]+`)
	labelEnds   = regexp.MustCompile(`^[^A-Za-z0-9]+|[^A-Za-z0-9]+$`)
)

// ProductLabel is a GPU's product name as GPU Feature Discovery labels it
// (nvidia.com/gpu.product).
func ProductLabel(product string) string { return labelValue(product) }

// labelValue turns a product name into a valid label value the way GPU
// Feature Discovery does ("NVIDIA H100 80GB HBM3" → "NVIDIA-H100-80GB-HBM3").
func labelValue(s string) string {
	v := labelUnsafe.ReplaceAllString(s, "-")
	if len(v) > 63 {
		v = v[:63]
	}
	return labelEnds.ReplaceAllString(v, "")
}

func ptr(s string) *string { return &s }

// Apply writes d onto node (as the caller just read it, so it is not read
// twice): labels with a merge patch, the condition through the status
// subresource. The condition's transition time moves only when its status
// changes.
func Apply(ctx context.Context, client kubernetes.Interface, node *corev1.Node, d Desired) error {
	name := node.Name
	labels := map[string]*string{}
	for k, v := range d.Labels {
		if cur, ok := node.Labels[k]; (v == nil && ok) || (v != nil && cur != *v) {
			labels[k] = v
		}
	}
	if len(labels) > 0 {
		patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": labels}})
		if err != nil {
			return err
		}
		if _, err := client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("label node %s: %w", name, err)
		}
	}
	now := metav1.Now()
	cond := d.Condition
	cond.LastHeartbeatTime, cond.LastTransitionTime = now, now
	for _, c := range node.Status.Conditions {
		if c.Type == cond.Type && c.Status == cond.Status {
			cond.LastTransitionTime = c.LastTransitionTime
		}
	}
	// A strategic merge patch on conditions merges by type, so other
	// components' conditions stay as they are; on capacity and allocatable
	// by resource, so the kubelet's stay too (and it keeps ours: it only
	// sets what it manages). The quota charge is advertised with the
	// heartbeat, so a node re-created without it has it again at once.
	charge := api.ChargeCapacityList()
	patch, err := json.Marshal(map[string]any{"status": map[string]any{
		"conditions": []corev1.NodeCondition{cond}, "capacity": charge, "allocatable": charge}})
	if err != nil {
		return err
	}
	if _, err := client.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("set condition %s on node %s: %w", ConditionReady, name, err)
	}
	return nil
}

// ApplyAnnotations sets annotations on node (as the caller read it; a nil
// value removes one) with a merge patch of their own, apart from Apply's:
// a refused annotation (the tenants' use, api.UsageAnnotation) must never
// keep the node's labels or heartbeat from being written.
func ApplyAnnotations(ctx context.Context, client kubernetes.Interface, node *corev1.Node, annotations map[string]*string) error {
	changed := map[string]*string{}
	for k, v := range annotations {
		if cur, ok := node.Annotations[k]; (v == nil && ok) || (v != nil && cur != *v) {
			changed[k] = v
		}
	}
	if len(changed) == 0 {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": changed}})
	if err != nil {
		return err
	}
	if _, err := client.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("annotate node %s: %w", node.Name, err)
	}
	return nil
}
