package scheduler

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	corev1listers "k8s.io/client-go/listers/core/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// preemptNode is n1 with two 80000 MiB GPUs, each shared by two halves
// (a, b on GPU 0; c, d on GPU 1) and held by its reservation pod, as the
// cache and kube-scheduler's NodeInfo both hold it.
func preemptNode(t *testing.T) (*Plugin, *framework.NodeInfo, map[string]*corev1.Pod) {
	t.Helper()
	p := &Plugin{args: testArgs(), cache: NewCache(testArgs())}
	n := node("n1", 2, 80000, true)
	p.cache.SetNode(n)
	pods := map[string]*corev1.Pod{}
	info := framework.NewNodeInfo()
	info.SetNode(n)
	for i, g := range []string{"g0", "g1"} {
		uuid := []string{"GPU-0", "GPU-1"}[i]
		r := reservationPod("n1", g, uuid)
		r.Spec.Containers[0].Resources.Requests = corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(1, resource.DecimalSI)}
		p.cache.SetPod(r)
		info.AddPod(r)
		for _, name := range []string{"ab", "cd"}[i] {
			pod := placedPod(string(name), "n1", 40000, api.TimeSlicing, "", []string{g}, []string{uuid})
			p.cache.SetPod(pod)
			info.AddPod(pod)
			pods[string(name)] = pod
		}
	}
	return p, info, pods
}

func cycleFor(a Ask) fwk.CycleState {
	state := framework.NewCycleState()
	state.Write(stateKey, &cycle{ask: a})
	return state
}

func podInfo(t *testing.T, pod *corev1.Pod) fwk.PodInfo {
	t.Helper()
	pi, err := framework.NewPodInfo(pod)
	if err != nil {
		t.Fatal(err)
	}
	return pi
}

// Removing a share, as DefaultPreemption weighs a victim, frees its
// memory for the preemptor in Filter; adding it back takes it again; the
// cache's ledger never changes, and a clone of the state (one per node
// weighed) is apart from the original.
func TestFilterWeighsPreemptionsRemovals(t *testing.T) {
	p, info, pods := preemptNode(t)
	ctx := context.Background()
	state := cycleFor(ask("preemptor", 40000, api.TimeSlicing, 1))
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() || s.Code() != fwk.Unschedulable {
		t.Fatalf("full node: %v, want Unschedulable (preemption may help)", s)
	}
	if s := p.RemovePod(ctx, state, nil, podInfo(t, pods["c"]), info); !s.IsSuccess() {
		t.Fatal(s)
	}
	if s := p.Filter(ctx, state, nil, info); !s.IsSuccess() {
		t.Fatalf("with c weighed as a victim: %v, want it to fit", s)
	}
	clone := state.Clone()
	if s := p.AddPod(ctx, clone, nil, podInfo(t, pods["c"]), info); !s.IsSuccess() {
		t.Fatal(s)
	}
	if s := p.Filter(ctx, clone, nil, info); s.IsSuccess() {
		t.Fatal("c reprieved on a clone: the preemptor still fits")
	}
	if s := p.Filter(ctx, state, nil, info); !s.IsSuccess() {
		t.Fatalf("the clone's reprieve changed the original state: %v", s)
	}
	if s := p.cache.Filter("n1", ask("other", 40000, api.TimeSlicing, 1)); s.Fits {
		t.Fatal("a what-if removal freed memory in the cache's ledger")
	}
	// An sm-sharing preemptor needs a GPU whose time-slicing tenants are
	// all gone: one victim frees memory but not the mode.
	sm := cycleFor(ask("sm", 40000, api.SMSharing, 1))
	_ = p.RemovePod(ctx, sm, nil, podInfo(t, pods["c"]), info)
	if s := p.Filter(ctx, sm, nil, info); s.IsSuccess() {
		t.Fatal("an sm-sharing preemptor fits beside a time-slicing share")
	}
	_ = p.RemovePod(ctx, sm, nil, podInfo(t, pods["d"]), info)
	if s := p.Filter(ctx, sm, nil, info); !s.IsSuccess() {
		t.Fatalf("with both time-slicing shares of GPU 1 weighed: %v", s)
	}
}

// A whole-GPU preemptor fits once every share of one GPU is weighed away:
// kube-scheduler's count (NodeInfo) still holds the GPU's reservation
// pod, which is never a victim, and which Reclaim deletes once its group
// is empty; one share gone is not enough.
func TestWholeGPUPreemptorNeedsAGPUEmptied(t *testing.T) {
	p, info, pods := preemptNode(t)
	ctx := context.Background()
	state := cycleFor(Ask{UID: "whole", Whole: 1})
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() || s.Code() != fwk.Unschedulable {
		t.Fatalf("full node: %v, want Unschedulable", s)
	}
	_ = p.RemovePod(ctx, state, nil, podInfo(t, pods["a"]), info)
	_ = p.RemovePod(ctx, state, nil, podInfo(t, pods["c"]), info)
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("a whole GPU fits with one share gone from each GPU")
	}
	_ = p.RemovePod(ctx, state, nil, podInfo(t, pods["b"]), info)
	if s := p.Filter(ctx, state, nil, info); !s.IsSuccess() {
		t.Fatalf("GPU 0 emptied: %v, want the whole-GPU pod to fit", s)
	}
	// Reservation pods are never weighed: removing one changes nothing.
	state = cycleFor(Ask{UID: "whole", Whole: 1})
	_ = p.RemovePod(ctx, state, nil, podInfo(t, reservationPod("n1", "g0", "GPU-0")), info)
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("a reservation pod weighed as a victim freed its GPU under its tenants")
	}
}

// A pod nominated to the node (a preemptor waiting for its victims) is
// held the room its victims free: a pod of lower priority filtered
// meanwhile sees that room taken, even while the victims still terminate.
func TestNominatedPodHoldsTheRoomItsVictimsFree(t *testing.T) {
	p, info, pods := preemptNode(t)
	ctx := context.Background()
	nominee := pod("nominee", "", map[string]string{api.KeyFraction: "0.5"})
	now := metav1.Now()
	victim := pods["d"].DeepCopy()
	victim.DeletionTimestamp = &now
	if err := info.RemovePod(klog.Background(), pods["d"]); err != nil {
		t.Fatal(err)
	}
	info.AddPod(victim)

	// The victim has not gone: nobody fits, with or without the nominee.
	state := cycleFor(ask("late", 40000, api.TimeSlicing, 1))
	_ = p.AddPod(ctx, state, nil, podInfo(t, nominee), info)
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("a late pod fits while the victim terminates")
	}
	// The victim gone: its GPU's half is the nominee's, not the late pod's.
	p.cache.DeletePod(victim)
	_ = info.RemovePod(klog.Background(), victim)
	if s := p.Filter(ctx, cycleFor(ask("late", 40000, api.TimeSlicing, 1)), nil, info); !s.IsSuccess() {
		t.Fatalf("without the nominee the freed half fits: %v", s)
	}
	state = cycleFor(ask("late", 40000, api.TimeSlicing, 1))
	_ = p.AddPod(ctx, state, nil, podInfo(t, nominee), info)
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("a lower-priority pod took the room freed for the nominated preemptor")
	}
	// A pod already booked in the cache (assumed or bound) is not booked
	// twice.
	state = cycleFor(ask("late", 40000, api.TimeSlicing, 1))
	_ = p.AddPod(ctx, state, nil, podInfo(t, pods["a"]), info)
	if s := p.Filter(ctx, state, nil, info); !s.IsSuccess() {
		t.Fatalf("a bound tenant added again took room: %v", s)
	}
}

// Behind says when the cache still books a pod the scheduler's snapshot
// no longer shows on its node: PostFilter then waits for the cache
// rather than weigh preemption on a stale ledger.
func TestBehindFindsAPodOnlyTheCacheHolds(t *testing.T) {
	p, info, pods := preemptNode(t)
	if _, _, behind := p.cache.Behind([]fwk.NodeInfo{info}, nil); behind {
		t.Fatal("behind with the cache and the snapshot alike")
	}
	_ = info.RemovePod(klog.Background(), pods["b"])
	if gone, node, behind := p.cache.Behind([]fwk.NodeInfo{info}, nil); !behind || gone != "default/b" || node != "n1" {
		t.Fatalf("Behind = %s %s %v, want default/b on n1", gone, node, behind)
	}
	// PostFilter waits for it, but not for good: a pair apart for longer
	// than behindBound is apart for another reason.
	waiter := pod("waiter", "", nil)
	if _, _, behind := p.waitForCache(waiter, []fwk.NodeInfo{info}); !behind {
		t.Fatal("PostFilter does not wait for a cache that lags")
	}
	if len(p.waiting["n1"]) != 1 {
		t.Fatalf("waiting %v, want the pod waiting on n1", p.waiting)
	}
	p.behindSince["default/b@n1"] = time.Now().Add(-behindBound - time.Second)
	if gone, _, behind := p.waitForCache(waiter, []fwk.NodeInfo{info}); behind {
		t.Fatalf("still waiting for %s past %s", gone, behindBound)
	}
	p.cache.DeletePod(pods["b"])
	if _, _, behind := p.cache.Behind([]fwk.NodeInfo{info}, nil); behind {
		t.Fatal("still behind once the cache saw the pod go")
	}
	p.wake("n1")
	if len(p.waiting) != 0 || len(p.behindSince) != 0 {
		t.Fatalf("after the node's pods changed: waiting %v, behind since %v", p.waiting, p.behindSince)
	}
}

// draHandle is a framework handle whose DRA manager is kube-scheduler's
// own (dynamicresources.NewDRAManager over an informer of the claims).
type draHandle struct {
	fwk.Handle
	dra fwk.SharedDRAManager
}

func (h draHandle) SharedDRAManager() fwk.SharedDRAManager { return h.dra }

// A victim's claim of gpufrac's driver is freed with it when the victim
// is its only consumer (the claim is deallocated once its last consumer
// goes); one another pod also uses stays booked.
func TestPreemptionFreesAVictimsOwnClaim(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	victim := pod("victim", "n1", nil)
	victim.Namespace = "ml"
	other := pod("other", "n1", nil)
	other.Namespace = "ml"
	own, sharedClaim := claimOn("own", "n1", "GPU-a", 40000), claimOn("shared", "n1", "GPU-a", 40000)
	own.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: victim.Name, UID: victim.UID}}
	sharedClaim.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{
		{Resource: "pods", Name: victim.Name, UID: victim.UID}, {Resource: "pods", Name: other.Name, UID: other.UID}}
	for _, p := range []*corev1.Pod{victim, other} {
		for _, c := range []string{"own", "shared"} {
			if p == other && c == "own" {
				continue
			}
			name := c
			p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: c, ResourceClaimName: &name})
		}
	}
	client := fake.NewClientset(own, sharedClaim)
	factory := informers.NewSharedInformerFactory(client, 0)
	claims := assumecache.NewAssumeCache(klog.Background(), factory.Resource().V1().ResourceClaims().Informer(), "ResourceClaim", "", nil)
	manager := dynamicresources.NewDRAManager(ctx, claims, nil, factory)
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())
	// The assume cache fills from the informer's handlers, after its store.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := manager.ResourceClaims().Get("ml", "shared"); err == nil {
			if _, err := manager.ResourceClaims().Get("ml", "own"); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the DRA manager never saw the claims")
		}
	}

	p := &Plugin{args: testArgs(), cache: NewCache(testArgs()), handle: draHandle{dra: manager}}
	n := node("n1", 1, 80000, true)
	n.Labels[api.LabelStandingGPUs] = "1" // held for claims, as a node serving them asks
	p.cache.SetNode(n)
	for _, st := range p.cache.TakeStanding() {
		p.cache.SetPod(reservationPod("n1", st.Group, "GPU-a"))
	}
	if err := p.cache.SyncClaims([]*resourceapi.ResourceClaim{own, sharedClaim}); err != nil {
		t.Fatal(err)
	}
	info := framework.NewNodeInfo(victim, other)
	info.SetNode(n)
	state := cycleFor(ask("preemptor", 40000, api.TimeSlicing, 1))
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("the claims' GPU took the preemptor")
	}
	if s := p.RemovePod(ctx, state, nil, podInfo(t, victim), info); !s.IsSuccess() {
		t.Fatal(s)
	}
	if s := p.Filter(ctx, state, nil, info); !s.IsSuccess() {
		t.Fatalf("the victim's own claim was not freed with it: %v", s)
	}
	state = cycleFor(ask("preemptor", 80000, api.TimeSlicing, 1))
	_ = p.RemovePod(ctx, state, nil, podInfo(t, victim), info)
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("a claim another pod still uses was freed with the victim")
	}
}

// A whole-GPU preemptor, nominated, is held the GPU its victims left: the
// GPU's idle reservation pod still holds it (until PostFilter deletes it
// for the preemptor), and a share filtered meanwhile must not join it.
func TestNominatedWholeGPUPodHoldsTheGPUItsVictimsLeft(t *testing.T) {
	p, info, pods := preemptNode(t)
	ctx := context.Background()
	for _, name := range []string{"a", "b"} {
		p.cache.DeletePod(pods[name])
		if err := info.RemovePod(klog.Background(), pods[name]); err != nil {
			t.Fatal(err)
		}
	}
	if s := p.Filter(ctx, cycleFor(ask("late", 40000, api.TimeSlicing, 1)), nil, info); !s.IsSuccess() {
		t.Fatalf("a share does not fit the emptied GPU: %v", s)
	}
	nominee := wholePod("nominee", "", 1)
	state := cycleFor(ask("late", 40000, api.TimeSlicing, 1))
	_ = p.AddPod(ctx, state, nil, podInfo(t, nominee), info)
	if s := p.Filter(ctx, state, nil, info); s.IsSuccess() {
		t.Fatal("a lower-priority share joined the GPU left for a nominated whole-GPU pod")
	}
}

// A pod bound since the snapshot was taken (by another scheduler, or
// spec.nodeName) is the snapshot's lag, not the cache's: PostFilter does
// not wait for it. One the informer shows gone is the cache's.
func TestBehindIgnoresAPodBoundSinceTheSnapshot(t *testing.T) {
	p, info, pods := preemptNode(t)
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, toolscache.Indexers{toolscache.NamespaceIndex: toolscache.MetaNamespaceIndexFunc})
	p.pods = corev1listers.NewPodLister(indexer)
	_ = info.RemovePod(klog.Background(), pods["b"]) // the snapshot lacks b
	if err := indexer.Add(pods["b"]); err != nil {
		t.Fatal(err)
	}
	if gone, _, behind := p.waitForCache(pod("waiter", "", nil), []fwk.NodeInfo{info}); behind {
		t.Fatalf("waits for %s, which the informer shows live on its node", gone)
	}
	if err := indexer.Delete(pods["b"]); err != nil {
		t.Fatal(err)
	}
	if gone, _, behind := p.waitForCache(pod("waiter", "", nil), []fwk.NodeInfo{info}); !behind || gone != "default/b" {
		t.Fatalf("does not wait for default/b, gone from the informer and still in the cache (%s, %v)", gone, behind)
	}
}

// nvidia.com/gpu is counted as kube-scheduler adds a pod's requests: a
// restartable init container (a sidecar) runs beside the main ones.
func TestWholeGPUsCountedWithSidecars(t *testing.T) {
	always := corev1.ContainerRestartPolicyAlways
	one := corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(1, resource.DecimalSI)}
	p := wholePod("w", "", 1)
	p.Spec.Containers[0].Resources.Requests = one // as the API server defaults them from the limits
	p.Spec.InitContainers = []corev1.Container{{Name: "sidecar", RestartPolicy: &always, Resources: corev1.ResourceRequirements{Limits: one, Requests: one}}}
	if _, _, gpus := podRequests(p); gpus != 2 {
		t.Errorf("nvidia.com/gpu counted %d, want 2 (the main container's and its sidecar's)", gpus)
	}
	v := view{gpus: 8, gpusFree: 1}
	if _, fits := wholeVerdict(Ask{Whole: api.WholeGPUs(&p.Spec), DeviceGPUs: 2}, v, 0); fits {
		t.Error("a pod of two nvidia.com/gpu fit a node with one free")
	}
}
