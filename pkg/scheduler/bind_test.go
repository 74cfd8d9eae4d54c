package scheduler

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Every combination of the four conditions lands on one named route.
func TestPlanBindRoutes(t *testing.T) {
	for _, tc := range []struct {
		bindsFirst, additive, marked bool
		gpus                         naming
		want                         bindRoute
	}{
		{true, true, false, gpusNamed, routeBinding},
		{true, true, true, gpusNamed, routeBinding},
		{true, true, false, gpusWaiting, routeReserveThenBinding},
		{true, true, true, gpusWaiting, routePreBindThenBinding},
		{true, true, false, gpusFailed, routePreBindThenBinding},
		{true, false, false, gpusNamed, routePreBindPatch},
		{true, false, false, gpusWaiting, routePreBindPatch},
		{false, true, false, gpusNamed, routePreBindPatch},
		{false, true, false, gpusWaiting, routePreBindPatch},
	} {
		if got := planBind(tc.bindsFirst, tc.additive, tc.marked, tc.gpus); got != tc.want {
			t.Errorf("planBind(bindsFirst %v, additive %v, marked %v, gpus %d) = %d, want %d", tc.bindsFirst, tc.additive, tc.marked, tc.gpus, got, tc.want)
		}
	}
}

// clientHandle is a framework handle with a client and a bind order.
type clientHandle struct {
	listingHandle
	client kubernetes.Interface
}

func (h clientHandle) ClientSet() kubernetes.Interface { return h.client }

// bindWrites runs a fractional pod through PreFilter's state, Reserve and
// the bind extension points on a two-GPU node whose first GPU's group is
// named and holds a neighbour of neighbourMiB, and returns the API writes
// each made, by extension point. A reservation pod the plugin creates is
// given GPU-2 at once, as the node agent would.
func bindWrites(t *testing.T, bindOrder []string, pod *corev1.Pod, neighbourMiB int64) map[string][]k8stesting.Action {
	t.Helper()
	client := fake.NewClientset(pod)
	var p *Plugin
	client.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() == "binding" {
			return true, nil, nil
		}
		if r, ok := a.(k8stesting.CreateAction).GetObject().(*corev1.Pod); ok && r.Namespace == testArgs().ReservationNamespace {
			named := r.DeepCopy()
			named.UID = "uid-" + types.UID(r.Name)
			named.Annotations = api.ReservedGPUWrite("GPU-2").Apply(r.Annotations)
			p.cache.SetPod(named)
		}
		return false, nil, nil
	})
	p = &Plugin{args: testArgs(), cache: NewCache(testArgs()), handle: clientHandle{listingHandle{bind: bindOrder}, client}}
	p.cache.SetNode(node("n1", 2, 81920, true))
	p.cache.SetPod(reservationPod("n1", "g1", "GPU-1"))
	p.cache.SetPod(fractionPodOn("neighbour", "n1", "g1", "GPU-1", neighbourMiB))
	ctx := context.Background()
	state := framework.NewCycleState()
	// PreFilter's state, without its DRA sync (no DRA manager here).
	reqs, err := api.Parse(api.Intent(pod))
	if err != nil || len(reqs) != 1 {
		t.Fatalf("Parse: %v, %v", reqs, err)
	}
	policy, err := p.policy()
	if err != nil {
		t.Fatal(err)
	}
	state.Write(stateKey, &cycle{ask: Ask{UID: pod.UID, Fraction: &reqs[0]}, policy: policy})
	if err := p.cache.Reserve("n1", pod.Namespace, pod.Name, Ask{UID: pod.UID, Fraction: &reqs[0]}, policy, Host{}); err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	writes := map[string][]k8stesting.Action{}
	mark := func(point string) {
		writes[point] = client.Actions()
		client.ClearActions()
	}
	client.ClearActions()
	_, s := p.PreBindPreFlight(ctx, state, pod, "n1")
	if !s.IsSuccess() && !s.IsSkip() {
		t.Fatalf("PreBindPreFlight: %v", s)
	}
	if !s.IsSkip() {
		if s := p.PreBind(ctx, state, pod, "n1"); !s.IsSuccess() {
			t.Fatalf("PreBind: %v", s)
		}
	}
	mark("PreBind")
	if s := p.Bind(ctx, state, pod, "n1"); !s.IsSuccess() && !s.IsSkip() {
		t.Fatalf("Bind: %v", s)
	}
	mark("Bind")
	return writes
}

// fractionPodOn is a bound tenant of mib on a group's GPU.
func fractionPodOn(name, nodeName, group, uuid string, mib int64) *corev1.Pod {
	p := fractionPod(name, nodeName, "0.25")
	a := api.Assignment{Container: "main", Devices: []string{uuid}, RequestMiB: mib, LimitMiB: mib, Mode: api.TimeSlicing}
	w, _ := api.Decision{Assignment: a, Groups: []string{group}}.Write(p.Annotations)
	p.Annotations = w.Apply(p.Annotations)
	return p
}

// routeBinding: joining a named GPU costs one write, the Binding, which
// carries the decision; routePreBindPatch: a patch in PreBind, and Bind
// left to DefaultBinder.
func TestBindRoutesWriteWhatTheyPlan(t *testing.T) {
	t.Run("binding", func(t *testing.T) {
		writes := bindWrites(t, []string{Name, "DefaultBinder"}, fractionPod("p", "", "0.25"), 20480)
		if len(writes["PreBind"]) != 0 || len(writes["Bind"]) != 1 || writes["Bind"][0].GetSubresource() != "binding" {
			t.Fatalf("writes %v: want one Binding in Bind and nothing before", writes)
		}
		b := writes["Bind"][0].(k8stesting.CreateAction).GetObject().(*corev1.Binding)
		if b.Annotations[api.ContainerKey("main", api.SuffixDevices)] != "GPU-1" || b.Target.Name != "n1" {
			t.Errorf("binding %+v: want the decision on GPU-1 and node n1", b)
		}
	})
	t.Run("patch when another binder runs first", func(t *testing.T) {
		writes := bindWrites(t, []string{"DefaultBinder", Name}, fractionPod("p", "", "0.25"), 20480)
		if len(writes["PreBind"]) != 1 || writes["PreBind"][0].GetVerb() != "patch" || len(writes["Bind"]) != 0 {
			t.Fatalf("writes %v: want one patch in PreBind and no Binding of ours", writes)
		}
	})
	t.Run("patch when a key must go", func(t *testing.T) {
		stale := fractionPod("p", "", "0.25")
		stale.Annotations[api.ContainerKey("main", api.SuffixComputePortion)] = "0.5"
		writes := bindWrites(t, []string{Name, "DefaultBinder"}, stale, 20480)
		if len(writes["PreBind"]) != 1 || writes["PreBind"][0].GetVerb() != "patch" || len(writes["Bind"]) != 0 {
			t.Fatalf("writes %v: want one patch in PreBind and no Binding of ours", writes)
		}
	})
	// The first GPU is too full: the share opens the second, whose
	// reservation pod Bind makes (routeReserveThenBinding), or PreBind
	// for a pod already reported unschedulable (routePreBindThenBinding).
	isCreate := func(a k8stesting.Action, sub string) bool {
		return a.GetVerb() == "create" && a.GetSubresource() == sub
	}
	t.Run("reserve then binding", func(t *testing.T) {
		writes := bindWrites(t, []string{Name, "DefaultBinder"}, fractionPod("p", "", "0.25"), 70000)
		if len(writes["PreBind"]) != 0 || len(writes["Bind"]) != 2 || !isCreate(writes["Bind"][0], "") || !isCreate(writes["Bind"][1], "binding") {
			t.Fatalf("writes %v: want the reservation pod, then the Binding, both in Bind", writes)
		}
	})
	t.Run("PreBind then binding", func(t *testing.T) {
		marked := fractionPod("p", "", "0.25")
		marked.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable}}
		writes := bindWrites(t, []string{Name, "DefaultBinder"}, marked, 70000)
		if len(writes["PreBind"]) != 1 || !isCreate(writes["PreBind"][0], "") || len(writes["Bind"]) != 1 || !isCreate(writes["Bind"][0], "binding") {
			t.Fatalf("writes %v: want the reservation pod in PreBind, the Binding in Bind", writes)
		}
	})
}

// A missing PreFilter state is an error, as in NodeResourcesFit: the node
// is never passed unchecked.
func TestMissingCycleStateIsAnError(t *testing.T) {
	p := &Plugin{args: testArgs(), cache: NewCache(testArgs())}
	p.cache.SetNode(node("n1", 2, 81920, true))
	info := framework.NewNodeInfo()
	info.SetNode(node("n1", 2, 81920, true))
	state := framework.NewCycleState()
	pod := fractionPod("p", "", "0.25")
	if s := p.Filter(context.Background(), state, pod, info); s.Code() != fwk.Error {
		t.Errorf("Filter without PreFilter's state: %v, want an error", s)
	}
	if _, s := p.Score(context.Background(), state, pod, info); s.Code() != fwk.Error {
		t.Errorf("Score without PreFilter's state: %v, want an error", s)
	}
	if _, s := p.PreBindPreFlight(context.Background(), state, pod, "n1"); s.Code() != fwk.Error {
		t.Errorf("PreBindPreFlight without PreFilter's state: %v, want an error", s)
	}
}
