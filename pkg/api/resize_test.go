package api

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestDesiredMemoryResolvesAgainstTheAllocation(t *testing.T) {
	now := Memory{RequestMiB: 8192, LimitMiB: 12288}
	for _, c := range []struct {
		name    string
		keys    map[string]string
		want    Memory
		asked   bool
		wantErr string
	}{
		{"nothing asked", nil, now, false, ""},
		{"both", map[string]string{KeyResizeRequest: "16Gi", KeyResizeLimit: "20Gi"}, Memory{16384, 20480}, true, ""},
		{"a grow keeps a larger limit", map[string]string{KeyResizeRequest: "10Gi"}, Memory{10240, 12288}, true, ""},
		{"a grow past the limit raises it", map[string]string{KeyResizeRequest: "16Gi"}, Memory{16384, 16384}, true, ""},
		{"a shrink keeps the limit", map[string]string{KeyResizeRequest: "4Gi"}, Memory{4096, 12288}, true, ""},
		{"a limit alone keeps the request", map[string]string{KeyResizeLimit: "40Gi"}, Memory{8192, 40960}, true, ""},
		{"a limit below the request lowers it", map[string]string{KeyResizeLimit: "2Gi"}, Memory{2048, 2048}, true, ""},
		{"whitespace", map[string]string{KeyResizeRequest: " 16Gi "}, Memory{16384, 16384}, true, ""},
		{"limit below request", map[string]string{KeyResizeRequest: "16Gi", KeyResizeLimit: "8Gi"}, now, true,
			`gpufrac.io/resize.gpu-memory.limit "8Gi" must be at least gpufrac.io/resize.gpu-memory.request (16Gi)`},
		{"no unit", map[string]string{KeyResizeRequest: "4096"}, now, true, `gpufrac.io/resize.gpu-memory.request "4096" must be a quantity with a unit`},
		{"not a quantity", map[string]string{KeyResizeLimit: "lots"}, now, true, `gpufrac.io/resize.gpu-memory.limit "lots" must be a Kubernetes quantity`},
		{"zero", map[string]string{KeyResizeRequest: "0Gi"}, now, true, `must be greater than 0`},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, asked, err := DesiredMemory(c.keys, now)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("error %v, want one saying %q", err, c.wantErr)
				}
				if got != now || !asked {
					t.Errorf("on error got %v asked=%v, want the allocation and asked", got, asked)
				}
				return
			}
			if err != nil || got != c.want || asked != c.asked {
				t.Errorf("got %v asked=%v err=%v, want %v asked=%v", got, asked, err, c.want, c.asked)
			}
			// A fixed point: once granted, the same keys ask for nothing more.
			again, _, err := DesiredMemory(c.keys, got)
			if err != nil || again != got {
				t.Errorf("resolved against its own result: %v %v, want %v", again, err, got)
			}
		})
	}
}

func TestResizeOfSaysWhatEachWriterSaid(t *testing.T) {
	a := Assignment{Container: "main", Devices: []string{"GPU-1"}, RequestMiB: 16384, LimitMiB: 16384, Mode: TimeSlicing}
	from := Memory{RequestMiB: 8192, LimitMiB: 8192}
	for _, c := range []struct {
		name                   string
		annotations            map[string]string
		wanted, applying, done bool
		enforced, charged      Memory
	}{
		{"never resized", map[string]string{}, false, false, false, Memory{16384, 16384}, Memory{16384, 16384}},
		{"asked", map[string]string{KeyResizeRequest: "32Gi"}, true, false, false, Memory{16384, 16384}, Memory{16384, 16384}},
		{"granted a grow, not applied", map[string]string{KeyResizeRequest: "16Gi", ResizedFromAnnotation: from.String()}, false, true, false, from, Memory{16384, 16384}},
		{"applied", map[string]string{KeyResizeRequest: "16Gi", ResizedFromAnnotation: from.String(), EnforcedAnnotation: Memory{16384, 16384}.String()}, false, false, true, Memory{16384, 16384}, Memory{16384, 16384}},
		{"granted a shrink, not applied: the old memory is charged", map[string]string{KeyResizeRequest: "16Gi", ResizedFromAnnotation: Memory{32768, 40960}.String()}, false, true, false, Memory{32768, 40960}, Memory{32768, 40960}},
		{"the node's record outranks the scheduler's", map[string]string{ResizedFromAnnotation: Memory{32768, 32768}.String(), EnforcedAnnotation: from.String()}, false, true, false, from, Memory{16384, 16384}},
		{"an unreadable record counts as absent", map[string]string{EnforcedAnnotation: "lots"}, false, false, false, Memory{16384, 16384}, Memory{16384, 16384}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, err := ResizeOf(c.annotations, a)
			if err != nil {
				t.Fatal(err)
			}
			if r.Wanted() != c.wanted || r.Applying() != c.applying || r.Done() != c.done || r.Enforced != c.enforced || r.Charged() != c.charged {
				t.Errorf("got wanted=%v applying=%v done=%v enforced=%v charged=%v, want %v %v %v %v %v",
					r.Wanted(), r.Applying(), r.Done(), r.Enforced, r.Charged(), c.wanted, c.applying, c.done, c.enforced, c.charged)
			}
		})
	}
}

func TestResizeDecisionIsReadBackAsGranted(t *testing.T) {
	a := Assignment{Container: "main", Devices: []string{"GPU-1"}, RequestMiB: 8192, LimitMiB: 8192, Mode: SMSharing, Portion: Thousandths(100)}
	annotations := a.Annotations()
	annotations[KeyResizeRequest] = "16Gi"
	r, err := ResizeOf(annotations, a)
	if err != nil || !r.Wanted() {
		t.Fatalf("%+v %v", r, err)
	}
	after := ResizeDecision(a, r, r.Desired).Apply(annotations)
	as, err := ParseAssignments(after)
	if err != nil || len(as) != 1 {
		t.Fatal(as, err)
	}
	granted, err := ResizeOf(after, as[0])
	if err != nil || granted.Wanted() || !granted.Applying() || granted.Enforced != (Memory{8192, 8192}) {
		t.Errorf("after the decision: %+v %v", granted, err)
	}
	if as[0].Mode != SMSharing || as[0].Portion != a.Portion || as[0].RequestMiB != 16384 {
		t.Errorf("the decision changed more than the memory: %+v", as[0])
	}
	applied := EnforcedWrite(granted.Allocated).Apply(after)
	if done, _ := ResizeOf(applied, as[0]); !done.Done() {
		t.Errorf("after the node's record: %+v", done)
	}
}

func TestParseMemoryRefusesWhatNoWriterWrites(t *testing.T) {
	for _, s := range []string{"", "request=1Mi", "request=2Mi,limit=1Mi", "request=0Mi,limit=0Mi", "limit=1Mi,request=1Mi", "request=1Gi,limit=1Gi", "request=-1Mi,limit=1Mi"} {
		if m, err := ParseMemory(s); err == nil {
			t.Errorf("ParseMemory(%q) = %v, want an error", s, m)
		}
	}
	m := Memory{RequestMiB: 1, LimitMiB: 1 << 30} // 1Pi, the most a quantity key takes
	if got, err := ParseMemory(m.String()); err != nil || got != m {
		t.Errorf("round trip of %v: %v %v", m, got, err)
	}
}

func TestResizeStatusPatchKeepsTransitionTimes(t *testing.T) {
	earlier := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "u1"}, Status: corev1.PodStatus{Conditions: []corev1.PodCondition{
		{Type: ConditionResizePending, Status: corev1.ConditionTrue, Reason: ReasonResizeDeferred, LastTransitionTime: earlier},
	}}}
	now := metav1.NewTime(time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC))
	raw, err := ResizeStatusPatch(pod, "42", EnforcedWrite(Memory{1, 2}), now,
		ResizeCondition(ConditionResizePending, corev1.ConditionTrue, ReasonResizeInfeasible, "x"),
		ResizeCondition(ConditionResizeInProgress, corev1.ConditionFalse, ReasonResizeDone, "y"))
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Metadata struct {
			UID             string            `json:"uid"`
			ResourceVersion string            `json:"resourceVersion"`
			Annotations     map[string]string `json:"annotations"`
		} `json:"metadata"`
		Status corev1.PodStatus `json:"status"`
	}
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	if got.Metadata.UID != "u1" || got.Metadata.ResourceVersion != "42" || got.Metadata.Annotations[EnforcedAnnotation] != "request=1Mi,limit=2Mi" {
		t.Errorf("metadata: %+v", got.Metadata)
	}
	if c := got.Status.Conditions; len(c) != 2 || !c[0].LastTransitionTime.Equal(&earlier) || !c[1].LastTransitionTime.Equal(&now) {
		t.Errorf("conditions: %+v", c)
	}
}

func TestDescribeResize(t *testing.T) {
	a := Assignment{Container: "main", Devices: []string{"GPU-1"}, RequestMiB: 16384, LimitMiB: 16384, Mode: TimeSlicing}
	pending := corev1.PodCondition{Type: ConditionResizePending, Status: corev1.ConditionTrue, Reason: ReasonResizeDeferred}
	refused := corev1.PodCondition{Type: ConditionResizeInProgress, Status: corev1.ConditionTrue, Reason: ReasonResizeError}
	for _, c := range []struct {
		annotations map[string]string
		conditions  []corev1.PodCondition
		want        string
	}{
		{map[string]string{}, nil, ""},
		{map[string]string{KeyResizeRequest: "40Gi"}, nil, "resize to 40Gi/40Gi not decided yet"},
		{map[string]string{KeyResizeRequest: "40Gi"}, []corev1.PodCondition{pending}, "resize to 40Gi/40Gi deferred"},
		{map[string]string{KeyResizeRequest: "16Gi", ResizedFromAnnotation: "request=8192Mi,limit=8192Mi"}, nil, "resize to 16Gi/16Gi being applied (the node holds it to 8Gi/8Gi)"},
		{map[string]string{KeyResizeRequest: "16Gi", ResizedFromAnnotation: "request=32768Mi,limit=32768Mi"}, []corev1.PodCondition{refused}, "resize to 16Gi/16Gi refused by the node, which holds it to 32Gi/32Gi"},
		{map[string]string{KeyResizeRequest: "16Gi", EnforcedAnnotation: "request=16384Mi,limit=16384Mi"}, nil, ""},
	} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: c.annotations}, Status: corev1.PodStatus{Conditions: c.conditions}}
		if got := DescribeResize(pod, a); got != c.want {
			t.Errorf("%v %v: got %q, want %q", c.annotations, c.conditions, got, c.want)
		}
	}
}

func TestQuotaBoundsGPUMemory(t *testing.T) {
	for name, want := range map[corev1.ResourceName]bool{
		"requests.gpufrac.io/gpu-memory": true, "gpufrac.io/gpu-memory": true, "limits.gpufrac.io/gpu-memory": true,
		"requests.nvidia.com/gpu": false, "requests.memory": false, "requests.gpufrac.io/gpu-memory-x": false,
	} {
		if got := QuotaBoundsGPUMemory(corev1.ResourceList{name: {}}); got != want {
			t.Errorf("%s: %v, want %v", name, got, want)
		}
	}
}
