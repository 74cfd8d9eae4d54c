package api

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// This file is the codec of everything the scheduler side and the node
// side tell each other through the API beyond the user's request: the
// decision on a tenant pod, the reservation pods' labels and annotations,
// and the node's report of its GPUs. Each key is encoded by one function
// and decoded by one function here (contract_test.go lists them); code
// outside this package never indexes an object's annotations or labels
// with one of these keys, it calls these functions.

// Write is a typed change to an object's annotations or labels: keys set
// to values, and keys removed. It is what the writers of the contract
// return instead of a merge patch, where a nil value means "remove".
type Write struct {
	Set    map[string]string
	Remove []string
}

// MergePatch is the write as the value of a JSON merge patch's
// metadata.annotations (or metadata.labels): removals as nulls.
func (w Write) MergePatch() map[string]any {
	out := make(map[string]any, len(w.Set)+len(w.Remove))
	for _, k := range w.Remove {
		out[k] = nil
	}
	for k, v := range w.Set {
		out[k] = v
	}
	return out
}

// Additive is the write as a Binding can carry it (a Binding's metadata
// can only add and overwrite keys), or false when it must remove a key
// that current holds.
func (w Write) Additive(current map[string]string) (map[string]string, bool) {
	for _, k := range w.Remove {
		if _, present := current[k]; present {
			return nil, false
		}
	}
	return maps.Clone(w.Set), true
}

// Apply returns current with the write applied (current is not changed).
func (w Write) Apply(current map[string]string) map[string]string {
	out := maps.Clone(current)
	if out == nil {
		out = map[string]string{}
	}
	for _, k := range w.Remove {
		delete(out, k)
	}
	maps.Copy(out, w.Set)
	return out
}

// Decision is what gpufrac's scheduler writes on a fractional pod it
// places (SPEC §2): the container's Assignment as every node side reads
// it, and its own bookkeeping: the GPU groups, one per device, and which
// memory keys the decision added (so that Intent can take them away
// again).
type Decision struct {
	Assignment Assignment
	Groups     []string
}

// Write is the decision as the pod's annotations and labels change with
// it, given the annotations the pod has now. A stale compute portion is
// removed when the mode is time-slicing; the GPU-group label is set for a
// pod of one GPU and removed otherwise.
func (d Decision) Write(current map[string]string) (annotations, labels Write) {
	annotations.Set = d.Assignment.Annotations()
	annotations.Set[GPUGroupsAnnotation] = strings.Join(d.Groups, ",")
	annotations.Set[ResolvedKeysAnnotation] = ResolvedMemoryKeys(current, d.Assignment.Container, current[ResolvedKeysAnnotation])
	if portion := ContainerKey(d.Assignment.Container, SuffixComputePortion); annotations.Set[portion] == "" {
		annotations.Remove = []string{portion}
	}
	if len(d.Groups) == 1 {
		labels.Set = map[string]string{GPUGroupLabel: d.Groups[0]}
	} else {
		labels.Remove = []string{GPUGroupLabel}
	}
	return annotations, labels
}

// DecisionGroups reads the GPU groups gpufrac's scheduler wrote with a
// decision (GPUGroupsAnnotation), one per device; nil when it wrote none
// (another scheduler's decision).
func DecisionGroups(annotations map[string]string) []string {
	return SplitList(annotations[GPUGroupsAnnotation])
}

// HasDecision says whether a scheduler has written devices on the pod.
func HasDecision(annotations map[string]string) bool {
	return HasContainerKey(annotations, SuffixDevices)
}

// IsDecisionKey reports whether key is one a scheduler writes with its
// decision: a container's devices or compute portion, or gpufrac's
// bookkeeping (GPU groups, resolved keys).
func IsDecisionKey(key string) bool {
	return IsSchedulerOwned(key) || key == GPUGroupsAnnotation || key == ResolvedKeysAnnotation
}

// IsGroupsKey reports whether key is GPUGroupsAnnotation, which people
// read beside the fraction keys to see which GPU a pod shares.
func IsGroupsKey(key string) bool { return key == GPUGroupsAnnotation }

// Reservation is a reservation pod as the contract describes it: the GPU
// group it holds, whether it is a standing one, the GPU the node agent
// found the device plugin gave it, and (standing pods) what annotation
// shares hold of that GPU, as the scheduler last wrote it.
type Reservation struct {
	Group    string
	Standing bool
	// GPU is the UUID the node agent wrote (ReservedGPUAnnotation); "" until then.
	GPU string
	// Held is SharesHeldAnnotation's raw value; HeldSet says whether the
	// pod carries it at all.
	Held    string
	HeldSet bool
}

// ReservationLabels are the contract's labels of a reservation pod of a
// GPU group: the group, and the standing mark for a standing one.
func ReservationLabels(group string, standing bool) map[string]string {
	labels := map[string]string{GPUGroupLabel: group}
	if standing {
		labels[StandingLabel] = "true"
	}
	return labels
}

// ReservationOf reads a pod as a reservation pod; ok is false for a pod
// that names no GPU group (its other fields are read all the same). The
// caller decides which namespace's pods are reservation pods.
func ReservationOf(pod *corev1.Pod) (r Reservation, ok bool) {
	r.Group = pod.Labels[GPUGroupLabel]
	r.Standing = pod.Labels[StandingLabel] == "true"
	r.GPU = pod.Annotations[ReservedGPUAnnotation]
	r.Held, r.HeldSet = pod.Annotations[SharesHeldAnnotation]
	return r, r.Group != ""
}

// ReservedGPUWrite is what the node agent writes on a reservation pod
// once it knows the GPU the device plugin gave it.
func ReservedGPUWrite(uuid string) Write {
	return Write{Set: map[string]string{ReservedGPUAnnotation: uuid}}
}

// Write is what the scheduler writes on a standing reservation pod to say
// what annotation shares hold of its GPU.
func (h SharesHeld) Write() Write {
	return Write{Set: map[string]string{SharesHeldAnnotation: h.String()}}
}

// NodeReport is what a node agent reports of its node on the Node object:
// GPU Feature Discovery's inventory labels (where GFD does not), the
// memory-limit backend in effect, the GPUs it asks to have held for
// shares, and the memory kept back on each GPU. InventoryOf reads it.
type NodeReport struct {
	// Inventory is written only when set (Count > 0): GFD may own it.
	Inventory Inventory
	// Enforcement is the backend's name (LabelMemoryEnforcement).
	Enforcement string
	// Standing is LabelStandingGPUs; 0 removes the label.
	Standing int
	// ReserveMiB is LabelGPUMemoryReserve: what every reader of the
	// node's GPUs keeps back on each. Always written.
	ReserveMiB int64
	// Heartbeat is LabelAgentHeartbeat, whole seconds; 0 removes it.
	Heartbeat time.Duration
	// ReservationNamespace is LabelReservationNamespace; "" removes it.
	ReservationNamespace string
}

// ReservationNamespace is the namespace of the reservation pods of the
// node, as its agent publishes it (LabelReservationNamespace), or
// DefaultReservationNamespace where it does not (an agent from before).
func ReservationNamespace(node *corev1.Node) string {
	if ns, ok := ReservationNamespaceLabelled(node); ok {
		return ns
	}
	return DefaultReservationNamespace
}

// ReservationNamespaceLabelled is the namespace the node's agent
// publishes, if it does.
func ReservationNamespaceLabelled(node *corev1.Node) (string, bool) {
	ns := node.Labels[LabelReservationNamespace]
	return ns, ns != ""
}

// Labels is the report as label values; a nil value removes the label.
func (r NodeReport) Labels() map[string]*string {
	str := func(s string) *string { return &s }
	out := map[string]*string{
		LabelMemoryEnforcement: str(r.Enforcement),
		LabelStandingGPUs:      nil,
		LabelGPUMemoryReserve:  str(strconv.FormatInt(r.ReserveMiB, 10)),
	}
	if r.Standing > 0 {
		out[LabelStandingGPUs] = str(strconv.Itoa(r.Standing))
	}
	out[LabelReservationNamespace] = nil
	if r.ReservationNamespace != "" {
		out[LabelReservationNamespace] = str(r.ReservationNamespace)
	}
	out[LabelAgentHeartbeat] = nil
	if secs := int64(r.Heartbeat / time.Second); secs > 0 {
		out[LabelAgentHeartbeat] = str(strconv.FormatInt(secs, 10))
	}
	if r.Inventory.Count > 0 {
		out[LabelGPUCount] = str(strconv.Itoa(r.Inventory.Count))
		out[LabelGPUMemory] = str(strconv.FormatInt(r.Inventory.MemoryMiB, 10))
		out[LabelGPUProduct] = str(r.Inventory.Model)
	}
	return out
}

// InventoryLabelled says whether a node's labels name its GPU model (GPU
// Feature Discovery's, or an agent's).
func InventoryLabelled(labels map[string]string) bool { return labels[LabelGPUProduct] != "" }

// GPUMemoryMiB is the memory of each of a node's GPUs as its labels say
// (LabelGPUMemory); ok is false when there is no readable figure.
func GPUMemoryMiB(labels map[string]string) (mib int64, ok bool) {
	v, err := strconv.ParseInt(labels[LabelGPUMemory], 10, 64)
	return v, err == nil && v > 0
}

// GPUProduct is the GPU model a node's labels name (nvidia.com/gpu.product,
// GPU Feature Discovery's form); "" when none is published.
func GPUProduct(labels map[string]string) string { return labels[LabelGPUProduct] }

// MemoryEnforcement is the backend a node reports (LabelMemoryEnforcement).
func MemoryEnforcement(node *corev1.Node) string { return node.Labels[LabelMemoryEnforcement] }

// FractioningCondition is the node's ConditionFractioningReady, if any.
func FractioningCondition(node *corev1.Node) (corev1.NodeCondition, bool) {
	i := slices.IndexFunc(node.Status.Conditions, func(c corev1.NodeCondition) bool { return c.Type == ConditionFractioningReady })
	if i < 0 {
		return corev1.NodeCondition{}, false
	}
	return node.Status.Conditions[i], true
}

// DefaultAgentHeartbeat bounds an agent's silence on a node without
// LabelAgentHeartbeat: three of the agent's default 30 s resync periods.
const DefaultAgentHeartbeat = 90 * time.Second

// Heartbeat is when a node's agent was last heard (its
// ConditionFractioningReady heartbeat) and how long it may go unheard
// (LabelAgentHeartbeat). The zero Heartbeat is never silent.
type Heartbeat struct {
	Last  time.Time
	Bound time.Duration
}

// AgentHeartbeat reads a node's Heartbeat: the zero one for a node
// without the condition or a heartbeat in it (InventoryOf already refuses
// such a node). Read once per Node object: Silent is what runs per pod.
func AgentHeartbeat(node *corev1.Node) Heartbeat {
	cond, ok := FractioningCondition(node)
	if !ok || cond.LastHeartbeatTime.IsZero() {
		return Heartbeat{}
	}
	h := Heartbeat{Last: cond.LastHeartbeatTime.Time, Bound: DefaultAgentHeartbeat}
	if secs, err := strconv.ParseInt(node.Labels[LabelAgentHeartbeat], 10, 64); err == nil && secs > 0 {
		h.Bound = time.Duration(secs) * time.Second
	}
	return h
}

// Silent says whether the agent has gone unheard for longer than its
// bound at now, and if so why, in words for the pod's reason.
func (h Heartbeat) Silent(now time.Time) (bool, string) {
	if h.Last.IsZero() {
		return false, ""
	}
	silence := now.Sub(h.Last)
	if silence <= h.Bound {
		return false, ""
	}
	return true, fmt.Sprintf("the node's gpufrac agent has not been heard from for %s (its %s heartbeat may be at most %s old): with the agent gone nothing injects a fraction's limits", silence.Round(time.Second), ConditionFractioningReady, h.Bound)
}

// AgentSilent is AgentHeartbeat(node).Silent(now).
func AgentSilent(node *corev1.Node, now time.Time) (bool, string) {
	return AgentHeartbeat(node).Silent(now)
}

// StandingLabelled says whether the node carries LabelStandingGPUs at all.
func StandingLabelled(node *corev1.Node) bool {
	_, ok := node.Labels[LabelStandingGPUs]
	return ok
}

// FractionsClosed says whether a node's labels close it to new fractions
// (LabelFractionsClosed), and by whom.
func FractionsClosed(labels map[string]string) (by string, closed bool) {
	by, closed = labels[LabelFractionsClosed]
	return by, closed
}

// CloseToFractions is the label patch that closes a node to new fractions
// (by names who closed it; a label value) or, with "", reopens it.
func CloseToFractions(by string) Write {
	if by == "" {
		return Write{Remove: []string{LabelFractionsClosed}}
	}
	return Write{Set: map[string]string{LabelFractionsClosed: by}}
}
