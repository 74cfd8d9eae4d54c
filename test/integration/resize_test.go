package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

// A running share is resized in place (SPEC §7) on a `gpufrac up` cluster:
// the real API server, webhook and kube-scheduler with the plugin, KWOK
// as the kubelet and the simulated node agents. The pod grows where its
// GPU has room, waits (Deferred) where it has not until a neighbour goes,
// shrinks, and never moves or restarts; a change of mode is refused; the
// audit agrees with the scheduler throughout.
func TestResizeRunningShare(t *testing.T) {
	// GPUs whose driver sets per-cgroup limits: the only backend that can
	// change a running container's (the mocks' own driver is older).
	dir, done := startUp(t, 1, "--gpus", "dgxh100"+inventory.DriverLimitsSuffix)
	bin := gpufracBinary(t)
	t.Cleanup(func() {
		if out, err := exec.Command(bin, "down", "--dir", dir).CombinedOutput(); err != nil {
			t.Errorf("gpufrac down: %v\n%s", err, out)
		}
		if err := <-done; err != nil {
			t.Errorf("gpufrac up exited with %v", err)
		}
	})
	kubeconfig := filepath.Join(dir, "kubeconfig")
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	pods := client.CoreV1().Pods("default")

	node, err := client.CoreV1().Nodes().Get(ctx, "gpu-node-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	memMiB, _ := api.GPUMemoryMiB(node.Labels)
	reserve, _ := strconv.ParseInt(node.Labels[api.LabelGPUMemoryReserve], 10, 64)
	schedulable := memMiB - reserve

	share := func(name string, annotations map[string]string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations},
			Spec: corev1.PodSpec{SchedulerName: "gpufrac", NodeSelector: map[string]string{"kubernetes.io/hostname": "gpu-node-1"},
				Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
		}
	}
	running := func(name string) *corev1.Pod {
		t.Helper()
		var pod *corev1.Pod
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
			p, err := pods.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			pod = p
			return p.Status.Phase == corev1.PodRunning && api.HasDecision(p.Annotations), nil
		})
		if err != nil {
			t.Fatalf("pod %s is not Running with a GPU decision: %v (%+v)", name, err, pod)
		}
		return pod
	}
	// The tenant: 8Gi on one GPU. The neighbour: a share on every GPU of
	// the node, so on the tenant's too, leaving 12Gi free there.
	if _, err := pods.Create(ctx, share("tenant", map[string]string{api.KeyMemory: "8192"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	first := running("tenant")
	neighbourMiB := schedulable - 8192 - 12288
	created, err := pods.Create(ctx, share("neighbour", map[string]string{api.KeyMemory: strconv.FormatInt(neighbourMiB, 10), api.KeyNumDevices: "8"}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// What a bind costs, to weigh a resize against: the writes to the pod
	// up to and including the one that binds it, and the events about it.
	bindWrites := writesUntil(t, client, "neighbour", created.ResourceVersion, func(p *corev1.Pod) bool { return p.Spec.NodeName != "" })
	running("neighbour")
	bindEvents := schedulerEvents(t, client, "neighbour")
	devices := assignmentOf(t, first).Devices

	annotate := func(kv map[string]any) error {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": kv}})
		_, err := pods.Patch(ctx, "tenant", types.MergePatchType, patch, metav1.PatchOptions{})
		return err
	}
	// until waits for the tenant to satisfy ok, and returns it.
	until := func(what string, ok func(*corev1.Pod) bool) *corev1.Pod {
		t.Helper()
		var pod *corev1.Pod
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			p, err := pods.Get(ctx, "tenant", metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			pod = p
			return ok(p), nil
		})
		if err != nil {
			var log []byte
			for _, f := range []string{"scheduler", "node-agent-gpu-node-1", "webhook"} {
				raw, _ := os.ReadFile(filepath.Join(dir, "logs", f+".log"))
				log = append(log, fmt.Sprintf("--- %s.log (last 4000 bytes)\n", f)...)
				log = append(log, raw[max(0, len(raw)-4000):]...)
			}
			t.Fatalf("%s: %v\nannotations %v\nconditions %+v\n%s", what, err, pod.Annotations, pod.Status.Conditions, log)
		}
		return pod
	}
	resized := func(req, limit int64) func(*corev1.Pod) bool {
		return func(p *corev1.Pod) bool {
			a := assignmentOf(t, p)
			r, err := api.ResizeOf(p.Annotations, a)
			c, _ := api.PodResizeCondition(p, api.ConditionResizeInProgress)
			return err == nil && r.Done() && a.RequestMiB == req && a.LimitMiB == limit &&
				c.Status == corev1.ConditionFalse && c.Reason == api.ReasonResizeDone
		}
	}
	same := func(p *corev1.Pod) {
		t.Helper()
		if p.UID != first.UID || p.Spec.NodeName != first.Spec.NodeName || !equalStrings(assignmentOf(t, p).Devices, devices) {
			t.Errorf("the resized pod moved: %s on %s %v, was %s on %s %v", p.UID, p.Spec.NodeName, assignmentOf(t, p).Devices, first.UID, first.Spec.NodeName, devices)
		}
		if len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].RestartCount != 0 ||
			p.Status.ContainerStatuses[0].ContainerID != first.Status.ContainerStatuses[0].ContainerID {
			t.Errorf("the resized pod's container changed: %+v, was %+v", p.Status.ContainerStatuses, first.Status.ContainerStatuses)
		}
	}
	audit := func(want ...string) {
		t.Helper()
		out, err := exec.Command(bin, "audit", "--kubeconfig", kubeconfig).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "audit: clean") {
			t.Errorf("gpufrac audit: %v\n%s", err, out)
		}
		top, err := exec.Command(bin, "top", "--kubeconfig", kubeconfig).CombinedOutput()
		for _, w := range want {
			if err != nil || !strings.Contains(string(top), w) {
				t.Errorf("gpufrac top lacks %q: %v\n%s", w, err, top)
			}
		}
	}

	// Grow where the GPU has room: granted, applied, same container; at
	// no more API writes than the bind.
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{api.KeyResizeRequest: "16Gi"}}})
	asked, err := pods.Patch(ctx, "tenant", types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		t.Fatalf("resize to 16Gi: %v", err)
	}
	eventsBefore := schedulerEvents(t, client, "tenant")
	resizeWrites := writesUntil(t, client, "tenant", asked.ResourceVersion, resized(16384, 16384))
	same(until("grow to 16Gi", resized(16384, 16384)))
	time.Sleep(2 * time.Second) // nothing more is written after Done
	resizeWrites += writesUntil(t, client, "tenant", until("", resized(16384, 16384)).ResourceVersion, nil)
	resizeEvents := schedulerEvents(t, client, "tenant") - eventsBefore
	t.Logf("API writes: a bind %d to the pod + %d event(s); a resize %d to the pod + %d event(s)", bindWrites, bindEvents, resizeWrites, resizeEvents)
	if resizeWrites+resizeEvents > bindWrites+bindEvents || resizeWrites != 2 {
		t.Errorf("a resize took %d writes to the pod and %d events, a bind %d and %d: want 2 pod writes (the scheduler's, the node's) and no more than a bind",
			resizeWrites, resizeEvents, bindWrites, bindEvents)
	}
	audit("16Gi")

	// Grow beyond what is free: Deferred, with an event, until the
	// neighbour is deleted; then granted.
	if err := annotate(map[string]any{api.KeyResizeRequest: "40Gi"}); err != nil {
		t.Fatalf("resize to 40Gi: %v", err)
	}
	pending := until("grow to 40Gi deferred", func(p *corev1.Pod) bool {
		c, _ := api.PodResizeCondition(p, api.ConditionResizePending)
		return c.Status == corev1.ConditionTrue && c.Reason == api.ReasonResizeDeferred
	})
	if a := assignmentOf(t, pending); a.RequestMiB != 16384 {
		t.Errorf("a deferred grow changed the allocation to %dMi", a.RequestMiB)
	}
	events, err := client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=tenant"})
	if err != nil || !containsReason(events.Items, "GPUResizeDeferred") {
		t.Errorf("no GPUResizeDeferred event on the tenant: %v %+v", err, events)
	}
	audit("16Gi", "resize to 40Gi/40Gi deferred")
	if out, _ := exec.Command(bin, "audit", "--kubeconfig", kubeconfig).CombinedOutput(); !strings.Contains(string(out), "resizing default/tenant on gpu-node-1: resize to 40Gi/40Gi deferred") {
		t.Errorf("gpufrac audit does not show the deferred resize:\n%s", out)
	}
	// What a kubectl user sees.
	kubeDir, err := checkout.KubeBinaries()
	if err != nil {
		t.Fatal(err)
	}
	jsonpath := `{range .status.conditions[?(@.type=="` + api.ConditionResizePending + `")]}{.status} {.reason}: {.message}{end}`
	out, err := exec.Command(filepath.Join(kubeDir, "kubectl"), "--kubeconfig", kubeconfig, "get", "pod", "tenant", "-o", "jsonpath="+jsonpath).CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "True Deferred: main to request 40960Mi, limit 40960Mi on node gpu-node-1 does not fit its GPUs: NotEnoughGPUMemory") {
		t.Errorf("kubectl get pod tenant, its %s condition: %v\n%s", api.ConditionResizePending, err, out)
	}
	if err := pods.Delete(ctx, "neighbour", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	same(until("grow to 40Gi once the neighbour is gone", resized(40960, 40960)))
	audit("40Gi")

	// Shrink: the limit stays unless written too.
	if err := annotate(map[string]any{api.KeyResizeRequest: "4Gi", api.KeyResizeLimit: "6Gi"}); err != nil {
		t.Fatalf("shrink to 4Gi: %v", err)
	}
	same(until("shrink to 4Gi", resized(4096, 6144)))
	audit("4Gi")

	// What admission refuses, each with its reason.
	for _, c := range []struct {
		patch map[string]any
		want  string
	}{
		{map[string]any{api.ContainerKey("main", api.SuffixComputeMode): "sm-sharing"}, "already scheduled"},
		{map[string]any{api.ContainerKey("main", api.SuffixMemoryRequest): "8Gi"}, api.KeyResizeRequest},
		{map[string]any{api.KeyResizeLimit: "2Gi"}, "must be at least " + api.KeyResizeRequest},
		{map[string]any{api.KeyResizeRequest: "8Gi", api.KeyResizeLimit: "4Gi"}, "must be at least"},
		{map[string]any{api.KeyResizeRequest: "lots"}, "quantity"},
		{map[string]any{api.EnforcedAnnotation: "request=1Mi,limit=1Mi"}, "only by a node agent"},
		{map[string]any{api.ResizedFromAnnotation: "request=1Mi,limit=1Mi"}, "only by the scheduler"},
	} {
		err := annotate(c.patch)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%v: refused: %v", c.patch, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%v: got %v, want a refusal saying %q", c.patch, err, c.want)
		}
	}
	// The limit alone (the request's key taken back) lowers the request
	// with it.
	if err := annotate(map[string]any{api.KeyResizeRequest: nil, api.KeyResizeLimit: "2Gi"}); err != nil {
		t.Fatalf("limit 2Gi: %v", err)
	}
	same(until("limit 2Gi", resized(2048, 2048)))
	if _, err := pods.Create(ctx, share("born-resized", map[string]string{api.KeyMemory: "4096", api.KeyResizeRequest: "8Gi"}), metav1.CreateOptions{}); err == nil ||
		!strings.Contains(err.Error(), "cannot be set when a pod is created") {
		t.Errorf("a pod created with a resize key: %v", err)
	}
	audit("2Gi")

	// Where a quota bounds GPU memory, a share grows only within what its
	// pod was charged when it was created (the quota counted that).
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "team"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rq := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "gpu-memory"},
		Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{"requests." + api.ResourceGPUMemory: resource.MustParse("100Gi")}}}
	if _, err := client.CoreV1().ResourceQuotas("team").Create(ctx, rq, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	teamPod := share("budgeted", map[string]string{api.KeyMemory: "4096", api.KeyMemoryLimit: "8Gi"})
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().Pods("team").Create(ctx, teamPod, metav1.CreateOptions{})
		return err == nil, nil // until the quota controller has counted the namespace
	})
	if err != nil {
		t.Fatal(err)
	}
	teamPatch := func(kv map[string]any) {
		t.Helper()
		raw, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": kv}})
		if _, err := client.CoreV1().Pods("team").Patch(ctx, "budgeted", types.MergePatchType, raw, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	teamCondition := func(what string, ok func(*corev1.Pod) bool) {
		t.Helper()
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
			p, err := client.CoreV1().Pods("team").Get(ctx, "budgeted", metav1.GetOptions{})
			return err == nil && p.Status.Phase == corev1.PodRunning && ok(p), nil
		})
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// A resize key is admitted only on a placed pod (the webhook refuses it
	// before the decision): wait for it, or a busy machine races it.
	teamCondition("placed", func(p *corev1.Pod) bool {
		as, err := api.ParseAssignments(p.Annotations)
		return err == nil && len(as) > 0
	})
	teamPatch(map[string]any{api.KeyResizeRequest: "16Gi"})
	teamCondition("a grow past the quota charge is infeasible", func(p *corev1.Pod) bool {
		c, _ := api.PodResizeCondition(p, api.ConditionResizePending)
		return c.Status == corev1.ConditionTrue && c.Reason == api.ReasonResizeInfeasible && strings.Contains(c.Message, "charged to its namespace's GPU memory quota")
	})
	teamPatch(map[string]any{api.KeyResizeRequest: "8Gi"})
	teamCondition("a grow within the quota charge", resized(8192, 8192))
}

func assignmentOf(t *testing.T, p *corev1.Pod) api.Assignment {
	t.Helper()
	as, err := api.ParseAssignments(p.Annotations)
	if err != nil || len(as) != 1 {
		t.Fatalf("pod %s: decision %v, %v", p.Name, as, err)
	}
	return as[0]
}

func containsReason(events []corev1.Event, reason string) bool {
	for _, e := range events {
		if e.Reason == reason {
			return true
		}
	}
	return false
}

func equalStrings(a, b []string) bool { return fmt.Sprint(a) == fmt.Sprint(b) }

// writesUntil counts the writes to a pod after resourceVersion, up to and
// including the first that makes done true; with done nil, those within
// a second (none should come).
func writesUntil(t *testing.T, client kubernetes.Interface, name, resourceVersion string, done func(*corev1.Pod) bool) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if done == nil {
		ctx, cancel = context.WithTimeout(ctx, time.Second)
		defer cancel()
	}
	w, err := client.CoreV1().Pods("default").Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name, ResourceVersion: resourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	n := 0
	for ev := range w.ResultChan() {
		p, ok := ev.Object.(*corev1.Pod)
		if !ok {
			break
		}
		n++
		if done != nil && done(p) {
			return n
		}
	}
	if done != nil {
		t.Fatalf("pod %s: not done after %d writes", name, n)
	}
	return n
}

// schedulerEvents counts the events about a pod that are not its
// kubelet's (KWOK's).
func schedulerEvents(t *testing.T, client kubernetes.Interface, pod string) int {
	t.Helper()
	events, err := client.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + pod})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range events.Items {
		if e.Source.Component != "kubelet" && e.ReportingController != "kubelet" {
			n++
		}
	}
	return n
}
