package integration

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Issue 53, played as an ordinary namespace user (a Role on pods, their
// status, Deployments and ResourceClaims): every way the second review
// found to hold a share no quota counted, or to free a running one in
// the books, is refused, and the books show it.
func TestTenantCannotHoldAShareUncharged(t *testing.T) {
	ns, node := draScenario(t, "uncharged")
	publishSlices(t, node, "dgxh100", 1024)
	tenant := tenantUser(t, ns, "uncharged-user")
	ctx := context.Background()
	grantClaims(t, ns, "uncharged-user")
	sched := "gpufrac-uncharged"
	const fixed = "cannot be added, changed or removed after the pod is created"

	// 1a. A key the parser ignores, a scheduling gate, then the fraction.
	gated := workload(ns, "gated", sched, "uncharged", map[string]string{api.KeyContainerName: "main"})
	gated.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "tenant/hold"}}
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, gated, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err := tenant.CoreV1().Pods(ns).Patch(ctx, "gated", types.MergePatchType, []byte(`{"metadata":{"annotations":{"gpu-fraction":"0.5"}}}`), metav1.PatchOptions{})
	refused(t, "a fraction added to a pod created with an ignored key", err, `gpu-fraction "0.5" `+fixed)

	// 1b. Only KAI's per-container prefix at creation: it used to reach
	// neither pods webhook, so the pod was admitted unread and a share
	// added later was taken as a change of one it had. Now it is read.
	kai := workload(ns, "kai", sched, "uncharged", map[string]string{api.KAIContainerKeyPrefix + "main.note": "x"})
	kai.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "tenant/hold"}}
	_, err = tenant.CoreV1().Pods(ns).Create(ctx, kai, metav1.CreateOptions{})
	refused(t, "a pod created with KAI's prefix only", err, `kai.scheduler/container.main.note "x" is not a known key`)

	// 1c. A claim of another class at creation (charged nothing), swapped
	// for a 40Gi claim of gpufrac's before the pod is placed.
	other := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "other.example.com"}}
	if _, err := shared.admin.ResourceV1().DeviceClasses().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = shared.admin.ResourceV1().DeviceClasses().Delete(context.Background(), other.Name, metav1.DeleteOptions{})
	})
	decoy := memoryClaim(ns, "swapped", "", "")
	decoy.Spec.Devices.Requests[0].Exactly.DeviceClassName = other.Name
	if _, err := tenant.ResourceV1().ResourceClaims(ns).Create(ctx, decoy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	swap := claimPod(ns, "swap", sched, "uncharged", "swapped")
	swap.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "tenant/hold"}}
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, swap, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, "swap", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	} else if _, charged := api.ChargedMiB(&p.Spec); charged {
		t.Fatalf("a pod naming a claim of another class was charged: %v", p.Spec.Containers[0].Resources)
	}
	if err := tenant.ResourceV1().ResourceClaims(ns).Delete(ctx, "swapped", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := shared.admin.ResourceV1().ResourceClaims(ns).Get(ctx, "swapped", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatalf("the decoy claim is not gone: %v", err)
	}
	_, err = tenant.ResourceV1().ResourceClaims(ns).Create(ctx, memoryClaim(ns, "swapped", "40Gi", ""), metav1.CreateOptions{})
	refused(t, "a claim of gpufrac's swapped in after its pod was charged nothing", err,
		`resourceclaim swapped "40Gi" cannot be created now: pod swap names it and was charged 0`)
	// (gpufrac's scheduler would refuse the pod too: it places no share
	// whose pod carries no charge.)

	// The same swap for a pod any other scheduler with DRA places (the
	// default one allocates gpufrac's claims from its published slices):
	// the claim itself is refused while the pod's charge does not cover it,
	// and so is a claim made after the pod that names it.
	elsewhere := claimPod(ns, "elsewhere", "default-scheduler", "uncharged", "swapped-too")
	elsewhere.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "tenant/hold"}}
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, elsewhere, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = tenant.ResourceV1().ResourceClaims(ns).Create(ctx, memoryClaim(ns, "swapped-too", "40Gi", ""), metav1.CreateOptions{})
	refused(t, "a claim of gpufrac's made after the default scheduler's pod that names it", err,
		`resourceclaim swapped-too "40Gi" cannot be created now: pod elsewhere names it and was charged 0`)

	// 5. A charge written by the tenant on a pod with no share is taken
	// off: 4095Ti of it would use up a GPU node's 4Pi for every share.
	squat := workload(ns, "squat", "default-scheduler", "uncharged", nil)
	squat.Spec.Containers[0].Resources.Requests[api.ResourceGPUMemory] = resource.MustParse("4095Ti")
	squat.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("4095Ti")}
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, squat, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, "squat", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	} else if mib, charged := api.ChargedMiB(&p.Spec); charged {
		t.Errorf("a plain pod kept the %s MiB charge its author wrote", api.FormatMiB(mib))
	}

	// 2. A running share's status set Failed by its tenant: refused, and
	// the share stays in the books.
	if _, err := tenant.CoreV1().Pods(ns).Create(ctx, workload(ns, "big", sched, "uncharged", map[string]string{api.KeyMemory: "40960"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	placed(t, ns, "big")
	_, err = tenant.CoreV1().Pods(ns).Patch(ctx, "big", types.MergePatchType, []byte(`{"status":{"phase":"Failed"}}`), metav1.PatchOptions{}, "status")
	refused(t, "a running share's phase set Failed by its tenant", err, `status.phase "Failed" can be set only by the pod's node (its kubelet) or the cluster's controllers, not by uncharged-user`)
	if p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, "big", metav1.GetOptions{}); err != nil || p.Status.Phase == corev1.PodFailed {
		t.Errorf("after the refused patch: phase %v, err %v", p.Status.Phase, err)
	}
	held := false
	for _, n := range schedulerEnv(t).top(t).Nodes {
		for _, g := range n.Shared {
			for _, tn := range g.Tenants {
				held = held || tn.Pod == ns+"/big"
			}
		}
	}
	if !held {
		t.Error("the share whose phase its tenant tried to end is not in gpufrac top")
	}

	// 6. The scheduler's bookkeeping on a placed pod is its own.
	_, err = tenant.CoreV1().Pods(ns).Patch(ctx, "big", types.MergePatchType, []byte(`{"metadata":{"annotations":{"gpufrac.io/gpu-groups":"elsewhere"}}}`), metav1.PatchOptions{})
	refused(t, "the GPU groups of a placed share rewritten", err, "can be set, changed or removed only by the scheduler")
}
