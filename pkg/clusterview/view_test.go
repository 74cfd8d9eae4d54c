package clusterview

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/api/apitest"
)

func gpuNode(name string, gpus int64, ready bool) corev1.Node {
	enforcement := ""
	if ready {
		enforcement = "driver"
	}
	return *apitest.GPUNode(name, api.Inventory{Count: int(gpus), MemoryMiB: 81920, Model: "NVIDIA-H100-80GB-HBM3"}, enforcement, ready)
}

// tenant is placed by another scheduler (no GPU groups), with a limit of
// twice its request.
func tenant(name, node string, mib int64, mode api.ComputeMode, portion, uuid string) corev1.Pod {
	a := api.Assignment{Container: "main", Devices: []string{uuid}, RequestMiB: mib, LimitMiB: 2 * mib, Mode: mode}
	if portion != "" {
		a.Portion, _ = api.ParseFraction(portion)
	}
	p := apitest.Placed("team", name, node, a)
	p.UID = ""
	return *p
}

func whole(name, node string, n int64) corev1.Pod {
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "team"}}
	p.Spec.NodeName = node
	p.Spec.Containers = []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(n, resource.DecimalSI)}}}}
	return p
}

func reservation(node, group string) corev1.Pod {
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "gpufrac-" + node + "-" + group, Namespace: "gpufrac-reservations"}}
	p.Spec.NodeName = node
	return p
}

func cluster() View { return clusterWithReserve("") }

// clusterWithReserve is the cluster with n1 publishing reserve as its
// api.LabelGPUMemoryReserve ("" for none).
func clusterWithReserve(reserve string) View {
	pending := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "waiting", Namespace: "team", UID: "uid-waiting", Annotations: map[string]string{api.KeyFraction: "0.5"}}}
	pending.Spec.Containers = []corev1.Container{{Name: "main"}}
	n1 := gpuNode("n1", 4, true)
	if reserve != "" {
		n1.Labels[api.LabelGPUMemoryReserve] = reserve
	}
	return Build(
		[]corev1.Node{n1, gpuNode("cpu-only", 0, false), gpuNode("n0", 2, false)},
		[]corev1.Pod{
			reservation("n1", "ga"), reservation("n1", "gb"),
			tenant("big", "n1", 40960, api.TimeSlicing, "", "GPU-a"),
			tenant("small", "n1", 20480, api.TimeSlicing, "", "GPU-a"),
			tenant("mps-with-a-very-long-pod-name-that-will-not-fit-in-eighty-columns", "n1", 10240, api.SMSharing, "0.125", "GPU-b"),
			whole("trainer", "n1", 1),
			pending,
		},
		nil)
}

// Free memory is what the scheduler would still place: the reserve the
// node publishes, kept back on each GPU, is not free.
func TestBuildCountsTheNodesReserve(t *testing.T) {
	v := clusterWithReserve("1024")
	a, b := v.Nodes[1].Shared[0], v.Nodes[1].Shared[1]
	if a.FreeMiB != 20480-1024 || b.FreeMiB != 71680-1024 {
		t.Errorf("free %d, %d: want the reserve off each", a.FreeMiB, b.FreeMiB)
	}
}

func TestBuild(t *testing.T) {
	v := cluster()
	if len(v.Nodes) != 2 || v.Nodes[0].Name != "n0" || v.Nodes[1].Name != "n1" {
		t.Fatalf("nodes: %+v", v.Nodes)
	}
	n1 := v.Nodes[1]
	if !n1.Ready || n1.Idle != 1 || len(n1.Whole) != 1 || len(n1.Shared) != 2 {
		t.Fatalf("n1: %+v", n1)
	}
	a, b := n1.Shared[0], n1.Shared[1]
	if a.UUID != "GPU-a" || a.FreeMiB != 20480 || len(a.Tenants) != 2 || a.Tenants[0].Pod != "team/big" || a.Tenants[0].LimitMiB != 81920 {
		t.Errorf("GPU-a: %+v", a)
	}
	if b.Mode != api.SMSharing || b.FreeMiB != 71680 || b.Tenants[0].Portion != "0.125" {
		t.Errorf("GPU-b: %+v", b)
	}
	// Held: 61440 + 10240 on the shared GPUs, 81920 whole, of 6 × 81920.
	// Free: 20480 + 71680 stranded on shared GPUs, 81920 on n1's idle GPU
	// and 2 × 81920 on n0.
	want := Summary{GPUs: 6, AllocationPct: 31.3, FragmentationPct: 27.3, Pending: 1,
		TotalMiB: 6 * 81920, AllocatedMiB: 61440 + 10240 + 81920, FreeMiB: 20480 + 71680 + 81920 + 2*81920, StrandedMiB: 20480 + 71680}
	if v.Summary != want {
		t.Errorf("summary %+v, want %+v", v.Summary, want)
	}
	if len(v.Pending) != 1 || v.Pending[0].Pod != "team/waiting" || !strings.Contains(v.Pending[0].Asks, "request=0.5") {
		t.Errorf("pending: %+v", v.Pending)
	}
	big := a.Tenants[0].Annotations
	if big[api.ContainerKey("main", api.SuffixDevices)] != "GPU-a" || len(big) != 4 {
		t.Errorf("team/big's annotations: %v", big)
	}
	if n1.ReadyReason != "EnforcementAvailable" || n1.Enforcement != "driver" || v.Nodes[0].Ready || v.Nodes[0].ReadyReason != "" {
		t.Errorf("readiness: n1 %q %q, n0 %v", n1.ReadyReason, n1.Enforcement, v.Nodes[0].Ready)
	}
	if a.SchedulableMiB != 81920 {
		t.Errorf("schedulable %d", a.SchedulableMiB)
	}
}

// A pending pod's reason is the latest FailedScheduling event about that
// very pod (by UID), whichever clock its reporter set; other events, other
// pods and a deleted namesake are left out. Its PodScheduled condition,
// where the scheduler set one, wins.
func TestWithReasons(t *testing.T) {
	at := func(sec int64) metav1.Time { return metav1.Unix(sec, 0) }
	ev := func(uid, reason, msg string, last metav1.Time, series *corev1.EventSeries) corev1.Event {
		return corev1.Event{InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "team", Name: "waiting", UID: types.UID(uid)},
			Reason: reason, Message: msg, LastTimestamp: last, Series: series}
	}
	events := []corev1.Event{
		ev("uid-waiting", ReasonFailedScheduling, "old", at(10), nil),
		ev("uid-waiting", ReasonFailedScheduling, "0/3 nodes are available: 2 no GPU with 40960Mi free", at(5), &corev1.EventSeries{Count: 3, LastObservedTime: metav1.NewMicroTime(at(20).Time)}),
		ev("uid-waiting", "Scheduled", "later but not a failure", at(30), nil),
		ev("uid-of-a-deleted-namesake", ReasonFailedScheduling, "not this pod", at(40), nil),
	}
	v := cluster()
	got := WithReasons(v, events)
	if len(got.Pending) != 1 || got.Pending[0].Reason != "0/3 nodes are available: 2 no GPU with 40960Mi free" {
		t.Errorf("pending: %+v", got.Pending)
	}
	if v.Pending[0].Reason != "" {
		t.Errorf("WithReasons changed its argument: %+v", v.Pending)
	}
	// The condition, current at every attempt, over the events.
	v.Pending[0].Reason = "0/3 nodes are available: the condition's message"
	if got := WithReasons(v, events); got.Pending[0].Reason != "0/3 nodes are available: the condition's message" {
		t.Errorf("the condition lost to an event: %q", got.Pending[0].Reason)
	}
}

// Build reads a pending pod's reason from its PodScheduled=False condition.
func TestPendingReasonFromTheCondition(t *testing.T) {
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "waiting", Namespace: "team", Annotations: map[string]string{api.KeyFraction: "0.5"}}}
	p.Spec.Containers = []corev1.Container{{Name: "main"}}
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable", Message: "0/1 nodes are available: 1 no GPU"}}
	v := Build([]corev1.Node{gpuNode("n1", 1, true)}, []corev1.Pod{p}, nil)
	if len(v.Pending) != 1 || v.Pending[0].Reason != "0/1 nodes are available: 1 no GPU" {
		t.Errorf("pending: %+v", v.Pending)
	}
}

func TestRenderFitsEightyColumns(t *testing.T) {
	var out bytes.Buffer
	if err := Render(&out, cluster()); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	for _, line := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		if n := utf8.RuneCountInString(line); n > 80 {
			t.Errorf("line of %d columns: %q", n, line)
		}
	}
	for _, want := range []string{"n0  2 × NVIDIA-H100-80GB-HBM3 80Gi  NOT READY", "GPU GPU-a", "time-slicing", "team/big", "compute 0.125",
		"whole team/trainer", "idle GPUs: 1", "6 GPUs · allocated 31.3% · fragmented 27.3% of free · 1 fraction(s) pending"} {
		if !strings.Contains(text, want) {
			t.Errorf("view lacks %q:\n%s", want, text)
		}
	}
	raw, err := json.Marshal(cluster())
	if err != nil {
		t.Fatal(err)
	}
	var back View
	if err := json.Unmarshal(raw, &back); err != nil || back.Summary != cluster().Summary {
		t.Errorf("JSON round trip: %v %+v", err, back.Summary)
	}
}

// A node whose agent went silent past its bound is shown not ready, with
// the scheduler's reason, though its condition still says ready.
func TestSilentAgentShownNotReady(t *testing.T) {
	n := gpuNode("n1", 1, true)
	for i := range n.Status.Conditions {
		n.Status.Conditions[i].LastHeartbeatTime = metav1.NewTime(time.Now().Add(-time.Hour))
	}
	v := Build([]corev1.Node{n}, nil, nil)
	if len(v.Nodes) != 1 || v.Nodes[0].Ready || v.Nodes[0].ReadyReason != "AgentSilent" || !strings.Contains(v.Nodes[0].ReadyMessage, "has not been heard from") {
		t.Errorf("silent agent: %+v", v.Nodes)
	}
}
