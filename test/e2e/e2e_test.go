// Package e2e runs gpufrac's whole stack as `gpufrac up` starts it (real
// etcd and kube-apiserver, webhook, scheduler binary, node agents
// simulating GPUs) and checks the product's promises end to end.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/cli"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/admission"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/audit"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// up builds the gpufrac binary and starts a local cluster of n nodes; it
// returns the cluster and its state directory.
func up(t *testing.T, nodes int) (*localcluster.Cluster, string) {
	t.Helper()
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "gpufrac")
	build := exec.Command("go", "build", "-o", bin, "./cmd/gpufrac")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	dir := t.TempDir()
	c, err := localcluster.Up(context.Background(), localcluster.Options{
		Dir: dir, Nodes: nodes, Machine: "dgxh100", Binary: bin, Root: root, Progress: io.Discard,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		defer c.Down() // etcd and kube-apiserver would outlive the test otherwise
		if t.Failed() {
			for _, name := range c.Components() {
				raw, _ := os.ReadFile(filepath.Join(dir, "logs", name+".log"))
				lines := strings.Split(string(raw), "\n")
				t.Logf("%s log (last lines):\n%s", name, strings.Join(lines[max(len(lines)-30, 0):], "\n"))
			}
		}
	})
	return c, dir
}

// running waits until every pod in namespace ns is Running (KWOK's fake
// kubelets start bound pods) and returns how many there are.
func running(t *testing.T, c *localcluster.Cluster, ns string) int {
	t.Helper()
	var n, notRunning int
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		n, notRunning = len(list.Items), 0
		for _, p := range list.Items {
			if p.Status.Phase != corev1.PodRunning {
				notRunning++
			}
		}
		return notRunning == 0, nil
	})
	if err != nil {
		t.Fatalf("%d of %d pods in %s not Running: %v", notRunning, n, ns, err)
	}
	return n
}

// snapshot lists every node and pod.
func snapshot(t *testing.T, c *localcluster.Cluster) (*corev1.NodeList, *corev1.PodList) {
	t.Helper()
	ctx := context.Background()
	nodes, err := c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pods, err := c.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return nodes, pods
}

// checkAudit fails the test on any violation of SPEC §2.
func checkAudit(t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	nodes, pods := snapshot(t, c)
	if v := audit.Check(nodes.Items, pods.Items, nil, audit.Options{Now: time.Now()}); len(v) > 0 {
		// Who holds the GPUs involved, to explain the violation.
		for _, p := range pods.Items {
			for _, x := range v {
				uuid := x.Object[strings.LastIndexByte(x.Object, '/')+1:]
				a := p.Annotations
				if strings.Contains(a[api.ReservedGPUAnnotation], uuid) || strings.Contains(a[api.ContainerKey("main", api.SuffixDevices)], uuid) {
					t.Logf("%s/%s node=%s created=%s groups=%q devices=%q reserved=%q label=%q", p.Namespace, p.Name, p.Spec.NodeName,
						p.CreationTimestamp.Format("15:04:05"), a[api.GPUGroupsAnnotation], a[api.ContainerKey("main", api.SuffixDevices)],
						a[api.ReservedGPUAnnotation], p.Labels[api.GPUGroupLabel])
					break
				}
			}
		}
		t.Fatalf("audit: %v", v)
	}
}

func TestEndToEnd(t *testing.T) {
	c, dir := up(t, 8)
	ctx := context.Background()

	t.Run("examples land as SPEC §2 says", func(t *testing.T) {
		root, _ := checkout.Root()
		if err := c.Demo(ctx, filepath.Join(root, "examples"), io.Discard); err != nil {
			t.Fatal(err)
		}
		pods, err := c.Admin.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods.Items {
			reqs, err := api.Parse(api.Intent(&p))
			if err != nil || len(reqs) == 0 {
				t.Fatalf("pod %s: %v", p.Name, err)
			}
			a, err := api.ParseAssignments(p.Annotations)
			if err != nil || len(a) != 1 {
				t.Fatalf("pod %s: decision %v, %v", p.Name, a, err)
			}
			if len(a[0].Devices) != reqs[0].Devices || a[0].Mode != reqs[0].Mode || a[0].RequestMiB <= 0 || a[0].LimitMiB < a[0].RequestMiB ||
				(a[0].Mode == api.SMSharing) != !a[0].Portion.IsZero() {
				t.Errorf("pod %s asked %v, got %+v", p.Name, reqs[0], a[0])
			}
		}
		running(t, c, "default")
		// The reservation pods hold their GPUs like running pods.
		running(t, c, scheduler.DefaultReservationNamespace)
		checkAudit(t, c)
	})

	t.Run("a forged .gpus.devices is denied to a normal user", func(t *testing.T) {
		p := pod("forged", map[string]string{api.KeyFraction: "0.5", api.ContainerKey("main", api.SuffixDevices): "GPU-stolen"})
		_, err := c.Admin.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		if err == nil || !strings.Contains(err.Error(), "is written by the scheduler and cannot be set in a manifest") {
			t.Fatalf("forged devices: %v", err)
		}
	})

	t.Run("scheduler and a node agent crash during a burst of 500", func(t *testing.T) {
		if _, err := c.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "burst"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		shapes := []map[string]string{
			{api.KeyFraction: "0.05"}, {api.KeyFraction: "0.1"}, {api.KeyMemory: "4096"},
			{api.KeyFraction: "0.125", api.KeyComputeSharingMode: string(api.SMSharing)},
		}
		const total = 500
		work := make(chan int)
		var wg sync.WaitGroup
		errs := make(chan error, total)
		for range 8 {
			wg.Go(func() {
				for i := range work {
					p := pod(fmt.Sprintf("p-%03d", i), shapes[i%len(shapes)])
					if _, err := c.Admin.CoreV1().Pods("burst").Create(ctx, p, metav1.CreateOptions{}); err != nil {
						errs <- err
					}
				}
			})
		}
		for i := range total {
			work <- i
			switch i {
			case total / 3:
				if err := c.Crash("scheduler"); err != nil {
					t.Fatal(err)
				}
			case total / 2:
				if err := c.Crash("node-agent-gpu-node-1"); err != nil {
					t.Fatal(err)
				}
			}
		}
		close(work)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		var bound int
		err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 4*time.Minute, true, func(ctx context.Context) (bool, error) {
			list, err := c.Admin.CoreV1().Pods("burst").List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			bound = 0
			for _, p := range list.Items {
				if p.Spec.NodeName != "" && p.Annotations[api.ContainerKey("main", api.SuffixDevices)] != "" {
					bound++
				}
			}
			return bound == total, nil
		})
		if err != nil {
			t.Fatalf("%d of %d pods bound with their devices", bound, total)
		}
		// Reservation pods of binds the crash interrupted are collected.
		err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			nodes, err := c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			pods, err := c.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			return len(audit.Check(nodes.Items, pods.Items, nil, audit.Options{Now: time.Now()})) == 0, nil
		})
		if err != nil {
			checkAudit(t, c)
		}
		if n := running(t, c, "burst"); n != total {
			t.Fatalf("%d pods in burst, want %d", n, total)
		}
	})

	t.Run("deleted pods free their GPUs", func(t *testing.T) {
		// A plain delete, with the default grace period: the fake kubelet
		// stops the pod, the scheduler drops its share and, with the last
		// tenant of a GPU, the GPU's reservation pod.
		if err := c.Admin.CoreV1().Pods("burst").DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
		err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
			burst, err := c.Admin.CoreV1().Pods("burst").List(ctx, metav1.ListOptions{})
			return err == nil && len(burst.Items) == 0, err
		})
		if err != nil {
			t.Fatalf("the burst's pods were not deleted: %v", err)
		}
		// What is left is held by the examples in default.
		reservationsMatchTenants(t, c)
		checkAudit(t, c)
	})

	t.Run("Deployments, Jobs and claim templates run through kube-controller-manager", func(t *testing.T) {
		workloads(t, c, dir)
	})

	t.Run("a pod as KAI Scheduler's binder leaves it is run by our node side", func(t *testing.T) {
		kaiPod(t, c)
	})

	t.Run("down leaves no process", func(t *testing.T) {
		procs, _, err := localcluster.ReadPIDs(dir)
		if err != nil {
			t.Fatal(err)
		}
		// The pid file names this test process first, then its children:
		// etcd, kube-apiserver, the node agents, KWOK, the scheduler,
		// kube-controller-manager and the dashboard.
		children := procs[1:]
		if len(children) != 8+6 {
			t.Errorf("up.pid names %d children, want 14 (etcd, kube-apiserver, 8 node agents, KWOK, scheduler, kube-controller-manager, dashboard): %v", len(children), children)
		}
		if err := c.Shutdown(); err != nil {
			t.Error(err)
		}
		for _, p := range children {
			if p.Running() {
				t.Errorf("%v still running after down", p)
			}
		}
	})
}

func pod(name string, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
	}
}

// kaiPod places a pod as KAI Scheduler does — KAI's admission keys, the
// fraction on an init container, sm-sharing; then, as KAI's binder, CDI
// device names and the resolved request but no compute portion, and the
// binding — and checks that our side takes it: the webhook admits it and
// keeps the binder-owned keys to the binder, the node agent's decision
// (gpufrac explain runs the very function its NRI plugin does) runs both
// containers, and gpufrac audit and top read it through the same ledgers
// as the scheduler. KWOK's fake kubelets start no containers, so the NRI
// round trip itself is TestKAIShapedPodRunsOverNRI's.
func kaiPod(t *testing.T, c *localcluster.Cluster) {
	ctx := context.Background()
	const ns, name, node = "kai", "kai-sm", "gpu-node-7"
	const uuid = "GPU-0e2e0000-0000-4000-8000-000000000001" // a GPU of KAI's reservation pod, in KAI's namespace
	if _, err := c.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{
			api.KeyFraction: "0.25", api.KeyContainerName: "setup",
			api.ContainerKey("setup", api.SuffixComputeMode): string(api.SMSharing),
		}},
		Spec: corev1.PodSpec{SchedulerName: "kai-scheduler",
			InitContainers: []corev1.Container{{Name: "setup", Image: "cuda"}},
			Containers:     []corev1.Container{{Name: "main", Image: "cuda"}}},
	}
	created, err := c.Admin.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("our webhook refused a pod KAI admits: %v", err)
	}
	if created.Spec.SchedulerName != "kai-scheduler" {
		t.Errorf("the webhook changed the pod's scheduler to %q", created.Spec.SchedulerName)
	}

	binder := map[string]string{
		api.ContainerKey("setup", api.SuffixDevices):       api.CDIKindNVIDIAGPU + "=" + uuid,
		api.ContainerKey("setup", api.SuffixMemoryRequest): "20Gi", // 81920Mi × 0.25, as Quantity.String()
		"received-resource-type":                           "Fraction",
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": binder}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Admin.CoreV1().Pods(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err == nil ||
		!strings.Contains(err.Error(), "can be set, changed or removed only by the scheduler") {
		t.Fatalf("a user wrote the binder's keys: %v", err)
	}
	// KAI's binder is an identity the webhook trusts with those keys, as
	// gpufrac's scheduler is; this stands in for it.
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Impersonate = rest.ImpersonationConfig{UserName: admission.DefaultSchedulerUser}
	asBinder, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := asBinder.CoreV1().Pods(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("the binder's annotations: %v", err)
	}
	binding := &corev1.Binding{ObjectMeta: metav1.ObjectMeta{Name: name}, Target: corev1.ObjectReference{Kind: "Node", Name: node}}
	if err := asBinder.CoreV1().Pods(ns).Bind(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatalf("binding: %v", err)
	}
	running(t, c, ns)

	placed, err := c.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	placed.APIVersion, placed.Kind = "v1", "Pod"
	manifest, err := yaml.Marshal(placed)
	if err != nil {
		t.Fatal(err)
	}
	// The local cluster's node agents' settings (go-nvml's dgxh100 mock,
	// auto backend, no hook binary, the default MPS pipe directory), with
	// an MPS v3 daemon as on an r615 node: sm-sharing needs its namespaces,
	// and the mock's r550 driver has only the legacy interface.
	explain := cli.NewRootCommand()
	var out bytes.Buffer
	explain.SetIn(bytes.NewReader(manifest))
	explain.SetOut(&out)
	explain.SetErr(&out)
	explain.SetArgs([]string{"explain", "--simulate-gpus", "dgxh100", "--memory-limits", "auto", "--mps", "v3", "--hook-path", "", "-"})
	if err := explain.Execute(); err != nil {
		t.Fatalf("gpufrac explain: %v\n%s", err, out.String())
	}
	remaining := out.String()
	for _, want := range []string{
		"kai/kai-sm init container setup: RUN",
		"share: sm-sharing on " + uuid + ", request 20480Mi, limit 20480Mi, compute portion 0.25",
		"env set: NVIDIA_VISIBLE_DEVICES=" + api.CDIKindNVIDIAGPU + "=" + uuid,
		"env set: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
		"mount: /run/gpufrac/mps/pipe/gpufrac/" + nodeapi.NamespaceName(string(placed.UID), "setup") + " -> /run/nvidia/mps",
		"mps: namespace " + nodeapi.NamespaceName(string(placed.UID), "setup") + ", active-thread ceiling 25%",
		"derived 0.25 from the memory share",
		"kai/kai-sm container main: RUN",
		"env set: NVIDIA_VISIBLE_DEVICES=void",
	} {
		i := strings.Index(remaining, want)
		if i < 0 {
			t.Fatalf("the node side's decision lacks %q (in order):\n%s", want, out.String())
		}
		remaining = remaining[i+len(want):]
	}

	nodes, pods := snapshot(t, c)
	// KAI's reservation pod lives in KAI's namespace, which gpufrac does
	// not read: that, and only that, is what the audit says of the pod.
	v := audit.Check(nodes.Items, pods.Items, nil, audit.Options{Now: time.Now()})
	if len(v) != 1 || v[0].Kind != audit.NoReservation || v[0].Object != ns+"/"+name {
		t.Errorf("audit: %v, want only %s for %s/%s", v, audit.NoReservation, ns, name)
	}
	view := clusterview.Build(nodes.Items, pods.Items, nil)
	found := false
	for _, n := range view.Nodes {
		for _, g := range n.Shared {
			for _, tn := range g.Tenants {
				if n.Name == node && g.UUID == uuid && g.Mode == api.SMSharing && tn.Pod == ns+"/"+name && tn.RequestMiB == 20480 {
					found = true
				}
			}
		}
	}
	if !found {
		t.Errorf("gpufrac top does not show %s/%s on %s %s: %+v", ns, name, node, uuid, view.Nodes)
	}
	if err := c.Admin.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
}
