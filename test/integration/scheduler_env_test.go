package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/internal/testenv"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

const reservationNS = scheduler.DefaultReservationNamespace

var (
	binaryOnce sync.Once
	binaryPath string
	binaryErr  error
)

// gpufracBinary builds cmd/gpufrac once per test run: the scheduler runs
// as its own process so that a test can kill it.
func gpufracBinary(t testing.TB) string {
	t.Helper()
	binaryOnce.Do(func() {
		root, err := checkout.Root()
		if err != nil {
			binaryErr = err
			return
		}
		dir, err := os.MkdirTemp("", "gpufrac-bin-")
		if err != nil {
			binaryErr = err
			return
		}
		binaryPath = filepath.Join(dir, "gpufrac")
		cmd := exec.Command("go", "build", "-o", binaryPath, "./cmd/gpufrac")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			binaryErr = fmt.Errorf("go build ./cmd/gpufrac: %w\n%s", err, out)
		}
	})
	if binaryErr != nil {
		t.Fatal(binaryErr)
	}
	return binaryPath
}

// schedEnv is the cluster side the scheduler tests share: the scheduler's
// RBAC from deploy/scheduler, its identity's kubeconfig, an admin one for
// gpufrac audit, and the device-plugin stand-in.
type schedEnv struct {
	schedulerKubeconfig, adminKubeconfig string
	dir                                  string
}

var (
	schedOnce sync.Once
	sched     *schedEnv
	schedErr  error
)

func schedulerEnv(t testing.TB) *schedEnv {
	t.Helper()
	schedOnce.Do(func() { sched, schedErr = setUpScheduler() })
	if schedErr != nil {
		t.Fatal(schedErr)
	}
	return sched
}

func setUpScheduler() (*schedEnv, error) {
	ctx := context.Background()
	admin := shared.admin
	for _, ns := range []string{"gpufrac-system", reservationNS} {
		if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return nil, err
		}
	}
	root, err := checkout.Root()
	if err != nil {
		return nil, err
	}
	if err := localcluster.ApplyRBAC(ctx, admin, filepath.Join(root, "deploy", "scheduler", "scheduler.yaml")); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "gpufrac-sched-")
	if err != nil {
		return nil, err
	}
	e := &schedEnv{dir: dir}
	// The scheduler acts as its service account with only the RBAC of
	// deploy/scheduler: least privilege is tested, not assumed.
	kc, err := testenv.KubeConfig(shared.env, schedulerUser, "system:serviceaccounts", "system:serviceaccounts:gpufrac-system", "system:authenticated")
	if err != nil {
		return nil, err
	}
	e.schedulerKubeconfig = filepath.Join(dir, "scheduler.kubeconfig")
	if err := os.WriteFile(e.schedulerKubeconfig, kc, 0o600); err != nil {
		return nil, err
	}
	if kc, err = testenv.KubeConfig(shared.env, "auditor", "system:masters"); err != nil {
		return nil, err
	}
	e.adminKubeconfig = filepath.Join(dir, "admin.kubeconfig")
	if err := os.WriteFile(e.adminKubeconfig, kc, 0o600); err != nil {
		return nil, err
	}
	go runDevicePlugin(context.Background(), admin)
	return e, nil
}

// runDevicePlugin plays the kubelet's device plugin and the node agent for
// reservation pods, the one stand-in here (no kubelet runs): each gets the
// lowest GPU of its node that no other reservation pod holds, written as
// the node agent writes it. Like one node agent per node, it looks at a
// node's own reservation pods only, when one of them changes, and works on
// up to 16 nodes at once: the CPU it costs the shared machine per pod does
// not grow with the cluster (it shares the cores with what is measured).
func runDevicePlugin(ctx context.Context, client kubernetes.Interface) {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(reservationNS))
	informer := factory.Core().V1().Pods().Informer()
	const byNode = "node"
	if err := informer.AddIndexers(toolscache.Indexers{byNode: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok && p.Spec.NodeName != "" {
			return []string{p.Spec.NodeName}, nil
		}
		return nil, nil
	}}); err != nil {
		panic(err) // only before the informer starts, which it has not
	}
	queue := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	var mu sync.Mutex
	given := map[types.UID]string{} // what was written, before the informer shows it
	onEvent := func(obj any, deleted bool) {
		if d, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
			obj = d.Obj
		}
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Spec.NodeName == "" {
			return
		}
		if deleted {
			mu.Lock()
			delete(given, p.UID)
			mu.Unlock()
		}
		queue.Add(p.Spec.NodeName)
	}
	_, _ = informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { onEvent(o, false) },
		UpdateFunc: func(_, o any) { onEvent(o, false) },
		DeleteFunc: func(o any) { onEvent(o, true) },
	})
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())
	// agent writes the GPU of each of the node's reservation pods that has
	// none; false: a write failed, and the node is tried again.
	agent := func(node string) bool {
		objs, _ := informer.GetIndexer().ByIndex(byNode, node)
		pods := make([]*corev1.Pod, 0, len(objs))
		held := map[string]bool{}
		mu.Lock()
		for _, o := range objs {
			p := o.(*corev1.Pod)
			pods = append(pods, p)
			uuid := p.Annotations[api.ReservedGPUAnnotation]
			if uuid == "" {
				uuid = given[p.UID]
			}
			if uuid != "" {
				held[uuid] = true
			}
		}
		mu.Unlock()
		slices.SortFunc(pods, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
		ok := true
		for _, p := range pods {
			mu.Lock()
			done := given[p.UID] != ""
			mu.Unlock()
			if p.DeletionTimestamp != nil || p.Annotations[api.ReservedGPUAnnotation] != "" || done {
				continue
			}
			var uuid string
			for i := 0; ; i++ {
				if uuid = fmt.Sprintf("GPU-%x-%d", node, i); !held[uuid] {
					break
				}
			}
			held[uuid] = true
			mu.Lock()
			given[p.UID] = uuid
			mu.Unlock()
			patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, api.ReservedGPUAnnotation, uuid)
			if _, err := client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				mu.Lock()
				delete(given, p.UID)
				mu.Unlock()
				ok = false
			}
		}
		return ok
	}
	for range 16 {
		go func() {
			for {
				node, shutdown := queue.Get()
				if shutdown {
					return
				}
				if agent(node) {
					queue.Forget(node)
				} else {
					queue.AddRateLimited(node)
				}
				queue.Done(node)
			}
		}()
	}
	<-ctx.Done()
	queue.ShutDown()
}

// schedulerProcess is `gpufrac scheduler` running as a child process.
type schedulerProcess struct {
	cmd  *exec.Cmd
	log  string
	done chan error
}

// startScheduler runs the scheduler with deploy/scheduler/config.yaml,
// adjusted for a test: its kubeconfig, no leader election, a schedulerName
// and plugin args of the test's.
func (e *schedEnv) startScheduler(t testing.TB, name string, args map[string]any) *schedulerProcess {
	t.Helper()
	cfg := e.schedulerConfig(t, name, e.schedulerKubeconfig, args)
	cfg["leaderElection"] = map[string]any{"leaderElect": false}
	delete(pluginArgsOf(t, cfg), "leaderLease") // one replica, no election
	return launchScheduler(t, name, cfg)
}

// schedulerConfig is deploy/scheduler/config.yaml with a test's
// kubeconfig, schedulerName and plugin args.
func (e *schedEnv) schedulerConfig(t testing.TB, name, kubeconfig string, args map[string]any) map[string]any {
	t.Helper()
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "deploy", "scheduler", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["clientConnection"] = map[string]any{"kubeconfig": kubeconfig, "qps": 500, "burst": 1000}
	profile := cfg["profiles"].([]any)[0].(map[string]any)
	profile["schedulerName"] = name
	pluginArgs := pluginArgsOf(t, cfg)
	for k, v := range args {
		pluginArgs[k] = v
	}
	return cfg
}

// pluginArgsOf is the GPUFractions args of a configuration's profile.
func pluginArgsOf(t testing.TB, cfg map[string]any) map[string]any {
	t.Helper()
	profile := cfg["profiles"].([]any)[0].(map[string]any)
	for _, pc := range profile["pluginConfig"].([]any) {
		if pc := pc.(map[string]any); pc["name"] == "GPUFractions" {
			return pc["args"].(map[string]any)
		}
	}
	t.Fatal("deploy/scheduler/config.yaml has no GPUFractions pluginConfig")
	return nil
}

// launchScheduler runs `gpufrac scheduler` with the configuration cfg;
// prefix, when given, is a command that runs it (unshare, say).
func launchScheduler(t testing.TB, name string, cfg map[string]any, prefix ...string) *schedulerProcess {
	t.Helper()
	out, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, out, 0o600); err != nil {
		t.Fatal(err)
	}
	p := &schedulerProcess{log: filepath.Join(t.TempDir(), "scheduler.log"), done: make(chan error, 1)}
	logFile, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	argv := append(slices.Clone(prefix), gpufracBinary(t), "scheduler", "--config", path, "--secure-port", "0", "-v", "2")
	p.cmd = exec.Command(argv[0], argv[1:]...)
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	if dir := os.Getenv("GPUFRAC_PROFILE_DIR"); dir != "" {
		p.cmd.Env = append(os.Environ(), "GPUFRAC_CPU_PROFILE="+filepath.Join(dir, fmt.Sprintf("scheduler-%s-%d.pprof", name, time.Now().UnixNano())))
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait(); _ = logFile.Close() }()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			p.dumpLog(t)
		}
	})
	return p
}

// kill ends the scheduler at once, as a crash or an OOM kill would.
func (p *schedulerProcess) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	err := <-p.done
	p.done <- err
}

// signal sends the scheduler a signal (SIGSTOP, SIGCONT: a stall).
func (p *schedulerProcess) signal(sig syscall.Signal) { _ = p.cmd.Process.Signal(sig) }

func (p *schedulerProcess) stop() {
	select {
	case err := <-p.done:
		p.done <- err
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		p.done <- err
	case <-time.After(10 * time.Second):
		p.kill()
	}
}

func (p *schedulerProcess) dumpLog(t testing.TB) {
	raw, _ := os.ReadFile(p.log)
	lines := strings.Split(string(raw), "\n")
	if len(lines) > 80 {
		lines = lines[len(lines)-80:]
	}
	t.Logf("scheduler log (last lines):\n%s", strings.Join(lines, "\n"))
}

// gpuNode creates a node with GPUs, as the device plugin and the node
// agent would report it, in a scenario of its own (label scenario=<s>),
// and deletes it when the test ends.
func gpuNode(t testing.TB, name, scenario string, gpus int, memMiB int64, ready bool) {
	t.Helper()
	if err := makeGPUNode(name, scenario, gpus, memMiB, ready); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = shared.admin.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
}

func makeGPUNode(name, scenario string, gpus int, memMiB int64, ready bool) error {
	labels := map[string]string{
		"scenario":          scenario,
		api.LabelGPUCount:   fmt.Sprint(gpus),
		api.LabelGPUMemory:  fmt.Sprint(memMiB),
		api.LabelGPUProduct: "NVIDIA-H100-80GB-HBM3",
	}
	var conditions []corev1.NodeCondition
	if ready {
		conditions = append(conditions, corev1.NodeCondition{Type: api.ConditionFractioningReady, Status: corev1.ConditionTrue, Reason: "EnforcementAvailable"})
	}
	return localcluster.CreateNode(context.Background(), shared.admin, name, gpus, labels, conditions...)
}

// namespace creates a namespace for one test.
func namespace(t testing.TB, name string) string {
	t.Helper()
	if _, err := shared.admin.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return name
}

// workload is a pod for the scheduler under test, pinned to a scenario's
// nodes.
func workload(ns, name, schedulerName, scenario string, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: annotations},
		Spec: corev1.PodSpec{
			SchedulerName: schedulerName,
			NodeSelector:  map[string]string{"scenario": scenario},
			Containers: []corev1.Container{{Name: "main", Image: "cuda", Resources: corev1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")},
			}}},
		},
	}
}

func create(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	if _, err := shared.alice.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", pod.Name, err)
	}
}

// placed waits until the pod is bound and carries its devices.
func placed(t *testing.T, ns, name string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := shared.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		return p.Spec.NodeName != "", nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s not bound: %v (annotations %v)", ns, name, err, pod.Annotations)
	}
	if len(devices(pod)) > 0 && !decidedByBinding(pod) {
		t.Errorf("pod %s/%s: its GPU decision was not written by its Binding (managed fields %v)", ns, name, pod.ManagedFields)
	}
	return pod
}

// decidedByBinding says whether the pod's decision came with its Binding
// (one write) rather than a patch before it: the API server's binding
// path records no managed fields, a patch records its manager's.
func decidedByBinding(pod *corev1.Pod) bool {
	key := api.ContainerKey("main", api.SuffixDevices)
	for _, m := range pod.ManagedFields {
		if m.FieldsV1 != nil && strings.Contains(m.FieldsV1.GetRawString(), key) {
			return false
		}
	}
	return true
}

// devices returns the GPUs written on a placed pod's container main.
func devices(pod *corev1.Pod) []string {
	return api.SplitList(pod.Annotations[api.ContainerKey("main", api.SuffixDevices)])
}

// reservationPods lists the reservation pods on the given nodes.
func reservationPods(t testing.TB, nodes ...string) []corev1.Pod {
	t.Helper()
	list, err := shared.admin.CoreV1().Pods(reservationNS).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return slices.DeleteFunc(list.Items, func(p corev1.Pod) bool { return !slices.Contains(nodes, p.Spec.NodeName) })
}

// top runs `gpufrac top -o json` and returns the view.
func (e *schedEnv) top(t *testing.T) clusterview.View {
	t.Helper()
	out, err := exec.Command(gpufracBinary(t), "top", "--kubeconfig", e.adminKubeconfig, "-o", "json").Output()
	if err != nil {
		t.Fatalf("gpufrac top: %v", err)
	}
	var v clusterview.View
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("gpufrac top -o json: %v\n%s", err, out)
	}
	return v
}

// audit runs `gpufrac audit` on a scenario's nodes and fails the test on
// any violation.
func (e *schedEnv) audit(t *testing.T, scenario string) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(gpufracBinary(t), "audit", "--kubeconfig", e.adminKubeconfig, "--orphan-grace", "0s", "--node-selector", "scenario="+scenario)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("gpufrac audit: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "audit: clean") {
		t.Fatalf("gpufrac audit said:\n%s", out.String())
	}
}
