package api

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// UsageAnnotation is where a node agent publishes, on its Node, what the
// fractional pods there use of their GPUs (NodeUsage, JSON): the figures
// `gpufrac top`, its --advise and the dashboard show against the grant.
// Only the node's agent writes it; a tenant cannot write a Node.
const UsageAnnotation = "gpufrac.io/gpu-usage"

// SimulatedLoadAnnotation names, on a pod, the load a simulated GPU
// (a node agent run with --simulate-gpus: a local cluster, the demo)
// reports for it: idle, steady, busy, bursty or greedy. A node with real GPUs
// never reads it: there, use is measured.
const SimulatedLoadAnnotation = "gpufrac.io/simulated-load"

// SimulatedLoad is the load pod's annotation names ("" for none).
func SimulatedLoad(annotations map[string]string) string {
	return annotations[SimulatedLoadAnnotation]
}

// NodeUsage is what a node's fractional pods use of their GPUs, measured
// by the node agent: now, and over the window it remembers.
type NodeUsage struct {
	// At is when it was measured.
	At time.Time `json:"at"`
	// WindowSeconds is how far back the agent remembers readings (the
	// percentiles cover at most that, and a pod's Samples say how many).
	WindowSeconds int64 `json:"windowSeconds"`
	// Pods are the fractional pods' use, one entry per pod and GPU (a
	// pod's containers summed), sorted by pod and GPU.
	Pods []PodGPUUsage `json:"pods,omitempty"`
	// GPUs are the node's GPUs as a whole, sorted by UUID.
	GPUs []GPUUsage `json:"gpus,omitempty"`
	// Omitted counts the pod entries left out to keep the annotation
	// within maxUsageBytes.
	Omitted int `json:"omitted,omitempty"`
}

// PodGPUUsage is one pod's use of one GPU. A nil figure is one the driver
// cannot give (never read as zero): per-process memory on a driver that
// does not list processes, SM utilisation on one without samples.
type PodGPUUsage struct {
	// Pod is namespace/name.
	Pod string `json:"pod"`
	GPU string `json:"gpu"`
	// UsedMiB is what its processes hold now.
	UsedMiB *int64 `json:"usedMiB,omitempty"`
	// P95MiB and MaxMiB are over the readings of the window.
	P95MiB *int64 `json:"p95MiB,omitempty"`
	MaxMiB *int64 `json:"maxMiB,omitempty"`
	// SMPercent is its processes' SM utilisation over the last sampling
	// period; SMAvgPercent the mean over the window.
	SMPercent    *int64 `json:"smPercent,omitempty"`
	SMAvgPercent *int64 `json:"smAvgPercent,omitempty"`
	// Samples is how many readings of its memory the window holds (the
	// percentiles' count), SMSamples of its SM (the mean's), over
	// SpanSeconds; readings whose figure was unknown are not counted.
	Samples     int   `json:"samples"`
	SMSamples   int   `json:"smSamples"`
	SpanSeconds int64 `json:"spanSeconds"`
}

// GPUUsage is one GPU's use: all of it, and the part no fractional
// container's process holds (whole-GPU pods, the MPS server's own
// context, processes outside any pod).
type GPUUsage struct {
	UUID            string `json:"uuid"`
	UsedMiB         *int64 `json:"usedMiB,omitempty"`
	UnattributedMiB *int64 `json:"unattributedMiB,omitempty"`
	SMPercent       *int64 `json:"smPercent,omitempty"`
}

// maxUsageBytes bounds the annotation: a Node's annotations share
// 256 KiB, and pod names (up to 253 characters, chosen by tenants) must
// not crowd out anyone else's. 64 KiB holds a few hundred entries.
const maxUsageBytes = 64 << 10

// UsageWrite is the Node annotation that carries u, as a patch's map.
func UsageWrite(u NodeUsage) (map[string]*string, error) {
	u.Pods = slices.Clone(u.Pods)
	slices.SortFunc(u.Pods, func(a, b PodGPUUsage) int {
		return strings.Compare(a.Pod+"\x00"+a.GPU, b.Pod+"\x00"+b.GPU)
	})
	slices.SortFunc(u.GPUs, func(a, b GPUUsage) int { return strings.Compare(a.UUID, b.UUID) })
	raw, err := json.Marshal(u)
	for err == nil && len(raw) > maxUsageBytes && len(u.Pods) > 0 {
		// Drop a tenth of the pods (at least one) until it fits.
		drop := max(len(u.Pods)/10, 1)
		u.Pods, u.Omitted = u.Pods[:len(u.Pods)-drop], u.Omitted+drop
		raw, err = json.Marshal(u)
	}
	if err != nil {
		return nil, err
	}
	value := string(raw)
	return map[string]*string{UsageAnnotation: &value}, nil
}

// UsageOf reads what node's agent published of its tenants' use; ok is
// false where it published nothing (an agent from before, or none).
func UsageOf(node *corev1.Node) (u NodeUsage, ok bool, err error) {
	raw, ok := node.Annotations[UsageAnnotation]
	if !ok {
		return NodeUsage{}, false, nil
	}
	if err := json.Unmarshal([]byte(raw), &u); err != nil {
		return NodeUsage{}, true, fmt.Errorf("node %s: annotation %s: %w", node.Name, UsageAnnotation, err)
	}
	return u, true, nil
}

// Of finds pod's use of gpu.
func (u NodeUsage) Of(pod, gpu string) (PodGPUUsage, bool) {
	for _, p := range u.Pods {
		if p.Pod == pod && strings.EqualFold(p.GPU, gpu) {
			return p, true
		}
	}
	return PodGPUUsage{}, false
}
