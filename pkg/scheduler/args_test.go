package scheduler

import (
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
)

func TestDecodeArgs(t *testing.T) {
	a, err := DecodeArgs(nil)
	if err != nil || a.Policy != "gpufrac" || a.ReservationNamespace != DefaultReservationNamespace || a.BindTimeout.Duration != DefaultBindTimeout ||
		a.DeviceNaming != DeviceNamingUUID || a.CDIKind() != "" {
		t.Fatalf("defaults: %+v, %v", a, err)
	}
	if a.MaxMoves() != DefaultConsolidationMaxMoves {
		t.Errorf("default consolidation budget %d, want %d", a.MaxMoves(), DefaultConsolidationMaxMoves)
	}
	if off, err := DecodeArgs(&runtime.Unknown{Raw: []byte(`{"consolidationMaxMoves":0}`)}); err != nil || off.MaxMoves() != 0 {
		t.Errorf("consolidationMaxMoves 0: %d, %v; want consolidation off", off.MaxMoves(), err)
	}
	a, err = DecodeArgs(&runtime.Unknown{Raw: []byte("policy: spread\nbindTimeout: 30s\n"), ContentType: runtime.ContentTypeYAML})
	if err != nil || a.Policy != "spread" || a.BindTimeout.Duration != 30*time.Second {
		t.Fatalf("YAML args: %+v, %v", a, err)
	}
	for raw, want := range map[string]string{
		`{"policy":"best"}`:                                `policy "best" is not known: use one of gpufrac, fgd, bestfit, gpupacking, dotprod, spread`,
		`{"polcy":"fgd"}`:                                  `unknown field "polcy"`,
		`{"gpuMemoryReserveMiB":512}`:                      "the reserve is set once, on the node agent (--gpu-memory-reserve-mib",
		`{"gpuMemoryReserveMiBByModel":{"A100":5}}`:        "remove it from the scheduler's args",
		`{"reservationNamespace":"Bad_NS"}`:                `reservationNamespace "Bad_NS" is not a namespace name`,
		`{"bindTimeout":"soon"}`:                           `time: invalid duration "soon"`,
		`{"bindTimeout":"10ms"}`:                           "bindTimeout 10ms must be at least 1s",
		`{"reservationImage":"pause 3"}`:                   `reservationImage "pause 3" must be an image reference without spaces`,
		`{"deviceNaming":"CDI"}`:                           `deviceNaming "CDI" must be uuid (bare GPU UUIDs) or cdi (k8s.device-plugin.nvidia.com/gpu=<UUID>, for NVIDIA's node operator on CDI clusters)`,
		`{"policy":"random"}`:                              `policy "random" is not known`,
		`{"policy":"gpufrac","gpuMemoryReserveMiB":"1Gi"}`: "cannot unmarshal string",
		`{"consolidationMaxMoves":-1}`:                     "consolidationMaxMoves -1 must be 0 (no consolidation) or more",
	} {
		_, err := DecodeArgs(&runtime.Unknown{Raw: []byte(raw)})
		if err == nil || !strings.Contains(err.Error(), want) || !strings.HasPrefix(err.Error(), "GPUFractions args: ") || strings.Contains(err.Error(), "\n") {
			t.Errorf("DecodeArgs(%s) = %v, want one line containing %q", raw, err, want)
		}
	}
}

// FuzzDecodeArgs: any input is either valid arguments or one clear error,
// never a panic.
func FuzzDecodeArgs(f *testing.F) {
	for _, seed := range []string{`{}`, `{"policy":"spread","bindTimeout":"1m"}`, `policy: fgd`, `{"gpuMemoryReserveMiBByModel":{"x":1}}`, `[`, `null`} {
		f.Add([]byte(seed), true)
		f.Add([]byte(seed), false)
	}
	f.Fuzz(func(t *testing.T, raw []byte, yaml bool) {
		u := &runtime.Unknown{Raw: raw}
		if yaml {
			u.ContentType = runtime.ContentTypeYAML
		}
		a, err := DecodeArgs(u)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "GPUFractions args: ") {
				t.Fatalf("error without the plugin's name: %v", err)
			}
			return
		}
		if err := a.Validate(); err != nil {
			t.Fatalf("decoded args fail validation: %v", err)
		}
	})
}
