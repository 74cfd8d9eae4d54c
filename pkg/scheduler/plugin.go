// Package scheduler is the GPUFractions plugin of kube-scheduler: it
// places pods that ask for a fraction of a GPU (SPEC §1) on GPUs with the
// memory, compute mode and compute portion free, holds each shared GPU
// with a reservation pod, and writes its decision onto the pod in the KAI
// NvFractions annotations (SPEC §2), which gpufrac's node agent and
// NVIDIA's enforce. Whole-GPU pods keep going through the default plugins;
// this one only keeps them off shared GPUs.
package scheduler

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	corev1listers "k8s.io/client-go/listers/core/v1"
	toolscache "k8s.io/client-go/tools/cache"
	resourcehelper "k8s.io/component-helpers/resource"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// Name is the plugin's name in a KubeSchedulerConfiguration.
const Name = "GPUFractions"

// Plugin is the GPUFractions plugin.
type Plugin struct {
	args   Args
	handle fwk.Handle
	cache  *Cache

	mu      sync.Mutex
	current placement.Policy
	built   time.Time
	// synced says whether the cache has seen every pod and node the API
	// held when the scheduler started.
	synced []toolscache.InformerSynced
	// bindOrder finds out once whether this plugin binds first (first).
	bindOrder sync.Once
	first     bool
	// quotas are the ResourceQuotas, which say whether a namespace bounds
	// GPU memory (a resize then stays within its pod's charge).
	quotas       corev1listers.ResourceQuotaLister
	quotasSynced toolscache.InformerSynced
	// pods is the scheduler's pod informer's lister (stillOn).
	pods corev1listers.PodLister
	// lead caches what the leader-election Lease last said (leader.go).
	lead leadership
	// waiting are the pods whose PostFilter found the cache behind the
	// scheduler's snapshot, by node: woken when a pod leaves it
	// (waitForCache).
	waitingMu sync.Mutex
	waiting   map[string]map[types.UID]*corev1.Pod
	// behindSince is when each pod (namespace/name@node) was first seen
	// held by the cache and not by the snapshot.
	behindSince map[string]time.Time
}

var (
	_ fwk.PreFilterPlugin     = (*Plugin)(nil)
	_ fwk.PreFilterExtensions = (*Plugin)(nil)
	_ fwk.FilterPlugin        = (*Plugin)(nil)
	_ fwk.ScorePlugin         = (*Plugin)(nil)
	_ fwk.ReservePlugin       = (*Plugin)(nil)
	_ fwk.PreBindPlugin       = (*Plugin)(nil)
	_ fwk.BindPlugin          = (*Plugin)(nil)
	_ fwk.PostBindPlugin      = (*Plugin)(nil)
	_ fwk.PostFilterPlugin    = (*Plugin)(nil)
	_ fwk.EnqueueExtensions   = (*Plugin)(nil)
)

// New builds the plugin from its arguments; it is the factory registered
// with the kube-scheduler command. The cache follows the scheduler's own
// pod and node informers, and a collector deletes reservation pods whose
// GPU group emptied.
func New(ctx context.Context, obj runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
	args, err := DecodeArgs(obj)
	if err != nil {
		return nil, err
	}
	p := &Plugin{args: args, handle: h, cache: NewCache(args)}
	quotas := h.SharedInformerFactory().Core().V1().ResourceQuotas()
	p.quotas, p.quotasSynced = quotas.Lister(), quotas.Informer().HasSynced
	p.pods = h.SharedInformerFactory().Core().V1().Pods().Lister()
	pods := h.SharedInformerFactory().Core().V1().Pods().Informer()
	nodes := h.SharedInformerFactory().Core().V1().Nodes().Informer()
	podEvents, err := pods.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.onPod(obj, false) },
		UpdateFunc: func(_, obj any) { p.onPod(obj, false) },
		DeleteFunc: func(obj any) { p.onPod(obj, true) },
	})
	if err != nil {
		return nil, err
	}
	nodeEvents, err := nodes.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.onNode(obj, false) },
		UpdateFunc: func(_, obj any) { p.onNode(obj, false) },
		DeleteFunc: func(obj any) { p.onNode(obj, true) },
	})
	if err != nil {
		return nil, err
	}
	// The informers' own HasSynced says their stores are full, not that
	// this plugin's handlers have seen every object: only the handler
	// registrations say that. Until they do, the cache may lack tenants,
	// and a GPU that looks empty is not.
	p.synced = []toolscache.InformerSynced{podEvents.HasSynced, nodeEvents.HasSynced}
	go func() {
		if !toolscache.WaitForCacheSync(ctx.Done(), p.synced...) {
			return
		}
		p.collect(ctx)
	}()
	klog.FromContext(ctx).Info("GPUFractions plugin ready", "policy", args.Policy, "reservationNamespace", args.ReservationNamespace,
		"bindTimeout", args.BindTimeout.Duration, "deviceNaming", args.DeviceNaming)
	return p, nil
}

// Cache returns the plugin's view of the GPUs.
func (p *Plugin) Cache() *Cache { return p.cache }

// Name implements fwk.Plugin.
func (p *Plugin) Name() string { return Name }

func (p *Plugin) onPod(obj any, deleted bool) {
	if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj, deleted = tomb.Obj, true
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	if deleted {
		p.cache.DeletePod(pod)
	} else {
		p.cache.SetPod(pod)
	}
	if deleted || api.PodEnded(pod) {
		p.wake(pod.Spec.NodeName)
	}
}

func (p *Plugin) onNode(obj any, deleted bool) {
	if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj, deleted = tomb.Obj, true
	}
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	if deleted {
		p.cache.DeleteNode(node.Name)
		p.wake(node.Name) // nothing will leave it any more
		return
	}
	p.cache.SetNode(node)
}

// cycle is what PreFilter learns once per pod for the later extension
// points.
type cycle struct {
	ask    Ask
	policy placement.Policy
	// freed is the cache's count of removed tenants at PreFilter.
	freed uint64
}

// Clone implements fwk.StateData; the cycle is never changed after
// PreFilter.
func (c *cycle) Clone() fwk.StateData { return c }

const stateKey fwk.StateKey = Name

// readCycle is what PreFilter wrote. Its absence is an error, as in
// kube-scheduler's NodeResourcesFit: every pod that reaches Filter,
// Score, Reserve or PreBind went through PreFilter, so a missing cycle
// is a framework fault, and passing the node would place the pod
// unchecked.
func readCycle(state fwk.CycleState) (*cycle, *fwk.Status) {
	s, err := state.Read(stateKey)
	if err != nil {
		return nil, fwk.AsStatus(fmt.Errorf("reading %q from cycleState: %w", stateKey, err))
	}
	c, ok := s.(*cycle)
	if !ok {
		return nil, fwk.AsStatus(fmt.Errorf("%+v convert to %s cycle state error", s, Name))
	}
	return c, nil
}

// PreFilter reads the pod's request once; an invalid one is unschedulable
// until its author fixes it. A pod that asks for no GPU skips Filter but
// is still scored: its CPU and memory can strand a node's GPUs, and the
// simulator's figures assume the policy places it too.
func (p *Plugin) PreFilter(ctx context.Context, state fwk.CycleState, pod *corev1.Pod, _ []fwk.NodeInfo) (*fwk.PreFilterResult, *fwk.Status) {
	if !p.waitSynced(ctx) {
		return nil, fwk.NewStatus(fwk.Error, "gpufrac's GPU cache has not caught up with the API yet")
	}
	if err := p.syncClaims(); err != nil {
		return nil, fwk.AsStatus(err)
	}
	ask := Ask{UID: pod.UID}
	ask.CPU, ask.MemoryMiB, ask.DeviceGPUs = podRequests(pod)
	if n := api.WholeGPUs(&pod.Spec); n > 0 {
		ask.Whole = n
	}
	reqs, err := api.Parse(api.Intent(pod))
	switch {
	case err != nil:
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, err.Error())
	case len(reqs) > 0:
		ask.Fraction = &reqs[0]
	}
	if _, charged := api.ChargedMiB(&pod.Spec); charged || !p.args.AllowUncharged {
		claimsMiB, err := p.claimsChargeMiB(pod)
		if err != nil {
			return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, err.Error())
		}
		if !charged && (ask.Fraction != nil || claimsMiB > 0) {
			// Every pod that asks for a share at creation is charged by
			// the webhook; one without is a share gained after (claims
			// swapped, keys the webhook did not see) and would hold GPU
			// memory its namespace's quota never counted.
			return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
				"the pod holds a GPU share but carries no %s charge, which gpufrac's webhook writes on every pod that asks for one when it is created: it asked after creation (a claim made or replaced after its pod), or the webhook did not see it; create the claim first, then the pod again",
				api.ResourceGPUMemory))
		}
		if ask.ChargeMiB, _ = api.ShareBudgetMiB(&pod.Spec, claimsMiB); ask.ChargeMiB < 0 {
			return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
				"the pod's claims of %s hold %s of GPU memory, more than the %s charged to its namespace's quota (%s) when the pod was created (a claim made after its pod is charged nothing): create the claim first, then the pod again",
				api.DRADriver, api.FormatMiB(claimsMiB), api.FormatMiB(ask.ChargeMiB+claimsMiB), api.ResourceGPUMemory))
		}
		ask.Charged = true
	}
	freed := p.cache.Freed() // before any Filter reads the cache
	policy, err := p.policy()
	if err != nil {
		return nil, fwk.AsStatus(err)
	}
	state.Write(stateKey, &cycle{ask: ask, policy: policy, freed: freed})
	if !ask.GPU() {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	return nil, nil
}

// podRequests is the pod's CPU (milli-CPU), memory (MiB) and
// nvidia.com/gpu requests as kube-scheduler's NodeResourcesFit counts
// them (init containers, sidecars and overhead included).
func podRequests(pod *corev1.Pod) (cpu, memoryMiB, gpus int64) {
	reqs := resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{})
	return reqs.Cpu().MilliValue(), reqs.Memory().Value() >> 20, reqs.Name(api.ResourceGPU, resource.DecimalSI).Value()
}

// hostOf is a node's CPU and memory as kube-scheduler counts them.
func hostOf(nodeInfo fwk.NodeInfo) Host {
	alloc, used := nodeInfo.GetAllocatable(), nodeInfo.GetRequested()
	return Host{CPU: alloc.GetMilliCPU(), CPUUsed: used.GetMilliCPU(), MemoryMiB: alloc.GetMemory() >> 20, MemoryUsedMiB: used.GetMemory() >> 20}
}

// waitSynced waits, at most syncTimeout, until the cache has seen the
// API's state: at start-up only, so the first cycles never place on GPUs
// whose tenants the cache has not been told about yet.
func (p *Plugin) waitSynced(ctx context.Context) bool {
	for _, s := range p.synced {
		if !s() {
			ctx, cancel := context.WithTimeout(ctx, syncTimeout)
			defer cancel()
			return toolscache.WaitForCacheSync(ctx.Done(), p.synced...)
		}
	}
	return true
}

const syncTimeout = 30 * time.Second

// policy builds the placement policy for one pod: the FGD-like ones weigh
// the workload's typical shapes as the cache sees them now.
func (p *Plugin) policy() (placement.Policy, error) {
	if p.args.Policy == PolicySpread {
		return placement.Spread{}, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	// The workload's shapes drift slowly, and gpufrac's policy builds a
	// table per shape set: rebuild at most every policyTTL.
	if p.current != nil && time.Since(p.built) < policyTTL {
		return p.current, nil
	}
	shapes, capacity, supply := p.cache.Shapes()
	policy, err := placement.New(p.args.Policy, shapes, capacity, supply, nil)
	if err != nil {
		return nil, err
	}
	p.current, p.built = policy, time.Now()
	return policy, nil
}

// policyTTL is how long a policy built from the workload's shapes is used.
const policyTTL = time.Second

// Filter checks the node's GPUs, as preemption's simulation has changed
// them when it has (preempt.go).
func (p *Plugin) Filter(_ context.Context, state fwk.CycleState, _ *corev1.Pod, nodeInfo fwk.NodeInfo) *fwk.Status {
	c, status := readCycle(state)
	if status != nil {
		return status
	}
	v := p.cache.FilterAt(nodeInfo.Node(), c.ask, viewOf(state, nodeInfo))
	switch {
	case v.Fits:
		return nil
	case v.Resolvable:
		return fwk.NewStatus(fwk.Unschedulable, v.Reason)
	}
	return fwk.NewStatus(fwk.UnschedulableAndUnresolvable, v.Reason)
}

// Score rates the node with the placement policy; NormalizeScore maps the
// raw figures onto kube-scheduler's 0–100.
func (p *Plugin) Score(_ context.Context, state fwk.CycleState, _ *corev1.Pod, nodeInfo fwk.NodeInfo) (int64, *fwk.Status) {
	c, status := readCycle(state)
	if status != nil {
		return 0, status
	}
	score, ok := p.cache.Score(nodeInfo.Node().Name, c.ask, c.policy, hostOf(nodeInfo))
	if !ok {
		return unrated, nil
	}
	return rawScore(score), nil
}

// unrated is the raw score of a node the policy cannot rate (a whole-GPU
// pod on a node whose GPUs gpufrac does not know): NormalizeScore gives it
// 0, below every node the policy rated, whatever their raw scores.
const unrated = math.MinInt64

// rawScore is a policy's score as the framework's integer.
func rawScore(score float64) int64 {
	// Policies score in their own units, gpufrac's in GPUs of expected
	// fragmentation plus a node's rank. The ranks of names that differ in
	// their last character are about 1e-7 apart, and on a CPU-bound
	// workload the rank is scaled down to a hundredth: score to 1e-11, so
	// that rounding ties no two nodes the policy tells apart. (±4.5e7
	// units at that scale keep NormalizeScore's differences within an
	// int64; the largest scores, spread's free MiB on a node, are below
	// 2e7.)
	if math.IsNaN(score) {
		score = math.Inf(-1) // no rating a policy means: the lowest
	}
	return int64(math.Round(max(min(score, 4.5e7), -4.5e7) * 1e11))
}

// ScoreExtensions implements fwk.ScorePlugin.
func (p *Plugin) ScoreExtensions() fwk.ScoreExtensions { return p }

// NormalizeScore maps the raw scores onto kube-scheduler's 0–100 so that
// the policy's choice survives the framework: linearly, except that the
// policy's best node alone gets 100 and every other at most 99. A linear
// map alone would round near-equal nodes to the same integer, and
// kube-scheduler settles equal totals at random, where the policy (and
// the simulator) tell them apart. Nodes with the very same best raw score
// are told apart by name, the earliest first, as the simulator's given
// order does, so that a placement is reproducible.
func (p *Plugin) NormalizeScore(_ context.Context, _ fwk.CycleState, _ *corev1.Pod, scores fwk.NodeScoreList) *fwk.Status {
	normalize(scores)
	return nil
}

func normalize(scores fwk.NodeScoreList) {
	best := -1
	var lo, hi int64
	for i, s := range scores {
		if s.Score == unrated {
			continue
		}
		if best < 0 {
			lo, hi, best = s.Score, s.Score, i
		}
		lo, hi = min(lo, s.Score), max(hi, s.Score)
		if s.Score > scores[best].Score || (s.Score == scores[best].Score && s.Name < scores[best].Name) {
			best = i
		}
	}
	for i := range scores {
		switch {
		case scores[i].Score == unrated:
			scores[i].Score = 0
		case i == best:
			scores[i].Score = fwk.MaxScore
		case hi == lo:
			scores[i].Score = fwk.MaxScore - 1
		default:
			linear := int64(float64(scores[i].Score-lo) * float64(fwk.MaxScore) / float64(hi-lo))
			scores[i].Score = min(linear, fwk.MaxScore-1)
		}
	}
}

// Reserve assumes the pod's GPUs in the cache, on the GPUs the policy
// chose in Score: it rates the node again from the same snapshot.
func (p *Plugin) Reserve(_ context.Context, state fwk.CycleState, pod *corev1.Pod, node string) *fwk.Status {
	if s := p.reserveClaims(pod); !s.IsSuccess() {
		return s
	}
	c, status := readCycle(state)
	if status != nil {
		return status
	}
	if !c.ask.GPU() {
		return nil
	}
	var host Host
	if info, err := p.handle.SnapshotSharedLister().NodeInfos().Get(node); err == nil {
		host = hostOf(info)
	}
	if err := p.cache.Reserve(node, pod.Namespace, pod.Name, c.ask, c.policy, host); err != nil {
		return fwk.NewStatus(fwk.Unschedulable, err.Error())
	}
	return nil
}

// PostFilter gives GPUs back to a pod that asks for whole GPUs and fits
// nowhere only because reservation pods kept for shares hold idle GPUs:
// on the node that needs the fewest deleted, it deletes them and
// nominates the node, as preemption would; the deletions queue the pod
// again. Only nodes that refused the pod for GPUs alone are considered
// (kube-scheduler's count of nvidia.com/gpu, or this plugin's ledger);
// a filter that runs after NodeResourcesFit may still refuse the node, and
// then the pod tries again elsewhere. Listed ahead of DefaultPreemption
// (deploy/scheduler/config.yaml), so that an idle GPU is taken back before
// a running pod is preempted.
func (p *Plugin) PostFilter(ctx context.Context, state fwk.CycleState, pod *corev1.Pod, statuses fwk.NodeToStatusReader) (*fwk.PostFilterResult, *fwk.Status) {
	// PostFilter also runs for a pod whose PreFilter refused it (an
	// invalid request), which wrote no cycle: nothing to reclaim for it.
	c, status := readCycle(state)
	if status != nil || !c.ask.GPU() {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	infos, err := statuses.NodesForStatusCode(p.handle.SnapshotSharedLister().NodeInfos(), fwk.Unschedulable)
	if err != nil {
		return nil, fwk.AsStatus(err)
	}
	if node, freed := p.cache.FreedSince(infos, c.freed); freed && p.handle != nil {
		// Room came free on a refusing node while this cycle ran (a victim
		// gone between its Filter and now): its verdict may be stale, and
		// the event that frees it was handled before. Tried again at once
		// (the queue requeues an in-flight pod it is asked to activate),
		// rather than preempt or reclaim for room already there.
		p.handle.Activate(klog.FromContext(ctx), map[string]*corev1.Pod{pod.Namespace + "/" + pod.Name: pod})
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
			"GPU memory came free on node %s while this pod was being scheduled; trying again before reclaiming GPUs or preempting", node))
	}
	if gone, node, behind := p.waitForCache(pod, infos); behind {
		// Unresolvable ends PostFilter here: DefaultPreemption, next,
		// would weigh the same stale ledger.
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
			"gpufrac's GPU cache has not yet seen pod %s leave node %s; trying again once it has, before reclaiming GPUs or preempting", gone, node))
	}
	if c.ask.Whole == 0 {
		return p.consolidated(ctx, pod, c, refusedForGPUs(infos, statuses), "")
	}
	var nodes []string
	for _, info := range infos {
		if name := info.Node().Name; shortOfGPUsOnly(statuses.Get(name)) {
			nodes = append(nodes, name)
		}
	}
	node, retired := p.cache.Reclaim(c.ask.Whole, nodes)
	if node == "" {
		return p.consolidated(ctx, pod, c, refusedForGPUs(infos, statuses), "no node would fit it by deleting idle reservation pods")
	}
	logger := klog.FromContext(ctx)
	for _, o := range retired {
		// A delete that fails here is the collector's to retry: the group
		// is retired, so the pod is an orphan to it.
		if err := deleteReservation(ctx, p.handle.ClientSet(), o); err != nil {
			logger.Error(err, "Could not delete an idle reservation pod to make room for a whole-GPU pod; the collector retries", "pod", klog.KRef(o.Namespace, o.Name))
		}
	}
	logger.V(2).Info("Deleted idle reservation pods to make room for a whole-GPU pod", "pod", klog.KObj(pod), "node", node, "reservationPods", len(retired))
	return &fwk.PostFilterResult{NominatingInfo: &fwk.NominatingInfo{NominatedNodeName: node, NominatingMode: fwk.ModeOverride}}, fwk.NewStatus(fwk.Success)
}

// consolidated tries consolidation (consolidate.go) for a pod nothing
// else made room for; on success the pod is nominated to the node the
// moves free, so that the moved pods, made again, go elsewhere. Otherwise
// DefaultPreemption runs next.
func (p *Plugin) consolidated(ctx context.Context, pod *corev1.Pod, c *cycle, refused []fwk.NodeInfo, why string) (*fwk.PostFilterResult, *fwk.Status) {
	node, whyNot := p.consolidate(ctx, pod, c, refused)
	if node == "" {
		return nil, fwk.NewStatus(fwk.Unschedulable, strings.TrimPrefix(why+"; "+whyNot, "; "))
	}
	return &fwk.PostFilterResult{NominatingInfo: &fwk.NominatingInfo{NominatedNodeName: node, NominatingMode: fwk.ModeOverride}}, fwk.NewStatus(fwk.Success)
}

// refusedForGPUs are the nodes that refused the pod for GPU room alone:
// the plugins before this one (CPU, memory, affinity, taints) let it
// through, and this one's ledger found too little memory, idle GPUs,
// compute or GPUs of its mode, which moves can make. A node not ready,
// with a silent agent or GPUs it cannot account for is not one.
func refusedForGPUs(infos []fwk.NodeInfo, statuses fwk.NodeToStatusReader) []fwk.NodeInfo {
	room := func(s *fwk.Status) bool {
		if s.Code() != fwk.Unschedulable || s.Plugin() != Name || len(s.Reasons()) == 0 {
			return false
		}
		for _, r := range s.Reasons() {
			if !slices.ContainsFunc([]gpu.Reason{gpu.ReasonGPUs, gpu.ReasonWhole, gpu.ReasonMode, gpu.ReasonCompute}, func(g gpu.Reason) bool {
				return strings.HasPrefix(r, string(g)+":")
			}) {
				return false
			}
		}
		return true
	}
	return slices.DeleteFunc(slices.Clone(infos), func(info fwk.NodeInfo) bool {
		s := statuses.Get(info.Node().Name)
		return !shortOfGPUsOnly(s) && !room(s)
	})
}

// shortOfGPUsOnly says whether a node refused a pod for its GPUs alone:
// NodeResourcesFit for nvidia.com/gpu and nothing else, or this plugin's
// ledger for idle GPUs.
func shortOfGPUsOnly(s *fwk.Status) bool {
	if s.Code() != fwk.Unschedulable || len(s.Reasons()) == 0 {
		return false
	}
	for _, r := range s.Reasons() {
		switch {
		case s.Plugin() == "NodeResourcesFit" && r == "Insufficient "+string(api.ResourceGPU):
		case s.Plugin() == Name && strings.HasPrefix(r, string(gpu.ReasonWhole)+":"):
		default:
			return false
		}
	}
	return true
}

// Unreserve rolls Reserve back exactly.
func (p *Plugin) Unreserve(_ context.Context, state fwk.CycleState, pod *corev1.Pod, _ string) {
	if _, status := readCycle(state); status == nil {
		p.cache.Unreserve(pod.UID)
	}
}

// PreBindPreFlight implements fwk.PreBindPlugin: only fractional pods have
// anything to write, and it plans how (planBind, bind.go).
//
// When this plugin binds first (deploy/scheduler/config.yaml), PreBind is
// skipped for a fraction whose decision a Binding can carry: its Binding
// is made in Bind, which first makes the reservation pods its GPUs lack
// and waits for their UUIDs (nothing to wait for when it joins GPUs whose
// pods already name them). That matters beyond PreBind's few
// microseconds: for a pod whose PreBind runs, kube-scheduler first writes
// the node it chose into the pod's status (nominatedNodeName,
// NominatedNodeNameForExpectation), one more API write per pod, which a
// whole-GPU pod does not cost. The write tells autoscalers that a pod they
// see as unschedulable is about to be bound; so a pod already marked
// unschedulable (PodScheduled=False) that must wait for a new reservation
// pod still goes through PreBind and gets it.
func (p *Plugin) PreBindPreFlight(_ context.Context, state fwk.CycleState, pod *corev1.Pod, node string) (*fwk.PreBindPreFlightResult, *fwk.Status) {
	c, status := readCycle(state)
	if status != nil {
		return nil, status
	}
	if c.ask.Fraction == nil {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	d, ok := p.cache.Decision(pod.UID)
	if !ok || d.Node != node {
		return nil, fwk.AsStatus(fmt.Errorf("pod %s/%s has no GPU decision for node %s", pod.Namespace, pod.Name, node))
	}
	gpus := gpusNamed
	uuids, waitingFor, err := p.reservedUUIDs(d)
	switch {
	case err != nil:
		gpus = gpusFailed
	case waitingFor != "":
		gpus = gpusWaiting
	}
	// Whether the decision removes a key of the pod does not depend on
	// the GPUs' names.
	annotations, labels := d.write(make([]string, len(d.Groups)), p.args.CDIKind(), pod.Annotations)
	_, okA := annotations.Additive(pod.Annotations)
	_, okL := labels.Additive(pod.Labels)
	plan := &bindPlan{route: planBind(p.bindsFirst(), okA && okL, markedUnschedulable(pod), gpus), decision: d}
	if gpus == gpusNamed {
		plan.uuids = uuids
	}
	state.Write(bindKey, plan)
	if !plan.route.preBinds() {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	return &fwk.PreBindPreFlightResult{AllowParallel: true}, nil
}

// markedUnschedulable says whether the scheduler has reported the pod
// unschedulable (what autoscalers act on).
func markedUnschedulable(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}

// readPlan is the plan PreBindPreFlight wrote; nil when it planned none
// (a pod that asks for no fraction).
func readPlan(state fwk.CycleState) *bindPlan {
	raw, err := state.Read(bindKey)
	if err != nil {
		return nil
	}
	plan, _ := raw.(*bindPlan)
	return plan
}

// PreBind implements fwk.PreBindPlugin for the routes that run through it:
// it makes the reservation pods exist and waits until each names its GPU;
// then the decision goes onto the pod with its Binding (Bind), or is
// patched here (routePreBindPatch).
func (p *Plugin) PreBind(ctx context.Context, state fwk.CycleState, pod *corev1.Pod, _ string) *fwk.Status {
	plan := readPlan(state)
	if plan == nil || !plan.route.preBinds() {
		return nil
	}
	uuids, err := p.reserveGPUs(ctx, plan.decision)
	if err != nil {
		return fwk.AsStatus(err)
	}
	if plan.route == routePreBindThenBinding {
		plan.uuids = uuids
		return nil
	}
	return fwk.AsStatus(p.annotate(ctx, pod, plan.decision, uuids))
}

// bindsFirst says whether this plugin's Bind runs before any other bind
// plugin in the profile, as deploy/scheduler/config.yaml configures it
// (bind.enabled); asked of the framework once, at the first bind, when its
// plugins are all known. A framework that cannot say is taken to run
// DefaultBinder first.
func (p *Plugin) bindsFirst() bool {
	p.bindOrder.Do(func() {
		if lister, ok := p.handle.(interface{ ListPlugins() *schedconfig.Plugins }); ok {
			if plugins := lister.ListPlugins(); plugins != nil && len(plugins.Bind.Enabled) > 0 {
				p.first = plugins.Bind.Enabled[0].Name == Name
			}
		}
		if !p.first {
			klog.Background().Info("GPUFractions is not the first bind plugin of its profile: decisions are patched before DefaultBinder binds (one more write per pod); list it under bind.enabled as deploy/scheduler/config.yaml does")
		}
	})
	return p.first
}

// Bind binds a fractional pod with a Binding that carries its decision
// (every route but routePreBindPatch), first making the reservation pods
// its GPUs lack and waiting for their names when PreBind was skipped
// (routeReserveThenBinding). Other pods go to DefaultBinder.
func (p *Plugin) Bind(ctx context.Context, state fwk.CycleState, pod *corev1.Pod, node string) *fwk.Status {
	plan := readPlan(state)
	if plan == nil || plan.route == routePreBindPatch {
		return fwk.NewStatus(fwk.Skip)
	}
	uuids := plan.uuids
	if plan.route == routeReserveThenBinding {
		var err error
		if uuids, err = p.reserveGPUs(ctx, plan.decision); err != nil {
			return fwk.AsStatus(err)
		}
	}
	return fwk.AsStatus(p.bind(ctx, pod, node, plan.decision, uuids))
}

// EventsToRegister implements fwk.EnqueueExtensions: a pod this plugin
// refused may fit once something frees room or makes the ledger whole
// again. Without these, it would wait for the queue's five-minute flush:
//
//   - a pod leaves, or ends (its share is freed before it is deleted);
//   - a bound pod's annotations change: the decision a pod bound without
//     one was waiting for, or the GPU a node agent wrote on a reservation
//     pod, either of which clears a node's conflict;
//   - a node changes (new GPUs, readiness; an agent back from silence
//     says AgentStarting, then Ready: kube-scheduler retries on a
//     condition's status, never on a heartbeat alone);
//   - a claim of gpufrac's driver is released or changes;
//   - a node's ResourceSlices change: a claim pod refused in Reserve
//     because the slices lagged behind the annotation shares fits once
//     they show them (the DRA plugin's own hints do not run for a pod that
//     this plugin refused).
func (p *Plugin) EventsToRegister(context.Context) ([]fwk.ClusterEventWithHint, error) {
	return []fwk.ClusterEventWithHint{
		{Event: fwk.ClusterEvent{Resource: fwk.Pod, ActionType: fwk.Delete | fwk.UpdatePodScaleDown}},
		{Event: fwk.ClusterEvent{Resource: fwk.AssignedPod, ActionType: fwk.Update}, QueueingHintFn: assignedPodChanged},
		{Event: fwk.ClusterEvent{Resource: fwk.Node, ActionType: fwk.Add | fwk.UpdateNodeLabel | fwk.UpdateNodeCondition | fwk.UpdateNodeAllocatable}},
		{Event: fwk.ClusterEvent{Resource: fwk.ResourceClaim, ActionType: fwk.Update | fwk.Delete}, QueueingHintFn: claimOfOursChanged},
		{Event: fwk.ClusterEvent{Resource: fwk.ResourceSlice, ActionType: fwk.Add | fwk.Update}, QueueingHintFn: slicesForClaimPods},
	}, nil
}

// assignedPodChanged queues on a bound pod that ended or whose
// annotations changed; its status updates otherwise change nothing here.
func assignedPodChanged(_ klog.Logger, _ *corev1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	old, okOld := oldObj.(*corev1.Pod)
	pod, okNew := newObj.(*corev1.Pod)
	if !okOld || !okNew {
		return fwk.Queue, nil // not what the event promises: err on retrying
	}
	if api.PodEnded(pod) && !api.PodEnded(old) || !maps.Equal(old.Annotations, pod.Annotations) {
		return fwk.Queue, nil
	}
	return fwk.QueueSkip, nil
}

// claimOfOursChanged queues on a change to a claim that held, or holds, a
// device of gpufrac's driver.
func claimOfOursChanged(_ klog.Logger, _ *corev1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	claims := 0
	for _, o := range []any{oldObj, newObj} {
		if c, ok := o.(*resourceapi.ResourceClaim); ok {
			if ours(c) {
				return fwk.Queue, nil
			}
			claims++
		}
	}
	if claims == 0 {
		return fwk.Queue, nil // not what the event promises (a tombstone): err on retrying
	}
	return fwk.QueueSkip, nil
}

// slicesForClaimPods queues a pod with claims on a change to a node's
// slices; an annotation pod does not read them.
func slicesForClaimPods(_ klog.Logger, pod *corev1.Pod, _, _ any) (fwk.QueueingHint, error) {
	if len(pod.Spec.ResourceClaims) > 0 {
		return fwk.Queue, nil
	}
	return fwk.QueueSkip, nil
}

// collect deletes reservation pods whose GPU group emptied, whenever the
// cache says one may have, and every half minute in case a delete failed.
func (p *Plugin) collect(ctx context.Context) {
	logger := klog.FromContext(ctx).WithName(Name)
	tick := time.NewTicker(30 * time.Second)
	defer tick.Stop()
	for {
		dirty := p.cache.Dirty()
		// Every write below is the leader's alone: a standby replica that
		// created, annotated or deleted reservation pods from its own
		// cache would fight the leader's decisions. It waits for the tick,
		// not for its cache's changes, and takes nothing from the cache's
		// queues, which are then whole when it comes to lead.
		if !p.leads(ctx, logger) {
			select {
			case <-ctx.Done():
				return
			case <-time.After(leaderPoll):
			}
			continue
		}
		// Claims hold GPUs too: a standing pod whose claims the cache has
		// not seen since a restart is not empty.
		if err := p.syncClaims(); err != nil {
			logger.Error(err, "Cannot read the DRA claims; collecting nothing this round")
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			continue
		}
		for _, st := range p.cache.TakeStanding() {
			pod := ReservationPod(p.args, st.Node, st.Group)
			if _, err := p.handle.ClientSet().CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				p.cache.DropStanding(st)
				logger.Error(err, "Could not create a standing reservation pod; retrying later", "pod", klog.KObj(pod))
			} else if err == nil {
				logger.V(2).Info("Created a standing reservation pod: the node holds this GPU for shares", "pod", klog.KObj(pod))
			}
		}
		for _, u := range p.cache.HeldUpdates() {
			if err := writeHeld(ctx, p.handle.ClientSet(), u); err != nil && !apierrors.IsNotFound(err) {
				logger.Error(err, "Could not write what annotation shares hold on a standing reservation pod; retrying later", "pod", klog.KRef(u.Namespace, u.Name))
			}
		}
		p.resizeAll(ctx, logger)
		for _, o := range p.cache.Orphans() {
			if !p.cache.StillOrphan(o) {
				continue
			}
			if err := deleteReservation(ctx, p.handle.ClientSet(), o); err != nil {
				logger.Error(err, "Could not delete an empty reservation pod; retrying later", "pod", klog.KRef(o.Namespace, o.Name))
			} else {
				logger.V(2).Info("Deleted reservation pod: its GPU group has no tenant", "pod", klog.KRef(o.Namespace, o.Name))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-dirty:
			// Let a burst of deletions settle into one pass.
			time.Sleep(100 * time.Millisecond)
		case <-tick.C:
		}
	}
}
