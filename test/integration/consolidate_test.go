package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/internal/testenv"
	"github.com/gpufrac/gpufrac/pkg/api"
)

// startReplicaSetController runs kube-controller-manager's ReplicaSet
// controller (built from source into bin/kube) against the test's API
// server until the test ends: consolidation's moved pods are made again
// by their controller, the real one.
func startReplicaSetController(t *testing.T) {
	t.Helper()
	kubeDir, err := checkout.KubeBinaries()
	if err != nil {
		t.Fatal(err)
	}
	kc, err := testenv.KubeConfig(shared.env, "replicaset-controller", "system:masters")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "kubeconfig"), kc, 0o600); err != nil {
		t.Fatal(err)
	}
	port, err := localcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "controller-manager.log"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, filepath.Join(kubeDir, "kube-controller-manager"), //nolint:gosec // the repository's own build of kube-controller-manager
		"--kubeconfig", filepath.Join(dir, "kubeconfig"), "--controllers", "replicaset-controller",
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(port), "--cert-dir", dir)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		_ = log.Close()
		if t.Failed() {
			if b, err := os.ReadFile(log.Name()); err == nil && len(b) > 4000 {
				t.Logf("kube-controller-manager log (tail):\n%s", b[len(b)-4000:])
			}
		}
	})
}

// podsOf are the namespace's pods whose name starts with prefix.
func podsOf(t *testing.T, ns, prefix string) []corev1.Pod {
	t.Helper()
	list, err := shared.admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return slices.DeleteFunc(list.Items, func(p corev1.Pod) bool { return len(p.Name) < len(prefix) || p.Name[:len(prefix)] != prefix })
}

// TestConsolidationMovesOnlyOptedInPods: a whole-GPU pod waits because
// each of the node's two GPUs holds a share. One share's pod opted in to
// being moved and has a ReplicaSet; the other opted in too but is a bare
// pod (evicted, it would be lost), so it must stay. Consolidation evicts
// the first, its ReplicaSet makes it again beside the second, and the
// whole-GPU pod gets the GPU it left; the books stay clean throughout.
func TestConsolidationMovesOnlyOptedInPods(t *testing.T) {
	e := schedulerEnv(t)
	e.startScheduler(t, testScheduler, nil)
	startReplicaSetController(t)
	ns := namespace(t, "sched-consolidate")
	gpuNode(t, "consolidate-0", "consolidate", 2, 81920, true)
	cleanUp(t, ns, "consolidate-0")
	optIn := map[string]string{api.LabelPreemptibility: api.Preemptible}
	zero := int64(0)

	// GPU A: a 0.75 share, gone later; GPU B: the mover's half.
	temp := workload(ns, "temp", testScheduler, "consolidate", map[string]string{"gpu-fraction": "0.75"})
	temp.Spec.TerminationGracePeriodSeconds = &zero
	create(t, temp)
	gpuA := devices(placed(t, ns, "temp"))[0]
	tmpl := workload(ns, "", testScheduler, "consolidate", map[string]string{"gpu-fraction": "0.5"})
	tmpl.Labels = map[string]string{"app": "mover", api.LabelPreemptibility: api.Preemptible}
	tmpl.Spec.TerminationGracePeriodSeconds = &zero
	one := int32(1)
	rs := &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: "mover", Namespace: ns},
		Spec: appsv1.ReplicaSetSpec{Replicas: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "mover"}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: tmpl.Labels, Annotations: tmpl.Annotations}, Spec: tmpl.Spec}},
	}
	if _, err := shared.admin.AppsV1().ReplicaSets(ns).Create(context.Background(), rs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var first corev1.Pod
	if err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		pods := podsOf(t, ns, "mover-")
		if len(pods) == 1 && pods[0].Spec.NodeName != "" {
			first = pods[0]
			return true, nil
		}
		return false, nil
	}); err != nil {
		t.Fatalf("the ReplicaSet's pod was not made and placed: %v", err)
	}
	gpuB := devices(placed(t, ns, first.Name))[0]
	if gpuB == gpuA {
		t.Fatalf("setup: the mover shares GPU %s with the 0.75 share", gpuA)
	}
	// A bare pod that opted in: no controller would make it again.
	pinned := workload(ns, "pinned", testScheduler, "consolidate", map[string]string{"gpu-fraction": "0.25"})
	pinned.Labels = optIn
	pinned.Spec.TerminationGracePeriodSeconds = &zero
	create(t, pinned)
	pinnedPod := placed(t, ns, "pinned")
	if got := devices(pinnedPod)[0]; got != gpuA {
		t.Fatalf("setup: the bare share went to %s, want %s (the tightest)", got, gpuA)
	}
	if err := shared.admin.CoreV1().Pods(ns).Delete(context.Background(), "temp", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, ns, "temp")
	e.audit(t, "consolidate")

	create(t, wholeGPUPod(ns, "whole", testScheduler, "consolidate", 1))
	waitGone(t, ns, first.Name)
	placed(t, ns, "whole")
	var again corev1.Pod
	if err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		pods := podsOf(t, ns, "mover-")
		if len(pods) == 1 && pods[0].UID != first.UID && pods[0].Spec.NodeName != "" {
			again = pods[0]
			return true, nil
		}
		return false, nil
	}); err != nil {
		t.Fatalf("the moved pod was not made again and placed: %v", err)
	}
	if got := devices(placed(t, ns, again.Name))[0]; got != gpuA {
		t.Errorf("the moved share landed on %s, want %s, beside the bare one", got, gpuA)
	}
	now, err := shared.admin.CoreV1().Pods(ns).Get(context.Background(), "pinned", metav1.GetOptions{})
	if err != nil || now.UID != pinnedPod.UID || now.DeletionTimestamp != nil {
		t.Errorf("the bare pod was moved or deleted: %v %v", err, now)
	}
	e.audit(t, "consolidate")
}
