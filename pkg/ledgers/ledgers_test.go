package ledgers

import (
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/api/apitest"
	"github.com/gpufrac/gpufrac/pkg/gpu"
)

const ns = "gpufrac-reservations"

func node(name string, gpus int) corev1.Node {
	return *apitest.GPUNode(name, api.Inventory{Count: gpus, MemoryMiB: 81920, Model: "H100"}, "driver", true)
}

func pod(name, node string, annotations map[string]string) corev1.Pod {
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "team", UID: types.UID("uid-" + name), Annotations: annotations}}
	p.Spec.NodeName = node
	p.Spec.Containers = []corev1.Container{{Name: "main"}}
	return p
}

func reservation(node, group, uuid string) corev1.Pod {
	p := apitest.Reservation(ns, node, group, uuid, false)
	p.Name, p.UID = "r-"+group, types.UID("uid-r-"+group)
	return *p
}

// decision is the annotations of a decision as the codec writes them:
// gpufrac's with groups, another scheduler's without.
func decision(mib int64, mode api.ComputeMode, portion, devices, groups string) map[string]string {
	a := api.Assignment{Container: "main", Devices: strings.Split(devices, ","), RequestMiB: mib, LimitMiB: mib, Mode: mode}
	if portion != "" {
		a.Portion, _ = api.ParseFraction(portion)
	}
	var g []string
	if groups != "" {
		g = strings.Split(groups, ",")
	}
	return apitest.Placed("", "", "", a, g...).Annotations
}

// Build reads gpufrac's pods by their groups, KAI's by their GPUs joined
// with the reservation pods, and books them all on the node's ledger.
func TestBuildReadsBothSchedulersPods(t *testing.T) {
	n1 := node("n1", 4)
	n1.Labels[api.LabelGPUMemoryReserve] = "1024"
	c := Build([]corev1.Node{n1, {ObjectMeta: metav1.ObjectMeta{Name: "cpu"}}}, []corev1.Pod{
		reservation("n1", "ga", "GPU-aa"),
		pod("ours", "n1", decision(40960, api.TimeSlicing, "", "GPU-aa", "ga")),
		// KAI's binder: CDI names, no groups of ours, sm-sharing without a portion.
		pod("kai", "n1", decision(20480, api.SMSharing, "", "k8s.device-plugin.nvidia.com/gpu=GPU-bb", "")),
		reservation("n1", "gb", "GPU-bb"),
		pod("bare", "n1", map[string]string{api.KeyFraction: "0.5"}),
		pod("broken", "n1", decision(1, api.TimeSlicing, "", "0", "")),
		pod("elsewhere", "n9", decision(1, api.TimeSlicing, "", "GPU-cc", "")),
	}, nil)
	if len(c.Nodes) != 1 {
		t.Fatalf("nodes %v: want only n1", c.Nodes)
	}
	n := c.Nodes["n1"]
	if len(n.Tenants) != 2 || n.WholeGPUs != 2 || len(n.Conflicts) != 0 {
		t.Fatalf("tenants %v, whole %d, conflicts %v", n.Tenants, n.WholeGPUs, n.Conflicts)
	}
	if g := n.Tenants["uid-kai"].Groups; len(g) != 1 || g[0] != "gb" {
		t.Errorf("KAI's pod is in groups %v, want the reservation pod's gb", g)
	}
	// No portion written: charged what the node derives, 20480 / 80896.
	if p := n.Tenants["uid-kai"].Request.Share.Portion; p != 253 {
		t.Errorf("KAI's sm-sharing pod is charged %d/1000 compute, want 253", p)
	}
	for uuid, want := range map[string]int64{"GPU-aa": 80896 - 40960, "GPU-bb": 80896 - 20480} {
		slot := n.Groups[n.GroupOfOrOwn(uuid)]
		if d := n.Ledger.Devices[slot]; d.Free() != want || n.UUID(slot) != uuid {
			t.Errorf("%s: slot %d (%s) free %d, want %d", uuid, slot, n.UUID(slot), d.Free(), want)
		}
	}
	if len(c.Problems) != 2 || c.Problems[0].Pod != "team/bare" || !c.Problems[0].NoDecision || c.Problems[1].NoDecision {
		t.Errorf("problems %+v", c.Problems)
	}
	if err := n.Ledger.Check(); err != nil {
		t.Error(err)
	}
}

// Record keeps what breaks an invariant, so that Violations can say so;
// Place (the scheduler's) refuses it as a conflict.
func TestRecordKeepsWhatPlaceRefuses(t *testing.T) {
	pods := []corev1.Pod{
		reservation("n1", "ga", "GPU-aa"),
		pod("big1", "n1", decision(50000, api.TimeSlicing, "", "GPU-aa", "ga")),
		pod("big2", "n1", decision(40000, api.TimeSlicing, "", "GPU-aa", "ga")),
	}
	c := Build([]corev1.Node{node("n1", 1)}, pods, nil)
	n := c.Nodes["n1"]
	if v := n.Ledger.Violations(); len(v) != 1 || v[0].Kind != gpu.OverCommitted || len(n.Conflicts) != 0 {
		t.Errorf("recorded: violations %v, conflicts %v", v, n.Conflicts)
	}

	placed := NewLayout("n1", n.Inventory)
	tenants := []Tenant{*n.Tenants["uid-big1"], *n.Tenants["uid-big2"]}
	placed.Fill(tenants, []string{"ga"}, true)
	if v := placed.Ledger.Violations(); len(v) != 0 || len(placed.Conflicts) != 1 || placed.Conflicts["uid-big2"] == "" {
		t.Errorf("placed: violations %v, conflicts %v", v, placed.Conflicts)
	}
	if err := placed.Ledger.Check(); err != nil {
		t.Error(err)
	}
	// Releasing the tenant that fits leaves the reservation pod's slot
	// held for shares: idle, and not for whole-GPU pods.
	placed.Release(tenants[0], func(g string) bool { return g == "ga" })
	if d := placed.Ledger.Devices[placed.Groups["ga"]]; !d.Idle() || !d.SharedOnly {
		t.Errorf("after release the GPU is idle %v, held for shares %v; want both", d.Idle(), d.SharedOnly)
	}
	// Retired (its pod to be deleted), it is held whole, by the placeholder.
	if !placed.Retire("ga") {
		t.Fatal("Retire refused an idle group")
	}
	if d := placed.Ledger.Devices[placed.Groups["ga"]]; d.Whole() != Placeholder("ga") || !IsPlaceholder(d.Whole()) || d.SharedOnly {
		t.Errorf("after Retire the GPU is held by %q (held for shares %v), want the reservation placeholder", d.Whole(), d.SharedOnly)
	}
}

// nothingKnown is a node where nothing holds any GPU yet.
func nothingKnown(string) (string, bool) { return "", false }

func TestTenantOf(t *testing.T) {
	whole := pod("w", "n1", nil)
	whole.Spec.InitContainers = []corev1.Container{{Name: "i", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{api.ResourceGPU: resource.MustParse("2")}}}}
	if tn, held, err := TenantOf(&whole, nothingKnown, 80000); err != nil || !held || tn.Request.Whole != 2 {
		t.Errorf("whole: %+v %v %v", tn, held, err)
	}
	plain := pod("p", "n1", map[string]string{"app": "web"})
	if _, held, err := TenantOf(&plain, nothingKnown, 80000); held || err != nil {
		t.Errorf("ordinary pod: held %v, %v", held, err)
	}
	bad := pod("b", "n1", decision(1024, "mps", "", "GPU-aa", ""))
	var list api.ErrorList
	if _, held, err := TenantOf(&bad, nothingKnown, 80000); held || !errors.As(err, &list) {
		t.Errorf("bad mode: held %v, %v", held, err)
	}
	sm := pod("s", "n1", decision(1024, api.SMSharing, "0.25", "GPU-AA", ""))
	sm.UID = ""
	tn, held, err := TenantOf(&sm, nothingKnown, 80000)
	if err != nil || !held || tn.Request.Tenant != "team/s" || tn.Groups[0] != "uuid-gpu-aa" || tn.Request.Share.Portion != 250 {
		t.Errorf("sm-sharing without UID: %+v %v %v", tn, held, err)
	}
}

// The cluster's view is of GPUs: two groups that name one physical GPU
// are booked on one slot, so their sum shows.
func TestBuildBooksOneGPUOnce(t *testing.T) {
	c := Build([]corev1.Node{node("n1", 2)}, []corev1.Pod{
		reservation("n1", "ga", "GPU-aa"),
		pod("p1", "n1", decision(50000, api.TimeSlicing, "", "GPU-aa", "ga")),
		pod("p2", "n1", decision(40000, api.TimeSlicing, "", "GPU-aa", "gstale")),
	}, nil)
	v := c.Nodes["n1"].Ledger.Violations()
	if len(v) != 1 || v[0].Kind != gpu.OverCommitted || len(v[0].Tenants) != 2 {
		t.Errorf("violations %+v, want one over-commit of both pods on GPU-aa", v)
	}
}

// A KAI sm-sharing pod's portion comes from its node's GPU memory; while
// that is unknown it cannot be charged, and says why.
func TestSMSharingWithoutPortionNeedsTheNodesMemory(t *testing.T) {
	p := pod("kai", "n1", decision(20480, api.SMSharing, "", "GPU-aa", ""))
	if _, held, err := TenantOf(&p, nothingKnown, 0); held || err == nil {
		t.Errorf("held %v, err %v: want an error while the node's memory is unknown", held, err)
	}
}

// A standing group's GPU is held for shares: whole-GPU pods and new
// groups never get it, shares of either front door join it, and it stays
// held (no placeholder) when its last share goes.
func TestStandingGroupsHoldAGPUForShares(t *testing.T) {
	l := NewLayout("n", api.Inventory{Count: 2, MemoryMiB: 81920, Model: "H100"})
	standing := StandingGroup(0)
	reserved := func(g string) bool { return g == standing }
	l.Fill(nil, []string{standing}, true)
	slot := l.Groups[standing]
	if d := l.Ledger.Devices[slot]; !d.SharedOnly || !d.Idle() {
		t.Fatalf("standing GPU: SharedOnly %v, idle %v; want held for shares, idle", d.SharedOnly, d.Idle())
	}
	l.Place(Tenant{Request: gpu.Request{Tenant: "whole", Whole: 2}}, reserved)
	if _, conflict := l.Conflicts["whole"]; !conflict {
		t.Error("a pod asking for both GPUs was given the standing one")
	}
	share := gpu.Request{Tenant: "claim/gpu", Devices: 1, Share: gpu.Share{Request: 1024, Limit: 1024, Mode: api.TimeSlicing}}
	l.Place(Tenant{Request: share, Groups: []string{standing}}, reserved)
	other := gpu.Request{Tenant: "pod", Devices: 1, Share: gpu.Share{Request: 1024, Limit: 1024, Mode: api.TimeSlicing}}
	l.Place(Tenant{Request: other, Groups: []string{"g1"}}, reserved)
	if l.Groups["g1"] == slot {
		t.Error("a new group took the standing group's GPU")
	}
	l.Release(Tenant{Request: share, Groups: []string{standing}}, reserved)
	if d := l.Ledger.Devices[slot]; !d.SharedOnly || !d.Idle() || l.Groups[standing] != slot {
		t.Errorf("after its last share: SharedOnly %v, idle %v, slot %d; want still held for shares", d.SharedOnly, d.Idle(), l.Groups[standing])
	}
}

// A node's reservation pods are those in the namespace its agent
// publishes: read there, not configured again in every reader.
func TestReservationPodsAreInTheNamespaceTheNodePublishes(t *testing.T) {
	n := node("n1", 1)
	n.Labels[api.LabelReservationNamespace] = "team-reservations"
	moved := reservation("n1", "ga", "GPU-aa")
	moved.Namespace = "team-reservations"
	stray := reservation("n1", "gb", "GPU-aa") // in the default namespace: a pod like any other there
	c := Build([]corev1.Node{n}, []corev1.Pod{moved, stray, pod("t", "n1", decision(20000, api.TimeSlicing, "", "GPU-aa", "ga"))}, nil)
	got := c.Nodes["n1"]
	if _, ok := got.Reservations["ga"]; !ok || len(got.Reservations) != 1 {
		t.Errorf("reservations %v, want only ga (namespace team-reservations)", got.Reservations)
	}
	if got.WholeGPUs != 2 {
		t.Errorf("whole GPUs %d, want 2: the reservation pod's and the stray pod's", got.WholeGPUs)
	}
}

// Issue 53: a tenant on its way out holds its memory until its containers
// stop, and the scheduler charges it so: the books (audit, top, the
// dashboard) count it too, so that two shares over a GPU while one of
// them terminates are seen; an ended one holds nothing.
func TestBuildCountsTerminatingTenants(t *testing.T) {
	leaving := pod("leaving", "n1", decision(50000, api.TimeSlicing, "", "GPU-aa", "ga"))
	leaving.DeletionTimestamp = &metav1.Time{}
	ended := pod("ended", "n1", decision(50000, api.TimeSlicing, "", "GPU-aa", "ga"))
	ended.Status.Phase = corev1.PodFailed
	c := Build([]corev1.Node{node("n1", 1)}, []corev1.Pod{
		reservation("n1", "ga", "GPU-aa"), leaving, ended,
		pod("next", "n1", decision(40000, api.TimeSlicing, "", "GPU-aa", "ga")),
	}, nil)
	n := c.Nodes["n1"]
	if _, ok := n.Tenants["uid-leaving"]; !ok {
		t.Fatalf("tenants %v: the terminating one is not booked", n.Tenants)
	}
	if _, ok := n.Tenants["uid-ended"]; ok {
		t.Error("an ended tenant is booked")
	}
	if v := n.Ledger.Violations(); len(v) != 1 || v[0].Kind != gpu.OverCommitted {
		t.Errorf("violations %v, want the GPU over its memory while one tenant terminates", v)
	}
}
