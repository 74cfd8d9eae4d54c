package scheduler

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// claimOn is a claim allocated a share of memoryMiB on the GPU uuid of
// node's pool.
func claimOn(name, node, uuid string, memoryMiB int64) *resourceapi.ResourceClaim {
	device, _ := api.DRADeviceName(uuid, api.TimeSlicing)
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("uid-" + name), ResourceVersion: "1"}}
	c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "gpu", Driver: api.DRADriver, Pool: node, Device: device,
		ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{api.DRACapacityMemory: *resource.NewQuantity(memoryMiB<<20, resource.BinarySI)},
	}}}}
	return c
}

// A node that asks for standing GPUs gets them booked at once, each held
// for shares; claims and annotation pods then share them on one ledger:
// an annotation pod joins a claim's GPU, what annotation shares hold is
// written for the node (claims left out: the allocator counts those), and
// a claim that no longer fits is a conflict that Reserve refuses.
func TestClaimsAndAnnotationSharesOnStandingGPUs(t *testing.T) {
	c := NewCache(testArgs())
	n := node("n1", 2, 80000, true)
	n.Labels[api.LabelStandingGPUs] = "2"
	c.SetNode(n)
	taken := c.TakeStanding()
	if len(taken) != 2 || len(c.TakeStanding()) != 0 {
		t.Fatalf("TakeStanding: %v, then more; want two standing groups, once", taken)
	}
	for i, st := range taken {
		c.SetPod(reservationPod("n1", st.Group, []string{"GPU-a", "GPU-b"}[i]))
	}
	if pl, err := placementFor("gpufrac", c); err != nil {
		t.Fatal(err)
	} else if err := c.Reserve("n1", "default", "whole", Ask{UID: "uid-whole", Whole: 1}, pl, Host{}); err == nil {
		t.Error("a whole-GPU pod was given a GPU held for shares")
	}

	if err := c.SyncClaims([]*resourceapi.ResourceClaim{claimOn("c1", "n1", "GPU-a", 50000)}); err != nil {
		t.Fatal(err)
	}
	// An sm-sharing pod never joins the time-slicing claim's GPU.
	p, err := placementFor("gpufrac", c)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Reserve("n1", "default", "sm", ask("uid-sm", 10000, api.SMSharing, 1), p, Host{}); err != nil {
		t.Fatal(err)
	}
	if d, _ := c.Decision("uid-sm"); len(d.Groups) != 1 || d.Groups[0] != ledgers.StandingGroup(1) {
		t.Errorf("the sm-sharing pod went to %v, want the other standing GPU (standing-1): GPU-a runs time-slicing", d.Groups)
	}
	c.Unreserve("uid-sm")
	c.SetPod(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{ledgers.StandingGroup(0)}, []string{"GPU-a"}))
	if got := summary(c, "n1"); !strings.Contains(got, "70000") {
		t.Errorf("GPU-a should hold the claim's 50000 and the pod's 20000: %s", got)
	}
	updates := c.HeldUpdates()
	var held string
	for _, u := range updates {
		if u.Name == ReservationName("n1", ledgers.StandingGroup(0)) {
			held = u.Held.String()
		}
	}
	if want := (api.SharesHeld{MemoryMiB: 20000, Mode: api.TimeSlicing}).String(); held != want {
		t.Errorf("what annotation shares hold of GPU-a: %q, want %q (the claim is the allocator's to count)", held, want)
	}

	// Stale slices let the allocator give GPU-a 20000 more.
	if err := c.SyncClaims([]*resourceapi.ResourceClaim{claimOn("c1", "n1", "GPU-a", 50000), claimOn("c2", "n1", "GPU-a", 20000)}); err != nil {
		t.Fatal(err)
	}
	if why := c.ClaimConflict("uid-c2"); !strings.Contains(why, "does not fit") {
		t.Errorf("an over-committing claim: conflict %q", why)
	}
	if why := c.ClaimConflict("uid-c1"); !strings.Contains(why, "takes no new share") {
		t.Errorf("while the node has a conflict, no claim is let through: conflict %q", why)
	}
	if len(c.HeldUpdates()) != 2 {
		t.Errorf("HeldUpdates: %v, want both standing pods", c.HeldUpdates())
	}
	for _, u := range c.HeldUpdates() {
		if h, err := api.ParseSharesHeld(u.Held.String()); err != nil || h.MemoryMiB != 80000 {
			t.Errorf("with a conflict on the node, %s should offer claims nothing (80000 held): %s, %v", u.Name, u.Held.String(), err)
		}
	}
	c.ForgetClaim("uid-c2")
	if why := c.ClaimConflict("uid-c1"); why != "" {
		t.Errorf("the claim that fits, once the other is gone: conflict %q", why)
	}
	if err := c.SyncClaims([]*resourceapi.ResourceClaim{claimOn("c1", "n1", "GPU-a", 50000)}); err != nil {
		t.Fatal(err)
	}
	if err := c.SyncClaims(nil); err != nil {
		t.Fatal(err)
	}
	if got := summary(c, "n1"); !strings.Contains(got, "20000") || strings.Contains(got, "70000") {
		t.Errorf("after the claims went, GPU-a should hold the pod's 20000 only: %s", got)
	}
	if o := c.Orphans(); len(o) != 0 {
		t.Errorf("standing reservation pods are never orphans: %v", o)
	}
}

// A GPU that an ordinary group's idle reservation pod keeps (a share
// placed before the node's standing pods existed) goes to the standing
// pod the node lacks: the idle pod is retired for the collector to
// delete, and once it is gone the standing pod takes the GPU.
func TestStandingGPUsTakeBackIdleReservations(t *testing.T) {
	c := NewCache(testArgs())
	n := node("n1", 2, 80000, true)
	c.SetNode(n)
	c.SetPod(reservationPod("n1", "early", "GPU-a"))
	n = n.DeepCopy()
	n.Labels[api.LabelStandingGPUs] = "2"
	c.SetNode(n)
	if taken := c.TakeStanding(); len(taken) != 1 {
		t.Fatalf("TakeStanding: %v, want one standing pod (one GPU is idle)", taken)
	}
	o := c.Orphans()
	if len(o) != 1 || o[0].Name != ReservationName("n1", "early") {
		t.Fatalf("orphans %v, want the idle reservation pod of group early", o)
	}
	c.DeletePod(reservationPod("n1", "early", "GPU-a"))
	if taken := c.TakeStanding(); len(taken) != 1 || taken[0].Group != ledgers.StandingGroup(1) {
		t.Fatalf("TakeStanding once the idle pod is gone: %v, want standing-1", taken)
	}
}

// The collector is woken when a standing reservation pod's GPU becomes
// known, not left to its half-minute tick: until it writes what the
// GPU's annotation shares hold, the node offers DRA claims nothing there.
func TestStandingGPUKnownWakesTheCollector(t *testing.T) {
	c := NewCache(testArgs())
	n := node("n1", 1, 80000, true)
	n.Labels[api.LabelStandingGPUs] = "1"
	c.SetNode(n)
	taken := c.TakeStanding()
	if len(taken) != 1 {
		t.Fatalf("TakeStanding: %v, want one", taken)
	}
	c.SetPod(reservationPod("n1", taken[0].Group, ""))
	if len(c.HeldUpdates()) != 0 {
		t.Fatalf("HeldUpdates before the GPU is known: %v, want none", c.HeldUpdates())
	}
	dirty := c.Dirty()
	c.SetPod(reservationPod("n1", taken[0].Group, ""))
	select {
	case <-dirty:
		t.Error("an unchanged standing reservation pod woke the collector")
	default:
	}
	c.SetPod(reservationPod("n1", taken[0].Group, "GPU-a"))
	select {
	case <-dirty:
	default:
		t.Fatal("the standing GPU's UUID arrived and the collector was not woken")
	}
	if u := c.HeldUpdates(); len(u) != 1 || u[0].Held != (api.SharesHeld{}) {
		t.Errorf("HeldUpdates once the GPU is known: %v, want the one pod, holding nothing", u)
	}
}

// A pod this plugin refused is tried again on the events that can make it
// fit, and not on those that cannot: a claim pod on its node's slices
// changing (Reserve refuses one whose slices lag behind the ledger), any
// pod on a claim of ours released or a bound pod's decision written or
// its end; nobody on a bound pod's status heartbeat or a foreign claim.
func TestRefusedPodsAreRetriedOnWhatCanMakeThemFit(t *testing.T) {
	p := &Plugin{}
	events, err := p.EventsToRegister(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	hint := func(r fwk.EventResource, a fwk.ActionType, pod *corev1.Pod, oldObj, newObj any) fwk.QueueingHint {
		t.Helper()
		for _, e := range events {
			if e.Event.Resource == r && e.Event.ActionType&a != 0 {
				if e.QueueingHintFn == nil {
					return fwk.Queue
				}
				h, err := e.QueueingHintFn(klog.Background(), pod, oldObj, newObj)
				if err != nil {
					t.Fatal(err)
				}
				return h
			}
		}
		return fwk.QueueSkip // not registered: the pod waits for the queue's flush
	}
	claimPod := &corev1.Pod{Spec: corev1.PodSpec{ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu"}}}}
	fractional := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{api.KeyFraction: "0.5"}}}
	bound := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "b", Annotations: map[string]string{api.KeyFraction: "0.5"}}, Spec: corev1.PodSpec{NodeName: "n1"}}
	decided := bound.DeepCopy()
	decided.Annotations["gpu-fraction.main.devices"] = "GPU-1"
	heartbeat := bound.DeepCopy()
	heartbeat.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	done := bound.DeepCopy()
	done.Status.Phase = corev1.PodSucceeded
	mine, foreign := claimOn("c", "n1", "GPU-1", 4096), claimOn("f", "n1", "GPU-1", 4096)
	foreign.Status.Allocation.Devices.Results[0].Driver = "gpu.nvidia.com"
	slice := &resourceapi.ResourceSlice{}
	for _, c := range []struct {
		what string
		got  fwk.QueueingHint
		want fwk.QueueingHint
	}{
		{"claim pod, slices updated", hint(fwk.ResourceSlice, fwk.Update, claimPod, slice, slice), fwk.Queue},
		{"claim pod, slice added", hint(fwk.ResourceSlice, fwk.Add, claimPod, nil, slice), fwk.Queue},
		{"annotation pod, slices updated", hint(fwk.ResourceSlice, fwk.Update, fractional, slice, slice), fwk.QueueSkip},
		{"our claim released", hint(fwk.ResourceClaim, fwk.Update, fractional, mine, foreign), fwk.Queue},
		{"our claim deleted", hint(fwk.ResourceClaim, fwk.Delete, claimPod, mine, nil), fwk.Queue},
		{"a foreign claim changed", hint(fwk.ResourceClaim, fwk.Update, fractional, foreign, foreign), fwk.QueueSkip},
		{"a claim's tombstone", hint(fwk.ResourceClaim, fwk.Delete, fractional, "tombstone", nil), fwk.Queue},
		{"a bound pod's decision written", hint(fwk.AssignedPod, fwk.Update, fractional, bound, decided), fwk.Queue},
		{"a bound pod ended", hint(fwk.AssignedPod, fwk.Update, claimPod, bound, done), fwk.Queue},
		{"a bound pod's status heartbeat", hint(fwk.AssignedPod, fwk.Update, fractional, bound, heartbeat), fwk.QueueSkip},
		{"a pod deleted", hint(fwk.Pod, fwk.Delete, claimPod, bound, nil), fwk.Queue},
	} {
		if c.got != c.want {
			t.Errorf("%s: %v, want %v", c.what, c.got, c.want)
		}
	}
}
