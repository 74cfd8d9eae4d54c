package audit

import (
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/api/apitest"
)

const resNS = "gpufrac-reservations"

var now = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

func gpuNode(name string, gpus int64) corev1.Node {
	return *apitest.GPUNode(name, api.Inventory{Count: int(gpus), MemoryMiB: 80000, Model: "H100"}, "", false)
}

func reservation(node, group, uuid string) corev1.Pod {
	p := apitest.Reservation(resNS, node, group, uuid, false)
	p.CreationTimestamp = metav1.NewTime(now.Add(-time.Hour))
	return *p
}

func tenant(name, node string, mib int64, mode api.ComputeMode, portion, group string, uuids ...string) corev1.Pod {
	a := api.Assignment{Container: "main", Devices: uuids, RequestMiB: mib, LimitMiB: mib, Mode: mode}
	if portion != "" {
		a.Portion, _ = api.ParseFraction(portion)
	}
	var groups []string
	if group != "" {
		groups = strings.Split(group, ",")
	}
	return *apitest.Placed("team", name, node, a, groups...)
}

func check(nodes []corev1.Node, pods ...corev1.Pod) []Violation {
	return Check(nodes, pods, nil, Options{OrphanGrace: time.Minute, Now: now})
}

func TestCleanCluster(t *testing.T) {
	nodes := []corev1.Node{gpuNode("n1", 2)}
	got := check(nodes,
		reservation("n1", "ga", "GPU-a"),
		tenant("p1", "n1", 40000, api.TimeSlicing, "", "ga", "GPU-a"),
		tenant("p2", "n1", 40000, api.TimeSlicing, "", "ga", "GPU-a"),
		reservation("n1", "gb", "GPU-b"),
		tenant("p3", "n1", 20000, api.SMSharing, "0.25", "gb", "GPU-b"),
	)
	if len(got) != 0 {
		t.Fatalf("clean cluster reported: %v", got)
	}
}

func TestEveryViolationIsFound(t *testing.T) {
	nodes := []corev1.Node{gpuNode("n1", 4), gpuNode("n2", 1)}
	unannotated := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "bare", Namespace: "team", Annotations: map[string]string{api.KeyFraction: "0.5"}}}
	unannotated.Spec.NodeName = "n1"
	unannotated.Spec.Containers = []corev1.Container{{Name: "main"}}
	young := reservation("n2", "gy", "GPU-0e")
	young.CreationTimestamp = metav1.NewTime(now.Add(-time.Second))
	whole := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "whole", Namespace: "team"}}
	whole.Spec.NodeName = "n2"
	whole.Spec.Containers = []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}}}}
	got := check(nodes,
		reservation("n1", "ga", "GPU-a"),
		tenant("big1", "n1", 50000, api.TimeSlicing, "", "ga", "GPU-a"),
		tenant("big2", "n1", 40000, api.SMSharing, "0.6", "ga", "GPU-a"),
		reservation("n1", "gb", "GPU-b"),
		tenant("sm1", "n1", 10000, api.SMSharing, "0.6", "gb", "GPU-b"),
		tenant("sm2", "n1", 10000, api.SMSharing, "0.6", "gb", "GPU-b"),
		tenant("stray", "n1", 1000, api.TimeSlicing, "", "gz", "GPU-0f"),
		unannotated,
		reservation("n1", "gc", ""),      // no tenant, and never told its GPU
		reservation("n1", "gk", "GPU-k"), // no tenant: kept for shares, not an orphan
		young,                            // no tenant yet, within the grace
		whole,                            // with young: 2 GPUs on a 1-GPU node
	)
	var kinds []string
	for _, v := range got {
		kinds = append(kinds, string(v.Kind)+" "+v.Object)
		if strings.Contains(v.String(), "\n") {
			t.Errorf("violation on several lines: %q", v)
		}
	}
	want := []string{
		"ComputePortionOverOne n1/GPU-b",
		"DeviceWithoutReservation team/stray",
		"FractionWithoutDevices team/bare",
		"GPUOverCommitted n1/GPU-a",
		"MixedComputeModes n1/GPU-a",
		"NodeGPUsOverCommitted n2",
		"OrphanReservationPod gpufrac-reservations/gpufrac-n1-gc",
	}
	if strings.Join(kinds, "\n") != strings.Join(want, "\n") {
		t.Fatalf("violations:\n%s\nwant:\n%s\n(full: %v)", strings.Join(kinds, "\n"), strings.Join(want, "\n"), got)
	}
}

// A pod the node's ledger has no GPU left for is a finding of its own,
// named by the pod: here a whole-GPU pod on the one GPU fractions share.
func TestPodWithNoGPULeftIsFound(t *testing.T) {
	whole := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "whole", Namespace: "team"}}
	whole.Spec.NodeName = "n1"
	whole.Spec.Containers = []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}}}}
	got := check([]corev1.Node{gpuNode("n1", 1)},
		reservation("n1", "ga", "GPU-a"),
		tenant("p1", "n1", 40000, api.TimeSlicing, "", "ga", "GPU-a"),
		whole,
	)
	var kinds []string
	for _, v := range got {
		kinds = append(kinds, string(v.Kind)+" "+v.Object)
	}
	want := []string{"GPUsNotAccounted team/whole", "NodeGPUsOverCommitted n1"}
	if !slices.Equal(kinds, want) {
		t.Errorf("violations %v, want %v (%v)", kinds, want, got)
	}
}

// An edited gpufrac.io/gpu-groups is reported, and the share is still
// counted on the GPU it holds: here two pods on GPU-a, one claiming gb,
// over-commit GPU-a, which the audit says too.
func TestEditedGroupsAreReported(t *testing.T) {
	nodes := []corev1.Node{gpuNode("n1", 2)}
	got := check(nodes,
		reservation("n1", "ga", "GPU-a"),
		reservation("n1", "gb", "GPU-b"),
		tenant("honest", "n1", 50000, api.TimeSlicing, "", "ga", "GPU-a"),
		tenant("edited", "n1", 40000, api.TimeSlicing, "", "gb", "GPU-a"),
	)
	var kinds []Kind
	for _, v := range got {
		kinds = append(kinds, v.Kind)
		if v.Kind == GroupsDisputed && (v.Object != "team/edited" || !strings.Contains(v.Message, "gb") || !strings.Contains(v.Message, "GPU-a")) {
			t.Errorf("dispute %v: want the edited pod, its group and its GPU", v)
		}
	}
	if !slices.Contains(kinds, GroupsDisputed) || !slices.Contains(kinds, OverCommitted) {
		t.Errorf("violations %v: want the edited groups and GPU-a over-committed", got)
	}
}

// The audit names, beside its findings, who would be reclaimed first on
// each GPU were it short of memory: the tenants above their request by
// their node's last reading, lowest priority first. A burst is no
// violation: the cluster stays clean.
func TestReclaimsNameTheOrderBesideACleanAudit(t *testing.T) {
	node := gpuNode("n1", 1)
	ann, err := api.UsageWrite(api.NodeUsage{At: time.Now(), Pods: []api.PodGPUUsage{
		{Pod: "team/low", GPU: "GPU-a", UsedMiB: i64(25000)},
		{Pod: "team/high", GPU: "GPU-a", UsedMiB: i64(30000)},
		{Pod: "team/within", GPU: "GPU-a", UsedMiB: i64(10000)},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if node.Annotations == nil {
		node.Annotations = map[string]string{}
	}
	for k, v := range ann {
		node.Annotations[k] = *v
	}
	pods := []corev1.Pod{reservation("n1", "ga", "GPU-a")}
	for name, priority := range map[string]int32{"low": 0, "high": 1000, "within": -1} {
		p := tenant(name, "n1", 20000, api.TimeSlicing, "", "ga", "GPU-a")
		p.Spec.Priority = &priority
		pods = append(pods, p)
	}
	if got := check([]corev1.Node{node}, pods...); len(got) != 0 {
		t.Fatalf("bursting tenants reported as violations: %v", got)
	}
	got := Reclaims([]corev1.Node{node}, pods, nil)
	if want := []string{"reclaimed first on n1 GPU GPU-a, were it short of memory: team/low, team/high"}; !slices.Equal(got, want) {
		t.Errorf("Reclaims = %q, want %q", got, want)
	}
}

func i64(v int64) *int64 { return &v }
