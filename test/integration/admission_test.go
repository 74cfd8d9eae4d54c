// Package integration runs gpufrac against the real kube-apiserver and etcd.
package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/internal/testenv"
	"github.com/gpufrac/gpufrac/pkg/admission"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
)

const (
	webhookUser   = "system:serviceaccount:gpufrac-system:gpufrac-webhook"
	schedulerUser = admission.DefaultSchedulerUser
	schedulerName = "gpufrac"
)

// webhookEnv is one API server with gpufrac's webhook configurations from
// deploy/webhook installed and our webhook server answering them over TLS.
type webhookEnv struct {
	admin, alice, scheduler *kubernetes.Clientset
	adminConfig             *rest.Config
	env                     *envtest.Environment
	serving                 admission.ServerOptions
	stopWebhook             context.CancelFunc
	webhookDone             chan error
}

// startWebhook serves the webhooks on the address and certificates envtest
// registered, and waits until they answer.
func (w *webhookEnv) startWebhook() error {
	srv := admission.NewServer(w.serving)
	ctx, cancel := context.WithCancel(context.Background())
	w.stopWebhook, w.webhookDone = cancel, make(chan error, 1)
	go func() { w.webhookDone <- srv.Start(ctx) }()
	if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return srv.StartedChecker()(nil) == nil, nil
	}); err != nil {
		cancel()
		return fmt.Errorf("webhook server did not start: %w", err)
	}
	return nil
}

var shared *webhookEnv

func TestMain(m *testing.M) {
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:])) // a child playing nvidia-cuda-mps-control
	}
	ctrllog.SetLogger(klog.NewKlogr())
	code, err := runWithEnv(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration environment:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func runWithEnv(m *testing.M) (int, error) {
	env, err := testenv.New()
	if err != nil {
		return 0, err
	}
	root, err := checkout.Root()
	if err != nil {
		return 0, err
	}
	env.WebhookInstallOptions.Paths = []string{filepath.Join(root, "deploy", "webhook")}
	if _, err := env.Start(); err != nil {
		return 0, fmt.Errorf("start kube-apiserver: %w", err)
	}
	defer func() { _ = env.Stop() }()

	w := &webhookEnv{env: env}
	if w.admin, w.adminConfig, err = testenv.User(env, "admin", "system:masters"); err != nil {
		return 0, err
	}
	if w.alice, _, err = testenv.User(env, "alice", "system:masters"); err != nil {
		return 0, err
	}
	if w.scheduler, _, err = testenv.User(env, schedulerUser, "system:serviceaccounts", "system:masters"); err != nil {
		return 0, err
	}
	o := env.WebhookInstallOptions
	// The charge to quota reads the nodes and claims as the webhook's own
	// service account would, with deploy/webhook's RBAC.
	if err := localcluster.ApplyRBAC(context.Background(), w.admin, filepath.Join(root, "deploy", "webhook", "server.yaml")); err != nil {
		return 0, err
	}
	reader, _, err := testenv.User(env, webhookUser, "system:serviceaccounts", "system:serviceaccounts:gpufrac-system", "system:authenticated")
	if err != nil {
		return 0, err
	}
	chargerCtx, stopCharger := context.WithCancel(context.Background())
	defer stopCharger()
	charger, _ := admission.NewCharger(chargerCtx, reader)
	// The suite's GPUs are 80Gi H100s, and many admission tests create a
	// share of a GPU before any node exists: a share is charged as on an
	// 80Gi GPU at least (TestQuota... checks the charge against real nodes).
	nodes := charger.LargestGPUMiB
	charger.LargestGPUMiB = func() int64 { return max(nodes(), 81920) }
	w.serving = admission.ServerOptions{
		Host: o.LocalServingHost, Port: o.LocalServingPort, CertDir: o.LocalServingCertDir,
		Identity: admission.Identity{Users: []string{schedulerUser}, Schedulers: []string{schedulerName, "gpufrac-*"}}, SchedulerName: schedulerName,
		Charger: charger,
	}
	if err := w.startWebhook(); err != nil {
		return 0, err
	}
	defer func() { w.stopWebhook() }()
	shared = w
	return m.Run(), nil
}

var podSeq int

func fracPod(annotations map[string]string, containers ...string) *corev1.Pod {
	if len(containers) == 0 {
		containers = []string{"main"}
	}
	podSeq++
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%d", podSeq), Namespace: "default", Annotations: annotations}}
	for _, c := range containers {
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: c, Image: "cuda"})
	}
	return p
}

func deniedWith(t *testing.T, err error, webhook, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("admitted; want denial %q", msg)
	}
	want := fmt.Sprintf("admission webhook %q denied the request: %s", webhook, msg)
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("error:\n got  %s\n want %s", err, want)
	}
}

// Each rule of SPEC §1, through the API server exactly as kubectl sends it.
func TestPodRulesRejectedAtCreate(t *testing.T) {
	ctx := context.Background()
	gpu := func(p *corev1.Pod) *corev1.Pod {
		p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}
		return p
	}
	tests := []struct {
		name string
		pod  *corev1.Pod
		msg  string
	}{
		{"fraction out of range", fracPod(map[string]string{"gpu-fraction": "1"}),
			`container "main": gpu-fraction "1" must be greater than 0 and less than 1`},
		{"fraction as a quantity", fracPod(map[string]string{"gpu-fraction": "500m"}),
			`container "main": gpu-fraction "500m" must be a decimal number such as 0.5`},
		{"fraction NaN", fracPod(map[string]string{"gpu-fraction": "NaN"}),
			`container "main": gpu-fraction "NaN" must be a decimal number such as 0.5`},
		{"fraction limit with six decimals", fracPod(map[string]string{"gpu-fraction": "0.5", "gpu-fraction.limit": "0.500001"}),
			`container "main": gpu-fraction.limit "0.500001" must have at most 5 decimal places`},
		{"fraction limit not above request", fracPod(map[string]string{"gpu-fraction": "0.5", "gpu-fraction.limit": "0.5"}),
			`container "main": gpu-fraction.limit "0.5" must be greater than gpu-fraction (0.5) and less than 1`},
		{"fraction limit without fraction", fracPod(map[string]string{"gpu-memory": "1024", "gpu-fraction.limit": "0.5"}),
			`container "main": gpu-fraction.limit "0.5" needs gpu-fraction: the limit is a share of the same GPU as the request`},
		{"memory with a unit", fracPod(map[string]string{"gpu-memory": "4Gi"}),
			`container "main": gpu-memory "4Gi" must be a positive whole number of MiB without a unit, such as 4096`},
		{"memory limit without a unit", fracPod(map[string]string{"gpu-memory": "4096", "gpu-memory.limit": "8192"}),
			`container "main": gpu-memory.limit "8192" must be a quantity with a unit, such as 8Gi (unlike gpu-memory, it is not a number of MiB)`},
		{"memory limit below request", fracPod(map[string]string{"gpu-memory": "4096", "gpu-memory.limit": "1Gi"}),
			`container "main": gpu-memory.limit "1Gi" must be at least gpu-memory (4096Mi)`},
		{"fraction and memory", fracPod(map[string]string{"gpu-fraction": "0.5", "gpu-memory": "1024"}),
			`container "main": gpu-memory "1024" cannot be combined with gpu-fraction: ask for a share of a GPU or for an amount of memory, not both`},
		{"num-devices zero", fracPod(map[string]string{"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"}),
			`container "main": gpu-fraction-num-devices "0" must be a positive whole number of GPUs, such as 2`},
		{"num-devices without a request", fracPod(map[string]string{"gpu-fraction-num-devices": "2"}),
			`container "main": gpu-fraction-num-devices "2" needs a memory request: set gpu-fraction or gpu-memory (or .gpu-memory.request)`},
		{"target container missing", fracPod(map[string]string{"gpu-fraction": "0.5", "gpu-fraction-container-name": "gpu"}, "main", "side"),
			`gpu-fraction-container-name "gpu" names a container that is not in the pod (containers: main, side)`},
		{"mode blank", fracPod(map[string]string{"gpu-fraction": "0.5", "kai.scheduler/gpu-compute-sharing-mode": ""}),
			`container "main": kai.scheduler/gpu-compute-sharing-mode "" must be time-slicing or sm-sharing`},
		{"canonical limit below request", fracPod(map[string]string{"nvidia.com/container.main.gpu-memory.request": "2Gi", "nvidia.com/container.main.gpu-memory.limit": "1Gi"}),
			`container "main": nvidia.com/container.main.gpu-memory.limit "1Gi" must be at least the memory request (2048Mi)`},
		{"canonical and shorthand disagree", fracPod(map[string]string{"gpu-memory": "1024", "nvidia.com/container.main.gpu-memory.request": "2Gi"}),
			`container "main": nvidia.com/container.main.gpu-memory.request "2Gi" disagrees with gpu-memory "1024" (2048Mi vs 1024Mi): set one, or make them equal`},
		{"unknown suffix", fracPod(map[string]string{"nvidia.com/container.main.gpu-mem": "1Gi"}),
			`nvidia.com/container.main.gpu-mem "1Gi" is not a known key: per-container keys end in .gpu-memory.request, .gpu-memory.limit, .gpu-compute.mode`},
		{"forged devices", fracPod(map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-1"}),
			`container "main": nvidia.com/container.main.gpus.devices "GPU-1" is written by the scheduler and cannot be set in a manifest: remove it`},
		{"forged portion", fracPod(map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpu-compute.portion": "1"}),
			`container "main": nvidia.com/container.main.gpu-compute.portion "1" is written by the scheduler and cannot be set in a manifest: remove it`},
		{"whole GPU and fraction", gpu(fracPod(map[string]string{"gpu-fraction": "0.5"})),
			`container "main": resources.limits[nvidia.com/gpu] "1" cannot be combined with GPU-fraction annotations on the same pod: ask for whole GPUs or for a fraction, not both`},
		{"two fractional containers", fracPod(map[string]string{"nvidia.com/container.a.gpu-memory.request": "1Gi", "nvidia.com/container.b.gpu-memory.request": "1Gi"}, "a", "b"),
			`GPU-fraction containers "a, b" are more than one: only one container per pod may have fraction annotations (pod-level keys apply to "a" unless gpu-fraction-container-name names another)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := shared.alice.CoreV1().Pods("default").Create(ctx, tt.pod, metav1.CreateOptions{})
			deniedWith(t, err, "pods.validate.gpufrac.io", tt.msg)
		})
	}
}

func TestValidPodAdmittedAndNormalised(t *testing.T) {
	ctx := context.Background()
	created, err := shared.alice.CoreV1().Pods("default").Create(ctx,
		fracPod(map[string]string{"gpu-memory": "4096", "gpu-memory.limit": "6Gi", "kai.scheduler/gpu-compute-sharing-mode": "sm-sharing"}),
		metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("valid pod denied: %v", err)
	}
	want := map[string]string{
		"gpu-memory":                                   "4096",
		"gpu-memory.limit":                             "6Gi",
		"kai.scheduler/gpu-compute-sharing-mode":       "sm-sharing",
		"nvidia.com/container.main.gpu-memory.request": "4Gi", // as KAI's admission writes it
		"nvidia.com/container.main.gpu-memory.limit":   "6Gi",
		"nvidia.com/container.main.gpu-compute.mode":   "sm-sharing",
	}
	for k, v := range want {
		if created.Annotations[k] != v {
			t.Errorf("annotation %s = %q, want %q (all: %v)", k, created.Annotations[k], v, created.Annotations)
		}
	}
	if created.Labels[admission.SelectionLabel] != "true" {
		t.Errorf("labels %v lack %s=true", created.Labels, admission.SelectionLabel)
	}
	if created.Spec.SchedulerName != schedulerName {
		t.Errorf("schedulerName = %q, want %q", created.Spec.SchedulerName, schedulerName)
	}

	plain, err := shared.alice.CoreV1().Pods("default").Create(ctx, fracPod(nil), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("plain pod denied: %v", err)
	}
	if plain.Spec.SchedulerName != corev1.DefaultSchedulerName || plain.Labels[admission.SelectionLabel] != "" {
		t.Errorf("plain pod was mutated: scheduler %q labels %v", plain.Spec.SchedulerName, plain.Labels)
	}
}

func TestWorkloadTemplatesRejectedAtCreate(t *testing.T) {
	ctx := context.Background()
	ns := createNamespace(t, "workloads")
	template := func(annotations map[string]string) corev1.PodTemplateSpec {
		return corev1.PodTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "x"}, Annotations: annotations},
			Spec:       corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever, Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
		}
	}
	deployment := func(name string, annotations map[string]string) *appsv1.Deployment {
		d := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: appsv1.DeploymentSpec{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "x"}}, Template: template(annotations)}}
		d.Spec.Template.Spec.RestartPolicy = corev1.RestartPolicyAlways
		return d
	}
	deps := shared.alice.AppsV1().Deployments(ns)
	_, err := deps.Create(ctx, deployment("bad", map[string]string{"gpu-fraction": "1.5"}), metav1.CreateOptions{})
	deniedWith(t, err, "workloads.validate.gpufrac.io", `container "main": gpu-fraction "1.5" must be greater than 0 and less than 1`)

	good, err := deps.Create(ctx, deployment("good", map[string]string{"gpu-fraction": "0.5"}), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("valid deployment denied: %v", err)
	}
	good.Spec.Template.Annotations["gpu-fraction"] = "2"
	_, err = deps.Update(ctx, good, metav1.UpdateOptions{})
	deniedWith(t, err, "workloads.validate.gpufrac.io", `container "main": gpu-fraction "2" must be greater than 0 and less than 1`)

	misplaced := deployment("misplaced", nil)
	misplaced.Annotations = map[string]string{"gpu-fraction": "0.5"}
	_, err = deps.Create(ctx, misplaced, metav1.CreateOptions{})
	deniedWith(t, err, "workloads.validate.gpufrac.io",
		`metadata.annotations[gpu-fraction] "0.5" is on the Deployment itself, where nothing reads it: move it to the pod template's metadata.annotations`)

	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "train"}, Spec: batchv1.JobSpec{Template: template(map[string]string{"gpu-memory": "4Gi"})}}
	job.Spec.Template.Labels = nil
	_, err = shared.alice.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{})
	deniedWith(t, err, "workloads.validate.gpufrac.io",
		`container "main": gpu-memory "4Gi" must be a positive whole number of MiB without a unit, such as 4096`)

	cron := &batchv1.CronJob{ObjectMeta: metav1.ObjectMeta{Name: "nightly"}, Spec: batchv1.CronJobSpec{Schedule: "0 3 * * *",
		JobTemplate: batchv1.JobTemplateSpec{Spec: batchv1.JobSpec{Template: template(map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-1"})}}}}
	cron.Spec.JobTemplate.Spec.Template.Labels = nil
	_, err = shared.alice.BatchV1().CronJobs(ns).Create(ctx, cron, metav1.CreateOptions{})
	deniedWith(t, err, "cronjobs.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "GPU-1" is written by the scheduler and cannot be set in a manifest: remove it`)

	// A workload with no template metadata at all must not trip the scope
	// conditions (an error there would fail closed on every such Job).
	bare := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "bare"}, Spec: batchv1.JobSpec{Template: template(nil)}}
	bare.Spec.Template.ObjectMeta = metav1.ObjectMeta{}
	if _, err := shared.alice.BatchV1().Jobs(ns).Create(ctx, bare, metav1.CreateOptions{}); err != nil {
		t.Errorf("plain job denied: %v", err)
	}
}

func TestSchedulerOwnedKeysAreGuarded(t *testing.T) {
	ctx := context.Background()
	devices := "nvidia.com/container.main.gpus.devices"
	pods := func(c *kubernetes.Clientset) func(*corev1.Pod) (*corev1.Pod, error) {
		return func(p *corev1.Pod) (*corev1.Pod, error) {
			return c.CoreV1().Pods("default").Update(ctx, p, metav1.UpdateOptions{})
		}
	}
	p, err := shared.alice.CoreV1().Pods("default").Create(ctx, fracPod(map[string]string{"gpu-fraction": "0.5"}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	p.Annotations[devices] = "GPU-aaaa"
	_, err = pods(shared.alice)(p.DeepCopy())
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "GPU-aaaa" can be set, changed or removed only by the scheduler (`+schedulerUser+`), not by alice`)

	// The scheduler writes its decision, as its PreBind does.
	p.Annotations["nvidia.com/container.main.gpu-memory.request"] = "40448Mi"
	p.Annotations["nvidia.com/container.main.gpu-memory.limit"] = "40448Mi"
	written, err := pods(shared.scheduler)(p.DeepCopy())
	if err != nil {
		t.Fatalf("scheduler denied: %v", err)
	}

	edited := written.DeepCopy()
	edited.Annotations[devices] = "GPU-bbbb"
	_, err = pods(shared.alice)(edited)
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "GPU-bbbb" can be set, changed or removed only by the scheduler (`+schedulerUser+`), not by alice`)

	removed := written.DeepCopy()
	delete(removed.Annotations, devices)
	_, err = pods(shared.alice)(removed)
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "(removed; was GPU-aaaa)" can be set, changed or removed only by the scheduler (`+schedulerUser+`), not by alice`)

	raised := written.DeepCopy()
	raised.Annotations["nvidia.com/container.main.gpu-memory.limit"] = "80000Mi"
	_, err = pods(shared.alice)(raised)
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`nvidia.com/container.main.gpu-memory.limit "80000Mi" cannot change: the pod is already scheduled to a GPU, so its GPU-fraction annotations are fixed; resize its memory with gpufrac.io/resize.gpu-memory.request (and gpufrac.io/resize.gpu-memory.limit), or delete and recreate the pod to ask for another fraction`)

	// A JSON merge patch that deletes the key, as `kubectl annotate key-` does.
	_, err = shared.alice.CoreV1().Pods("default").Patch(ctx, p.Name, "application/merge-patch+json",
		[]byte(`{"metadata":{"annotations":{"`+devices+`":null}}}`), metav1.PatchOptions{})
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "(removed; was GPU-aaaa)" can be set, changed or removed only by the scheduler (`+schedulerUser+`), not by alice`)

	// Other annotations stay editable.
	other := written.DeepCopy()
	other.Annotations["team"] = "ml"
	if _, err := pods(shared.alice)(other); err != nil {
		t.Errorf("unrelated annotation edit denied: %v", err)
	}
}

func TestFractionFixedOnceBound(t *testing.T) {
	ctx := context.Background()
	p := fracPod(map[string]string{"gpu-fraction": "0.5"})
	p.Spec.NodeName = "gpu-node-1"
	// Only a scheduler creates a fractional pod bound (a user may not:
	// TestTenantCannotSquatANode).
	bound, err := shared.scheduler.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bound.Annotations["gpu-fraction"] = "0.75"
	_, err = shared.alice.CoreV1().Pods("default").Update(ctx, bound, metav1.UpdateOptions{})
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`gpu-fraction "0.75" cannot change: the pod is already scheduled to node gpu-node-1, so its GPU-fraction annotations are fixed; resize its memory with gpufrac.io/resize.gpu-memory.request (and gpufrac.io/resize.gpu-memory.limit), or delete and recreate the pod to ask for another fraction`)
}

// validateCalls is how many reviews the webhook's /validate has served
// in this process, from controller-runtime's request counter.
func validateCalls(t *testing.T) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, f := range families {
		if f.GetName() != "controller_runtime_webhook_requests_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "webhook" && l.GetValue() == "/validate" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// A Binding's annotations land on the pod it binds: only the scheduler's
// Binding may carry a GPU decision, and the API server copies it.
func TestBindingCarriesOnlyTheSchedulersDecision(t *testing.T) {
	ctx := context.Background()
	devices := "nvidia.com/container.main.gpus.devices"
	bind := func(c *kubernetes.Clientset, name string, annotations map[string]string) error {
		return c.CoreV1().Pods("default").Bind(ctx, &corev1.Binding{
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations},
			Target:     corev1.ObjectReference{Kind: "Node", Name: "gpu-node-1"},
		}, metav1.CreateOptions{})
	}
	p, err := shared.alice.CoreV1().Pods("default").Create(ctx, fracPod(map[string]string{"gpu-fraction": "0.5"}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// alice is a cluster admin here: RBAC lets her bind, the webhook does not.
	before := validateCalls(t)
	err = bind(shared.alice, p.Name, map[string]string{devices: "GPU-aaaa"})
	deniedWith(t, err, "bindings.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "GPU-aaaa" can be written by a Binding only by the scheduler (`+schedulerUser+`), not by alice`)
	if got := validateCalls(t); got != before+1 {
		t.Errorf("alice's binding: %v calls to /validate, want 1", got-before)
	}
	// The scheduler's own Binding is admitted without a call to the
	// webhook (the not-from-the-scheduler match condition).
	decision := map[string]string{devices: "GPU-aaaa", "nvidia.com/container.main.gpu-memory.request": "40448Mi", api.GPUGroupsAnnotation: "g1"}
	before = validateCalls(t)
	if err := bind(shared.scheduler, p.Name, decision); err != nil {
		t.Fatalf("the scheduler's binding was refused: %v", err)
	}
	if got := validateCalls(t); got != before {
		t.Errorf("the scheduler's binding: %v calls to /validate, want none", got-before)
	}
	got, err := shared.admin.CoreV1().Pods("default").Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Spec.NodeName != "gpu-node-1" || got.Annotations[devices] != "GPU-aaaa" || got.Annotations[api.GPUGroupsAnnotation] != "g1" {
		t.Errorf("bound pod: node %q, annotations %v: want the binding's node and decision", got.Spec.NodeName, got.Annotations)
	}
}

// The scheduler's keys are guarded on every path that writes a pod's
// annotations: an update of pods/status keeps annotation changes, and the
// legacy bindings resource binds as pods/binding does.
func TestSchedulerKeysGuardedOnStatusAndLegacyBindings(t *testing.T) {
	ctx := context.Background()
	devices := "nvidia.com/container.main.gpus.devices"
	p, err := shared.alice.CoreV1().Pods("default").Create(ctx, fracPod(map[string]string{"gpu-fraction": "0.5"}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	forged := p.DeepCopy()
	forged.Annotations[devices] = "GPU-aaaa"
	_, err = shared.alice.CoreV1().Pods("default").UpdateStatus(ctx, forged, metav1.UpdateOptions{})
	deniedWith(t, err, "pods.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "GPU-aaaa" can be set, changed or removed only by the scheduler (`+schedulerUser+`), not by alice`)
	// A status update that leaves the annotations alone is not sent to the
	// webhook at all (the kubelet's, every few seconds).
	before := validateCalls(t)
	status := p.DeepCopy()
	status.Status.Message = "hello"
	if _, err := shared.alice.CoreV1().Pods("default").UpdateStatus(ctx, status, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("a status update without annotation changes was refused: %v", err)
	}
	if got := validateCalls(t); got != before {
		t.Errorf("a status update without annotation changes: %v calls to /validate, want none", got-before)
	}

	binding := &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: "default", Annotations: map[string]string{devices: "GPU-aaaa"}},
		Target:     corev1.ObjectReference{Kind: "Node", Name: "gpu-node-1"},
	}
	err = shared.alice.CoreV1().RESTClient().Post().Namespace("default").Resource("bindings").Body(binding).Do(ctx).Error()
	deniedWith(t, err, "bindings.validate.gpufrac.io",
		`container "main": nvidia.com/container.main.gpus.devices "GPU-aaaa" can be written by a Binding only by the scheduler (`+schedulerUser+`), not by alice`)
	got, err := shared.admin.CoreV1().Pods("default").Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Spec.NodeName != "" || got.Annotations[devices] != "" {
		t.Errorf("pod after the refused writes: node %q, devices %q; want neither", got.Spec.NodeName, got.Annotations[devices])
	}
}
