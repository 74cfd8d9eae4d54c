package admission

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

const scheduler = DefaultSchedulerUser

var identity = Identity{Users: []string{scheduler}}

func pod(annotations map[string]string, node string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", Annotations: annotations},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
	}
}

type ann = map[string]string

// reviewCase is one ReviewPod call and the denial it must give ("": none).
type reviewCase struct {
	name    string
	op      Operation
	user    string
	old     *corev1.Pod
	pod     *corev1.Pod
	wantErr string
}

func checkReviews(t *testing.T, id Identity, tests []reviewCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := id.ReviewPod(tt.op, tt.user, tt.old, tt.pod)
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.wantErr {
				t.Errorf("ReviewPod error:\n got  %q\n want %q", got, tt.wantErr)
			}
		})
	}
}

func TestReviewPod(t *testing.T) {
	const fixed = `cannot be added, changed or removed after the pod is created: a pod's GPU fraction is fixed (and charged to its namespace's quota) at creation; delete and recreate the pod with the annotations it needs`
	devices := "nvidia.com/container.main.gpus.devices"
	portion := "nvidia.com/container.main.gpu-compute.portion"
	resolvedReq := "nvidia.com/container.main.gpu-memory.request"
	scheduled := ann{"gpu-fraction": "0.5", devices: "GPU-1", resolvedReq: "40448Mi"}
	tests := []reviewCase{
		{"valid create", Create, "alice", nil, pod(ann{"gpu-fraction": "0.5"}, ""), ""},
		{"invalid create names the rule", Create, "alice", nil, pod(ann{"gpu-fraction": "1"}, ""),
			`container "main": gpu-fraction "1" must be greater than 0 and less than 1`},
		{"forged devices on create", Create, "alice", nil, pod(ann{"gpu-fraction": "0.5", devices: "GPU-1"}, ""),
			`container "main": nvidia.com/container.main.gpus.devices "GPU-1" is written by the scheduler and cannot be set in a manifest: remove it`},
		{"scheduler may create with its keys", Create, scheduler, nil, pod(ann{"gpu-fraction": "0.5", devices: "GPU-1"}, ""), ""},
		{"scheduler's create is still validated", Create, scheduler, nil, pod(ann{"gpu-fraction": "2", devices: "GPU-1"}, ""),
			`container "main": gpu-fraction "2" must be greater than 0 and less than 1`},
		{"user adds devices", Update, "alice", pod(ann{"gpu-fraction": "0.5"}, ""), pod(ann{"gpu-fraction": "0.5", devices: "GPU-1"}, ""),
			`container "main": nvidia.com/container.main.gpus.devices "GPU-1" can be set, changed or removed only by the scheduler (` + scheduler + `), not by alice`},
		{"user edits devices", Update, "alice", pod(scheduled, "n1"), pod(with(scheduled, devices, "GPU-2"), "n1"),
			`container "main": nvidia.com/container.main.gpus.devices "GPU-2" can be set, changed or removed only by the scheduler (` + scheduler + `), not by alice`},
		{"user removes devices", Update, "alice", pod(scheduled, "n1"), pod(without(scheduled, devices), "n1"),
			`container "main": nvidia.com/container.main.gpus.devices "(removed; was GPU-1)" can be set, changed or removed only by the scheduler (` + scheduler + `), not by alice`},
		{"user sets portion", Update, "alice", pod(ann{"gpu-fraction": "0.5"}, ""), pod(ann{"gpu-fraction": "0.5", portion: "1"}, ""),
			`container "main": nvidia.com/container.main.gpu-compute.portion "1" can be set, changed or removed only by the scheduler (` + scheduler + `), not by alice`},
		{"scheduler writes its keys and the resolved request", Update, scheduler, pod(ann{"gpu-fraction": "0.5"}, ""), pod(scheduled, ""), ""},
		{"scheduler may rewrite a bound pod", Update, scheduler, pod(scheduled, "n1"), pod(with(scheduled, devices, "GPU-2"), "n1"), ""},
		{"user changes the fraction of a bound pod", Update, "alice", pod(ann{"gpu-fraction": "0.5"}, "n1"), pod(ann{"gpu-fraction": "0.75"}, "n1"),
			`gpu-fraction "0.75" cannot change: the pod is already scheduled to node n1, so its GPU-fraction annotations are fixed; resize its memory with gpufrac.io/resize.gpu-memory.request (and gpufrac.io/resize.gpu-memory.limit), or delete and recreate the pod to ask for another fraction`},
		{"user changes the resolved request before binding", Update, "alice", pod(scheduled, ""), pod(with(scheduled, resolvedReq, "80000Mi"), ""),
			`nvidia.com/container.main.gpu-memory.request "80000Mi" cannot change: the pod is already scheduled to a GPU, so its GPU-fraction annotations are fixed; resize its memory with gpufrac.io/resize.gpu-memory.request (and gpufrac.io/resize.gpu-memory.limit), or delete and recreate the pod to ask for another fraction`},
		{"user adds a fraction key to a bound pod", Update, "alice", pod(nil, "n1"), pod(ann{"gpu-memory": "1024"}, "n1"),
			`gpu-memory "1024" cannot change: the pod is already scheduled to node n1, so its GPU-fraction annotations are fixed; resize its memory with gpufrac.io/resize.gpu-memory.request (and gpufrac.io/resize.gpu-memory.limit), or delete and recreate the pod to ask for another fraction`},
		{"user edits other annotations of a bound pod", Update, "alice", pod(scheduled, "n1"), pod(with(scheduled, "team", "ml"), "n1"), ""},
		// Fixed at creation, when its charge was sized: a pending pod too.
		{"user changes the fraction of a pending pod", Update, "alice", pod(ann{"gpu-fraction": "0.5"}, ""), pod(ann{"gpu-fraction": "0.25"}, ""),
			`gpu-fraction "0.25" ` + fixed},
		// Issue 53: a key the parser ignores made the pod no fraction at
		// creation (no charge, no check); the fraction added later was
		// taken as a change of one it already had.
		{"a fraction added beside an ignored key", Update, "alice", pod(ann{"gpu-fraction-container-name": "main"}, ""),
			pod(ann{"gpu-fraction-container-name": "main", "gpu-fraction": "0.5"}, ""), `gpu-fraction "0.5" ` + fixed},
		{"a fraction added beside KAI's prefix", Update, "alice", pod(ann{"kai.scheduler/container.main.x": "1"}, ""),
			pod(ann{"kai.scheduler/container.main.x": "1", "gpu-memory": "80Gi"}, ""), `gpu-memory "80Gi" ` + fixed},
		{"a fraction removed", Update, "alice", pod(ann{"gpu-fraction": "0.5"}, ""), pod(nil, ""), `gpu-fraction "(removed; was 0.5)" ` + fixed},
		{"the scheduler's groups forged on create", Create, "alice", nil, pod(ann{"gpu-fraction": "0.5", "gpufrac.io/gpu-groups": "g1"}, ""),
			`gpufrac.io/gpu-groups "g1" is written by the scheduler (` + scheduler + `) with its decision and cannot be set when a pod is created: remove it`},
		{"the scheduler's resolved keys forged on update", Update, "alice", pod(ann{"gpu-fraction": "0.5"}, ""), pod(ann{"gpu-fraction": "0.5", "gpufrac.io/resolved-keys": ".gpu-memory.request"}, ""),
			`gpufrac.io/resolved-keys ".gpu-memory.request" can be set, changed or removed only by the scheduler (` + scheduler + `), not by alice`},
	}
	checkReviews(t, identity, tests)
}

// Squatting: with trusted schedulers configured, a fraction is created
// only for one of them to place, and never gained afterwards.
func TestOnlyATrustedSchedulerPlacesAFraction(t *testing.T) {
	const fixed = `cannot be added, changed or removed after the pod is created: a pod's GPU fraction is fixed (and charged to its namespace's quota) at creation; delete and recreate the pod with the annotations it needs`
	id := Identity{Users: []string{scheduler}, Schedulers: []string{"gpufrac", "kai-scheduler", "team-*"}}
	onScheduler := func(name, node string, a ann) *corev1.Pod {
		p := pod(a, node)
		p.Spec.SchedulerName = name
		return p
	}
	ask := ann{"gpu-memory": "999999"}
	checkReviews(t, id, []reviewCase{
		{"gpufrac places it", Create, "alice", nil, onScheduler("gpufrac", "", ask), ""},
		{"KAI places it", Create, "alice", nil, onScheduler("kai-scheduler", "", ask), ""},
		{"a glob", Create, "alice", nil, onScheduler("team-a", "", ask), ""},
		{"created bound", Create, "alice", nil, onScheduler("gpufrac", "gpu-node-2", ask),
			`spec.nodeName "gpu-node-2" cannot be set on a pod that asks for a GPU fraction: only a trusted scheduler (gpufrac, kai-scheduler, team-*) places one, choosing its GPU; pin it with a nodeSelector or node affinity instead`},
		{"another scheduler", Create, "alice", nil, onScheduler("my-scheduler", "", ask),
			`spec.schedulerName "my-scheduler" is not trusted to place GPU fractions: set schedulerName to one that is (gpufrac, kai-scheduler, team-*)`},
		{"the default scheduler", Create, "alice", nil, onScheduler("", "", ask),
			`spec.schedulerName "default-scheduler" is not trusted to place GPU fractions: set schedulerName to one that is (gpufrac, kai-scheduler, team-*)`},
		{"a pod asking nothing may be created bound", Create, "alice", nil, onScheduler("", "n1", ann{"team": "ml"}), ""},
		{"a fraction gained by UPDATE", Update, "alice", onScheduler("my-scheduler", "", nil), onScheduler("my-scheduler", "", ask),
			`gpu-memory "999999" ` + fixed},
		{"the scheduler creates what it places", Create, scheduler, nil, onScheduler("gpufrac", "n1", ask), ""},
	})
	// Without trusted schedulers configured, nothing of this is checked.
	if _, err := identity.ReviewPod(Create, "alice", nil, onScheduler("my-scheduler", "n1", ask)); err != nil {
		t.Errorf("unconfigured: %v", err)
	}
}

func with(m ann, k, v string) ann {
	out := ann{k: v}
	for key, val := range m {
		if key != k {
			out[key] = val
		}
	}
	return out
}

func without(m ann, k string) ann {
	out := ann{}
	for key, val := range m {
		if key != k {
			out[key] = val
		}
	}
	return out
}

func TestNormalise(t *testing.T) {
	tests := []struct {
		name   string
		in     ann
		want   ann
		wantOK bool
	}{
		{"memory shorthand becomes canonical as KAI writes it; shorthands stay", ann{"gpu-memory": "4096", "gpu-memory.limit": "8Gi", "x": "y"},
			ann{"gpu-memory": "4096", "gpu-memory.limit": "8Gi", "x": "y",
				"nvidia.com/container.main.gpu-memory.request": "4Gi",
				"nvidia.com/container.main.gpu-memory.limit":   "8Gi",
				"nvidia.com/container.main.gpu-compute.mode":   "time-slicing"}, true},
		{"memory without a limit gets no canonical limit (KAI refuses gpu-memory next to one)", ann{"gpu-memory": "2000"},
			ann{"gpu-memory": "2000",
				"nvidia.com/container.main.gpu-memory.request": "2000Mi",
				"nvidia.com/container.main.gpu-compute.mode":   "time-slicing"}, true},
		{"gpu-fraction.limit becomes KAI's portion limit", ann{"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75"},
			ann{"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75",
				"kai.scheduler/container.main.gpu-memory.portion.limit": "0.75",
				"nvidia.com/container.main.gpu-compute.mode":            "time-slicing"}, true},
		{"a fraction is not resolved here", ann{"gpu-fraction": "0.5", "kai.scheduler/gpu-compute-sharing-mode": "sm-sharing"},
			ann{"gpu-fraction": "0.5", "kai.scheduler/gpu-compute-sharing-mode": "sm-sharing",
				"nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}, true},
		{"canonical keys are left as written", ann{"nvidia.com/container.main.gpu-memory.request": "2Gi"},
			ann{"nvidia.com/container.main.gpu-memory.request": "2Gi",
				"nvidia.com/container.main.gpu-compute.mode": "time-slicing"}, true},
		{"no fraction", ann{"x": "y"}, nil, false},
		{"invalid is left to the validator", ann{"gpu-fraction": "1"}, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := pod(tt.in, "")
			got, labels, ok := Normalise(p)
			if ok != tt.wantOK {
				t.Fatalf("ok = %v, want %v", ok, tt.wantOK)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("annotations (-want +got):\n%s", diff)
			}
			if ok && labels[SelectionLabel] != "true" {
				t.Errorf("labels %v lack %s=true", labels, SelectionLabel)
			}
			// Idempotent: the normalised pod is valid and normalises to itself.
			if ok {
				p.Annotations = got
				again, _, ok2 := Normalise(p)
				if !ok2 || !cmp.Equal(got, again) {
					t.Errorf("not idempotent: %v then %v (ok=%v)", got, again, ok2)
				}
				if _, err := identity.ReviewPod(Create, "alice", nil, p); err != nil {
					t.Errorf("normalised pod does not validate: %v", err)
				}
			}
		})
	}
}

func TestReviewBinding(t *testing.T) {
	id := Identity{Users: []string{DefaultSchedulerUser}}
	decision := map[string]string{
		"nvidia.com/container.main.gpus.devices":       "GPU-1",
		"nvidia.com/container.main.gpu-memory.request": "40960Mi",
		api.GPUGroupsAnnotation:                        "g1",
		"team":                                         "a",
	}
	if err := id.ReviewBinding(DefaultSchedulerUser, decision); err != nil {
		t.Errorf("the scheduler's binding: %v", err)
	}
	if err := id.ReviewBinding("system:serviceaccount:x:other-scheduler", map[string]string{"team": "a"}); err != nil {
		t.Errorf("another scheduler's binding without fraction keys: %v", err)
	}
	err := id.ReviewBinding("mallory", decision)
	if err == nil {
		t.Fatal("a binding with a forged decision was allowed")
	}
	for _, want := range []string{"nvidia.com/container.main.gpus.devices", api.GPUGroupsAnnotation, "mallory", DefaultSchedulerUser} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("denial %q does not name %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "team") {
		t.Errorf("denial %q names a key that is not the scheduler's", err)
	}
}

// A workload whose fractional pods no trusted scheduler would place is
// refused at its template, judged as its pods will be once mutated.
func TestReviewWorkloadNeedsATrustedScheduler(t *testing.T) {
	deployment := func(scheduler, node string, annotations string) []byte {
		return []byte(`{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"d"},"spec":{"template":{"metadata":{"annotations":` +
			annotations + `},"spec":{"schedulerName":"` + scheduler + `","nodeName":"` + node + `","containers":[{"name":"main","image":"cuda"}]}}}}`)
	}
	const fraction = `{"gpu-memory":"1024"}`
	trusted := Identity{Schedulers: []string{"gpufrac"}}
	mutated := Identity{Schedulers: []string{"gpufrac"}, DefaultScheduler: "gpufrac"}
	for _, tc := range []struct {
		name string
		id   Identity
		raw  []byte
		want string // "" admitted
	}{
		{"another scheduler", trusted, deployment("my-scheduler", "", fraction), `pod template spec.schedulerName "my-scheduler" is not trusted`},
		{"bound to a node", trusted, deployment("gpufrac", "n1", fraction), `pod template spec.nodeName "n1" cannot be set`},
		{"the trusted one", trusted, deployment("gpufrac", "", fraction), ""},
		{"the default, with no mutation", trusted, deployment("default-scheduler", "", fraction), `pod template spec.schedulerName "default-scheduler" is not trusted`},
		{"the default, mutated to gpufrac", mutated, deployment("default-scheduler", "", fraction), ""},
		{"no fraction, any scheduler", trusted, deployment("my-scheduler", "n1", `{}`), ""},
	} {
		_, err := tc.id.ReviewWorkload("Deployment", tc.raw)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: refused: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want refused with %q", tc.name, err, tc.want)
		}
	}
}

func TestReviewPodResize(t *testing.T) {
	const agent = DefaultNodeAgentUser
	id := Identity{Users: []string{scheduler}, NodeAgents: []string{agent}}
	devices := "nvidia.com/container.main.gpus.devices"
	scheduled := ann{"gpu-memory": "8192", devices: "GPU-1", "nvidia.com/container.main.gpu-memory.request": "8Gi", "nvidia.com/container.main.gpu-memory.limit": "8Gi"}
	pending := ann{"gpu-memory": "8192"}
	enforced := "request=16384Mi,limit=16384Mi"
	checkReviews(t, id, []reviewCase{
		{"user asks a resize of a scheduled pod", Update, "alice", pod(scheduled, "n1"), pod(with(scheduled, api.KeyResizeRequest, "16Gi"), "n1"), ""},
		{"user asks a limit alone", Update, "alice", pod(scheduled, "n1"), pod(with(scheduled, api.KeyResizeLimit, "32Gi"), "n1"), ""},
		{"user takes a resize back", Update, "alice", pod(with(scheduled, api.KeyResizeRequest, "16Gi"), "n1"), pod(scheduled, "n1"), ""},
		{"a resize that cannot be read", Update, "alice", pod(scheduled, "n1"), pod(with(scheduled, api.KeyResizeRequest, "16"), "n1"),
			`gpufrac.io/resize.gpu-memory.request "16" must be a quantity with a unit, such as 8Gi (unlike gpu-memory, it is not a number of MiB)`},
		{"a resize with the limit below the request", Update, "alice", pod(with(scheduled, api.KeyResizeRequest, "16Gi"), "n1"),
			pod(with(with(scheduled, api.KeyResizeRequest, "16Gi"), api.KeyResizeLimit, "10Gi"), "n1"),
			`gpufrac.io/resize.gpu-memory.limit "10Gi" must be at least gpufrac.io/resize.gpu-memory.request (16Gi)`},
		{"a resize of a pod not scheduled yet", Update, "alice", pod(pending, ""), pod(with(pending, api.KeyResizeRequest, "16Gi"), ""),
			`gpufrac.io/resize.gpu-memory.request "16Gi" resizes the GPU share of a pod the scheduler has placed, and this pod has no GPU decision yet: set the memory request itself, or wait until it is scheduled`},
		{"a resize key at creation", Create, "alice", nil, pod(with(pending, api.KeyResizeRequest, "16Gi"), ""),
			`gpufrac.io/resize.gpu-memory.request "16Gi" cannot be set when a pod is created: it resizes the GPU share of a pod already running (set the memory request itself at creation)`},
		{"a record forged at creation", Create, "alice", nil, pod(with(pending, api.EnforcedAnnotation, enforced), ""),
			`gpufrac.io/enforced-gpu-memory "request=16384Mi,limit=16384Mi" cannot be set when a pod is created: it resizes the GPU share of a pod already running (set the memory request itself at creation)`},
		{"user forges what the node enforces", Update, "alice", pod(scheduled, "n1"), pod(with(scheduled, api.EnforcedAnnotation, enforced), "n1"),
			`gpufrac.io/enforced-gpu-memory "request=16384Mi,limit=16384Mi" can be set, changed or removed only by a node agent (` + agent + `), not by alice`},
		{"user removes the scheduler's record", Update, "alice", pod(with(scheduled, api.ResizedFromAnnotation, enforced), "n1"), pod(scheduled, "n1"),
			`gpufrac.io/resized-from "(removed; was request=16384Mi,limit=16384Mi)" can be set, changed or removed only by the scheduler (` + scheduler + `), not by alice`},
		{"a node agent records what it enforces", Update, agent, pod(scheduled, "n1"), pod(with(scheduled, api.EnforcedAnnotation, enforced), "n1"), ""},
		{"a node agent may not write the scheduler's record", Update, agent, pod(scheduled, "n1"), pod(with(scheduled, api.ResizedFromAnnotation, enforced), "n1"),
			`gpufrac.io/resized-from "request=16384Mi,limit=16384Mi" can be set, changed or removed only by the scheduler (` + scheduler + `), not by ` + agent},
		{"a node agent may not resize", Update, agent, pod(scheduled, "n1"), pod(with(scheduled, "nvidia.com/container.main.gpu-memory.request", "16Gi"), "n1"),
			`nvidia.com/container.main.gpu-memory.request "16Gi" cannot change: the pod is already scheduled to node n1, so its GPU-fraction annotations are fixed; resize its memory with gpufrac.io/resize.gpu-memory.request (and gpufrac.io/resize.gpu-memory.limit), or delete and recreate the pod to ask for another fraction`},
		{"the scheduler grants", Update, scheduler, pod(with(scheduled, api.KeyResizeRequest, "16Gi"), "n1"),
			pod(with(with(scheduled, api.KeyResizeRequest, "16Gi"), api.ResizedFromAnnotation, "request=8192Mi,limit=8192Mi"), "n1"), ""},
	})
	if err := id.ReviewBinding("alice", ann{api.EnforcedAnnotation: enforced}); err == nil {
		t.Error("a Binding from a user may carry what a node enforces")
	}
}
