package api

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// podBuilder makes the pods of the table tests.
type podBuilder struct{ pod *corev1.Pod }

func newPod(annotations map[string]string, containers ...string) *podBuilder {
	if len(containers) == 0 {
		containers = []string{"main"}
	}
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", Annotations: annotations}}
	for _, c := range containers {
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: c, Image: "img"})
	}
	return &podBuilder{pod: p}
}

// wholeGPUs gives container i a whole-GPU limit.
func (b *podBuilder) wholeGPUs(i int, n string) *podBuilder {
	b.pod.Spec.Containers[i].Resources.Limits = corev1.ResourceList{ResourceGPU: resource.MustParse(n)}
	return b
}

func (b *podBuilder) initContainer(name string) *podBuilder {
	b.pod.Spec.InitContainers = append(b.pod.Spec.InitContainers, corev1.Container{Name: name, Image: "img"})
	return b
}

func (b *podBuilder) initWholeGPUs(n string) *podBuilder {
	b.pod.Spec.InitContainers = append(b.pod.Spec.InitContainers, corev1.Container{
		Name: "init", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{ResourceGPU: resource.MustParse(n)}},
	})
	return b
}

func frac(t *testing.T, s string) Fraction {
	t.Helper()
	f, err := ParseFraction(s)
	if err != nil {
		t.Fatalf("ParseFraction(%q): %v", s, err)
	}
	return f
}

func fractionReq(t *testing.T, c, req, limit string, mode ComputeMode, devices int) []Request {
	return []Request{{Container: c, Memory: Amount{Fraction: frac(t, req)}, Limit: Amount{Fraction: frac(t, limit)}, Mode: mode, Devices: devices}}
}

func mibReq(c string, req, limit int64, mode ComputeMode, devices int) []Request {
	return []Request{{Container: c, Memory: Amount{MiB: req}, Limit: Amount{MiB: limit}, Mode: mode, Devices: devices}}
}

type ann = map[string]string

func TestParseAccepts(t *testing.T) {
	tests := []struct {
		name string
		pod  *podBuilder
		want func(t *testing.T) []Request
	}{
		{"no annotations: no fraction", newPod(nil), func(*testing.T) []Request { return nil }},
		{"unrelated annotations: no fraction", newPod(ann{"nvidia.com/gpu.product": "H100", "example.com/x": "1",
			"gpu-type": "a100", "gpu-count": "2", "gpu-memory-type": "hbm3", "kai.scheduler/queue": "q"}),
			func(*testing.T) []Request { return nil }},
		{"whole GPUs without fraction annotations", newPod(nil).wholeGPUs(0, "2"), func(*testing.T) []Request { return nil }},
		{"zero whole GPUs do not conflict", newPod(ann{KeyFraction: "0.5"}).wholeGPUs(0, "0"),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.5", TimeSlicing, 1) }},
		{"fraction: limit defaults to request", newPod(ann{KeyFraction: "0.5"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.5", TimeSlicing, 1) }},
		{"fraction with leading point", newPod(ann{KeyFraction: ".25"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.25", "0.25", TimeSlicing, 1) }},
		{"fraction with many decimals", newPod(ann{KeyFraction: "0.333333333"}),
			func(t *testing.T) []Request {
				return fractionReq(t, "main", "0.333333333", "0.333333333", TimeSlicing, 1)
			}},
		{"fraction applies to the first container by default", newPod(ann{KeyFraction: "0.5"}, "first", "second"),
			func(t *testing.T) []Request { return fractionReq(t, "first", "0.5", "0.5", TimeSlicing, 1) }},
		{"fraction with burst limit", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.75"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.75", TimeSlicing, 1) }},
		{"fraction limit with exactly five decimals", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.99999"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.99999", TimeSlicing, 1) }},
		{"memory in MiB", newPod(ann{KeyMemory: "4096"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 4096, TimeSlicing, 1) }},
		{"memory with limit quantity", newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "8Gi"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 8192, TimeSlicing, 1) }},
		{"memory limit equal to request", newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "4Gi"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 4096, TimeSlicing, 1) }},
		{"memory limit in decimal units rounds up to MiB", newPod(ann{KeyMemory: "4000", KeyMemoryLimit: "5G"}),
			func(*testing.T) []Request { return mibReq("main", 4000, 4769, TimeSlicing, 1) }},
		{"sm-sharing via the KAI pod-level key", newPod(ann{KeyFraction: "0.25", KeyComputeSharingMode: "sm-sharing"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.25", "0.25", SMSharing, 1) }},
		{"time-slicing spelled out", newPod(ann{KeyFraction: "0.25", KeyComputeSharingMode: "time-slicing"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.25", "0.25", TimeSlicing, 1) }},
		{"num-devices with a fraction", newPod(ann{KeyFraction: "0.5", KeyNumDevices: "2"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.5", TimeSlicing, 2) }},
		{"num-devices with memory", newPod(ann{KeyMemory: "1024", KeyNumDevices: "4"}),
			func(*testing.T) []Request { return mibReq("main", 1024, 1024, TimeSlicing, 4) }},
		{"container-name picks the target", newPod(ann{KeyFraction: "0.5", KeyContainerName: "worker"}, "sidecar", "worker"),
			func(t *testing.T) []Request { return fractionReq(t, "worker", "0.5", "0.5", TimeSlicing, 1) }},
		{"canonical request only: limit defaults to request",
			newPod(ann{"nvidia.com/container.main.gpu-memory.request": "4Gi"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 4096, TimeSlicing, 1) }},
		{"canonical limit only: request defaults to limit",
			newPod(ann{"nvidia.com/container.main.gpu-memory.limit": "7680Mi"}),
			func(*testing.T) []Request { return mibReq("main", 7680, 7680, TimeSlicing, 1) }},
		{"canonical request and limit with mode",
			newPod(ann{"nvidia.com/container.main.gpu-memory.request": "2Gi", "nvidia.com/container.main.gpu-memory.limit": "3Gi",
				"nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}),
			func(*testing.T) []Request { return mibReq("main", 2048, 3072, SMSharing, 1) }},
		{"canonical bytes that are whole MiB",
			newPod(ann{"nvidia.com/container.main.gpu-memory.request": "4294967296"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 4096, TimeSlicing, 1) }},
		{"canonical keys on a dotted container name",
			newPod(ann{"nvidia.com/container.llm.v2.gpu-memory.request": "1Gi", "nvidia.com/container.llm.v2.gpu-compute.mode": "time-slicing"}, "side", "llm.v2"),
			func(*testing.T) []Request { return mibReq("llm.v2", 1024, 1024, TimeSlicing, 1) }},
		{"dotted container name that looks like a suffix",
			newPod(ann{"nvidia.com/container.a.gpu-memory.gpu-memory.request": "1Gi"}, "a.gpu-memory"),
			func(*testing.T) []Request { return mibReq("a.gpu-memory", 1024, 1024, TimeSlicing, 1) }},
		{"shorthand and canonical agree (admission output)",
			newPod(ann{KeyMemory: "4096", "nvidia.com/container.main.gpu-memory.request": "4Gi",
				KeyComputeSharingMode: "sm-sharing", "nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 4096, SMSharing, 1) }},
		{"shorthand memory with its limit and the same canonical limit",
			newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "6Gi", "nvidia.com/container.main.gpu-memory.limit": "6144Mi"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 6144, TimeSlicing, 1) }},
		{"the canonical keys' container wins over the default first container, as in KAI",
			newPod(ann{KeyFraction: "0.5", "nvidia.com/container.b.gpu-compute.mode": "sm-sharing"}, "a", "b"),
			func(t *testing.T) []Request { return fractionReq(t, "b", "0.5", "0.5", SMSharing, 1) }},
		{"canonical request wins over gpu-fraction, as in KAI",
			newPod(ann{KeyFraction: "0.5", "nvidia.com/container.main.gpu-memory.request": "4Gi"}),
			func(*testing.T) []Request { return mibReq("main", 4096, 4096, TimeSlicing, 1) }},
		{"fraction in exponent form, as KAI's ParseFloat reads it", newPod(ann{KeyFraction: "5e-1", KeyFractionLimit: "+0.75"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.75", TimeSlicing, 1) }},
		{"fraction on an init container named by gpu-fraction-container-name",
			newPod(ann{KeyFraction: "0.25", KeyContainerName: "setup"}).initContainer("setup"),
			func(t *testing.T) []Request { return fractionReq(t, "setup", "0.25", "0.25", TimeSlicing, 1) }},
		{"canonical keys on an init container",
			newPod(ann{"nvidia.com/container.setup.gpu-memory.request": "2Gi"}).initContainer("setup"),
			func(*testing.T) []Request { return mibReq("setup", 2048, 2048, TimeSlicing, 1) }},
		{"KAI's portion limit resolves as the limit",
			newPod(ann{KeyFraction: "0.5", PortionLimitKey("main"): "0.75"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.75", TimeSlicing, 1) }},
		{"KAI's portion limit next to the same gpu-fraction.limit (KAI's admission writes one from the other)",
			newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.75", PortionLimitKey("main"): "0.75000"}),
			func(t *testing.T) []Request { return fractionReq(t, "main", "0.5", "0.75", TimeSlicing, 1) }},
		{"gpu-fraction-container-name alone is ignored, as in KAI", newPod(ann{KeyContainerName: "main"}).wholeGPUs(0, "1"),
			func(*testing.T) []Request { return nil }},
		{"shorthand fraction with canonical mode and matching container-name",
			newPod(ann{KeyFraction: "0.5", KeyContainerName: "gpu", "nvidia.com/container.gpu.gpu-compute.mode": "sm-sharing"}, "web", "gpu"),
			func(t *testing.T) []Request { return fractionReq(t, "gpu", "0.5", "0.5", SMSharing, 1) }},
		{"canonical keys on the second container with num-devices",
			newPod(ann{"nvidia.com/container.b.gpu-memory.request": "1Gi", KeyNumDevices: "2", KeyContainerName: "b"}, "a", "b"),
			func(*testing.T) []Request { return mibReq("b", 1024, 1024, TimeSlicing, 2) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.pod.pod)
			if err != nil {
				t.Fatalf("Parse: unexpected error: %v", err)
			}
			if diff := cmp.Diff(tt.want(t), got, cmp.AllowUnexported(Fraction{})); diff != "" {
				t.Errorf("Parse (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseRejects(t *testing.T) {
	tests := []struct {
		name string
		pod  *podBuilder
		// want are the exact messages, in order.
		want []string
	}{
		{"fraction 1", newPod(ann{KeyFraction: "1"}),
			[]string{`container "main": gpu-fraction "1" must be greater than 0 and less than 1`}},
		{"fraction 0", newPod(ann{KeyFraction: "0.0"}),
			[]string{`container "main": gpu-fraction "0.0" must be greater than 0 and less than 1`}},
		{"fraction 50 (a percentage)", newPod(ann{KeyFraction: "50"}),
			[]string{`container "main": gpu-fraction "50" must be greater than 0 and less than 1`}},
		{"fraction 500m (a quantity)", newPod(ann{KeyFraction: "500m"}),
			[]string{`container "main": gpu-fraction "500m" must be a decimal number such as 0.5`}},
		{"fraction NaN", newPod(ann{KeyFraction: "NaN"}),
			[]string{`container "main": gpu-fraction "NaN" must be a decimal number such as 0.5`}},
		{"fraction Inf", newPod(ann{KeyFraction: "+Inf"}),
			[]string{`container "main": gpu-fraction "+Inf" must be a decimal number such as 0.5`}},
		{"fraction negative", newPod(ann{KeyFraction: "-0.5"}),
			[]string{`container "main": gpu-fraction "-0.5" must be greater than 0 and less than 1`}},
		{"fraction exponent above 1", newPod(ann{KeyFraction: "5e-0"}),
			[]string{`container "main": gpu-fraction "5e-0" must be greater than 0 and less than 1`}},
		{"shorthand memory with canonical limit (KAI refuses the pair)",
			newPod(ann{KeyMemory: "4096", "nvidia.com/container.main.gpu-memory.limit": "6Gi"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.limit "6Gi" cannot be combined with gpu-memory alone: set the limit with gpu-memory.limit too (KAI Scheduler refuses this pair)`}},
		{"portion limit without gpu-fraction", newPod(ann{PortionLimitKey("main"): "0.75"}),
			[]string{`container "main": kai.scheduler/container.main.gpu-memory.portion.limit "0.75" needs gpu-fraction: the limit is a share of the same GPU as the request`}},
		{"portion limit not above the fraction", newPod(ann{KeyFraction: "0.5", PortionLimitKey("main"): "0.5"}),
			[]string{`container "main": kai.scheduler/container.main.gpu-memory.portion.limit "0.5" must be greater than gpu-fraction (0.5) and less than 1`}},
		{"portion limit with six decimals", newPod(ann{KeyFraction: "0.5", PortionLimitKey("main"): "0.600001"}),
			[]string{`container "main": kai.scheduler/container.main.gpu-memory.portion.limit "0.600001" must have at most 5 decimal places`}},
		{"portion limit of 1", newPod(ann{KeyFraction: "0.5", PortionLimitKey("main"): "1"}),
			[]string{`container "main": kai.scheduler/container.main.gpu-memory.portion.limit "1" must be less than 1 and greater than gpu-fraction`}},
		{"portion limit on another container than gpu-fraction's", newPod(ann{KeyFraction: "0.5", PortionLimitKey("side"): "0.75"}, "main", "side"),
			[]string{`container "side": kai.scheduler/container.side.gpu-memory.portion.limit "0.75" must name the container gpu-fraction applies to ("main": gpu-fraction-container-name, or the first container)`}},
		{"portion limit disagreeing with gpu-fraction.limit", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.75", PortionLimitKey("main"): "0.8"}),
			[]string{`container "main": kai.scheduler/container.main.gpu-memory.portion.limit "0.8" disagrees with gpu-fraction.limit "0.75": set one, or make them equal`}},
		{"unknown key under kai.scheduler/container.", newPod(ann{KeyFraction: "0.5", "kai.scheduler/container.main.gpu-memory.limit": "0.75"}),
			[]string{`kai.scheduler/container.main.gpu-memory.limit "0.75" is not a known key: KAI Scheduler's per-container key is kai.scheduler/container.<container>.gpu-memory.portion.limit`}},
		{"a share limit next to a canonical request that overrides the share",
			newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.75", "nvidia.com/container.main.gpu-memory.request": "4Gi"}),
			[]string{`container "main": gpu-fraction.limit "0.75" cannot be combined with nvidia.com/container.main.gpu-memory.request: a limit as a share of the GPU needs the request as a share (gpu-fraction); set nvidia.com/container.main.gpu-memory.limit instead`}},
		{"fraction blank", newPod(ann{KeyFraction: ""}),
			[]string{`container "main": gpu-fraction "" must be a decimal number such as 0.5`}},
		{"fraction with space", newPod(ann{KeyFraction: " 0.5"}),
			[]string{`container "main": gpu-fraction " 0.5" must be a decimal number such as 0.5`}},
		{"fraction limit six decimals", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.750001"}),
			[]string{`container "main": gpu-fraction.limit "0.750001" must have at most 5 decimal places`}},
		{"fraction limit equal to request", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.50"}),
			[]string{`container "main": gpu-fraction.limit "0.50" must be greater than gpu-fraction (0.5) and less than 1`}},
		{"fraction limit below request", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "0.4"}),
			[]string{`container "main": gpu-fraction.limit "0.4" must be greater than gpu-fraction (0.5) and less than 1`}},
		{"fraction limit 1", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "1"}),
			[]string{`container "main": gpu-fraction.limit "1" must be less than 1 and greater than gpu-fraction`}},
		{"fraction limit not decimal", newPod(ann{KeyFraction: "0.5", KeyFractionLimit: "Inf"}),
			[]string{`container "main": gpu-fraction.limit "Inf" must be a decimal number such as 0.75`}},
		{"fraction limit without fraction", newPod(ann{KeyMemory: "1024", KeyFractionLimit: "0.5"}),
			[]string{`container "main": gpu-fraction.limit "0.5" needs gpu-fraction: the limit is a share of the same GPU as the request`}},
		{"fraction and memory together", newPod(ann{KeyFraction: "0.5", KeyMemory: "1024"}),
			[]string{`container "main": gpu-memory "1024" cannot be combined with gpu-fraction: ask for a share of a GPU or for an amount of memory, not both`}},
		{"memory with a unit", newPod(ann{KeyMemory: "4Gi"}),
			[]string{`container "main": gpu-memory "4Gi" must be a positive whole number of MiB without a unit, such as 4096`}},
		{"memory zero", newPod(ann{KeyMemory: "0"}),
			[]string{`container "main": gpu-memory "0" must be a positive whole number of MiB without a unit, such as 4096`}},
		{"memory decimal", newPod(ann{KeyMemory: "1.5"}),
			[]string{`container "main": gpu-memory "1.5" must be a positive whole number of MiB without a unit, such as 4096`}},
		{"memory negative", newPod(ann{KeyMemory: "-4"}),
			[]string{`container "main": gpu-memory "-4" must be a positive whole number of MiB without a unit, such as 4096`}},
		{"memory limit without unit", newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "8192"}),
			[]string{`container "main": gpu-memory.limit "8192" must be a quantity with a unit, such as 8Gi (unlike gpu-memory, it is not a number of MiB)`}},
		{"memory limit below request", newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "2Gi"}),
			[]string{`container "main": gpu-memory.limit "2Gi" must be at least gpu-memory (4096Mi)`}},
		{"memory limit without memory", newPod(ann{KeyFraction: "0.5", KeyMemoryLimit: "8Gi"}),
			[]string{`container "main": gpu-memory.limit "8Gi" needs gpu-memory: set the memory request too`}},
		{"memory limit not a quantity", newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "lots"}),
			[]string{`container "main": gpu-memory.limit "lots" must be a Kubernetes quantity such as 4Gi or 7680Mi`}},
		{"num-devices zero", newPod(ann{KeyFraction: "0.5", KeyNumDevices: "0"}),
			[]string{`container "main": gpu-fraction-num-devices "0" must be a positive whole number of GPUs, such as 2`}},
		{"num-devices decimal", newPod(ann{KeyFraction: "0.5", KeyNumDevices: "1.5"}),
			[]string{`container "main": gpu-fraction-num-devices "1.5" must be a positive whole number of GPUs, such as 2`}},
		{"num-devices alone", newPod(ann{KeyNumDevices: "2"}),
			[]string{`container "main": gpu-fraction-num-devices "2" needs a memory request: set gpu-fraction or gpu-memory (or .gpu-memory.request)`}},
		{"mode alone", newPod(ann{KeyComputeSharingMode: "sm-sharing"}),
			[]string{`container "main": kai.scheduler/gpu-compute-sharing-mode "sm-sharing" needs a memory request: set gpu-fraction or gpu-memory (or .gpu-memory.request)`}},
		{"mode unknown", newPod(ann{KeyFraction: "0.5", KeyComputeSharingMode: "mps"}),
			[]string{`container "main": kai.scheduler/gpu-compute-sharing-mode "mps" must be time-slicing or sm-sharing`}},
		{"canonical mode blank", newPod(ann{"nvidia.com/container.main.gpu-memory.request": "1Gi", "nvidia.com/container.main.gpu-compute.mode": ""}),
			[]string{`container "main": nvidia.com/container.main.gpu-compute.mode "" must be time-slicing or sm-sharing`}},
		{"canonical mode alone", newPod(ann{"nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}),
			[]string{`container "main": nvidia.com/container.main.gpu-compute.mode "sm-sharing" needs a memory request: set nvidia.com/container.main.gpu-memory.request or gpu-fraction`}},
		{"canonical and shorthand modes disagree",
			newPod(ann{KeyFraction: "0.5", KeyComputeSharingMode: "sm-sharing", "nvidia.com/container.main.gpu-compute.mode": "time-slicing"}),
			[]string{`container "main": nvidia.com/container.main.gpu-compute.mode "time-slicing" disagrees with kai.scheduler/gpu-compute-sharing-mode "sm-sharing": set one, or make them equal`}},
		{"canonical and shorthand memory disagree",
			newPod(ann{KeyMemory: "4096", "nvidia.com/container.main.gpu-memory.request": "8Gi"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.request "8Gi" disagrees with gpu-memory "4096" (8192Mi vs 4096Mi): set one, or make them equal`}},
		{"canonical and shorthand limit disagree",
			newPod(ann{KeyMemory: "4096", KeyMemoryLimit: "8Gi", "nvidia.com/container.main.gpu-memory.limit": "6Gi"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.limit "6Gi" disagrees with gpu-memory.limit "8Gi" (6144Mi vs 8192Mi): set one, or make them equal`}},
		{"canonical limit below request",
			newPod(ann{"nvidia.com/container.main.gpu-memory.request": "4Gi", "nvidia.com/container.main.gpu-memory.limit": "2Gi"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.limit "2Gi" must be at least the memory request (4096Mi)`}},
		{"canonical request zero", newPod(ann{"nvidia.com/container.main.gpu-memory.request": "0"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.request "0" must be greater than 0`}},
		{"canonical request in bytes below 1Mi", newPod(ann{"nvidia.com/container.main.gpu-memory.request": "4096"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.request "4096" must be at least 1Mi (a bare number means bytes: write a unit, such as 4Gi)`}},
		{"canonical request absurdly large", newPod(ann{"nvidia.com/container.main.gpu-memory.request": "8Ei"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.request "8Ei" must be at most 1Pi`}},
		{"canonical request not a quantity", newPod(ann{"nvidia.com/container.main.gpu-memory.request": "4 GB"}),
			[]string{`container "main": nvidia.com/container.main.gpu-memory.request "4 GB" must be a Kubernetes quantity such as 4Gi or 7680Mi`}},
		{"unknown suffix", newPod(ann{"nvidia.com/container.main.gpu-memory": "4Gi"}),
			[]string{`nvidia.com/container.main.gpu-memory "4Gi" is not a known key: per-container keys end in .gpu-memory.request, .gpu-memory.limit, .gpu-compute.mode`}},
		{"key with no container", newPod(ann{"nvidia.com/container..gpu-memory.request": "4Gi"}),
			[]string{`nvidia.com/container..gpu-memory.request "4Gi" names no container: per-container keys are nvidia.com/container.<container>.gpu-memory.request`}},
		{"forged devices", newPod(ann{KeyFraction: "0.5", "nvidia.com/container.main.gpus.devices": "GPU-0d0e"}),
			[]string{`container "main": nvidia.com/container.main.gpus.devices "GPU-0d0e" is written by the scheduler and cannot be set in a manifest: remove it`}},
		{"forged portion without any request", newPod(ann{"nvidia.com/container.main.gpu-compute.portion": "1"}),
			[]string{`container "main": nvidia.com/container.main.gpu-compute.portion "1" is written by the scheduler and cannot be set in a manifest: remove it`}},
		{"forged devices on a dotted container", newPod(ann{"nvidia.com/container.a.b.gpus.devices": "GPU-1"}, "a.b"),
			[]string{`container "a.b": nvidia.com/container.a.b.gpus.devices "GPU-1" is written by the scheduler and cannot be set in a manifest: remove it`}},
		{"whole GPU and fraction", newPod(ann{KeyFraction: "0.5"}).wholeGPUs(0, "1"),
			[]string{`container "main": resources.limits[nvidia.com/gpu] "1" cannot be combined with GPU-fraction annotations on the same pod: ask for whole GPUs or for a fraction, not both`}},
		{"whole GPU in an init container and fraction", newPod(ann{KeyMemory: "1024"}).initWholeGPUs("1"),
			[]string{`container "init": resources.requests[nvidia.com/gpu] "1" cannot be combined with GPU-fraction annotations on the same pod: ask for whole GPUs or for a fraction, not both`}},
		{"container-name that does not exist", newPod(ann{KeyFraction: "0.5", KeyContainerName: "gpu"}, "main", "side"),
			[]string{`gpu-fraction-container-name "gpu" names a container that is not in the pod (containers: main, side)`}},
		{"canonical keys for a missing container", newPod(ann{"nvidia.com/container.gpu.gpu-memory.request": "1Gi"}),
			[]string{`container "gpu": nvidia.com/container.gpu.gpu-memory.request "1Gi" names a container that is not in the pod (containers: main)`}},
		{"two fractional containers via canonical keys",
			newPod(ann{"nvidia.com/container.a.gpu-memory.request": "1Gi", "nvidia.com/container.b.gpu-memory.request": "1Gi"}, "a", "b"),
			[]string{`GPU-fraction containers "a, b" are more than one: only one container per pod may have fraction annotations (pod-level keys apply to "a" unless gpu-fraction-container-name names another)`}},
		{"container-name disagrees with canonical keys",
			newPod(ann{KeyFraction: "0.5", KeyContainerName: "a", "nvidia.com/container.b.gpu-compute.mode": "sm-sharing"}, "a", "b"),
			[]string{`GPU-fraction containers "b, a" are more than one: only one container per pod may have fraction annotations (pod-level keys apply to "a" unless gpu-fraction-container-name names another)`}},
		{"shorthand on a pod with no containers", newPod(ann{KeyFraction: "0.5"}).noContainers(),
			[]string{`gpu-fraction "0.5" applies to the first container, but the pod has none`}},
		{"misspelt shorthand (underscore)", newPod(ann{"gpu_fraction": "0.5"}),
			[]string{`gpu_fraction "0.5" is not a key gpufrac reads: did you mean gpu-fraction?`}},
		{"misspelt shorthand (dash for dot)", newPod(ann{KeyFraction: "0.5", "gpu-fraction-limit": "0.7"}),
			[]string{`gpu-fraction-limit "0.7" is not a key gpufrac reads: did you mean gpu-fraction.limit?`}},
		{"misspelt shorthand (one letter)", newPod(ann{"gpu-fracton": "0.5"}),
			[]string{`gpu-fracton "0.5" is not a key gpufrac reads: did you mean gpu-fraction?`}},
		{"misspelt shorthand (case)", newPod(ann{"GPU-Memory": "4096"}),
			[]string{`GPU-Memory "4096" is not a key gpufrac reads: did you mean gpu-memory?`}},
		{"several problems are all reported",
			newPod(ann{KeyFraction: "2", KeyNumDevices: "-1", KeyComputeSharingMode: "", "nvidia.com/container.main.gpus.devices": "x"}).wholeGPUs(0, "1"),
			[]string{
				`container "main": nvidia.com/container.main.gpus.devices "x" is written by the scheduler and cannot be set in a manifest: remove it`,
				`container "main": resources.limits[nvidia.com/gpu] "1" cannot be combined with GPU-fraction annotations on the same pod: ask for whole GPUs or for a fraction, not both`,
				`container "main": gpu-fraction "2" must be greater than 0 and less than 1`,
				`container "main": kai.scheduler/gpu-compute-sharing-mode "" must be time-slicing or sm-sharing`,
				`container "main": gpu-fraction-num-devices "-1" must be a positive whole number of GPUs, such as 2`,
			}},
		{"wrong container-name and a bad value are both reported",
			newPod(ann{KeyFraction: "1.5", KeyContainerName: "nope"}),
			[]string{
				`gpu-fraction-container-name "nope" names a container that is not in the pod (containers: main)`,
				`container "nope": gpu-fraction "1.5" must be greater than 0 and less than 1`,
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.pod.pod)
			if err == nil {
				t.Fatalf("Parse accepted the pod: %v", got)
			}
			if got != nil {
				t.Errorf("Parse returned a request with an error: %v", got)
			}
			var list ErrorList
			if !errors.As(err, &list) {
				t.Fatalf("error is %T, want ErrorList", err)
			}
			msgs := make([]string, len(list))
			for i, e := range list {
				msgs[i] = e.Error()
			}
			if diff := cmp.Diff(tt.want, msgs); diff != "" {
				t.Errorf("messages (-want +got):\n%s", diff)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error spans several lines: %q", err)
			}
		})
	}
}

func (b *podBuilder) noContainers() *podBuilder {
	b.pod.Spec.Containers = nil
	return b
}

func TestCheckWarns(t *testing.T) {
	tests := []struct {
		name string
		pod  *podBuilder
		want []string
	}{
		{"a valid fraction: no warning", newPod(ann{KeyFraction: "0.5"}), nil},
		{"gpu-fraction-container-name on a pod that asks for nothing", newPod(ann{KeyContainerName: "main"}),
			[]string{`gpu-fraction-container-name "main" is ignored: the pod asks for no GPU fraction (gpu-fraction, gpu-memory or nvidia.com/container.<container>.gpu-memory.request would ask for one)`}},
		{"a shorthand next to a canonical request", newPod(ann{KeyFraction: "0.5", "nvidia.com/container.main.gpu-memory.request": "4Gi"}),
			[]string{`container "main": gpu-fraction "0.5" is ignored: nvidia.com/container.main.gpu-memory.request is set too, and the canonical request wins, as in KAI Scheduler`}},
		{"an exponent", newPod(ann{KeyFraction: "2.5e-1"}),
			[]string{`container "main": gpu-fraction "2.5e-1" is read as 0.25: write it as a plain decimal`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, warnings, err := Check(tt.pod.pod.Annotations, &tt.pod.pod.Spec)
			if err != nil {
				t.Fatalf("Check refused: %v", err)
			}
			if diff := cmp.Diff(tt.want, warnings); diff != "" {
				t.Errorf("warnings (-want +got):\n%s", diff)
			}
		})
	}
}

func TestFieldErrorTruncatesLongValues(t *testing.T) {
	long := strings.Repeat("x", 500) + "\nsecond line"
	_, err := Parse(newPod(ann{KeyFraction: long}).pod)
	if err == nil {
		t.Fatal("accepted")
	}
	msg := err.Error()
	if len(msg) > 200 || strings.Contains(msg, "\n") {
		t.Errorf("message not one short line (%d bytes): %q", len(msg), msg)
	}
}

func TestParseTemplateMatchesParse(t *testing.T) {
	p := newPod(ann{KeyMemory: "2048", KeyNumDevices: "2"}).pod
	viaPod, err1 := Parse(p)
	viaTemplate, err2 := ParseTemplate(p.Annotations, &p.Spec)
	if err1 != nil || err2 != nil {
		t.Fatalf("errors: %v, %v", err1, err2)
	}
	if diff := cmp.Diff(viaPod, viaTemplate, cmp.AllowUnexported(Fraction{})); diff != "" {
		t.Errorf("(-Parse +ParseTemplate):\n%s", diff)
	}
}
