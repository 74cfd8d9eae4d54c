package api

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

// FuzzParse feeds Parse arbitrary annotation maps, written one key=value
// per line, on a pod with a plain and a dotted container. Parse must never
// panic, and whatever it accepts must satisfy the Request invariants.
func FuzzParse(f *testing.F) {
	seeds := []string{
		"gpu-fraction=0.5",
		"gpu-fraction=0.5\ngpu-fraction.limit=0.75",
		"gpu-fraction=0.5\ngpu-fraction.limit=0.750001",
		"gpu-fraction=NaN",
		"gpu-fraction=500m",
		"gpu-fraction=50",
		"gpu-memory=4096\ngpu-memory.limit=8Gi",
		"gpu-memory=4096\ngpu-memory.limit=8192",
		"gpu-memory=4096\ngpu-fraction-num-devices=2",
		"gpu-fraction=0.25\nkai.scheduler/gpu-compute-sharing-mode=sm-sharing",
		"gpu-fraction=0.25\ngpu-fraction-container-name=llm.v2",
		"nvidia.com/container.main.gpu-memory.request=4Gi",
		"nvidia.com/container.main.gpu-memory.limit=7680Mi",
		"nvidia.com/container.llm.v2.gpu-memory.request=1Gi\nnvidia.com/container.llm.v2.gpu-memory.limit=2Gi",
		"nvidia.com/container.main.gpus.devices=GPU-1",
		"nvidia.com/container.main.gpu-compute.portion=0.5",
		"nvidia.com/container.main.gpu-compute.mode=sm-sharing\ngpu-memory=1",
		"nvidia.com/container.main.gpu-memory=1Gi",
		"nvidia.com/container.main.gpus.devices=GPU-a,GPU-b\nnvidia.com/container.main.gpu-memory.request=4Gi\nnvidia.com/container.main.gpu-compute.mode=sm-sharing\nnvidia.com/container.main.gpu-compute.portion=0.5",
		"gpu-fraction=0.5\nnvidia.com/container.main.gpus.devices=GPU-a\nnvidia.com/container.main.gpu-memory.limit=40448Mi",
		"gpu-fraction=0.5\nkai.scheduler/container.main.gpu-memory.portion.limit=0.75",
		"gpu-fraction=5e-1\ngpu-fraction.limit=0.75\nkai.scheduler/container.main.gpu-memory.portion.limit=0.75",
		"gpu-fraction-container-name=main",
		"gpu-fraction=0.5\nnvidia.com/container.main.gpu-memory.request=4Gi",
		"nvidia.com/container.main.gpus.devices=k8s.device-plugin.nvidia.com/gpu=GPU-a\nnvidia.com/container.main.gpu-memory.request= 2Gi \nnvidia.com/container.main.gpu-compute.mode=sm-sharing",
		"nvidia.com/container.main.gpus.devices=GPU-a\nnvidia.com/container.main.gpu-memory.request=2Gi\nnvidia.com/container.main.gpu-compute.mode=sm-sharing\nnvidia.com/container.main.gpu-compute.portion=2.5e-1",
		"nvidia.com/container.main.gpus.devices=GPU-a\nnvidia.com/container.main.gpu-memory.request=2Gi\nnvidia.com/container.main.gpu-compute.mode=mps",
	}
	for _, s := range seeds {
		f.Add(s, false)
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, spec string, wholeGPU bool) {
		annotations := map[string]string{}
		for _, line := range strings.Split(spec, "\n") {
			k, v, _ := strings.Cut(line, "=")
			annotations[k] = v
		}
		b := newPod(annotations, "main", "llm.v2")
		if wholeGPU {
			b.wholeGPUs(0, "1")
		}
		checkAssignments(t, b.pod.Annotations)
		reqs, err := Parse(b.pod)
		again, errAgain := Parse(b.pod)
		if !reflect.DeepEqual(reqs, again) || (err == nil) != (errAgain == nil) || (err != nil && err.Error() != errAgain.Error()) {
			t.Fatalf("Parse is not deterministic: %v/%v then %v/%v", reqs, err, again, errAgain)
		}
		if err != nil {
			var list ErrorList
			if !errors.As(err, &list) || len(list) == 0 {
				t.Fatalf("error %T %v is not a non-empty ErrorList", err, err)
			}
			if strings.ContainsAny(err.Error(), "\n\r") {
				t.Fatalf("error spans several lines: %q", err)
			}
			if reqs != nil {
				t.Fatalf("requests %v returned with error %v", reqs, err)
			}
			return
		}
		if reqs == nil {
			return
		}
		if len(reqs) != 1 {
			t.Fatalf("%d fractional containers accepted", len(reqs))
		}
		checkInvariants(t, reqs[0])
	})
}

func checkInvariants(t *testing.T, r Request) {
	t.Helper()
	if r.Container != "main" && r.Container != "llm.v2" {
		t.Fatalf("request for unknown container %q", r.Container)
	}
	if r.Devices < 1 {
		t.Fatalf("devices %d < 1", r.Devices)
	}
	if _, ok := ParseComputeMode(string(r.Mode)); !ok {
		t.Fatalf("invalid mode %q", r.Mode)
	}
	if r.Memory.IsFraction() != r.Limit.IsFraction() {
		t.Fatalf("request %v and limit %v are of different kinds", r.Memory, r.Limit)
	}
	if r.Memory.IsFraction() {
		for _, f := range []Fraction{r.Memory.Fraction, r.Limit.Fraction} {
			if f.IsZero() || f.IsOne() || f.Float64() <= 0 || f.Float64() >= 1 {
				t.Fatalf("fraction %s outside (0,1)", f)
			}
		}
		if r.Limit.Fraction.Cmp(r.Memory.Fraction) < 0 {
			t.Fatalf("limit %s < request %s", r.Limit.Fraction, r.Memory.Fraction)
		}
	} else if r.Memory.MiB <= 0 || r.Limit.MiB < r.Memory.MiB {
		t.Fatalf("memory request %dMi, limit %dMi: want 0 < request ≤ limit", r.Memory.MiB, r.Limit.MiB)
	}
	if res, err := r.Resolve(81920, 1024); err == nil && (res.RequestMiB <= 0 || res.LimitMiB < res.RequestMiB) {
		t.Fatalf("resolved %+v: want 0 < request ≤ limit", res)
	}
}

// checkAssignments holds ParseAssignments, which the node side trusts, to
// the same standard: no panic, nothing accepted that it could not enforce,
// and what it accepts written back by Assignment.Annotations reads the same.
func checkAssignments(t *testing.T, annotations map[string]string) {
	t.Helper()
	as, err := ParseAssignments(annotations)
	if err != nil && strings.ContainsAny(err.Error(), "\n\r") {
		t.Fatalf("error spans several lines: %q", err)
	}
	for _, a := range as {
		seen := map[string]bool{}
		for _, d := range a.Devices {
			if !isGPUUUID(d) || seen[d] {
				t.Fatalf("devices %q: not a UUID, or repeated", a.Devices)
			}
			seen[d] = true
		}
		if len(a.Devices) == 0 || a.RequestMiB <= 0 || a.LimitMiB < a.RequestMiB {
			t.Fatalf("assignment %+v breaks 0 < request <= limit with devices", a)
		}
		if a.Portion.Cmp(Fraction{num: 1}) > 0 || (a.Mode != SMSharing && !a.Portion.IsZero()) {
			t.Fatalf("assignment %+v has a portion outside (0,1] or one without sm-sharing", a)
		}
		switch {
		case a.Mode == "" && err == nil:
			t.Fatalf("assignment %+v without a mode and no error", a)
		case a.Mode == "":
			continue // the caps of a decision whose compute is unreadable
		}
		again, aerr := ParseAssignments(a.Annotations())
		if aerr != nil || len(again) != 1 || !reflect.DeepEqual(again[0], a) {
			t.Fatalf("%+v written back reads %+v, %v", a, again, aerr)
		}
	}
}

// The resize keys and records never panic, and what they accept holds
// 0 < request ≤ limit.
func FuzzResize(f *testing.F) {
	for _, seed := range [][3]string{{"16Gi", "20Gi", "request=1Mi,limit=2Mi"}, {"", "2Gi", ""}, {"1e3Mi", "", "request=0Mi,limit=0Mi"}} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, req, limit, record string) {
		annotations := map[string]string{EnforcedAnnotation: record}
		if req != "" {
			annotations[KeyResizeRequest] = req
		}
		if limit != "" {
			annotations[KeyResizeLimit] = limit
		}
		a := Assignment{Container: "c", Devices: []string{"GPU-1"}, RequestMiB: 100, LimitMiB: 200, Mode: TimeSlicing}
		r, err := ResizeOf(annotations, a)
		for _, m := range []Memory{r.Desired, r.Enforced, r.Charged()} {
			if m.RequestMiB <= 0 || m.LimitMiB < m.RequestMiB {
				t.Fatalf("%v (err %v) from %q: %+v", m, err, annotations, r)
			}
		}
		if m, err := ParseMemory(record); err == nil && m.String() != record {
			t.Fatalf("ParseMemory(%q) = %v, which writes as %q", record, m, m.String())
		}
	})
}
