package integration

import (
	"context"
	"fmt"
	"math/rand"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// testScheduler is the name the scenarios' scheduler answers to: not the
// webhook's default (gpufrac), so that pods other tests leave pending are
// not placed on the scenarios' nodes.
const testScheduler = "gpufrac-test"

func fraction(f string) map[string]string { return map[string]string{api.KeyFraction: f} }

// cleanUp deletes a scenario's pods and its nodes' reservation pods, so
// that the next scenario audits a clean cluster.
func cleanUp(t *testing.T, ns string, nodes ...string) {
	t.Cleanup(func() {
		ctx := context.Background()
		now := metav1.DeleteOptions{GracePeriodSeconds: new(int64)}
		_ = shared.admin.CoreV1().Pods(ns).DeleteCollection(ctx, now, metav1.ListOptions{})
		for _, r := range reservationPods(t, nodes...) {
			_ = shared.admin.CoreV1().Pods(r.Namespace).Delete(ctx, r.Name, now)
		}
	})
}

func wholeGPUPod(ns, name, testScheduler, scenario string, n int64) *corev1.Pod {
	p := workload(ns, name, testScheduler, scenario, nil)
	q := *resource.NewQuantity(n, resource.DecimalSI)
	p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: q}
	return p
}

// pending asserts that a pod stays unscheduled and returns the message
// of its FailedScheduling event.
func pending(t *testing.T, ns, name string) string {
	t.Helper()
	var msg string
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		pod, err := shared.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if pod.Spec.NodeName != "" {
			return false, fmt.Errorf("pod %s was bound to %s", name, pod.Spec.NodeName)
		}
		events, err := shared.admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.name", name).String()})
		if err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.Reason == "FailedScheduling" {
				msg = e.Message
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s: want Pending with a FailedScheduling event: %v", ns, name, err)
	}
	return msg
}

// Two halves share one GPU and one reservation pod; a third half opens
// the second GPU. A GPU whose last tenant went keeps its reservation pod
// for the next share, which joins it (no new reservation pod); a pod that
// asks for the GPU whole gets it: the scheduler deletes the idle
// reservation pod and places the pod once it is gone.
func TestSchedulerPacksFractionsAndGivesIdleGPUsBack(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-pack")
	gpuNode(t, "pack-0", "pack", 2, 81920, true)
	cleanUp(t, ns, "pack-0")

	var pods []*corev1.Pod
	for i := range 3 {
		create(t, workload(ns, fmt.Sprintf("half-%d", i), testScheduler, "pack", fraction("0.5")))
		pods = append(pods, placed(t, ns, fmt.Sprintf("half-%d", i)))
	}
	d0, d1, d2 := devices(pods[0]), devices(pods[1]), devices(pods[2])
	if len(d0) != 1 || !slices.Equal(d0, d1) || slices.Equal(d0, d2) || len(d2) != 1 {
		t.Fatalf("devices: %v %v %v; want the first two on one GPU and the third on another", d0, d1, d2)
	}
	for _, p := range pods {
		a := p.Annotations
		if a[api.ContainerKey("main", api.SuffixMemoryRequest)] != "40960Mi" || a[api.ContainerKey("main", api.SuffixMemoryLimit)] != "40960Mi" ||
			a[api.ContainerKey("main", api.SuffixComputeMode)] != string(api.TimeSlicing) || a[api.GPUGroupsAnnotation] == "" {
			t.Errorf("pod %s decision annotations: %v", p.Name, a)
		}
		if _, ok := a[api.ContainerKey("main", api.SuffixComputePortion)]; ok {
			t.Errorf("pod %s: time-slicing pod got a compute portion", p.Name)
		}
	}
	if r := reservationPods(t, "pack-0"); len(r) != 2 {
		t.Fatalf("%d reservation pods on pack-0, want 2 (one per shared GPU)", len(r))
	}
	e.audit(t, "pack")
	for _, n := range e.top(t).Nodes {
		if n.Name != "pack-0" {
			continue
		}
		if len(n.Shared) != 2 || n.Idle != 0 || n.Shared[0].FreeMiB+n.Shared[1].FreeMiB != 40960 {
			t.Fatalf("gpufrac top shows pack-0 as %+v", n)
		}
	}

	del := func(name string) {
		if err := shared.admin.CoreV1().Pods(ns).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatal(err)
		}
	}
	uids := func() []string {
		var out []string
		for _, r := range reservationPods(t, "pack-0") {
			out = append(out, string(r.UID))
		}
		slices.Sort(out)
		return out
	}
	before := uids()
	del("half-2")
	waitGone(t, ns, "half-2")
	create(t, workload(ns, "half-3", testScheduler, "pack", fraction("0.5")))
	if d3 := devices(placed(t, ns, "half-3")); !slices.Equal(d3, d2) {
		t.Errorf("half-3 got %v, want the GPU half-2 left (%v), whose reservation pod was kept", d3, d2)
	}
	if after := uids(); !slices.Equal(after, before) {
		t.Errorf("reservation pods on pack-0 after half-3: %v, want the same two as before (%v): half-3 joins the kept one", after, before)
	}
	del("half-0")
	del("half-3")
	waitGone(t, ns, "half-0", "half-3")
	if r := reservationPods(t, "pack-0"); len(r) != 2 {
		t.Fatalf("%d reservation pods on pack-0 with one GPU idle, want 2: the idle one is kept", len(r))
	}
	e.audit(t, "pack")
	create(t, wholeGPUPod(ns, "whole-1", testScheduler, "pack", 1))
	placed(t, ns, "whole-1")
	if r := reservationPods(t, "pack-0"); len(r) != 1 || r[0].Annotations[api.ReservedGPUAnnotation] != d1[0] {
		t.Fatalf("reservation pods left on pack-0: %d, want only half-1's (GPU %s)", len(r), d1[0])
	}
	del("half-1")
	waitGone(t, ns, "half-1")
	create(t, wholeGPUPod(ns, "whole-2", testScheduler, "pack", 1))
	placed(t, ns, "whole-2")
	waitReservations(t, 0, "pack-0")
	e.audit(t, "pack")
}

// waitGone waits until the pods are deleted.
func waitGone(t testing.TB, ns string, names ...string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		for _, n := range names {
			if _, err := shared.admin.CoreV1().Pods(ns).Get(ctx, n, metav1.GetOptions{}); err == nil {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("pods %v still there", names)
	}
}

// A share costs the API server what a whole-GPU pod does, its Binding,
// whether it opens a GPU (plus that GPU's reservation pod, once) or joins
// one: kube-scheduler never writes its node into its status first
// (nominatedNodeName). The one that does get it: a pod already reported
// unschedulable that waits for its GPU's reservation pod, for the sake of
// autoscalers, which act on such pods; it also shows that the watch sees
// the write it checks for.
func TestSchedulerBindsAShareInOneWrite(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-onewrite")
	cleanUp(t, ns, "onewrite-0")
	list, err := shared.admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w, err := shared.admin.CoreV1().Pods(ns).Watch(context.Background(), metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	// No node yet: the first share is reported unschedulable.
	create(t, workload(ns, "waited", testScheduler, "onewrite", fraction("0.25")))
	pending(t, ns, "waited")
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		pod, err := shared.admin.CoreV1().Pods(ns).Get(ctx, "waited", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range pod.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Reason == corev1.PodReasonUnschedulable {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("pod waited is not marked unschedulable: %v", err)
	}
	gpuNode(t, "onewrite-0", "onewrite", 2, 81920, true)
	placed(t, ns, "waited")
	create(t, workload(ns, "open", testScheduler, "onewrite", fraction("0.8"))) // too big for the first GPU
	placed(t, ns, "open")
	create(t, workload(ns, "join", testScheduler, "onewrite", fraction("0.1")))
	placed(t, ns, "join")
	names := []string{"waited", "open", "join"}
	nominated := map[string]bool{}
	bound := map[string]bool{}
	timeout := time.After(30 * time.Second)
	for len(bound) < len(names) {
		select {
		case ev := <-w.ResultChan():
			pod, ok := ev.Object.(*corev1.Pod)
			if !ok {
				t.Fatalf("watch: %v", ev.Object)
			}
			if pod.Spec.NodeName == "" && pod.Status.NominatedNodeName != "" {
				nominated[pod.Name] = true
			}
			if pod.Spec.NodeName != "" {
				bound[pod.Name] = true
			}
		case <-timeout:
			t.Fatalf("the watch did not show every pod bound: %v", bound)
		}
	}
	if !nominated["waited"] {
		t.Error("the share reported unschedulable was bound without kube-scheduler nominating it first while its reservation pod came up: autoscalers see it pending, and this test no longer sees the write it checks for")
	}
	for _, name := range names[1:] {
		if nominated[name] {
			t.Errorf("share %s had its node written into its status before its Binding: one write more than a whole-GPU pod", name)
		}
	}
	waited, open, join := devices(placed(t, ns, "waited")), devices(placed(t, ns, "open")), devices(placed(t, ns, "join"))
	if len(waited) != 1 || len(open) != 1 || slices.Equal(waited, open) || !slices.Equal(join, waited) && !slices.Equal(join, open) {
		t.Errorf("devices %v, %v and %v: want the first two on different GPUs and the third joining one of them", waited, open, join)
	}
	if got := len(reservationPods(t, "onewrite-0")); got != 2 {
		t.Errorf("%d reservation pods on the node, want 2: one per shared GPU", got)
	}
}

func waitReservations(t testing.TB, want int, nodes ...string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return len(reservationPods(t, nodes...)) == want, nil
	})
	if err != nil {
		t.Fatalf("reservation pods on %v: %d, want %d", nodes, len(reservationPods(t, nodes...)), want)
	}
}

// With the spread policy two halves take a GPU each.
func TestSchedulerSpreadPolicy(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, "gpufrac-spread", map[string]any{"policy": "spread"})
	ns := namespace(t, "sched-spread")
	gpuNode(t, "spread-0", "spread", 2, 81920, true)
	cleanUp(t, ns, "spread-0")
	var got [][]string
	for i := range 3 {
		create(t, workload(ns, fmt.Sprintf("half-%d", i), "gpufrac-spread", "spread", fraction("0.5")))
		got = append(got, devices(placed(t, ns, fmt.Sprintf("half-%d", i))))
	}
	if slices.Equal(got[0], got[1]) || (!slices.Equal(got[2], got[0]) && !slices.Equal(got[2], got[1])) {
		t.Fatalf("devices %v: want the first two on different GPUs and the third sharing one", got)
	}
	e.audit(t, "spread")
}

// time-slicing and sm-sharing share a node but never a GPU; sm-sharing
// pods get a compute portion and share with each other.
func TestSchedulerKeepsComputeModesApart(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-modes")
	gpuNode(t, "modes-0", "modes", 2, 81920, true)
	cleanUp(t, ns, "modes-0")
	sm := func(f string) map[string]string {
		return map[string]string{api.KeyFraction: f, api.KeyComputeSharingMode: string(api.SMSharing)}
	}
	create(t, workload(ns, "ts", testScheduler, "modes", fraction("0.25")))
	ts := placed(t, ns, "ts")
	create(t, workload(ns, "sm-1", testScheduler, "modes", sm("0.25")))
	sm1 := placed(t, ns, "sm-1")
	create(t, workload(ns, "sm-2", testScheduler, "modes", sm("0.5")))
	sm2 := placed(t, ns, "sm-2")
	if ts.Spec.NodeName != sm1.Spec.NodeName || slices.Equal(devices(ts), devices(sm1)) || slices.Equal(devices(ts), devices(sm2)) {
		t.Fatalf("time-slicing on %v, sm-sharing on %v and %v: want one node, different GPUs", devices(ts), devices(sm1), devices(sm2))
	}
	if p := sm1.Annotations[api.ContainerKey("main", api.SuffixComputePortion)]; p != "0.25" {
		t.Errorf("sm-1 compute portion %q, want 0.25", p)
	}
	if p := sm2.Annotations[api.ContainerKey("main", api.SuffixComputePortion)]; p != "0.5" {
		t.Errorf("sm-2 compute portion %q, want 0.5", p)
	}
	e.audit(t, "modes")
}

// gpu-fraction-num-devices: 2 lands on two distinct GPUs of one node, each
// held by its own reservation pod.
func TestSchedulerMultiDevice(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-multi")
	gpuNode(t, "multi-0", "multi", 4, 81920, true)
	cleanUp(t, ns, "multi-0")
	create(t, workload(ns, "two", testScheduler, "multi", map[string]string{api.KeyFraction: "0.5", api.KeyNumDevices: "2"}))
	pod := placed(t, ns, "two")
	d := devices(pod)
	if len(d) != 2 || d[0] == d[1] {
		t.Fatalf("devices %v: want two distinct GPUs", d)
	}
	if groups := api.SplitList(pod.Annotations[api.GPUGroupsAnnotation]); len(groups) != 2 {
		t.Fatalf("GPU groups %v, want two", groups)
	}
	if r := reservationPods(t, "multi-0"); len(r) != 2 {
		t.Fatalf("%d reservation pods, want 2", len(r))
	}
	e.audit(t, "multi")
}

// A request no GPU can take stays Pending, and the event says why, per
// kind of node.
func TestSchedulerExplainsUnschedulable(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-why")
	gpuNode(t, "why-small-0", "why", 1, 16384, true)
	gpuNode(t, "why-small-1", "why", 1, 16384, true)
	gpuNode(t, "why-cold-0", "why", 1, 81920, false)
	cleanUp(t, ns, "why-small-0", "why-small-1", "why-cold-0")
	create(t, workload(ns, "big", testScheduler, "why", map[string]string{api.KeyMemory: "30000"}))
	msg := pending(t, ns, "big")
	for _, want := range []string{
		"0/", "2 NotEnoughGPUMemory: fewer than 1 GPU(s) with 30000Mi of memory free",
		"1 node does not report the condition gpu-fractioning.nvidia.com/Ready",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("FailedScheduling message %q lacks %q", msg, want)
		}
	}
	e.audit(t, "why")
}

// A whole-GPU pod never gets a shared GPU, and fractions never land on a
// whole-GPU pod's GPU.
func TestSchedulerWholeGPUsAndFractionsNeverShare(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-whole")
	gpuNode(t, "whole-0", "whole", 2, 81920, true)
	cleanUp(t, ns, "whole-0")
	create(t, workload(ns, "half", testScheduler, "whole", fraction("0.5")))
	placed(t, ns, "half")
	create(t, wholeGPUPod(ns, "whole-1", testScheduler, "whole", 1))
	placed(t, ns, "whole-1")
	create(t, workload(ns, "big-share", testScheduler, "whole", fraction("0.6")))
	if msg := pending(t, ns, "big-share"); !strings.Contains(msg, "NotEnoughGPUMemory") {
		t.Errorf("big-share: %s", msg)
	}
	create(t, wholeGPUPod(ns, "whole-2", testScheduler, "whole", 1))
	if msg := pending(t, ns, "whole-2"); !strings.Contains(msg, "nvidia.com/gpu") && !strings.Contains(msg, "NotEnoughIdleGPUs") {
		t.Errorf("whole-2: %s", msg)
	}
	e.audit(t, "whole")
}

// Kill the scheduler during a burst of 300 fractional pods and start it
// again: it rebuilds every GPU's tenants from the API, every pod binds
// once, and the audit is clean.
func TestSchedulerRestartDuringBurst(t *testing.T) {
	e := schedulerEnv(t)
	first := e.startScheduler(t, testScheduler, nil)
	ns := namespace(t, "sched-burst")
	var nodes []string
	for i := range 30 {
		nodes = append(nodes, fmt.Sprintf("burst-%02d", i))
		gpuNode(t, nodes[i], "burst", 8, 81920, true)
	}
	cleanUp(t, ns, nodes...)
	rng := rand.New(rand.NewSource(7))
	shapes := []map[string]string{
		fraction("0.1"), fraction("0.25"), fraction("0.5"), fraction("0.3"), fraction("0.75"),
		{api.KeyMemory: "20000"},
		{api.KeyFraction: "0.25", api.KeyComputeSharingMode: string(api.SMSharing)},
		{api.KeyFraction: "0.5", api.KeyComputeSharingMode: string(api.SMSharing)},
		{api.KeyFraction: "0.2", api.KeyNumDevices: "2"},
	}
	const total = 300
	names := make([]string, total)
	work := make(chan *corev1.Pod)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for p := range work {
				create(t, p)
			}
		})
	}
	for i := range total {
		names[i] = fmt.Sprintf("burst-%03d", i)
		work <- workload(ns, names[i], testScheduler, "burst", shapes[rng.Intn(len(shapes))])
		if i == total/3 {
			// Let the scheduler get well into the burst, then kill it.
			waitBound(t, ns, 50)
			first.kill()
		}
	}
	close(work)
	wg.Wait()
	e.startScheduler(t, testScheduler, nil)
	waitBound(t, ns, total)
	list, err := shared.admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	groups := map[string]bool{}
	for _, p := range list.Items {
		if len(devices(&p)) == 0 {
			t.Errorf("pod %s bound without devices", p.Name)
		}
		for _, g := range api.SplitList(p.Annotations[api.GPUGroupsAnnotation]) {
			groups[p.Spec.NodeName+"/"+g] = true
		}
	}
	// Reservation pods of binds the kill interrupted are collected.
	waitReservations(t, len(groups), nodes...)
	e.audit(t, "burst")
}

// waitBound waits until at least n pods of the namespace are bound.
func waitBound(t *testing.T, ns string, n int) {
	t.Helper()
	bound := 0
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := shared.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		bound = 0
		for _, p := range list.Items {
			if p.Spec.NodeName != "" {
				bound++
			}
		}
		return bound >= n, nil
	})
	if err != nil {
		t.Fatalf("%d pods bound in %s, want %d", bound, ns, n)
	}
}
