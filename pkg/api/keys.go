package api

import "strings"

// ContainerKeyPrefix starts every canonical per-container annotation key:
// nvidia.com/container.<container><suffix>. The container name sits between
// the prefix and a known suffix and may itself contain dots, so keys are
// split by their suffix, never by the first dot.
const ContainerKeyPrefix = "nvidia.com/container."

// Suffixes of the canonical per-container keys (KAI Scheduler NvFractions contract).
const (
	// SuffixMemoryRequest is the guaranteed memory on each assigned GPU, a
	// Kubernetes quantity. The scheduler charges this amount.
	SuffixMemoryRequest = ".gpu-memory.request"
	// SuffixMemoryLimit is the hard cap a container may burst to on each GPU.
	SuffixMemoryLimit = ".gpu-memory.limit"
	// SuffixComputeMode is time-slicing (default) or sm-sharing.
	SuffixComputeMode = ".gpu-compute.mode"
	// SuffixDevices is the comma-separated list of assigned GPU UUIDs.
	// Scheduler-owned.
	SuffixDevices = ".gpus.devices"
	// SuffixComputePortion is the sm-sharing compute share in (0,1].
	// Scheduler-owned.
	SuffixComputePortion = ".gpu-compute.portion"
)

// KAIContainerKeyPrefix starts the per-container keys KAI Scheduler's
// admission writes under its own domain. The one it defines is
// SuffixMemoryPortionLimit, written from gpu-fraction.limit.
const KAIContainerKeyPrefix = "kai.scheduler/container."

// SuffixMemoryPortionLimit (under KAIContainerKeyPrefix) is the burst limit
// as a share of the GPU: gpu-fraction.limit for one named container. It
// follows gpu-fraction.limit's rules and resolves to SuffixMemoryLimit on
// the chosen GPU.
const SuffixMemoryPortionLimit = ".gpu-memory.portion.limit"

// PortionLimitKey is the KAI portion-limit key for container c.
func PortionLimitKey(c string) string {
	return KAIContainerKeyPrefix + c + SuffixMemoryPortionLimit
}

// Pod-level shorthand keys. Admission rewrites them into the canonical
// per-container keys and keeps them.
const (
	KeyFraction           = "gpu-fraction"
	KeyMemory             = "gpu-memory"
	KeyFractionLimit      = "gpu-fraction.limit"
	KeyMemoryLimit        = "gpu-memory.limit"
	KeyNumDevices         = "gpu-fraction-num-devices"
	KeyContainerName      = "gpu-fraction-container-name"
	KeyComputeSharingMode = "kai.scheduler/gpu-compute-sharing-mode"
)

// LabelPreemptibility is KAI Scheduler's opt-in to being moved or
// preempted (KAI's pkg/podgrouper/podgrouper/plugins/constants), which a
// user sets on a pod; gpufrac's consolidation moves only pods labelled
// Preemptible (OptedInToMoves).
const (
	LabelPreemptibility = "kai.scheduler/preemptibility"
	Preemptible         = "preemptible"
)

// OptedInToMoves says whether the pod's owner let the scheduler move it.
func OptedInToMoves(labels map[string]string) bool { return labels[LabelPreemptibility] == Preemptible }

// ResourceGPU is the device plugin's whole-GPU extended resource.
const ResourceGPU = "nvidia.com/gpu"

// ReservedGPUAnnotation is written by the node agent on a reservation pod:
// the UUID of the physical GPU the device plugin gave it, read from the
// kubelet's PodResources API. The scheduler waits for it before it writes
// .gpus.devices.
const ReservedGPUAnnotation = "gpufrac.io/reserved-gpu-uuid"

// DefaultReservationNamespace holds the reservation pods unless the
// scheduler and the node agent are told another (both must agree).
const DefaultReservationNamespace = "gpufrac-reservations"

// LabelReservationNamespace is written by the node agent on its node: the
// namespace of the reservation pods it tells their GPU, set once on the
// agent (--reservation-namespace) as the memory reserve is. Every other
// reader (audit, top, the dashboard) reads it here (ReservationNamespace);
// the scheduler, which creates them, refuses a node whose agent names
// another namespace than its own.
const LabelReservationNamespace = "gpufrac.io/reservation-namespace"

// LabelFractionsClosed closes the node that carries it to new fractions: the
// scheduler places none there (Inventory), the node agent reports its
// readiness condition False for every other scheduler (KAI's reads it) and
// offers no DRA shares. Running shares are not touched by the label itself.
// gpufrac mps-replace sets it while it drains the node's shares and
// replaces its MPS daemon; its value says who closed it.
const LabelFractionsClosed = "gpufrac.io/fractions-closed"

// GPUGroupsAnnotation is written by the scheduler on a fractional pod with
// its decision: the comma-separated GPU groups the pod joined, one per
// device, in the order of .gpus.devices. A GPU group is the set of pods
// sharing one physical GPU, held by one reservation pod; the scheduler
// rebuilds its state from this after a restart.
const GPUGroupsAnnotation = "gpufrac.io/gpu-groups"

// ResolvedKeysAnnotation is written by gpufrac's scheduler with its
// decision: the suffixes of the memory keys the decision added (that the
// pod's author had not set), so that api.Intent removes exactly those, and
// a canonical request its author set next to gpu-fraction stays theirs.
const ResolvedKeysAnnotation = "gpufrac.io/resolved-keys"

// GPUGroupLabel carries the GPU group on a reservation pod, and on a
// fractional pod that has one device, so that kubectl can list a GPU's
// tenants (kubectl get pods -A -l gpufrac.io/gpu-group=<group>).
const GPUGroupLabel = "gpufrac.io/gpu-group"

// The node inventory schedulers read: GPU Feature Discovery's labels (the
// node agent sets them where GFD does not) and KAI's readiness condition,
// which the node agent reports when it can enforce fractions.
const (
	LabelGPUCount   = "nvidia.com/gpu.count"
	LabelGPUMemory  = "nvidia.com/gpu.memory" // MiB per GPU
	LabelGPUProduct = "nvidia.com/gpu.product"
	// ConditionFractioningReady is a node condition type.
	ConditionFractioningReady = "gpu-fractioning.nvidia.com/Ready"
	// LabelMemoryEnforcement is the memory-limit backend the node agent
	// has in effect: driver, toolkit, mps-pinned or none.
	LabelMemoryEnforcement = "gpufrac.io/memory-enforcement"
	// LabelStandingGPUs is how many of its GPUs a node asks to have held
	// for shares at all times: its DRA driver offers claims only GPUs the
	// device plugin cannot give a whole-GPU pod, so the scheduler keeps a
	// standing reservation pod on each (see StandingGPUs).
	LabelStandingGPUs = "gpufrac.io/standing-gpus"
	// LabelGPUMemoryReserve is the MiB the node keeps back on each GPU,
	// published by its node agent (--gpu-memory-reserve-mib, the one place
	// it is configured) and read by every reader of the node's GPUs: the
	// scheduler, audit, top, the dashboard, explain. A share of a GPU is a
	// share of its memory less this. Absent (a node of another operator):
	// 0, KAI's default.
	LabelGPUMemoryReserve = "gpufrac.io/gpu-memory-reserve-mib"
	// LabelAgentHeartbeat is how long, in seconds, the node's agent may go
	// unheard (its ConditionFractioningReady heartbeat not renewed) before
	// the node takes no fractions: three of its resync periods, published
	// by the agent. Absent: DefaultAgentHeartbeat.
	LabelAgentHeartbeat = "gpufrac.io/agent-heartbeat-seconds"
	// StandingLabel marks a standing reservation pod (value "true"): one
	// that holds its GPU for shares whether or not any share is there
	// (kubectl get pods -n gpufrac-reservations -l gpufrac.io/standing).
	StandingLabel = "gpufrac.io/standing"
)

// userSuffixes are the canonical suffixes a manifest may set, in the order
// error messages list them.
var userSuffixes = []string{SuffixMemoryRequest, SuffixMemoryLimit, SuffixComputeMode}

// schedulerSuffixes are written only by the scheduler after binding.
var schedulerSuffixes = []string{SuffixDevices, SuffixComputePortion}

// allSuffixes holds every known suffix; none is a suffix of another, so the
// split is unambiguous.
var allSuffixes = append(append([]string{}, userSuffixes...), schedulerSuffixes...)

var shorthandKeys = []string{
	KeyFraction, KeyMemory, KeyFractionLimit, KeyMemoryLimit,
	KeyNumDevices, KeyContainerName, KeyComputeSharingMode,
}

// ContainerKey returns the canonical annotation key for container c.
func ContainerKey(c, suffix string) string {
	return ContainerKeyPrefix + c + suffix
}

// SplitContainerKey splits a canonical key into its container name and
// suffix. ok is false when key is not under ContainerKeyPrefix; suffix is ""
// when the key is under the prefix but ends in no known suffix, and
// container is "" when the key names no container.
func SplitContainerKey(key string) (container, suffix string, ok bool) {
	rest, ok := strings.CutPrefix(key, ContainerKeyPrefix)
	if !ok {
		return "", "", false
	}
	for _, s := range allSuffixes {
		if c, found := strings.CutSuffix(rest, s); found {
			return c, s, true
		}
	}
	return rest, "", true
}

// IsSchedulerOwned reports whether key is one that only the scheduler may
// write: a container's assigned devices or its compute portion.
func IsSchedulerOwned(key string) bool {
	c, suffix, ok := SplitContainerKey(key)
	return ok && c != "" && (suffix == SuffixDevices || suffix == SuffixComputePortion)
}

// IsFractionKey reports whether key is any annotation this API reads: a
// shorthand or anything under ContainerKeyPrefix or KAIContainerKeyPrefix
// (known or not).
func IsFractionKey(key string) bool {
	if strings.HasPrefix(key, ContainerKeyPrefix) || strings.HasPrefix(key, KAIContainerKeyPrefix) {
		return true
	}
	for _, k := range shorthandKeys {
		if key == k {
			return true
		}
	}
	return false
}

// nearShorthand returns the shorthand key that key was probably meant to
// be ("gpu_fraction", "GPU-Memory", "gpu-fraction-limit", "gpu-fracton"),
// or "". A misspelt key would otherwise be ignored and the pod would run
// without the GPU share its author asked for.
func nearShorthand(key string) string {
	// Every shorthand holds "gpu"; a key without it is somebody else's,
	// which keeps this check off the path of ordinary annotations.
	if len(key) < len(KeyMemory) || !strings.Contains(normaliseKey(key), "gpu") || IsFractionKey(key) {
		return ""
	}
	norm := normaliseKey(key)
	for i, k := range shorthandKeys {
		if norm == normalisedShorthands[i] || withinOneEdit(key, k) {
			return k
		}
	}
	return ""
}

var normalisedShorthands = func() []string {
	n := make([]string, len(shorthandKeys))
	for i, k := range shorthandKeys {
		n[i] = normaliseKey(k)
	}
	return n
}()

func normaliseKey(k string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r == '_' || r == '.':
			return '-'
		case r >= 'A' && r <= 'Z':
			return r + ('a' - 'A')
		}
		return r
	}, k)
}

// withinOneEdit reports whether a becomes b by at most one insertion,
// deletion or substitution of a byte.
func withinOneEdit(a, b string) bool {
	if len(a) > len(b) {
		a, b = b, a
	}
	if len(b)-len(a) > 1 {
		return false
	}
	i := 0
	for i < len(a) && a[i] == b[i] {
		i++
	}
	if len(a) == len(b) {
		return i == len(a) || a[i+1:] == b[i+1:]
	}
	return a[i:] == b[i+1:]
}

// SplitList splits a comma-separated annotation value, dropping empty
// items: "a,b" → [a b], "" → nil.
func SplitList(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return r == ',' })
}
