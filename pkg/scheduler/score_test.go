package scheduler

import (
	"math"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fwk "k8s.io/kube-scheduler/framework"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

func TestNormalizeKeepsThePolicysBestAlone(t *testing.T) {
	for _, tc := range []struct {
		name string
		raw  []int64
		want []int64
	}{
		// 1000 and 999 apart by a thousandth of the range: a linear map
		// alone gives both 100, and kube-scheduler would pick at random.
		{"near tie", []int64{-100000, 1000, 999, 0}, []int64{0, 100, 99, 99}},
		{"order kept below the best", []int64{0, 100, 50, 25}, []int64{0, 100, 50, 25}},
		// Equal best: the earliest name wins, as the simulator's given order.
		{"exact tie", []int64{7, 7, 3}, []int64{100, 99, 0}},
		{"all equal", []int64{5, 5, 5}, []int64{100, 99, 99}},
		{"one node", []int64{-3}, []int64{100}},
		// A node the policy cannot rate never outranks one it rated.
		{"unrated", []int64{unrated, -5000, -7000}, []int64{0, 100, 0}},
		{"only unrated", []int64{unrated, unrated}, []int64{0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			scores := make(fwk.NodeScoreList, len(tc.raw))
			for i, s := range tc.raw {
				scores[i] = fwk.NodeScore{Name: string(rune('a' + i)), Score: s}
			}
			// The names' order, not the list's, settles an exact tie.
			slices.Reverse(scores)
			normalize(scores)
			slices.Reverse(scores)
			for i, s := range scores {
				if s.Score != tc.want[i] {
					t.Fatalf("normalize(%v) = %v, want %v", tc.raw, scores, tc.want)
				}
			}
		})
	}
}

func withResources(p *corev1.Pod, cpu, memory string) *corev1.Pod {
	p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(cpu), corev1.ResourceMemory: resource.MustParse(memory)}
	return p
}

func fractionPod(name, nodeName, fraction string) *corev1.Pod {
	return pod(name, nodeName, map[string]string{api.KeyFraction: fraction})
}

func TestShapesCountPendingAndCPUOnlyPods(t *testing.T) {
	c := NewCache(testArgs())
	withCPU := func(n *corev1.Node, cpu string) *corev1.Node {
		n.Status.Allocatable[corev1.ResourceCPU] = resource.MustParse(cpu)
		return n
	}
	c.SetNode(withCPU(node("n1", 8, 40000, true), "96"))
	c.SetNode(withCPU(node("n2", 8, 40000, true), "96"))
	c.SetNode(withCPU(node("odd", 8, 80000, true), "128"))
	c.SetNode(withCPU(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cpu-node"}, Status: corev1.NodeStatus{Allocatable: corev1.ResourceList{}}}, "64"))
	// The pending pods are demand too: a policy that saw only bound pods
	// would plan for nothing on an empty cluster.
	for _, p := range []*corev1.Pod{
		withResources(fractionPod("half-1", "", "0.5"), "4", "8Gi"),
		withResources(fractionPod("half-2", "", "0.5"), "4", "16Gi"),
		withResources(fractionPod("half-3", "", "0.5"), "4", "12Gi"),
		withResources(wholePod("whole", "", 2), "8", "1Gi"),
		withResources(pod("cpu-only", "", nil), "16", "1Gi"),
	} {
		c.SetPod(p)
	}
	// Not demand: a DaemonSet's pod, a finished pod, a pod asking nothing.
	daemon := withResources(pod("daemon", "n1", nil), "1", "1Gi")
	daemon.OwnerReferences = []metav1.OwnerReference{{Kind: "DaemonSet", Name: "ds", APIVersion: "apps/v1"}}
	done := withResources(pod("done", "n1", nil), "2", "1Gi")
	done.Status.Phase = corev1.PodSucceeded
	for _, p := range []*corev1.Pod{daemon, done, pod("nothing", "n1", nil)} {
		c.SetPod(p)
	}
	shapes, capacity, supply := c.Shapes()
	got := map[placement.Key]placement.Shape{}
	for _, s := range shapes {
		got[s.Key()] = s
	}
	// 0.5 of the common GPU (40000Mi on two nodes of three), not of the
	// odd one's 80000Mi.
	half := got[placement.Key{CPU: 4000, NumGPU: 1, Share: 20000}]
	if half.P != 0.6 || half.Memory != 12*1024 {
		t.Errorf("shapes %+v: want the half-GPU share at P 0.6 with mean memory 12Gi", shapes)
	}
	if _, ok := got[placement.Key{CPU: 16000}]; !ok {
		t.Errorf("shapes %+v: the CPU-only pod is missing", shapes)
	}
	if len(shapes) != 3 {
		t.Errorf("shapes %+v: want 3 (the daemon's, the finished and the empty pod are not demand)", shapes)
	}
	if capacity.GPU != 8*80000 {
		t.Errorf("capacity %+v: want the largest node's 8 x 80000Mi", capacity)
	}
	// Every node's CPU, the CPU-only node's too, and a whole GPU as the
	// GPU that shares were sized on.
	if want := (placement.Supply{CPU: 384000, GPUs: 24, Unit: 40000}); supply != want {
		t.Errorf("supply %+v, want %+v", supply, want)
	}
	c.DeletePod(fractionPod("half-1", "", "0.5"))
	shapes, _, _ = c.Shapes()
	if i := slices.IndexFunc(shapes, func(s placement.Shape) bool { return s.Share == 20000 }); i < 0 || shapes[i].P != 0.5 {
		t.Errorf("after a delete: shapes %+v, want the half-GPU share at P 0.5", shapes)
	}
}

// A CPU-only pod is rated by the policy: on the node whose CPU it would
// leave too short to feed the idle GPUs it scores lower than on a node
// where it strands nothing, and a node without GPUs rates it too.
func TestScoreRatesCPUOnlyPodsByWhatTheyStrand(t *testing.T) {
	c := NewCache(testArgs())
	c.SetNode(node("gpu", 8, 40000, true))
	for i := range 8 {
		c.SetPod(withResources(fractionPod("pending-"+string(rune('a'+i)), "", "0.5"), "8", "1Gi"))
	}
	policy := NewTestPolicy(t, c)
	cpuOnly := Ask{UID: "cpu", CPU: 40000, MemoryMiB: 1024}
	// 64 CPUs, 20 used: 40 more leave 4, enough for no 8-CPU share.
	tight := Host{CPU: 64000, CPUUsed: 20000, MemoryMiB: 1 << 20}
	roomy := Host{CPU: 256000, MemoryMiB: 1 << 20}
	onTight, ok1 := c.Score("gpu", cpuOnly, policy, tight)
	onRoomy, ok2 := c.Score("gpu", cpuOnly, policy, roomy)
	onCPUNode, ok3 := c.Score("cpu-node", cpuOnly, policy, roomy)
	if !ok1 || !ok2 || !ok3 {
		t.Fatalf("Score: want every node rated for a CPU-only pod, got ok %v %v %v", ok1, ok2, ok3)
	}
	if onTight >= onRoomy || onTight >= onCPUNode {
		t.Errorf("scores: tight %v, roomy %v, node without GPUs %v: the node left unable to feed its GPUs must score lowest", onTight, onRoomy, onCPUNode)
	}
	// A GPU pod is not rated on a node without GPUs.
	if _, ok := c.Score("cpu-node", ask("g", 1000, api.TimeSlicing, 1), policy, roomy); ok {
		t.Error("Score rated a fractional pod on a node without GPUs")
	}
	// Reserve books nothing for a CPU-only pod.
	if err := c.Reserve("gpu", "default", "cpu", cpuOnly, policy, tight); err != nil {
		t.Fatalf("Reserve(CPU-only) = %v", err)
	}
	if _, held := c.where["cpu"]; held {
		t.Error("Reserve booked a CPU-only pod in the GPU cache")
	}
}

// NewTestPolicy is the default policy over the cache's workload.
func NewTestPolicy(t *testing.T, c *Cache) placement.Policy {
	t.Helper()
	shapes, capacity, supply := c.Shapes()
	p, err := placement.New("gpufrac", shapes, capacity, supply, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The decision goes with the Binding unless it must remove a key the pod
// carries (a stale portion, a stale group label): a Binding only adds.
func TestBindingCarriesTheDecisionUnlessAKeyMustGo(t *testing.T) {
	portionKey := api.ContainerKey("main", api.SuffixComputePortion)
	d := Decision{Container: "main", Groups: []string{"g"}, Resolved: api.Resolved{RequestMiB: 1024, LimitMiB: 2048}, Mode: api.TimeSlicing}
	bindingOf := func(d Decision, uuids []string, pod *corev1.Pod) (annotations, labels map[string]string, ok bool) {
		wa, wl := d.write(uuids, "", pod.Annotations)
		annotations, okA := wa.Additive(pod.Annotations)
		labels, okL := wl.Additive(pod.Labels)
		return annotations, labels, okA && okL
	}
	fresh := fractionPod("p", "", "0.5")
	annotations, labels, ok := bindingOf(d, []string{"GPU-1"}, fresh)
	if !ok || annotations[api.ContainerKey("main", api.SuffixDevices)] != "GPU-1" || annotations[api.GPUGroupsAnnotation] != "g" ||
		labels[api.GPUGroupLabel] != "g" {
		t.Fatalf("binding %v %v, %v: want the devices, the group and its label", annotations, labels, ok)
	}
	if _, has := annotations[portionKey]; has {
		t.Errorf("a time-slicing binding carries a compute portion: %v", annotations)
	}
	stale := fractionPod("p", "", "0.5")
	stale.Annotations[portionKey] = "0.5"
	if _, _, ok := bindingOf(d, []string{"GPU-1"}, stale); ok {
		t.Error("a decision that must remove a stale portion went with the Binding, which cannot remove it")
	}
	two := d
	two.Groups = []string{"g1", "g2"}
	labelled := fractionPod("p", "", "0.5")
	labelled.Labels = map[string]string{api.GPUGroupLabel: "old"}
	if _, _, ok := bindingOf(two, []string{"GPU-1", "GPU-2"}, labelled); ok {
		t.Error("a two-GPU decision that must remove a stale group label went with the Binding")
	}
}

// listingHandle is a framework handle that lists its profile's plugins.
type listingHandle struct {
	fwk.Handle
	bind []string
}

func (h listingHandle) ListPlugins() *schedconfig.Plugins {
	var p schedconfig.Plugins
	for _, name := range h.bind {
		p.Bind.Enabled = append(p.Bind.Enabled, schedconfig.Plugin{Name: name})
	}
	return &p
}

// The decision rides on the Binding only when this plugin binds first: a
// DefaultBinder ahead of it would bind the pod without the decision.
func TestBindsFirstOnlyWhenFirst(t *testing.T) {
	for _, tc := range []struct {
		handle fwk.Handle
		want   bool
	}{
		{listingHandle{bind: []string{Name, "DefaultBinder"}}, true},
		{listingHandle{bind: []string{"DefaultBinder", Name}}, false},
		{listingHandle{}, false},
		{struct{ fwk.Handle }{}, false}, // a framework that cannot say
	} {
		p := &Plugin{handle: tc.handle}
		if got := p.bindsFirst(); got != tc.want {
			t.Errorf("%+v: bindsFirst %v, want %v", tc.handle, got, tc.want)
		}
	}
}

// Raw scores keep what a scaled-down rank tells apart, and the extremes
// normalise without overflow: the best node alone at 100, the rest in
// order below it.
func TestRawScoresKeepSmallDifferencesAndNormaliseAtTheExtremes(t *testing.T) {
	if a, b := rawScore(-0.5), rawScore(-0.5+2e-9); a >= b {
		t.Errorf("scores 2e-9 apart got raw %d and %d: want them ordered", a, b)
	}
	scores := fwk.NodeScoreList{
		{Name: "worst", Score: rawScore(math.Inf(-1))},
		{Name: "nan", Score: rawScore(math.NaN())},
		{Name: "mid", Score: rawScore(-3)},
		{Name: "best", Score: rawScore(math.Inf(1))},
	}
	normalize(scores)
	got := map[string]int64{}
	for _, s := range scores {
		got[s.Name] = s.Score
	}
	if got["best"] != fwk.MaxScore || got["mid"] >= fwk.MaxScore || got["mid"] < got["worst"] || got["worst"] < 0 || got["nan"] != got["worst"] {
		t.Errorf("normalised %v: want best 100, mid below it, worst and nan lowest, none negative", got)
	}
}
