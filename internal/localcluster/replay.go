package localcluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/sim"
)

// ReplayNamespace holds the pods of a live replay.
const ReplayNamespace = "replay"

// replayGate holds every pod of a replay until its turn.
const replayGate = "gpufrac.io/replay"

// replayScheduler is the profile of deploy/scheduler/config.yaml.
const replayScheduler = "gpufrac"

// replayImage is what a replayed pod runs: KWOK runs nothing anyway.
const replayImage = "registry.k8s.io/pause:3.10"

// decideTimeout bounds the wait for the scheduler's decision on one pod.
const decideTimeout = 2 * time.Minute

// Replay gives the cluster's scheduler pods in their given order, one at a
// time, and returns where each went. All of them are created first, held
// by a scheduling gate, so that the scheduler's workload estimate sees the
// whole list (as the simulator's estimate counts every pod of its trace);
// then each is ungated and its decision awaited (bound, or unschedulable)
// before the next, so the scheduler places the very sequence a Given run
// of the simulator places. A pod the scheduler cannot place stays
// pending; since nothing leaves a replay, no later retry can place it.
func (c *Cluster) Replay(ctx context.Context, pods []sim.PodSpec, progress func(done, total int)) ([]sim.Placement, error) {
	client := c.Admin
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ReplayNamespace}}, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create namespace %s: %w", ReplayNamespace, err)
	}
	names := make([]string, len(pods))
	var (
		mu       sync.Mutex
		firstErr error
	)
	Parallel(len(pods), 16, func(i int) {
		pod := replayPod(pods[i])
		names[i] = pod.Name
		if _, err := client.CoreV1().Pods(ReplayNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			mu.Lock()
			firstErr = errors.Join(firstErr, fmt.Errorf("create pod %s: %w", pod.Name, err))
			mu.Unlock()
		}
	})
	if firstErr != nil {
		return nil, firstErr
	}
	// The decisions, as the pods' updates report them.
	decided := map[string]chan *corev1.Pod{}
	for _, n := range names {
		decided[n] = make(chan *corev1.Pod, 1)
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ReplayNamespace))
	informer := factory.Core().V1().Pods().Informer()
	var sent sync.Map
	notify := func(obj any) {
		pod, ok := obj.(*corev1.Pod)
		if !ok || !isDecided(pod) {
			return
		}
		if _, dup := sent.LoadOrStore(pod.Name, true); dup {
			return
		}
		if ch, ok := decided[pod.Name]; ok {
			ch <- pod
		}
	}
	if _, err := informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{AddFunc: notify, UpdateFunc: func(_, obj any) { notify(obj) }}); err != nil {
		return nil, err
	}
	stop := make(chan struct{})
	defer close(stop)
	factory.Start(stop)
	if !toolscache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil, ctx.Err()
	}
	// The scheduler rebuilds its policy from the workload at most once a
	// second: let it see every gated pod first.
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(3 * time.Second):
	}
	ungate := []byte(`{"spec":{"schedulingGates":null}}`)
	placed := make([]sim.Placement, len(pods))
	for i, name := range names {
		if progress != nil && i%25 == 0 {
			progress(i, len(pods))
		}
		if _, err := client.CoreV1().Pods(ReplayNamespace).Patch(ctx, name, types.MergePatchType, ungate, metav1.PatchOptions{}); err != nil {
			return nil, fmt.Errorf("ungate pod %s: %w", name, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(decideTimeout):
			return nil, fmt.Errorf("pod %s (%d of %d): no decision from the scheduler after %s (see %s/logs/scheduler.log)", name, i+1, len(pods), decideTimeout, c.opts.Dir)
		case pod := <-decided[name]:
			if pod.Spec.NodeName != "" {
				placed[i] = sim.Placement{Node: pod.Spec.NodeName, Group: strings.Join(api.DecisionGroups(pod.Annotations), ",")}
			}
		}
	}
	if progress != nil {
		progress(len(pods), len(pods))
	}
	// A pod found unschedulable must still be pending: were one bound by a
	// later retry, the replay would book less than the cluster holds.
	list, err := client.CoreV1().Pods(ReplayNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	bound := map[string]string{}
	for _, p := range list.Items {
		bound[p.Name] = p.Spec.NodeName
	}
	for i, name := range names {
		if placed[i].Node == "" && bound[name] != "" {
			return nil, fmt.Errorf("pod %s (%d of %d) was found unschedulable, then bound to %s by a later retry: the replay no longer matches the cluster", name, i+1, len(pods), bound[name])
		}
	}
	return placed, nil
}

// isDecided says whether the scheduler is done with a replayed pod: bound
// (a fractional pod's decision is written before its binding), or found
// unschedulable.
func isDecided(pod *corev1.Pod) bool {
	if len(pod.Spec.SchedulingGates) > 0 {
		return false
	}
	if pod.Spec.NodeName != "" {
		return true
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}

// replayPod is a trace pod as a user would write it: CPU and memory
// requests, whole GPUs through the device plugin's resource, or a share
// as a gpu-fraction annotation in thousandths (the trace's milli-GPU);
// every one for the gpufrac profile, which places CPU-only pods too.
func replayPod(p sim.PodSpec) *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: podName(p.Name), Namespace: ReplayNamespace, Labels: map[string]string{"app.kubernetes.io/part-of": "gpufrac-replay"}},
		Spec: corev1.PodSpec{
			SchedulerName:   replayScheduler,
			SchedulingGates: []corev1.PodSchedulingGate{{Name: replayGate}},
			Containers: []corev1.Container{{Name: "main", Image: replayImage, Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceCPU:    *resource.NewMilliQuantity(p.CPUMilli, resource.DecimalSI),
				corev1.ResourceMemory: *resource.NewQuantity(p.MemoryMiB<<20, resource.BinarySI),
			}}}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}
	switch {
	case p.Shares():
		pod.Annotations = map[string]string{api.KeyFraction: thousandths(p.GPUMilli)}
	case p.NumGPU > 0:
		n := *resource.NewQuantity(int64(p.NumGPU), resource.DecimalSI)
		pod.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: n}
		pod.Spec.Containers[0].Resources.Requests[api.ResourceGPU] = n
	}
	return pod
}

// thousandths writes 460 as "0.46".
func thousandths(milli int64) string {
	return strings.TrimRight(strings.TrimRight(fmt.Sprintf("0.%03d", milli), "0"), ".")
}

// podName makes a trace pod's name a pod name: lower case, and only
// letters, digits, '-' and '.'.
func podName(name string) string {
	b := []byte(strings.ToLower(name))
	for i, c := range b {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' && c != '.' {
			b[i] = '-'
		}
	}
	return strings.Trim(string(b), "-.")
}

// Parallel runs f(0..n-1) on workers goroutines: for creating many API
// objects at once (a replay's pods, a benchmark's nodes).
func Parallel(n, workers int, f func(int)) {
	work := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range work {
				f(i)
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
}
