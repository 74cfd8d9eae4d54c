//go:build nodee2e

package node

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Two tenants of one GPU each use 8 GiB, 4 GiB above their request, and a
// host process takes all but 2 GiB of the rest: the GPU is short of
// memory (below 5% free). The node agent stops the lower-priority one,
// with an event naming the pressure and the order; its memory back, the
// GPU has room again, and the other keeps running.
func TestBurstReclaimStopsTheLowerPriorityFirst(t *testing.T) {
	ctx := context.Background()
	classes := map[string]int32{"gpufrac-e2e-burst-low": 10, "gpufrac-e2e-burst-high": 1000}
	for name, value := range classes {
		pc := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Value: value}
		if _, err := theNode.admin.SchedulingV1().PriorityClasses().Create(ctx, pc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = theNode.admin.SchedulingV1().PriorityClasses().Delete(ctx, name, metav1.DeleteOptions{}) })
	}
	share := map[string]string{"gpu-memory": "4096", "gpu-memory.limit": "16Gi"}
	at := func(class string) func(*corev1.Pod) { return func(p *corev1.Pod) { p.Spec.PriorityClassName = class } }
	// The high one first: the low one packs beside it.
	createPodWith(t, "burst-high", share, at("gpufrac-e2e-burst-high"), probe("main", nil))
	high := running(t, "burst-high")
	createPodWith(t, "burst-low", share, at("gpufrac-e2e-burst-low"), probe("main", nil))
	low := running(t, "burst-low")
	gpu := assignment(t, high, "main").Devices[0]
	if other := assignment(t, low, "main").Devices[0]; other != gpu {
		t.Fatalf("burst-low on %s and burst-high on %s: the test needs them on one GPU", other, gpu)
	}
	var totalMiB int64
	for _, g := range theNode.gpus {
		if g.UUID == gpu {
			totalMiB = g.MemoryMiB
		}
	}
	const tenantMiB, freeMiB = 8192, 2048
	lines := []string{
		fmt.Sprintf("%s %d %d 50 compute", gpu, containerPID(t, high, "main"), int64(tenantMiB)<<20),
		fmt.Sprintf("%s %d %d 50 compute", gpu, containerPID(t, low, "main"), int64(tenantMiB)<<20),
		fmt.Sprintf("%s %d %d 0 compute", gpu, os.Getpid(), (totalMiB-2*tenantMiB-freeMiB)<<20),
	}
	processes := filepath.Join(theNode.nvmlDir(), "processes")
	if err := os.WriteFile(processes, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(processes) })

	var event corev1.Event
	err := waitFor("burst-low reclaimed", 60*time.Second, func() (bool, error) {
		events, err := theNode.admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=GPUMemoryReclaimed"})
		if err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.InvolvedObject.UID == low.UID {
				event = e
			}
			if e.InvolvedObject.UID == high.UID {
				return false, fmt.Errorf("burst-high (priority 1000) was reclaimed: %s", e.Message)
			}
		}
		return event.Message != "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"GPU " + gpu + " has 2Gi free", "below 5%", "order: " + ns + "/burst-low (priority 10, 4Gi above its request); " + ns + "/burst-high (priority 1000, 4Gi above its request)"} {
		if !strings.Contains(event.Message, want) {
			t.Errorf("event %q does not say %q", event.Message, want)
		}
	}
	if err := waitFor("burst-low gone", 60*time.Second, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(ns).Get(ctx, "burst-low", metav1.GetOptions{})
		return apierrors.IsNotFound(err) || (err == nil && p.UID != low.UID), nil
	}); err != nil {
		t.Fatal(err)
	}
	// Five resyncs with the GPU at 10 GiB free: burst-high runs on.
	time.Sleep(10 * time.Second)
	p := getPod(t, "burst-high")
	if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
		t.Fatalf("burst-high stopped too (phase %s, deleting %v) once the GPU had room again", p.Status.Phase, p.DeletionTimestamp != nil)
	}
}
