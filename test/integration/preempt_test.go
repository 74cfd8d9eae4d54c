package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// holdFinalizer keeps a victim in the API after preemption deletes it,
// as a kubelet does while the pod's containers stop: the test reads its
// DisruptionTarget condition and decides when it is gone.
const holdFinalizer = "gpufrac.io/test-hold"

// priorityClass makes a PriorityClass for the test.
func priorityClass(t *testing.T, name string, value int32) string {
	t.Helper()
	pc := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Value: value}
	if _, err := shared.admin.SchedulingV1().PriorityClasses().Create(context.Background(), pc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = shared.admin.SchedulingV1().PriorityClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// share is a half of a GPU at a priority class ("" for none: priority 0),
// held by holdFinalizer once deleted.
func share(ns, name, scenario, class, fraction string, labels map[string]string) *corev1.Pod {
	p := workload(ns, name, testScheduler, scenario, map[string]string{"gpu-fraction": fraction})
	p.Spec.PriorityClassName = class
	p.Spec.TerminationGracePeriodSeconds = new(int64) // no kubelet here to end a graceful delete
	p.Finalizers = []string{holdFinalizer}
	p.Labels = labels
	return p
}

// release lets a held pod go.
func release(t *testing.T, ns, name string) {
	t.Helper()
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	if _, err := shared.admin.CoreV1().Pods(ns).Patch(context.Background(), name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
}

// releaseAll lets every held pod of the namespace go when the test ends
// (before cleanUp, registered earlier, deletes them).
func releaseAll(t *testing.T, ns string) {
	t.Cleanup(func() {
		list, err := shared.admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return
		}
		patch := []byte(`{"metadata":{"finalizers":null}}`)
		for _, p := range list.Items {
			_, _ = shared.admin.CoreV1().Pods(ns).Patch(context.Background(), p.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		}
	})
}

// terminating are the namespace's pods being deleted, by name.
func terminating(t *testing.T, ns string) []string {
	t.Helper()
	list, err := shared.admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil {
			continue
		}
		out = append(out, p.Name)
	}
	slices.Sort(out)
	return out
}

// victims waits for preemption to delete want pods of the namespace and
// checks each carries the DisruptionTarget condition; then that no more
// are deleted in the next seconds (one preemption, not a cascade).
func victims(t *testing.T, ns string, want int) []string {
	t.Helper()
	var got []string
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		got = terminating(t, ns)
		return len(got) >= want, nil
	})
	if err != nil {
		t.Fatalf("preemption deleted %v, want %d pods", got, want)
	}
	time.Sleep(3 * time.Second)
	if again := terminating(t, ns); !slices.Equal(again, got) {
		t.Fatalf("preemption deleted %v, then %v: want exactly %d victims", got, again, want)
	}
	for _, name := range got {
		p, err := shared.admin.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.DisruptionTarget && c.Status == corev1.ConditionTrue && c.Reason == corev1.PodReasonPreemptionByScheduler
		}) {
			t.Errorf("victim %s has no DisruptionTarget condition (PreemptionByScheduler): %+v", name, p.Status.Conditions)
		}
	}
	return got
}

// nominated waits until the pod is nominated to the node.
func nominated(t *testing.T, ns, name, node string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil && p.Status.NominatedNodeName == node, err
	})
	if err != nil {
		t.Fatalf("pod %s not nominated to %s: %v", name, node, err)
	}
}

// A more important share preempts through kube-scheduler's own
// DefaultPreemption, which weighs the node with the plugin's ledger (its
// PreFilter extensions): one victim, the fewest that make the preemptor
// fit one GPU; the preemptor waits on the node for its victim, which is
// never one a PodDisruptionBudget protects while another would do, and
// takes the GPU it left. A preemptor that no eviction would make fit
// evicts nobody; a whole-GPU one evicts the shares of one GPU only, whose
// idle reservation pod is then deleted for it. The audit is clean at each
// step.
func TestPreemptionFreesTheFewestShares(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-preempt")
	gpuNode(t, "preempt-0", "preempt", 2, 81920, true)
	cleanUp(t, ns, "preempt-0")
	releaseAll(t, ns)
	high := priorityClass(t, "gpufrac-test-high", 1000)

	gpuOf := map[string]string{}
	for i := range 4 {
		name := fmt.Sprintf("low-%d", i)
		create(t, share(ns, name, "preempt", "", "0.5", map[string]string{"low": name}))
		gpuOf[name] = devices(placed(t, ns, name))[0]
	}
	e.audit(t, "preempt")

	// One victim, and the preemptor on its GPU once it is gone.
	create(t, share(ns, "high-0", "preempt", high, "0.5", nil))
	nominated(t, ns, "high-0", "preempt-0")
	first := victims(t, ns, 1)
	if p, _ := shared.admin.CoreV1().Pods(ns).Get(context.Background(), "high-0", metav1.GetOptions{}); p.Spec.NodeName != "" {
		t.Fatalf("high-0 bound to %s while its victim %s still runs", p.Spec.NodeName, first[0])
	}
	e.audit(t, "preempt")
	release(t, ns, first[0])
	waitGone(t, ns, first[0])
	if d := devices(placed(t, ns, "high-0")); len(d) != 1 || d[0] != gpuOf[first[0]] {
		t.Fatalf("high-0 placed on %v, want the GPU its victim %s left (%s)", d, first[0], gpuOf[first[0]])
	}
	e.audit(t, "preempt")

	// Of the three lows left, the one sharing high-0's GPU and one of the
	// other GPU's pair would each make room: a PDB that allows no
	// disruption protects the first and one of the pair, so the victim
	// is the other.
	var withHigh, pair []string
	for name, gpu := range gpuOf {
		switch {
		case name == first[0]:
		case gpu == gpuOf[first[0]]:
			withHigh = append(withHigh, name)
		default:
			pair = append(pair, name)
		}
	}
	slices.Sort(pair)
	if len(withHigh) != 1 || len(pair) != 2 {
		t.Fatalf("lows left: %v beside high-0, %v on the other GPU", withHigh, pair)
	}
	protected := []string{withHigh[0], pair[0]}
	zero := intstr.FromInt32(0)
	pdb := &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "protect", Namespace: ns},
		Spec: policyv1.PodDisruptionBudgetSpec{MaxUnavailable: &zero, Selector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "low", Operator: metav1.LabelSelectorOpIn, Values: protected},
		}}},
	}
	if _, err := shared.admin.PolicyV1().PodDisruptionBudgets(ns).Create(context.Background(), pdb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the scheduler's PDB informer
	create(t, share(ns, "high-1", "preempt", high, "0.5", nil))
	second := victims(t, ns, 1)
	if second[0] != pair[1] {
		t.Fatalf("victim %s, want %s: %v are under a PodDisruptionBudget that allows no disruption", second[0], pair[1], protected)
	}
	release(t, ns, second[0])
	waitGone(t, ns, second[0])
	if d := devices(placed(t, ns, "high-1")); len(d) != 1 || d[0] != gpuOf[pair[1]] {
		t.Fatalf("high-1 placed on %v, want %s", d, gpuOf[pair[1]])
	}
	e.audit(t, "preempt")

	// Each GPU now holds a priority-1000 half: three quarters fit on
	// neither whatever the lows do, so nobody is evicted.
	create(t, share(ns, "high-big", "preempt", high, "0.75", nil))
	pending(t, ns, "high-big")
	time.Sleep(3 * time.Second)
	if got := terminating(t, ns); len(got) != 0 {
		t.Fatalf("a preemptor that cannot fit evicted %v", got)
	}
	e.audit(t, "preempt")
}

// A whole-GPU pod of higher priority evicts the shares of one GPU, not
// one share on each, and takes that GPU once its reservation pod, idle,
// is deleted for it.
func TestWholeGPUPreemptionEmptiesOneGPU(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-preempt-whole")
	gpuNode(t, "preempt-whole-0", "preempt-whole", 2, 81920, true)
	cleanUp(t, ns, "preempt-whole-0")
	releaseAll(t, ns)
	high := priorityClass(t, "gpufrac-test-high-whole", 1000)

	gpuOf := map[string]string{}
	for i := range 4 {
		name := fmt.Sprintf("low-%d", i)
		create(t, share(ns, name, "preempt-whole", "", "0.5", nil))
		gpuOf[name] = devices(placed(t, ns, name))[0]
	}
	if r := reservationPods(t, "preempt-whole-0"); len(r) != 2 {
		t.Fatalf("%d reservation pods, want 2", len(r))
	}
	whole := wholeGPUPod(ns, "whole-high", testScheduler, "preempt-whole", 1)
	whole.Spec.PriorityClassName = high
	create(t, whole)
	got := victims(t, ns, 2)
	if gpuOf[got[0]] != gpuOf[got[1]] {
		t.Fatalf("victims %v hold GPUs %s and %s: want both shares of one GPU", got, gpuOf[got[0]], gpuOf[got[1]])
	}
	e.audit(t, "preempt-whole")
	for _, v := range got {
		release(t, ns, v)
	}
	waitGone(t, ns, got...)
	placed(t, ns, "whole-high")
	if r := reservationPods(t, "preempt-whole-0"); len(r) != 1 || r[0].Annotations[api.ReservedGPUAnnotation] == gpuOf[got[0]] {
		t.Fatalf("reservation pods left: %d, want only the one of the GPU the shares still hold", len(r))
	}
	e.audit(t, "preempt-whole")
}
