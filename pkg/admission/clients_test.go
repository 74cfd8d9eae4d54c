package admission

import (
	"context"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Issue 53: a share's pod must not be able to become root after the
// node checked its containers' uid.
func TestShareClientsCannotBecomeRoot(t *testing.T) {
	m := &Mutator{}
	mutate := func(p *corev1.Pod) (map[string]any, string) {
		t.Helper()
		resp := m.Handle(context.Background(), request(t, admissionv1.Create, podKind, "alice", nil, p))
		if !resp.Allowed {
			return nil, resp.Result.Message
		}
		byPath := map[string]any{}
		for _, op := range resp.Patches {
			byPath[op.Path] = op.Value
		}
		return byPath, ""
	}
	share := func(edit func(*corev1.Pod)) *corev1.Pod {
		p := pod(ann{"gpu-memory": "1024"}, "")
		p.Spec.InitContainers = []corev1.Container{{Name: "init", Image: "cuda", SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)}}}
		if edit != nil {
			edit(p)
		}
		return p
	}

	patches, denied := mutate(share(nil))
	if denied != "" {
		t.Fatal(denied)
	}
	if v := patches["/spec/containers/0/securityContext"]; v == nil || v.(map[string]any)["allowPrivilegeEscalation"] != false {
		t.Errorf("container without securityContext: patch %v, want allowPrivilegeEscalation false", v)
	}
	if v, ok := patches["/spec/initContainers/0/securityContext/allowPrivilegeEscalation"]; !ok || v != false {
		t.Errorf("init container with a securityContext: patch %v, want allowPrivilegeEscalation false", v)
	}

	for _, c := range []struct {
		name string
		edit func(*corev1.Pod)
		want string
	}{
		{"escalation asked", func(p *corev1.Pod) {
			p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{AllowPrivilegeEscalation: ptr.To(true)}
		}, `container "main" securityContext.allowPrivilegeEscalation "true" cannot be set on a pod holding a GPU share`},
		{"privileged", func(p *corev1.Pod) {
			p.Spec.InitContainers[0].SecurityContext.Privileged = ptr.To(true)
		}, `init container "init" securityContext.privileged "true" cannot be set`},
		{"SYS_ADMIN", func(p *corev1.Pod) {
			p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Capabilities: &corev1.Capabilities{Add: []corev1.Capability{"SYS_ADMIN"}}}
		}, `securityContext.capabilities.add "SYS_ADMIN" cannot be added`},
		{"shared process namespace", func(p *corev1.Pod) { p.Spec.ShareProcessNamespace = ptr.To(true) },
			`spec.shareProcessNamespace "true" cannot be set on a pod holding a GPU share`},
	} {
		if _, denied := mutate(share(c.edit)); !strings.Contains(denied, c.want) {
			t.Errorf("%s: %q, want it refused with %q", c.name, denied, c.want)
		}
		// In a user namespace its root is no root of the host.
		inUserNS := share(func(p *corev1.Pod) { c.edit(p); p.Spec.HostUsers = ptr.To(false) })
		if patches, denied := mutate(inUserNS); denied != "" || patches["/spec/containers/0/securityContext"] != nil {
			t.Errorf("%s in a user namespace: denied %q, patches %v", c.name, denied, patches)
		}
	}
	// A pod that asks for no share is not touched.
	plain := pod(nil, "")
	plain.Spec.ShareProcessNamespace = ptr.To(true)
	if patches, denied := mutate(plain); denied != "" || len(patches) != 0 {
		t.Errorf("plain pod: denied %q, patches %v", denied, patches)
	}
	// At validation: a pod whose only key is one the parser ignores asks
	// for no share, and is not judged as one.
	ignored := pod(ann{"gpu-fraction-container-name": "main"}, "")
	ignored.Spec.ShareProcessNamespace = ptr.To(true)
	if _, err := identity.ReviewPod(Create, "alice", nil, ignored); err != nil {
		t.Errorf("a pod with only an ignored key: %v", err)
	}
	sharing := pod(ann{"gpu-memory": "1024"}, "")
	sharing.Spec.ShareProcessNamespace = ptr.To(true)
	if _, err := identity.ReviewPod(Create, "alice", nil, sharing); err == nil || !strings.Contains(err.Error(), "spec.shareProcessNamespace") {
		t.Errorf("a share sharing its process namespace, at validation: %v", err)
	}
	// The admin who accepts root clients accepts this too.
	m.AllowRootMPSClients = true
	if _, denied := mutate(share(func(p *corev1.Pod) { p.Spec.ShareProcessNamespace = ptr.To(true) })); denied != "" {
		t.Errorf("with --allow-root-mps-clients: %q", denied)
	}

	// Debugging with a target joins its process namespace.
	v := &Validator{Identity: identity}
	old := pod(ann{"gpu-memory": "1024", "nvidia.com/container.main.gpus.devices": "GPU-1"}, "n1")
	debugged := old.DeepCopy()
	debugged.Spec.EphemeralContainers = []corev1.EphemeralContainer{{TargetContainerName: "main", EphemeralContainerCommon: corev1.EphemeralContainerCommon{Name: "debug", Image: "busybox"}}}
	req := request(t, admissionv1.Update, podKind, "alice", old, debugged)
	req.SubResource = "ephemeralcontainers"
	if resp := v.Handle(context.Background(), req); resp.Allowed || !strings.Contains(resp.Result.Message, `ephemeral container "debug" targetContainerName "main" cannot be set in a pod holding a GPU share`) {
		t.Errorf("targeted debug container: allowed=%v %q", resp.Allowed, resp.Result.Message)
	}
	debugged.Spec.EphemeralContainers[0].TargetContainerName = ""
	req = request(t, admissionv1.Update, podKind, "alice", old, debugged)
	req.SubResource = "ephemeralcontainers"
	if resp := v.Handle(context.Background(), req); !resp.Allowed {
		t.Errorf("untargeted debug container refused: %q", resp.Result.Message)
	}
}

// Issue 53: a charge is written by the webhook only; one the author
// wrote on a pod without a share is taken off.
func TestAuthorsChargeIsStrippedFromPlainPods(t *testing.T) {
	m := &Mutator{}
	p := pod(nil, "")
	p.Spec.Containers[0].Resources = corev1.ResourceRequirements{
		Requests: corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("4095Ti"), corev1.ResourceCPU: resource.MustParse("1")},
		Limits:   corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("4095Ti")}}
	p.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("1Ti")}}}}
	resp := m.Handle(context.Background(), request(t, admissionv1.Create, podKind, "alice", nil, p))
	removed := map[string]bool{}
	for _, op := range resp.Patches {
		if op.Operation != "remove" {
			t.Errorf("unexpected patch %v", op)
		}
		removed[op.Path] = true
	}
	for _, path := range []string{"/spec/containers/0/resources/requests/gpufrac.io~1gpu-memory", "/spec/containers/0/resources/limits/gpufrac.io~1gpu-memory", "/spec/initContainers/0/resources/requests/gpufrac.io~1gpu-memory"} {
		if !removed[path] {
			t.Errorf("%s not removed: %v", path, resp.Patches)
		}
	}
}

// Issue 53: a tenant's pods/status write of a terminal phase would free
// a running share in every book; only nodes and controllers may.
func TestOnlyNodesEndAShare(t *testing.T) {
	v := &Validator{Identity: identity}
	running := pod(ann{"gpu-memory": "40960", "nvidia.com/container.main.gpus.devices": "GPU-1"}, "n1")
	running.Status.Phase = corev1.PodRunning
	failed := running.DeepCopy()
	failed.Status.Phase = corev1.PodFailed
	status := func(user string, groups ...string) admission.Response {
		req := request(t, admissionv1.Update, podKind, user, running, failed)
		req.SubResource, req.UserInfo.Groups = "status", groups
		return v.Handle(context.Background(), req)
	}
	if resp := status("alice", "system:authenticated"); resp.Allowed || !strings.Contains(resp.Result.Message, `status.phase "Failed" can be set only by the pod's node (its kubelet) or the cluster's controllers, not by alice`) {
		t.Errorf("tenant: allowed=%v %q", resp.Allowed, resp.Result.Message)
	}
	for _, who := range []struct {
		user   string
		groups []string
	}{
		{"system:node:n1", []string{"system:nodes"}},
		{"system:serviceaccount:kube-system:pod-garbage-collector", nil},
		{"system:kube-controller-manager", nil},
		{"admin", []string{"system:masters"}},
	} {
		if resp := status(who.user, who.groups...); !resp.Allowed {
			t.Errorf("%s refused: %q", who.user, resp.Result.Message)
		}
	}
	// A DRA share is known by its charge.
	claim := pod(nil, "n1")
	claim.Spec.Containers[0].Resources.Requests = corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("10Gi")}
	ended := claim.DeepCopy()
	ended.Status.Phase = corev1.PodSucceeded
	req := request(t, admissionv1.Update, podKind, "alice", claim, ended)
	req.SubResource = "status"
	if resp := v.Handle(context.Background(), req); resp.Allowed {
		t.Error("a claim share's phase set by a tenant")
	}
}
