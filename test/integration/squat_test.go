package integration

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/gpufrac/gpufrac/internal/testenv"
	"github.com/gpufrac/gpufrac/pkg/api"
)

// tenantUser is an ordinary namespace user: a Role on pods (and their
// status) and Deployments in ns, nothing else, as a platform team gives
// its tenants.
func tenantUser(t *testing.T, ns, name string) *kubernetes.Clientset {
	t.Helper()
	ctx := context.Background()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "tenant", Namespace: ns}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods", "pods/status"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		{APIGroups: []string{"apps"}, Resources: []string{"deployments"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
	}}
	if _, err := shared.admin.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "tenant", Namespace: ns},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "tenant"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: name}}}
	if _, err := shared.admin.RbacV1().RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	client, _, err := testenv.User(shared.env, name)
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// grantClaims lets the namespace user created by tenantUser get, list,
// create and delete ResourceClaims in ns too.
func grantClaims(t *testing.T, ns, user string) {
	t.Helper()
	ctx := context.Background()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "tenant-claims", Namespace: ns}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims"}, Verbs: []string{"get", "list", "create", "delete"}}}}
	if _, err := shared.admin.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := shared.admin.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "tenant-claims", Namespace: ns},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "tenant-claims"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// refused fails the test unless err refuses what with a message holding want.
func refused(t *testing.T, what string, err error, want string) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("%s: %v; want it refused with %q", what, err, want)
	}
}

// Issue 38's squatting, played as an ordinary namespace user: one pod
// created bound (spec.nodeName) with gpu-memory "999999" used to be
// admitted and to close its node to every fraction. Now admission refuses
// it, and one for an untrusted scheduler, and a fraction gained by an
// update; and should such a pod be there anyway (made here by the
// scheduler's own identity, which admission trusts), it closes nothing:
// a share pinned to that node is placed, and the audit names the squatter.
func TestTenantCannotSquatANode(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "squat")
	gpuNode(t, "squat-0", "squat", 2, 81920, true)
	cleanUp(t, ns, "squat-0")
	tenant := tenantUser(t, ns, "tenant-user")
	ctx := context.Background()
	bound := workload(ns, "squatter", testScheduler, "squat", map[string]string{api.KeyMemory: "999999"})
	bound.Spec.NodeName = "squat-0"
	_, err := tenant.CoreV1().Pods(ns).Create(ctx, bound, metav1.CreateOptions{})
	refused(t, "a fraction created bound", err, `spec.nodeName "squat-0" cannot be set on a pod that asks for a GPU fraction`)

	_, err = tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "elsewhere", "my-scheduler", "squat", map[string]string{api.KeyMemory: "1024"}), metav1.CreateOptions{})
	refused(t, "a fraction for another scheduler", err, `spec.schedulerName "my-scheduler" is not trusted to place GPU fractions`)

	// The same through a workload: refused at the template, not pod by pod
	// behind a controller that would retry for ever.
	template := workload(ns, "fleet", "my-scheduler", "squat", map[string]string{api.KeyMemory: "1024"})
	one := int32(1)
	deployment := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "fleet", Namespace: ns},
		Spec: appsv1.DeploymentSpec{Replicas: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "fleet"}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "fleet"}, Annotations: template.Annotations}, Spec: template.Spec}}}
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}} // admission runs; nothing is stored
	_, err = tenant.AppsV1().Deployments(ns).Create(ctx, deployment, dryRun)
	refused(t, "a fractional Deployment for another scheduler", err, `pod template spec.schedulerName "my-scheduler" is not trusted to place GPU fractions`)
	deployment.Spec.Template.Spec.SchedulerName = testScheduler
	if _, err := tenant.AppsV1().Deployments(ns).Create(ctx, deployment, dryRun); err != nil {
		t.Errorf("a fractional Deployment for the trusted scheduler: %v", err)
	}

	// A pod asking nothing, waiting for a scheduler that will never come
	// (or bind it where it likes), gains a fraction.
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "plain", "my-scheduler", "squat", nil), metav1.CreateOptions{}); err != nil {
		t.Fatalf("a pod asking nothing: %v", err)
	}
	_, err = tenant.CoreV1().Pods(ns).Patch(ctx, "plain", types.MergePatchType, []byte(`{"metadata":{"annotations":{"gpu-memory":"999999"}}}`), metav1.PatchOptions{})
	refused(t, "a fraction gained by an update", err, `gpu-memory "999999" cannot be added, changed or removed after the pod is created`)
	_, err = tenant.CoreV1().Pods(ns).Patch(ctx, "plain", types.MergePatchType, []byte(`{"metadata":{"annotations":{"gpu-memory":"999999"}}}`), metav1.PatchOptions{}, "status")
	refused(t, "a fraction gained through pods/status", err, `gpu-memory "999999" cannot be added, changed or removed after the pod is created`)

	// Defence in depth: the squatter exists all the same.
	if _, err := shared.scheduler.CoreV1().Pods(ns).Create(ctx, bound, metav1.CreateOptions{}); err != nil {
		t.Fatalf("the scheduler's identity creating a bound pod: %v", err)
	}
	create(t, workload(ns, "tenth", testScheduler, "squat", fraction("0.1")))
	if got := placed(t, ns, "tenth"); got.Spec.NodeName != "squat-0" {
		t.Fatalf("the share went to %q", got.Spec.NodeName)
	}
	var out bytes.Buffer
	cmd := exec.Command(gpufracBinary(t), "audit", "--kubeconfig", e.adminKubeconfig, "--orphan-grace", "0s", "--node-selector", "scenario=squat")
	cmd.Stdout, cmd.Stderr = &out, &out
	_ = cmd.Run() // exits 1 on a violation: the one wanted
	if !strings.Contains(out.String(), "FractionWithoutDevices squat/squatter") || strings.Count(out.String(), "\n") > 2 {
		t.Errorf("audit:\n%s", out.String())
	}
}
