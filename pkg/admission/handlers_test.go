package admission

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
)

func request(t testing.TB, op admissionv1.Operation, kind metav1.GroupVersionKind, user string, old, obj any) admission.Request {
	t.Helper()
	raw := func(o any) runtime.RawExtension {
		if o == nil {
			return runtime.RawExtension{}
		}
		b, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		return runtime.RawExtension{Raw: b}
	}
	return admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{
		UID: "uid", Kind: kind, Operation: op, UserInfo: authenticationv1.UserInfo{Username: user},
		Object: raw(obj), OldObject: raw(old),
	}}
}

var (
	podKind        = metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}
	deploymentKind = metav1.GroupVersionKind{Group: "apps", Version: "v1", Kind: "Deployment"}
)

func TestValidatorHandle(t *testing.T) {
	v := &Validator{Identity: identity}
	ctx := context.Background()

	resp := v.Handle(ctx, request(t, admissionv1.Create, podKind, "alice", nil, pod(ann{"gpu-fraction": "1"}, "")))
	if resp.Allowed || resp.Result.Message != `container "main": gpu-fraction "1" must be greater than 0 and less than 1` {
		t.Errorf("invalid pod: allowed=%v message=%q", resp.Allowed, resp.Result.Message)
	}
	if resp := v.Handle(ctx, request(t, admissionv1.Create, podKind, "alice", nil, pod(ann{"gpu-fraction": "0.5"}, ""))); !resp.Allowed {
		t.Errorf("valid pod denied: %q", resp.Result.Message)
	}
	// KAI admits a chart's gpu-fraction-container-name on a pod that asks
	// for nothing; so do we, with a warning kubectl prints.
	resp = v.Handle(ctx, request(t, admissionv1.Create, podKind, "alice", nil, pod(ann{"gpu-fraction-container-name": "main"}, "")))
	if !resp.Allowed || len(resp.Warnings) != 1 || !strings.Contains(resp.Warnings[0], "gpu-fraction-container-name \"main\" is ignored") {
		t.Errorf("container name alone: allowed=%v warnings=%q", resp.Allowed, resp.Warnings)
	}
	old := pod(ann{"gpu-fraction": "0.5"}, "")
	forged := pod(ann{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-1"}, "")
	if resp := v.Handle(ctx, request(t, admissionv1.Update, podKind, "alice", old, forged)); resp.Allowed {
		t.Error("forged devices allowed on update")
	}
	if resp := v.Handle(ctx, request(t, admissionv1.Update, podKind, scheduler, old, forged)); !resp.Allowed {
		t.Errorf("scheduler denied: %q", resp.Result.Message)
	}
	if resp := v.Handle(ctx, request(t, admissionv1.Delete, podKind, "alice", old, nil)); !resp.Allowed {
		t.Error("delete denied")
	}
	bad := map[string]any{"kind": "Deployment", "metadata": map[string]any{"name": "d"},
		"spec": map[string]any{"template": map[string]any{"metadata": map[string]any{"annotations": map[string]string{"gpu-memory": "x"}},
			"spec": map[string]any{"containers": []map[string]string{{"name": "main"}}}}}}
	resp = v.Handle(ctx, request(t, admissionv1.Create, deploymentKind, "alice", nil, bad))
	if resp.Allowed || resp.Result.Message != `container "main": gpu-memory "x" must be a positive whole number of MiB without a unit, such as 4096` {
		t.Errorf("bad deployment: allowed=%v message=%q", resp.Allowed, resp.Result.Message)
	}
	garbage := request(t, admissionv1.Create, podKind, "alice", nil, nil)
	garbage.Object.Raw = []byte("{not json")
	if resp := v.Handle(ctx, garbage); resp.Allowed || resp.Result.Code != 400 {
		t.Errorf("undecodable pod: allowed=%v code=%d", resp.Allowed, resp.Result.Code)
	}
}

func TestMutatorHandle(t *testing.T) {
	m := &Mutator{SchedulerName: "gpufrac"}
	p := pod(ann{"gpu-memory": "1024"}, "")
	p.Spec.SchedulerName = corev1.DefaultSchedulerName
	resp := m.Handle(context.Background(), request(t, admissionv1.Create, podKind, "alice", nil, p))
	// Annotations, labels, schedulerName, the charge as request and
	// limit, and allowPrivilegeEscalation false (clients.go).
	if !resp.Allowed || len(resp.Patches) != 6 {
		t.Fatalf("allowed=%v patches=%v", resp.Allowed, resp.Patches)
	}
	byPath := map[string]any{}
	for _, op := range resp.Patches {
		byPath[op.Path] = op.Value
	}
	if byPath["/spec/schedulerName"] != "gpufrac" {
		t.Errorf("schedulerName patch = %v", byPath["/spec/schedulerName"])
	}
	if a := byPath["/metadata/annotations"].(map[string]string); a["nvidia.com/container.main.gpu-memory.request"] != "1Gi" {
		t.Errorf("annotations patch = %v", a)
	}

	own := pod(ann{"gpu-memory": "1024"}, "")
	own.Spec.SchedulerName = "kai-scheduler"
	resp = m.Handle(context.Background(), request(t, admissionv1.Create, podKind, "alice", nil, own))
	for _, op := range resp.Patches {
		if op.Path == "/spec/schedulerName" {
			t.Error("a pod's own scheduler choice was overwritten")
		}
	}
	if resp := m.Handle(context.Background(), request(t, admissionv1.Create, podKind, "alice", nil, pod(nil, ""))); len(resp.Patches) != 0 {
		t.Errorf("plain pod patched: %v", resp.Patches)
	}
}

// BenchmarkValidatorHandle is the admission latency of the validating
// handler itself, JSON decoding included (the TLS and HTTP around it are
// measured through the API server by the integration benchmark).
func BenchmarkValidatorHandle(b *testing.B) {
	v := &Validator{Identity: identity}
	scheduled := ann{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-1"}
	cases := []struct {
		name string
		req  admission.Request
	}{
		{"create", request(b, admissionv1.Create, podKind, "alice", nil, pod(ann{"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75"}, ""))},
		{"update-guard", request(b, admissionv1.Update, podKind, "alice", pod(scheduled, "n1"), pod(with(scheduled, "team", "ml"), "n1"))},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if resp := v.Handle(context.Background(), c.req); !resp.Allowed {
					b.Fatal(resp.Result.Message)
				}
			}
		})
	}
}

func BenchmarkMutatorHandle(b *testing.B) {
	m := &Mutator{SchedulerName: "gpufrac"}
	req := request(b, admissionv1.Create, podKind, "alice", nil, pod(ann{"gpu-memory": "4096", "gpu-memory.limit": "8Gi"}, ""))
	b.ReportAllocs()
	for b.Loop() {
		if resp := m.Handle(context.Background(), req); !resp.Allowed {
			b.Fatal(resp.Result.Message)
		}
	}
}
