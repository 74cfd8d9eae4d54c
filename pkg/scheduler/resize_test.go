package scheduler

import (
	"maps"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// resizeCluster is a node of one 80000Mi GPU (no reserve) that enforces
// with backend, holding p1 (20000Mi) and p2 (50000Mi).
func resizeCluster(t *testing.T, backend string) *Cache {
	t.Helper()
	c := NewCache(testArgs())
	n := node("n1", 1, 80000, true)
	n.Labels[api.LabelMemoryEnforcement] = backend
	c.SetNode(n)
	c.SetPod(reservationPod("n1", "ga", "GPU-a"))
	c.SetPod(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}))
	c.SetPod(placedPod("p2", "n1", 50000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}))
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 ga:70000Mi/0‰/2/" {
		t.Fatalf("before: %s", got)
	}
	return c
}

// resizing is p with its resize keys set, as the user writes them.
func resizing(p *corev1.Pod, keys map[string]string) *corev1.Pod {
	p = p.DeepCopy()
	maps.Copy(p.Annotations, keys)
	return p
}

func TestResizeGrowsWhereItFitsAndWaitsWhereNot(t *testing.T) {
	c := resizeCluster(t, "driver")
	p1 := placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"})

	// 30000Mi: 10000 more, which the GPU has free. Booked at once.
	grow := resizing(p1, map[string]string{api.KeyResizeRequest: "30000Mi"})
	c.SetPod(grow)
	if len(c.Resizes()) != 1 {
		t.Fatalf("the asked resize is not tracked: %v", c.Resizes())
	}
	v, ok := c.decideResize(grow, quota{})
	if !ok || !v.grant {
		t.Fatalf("a grow into free memory: %+v %v", v, ok)
	}
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 ga:80000Mi/0‰/2/" {
		t.Errorf("after the grant: %s", got)
	}
	// An update of the pod before the grant's write lands changes nothing.
	c.SetPod(grow)
	if got := summary(c, "n1"); !strings.Contains(got, "ga:80000Mi") {
		t.Errorf("a stale update undid the booked grant: %s", got)
	}
	// The grant's write lands: booked as the pod says, nothing waits.
	granted := resizing(grow, api.ResizeDecision(*mustAssignment(t, grow), mustResize(t, grow), api.Memory{RequestMiB: 30000, LimitMiB: 30000}).Set)
	c.SetPod(granted)
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 ga:80000Mi/0‰/2/" || len(c.Resizes()) != 0 {
		t.Errorf("after the write: %s, waiting %d", got, len(c.Resizes()))
	}

	// One resize at a time: until the node applies the grant, the next waits.
	early := resizing(granted, map[string]string{api.KeyResizeRequest: "25000Mi"})
	c.SetPod(early)
	if v, ok := c.decideResize(early, quota{}); !ok || v.grant || v.reason != api.ReasonResizeDeferred || !strings.Contains(v.message, "has not yet applied the previous resize") {
		t.Errorf("a resize while the last is being applied: %+v %v", v, ok)
	}
	applied := resizing(granted, api.EnforcedWrite(api.Memory{RequestMiB: 30000, LimitMiB: 30000}).Set)
	c.SetPod(applied)

	// Another 1Mi does not fit: deferred, the allocation unchanged.
	more := resizing(applied, map[string]string{api.KeyResizeRequest: "30001Mi"})
	c.SetPod(more)
	if v, ok := c.decideResize(more, quota{}); !ok || v.grant || v.reason != api.ReasonResizeDeferred || !strings.Contains(v.message, "NotEnoughGPUMemory") {
		t.Errorf("a grow past the free memory: %+v %v", v, ok)
	}
	// Larger than the GPU: infeasible.
	huge := resizing(applied, map[string]string{api.KeyResizeRequest: "80001Mi"})
	if v, ok := c.decideResize(huge, quota{}); !ok || v.reason != api.ReasonResizeInfeasible || !strings.Contains(v.message, "LargerThanGPU") {
		t.Errorf("a grow past the GPU: %+v %v", v, ok)
	}
	// The neighbour goes: the deferred grow is tried again and fits.
	dirty := c.Dirty()
	c.DeletePod(placedPod("p2", "n1", 50000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}))
	select {
	case <-dirty:
	default:
		t.Error("freed memory does not wake the writer")
	}
	if v, ok := c.decideResize(more, quota{}); !ok || !v.grant {
		t.Errorf("the deferred grow once memory is free: %+v %v", v, ok)
	}
}

func TestResizeShrinkFreesMemoryOnlyOnceTheNodeHoldsIt(t *testing.T) {
	c := resizeCluster(t, "driver")
	p2 := placedPod("p2", "n1", 50000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"})
	shrink := resizing(p2, map[string]string{api.KeyResizeRequest: "10000Mi"})
	c.SetPod(shrink)
	if v, ok := c.decideResize(shrink, quota{}); !ok || !v.grant {
		t.Fatalf("a shrink: %+v %v", v, ok)
	}
	granted := resizing(shrink, api.ResizeDecision(*mustAssignment(t, shrink), mustResize(t, shrink), api.Memory{RequestMiB: 10000, LimitMiB: 50000}).Set)
	c.SetPod(granted)
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 ga:70000Mi/0‰/2/" {
		t.Errorf("granted, not applied: %s, want the old 50000Mi still charged", got)
	}
	dirty := c.Dirty()
	c.SetPod(resizing(granted, api.EnforcedWrite(api.Memory{RequestMiB: 10000, LimitMiB: 50000}).Set))
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 ga:30000Mi/0‰/2/" {
		t.Errorf("applied: %s", got)
	}
	select {
	case <-dirty:
	default:
		t.Error("memory a shrink freed does not wake the writer")
	}
	// A restarted scheduler reads the same books from the pods.
	again := NewCache(testArgs())
	n := node("n1", 1, 80000, true)
	n.Labels[api.LabelMemoryEnforcement] = "driver"
	again.SetNode(n)
	again.SetPod(reservationPod("n1", "ga", "GPU-a"))
	again.SetPod(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}))
	again.SetPod(granted)
	if got := summary(again, "n1"); got != "idle=0 whole=0 conflicts=0 ga:70000Mi/0‰/2/" {
		t.Errorf("rebuilt while the shrink is applied: %s", got)
	}
}

func TestResizeOnANodeThatCannotIsInfeasible(t *testing.T) {
	c := resizeCluster(t, "mps-pinned")
	p1 := resizing(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}), map[string]string{api.KeyResizeRequest: "10000Mi"})
	c.SetPod(p1)
	v, ok := c.decideResize(p1, quota{})
	if !ok || v.grant || v.reason != api.ReasonResizeInfeasible || !strings.Contains(v.message, `"mps-pinned"`) {
		t.Errorf("%+v %v", v, ok)
	}
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 ga:70000Mi/0‰/2/" {
		t.Errorf("an infeasible resize changed the books: %s", got)
	}
}

func mustAssignment(t *testing.T, p *corev1.Pod) *api.Assignment {
	t.Helper()
	as, err := api.ParseAssignments(p.Annotations)
	if err != nil || len(as) != 1 {
		t.Fatal(as, err)
	}
	return &as[0]
}

func mustResize(t *testing.T, p *corev1.Pod) api.Resize {
	t.Helper()
	r, err := api.ResizeOf(p.Annotations, *mustAssignment(t, p))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestResizeStaysWithinWhatQuotaCharged(t *testing.T) {
	c := resizeCluster(t, "driver")
	p1 := resizing(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}), map[string]string{api.KeyResizeRequest: "25000Mi"})
	c.SetPod(p1)
	v, ok := c.decideResize(p1, quota{bounded: true, mib: 24000})
	if !ok || v.grant || v.reason != api.ReasonResizeInfeasible || !strings.Contains(v.message, "charged to its namespace's GPU memory quota") {
		t.Errorf("a grow past the pod's quota charge: %+v %v", v, ok)
	}
	if v, ok := c.decideResize(p1, quota{bounded: true, mib: 25000}); !ok || !v.grant {
		t.Errorf("a grow within the pod's quota charge: %+v %v", v, ok)
	}
}

func TestLeaderLeaseArgument(t *testing.T) {
	for lease, ok := range map[string]bool{"": true, "gpufrac-system/gpufrac-scheduler": true, "gpufrac-scheduler": false, "Bad_NS/x": false, "ns/": false} {
		a := testArgs()
		a.LeaderLease = lease
		if err := a.Validate(); (err == nil) != ok {
			t.Errorf("leaderLease %q: %v", lease, err)
		} else if err != nil && !strings.Contains(err.Error(), "leaderLease") {
			t.Errorf("leaderLease %q: the error does not name the argument: %v", lease, err)
		}
	}
}

func TestResizeWithdrawnClearsItsPendingCondition(t *testing.T) {
	c := resizeCluster(t, "driver")
	p1 := placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"})
	p1.Status.Conditions = []corev1.PodCondition{{Type: api.ConditionResizePending, Status: corev1.ConditionTrue, Reason: api.ReasonResizeDeferred}}
	c.SetPod(p1)
	if len(c.Resizes()) != 1 {
		t.Fatal("a pod whose Pending condition says it waits is not tracked once it asks nothing")
	}
	if v, ok := c.decideResize(p1, quota{}); !ok || !v.withdrawn || v.grant {
		t.Errorf("%+v %v", v, ok)
	}
	// Placed by another scheduler (no GPU groups of gpufrac's): infeasible.
	kai := resizing(placedPod("p2", "n1", 50000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}), map[string]string{api.KeyResizeRequest: "40000Mi"})
	delete(kai.Annotations, api.GPUGroupsAnnotation)
	c.SetPod(kai)
	if v, ok := c.decideResize(kai, quota{}); !ok || v.reason != api.ReasonResizeInfeasible || !strings.Contains(v.message, "placed by another scheduler") {
		t.Errorf("%+v %v", v, ok)
	}
}
