package api

import (
	"errors"
	"testing"
)

func TestParseFraction(t *testing.T) {
	tests := []struct {
		in      string
		want    string
		wantErr error
	}{
		{"0.5", "0.5", nil},
		{".5", "0.5", nil},
		{"0.50000", "0.5", nil},
		{"00.25", "0.25", nil},
		{"1", "1", nil},
		{"1.000", "1", nil},
		{"0", "0", nil},
		{"0.000000000000000001", "0.000000000000000001", nil},
		{"0.1234567890123456789", "", errTooPrecise},
		{"0.10000000000000000000", "0.1", nil},
		{"1.5", "", errAboveOne},
		{"50", "", errAboveOne},
		{"", "", errEmptyDecimal},
		{".", "", errNotDecimal},
		{"5.", "", errNotDecimal},
		{"500m", "", errNotDecimal},
		{"NaN", "", errNotDecimal},
		{"Inf", "", errNotDecimal},
		{"-0.5", "", errNotDecimal},
		{"+0.5", "", errNotDecimal},
		{"5e-1", "", errNotDecimal},
		{"0x1p-1", "", errNotDecimal},
		{"0.5 ", "", errNotDecimal},
		{"0,5", "", errNotDecimal},
		{"٠.٥", "", errNotDecimal},
	}
	for _, tt := range tests {
		got, err := ParseFraction(tt.in)
		if !errors.Is(err, tt.wantErr) {
			t.Errorf("ParseFraction(%q) error = %v, want %v", tt.in, err, tt.wantErr)
			continue
		}
		if err == nil && got.String() != tt.want {
			t.Errorf("ParseFraction(%q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestFractionCmp(t *testing.T) {
	tests := []struct {
		a, b string
		want int
	}{
		{"0.5", "0.50", 0},
		{"0.5", "0.49999", 1},
		{"0.1", "0.100000000000000001", -1},
		{"1", "0.999999999999999999", 1},
		{"0", "0.000000000000000001", -1},
	}
	for _, tt := range tests {
		a, b := mustFraction(t, tt.a), mustFraction(t, tt.b)
		if got := a.Cmp(b); got != tt.want {
			t.Errorf("%s.Cmp(%s) = %d, want %d", tt.a, tt.b, got, tt.want)
		}
		if got := b.Cmp(a); got != -tt.want {
			t.Errorf("%s.Cmp(%s) = %d, want %d", tt.b, tt.a, got, -tt.want)
		}
	}
}

func TestFractionOfIsExactFloor(t *testing.T) {
	tests := []struct {
		f    string
		n    int64
		want int64
	}{
		// 0.3 × 81920 is 24575.999999999996 in float64; the exact answer is 24576.
		{"0.3", 81920, 24576},
		{"0.1", 30, 3},
		{"0.333333", 3, 0},
		{"0.5", 80896, 40448},
		{"0.999999999999999999", 1 << 62, (1 << 62) - 5},
		{"1", 12345, 12345},
		{"0.5", 0, 0},
		{"0.5", -10, 0},
	}
	for _, tt := range tests {
		if got := mustFraction(t, tt.f).Of(tt.n); got != tt.want {
			t.Errorf("%s.Of(%d) = %d, want %d", tt.f, tt.n, got, tt.want)
		}
	}
}

func mustFraction(t *testing.T, s string) Fraction {
	t.Helper()
	f, err := ParseFraction(s)
	if err != nil {
		t.Fatalf("ParseFraction(%q): %v", s, err)
	}
	return f
}

func TestResolve(t *testing.T) {
	half := Request{Container: "main", Memory: Amount{Fraction: mustFraction(t, "0.5")}, Limit: Amount{Fraction: mustFraction(t, "0.75")}, Mode: TimeSlicing, Devices: 1}
	got, err := half.Resolve(81920, 1024)
	if err != nil {
		t.Fatal(err)
	}
	// floor((81920 − 1024) × 0.5) and × 0.75.
	if want := (Resolved{RequestMiB: 40448, LimitMiB: 60672}); got != want {
		t.Errorf("Resolve = %+v, want %+v", got, want)
	}

	abs := Request{Container: "main", Memory: Amount{MiB: 4096}, Limit: Amount{MiB: 8192}, Mode: TimeSlicing, Devices: 1}
	if got, err := abs.Resolve(16384, 1024); err != nil || got != (Resolved{4096, 8192}) {
		t.Errorf("absolute Resolve = %+v, %v", got, err)
	}

	tiny := Request{Container: "main", Memory: Amount{Fraction: mustFraction(t, "0.0001")}, Limit: Amount{Fraction: mustFraction(t, "0.0001")}}
	_, err = tiny.Resolve(4096, 0)
	want := `container "main": request: fraction 0.0001 of a GPU with 4096Mi of memory and 0Mi reserved resolves to 0Mi: the share must resolve to at least 1Mi`
	if err == nil || err.Error() != want {
		t.Errorf("tiny Resolve error = %v, want %s", err, want)
	}
	if _, err := half.Resolve(1024, 2048); err == nil {
		t.Error("reserve above total resolved without error")
	}
}

func TestRequestString(t *testing.T) {
	r := Request{Container: "llm.v2", Memory: Amount{Fraction: mustFraction(t, "0.25")}, Limit: Amount{Fraction: mustFraction(t, "0.5")}, Mode: SMSharing, Devices: 2}
	want := "container=llm.v2 request=0.25 limit=0.5 mode=sm-sharing devices=2"
	if got := r.String(); got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	r = Request{Container: "main", Memory: Amount{MiB: 4096}, Limit: Amount{MiB: 4096}, Mode: TimeSlicing, Devices: 1}
	if got, want := r.String(), "container=main request=4096Mi limit=4096Mi mode=time-slicing devices=1"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func TestSplitContainerKey(t *testing.T) {
	tests := []struct {
		key, container, suffix string
		ok                     bool
	}{
		{"nvidia.com/container.main.gpu-memory.request", "main", SuffixMemoryRequest, true},
		{"nvidia.com/container.a.b.c.gpu-compute.mode", "a.b.c", SuffixComputeMode, true},
		{"nvidia.com/container.x.gpus.devices", "x", SuffixDevices, true},
		{"nvidia.com/container.x.gpu-compute.portion", "x", SuffixComputePortion, true},
		{"nvidia.com/container.x.gpu-memory", "x.gpu-memory", "", true},
		{"nvidia.com/container.gpu-memory.request", "gpu-memory.request", "", true},
		{"nvidia.com/gpu.product", "", "", false},
		{"gpu-fraction", "", "", false},
	}
	for _, tt := range tests {
		c, s, ok := SplitContainerKey(tt.key)
		if c != tt.container || s != tt.suffix || ok != tt.ok {
			t.Errorf("SplitContainerKey(%q) = %q, %q, %v; want %q, %q, %v", tt.key, c, s, ok, tt.container, tt.suffix, tt.ok)
		}
		if ok && s != "" && ContainerKey(c, s) != tt.key {
			t.Errorf("ContainerKey(%q, %q) does not round-trip to %q", c, s, tt.key)
		}
	}
	if !IsSchedulerOwned("nvidia.com/container.a.b.gpus.devices") || IsSchedulerOwned("nvidia.com/container.a.gpu-memory.request") {
		t.Error("IsSchedulerOwned misclassifies keys")
	}
	if !IsFractionKey(KeyFraction) || !IsFractionKey("nvidia.com/container.a.anything") || IsFractionKey("nvidia.com/gpu.count") {
		t.Error("IsFractionKey misclassifies keys")
	}
}

func TestWithinOneEdit(t *testing.T) {
	tests := []struct {
		a, b string
		want bool
	}{
		{"gpu-fraction", "gpu-fraction", true},
		{"gpu-fracton", "gpu-fraction", true},
		{"gpu-fractiox", "gpu-fraction", true},
		{"gpu-fractionn", "gpu-fraction", true},
		{"xgpu-fraction", "gpu-fraction", true},
		{"gpu-fractio", "gpu-fraction", true},
		{"gpu-frction", "gpu-fraction", true},
		{"gpu-frctn", "gpu-fraction", false},
		{"gpu-memory", "gpu-fraction", false},
		{"", "a", true},
		{"", "ab", false},
	}
	for _, tt := range tests {
		if got := withinOneEdit(tt.a, tt.b); got != tt.want {
			t.Errorf("withinOneEdit(%q, %q) = %v, want %v", tt.a, tt.b, got, tt.want)
		}
		if got := withinOneEdit(tt.b, tt.a); got != tt.want {
			t.Errorf("withinOneEdit(%q, %q) = %v, want %v", tt.b, tt.a, got, tt.want)
		}
	}
}
