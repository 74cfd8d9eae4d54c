package api

import (
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"
	"pgregory.net/rapid"
)

func TestParseAssignments(t *testing.T) {
	dev := "nvidia.com/container.main.gpus.devices"
	req := "nvidia.com/container.main.gpu-memory.request"
	limit := "nvidia.com/container.main.gpu-memory.limit"
	mode := "nvidia.com/container.main.gpu-compute.mode"
	portion := "nvidia.com/container.main.gpu-compute.portion"
	half := mustFraction(t, "0.5")
	tests := []struct {
		name    string
		ann     map[string]string
		want    []Assignment
		wantErr string
	}{
		{"no fraction", map[string]string{"a": "b"}, nil, ""},
		{"gpufrac scheduler output for a fraction",
			map[string]string{KeyFraction: "0.5", dev: "GPU-a", req: "40448Mi", limit: "40448Mi", mode: "time-slicing"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 40448, LimitMiB: 40448, Mode: TimeSlicing}}, ""},
		{"KAI-style canonical keys only, two devices, sm-sharing",
			map[string]string{dev: "GPU-a, GPU-b", req: "4Gi", limit: "8Gi", mode: "sm-sharing", portion: "0.5"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a", "GPU-b"}, RequestMiB: 4096, LimitMiB: 8192, Mode: SMSharing, Portion: half}}, ""},
		{"limit alone", map[string]string{dev: "GPU-a", limit: "1Gi"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024, Mode: TimeSlicing}}, ""},
		{"dotted container", map[string]string{"nvidia.com/container.llm.v2.gpus.devices": "GPU-a", "nvidia.com/container.llm.v2.gpu-memory.request": "1Gi"},
			[]Assignment{{Container: "llm.v2", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024, Mode: TimeSlicing}}, ""},
		{"fraction not yet scheduled", map[string]string{KeyFraction: "0.5"}, nil,
			`gpu-fraction "0.5" asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no nvidia.com/container.<container>.gpus.devices)`},
		{"fraction for a named container not yet scheduled", map[string]string{KeyFraction: "0.5", KeyContainerName: "llm.v2"}, nil,
			`container "llm.v2": nvidia.com/container.llm.v2.gpus.devices "" is missing: the container asks for a GPU fraction but no scheduler has assigned it GPUs`},
		{"devices without memory", map[string]string{dev: "GPU-a"}, nil,
			`container "main": nvidia.com/container.main.gpu-memory.request "" is missing: the scheduler writes the resolved memory request with the devices`},
		{"duplicate device", map[string]string{dev: "GPU-a,GPU-a", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "GPU-a,GPU-a" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "GPU-a" is listed twice`},
		{"empty device entry", map[string]string{dev: "GPU-a,", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "GPU-a," must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): an entry is empty`},
		{"limit below request", map[string]string{dev: "GPU-a", req: "2Gi", limit: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpu-memory.limit "1Gi" must be at least the memory request (2048Mi)`},
		{"sm-sharing without portion, as released KAI's binder leaves it: the node derives one",
			map[string]string{dev: "GPU-a", req: "1Gi", mode: "sm-sharing"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024, Mode: SMSharing}}, ""},
		{"KAI's binder on a CDI cluster: CDI names, canonical quantities",
			map[string]string{dev: "k8s.device-plugin.nvidia.com/gpu=GPU-a,k8s.device-plugin.nvidia.com/gpu=GPU-b", req: "2Gi", limit: "3Gi"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a", "GPU-b"}, CDIKind: CDIKindNVIDIAGPU, RequestMiB: 2048, LimitMiB: 3072, Mode: TimeSlicing}}, ""},
		{"surrounding whitespace and a portion in exponent form",
			map[string]string{dev: " GPU-a ", req: " 1000Mi", mode: "sm-sharing ", portion: "2.5e-01"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1000, LimitMiB: 1000, Mode: SMSharing, Portion: mustFraction(t, "0.25")}}, ""},
		{"a portion on a time-slicing tenant is ignored (never compute-capped)",
			map[string]string{dev: "GPU-a", req: "1Gi", portion: "0.5"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024, Mode: TimeSlicing}}, ""},
		{"KAI's reservation pod: a mode and a whole GPU ask for no share",
			map[string]string{"nvidia.com/container.resource-reservation.gpu-compute.mode": "sm-sharing", "karpenter.sh/do-not-disrupt": "true"}, nil, ""},
		{"a chart's container name alone asks for nothing", map[string]string{KeyContainerName: "main"}, nil, ""},
		{"a mode written by admission before the scheduler decided", map[string]string{KeyFraction: "0.5", mode: "time-slicing"}, nil,
			`gpu-fraction "0.5" asks for a GPU fraction, but no scheduler has assigned the pod GPUs (no nvidia.com/container.<container>.gpus.devices)`},
		{"device index", map[string]string{dev: "0", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "0" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "0" is not a GPU UUID (GPU-<hex digits and dashes>, as nvidia-smi -L prints); device indices differ from node to node and are not accepted`},
		{"MIG device", map[string]string{dev: "MIG-1234", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "MIG-1234" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "MIG-1234" is not a GPU UUID (GPU-<hex digits and dashes>, as nvidia-smi -L prints); a MIG device cannot be shared by fractions`},
		{"all", map[string]string{dev: "all", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "all" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "all" is not a GPU UUID (GPU-<hex digits and dashes>, as nvidia-smi -L prints)`},
		{"CDI name with a bad kind", map[string]string{dev: "gpu=GPU-a", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "gpu=GPU-a" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "gpu=GPU-a" is not a CDI device name: the kind "gpu" must be <vendor>/<class>, such as k8s.device-plugin.nvidia.com/gpu`},
		{"CDI name and bare UUID mixed", map[string]string{dev: "k8s.device-plugin.nvidia.com/gpu=GPU-a,GPU-b", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "k8s.device-plugin.nvidia.com/gpu=GPU-a,GPU-b" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "GPU-b" is named differently from the first entry: every entry must be a bare UUID, or every one a CDI name of one kind`},
		{"the same GPU under two names", map[string]string{dev: "nvidia.com/gpu=GPU-a,k8s.device-plugin.nvidia.com/gpu=GPU-a", req: "1Gi"}, nil,
			`container "main": nvidia.com/container.main.gpus.devices "nvidia.com/gpu=GPU-a,k8s.device-plugin.nvidia.com/gpu=GPU-a" must be a comma-separated list of distinct GPU UUIDs or CDI device names (<kind>=<UUID>): "k8s.device-plugin.nvidia.com/gpu=GPU-a" is named differently from the first entry: every entry must be a bare UUID, or every one a CDI name of one kind`},
		{"portion above 1: the memory caps are still read", map[string]string{dev: "GPU-a", req: "1Gi", mode: "sm-sharing", portion: "1.5"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024}},
			`container "main": nvidia.com/container.main.gpu-compute.portion "1.5" must be a decimal greater than 0 and at most 1`},
		{"portion as a percentage", map[string]string{dev: "GPU-a", req: "1Gi", mode: "sm-sharing", portion: "50"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024}},
			`container "main": nvidia.com/container.main.gpu-compute.portion "50" must be a decimal greater than 0 and at most 1`},
		{"bad mode: the memory caps are still read", map[string]string{dev: "GPU-a", req: "1Gi", mode: "mps"},
			[]Assignment{{Container: "main", Devices: []string{"GPU-a"}, RequestMiB: 1024, LimitMiB: 1024}},
			`container "main": nvidia.com/container.main.gpu-compute.mode "mps" must be time-slicing or sm-sharing`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newPod(tt.ann, "main", "llm.v2").pod
			got, err := ParseAssignments(p.Annotations)
			gotErr := ""
			if err != nil {
				gotErr = err.Error()
			}
			if gotErr != tt.wantErr {
				t.Fatalf("error:\n got  %q\n want %q", gotErr, tt.wantErr)
			}
			if diff := cmp.Diff(tt.want, got, cmp.AllowUnexported(Fraction{})); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestAsksForFraction(t *testing.T) {
	for ann, want := range map[string]bool{
		"gpu-fraction": true, "gpu-memory": true, "gpu-fraction.limit": true, "gpu-memory.limit": true,
		"nvidia.com/container.main.gpus.devices": true, "nvidia.com/container.main.gpu-memory.request": true,
		"nvidia.com/container.main.gpu-memory.limit": true,
		"nvidia.com/container.main":                  true, // malformed: refused rather than guessed
		"nvidia.com/container..gpu-memory.request":   true,
		"gpu-fraction-container-name":                false,
		"gpu-fraction-num-devices":                   false,
		"kai.scheduler/gpu-compute-sharing-mode":     false,
		"nvidia.com/container.main.gpu-compute.mode": false,
		"app": false,
	} {
		if got := AsksForFraction(map[string]string{ann: "x"}); got != want {
			t.Errorf("AsksForFraction(%s) = %v, want %v", ann, got, want)
		}
	}
}

func TestActiveThreadPercentage(t *testing.T) {
	for portion, want := range map[string]int{"0.5": 50, "0.255": 25, "1": 100, "0.001": 1, "0.999": 99} {
		a := Assignment{Portion: mustFraction(t, portion)}
		if got := a.ActiveThreadPercentage(); got != want {
			t.Errorf("portion %s: %d, want %d", portion, got, want)
		}
	}
}

// What a scheduler writes is read back as written: Assignment.Annotations
// and ParseAssignments are one contract, for every valid assignment and
// every device naming (UUIDs, or the CDI names KAI writes on CDI clusters).
func TestAssignmentAnnotationsRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		want := Assignment{
			// Container names may contain dots, and look like our suffixes.
			Container: rapid.StringMatching(`[a-z]([-a-z0-9.]{0,20}[a-z0-9])?`).Draw(t, "container"),
			Mode:      rapid.SampledFrom([]ComputeMode{TimeSlicing, SMSharing}).Draw(t, "mode"),
		}
		want.CDIKind = rapid.SampledFrom([]string{"", CDIKindNVIDIAGPU, "nvidia.com/gpu"}).Draw(t, "cdi kind")
		for i := range rapid.IntRange(1, 8).Draw(t, "devices") {
			d := "GPU-" + rapid.StringMatching(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{11}`).Draw(t, "uuid") + strconv.Itoa(i)
			want.Devices = append(want.Devices, d)
		}
		want.RequestMiB = rapid.Int64Range(1, 1<<30).Draw(t, "request")
		want.LimitMiB = want.RequestMiB + rapid.Int64Range(0, 1<<30-want.RequestMiB).Draw(t, "burst")
		if want.Mode == SMSharing {
			// 0: no portion written, as released KAI leaves sm-sharing.
			want.Portion = Thousandths(rapid.Int64Range(0, 1000).Draw(t, "thousandths"))
		}
		got, err := ParseAssignments(want.Annotations())
		if err != nil {
			t.Fatalf("%+v wrote %v, which does not read back: %v", want, want.Annotations(), err)
		}
		if diff := cmp.Diff([]Assignment{want}, got, cmp.AllowUnexported(Fraction{})); diff != "" {
			t.Fatalf("wrote %v, read back (-want +got):\n%s", want.Annotations(), diff)
		}
	})
}

func TestThousandths(t *testing.T) {
	for in, want := range map[int64]string{250: "0.25", 1000: "1", 1: "0.001", 333: "0.333", 500: "0.5", 0: "0", 2000: "1", -5: "0"} {
		got := Thousandths(in)
		if got.String() != want {
			t.Errorf("Thousandths(%d) = %s, want %s", in, got, want)
		}
		// The shortest form, as ParseFraction reads it, so that the two compare equal.
		if parsed, err := ParseFraction(want); err != nil || parsed != got {
			t.Errorf("Thousandths(%d) = %#v, ParseFraction(%q) = %#v (%v)", in, got, want, parsed, err)
		}
	}
}

func TestIntentRemovesExactlyTheKeysTheDecisionAdded(t *testing.T) {
	req, limit := ContainerKey("main", SuffixMemoryRequest), ContainerKey("main", SuffixMemoryLimit)
	author := map[string]string{KeyFraction: "0.5", req: "10Gi"}
	added := ResolvedMemoryKeys(author, "main", "")
	if added != SuffixMemoryLimit {
		t.Fatalf("ResolvedMemoryKeys = %q, want only the limit", added)
	}
	if again := ResolvedMemoryKeys(map[string]string{KeyFraction: "0.5", req: "10240Mi", limit: "10240Mi"}, "main", added); again != added {
		t.Errorf("a retry's record %q, want the first attempt's %q", again, added)
	}
	placed := newPod(map[string]string{KeyFraction: "0.5", req: "10240Mi", limit: "10240Mi", ResolvedKeysAnnotation: added,
		ContainerKey("main", SuffixDevices): "GPU-a", GPUGroupsAnnotation: "g"}).pod
	got := Intent(placed).Annotations
	if _, ok := got[limit]; ok || got[req] != "10240Mi" || got[ResolvedKeysAnnotation] != "" || got[GPUGroupsAnnotation] != "" {
		t.Errorf("Intent kept %v", got)
	}
}
