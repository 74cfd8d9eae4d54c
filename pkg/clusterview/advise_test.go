package clusterview

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpufrac/gpufrac/pkg/api"
)

func i64(v int64) *int64 { return &v }

func usage(now, p95 int64, samples int) *api.PodGPUUsage {
	return &api.PodGPUUsage{UsedMiB: i64(now), P95MiB: i64(p95), MaxMiB: i64(p95), SMAvgPercent: i64(0), Samples: samples, SMSamples: samples, SpanSeconds: int64(samples-1) * 30}
}

func TestAdvise(t *testing.T) {
	share := func(request, limit int64, u *api.PodGPUUsage) Tenant {
		return Tenant{Pod: "ml/nb", RequestMiB: request, LimitMiB: limit, Use: u}
	}
	for _, tt := range []struct {
		name    string
		tenants []Tenant
		want    int64 // 0: no advice
	}{
		{"idle: p95 400Mi of 8Gi, with a fifth more, rounded up", []Tenant{share(8192, 8192, usage(380, 400, 120))}, 512},
		{"never below what it holds now", []Tenant{share(8192, 8192, usage(2000, 400, 120))}, 2048},
		{"busy within its request: nothing", []Tenant{share(8192, 8192, usage(7800, 7900, 120))}, 0},
		{"saving under a fifth: nothing", []Tenant{share(8192, 8192, usage(5000, 5500, 120))}, 0},
		{"above its request: grow", []Tenant{share(4096, 8192, usage(6000, 6100, 120))}, 7424},
		{"too few readings", []Tenant{share(8192, 8192, usage(100, 100, MinAdviceSamples-1))}, 0},
		{"use unknown", []Tenant{share(8192, 8192, nil)}, 0},
		{"two GPUs: the one it uses most", []Tenant{share(8192, 8192, usage(300, 300, 20)), share(8192, 8192, usage(3000, 3000, 20))}, 3840},
		{"one GPU unknown: nothing", []Tenant{share(8192, 8192, usage(300, 300, 20)), share(8192, 8192, nil)}, 0},
		{"a claim's share is not resized by annotation", []Tenant{{Pod: "ml/c/r", Claim: true, RequestMiB: 8192, LimitMiB: 8192, Use: usage(10, 10, 20)}}, 0},
	} {
		a := Advise(tt.tenants[0].Pod, tt.tenants)
		var got int64
		if a != nil {
			got = a.RequestMiB
		}
		if got != tt.want {
			t.Errorf("%s: advice %+v, want request %d", tt.name, a, tt.want)
			continue
		}
		if a != nil && !strings.HasPrefix(a.Command, "kubectl annotate pod -n ml nb "+api.KeyResizeRequest+"=") {
			t.Errorf("%s: command %q", tt.name, a.Command)
		}
	}
	if a := Advise("ml/nb", []Tenant{share(8192, 8192, usage(380, 400, 120))}); a.Command != "kubectl annotate pod -n ml nb gpufrac.io/resize.gpu-memory.request=512Mi --overwrite" {
		t.Errorf("command %q", a.Command)
	}
}

func TestIdleAndNearLimit(t *testing.T) {
	idleShare := Tenant{RequestMiB: 8192, LimitMiB: 8192, Use: usage(100, 120, 10)}
	if !idle(idleShare) || nearLimit(idleShare) {
		t.Errorf("idle share: idle %v, near %v", idle(idleShare), nearLimit(idleShare))
	}
	computing := idleShare
	computing.Use = usage(100, 120, 10)
	computing.Use.SMAvgPercent = i64(3)
	if idle(computing) {
		t.Error("a share that computes is not idle")
	}
	full := Tenant{RequestMiB: 4096, LimitMiB: 8192, Use: usage(7500, 7000, 10)}
	if !nearLimit(full) || idle(full) {
		t.Errorf("full share: idle %v, near %v", idle(full), nearLimit(full))
	}
}

// Top's used column and the advice, rendered.
func TestRenderShowsUseAndAdvice(t *testing.T) {
	v := View{Nodes: []Node{{Name: "n1", GPUs: 1, MemoryMiB: 81920, Ready: true, Shared: []GPU{{UUID: "GPU-a", Mode: api.TimeSlicing,
		Tenants: []Tenant{{Pod: "ml/nb", RequestMiB: 8192, LimitMiB: 8192, Use: usage(380, 400, 120)},
			{Pod: "ml/unknown", RequestMiB: 4096, LimitMiB: 4096}}}}}}}
	adviseAll(&v)
	var out bytes.Buffer
	if err := Render(&out, v); err != nil {
		t.Fatal(err)
	}
	if err := RenderAdvice(&out, v); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	for _, want := range []string{"request   limit    used", "ml/nb", "380Mi", "ml/unknown", "ml/nb: shrink the request 8Gi → 512Mi",
		"p95 of use 400Mi over 59m30s (120 readings), holds 380Mi now", "gpufrac.io/resize.gpu-memory.request=512Mi"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, "ml/unknown") && !strings.HasSuffix(strings.TrimSpace(line), "-") {
			t.Errorf("unknown use not shown as -: %q", line)
		}
	}
}

func TestHistoryKeepsAnHourOfReadingsOnce(t *testing.T) {
	h := NewHistory(time.Hour)
	start := time.Unix(1_000_000, 0)
	view := func(at time.Time, mib int64, pods ...string) View {
		g := GPU{UUID: "GPU-a", Use: &api.GPUUsage{UsedMiB: i64(mib)}}
		for _, p := range pods {
			g.Tenants = append(g.Tenants, Tenant{Pod: p, Use: &api.PodGPUUsage{UsedMiB: i64(mib)}})
		}
		return View{Nodes: []Node{{Name: "n1", UsageAt: at, Shared: []GPU{g}}}}
	}
	for i := range 150 {
		v := view(start.Add(time.Duration(i)*30*time.Second), int64(i), "ml/a", "ml/b")
		h.Record(v)
		h.Record(v) // a rebuild with no new reading adds nothing
	}
	v := view(start.Add(149*30*time.Second), 149, "ml/a")
	h.Record(v)
	h.Attach(&v)
	g := v.Nodes[0].Shared[0]
	if n := len(g.History); n != 120 || g.History[0].UsedMiB != 30 || g.History[n-1].UsedMiB != 149 {
		t.Errorf("GPU history: %d readings, from %+v", n, g.History[0])
	}
	if n := len(g.Tenants[0].History); n != 120 {
		t.Errorf("tenant history: %d readings, want the hour's 120", n)
	}
	if _, ok := h.tenants["n1/GPU-a/ml/b"]; ok {
		t.Error("a tenant gone is remembered")
	}
}

// Top marks the tenants above their request with their place in the
// reclaim order, the lowest priority first; one within its request, or
// whose use is unknown, is never in it.
func TestRenderShowsTheReclaimOrder(t *testing.T) {
	g := GPU{UUID: "GPU-a", Mode: api.TimeSlicing, Tenants: []Tenant{
		{Pod: "ml/prod", RequestMiB: 8192, LimitMiB: 16384, Priority: 1000, Use: usage(12288, 12288, 10)},
		{Pod: "ml/nb", RequestMiB: 8192, LimitMiB: 16384, Use: usage(9216, 9216, 10)},
		{Pod: "ml/within", RequestMiB: 8192, LimitMiB: 16384, Priority: -1, Use: usage(8192, 8192, 10)},
		{Pod: "ml/unknown", RequestMiB: 4096, LimitMiB: 8192},
	}}
	g.ReclaimOrder = reclaimOrder(g.Tenants)
	if want := []string{"ml/nb", "ml/prod"}; !slices.Equal(g.ReclaimOrder, want) {
		t.Fatalf("order %v, want %v", g.ReclaimOrder, want)
	}
	var out bytes.Buffer
	if err := Render(&out, View{Nodes: []Node{{Name: "n1", GPUs: 1, MemoryMiB: 81920, Ready: true, Shared: []GPU{g}}}}); err != nil {
		t.Fatal(err)
	}
	marks := map[string]string{"ml/nb": "reclaim #1", "ml/prod": "reclaim #2", "ml/within": "", "ml/unknown": ""}
	for _, line := range strings.Split(out.String(), "\n") {
		for pod, mark := range marks {
			if !strings.Contains(line, pod) {
				continue
			}
			if has := strings.Contains(line, "reclaim #"); has != (mark != "") || !strings.Contains(line, mark) {
				t.Errorf("line %q, want mark %q", line, mark)
			}
			if len(line) > 80 {
				t.Errorf("line of %d columns: %q", len(line), line)
			}
		}
	}
}
