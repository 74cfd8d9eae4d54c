package integration

import (
	"context"
	"os/exec"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// A namespace's GPU memory is bounded by a plain ResourceQuota on
// requests.gpufrac.io/gpu-memory, annotation shares and claims counted
// together, and an ordinary namespace user cannot talk their way past it:
// a charge they write themselves is replaced, and a claim made after its
// pod (charged nothing then) cannot be made.
//
// No kube-controller-manager runs in this suite: the quota's status is
// set as the quota controller's first sync sets it (hard from spec, used
// 0); from there ResourceQuota's admission counts every pod itself. The
// README tour runs the same on `gpufrac up`, with the real controller.
func TestNamespaceGPUMemoryQuota(t *testing.T) {
	ns, node := draScenario(t, "quota")
	publishSlices(t, node, "dgxh100", 1024)
	tenant := tenantUser(t, ns, "quota-user")
	ctx := context.Background()
	grantClaims(t, ns, "quota-user")

	budget := corev1.ResourceList{"requests." + api.ResourceGPUMemory: resource.MustParse("50Gi")}
	quota, err := shared.admin.CoreV1().ResourceQuotas(ns).Create(ctx, &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Name: "gpu-memory", Namespace: ns}, Spec: corev1.ResourceQuotaSpec{Hard: budget}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	quota.Status = corev1.ResourceQuotaStatus{Hard: budget, Used: corev1.ResourceList{"requests." + api.ResourceGPUMemory: resource.MustParse("0")}}
	if _, err := shared.admin.CoreV1().ResourceQuotas(ns).UpdateStatus(ctx, quota, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	sched := "gpufrac-quota"
	charge := func(name string) string {
		t.Helper()
		p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		mib, _ := api.ChargedMiB(&p.Spec)
		return api.FormatMiB(mib)
	}
	exceeded := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), "exceeded quota: gpu-memory") || !strings.Contains(err.Error(), "requests.gpufrac.io/gpu-memory") {
			t.Errorf("%s: %v; want it refused by the namespace's GPU memory quota", what, err)
		}
	}

	// 20Gi guaranteed, bursting to 30Gi: charged its limit.
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "burst", sched, "quota", map[string]string{api.KeyMemory: "20480", api.KeyMemoryLimit: "30Gi"}), metav1.CreateOptions{}); err != nil {
		t.Fatalf("a 30Gi share in a 50Gi budget: %v", err)
	}
	if got := charge("burst"); got != "30Gi" {
		t.Errorf("the 20Gi share bursting to 30Gi was charged %s, want 30Gi", got)
	}
	placed(t, ns, "burst")

	// Half an 80Gi GPU is 40Gi: over the 20Gi left.
	_, err = tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "half", sched, "quota", fraction("0.5")), metav1.CreateOptions{})
	exceeded("half a GPU with 20Gi left", err)

	// A charge the tenant writes is replaced by the share's.
	forged := workload(ns, "forged", sched, "quota", map[string]string{api.KeyMemory: "20480"})
	forged.Spec.Containers[0].Resources.Requests[api.ResourceGPUMemory] = resource.MustParse("1Mi")
	forged.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("1Mi")}
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, forged, metav1.CreateOptions{}); err != nil {
		t.Fatalf("a 20Gi share in the 20Gi left: %v", err)
	}
	if got := charge("forged"); got != "20Gi" {
		t.Errorf("a share of 20Gi whose author wrote a 1Mi charge was charged %s, want 20Gi", got)
	}
	placed(t, ns, "forged")

	// The budget is spent: a claim's share counts against it too.
	if _, err := tenant.ResourceV1().ResourceClaims(ns).Create(ctx, memoryClaim(ns, "tenth", "8Gi", ""), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = tenant.CoreV1().Pods(ns).Create(ctx, claimPod(ns, "claimer", sched, "quota", "tenth"), metav1.CreateOptions{})
	exceeded("a claim of 8Gi with nothing left", err)

	// A pod whose claim does not exist yet is charged nothing, and the
	// claim cannot then be made: any scheduler with DRA would place it
	// uncharged (issue 53; gpufrac's would refuse it).
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, claimPod(ns, "early", sched, "quota", "later"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("a pod whose claim comes later: %v", err)
	}
	if got := charge("early"); got != "0" {
		t.Errorf("a pod whose claim does not exist yet was charged %s, want 0", got)
	}
	_, err = tenant.ResourceV1().ResourceClaims(ns).Create(ctx, memoryClaim(ns, "later", "8Gi", ""), metav1.CreateOptions{})
	if err == nil || !strings.Contains(err.Error(), "resourceclaim later \"8Gi\" cannot be created now: pod early names it and was charged 0") {
		t.Errorf("the claim made after its pod: %v, want it refused", err)
	}

	// What quota counted is what the namespace holds.
	got, err := shared.admin.CoreV1().ResourceQuotas(ns).Get(ctx, "gpu-memory", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if used := got.Status.Used["requests."+api.ResourceGPUMemory]; used.String() != "50Gi" {
		t.Errorf("the quota counts %s used, want 50Gi (30Gi + 20Gi)", used.String())
	}
	if out, err := exec.Command(gpufracBinary(t), "audit", "--kubeconfig", schedulerEnv(t).adminKubeconfig, "--node-selector", "scenario=quota").CombinedOutput(); err != nil {
		t.Errorf("audit: %v\n%s", err, out)
	}
}
