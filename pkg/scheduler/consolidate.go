package scheduler

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	resourcehelper "k8s.io/component-helpers/resource"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// movable says whether consolidation may move pod for a pod of priority
// prio: it opted in (api.OptedInToMoves: KAI's preemptibility label), a
// controller makes it again once evicted (a bare pod would be lost), it
// is not already going, and it matters no more than the pod it makes room
// for. KAI also counts pods below priority 100 preemptible when
// unlabelled; gpufrac does not: on a stock cluster every pod runs at
// priority 0, and moving pods that never asked for it would surprise
// their owners. A pod whose replacement the planner cannot place as
// kube-scheduler would (volumes bound to a node or zone, host ports, pod
// affinity or spread constraints, DRA claims) does not move either.
func movable(pod *corev1.Pod, prio int32) bool {
	owner := metav1.GetControllerOf(pod)
	if !api.OptedInToMoves(pod.Labels) || owner == nil || pod.DeletionTimestamp != nil || corev1helpers.PodPriority(pod) > prio {
		return false
	}
	switch owner.Kind {
	case "DaemonSet", "Node", "Job":
		// A DaemonSet makes its pod again on the same node; a static
		// pod's mirror (owned by its Node) is the kubelet's; an evicted
		// Job pod counts against the Job's backoffLimit.
		return false
	}
	if len(pod.Spec.ResourceClaims) > 0 || len(pod.Spec.TopologySpreadConstraints) > 0 ||
		(pod.Spec.Affinity != nil && (pod.Spec.Affinity.PodAffinity != nil || pod.Spec.Affinity.PodAntiAffinity != nil)) {
		return false
	}
	for _, v := range pod.Spec.Volumes {
		if v.PersistentVolumeClaim != nil || v.Ephemeral != nil {
			return false
		}
	}
	for _, c := range pod.Spec.Containers {
		for _, port := range c.Ports {
			if port.HostPort != 0 {
				return false
			}
		}
	}
	return true
}

// consolidate is PostFilter's last resort before preemption: it plans
// moving pods that opted in so that the pod fits one of the nodes that
// refused it (placement.Consolidator, on copies of the ledgers), evicts
// them through the Eviction API, and returns the node to nominate, or ""
// with why not.
func (p *Plugin) consolidate(ctx context.Context, pod *corev1.Pod, c *cycle, refused []fwk.NodeInfo) (string, string) {
	budget := p.args.MaxMoves()
	if budget == 0 || p.handle == nil {
		return "", "consolidation is off"
	}
	all, err := p.handle.SnapshotSharedLister().NodeInfos().List()
	if err != nil {
		return "", err.Error()
	}
	prio := corev1helpers.PodPriority(pod)
	pods := map[string]*corev1.Pod{}
	var going []types.UID
	for _, info := range all {
		for _, pi := range info.GetPods() {
			switch q := pi.GetPod(); {
			case q.DeletionTimestamp != nil:
				going = append(going, q.UID)
			case movable(q, prio):
				pods[string(q.UID)] = q
			}
		}
	}
	switch {
	case len(pods) == 0:
		// Most clusters: nothing opted in, and no plan to weigh.
		return "", fmt.Sprintf("no running pod labelled %s=%s may move for it", api.LabelPreemptibility, api.Preemptible)
	case len(refused) == 0:
		return "", "no node refused it for GPU room alone, which moving pods could make"
	}
	plan, names, ok := p.cache.planConsolidation(c, all, refused, going, budget, pods)
	if !ok {
		return "", fmt.Sprintf("no node fits it by moving at most %d pods labelled %s=%s", budget, api.LabelPreemptibility, api.Preemptible)
	}
	logger := klog.FromContext(ctx)
	evict := func(q *corev1.Pod, dryRun []string) error {
		// The UID precondition: never a replacement of the same name.
		ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: q.Name, Namespace: q.Namespace},
			DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &q.UID}, DryRun: dryRun}}
		return p.handle.ClientSet().PolicyV1().Evictions(q.Namespace).Evict(ctx, ev)
	}
	// Every eviction is tried dry first (a disruption budget refuses it
	// then too), so that a plan that cannot be carried out moves nobody.
	for _, m := range plan.Moves {
		if q := pods[m.Tenant]; evict(q, []string{metav1.DryRunAll}) != nil {
			return "", fmt.Sprintf("consolidation would need to evict %s/%s, which its disruption budget or the API refuses now", q.Namespace, q.Name)
		}
	}
	var moved []string
	for _, m := range plan.Moves {
		q := pods[m.Tenant]
		if err := evict(q, nil); err != nil {
			// A disruption budget, most likely: the pods moved so far are
			// made again by their controllers; this pod tries again later.
			logger.Info("Consolidation could not evict a pod", "pod", klog.KObj(pod), "node", names[plan.Node], "evicting", klog.KObj(q), "err", err)
			return "", fmt.Sprintf("consolidation could not evict %s/%s: %v", q.Namespace, q.Name, err)
		}
		moved = append(moved, q.Namespace+"/"+q.Name+" (to room on "+names[m.To]+")")
	}
	logger.V(2).Info("Consolidation moved pods to make room", "pod", klog.KObj(pod), "node", names[plan.Node], "moved", moved)
	if p.handle.EventRecorder() != nil {
		p.handle.EventRecorder().Eventf(pod, nil, corev1.EventTypeNormal, "Consolidating", "Scheduling",
			"Moving %d pod(s) to make room on node %s: %s", len(moved), names[plan.Node], strings.Join(moved, ", "))
	}
	return names[plan.Node], ""
}

// askOfPod is what PreFilter would ask for a pod made again from pod's
// spec: its GPUs, and the GPU memory its quota was charged (claims aside:
// a pod with claims never moves).
func askOfPod(pod *corev1.Pod) (Ask, bool) {
	ask := Ask{UID: pod.UID, Whole: api.WholeGPUs(&pod.Spec)}
	ask.CPU, ask.MemoryMiB, ask.DeviceGPUs = podRequests(pod)
	reqs, err := api.Parse(api.Intent(pod))
	if err != nil {
		return Ask{}, false
	}
	if len(reqs) > 0 {
		ask.Whole, ask.Fraction = 0, &reqs[0]
	}
	ask.ChargeMiB, ask.Charged = api.ShareBudgetMiB(&pod.Spec, 0)
	return ask, ask.GPU()
}

// mayRunOn says whether a pod made again from pod's spec could run on the
// node: its node selector and required affinity, the node's NoSchedule
// and NoExecute taints, and the host's CPU and memory, after the pods
// the plan moves there before it.
func mayRunOn(pod *corev1.Pod, info fwk.NodeInfo, before []*corev1.Pod) bool {
	node := info.Node()
	if ok, err := nodeaffinity.GetRequiredNodeAffinity(pod).Match(node); err != nil || !ok {
		return false
	}
	if _, untolerated := corev1helpers.FindMatchingUntoleratedTaint(klog.Background(), node.Spec.Taints, pod.Spec.Tolerations, func(t *corev1.Taint) bool {
		return t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute
	}, false); untolerated {
		return false
	}
	alloc, used := info.GetAllocatable(), info.GetRequested()
	cpu, mem := used.GetMilliCPU(), used.GetMemory()
	for _, q := range append(before, pod) {
		if q.Spec.NodeName == node.Name {
			continue // moved within its node: already counted there
		}
		req := resourcehelper.PodRequests(q, resourcehelper.PodResourcesOptions{})
		cpu, mem = cpu+req.Cpu().MilliValue(), mem+req.Memory().Value()
	}
	return cpu <= alloc.GetMilliCPU() && mem <= alloc.GetMemory()
}

// planConsolidation plans on copies of the ledgers of every node the
// snapshot holds (pods being deleted counted gone, as their room is
// coming), for targets among the nodes that refused the pod. It returns
// the plan and the nodes' names (the plan's indices).
func (c *Cache) planConsolidation(cy *cycle, all, refused []fwk.NodeInfo, going []types.UID, budget int, movable map[string]*corev1.Pod) (placement.Plan, []string, bool) {
	canMove := func(tenant string) bool { return movable[tenant] != nil }
	c.mu.RLock()
	defer c.mu.RUnlock()
	var ledgers []*gpu.Node
	var states []*nodeState
	var names []string
	var infos []fwk.NodeInfo
	for _, info := range all {
		ns, ok := c.nodes[info.Node().Name]
		if !ok || ns.Ledger == nil {
			continue
		}
		l := ns.Ledger.Clone()
		for _, uid := range going {
			_ = l.Release(string(uid)) // a tenant of another node, or none: nothing here
		}
		ledgers, states, names, infos = append(ledgers, l), append(states, ns), append(names, info.Node().Name), append(infos, info)
	}
	targets := map[string]bool{}
	for _, info := range refused {
		targets[info.Node().Name] = true
	}
	cons := placement.Consolidator{
		Policy:   cy.policy,
		MaxMoves: budget,
		Movable:  func(_ int, tenant string) bool { return canMove(tenant) },
		// A GPU its shares leave is held by their group's idle
		// reservation pod, which PostFilter's reclaim deletes for a
		// whole-GPU pod on the next try.
		Emptied: func(i int, l *gpu.Node) { reclaimIdle(states[i], l) },
		On: func(i int, _ gpu.Request) (gpu.Request, bool) {
			if !targets[names[i]] {
				return gpu.Request{}, false
			}
			r, _, err := c.request(states[i], cy.ask)
			return r, err == nil
		},
		// A moved pod is made again from the same spec: it goes only where
		// that spec may run, with its host's CPU and memory to spare, its
		// share sized on that node's GPUs.
		MoveTo: func(tenant string, i int, moved []string, _ gpu.Request) (gpu.Request, bool) {
			pod := movable[tenant]
			if pod == nil {
				return gpu.Request{}, false
			}
			before := make([]*corev1.Pod, 0, len(moved))
			for _, t := range moved {
				before = append(before, movable[t])
			}
			ask, ok := askOfPod(pod)
			// Filter's own verdict on the node as it stands (ready, its
			// agent alive, its books clean, the share within the pod's
			// quota charge, room on the ledger), then the host.
			if !ok || !c.filter(states[i], true, ask, nil).Fits || !mayRunOn(pod, infos[i], before) {
				return gpu.Request{}, false
			}
			r, _, err := c.request(states[i], ask)
			return r, err == nil
		},
	}
	plan, ok := cons.Plan(ledgers, gpu.Request{Tenant: string(cy.ask.UID)})
	if ok && slices.ContainsFunc(plan.Moves, func(m placement.Move) bool { return !canMove(m.Tenant) }) {
		return placement.Plan{}, nil, false // the planner moves only what Movable allows; kept as a guard
	}
	return plan, names, ok
}
