package scheduler

import (
	"fmt"
	"math/rand"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/api/apitest"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

func testArgs() Args {
	var a Args
	a.Default()
	return a
}

func node(name string, gpus int, memMiB int64, ready bool) *corev1.Node {
	n := apitest.GPUNode(name, api.Inventory{Count: gpus, MemoryMiB: memMiB, Model: "H100"}, "driver", true)
	if !ready {
		n.Status.Conditions[0].Status = corev1.ConditionFalse
	}
	n.Status.Conditions[0].Reason = "Test"
	return n
}

func pod(name, nodeName string, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("uid-" + name), Annotations: annotations},
		Spec:       corev1.PodSpec{NodeName: nodeName, Containers: []corev1.Container{{Name: "main"}}},
	}
}

// placedPod is a pod as the scheduler leaves it: bound, with its decision.
func placedPod(name, nodeName string, mib int64, mode api.ComputeMode, portion string, groups []string, uuids []string) *corev1.Pod {
	a := api.Assignment{Container: "main", Devices: uuids, RequestMiB: mib, LimitMiB: mib, Mode: mode}
	if portion != "" {
		a.Portion, _ = api.ParseFraction(portion)
	}
	p := apitest.Placed("default", name, nodeName, a, groups...)
	return p
}

func wholePod(name, nodeName string, n int64) *corev1.Pod {
	p := pod(name, nodeName, nil)
	p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(n, resource.DecimalSI)}
	return p
}

func reservationPod(nodeName, group, uuid string) *corev1.Pod {
	p := ReservationPod(testArgs(), nodeName, group)
	p.UID = types.UID("uid-" + p.Name)
	if uuid != "" {
		p.Annotations = map[string]string{api.ReservedGPUAnnotation: uuid}
	}
	return p
}

// summary describes a node's GPUs independently of slot numbering: per GPU
// group its charged memory, compute and tenant count, and its whole-GPU
// holder (a reservation being deleted) or "held-for-shares" for an idle
// group whose reservation pod is kept; plus the counts of idle and
// whole-owned GPUs.
func summary(c *Cache, name string) string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ns := c.nodes[name]
	if ns == nil || ns.Ledger == nil {
		return "no ledger"
	}
	var parts []string
	idle, whole := 0, 0
	for i, d := range ns.Ledger.Devices {
		held := d.Whole()
		switch {
		case d.Idle() && d.SharedOnly:
			held = "held-for-shares"
		case d.Idle():
			idle++
			continue
		case d.Whole() != "" && !strings.HasPrefix(d.Whole(), "reservation/"):
			whole++
			continue
		}
		group := "?"
		for g, s := range ns.Groups {
			if s == i {
				group = g
			}
		}
		parts = append(parts, fmt.Sprintf("%s:%dMi/%d‰/%d/%s", group, d.Charged(), d.Portion(), len(d.Shares()), held))
	}
	slices.Sort(parts)
	return fmt.Sprintf("idle=%d whole=%d conflicts=%d %s", idle, whole, len(ns.Conflicts), strings.Join(parts, " "))
}

// The cache is the same whatever order the informers deliver the objects
// in: the restart promise rests on this.
func TestCacheRebuildIsOrderIndependent(t *testing.T) {
	objects := []any{
		node("n1", 4, 80000, true),
		reservationPod("n1", "ga", "GPU-a"),
		reservationPod("n1", "gb", "GPU-b"),
		reservationPod("n1", "gc", "GPU-c"), // no tenant: kept, holding its GPU for shares
		placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}),
		placedPod("p2", "n1", 30000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}),
		placedPod("p3", "n1", 40000, api.SMSharing, "0.5", []string{"gb"}, []string{"GPU-b"}),
		wholePod("w1", "n1", 1),
		wholePod("pending-whole", "", 1), // not bound: holds nothing
	}
	want := ""
	for seed := range 40 {
		order := slices.Clone(objects)
		rand.New(rand.NewSource(int64(seed))).Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		c := NewCache(testArgs())
		for _, o := range order {
			switch o := o.(type) {
			case *corev1.Node:
				c.SetNode(o)
			case *corev1.Pod:
				c.SetPod(o)
			}
		}
		got := summary(c, "n1")
		if seed == 0 {
			want = got
			if want != "idle=0 whole=1 conflicts=0 ga:50000Mi/0‰/2/ gb:40000Mi/500‰/1/ gc:0Mi/0‰/0/held-for-shares" {
				t.Fatalf("cache after replay: %s", want)
			}
		}
		if got != want {
			t.Fatalf("seed %d: order changed the cache:\n got  %s\n want %s", seed, got, want)
		}
		if o := c.Orphans(); len(o) != 0 {
			t.Fatalf("orphans %v, want none: an idle reservation pod is kept", o)
		}
	}
}

// The cache reads gpufrac's pods and KAI's as its binder leaves them (no
// groups, CDI names, sm-sharing without a portion) into one node's
// tenancy (ledgers.Node, the very model audit and top build; no second
// reader to agree with).
func TestCacheReadsBothSchedulersPods(t *testing.T) {
	n := node("n1", 4, 80000, true)
	kai := pod("kai", "n1", map[string]string{
		api.ContainerKey("main", api.SuffixDevices):       "k8s.device-plugin.nvidia.com/gpu=GPU-d",
		api.ContainerKey("main", api.SuffixMemoryRequest): "20Gi",
		api.ContainerKey("main", api.SuffixComputeMode):   "sm-sharing",
	})
	pods := []*corev1.Pod{
		reservationPod("n1", "ga", "GPU-a"),
		reservationPod("n1", "gd", "GPU-d"),
		placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}),
		placedPod("p2", "n1", 30000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}),
		kai,
		wholePod("w1", "n1", 1),
	}
	c := NewCache(testArgs())
	c.SetNode(n)
	for _, p := range pods {
		c.SetPod(p)
	}
	got := summary(c, "n1")
	if want := "idle=1 whole=1 conflicts=0 ga:50000Mi/0‰/2/ gd:20480Mi/256‰/1/"; got != want {
		t.Fatalf("cache: %s, want %s", got, want)
	}
}

// A tenant's GPU is what cannot be forged: the GPU its decision names,
// joined with the reservation pod that holds it. An edited
// gpufrac.io/gpu-groups (a tenant may write its own annotations) neither
// closes the node nor books a second GPU, after a restart too.
func TestEditedGroupsCannotMoveAShare(t *testing.T) {
	for _, forged := range []string{"zzz", "gb"} {
		c := NewCache(testArgs())
		c.SetNode(node("n1", 2, 80000, true))
		for _, p := range []*corev1.Pod{
			reservationPod("n1", "ga", "GPU-a"),
			reservationPod("n1", "gb", "GPU-b"),
			placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}),
			placedPod("edited", "n1", 30000, api.TimeSlicing, "", []string{forged}, []string{"GPU-a"}),
		} {
			c.SetPod(p)
		}
		if got, want := summary(c, "n1"), "idle=0 whole=0 conflicts=0 ga:50000Mi/0‰/2/ gb:0Mi/0‰/0/held-for-shares"; got != want {
			t.Errorf("groups edited to %q: cache %s, want %s", forged, got, want)
		}
	}
}

// A KAI sm-sharing pod seen before its node's inventory waits for it,
// rather than being frozen with no compute portion and closing the node.
func TestKAIPodBeforeItsNodeWaitsForTheInventory(t *testing.T) {
	kai := pod("kai", "n1", map[string]string{
		api.ContainerKey("main", api.SuffixDevices):       "GPU-d",
		api.ContainerKey("main", api.SuffixMemoryRequest): "20000Mi",
		api.ContainerKey("main", api.SuffixComputeMode):   "sm-sharing",
	})
	c := NewCache(testArgs())
	c.SetPod(kai)
	c.SetNode(node("n1", 2, 80000, true))
	if got, want := summary(c, "n1"), "idle=1 whole=0 conflicts=0 uuid-gpu-d:20000Mi/250‰/1/"; got != want {
		t.Errorf("cache: %s, want %s", got, want)
	}
}

// KAI's portion limit (what its admission writes from gpu-fraction.limit)
// is resolved on the chosen GPU into the limit the scheduler writes.
func TestKAIPortionLimitResolvesIntoTheLimit(t *testing.T) {
	reqs, err := api.Parse(pod("p", "", map[string]string{api.KeyFraction: "0.25", api.PortionLimitKey("main"): "0.5"}))
	if err != nil || len(reqs) != 1 {
		t.Fatalf("Parse: %v, %v", reqs, err)
	}
	share, resolved, err := shareOn(reqs[0], api.Inventory{Count: 1, MemoryMiB: 81920, Model: "H100", ReserveMiB: 1024})
	if err != nil || resolved.RequestMiB != 20224 || resolved.LimitMiB != 40448 || share.Request != 20224 || share.Limit != 40448 {
		t.Errorf("resolved %+v, share %+v, %v: want request 20224Mi and limit 40448Mi of 80896Mi schedulable", resolved, share, err)
	}
	d := Decision{Container: "main", Groups: []string{"g"}, Resolved: resolved, Mode: api.TimeSlicing}
	if w, _ := d.write([]string{"GPU-1"}, "", nil); w.Set[api.ContainerKey("main", api.SuffixMemoryLimit)] != "40448Mi" {
		got := w.Set[api.ContainerKey("main", api.SuffixMemoryLimit)]
		t.Errorf("written limit %v, want 40448Mi", got)
	}
}

// A fractional pod bound without a decision (by hand, or by a scheduler
// that crashed) is charged where it fits, so the node is never
// over-committed meanwhile.
func TestCacheChargesBoundPodWithoutDecision(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 1, 80000, true))
	c.SetPod(pod("bare", "n1", map[string]string{api.KeyFraction: "0.5"}))
	if got := summary(c, "n1"); !strings.Contains(got, ":40000Mi/0‰/1/") {
		t.Fatalf("bound pod without decision not charged: %s", got)
	}
	v := c.Filter("n1", Ask{UID: "x", Fraction: &api.Request{Container: "main", Memory: api.Amount{MiB: 50000}, Limit: api.Amount{MiB: 50000}, Mode: api.TimeSlicing, Devices: 1}})
	if v.Fits {
		t.Fatal("a 50000Mi share fits a GPU with 40000Mi free")
	}
	c.DeletePod(pod("bare", "n1", nil))
	if got := summary(c, "n1"); got != "idle=1 whole=0 conflicts=0 " {
		t.Fatalf("after delete: %s", got)
	}
}

func ask(uid string, mib int64, mode api.ComputeMode, devices int) Ask {
	return Ask{UID: types.UID(uid), Fraction: &api.Request{Container: "main", Memory: api.Amount{MiB: mib}, Limit: api.Amount{MiB: mib}, Mode: mode, Devices: devices}}
}

// Reserve and Unreserve are exact inverses, and a reserved pod confirmed
// by the API is not charged twice.
func TestReserveUnreserve(t *testing.T) {
	for _, policy := range PolicyNames() {
		t.Run(policy, func(t *testing.T) {
			c := NewCache(testArgs())
			c.SetNode(node("n1", 4, 80000, true))
			c.SetPod(reservationPod("n1", "ga", "GPU-a"))
			c.SetPod(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}))
			before := summary(c, "n1")
			p, err := placementFor(policy, c)
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Reserve("n1", "default", "p2", ask("uid-p2", 30000, api.TimeSlicing, 2), p, Host{}); err != nil {
				t.Fatal(err)
			}
			d, ok := c.Decision("uid-p2")
			if !ok || len(d.Groups) != 2 || d.Groups[0] == d.Groups[1] || d.Resolved.RequestMiB != 30000 {
				t.Fatalf("decision %+v", d)
			}
			c.Unreserve("uid-p2")
			if got := summary(c, "n1"); got != before {
				t.Fatalf("after Unreserve:\n got  %s\n want %s", got, before)
			}
			// Reserve again, then the API shows the pod bound with that
			// decision: nothing changes.
			if err := c.Reserve("n1", "default", "p2", ask("uid-p2", 30000, api.TimeSlicing, 1), p, Host{}); err != nil {
				t.Fatal(err)
			}
			reserved := summary(c, "n1")
			d, _ = c.Decision("uid-p2")
			bound := placedPod("p2", "n1", 30000, api.TimeSlicing, "", d.Groups, []string{"GPU-0d"})
			c.SetPod(bound)
			if got := summary(c, "n1"); got != reserved {
				t.Fatalf("confirmed pod charged again:\n got  %s\n want %s", got, reserved)
			}
			c.Unreserve("uid-p2") // bound now: not ours to roll back
			if got := summary(c, "n1"); got != reserved {
				t.Fatalf("Unreserve released a bound pod:\n got  %s\n want %s", got, reserved)
			}
		})
	}
}

func placementFor(name string, c *Cache) (placement.Policy, error) {
	p := &Plugin{args: testArgs(), cache: c}
	p.args.Policy = name
	return p.policy()
}

func TestFilterReasons(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("cold", 1, 80000, false))
	noLabels := node("bare", 1, 80000, true)
	delete(noLabels.Labels, api.LabelGPUMemory)
	c.SetNode(noLabels)
	c.SetNode(node("ts", 1, 80000, true))
	c.SetPod(reservationPod("ts", "g1", "GPU-1"))
	c.SetPod(placedPod("p1", "ts", 40000, api.TimeSlicing, "", []string{"g1"}, []string{"GPU-1"}))
	c.SetNode(node("sm", 1, 80000, true))
	c.SetPod(reservationPod("sm", "g2", "GPU-2"))
	c.SetPod(placedPod("p2", "sm", 10000, api.SMSharing, "0.9", []string{"g2"}, []string{"GPU-2"}))
	for _, tc := range []struct {
		node string
		ask  Ask
		want string
	}{
		{"cold", ask("a", 1000, api.TimeSlicing, 1), "node condition gpu-fractioning.nvidia.com/Ready is False"},
		{"bare", ask("a", 1000, api.TimeSlicing, 1), "node has no nvidia.com/gpu.memory label"},
		{"nowhere", ask("a", 1000, api.TimeSlicing, 1), "node has not reported its GPUs"},
		{"ts", ask("a", 50000, api.TimeSlicing, 1), "NotEnoughGPUMemory: fewer than 1 GPU(s) with 50000Mi of memory free"},
		{"ts", ask("a", 1000, api.SMSharing, 1), "ComputeModeConflict"},
		{"ts", ask("a", 1000, api.TimeSlicing, 2), "NotEnoughGPUs: the node has fewer than 2 GPUs"},
		{"sm", ask("a", 20000, api.SMSharing, 1), "ComputePortionExceeded"},
		{"ts", Ask{UID: "w", Whole: 1}, "NotEnoughIdleGPUs"},
	} {
		v := c.Filter(tc.node, tc.ask)
		if v.Fits || !strings.Contains(v.Reason, tc.want) {
			t.Errorf("Filter(%s, %+v) = %+v, want a rejection containing %q", tc.node, tc.ask, v, tc.want)
		}
	}
	if v := c.Filter("ts", ask("a", 40000, api.TimeSlicing, 1)); !v.Fits {
		t.Errorf("40000Mi share on a GPU with 40000Mi free: %+v", v)
	}
	if v := c.Filter("cold", Ask{UID: "w", Whole: 1}); !v.Fits {
		t.Errorf("whole GPU on a node not ready for fractions: %+v", v)
	}
}

// Whole-GPU pods count against a node's GPUs however they arrive, and a
// pod the ledger cannot place (bound by another scheduler past capacity)
// stops fractions on that node until it leaves.
func TestConflictsCloseTheNode(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 2, 80000, true))
	c.SetPod(wholePod("w1", "n1", 2))
	c.SetPod(placedPod("p1", "n1", 1000, api.TimeSlicing, "", []string{"g"}, []string{"GPU-1"}))
	v := c.Filter("n1", ask("a", 1000, api.TimeSlicing, 1))
	if v.Fits || !strings.Contains(v.Reason, "cannot account for") {
		t.Fatalf("node with an unplaceable pod: %+v", v)
	}
	c.DeletePod(wholePod("w1", "n1", 2))
	if got := summary(c, "n1"); got != "idle=1 whole=0 conflicts=0 g:1000Mi/0‰/1/" {
		t.Fatalf("after the whole pod left: %s", got)
	}
}

// A fractional pod bound without a decision that cannot fit (created with
// spec.nodeName and gpu-memory "999999": no trusted scheduler placed it,
// and the node refuses its containers) holds nothing and closes nothing:
// other tenants keep being placed. One that fits is charged meanwhile.
func TestUndecidedSquatterNeverClosesTheNode(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 2, 80000, true))
	c.SetPod(pod("squatter", "n1", map[string]string{"gpu-memory": "999999"}))
	if v := c.Filter("n1", ask("a", 1000, api.TimeSlicing, 1)); !v.Fits {
		t.Fatalf("one undecided pod that cannot fit closed the node: %+v", v)
	}
	if got := strings.TrimSpace(summary(c, "n1")); got != "idle=2 whole=0 conflicts=0" {
		t.Errorf("the squatter was booked: %s", got)
	}
	c.SetPod(pod("pending-decision", "n1", map[string]string{"gpu-memory": "30000"}))
	if got := summary(c, "n1"); !strings.HasPrefix(got, "idle=1 ") {
		t.Errorf("an undecided pod that fits is not charged: %s", got)
	}
	c.DeletePod(pod("squatter", "n1", nil))
	if v := c.Filter("n1", ask("a", 1000, api.TimeSlicing, 1)); !v.Fits {
		t.Errorf("after the squatter left: %+v", v)
	}
}

func TestReservationName(t *testing.T) {
	if got := ReservationName("node-1", "abc"); got != "gpufrac-node-1-abc" {
		t.Errorf("ReservationName = %q", got)
	}
	long := strings.Repeat("n", 250)
	a, b := ReservationName(long, "abc"), ReservationName(long+"x", "abc")
	if len(a) > 253 || a == b || len(validation.IsDNS1123Subdomain(a)) > 0 {
		t.Errorf("long names: %q (%d), %q", a, len(a), b)
	}
}

func TestDecisionPatchWritesThePortionOnlyForSMSharing(t *testing.T) {
	portionKey := api.ContainerKey("main", api.SuffixComputePortion)
	for _, tt := range []struct {
		mode        api.ComputeMode
		thousandths int64
		want        string // "" : removed
	}{
		{api.SMSharing, 250, "0.25"}, {api.SMSharing, 1000, "1"}, {api.SMSharing, 0, "0.001"}, {api.SMSharing, 2000, "1"},
		{api.TimeSlicing, 500, ""},
	} {
		d := Decision{Container: "main", Groups: []string{"g"}, Resolved: api.Resolved{RequestMiB: 1, LimitMiB: 1}, Mode: tt.mode, Portion: tt.thousandths}
		w, _ := d.write([]string{"GPU-1"}, "", nil)
		got, set := w.Set[portionKey]
		removed := slices.Contains(w.Remove, portionKey)
		if got != tt.want || set == removed {
			t.Errorf("%s %d‰: portion %q (set %v, removed %v), want %q", tt.mode, tt.thousandths, got, set, removed, tt.want)
		}
	}
}

// deviceNaming: cdi writes the devices as KAI does on CDI clusters, and the
// node side reads the same UUIDs back.
func TestDecisionPatchNamesDevicesForCDI(t *testing.T) {
	args := Args{DeviceNaming: DeviceNamingCDI}
	d := Decision{Container: "main", Groups: []string{"g1", "g2"}, Resolved: api.Resolved{RequestMiB: 1024, LimitMiB: 1024}, Mode: api.TimeSlicing}
	w, _ := d.write([]string{"GPU-1", "GPU-2"}, args.CDIKind(), nil)
	if got := w.Set[api.ContainerKey("main", api.SuffixDevices)]; got != "k8s.device-plugin.nvidia.com/gpu=GPU-1,k8s.device-plugin.nvidia.com/gpu=GPU-2" {
		t.Fatalf("devices = %v", got)
	}
	annotations := w.Apply(nil)
	got, err := api.ParseAssignments(annotations)
	if err != nil || len(got) != 1 || !slices.Equal(got[0].Devices, []string{"GPU-1", "GPU-2"}) || got[0].CDIKind != api.CDIKindNVIDIAGPU {
		t.Errorf("read back %+v, %v", got, err)
	}
}

// A pod the scheduler annotated but did not bind (it crashed in between)
// is read for what its author asked, not rejected for carrying
// scheduler-owned keys.
func TestRescheduledPodKeepsItsRequest(t *testing.T) {
	for _, annotations := range []map[string]string{
		{api.KeyFraction: "0.5", api.KeyFractionLimit: "0.75"},
		{api.KeyMemory: "20000"},
		{api.ContainerKey("main", api.SuffixMemoryRequest): "10Gi", api.KeyComputeSharingMode: "sm-sharing"},
		// The canonical request wins over gpu-fraction, and stays the
		// author's: the decision lists only the keys it added.
		{api.KeyFraction: "0.5", api.ContainerKey("main", api.SuffixMemoryRequest): "10Gi"},
	} {
		orig := pod("p", "", annotations)
		want, err := api.Parse(orig)
		if err != nil {
			t.Fatal(err)
		}
		patched := orig.DeepCopy()
		resolved, err := want[0].Resolve(80000, 0)
		if err != nil {
			t.Fatal(err)
		}
		d := Decision{Container: "main", Groups: []string{"g"}, Resolved: resolved, Mode: want[0].Mode, Portion: 500}
		w, _ := d.write([]string{"GPU-1"}, "", orig.Annotations)
		patched.Annotations = w.Apply(patched.Annotations)
		// Written by us (with the groups) or by another scheduler (without).
		kai := patched.DeepCopy()
		delete(kai.Annotations, api.GPUGroupsAnnotation)
		delete(kai.Annotations, api.ResolvedKeysAnnotation)
		readers := []*corev1.Pod{patched, kai}
		if _, both := annotations[api.KeyFraction]; both && annotations[api.ContainerKey("main", api.SuffixMemoryRequest)] != "" {
			// Without our record of which keys the decision added, a
			// reader cannot tell the author's request from a binder's.
			readers = readers[:1]
		}
		for _, p := range readers {
			got, err := api.Parse(api.Intent(p))
			if err != nil || len(got) != 1 || got[0].String() != want[0].String() {
				t.Errorf("annotations %v: re-read as %v (%v), want %v", p.Annotations, got, err, want)
			}
		}
	}
}

// An idle reservation pod is kept for shares: the next share on its node
// joins its group (no new reservation pod) rather than open one on the
// GPU no reservation pod holds, which stays free for whole-GPU pods.
func TestIdleReservationIsJoined(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 2, 80000, true))
	// The kept group on the second GPU: the policy, on a tie, takes the
	// lowest idle one, which would open a group.
	c.SetPod(wholePod("first", "n1", 1))
	c.SetPod(reservationPod("n1", "kept", "GPU-a"))
	c.DeletePod(wholePod("first", "n1", 1))
	if c.nodes["n1"].Groups["kept"] != 1 {
		t.Fatalf("the kept group is on slot %d, want 1", c.nodes["n1"].Groups["kept"])
	}
	if o := c.Orphans(); len(o) != 0 {
		t.Fatalf("orphans %v, want none", o)
	}
	p, err := placementFor("gpufrac", c)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Reserve("n1", "default", "uid-0", ask("uid-0", 1000, api.TimeSlicing, 1), p, Host{}); err != nil {
		t.Fatal(err)
	}
	if d, _ := c.Decision("uid-0"); !slices.Equal(d.Groups, []string{"kept"}) {
		t.Fatalf("the share opened %v, want it to join the kept group", d.Groups)
	}
	if got := summary(c, "n1"); got != "idle=1 whole=0 conflicts=0 kept:1000Mi/0‰/1/" {
		t.Errorf("after the share joined: %s", got)
	}
	c.Unreserve("uid-0")
	if got := summary(c, "n1"); got != "idle=1 whole=0 conflicts=0 kept:0Mi/0‰/0/held-for-shares" {
		t.Errorf("after the share left, the group is held for shares again: %s", got)
	}
	// A whole-GPU pod takes the GPU no reservation pod holds.
	if err := c.Reserve("n1", "default", "whole", Ask{UID: "uid-whole", Whole: 1}, p, Host{}); err != nil {
		t.Fatal(err)
	}
	if got := summary(c, "n1"); got != "idle=0 whole=1 conflicts=0 kept:0Mi/0‰/0/held-for-shares" {
		t.Errorf("the whole-GPU pod: %s", got)
	}
}

// A reservation pod the kubelet refused holds its GPU whole until it is
// gone: a share neither joins its group nor opens another on its GPU.
func TestFailedReservationIsNeitherJoinedNorShared(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 1, 80000, true))
	failed := reservationPod("n1", "bad", "")
	failed.Status.Phase = corev1.PodFailed
	c.SetPod(failed)
	p, err := placementFor("gpufrac", c)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Reserve("n1", "default", "s", ask("uid-s", 1000, api.TimeSlicing, 1), p, Host{}); err == nil {
		d, _ := c.Decision("uid-s")
		t.Fatalf("a share was placed on the failed reservation pod's GPU: %v", d.Groups)
	}
	if o := c.Orphans(); len(o) != 1 {
		t.Errorf("orphans %v, want the failed pod", o)
	}
	c.DeletePod(failed)
	if err := c.Reserve("n1", "default", "s", ask("uid-s", 1000, api.TimeSlicing, 1), p, Host{}); err != nil {
		t.Errorf("once the failed pod is gone: %v", err)
	}
}

// Reclaim takes idle kept reservation pods back for a pod asking for whole
// GPUs, on the node that needs the fewest, and only where GPUs are what
// it lacks; a retired group is never joined again (the collector deletes
// its pod without taking a GPU from under a tenant), and its GPU is taken
// by nothing until the pod is gone.
func TestReclaimRetiresIdleReservations(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 2, 80000, true))
	c.SetNode(node("n2", 2, 80000, true))
	c.SetPod(reservationPod("n1", "a1", "GPU-a1"))
	c.SetPod(reservationPod("n1", "b1", "GPU-b1"))
	c.SetPod(reservationPod("n2", "a2", "GPU-a2"))
	c.SetPod(placedPod("busy", "n2", 1000, api.TimeSlicing, "", []string{"a2"}, []string{"GPU-a2"}))
	if chosen, _ := c.Reclaim(1, []string{"n2"}); chosen != "" {
		t.Fatalf("Reclaim for one GPU chose %s: n2 has an idle GPU, so GPUs are not what it lacks there", chosen)
	}
	chosen, retired := c.Reclaim(2, []string{"n2", "n1"})
	if chosen != "n1" || len(retired) != 2 {
		t.Fatalf("Reclaim for two GPUs: %s %v, want both of n1's idle reservation pods (n2's holds a tenant)", chosen, retired)
	}
	if o := c.Orphans(); len(o) != 2 {
		t.Errorf("orphans %v, want the two retired pods", o)
	}
	p, err := placementFor("gpufrac", c)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Reserve("n1", "default", "late", ask("uid-late", 1000, api.TimeSlicing, 1), p, Host{}); err == nil {
		d, _ := c.Decision("uid-late")
		t.Fatalf("a share was placed on n1 (%v) while both its GPUs are being given back", d.Groups)
	}
	// The API's update as it deletes a pod (deletionTimestamp), or any
	// other, leaves it retired.
	gone := reservationPod("n1", "a1", "GPU-a1")
	gone.DeletionTimestamp = &metav1.Time{}
	c.SetPod(gone)
	c.SetPod(reservationPod("n1", "b1", "GPU-b1"))
	if err := c.Reserve("n1", "default", "later", ask("uid-later", 1000, api.TimeSlicing, 1), p, Host{}); err == nil {
		t.Fatal("a share was placed on n1 after updates of its retired reservation pods")
	}
	for _, o := range retired {
		if !c.StillOrphan(o) {
			t.Errorf("%s gained a tenant", o.Name)
		}
	}
	if chosen, more := c.Reclaim(2, []string{"n1"}); chosen != "" {
		t.Errorf("Reclaim again while n1's retired pods are being deleted: %s %v, want none (they count as free)", chosen, more)
	}
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 a1:0Mi/0‰/0/reservation/a1 b1:0Mi/0‰/0/reservation/b1" {
		t.Errorf("n1 while its reservation pods are deleted: %s", got)
	}
	// A rebuild (the inventory changed) keeps them retired.
	c.SetNode(node("n1", 2, 81920, true))
	if got := summary(c, "n1"); got != "idle=0 whole=0 conflicts=0 a1:0Mi/0‰/0/reservation/a1 b1:0Mi/0‰/0/reservation/b1" {
		t.Errorf("n1 after a rebuild: %s", got)
	}
	c.DeletePod(reservationPod("n1", "a1", "GPU-a1"))
	c.DeletePod(reservationPod("n1", "b1", "GPU-b1"))
	if got := summary(c, "n1"); got != "idle=2 whole=0 conflicts=0 " {
		t.Errorf("n1 once they are gone: %s", got)
	}
}

// The scheduler's snapshot of a node can be newer than the cache's (the
// two follow the informer through separate handlers): FilterAt applies
// it, and the handler's late delivery of an older Node does not undo it.
// A node the cache has never seen, or an older snapshot, is not applied.
func TestFilterAtAppliesOnlyANewerNode(t *testing.T) {
	at := func(ready bool, rv string) *corev1.Node {
		n := node("n1", 2, 80000, ready)
		n.ResourceVersion = rv
		return n
	}
	share := ask("a", 1000, api.TimeSlicing, 1)
	c := NewCache(testArgs())
	c.SetNode(at(false, "5"))
	if v := c.FilterAt(at(false, "5"), share, view{}); v.Fits {
		t.Fatalf("not-ready node took a share: %+v", v)
	}
	if v := c.FilterAt(at(true, "4"), share, view{}); v.Fits {
		t.Fatalf("an older snapshot (rv 4 < 5) was applied: %+v", v)
	}
	if v := c.FilterAt(at(true, "6"), share, view{}); !v.Fits {
		t.Fatalf("the newer snapshot (rv 6) was not applied: %+v", v)
	}
	c.SetNode(at(false, "5")) // the handler, late
	if v := c.Filter("n1", share); !v.Fits {
		t.Fatalf("a late older Node (rv 5) undid the newer one: %+v", v)
	}
	c.SetNode(at(false, "7"))
	if v := c.Filter("n1", share); v.Fits {
		t.Fatalf("a newer Node from the handler (rv 7) was not applied: %+v", v)
	}
	// A node known only from a pod bound there (its Add not yet seen).
	c.SetPod(placedPod("early", "n2", 1000, api.TimeSlicing, "", []string{"g"}, []string{"GPU-1"}))
	n2 := node("n2", 2, 80000, true)
	n2.ResourceVersion = "8"
	if v := c.FilterAt(n2, share, view{}); !v.Fits {
		t.Fatalf("the snapshot of a node known from its pods was not applied: %+v", v)
	}
	gone := node("gone", 2, 80000, true)
	gone.ResourceVersion = "9"
	if v := c.FilterAt(gone, share, view{}); v.Fits || !strings.Contains(v.Reason, "not reported") {
		t.Fatalf("FilterAt made up a node the cache did not know: %+v", v)
	}
}

// A node whose agent stopped renewing its heartbeat takes no fractions
// once its bound has passed, and says why; whole-GPU pods are not the
// agent's business. The agent's next heartbeat (a node update) opens it.
func TestSilentAgentTakesNoFractions(t *testing.T) {
	beat := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	at := func(heartbeat time.Time, rv string) *corev1.Node {
		n := node("n1", 2, 80000, true)
		n.ResourceVersion = rv
		n.Labels[api.LabelAgentHeartbeat] = "90"
		n.Status.Conditions[0].LastHeartbeatTime = metav1.NewTime(heartbeat)
		return n
	}
	c := NewCache(testArgs())
	now := beat.Add(60 * time.Second)
	c.now = func() time.Time { return now }
	c.SetNode(at(beat, "1"))
	share := ask("a", 1000, api.TimeSlicing, 1)
	if v := c.Filter("n1", share); !v.Fits {
		t.Fatalf("a heartbeat 60 s old (bound 90 s): %+v", v)
	}
	now = beat.Add(91 * time.Second)
	v := c.Filter("n1", share)
	if v.Fits || !v.Resolvable || !strings.Contains(v.Reason, "gpufrac agent has not been heard from for 1m31s") || !strings.Contains(v.Reason, "at most 1m30s old") {
		t.Fatalf("a heartbeat 91 s old: %+v", v)
	}
	if v := c.Filter("n1", Ask{UID: "w", Whole: 1}); !v.Fits {
		t.Errorf("a whole-GPU pod refused for the agent's silence: %+v", v)
	}
	if v := c.FilterAt(at(now.Add(-time.Second), "2"), share, view{}); !v.Fits {
		t.Errorf("after a fresh heartbeat: %+v", v)
	}
}

// A share charged to quota against a smaller GPU than a node has is never
// placed there: it would hold more than its namespace was charged. An
// exact charge, and a pod that carries none (created before charging),
// are placed as before.
func TestShareNeverHoldsMoreThanItsCharge(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("big", 1, 81920, true))
	half := func(charged bool, chargeMiB int64) Ask {
		f, _ := api.ParseFraction("0.5")
		return Ask{UID: "x", Charged: charged, ChargeMiB: chargeMiB, Fraction: &api.Request{
			Container: "main", Memory: api.Amount{Fraction: f}, Limit: api.Amount{Fraction: f}, Mode: api.TimeSlicing, Devices: 1}}
	}
	if v := c.Filter("big", half(true, 20480)); v.Fits || v.Resolvable || !strings.Contains(v.Reason, "more GPU memory on this node's GPUs than the 20Gi charged") {
		t.Errorf("half of an 80Gi GPU charged 20Gi: %+v", v)
	}
	if v := c.Filter("big", half(true, 40960)); !v.Fits {
		t.Errorf("half of an 80Gi GPU charged 40Gi: %+v", v)
	}
	if v := c.Filter("big", half(false, 0)); !v.Fits {
		t.Errorf("uncharged pod: %+v", v)
	}
	two := ask("y", 10000, api.TimeSlicing, 1)
	two.Charged, two.ChargeMiB = true, 9999
	if v := c.Filter("big", two); v.Fits {
		t.Errorf("10000Mi share charged 9999Mi: %+v", v)
	}
}

// A reservation pod deleted under live shares (kubectl drain --force, an
// admin) leaves their GPU held by no pod: the device plugin may hand it to
// anyone, and a reservation pod made again by the group's name could be
// given another GPU. So no new share joins that GPU (nor opens a group on
// it) until its shares end, after a restart too; a share still being
// placed (no GPU named yet) does not close its GPU.
func TestLostReservationClosesItsGPU(t *testing.T) {
	reservation := reservationPod("n1", "ga", "GPU-a")
	tenant := placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"})
	c := NewCache(testArgs())
	c.SetNode(node("n1", 1, 80000, true))
	c.SetPod(reservation)
	c.SetPod(tenant)
	if v := c.Filter("n1", ask("x", 10000, api.TimeSlicing, 1)); !v.Fits {
		t.Fatalf("a share beside a held one: %+v", v)
	}
	c.DeletePod(reservation)
	closed := func(c *Cache, when string) {
		t.Helper()
		v := c.Filter("n1", ask("x", 10000, api.TimeSlicing, 1))
		if v.Fits || !strings.Contains(v.Reason, "GPUNotHeldForShares") {
			t.Errorf("%s: %+v, want the GPU closed to new shares", when, v)
		}
		if err := c.Reserve("n1", "default", "x", ask("x", 10000, api.TimeSlicing, 1), placement.Spread{}, Host{}); err == nil {
			t.Errorf("%s: a share was reserved on a GPU no pod holds", when)
		}
	}
	closed(c, "reservation deleted")
	restarted := NewCache(testArgs())
	restarted.SetNode(node("n1", 1, 80000, true))
	restarted.SetPod(tenant)
	closed(restarted, "after a restart")
	if got := summary(c, "n1"); !strings.Contains(got, "ga:20000Mi/0‰/1/") {
		t.Errorf("the running share is no longer booked where it runs: %s", got)
	}
	c.DeletePod(tenant)
	if v := c.Filter("n1", ask("y", 10000, api.TimeSlicing, 1)); !v.Fits {
		t.Errorf("once the share ended: %+v, want the GPU open again", v)
	}

	// Placed by this scheduler: the share it assumed learns its GPU when
	// the pod shows its decision, and the GPU closes as well when the
	// reservation pod goes.
	live := NewCache(testArgs())
	live.SetNode(node("n1", 1, 80000, true))
	if err := live.Reserve("n1", "default", "p1", ask("p1", 20000, api.TimeSlicing, 1), placement.Spread{}, Host{}); err != nil {
		t.Fatal(err)
	}
	d, _ := live.Decision("p1")
	live.SetPod(reservationPod("n1", d.Groups[0], "GPU-a"))
	bound := placedPod("p1", "n1", 20000, api.TimeSlicing, "", d.Groups, []string{"GPU-a"})
	bound.UID = "p1"
	live.SetPod(bound)
	live.DeletePod(reservationPod("n1", d.Groups[0], "GPU-a"))
	if v := live.Filter("n1", ask("x", 10000, api.TimeSlicing, 1)); v.Fits || !strings.Contains(v.Reason, "GPUNotHeldForShares") {
		t.Errorf("a share this scheduler placed lost its reservation pod: %+v, want the GPU closed", v)
	}

	// Being placed: the first share's reservation pod is not made yet.
	fresh := NewCache(testArgs())
	fresh.SetNode(node("n1", 1, 80000, true))
	if err := fresh.Reserve("n1", "default", "first", ask("first", 10000, api.TimeSlicing, 1), placement.Spread{}, Host{}); err != nil {
		t.Fatal(err)
	}
	if v := fresh.Filter("n1", ask("second", 10000, api.TimeSlicing, 1)); !v.Fits {
		t.Errorf("beside a share being placed: %+v", v)
	}
}

// A node whose agent finds reservation pods in another namespace than the
// one this scheduler creates them in takes no share: its reservation pods
// would never learn their GPU. Set once, alike; an agent that publishes
// none (from before) is not judged.
func TestNodeOfAnotherReservationNamespaceTakesNoShare(t *testing.T) {
	c := NewCache(testArgs())
	n := node("n1", 8, 81920, true)
	c.SetNode(n)
	share := ask("p", 20480, api.TimeSlicing, 1)
	if v := c.FilterAt(n, share, view{}); !v.Fits {
		t.Fatalf("unlabelled node: %+v", v)
	}
	for i, ns := range []string{api.DefaultReservationNamespace, "team-reservations"} {
		fits := ns == api.DefaultReservationNamespace
		l := n.DeepCopy()
		l.Labels[api.LabelReservationNamespace] = ns
		l.ResourceVersion = fmt.Sprint(10 + i)
		c.SetNode(l)
		v := c.FilterAt(l, share, view{})
		if v.Fits != fits || (!fits && !strings.Contains(v.Reason, "namespace team-reservations")) {
			t.Errorf("agent's namespace %s: %+v, want fits %v", ns, v, fits)
		}
	}
}

// A Node deleted and registered again under its name (a kubelet
// re-registering, a replaced machine, before the pod garbage collector's
// quarantine ends) comes back with the pods still bound to it, and no pod
// event says so: the cache keeps them through the deletion and books them
// again once the node publishes its GPUs, so that no share is placed on a
// GPU they hold (the soak found 10 GPUs held of 8). A pod the API deletes
// meanwhile is forgotten, and a gone node left with nothing is dropped.
func TestADeletedNodeComesBackWithItsPods(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("n1", 4, 80000, true))
	for _, p := range []*corev1.Pod{
		reservationPod("n1", "ga", "GPU-a"),
		placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}),
		wholePod("w1", "n1", 2),
	} {
		c.SetPod(p)
	}
	want := summary(c, "n1")
	if want != "idle=1 whole=2 conflicts=0 ga:20000Mi/0‰/1/" {
		t.Fatalf("before: %s", want)
	}
	c.DeleteNode("n1")
	// Registered again: first as the kubelet does, without the agent's
	// GPU labels, then with them.
	c.SetNode(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	c.SetNode(node("n1", 4, 80000, true))
	if got := summary(c, "n1"); got != want {
		t.Fatalf("after the node came back: %s, want %s (its pods are still bound to it)", got, want)
	}
	c.DeleteNode("n1")
	c.DeletePod(wholePod("w1", "n1", 2))
	c.DeletePod(placedPod("p1", "n1", 20000, api.TimeSlicing, "", []string{"ga"}, []string{"GPU-a"}))
	c.DeletePod(reservationPod("n1", "ga", "GPU-a"))
	c.mu.RLock()
	_, kept := c.nodes["n1"]
	c.mu.RUnlock()
	if kept {
		t.Fatal("a deleted node whose pods are all gone is still in the cache")
	}
}
