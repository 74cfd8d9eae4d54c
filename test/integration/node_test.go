package integration

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpufrac/gpufrac/internal/health"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
	"github.com/gpufrac/gpufrac/pkg/node/agent"
	"github.com/gpufrac/gpufrac/pkg/node/dra"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
	"github.com/gpufrac/gpufrac/pkg/node/publish"
	"github.com/gpufrac/gpufrac/pkg/node/reservation"
)

// kubelet serves the real PodResources v1 API on a unix socket: the one
// stand-in, since no kubelet runs here.
type kubelet struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	pods []*podresourcesv1.PodResources
}

func (k *kubelet) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	return &podresourcesv1.ListPodResourcesResponse{PodResources: k.pods}, nil
}

func serveKubelet(t *testing.T, k *kubelet) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "kubelet.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, k)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return sock
}

func gpuPod(ns, name string, devices ...string) *podresourcesv1.PodResources {
	return &podresourcesv1.PodResources{Namespace: ns, Name: name, Containers: []*podresourcesv1.ContainerResources{{
		Name: "reserve", Devices: []*podresourcesv1.ContainerDevices{
			{ResourceName: api.ResourceGPU, DeviceIds: devices},
			{ResourceName: "example.com/nic", DeviceIds: []string{"nic-0"}},
		},
	}}}
}

// createNamespace makes a fresh namespace named after prefix, so the
// tests also pass when run again against the same API server (-count).
func createNamespace(t *testing.T, prefix string) string {
	t.Helper()
	ns, err := shared.admin.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

// uniqueName suffixes a cluster-scoped name (nodes) per run.
func uniqueName(name string) string { return fmt.Sprintf("%s-%d", name, time.Now().UnixNano()) }

func reservationPod(t *testing.T, ns, name, node string) {
	t.Helper()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: corev1.PodSpec{NodeName: node,
		Containers: []corev1.Container{{Name: "reserve", Image: "pause"}}}}
	if _, err := shared.admin.CoreV1().Pods(ns).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func reservedGPU(t *testing.T, ns, name string) string {
	t.Helper()
	p, err := shared.admin.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p.Annotations[api.ReservedGPUAnnotation]
}

func TestReservationPodsLearnTheirGPUFromTheKubelet(t *testing.T) {
	ctx := context.Background()
	ns := createNamespace(t, "gpufrac-reserve-a")
	reservationPod(t, ns, "node-1-gpu-group-0", "node-1")
	reservationPod(t, ns, "node-1-gpu-group-1", "node-1") // not admitted by the kubelet yet
	reservationPod(t, ns, "node-2-gpu-group-0", "node-2") // another node's

	k := &kubelet{pods: []*podresourcesv1.PodResources{
		gpuPod(ns, "node-1-gpu-group-0", "GPU-1111"),
		gpuPod("default", "whole-gpu-job", "GPU-2222"),
	}}
	source, err := reservation.DialKubelet(serveKubelet(t, k))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = source.Close() }()
	a := &reservation.Annotator{Client: shared.admin, Node: "node-1", Namespace: ns, Source: source}
	n, err := a.Sync(ctx)
	if err != nil || n != 1 {
		t.Fatalf("Sync = %d, %v; want 1 annotated", n, err)
	}
	if got := reservedGPU(t, ns, "node-1-gpu-group-0"); got != "GPU-1111" {
		t.Errorf("reserved GPU = %q, want GPU-1111", got)
	}
	for _, name := range []string{"node-1-gpu-group-1", "node-2-gpu-group-0"} {
		if got := reservedGPU(t, ns, name); got != "" {
			t.Errorf("%s annotated with %q before the kubelet assigned it a GPU on this node", name, got)
		}
	}

	// The kubelet admits the second pod; a resync annotates it and leaves
	// the first alone.
	k.pods = append(k.pods, gpuPod(ns, "node-1-gpu-group-1", "GPU-3333"))
	if n, err := a.Sync(ctx); err != nil || n != 1 {
		t.Fatalf("second Sync = %d, %v", n, err)
	}
	if got := reservedGPU(t, ns, "node-1-gpu-group-1"); got != "GPU-3333" {
		t.Errorf("reserved GPU = %q, want GPU-3333", got)
	}

	// Which group's pod holds which GPU, for the shares gpufrac placed.
	labelled := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "node-1-gpu-group-9", Namespace: ns, Labels: api.ReservationLabels("g9", false)},
		Spec: corev1.PodSpec{NodeName: "node-1", Containers: []corev1.Container{{Name: "reserve", Image: "pause"}}}}
	if _, err := shared.admin.CoreV1().Pods(ns).Create(ctx, labelled, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	k.pods = append(k.pods, gpuPod(ns, "node-1-gpu-group-9", "GPU-9999"))
	if _, err := a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if got := a.HeldByGroup(); !maps.Equal(got, map[string]string{"g9": "GPU-9999"}) {
		t.Errorf("GPUs by group: %v, want g9's GPU-9999 (the other pods name no group)", got)
	}

	// What holds a share's GPU: a reservation pod, gpufrac's or KAI's,
	// never a whole-GPU workload that the device plugin gave it to.
	k.pods = append(k.pods, gpuPod("kai-resource-reservation", "gpu-reservation-x", "GPU-4444::1"))
	held, err := source.Allocated(ctx, ns, "kai-resource-reservation")
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]bool{"GPU-1111": true, "GPU-3333": true, "GPU-4444": true, "GPU-9999": true}; !maps.Equal(held, want) {
		t.Errorf("GPUs held by reservation pods: %v, want %v (not the whole-GPU job's GPU-2222)", held, want)
	}
}

func TestSimulatedDevicePluginAssignsDistinctGPUs(t *testing.T) {
	ctx := context.Background()
	ns := createNamespace(t, "gpufrac-reserve-b")
	inv := simulatedInventory(t, "dgxh100")
	var uuids []string
	for _, g := range inv.GPUs {
		uuids = append(uuids, g.UUID)
	}
	a := &reservation.Annotator{Client: shared.admin, Node: "sim-1", Namespace: ns, Source: &reservation.Simulated{GPUs: uuids}}
	for _, name := range []string{"r0", "r1", "r2"} {
		reservationPod(t, ns, name, "sim-1")
		time.Sleep(1100 * time.Millisecond) // distinct creation timestamps (second resolution)
		if _, err := a.Sync(ctx); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]string{}
	for i, name := range []string{"r0", "r1", "r2"} {
		got := reservedGPU(t, ns, name)
		if got != uuids[i] {
			t.Errorf("%s holds %q, want the lowest free GPU %q", name, got, uuids[i])
		}
		if other, dup := seen[got]; dup {
			t.Errorf("%s and %s hold the same GPU %s", name, other, got)
		}
		seen[got] = name
	}
}

func TestNodeConditionAndLabels(t *testing.T) {
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: uniqueName("gpu-node-publish"), Labels: map[string]string{"team": "ml"}}}
	if _, err := shared.admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	other := corev1.NodeCondition{Type: "example.com/Other", Status: corev1.ConditionTrue, Reason: "X", LastTransitionTime: metav1.Now()}
	node.Status.Conditions = []corev1.NodeCondition{other}
	if _, err := shared.admin.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	lib, _ := inventory.Simulated("dgxh100")
	inv, err := inventory.Read(lib)
	if err != nil {
		t.Fatal(err)
	}
	state := publish.State{Inventory: inv, Backend: nodeapi.BackendMPSPinned, PublishGPULabels: true}
	read := func() *corev1.Node {
		n, err := shared.admin.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	condition := func(n *corev1.Node) corev1.NodeCondition {
		for _, c := range n.Status.Conditions {
			if c.Type == publish.ConditionReady {
				return c
			}
		}
		t.Fatalf("no %s condition: %v", publish.ConditionReady, n.Status.Conditions)
		return corev1.NodeCondition{}
	}

	// Not registered with the runtime yet: visible, not ready.
	if err := publish.Apply(ctx, shared.admin, read(), publish.Compute(state, nil)); err != nil {
		t.Fatal(err)
	}
	n := read()
	if c := condition(n); c.Status != corev1.ConditionFalse || c.Reason != publish.ReasonNRI {
		t.Errorf("condition = %+v", c)
	}
	// The quota charge is advertised, so that every counter of extended
	// resources (kube-scheduler's queueing hints, KAI, the kubelet) takes it.
	for _, list := range []corev1.ResourceList{n.Status.Capacity, n.Status.Allocatable} {
		if q := list[api.ResourceGPUMemory]; q.Cmp(api.ChargeCapacity) != 0 {
			t.Errorf("node advertises %s of %s, want %s (capacity and allocatable)", q.String(), api.ResourceGPUMemory, api.ChargeCapacity.String())
		}
	}
	want := map[string]string{"team": "ml", api.LabelGPUCount: "8", api.LabelGPUMemory: "81920",
		api.LabelGPUProduct: "NVIDIA-H100-80GB-HBM3", api.LabelMemoryEnforcement: "mps-pinned",
		publish.LabelDriverVersion: inv.DriverVersion, publish.LabelCUDAVersion: inv.CUDAVersion(), publish.LabelInventoryOwner: "agent"}
	for k, v := range want {
		if n.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, n.Labels[k], v)
		}
	}
	firstTransition := condition(n).LastTransitionTime

	// Registered: ready, and the other component's condition survives.
	state.NRIRegistered = true
	time.Sleep(1100 * time.Millisecond)
	if err := publish.Apply(ctx, shared.admin, n, publish.Compute(state, n.Labels)); err != nil {
		t.Fatal(err)
	}
	n = read()
	c := condition(n)
	if c.Status != corev1.ConditionTrue || c.Reason != publish.ReasonReady || !c.LastTransitionTime.After(firstTransition.Time) {
		t.Errorf("condition after registration = %+v (first transition %v)", c, firstTransition)
	}
	found := false
	for _, c := range n.Status.Conditions {
		found = found || c.Type == other.Type
	}
	if !found {
		t.Errorf("another component's condition was dropped: %v", n.Status.Conditions)
	}

	// A heartbeat with the same status keeps the transition time.
	secondTransition := c.LastTransitionTime
	time.Sleep(1100 * time.Millisecond)
	if err := publish.Apply(ctx, shared.admin, n, publish.Compute(state, n.Labels)); err != nil {
		t.Fatal(err)
	}
	if c := condition(read()); !c.LastTransitionTime.Equal(&secondTransition) || !c.LastHeartbeatTime.After(secondTransition.Time) {
		t.Errorf("heartbeat moved the transition time or not the heartbeat: %+v", c)
	}
}

// The whole agent in simulate mode against the real API server: it
// publishes the node ready once its NRI plugin has registered, annotates
// reservation pods, and marks the node not ready when it stops.
func TestNodeAgentSimulated(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	nodeName := uniqueName("sim-agent-node")
	if _, err := shared.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ns := createNamespace(t, "gpufrac-reserve-c")
	reservationPod(t, ns, "gpu-group-0", nodeName)

	healthAddr, metricsAddr := freeAddr(t), freeAddr(t)
	authorize, err := health.KubernetesAuthorizer(shared.adminConfig)
	if err != nil {
		t.Fatal(err)
	}
	a := agent.New(agent.Options{
		NodeName: nodeName, SimulateGPUs: "dgxh200", ReservationNamespace: ns, HealthAddr: healthAddr,
		MetricsAddr: metricsAddr, MetricsAuth: authorize,
		StateDir: t.TempDir(), PublishGPULabels: true, ResyncPeriod: 200 * time.Millisecond,
		// Simulated and without MPS: no containers run here.
	}, shared.admin)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()

	readyCondition := func() corev1.NodeCondition {
		n, err := shared.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range n.Status.Conditions {
			if c.Type == publish.ConditionReady {
				return c
			}
		}
		return corev1.NodeCondition{}
	}
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return readyCondition().Status == corev1.ConditionTrue && reservedGPU(t, ns, "gpu-group-0") != "", nil
	}); err != nil {
		t.Fatalf("node never became ready with its reservation annotated: condition %+v", readyCondition())
	}
	if err := a.Ready(); err != nil {
		t.Errorf("agent not ready: %v", err)
	}
	n, _ := shared.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	// The mock machine's driver (550) predates driver limits: auto picks
	// the weak MPS limits and says so.
	if n.Labels[api.LabelGPUCount] != "8" || n.Labels[api.LabelGPUProduct] != "NVIDIA-H200-141GB-HBM3e" ||
		n.Labels[api.LabelMemoryEnforcement] != "mps-pinned" {
		t.Errorf("inventory labels = %v", n.Labels)
	}

	for path, want := range map[string]string{
		"/readyz":  "ok",
		"/healthz": "ok",
	} {
		body := httpGet(t, "http://"+healthAddr+path)
		if !strings.Contains(body, want) {
			t.Errorf("GET %s: %q lacks %q", path, body, want)
		}
	}
	// The metrics name every tenant's pods: not on the probes' plain port,
	// and on their own only for a token allowed to get /metrics.
	if body := httpGet(t, "http://"+healthAddr+"/metrics"); strings.Contains(body, "gpufrac_") {
		t.Errorf("the plain health port serves the metrics: %.200s", body)
	}
	code, _ := metricsGet(t, metricsAddr, "", http.StatusUnauthorized)
	if code != http.StatusUnauthorized {
		t.Errorf("GET /metrics without a token: %d, want 401", code)
	}
	code, _ = metricsGet(t, metricsAddr, serviceAccountToken(t, ns, "tenant", false), http.StatusForbidden)
	if code != http.StatusForbidden {
		t.Errorf("GET /metrics as a service account without the right: %d, want 403", code)
	}
	code, body := metricsGet(t, metricsAddr, serviceAccountToken(t, ns, "prometheus", true), http.StatusOK)
	if code != http.StatusOK || !strings.Contains(body, `gpufrac_memory_enforcement{backend="mps-pinned"} 1`) ||
		strings.Count(body, "gpufrac_gpu_memory_total_bytes{") != 8 || !strings.Contains(body, "gpufrac_node_ready 1") {
		t.Errorf("GET /metrics as the metrics reader: %d, metrics lack the enforcement, the 8 GPUs or readiness:\n%.500s", code, body)
	}
	// The simulated GPUs' use: each readable (the model says every figure),
	// and on the Node for top and the dashboard at the first resync (its
	// period between rewrites is a minute by default).
	if strings.Count(body, "gpufrac_gpu_usage_readable{") != 16 || !strings.Contains(body, "gpufrac_usage_sample_duration_seconds ") {
		t.Errorf("GET /metrics: the usage readings are missing:\n%.800s", body)
	}
	if u, ok, err := api.UsageOf(n); !ok || err != nil || len(u.GPUs) != 8 || u.GPUs[0].UsedMiB == nil || u.WindowSeconds != 3600 {
		t.Errorf("the Node's usage annotation: %v %v %+v", ok, err, u)
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("agent stopped with error: %v", err)
	}
	if c := readyCondition(); c.Status != corev1.ConditionFalse || c.Reason != "AgentStopped" {
		t.Errorf("condition after the agent stopped = %+v", c)
	}
}

// The node is ready for fractions only while its MPS daemon answers:
// before the daemon starts, and after it stops, the condition says why
// (the supervisor's last word); a daemon replaced after a crash brings the
// node back.
func TestNodeAgentReadinessFollowsTheMPSDaemon(t *testing.T) {
	mpstest.Use(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	nodeName := uniqueName("mps-agent-node")
	if _, err := shared.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	root, err := os.MkdirTemp("/tmp", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	a := agent.New(agent.Options{
		NodeName: nodeName, SimulateGPUs: "dgxh200", ReservationNamespace: "default", StateDir: t.TempDir(),
		ResyncPeriod: 200 * time.Millisecond, MPSControl: os.Args[0], Injection: injection.Config{MPSRoot: root},
	}, shared.admin)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v", err)
		}
	}()

	condition := func(status corev1.ConditionStatus, reason, message string) {
		t.Helper()
		var last corev1.NodeCondition
		if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			n, err := shared.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			for _, c := range n.Status.Conditions {
				if c.Type == publish.ConditionReady {
					last = c
				}
			}
			return last.Status == status && last.Reason == reason && strings.Contains(last.Message, message), nil
		}); err != nil {
			t.Fatalf("condition %+v, want %s/%s with %q", last, status, reason, message)
		}
	}
	condition(corev1.ConditionFalse, publish.ReasonMPS, "no MPS control daemon has been started")

	d := mps.NewDaemon(os.Args[0], root, 550) // the mock machine's driver
	d.ProbeInterval, d.CommandTimeout, d.MinBackoff, d.StopGrace, d.ServerBinary = 100*time.Millisecond, time.Second, 50*time.Millisecond, 2*time.Second, ""
	dctx, stopDaemon := context.WithCancel(ctx)
	daemonDone := make(chan struct{})
	go func() { defer close(daemonDone); _ = d.Run(dctx) }()
	defer func() { stopDaemon(); <-daemonDone }()
	condition(corev1.ConditionTrue, publish.ReasonReady, "MPS v2")

	st, err := mps.ReadStatus(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(st.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		s, _ := mps.ReadStatus(root)
		return s.Generation == 2 && s.Running, nil
	}); err != nil {
		t.Fatal("the crashed daemon was not replaced")
	}
	condition(corev1.ConditionTrue, publish.ReasonReady, "MPS v2")

	stopDaemon()
	<-daemonDone
	condition(corev1.ConditionFalse, publish.ReasonMPS, "its supervisor (the MPS daemon's pod) is shutting down")
}

// The agent's Events and evictions reach the API server.
func TestNodeAgentEventsAndEvictions(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	nodeName := uniqueName("sim-events-node")
	if _, err := shared.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ns := createNamespace(t, "agent-events")
	victim := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "unenforced", Namespace: ns},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "cuda"}}}}
	victim, err := shared.admin.CoreV1().Pods(ns).Create(ctx, victim, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	a := agent.New(agent.Options{NodeName: nodeName, SimulateGPUs: "dgxa100", ReservationNamespace: ns,
		StateDir: t.TempDir(), ResyncPeriod: time.Second}, shared.admin)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent stopped with error: %v", err)
		}
	}()
	if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return a.Ready() == nil, nil
	}); err != nil {
		t.Fatalf("agent not ready: %v", a.Ready())
	}

	ref := nriplugin.PodRef{Namespace: victim.Namespace, Name: victim.Name, UID: string(victim.UID)}
	a.Refused(ref, "main", errors.New("no scheduler decision"))
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		events, err := shared.admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.Reason == "GPUFractionRefused" && e.InvolvedObject.Name == victim.Name && e.Type == corev1.EventTypeWarning {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("no GPUFractionRefused event: %v", err)
	}

	// A tenant's disruption budget does not keep it running: the budget
	// would refuse an eviction, and the agent deletes the pod.
	one := intstr.FromInt32(1)
	victim.Labels = map[string]string{"app": "pinned"}
	if victim, err = shared.admin.CoreV1().Pods(ns).Update(ctx, victim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Running and ready, as a budget protects it (a pending pod's
	// eviction ignores budgets).
	victim.Status.Phase = corev1.PodRunning
	victim.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	if _, err = shared.admin.CoreV1().Pods(ns).UpdateStatus(ctx, victim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := shared.admin.PolicyV1().PodDisruptionBudgets(ns).Create(ctx, &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "pin", Namespace: ns},
		Spec:       policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: victim.Labels}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err = shared.admin.PolicyV1().Evictions(ns).Evict(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: victim.Name, Namespace: ns}})
	if !apierrors.IsTooManyRequests(err) {
		t.Fatalf("the budget does not refuse an eviction (%v): the test would prove nothing", err)
	}
	// The agent names the pod by UID: a stale reference removes nothing.
	stale := ref
	stale.UID = "00000000-0000-0000-0000-000000000000"
	if err := a.Evict(ctx, stale, "test"); err == nil {
		t.Error("removal with a stale UID succeeded")
	}
	if err := a.Evict(ctx, ref, "test"); err != nil {
		t.Fatalf("evict: %v", err)
	}
	if _, err := shared.admin.CoreV1().Pods(ns).Get(ctx, victim.Name, metav1.GetOptions{}); err == nil {
		t.Error("the pod still exists under its disruption budget")
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().String()
}

// serviceAccountToken makes a service account in ns and returns a token
// of it; reader binds it to the role that may get /metrics (the chart's
// gpufrac-metrics-reader).
func serviceAccountToken(t *testing.T, ns, name string, reader bool) string {
	t.Helper()
	ctx := context.Background()
	if _, err := shared.admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if reader {
		role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: ns + "-metrics-reader"},
			Rules: []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}}}
		if _, err := shared.admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: role.Name},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
			Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: ns, Name: name}}}
		if _, err := shared.admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = shared.admin.RbacV1().ClusterRoleBindings().Delete(context.Background(), role.Name, metav1.DeleteOptions{})
			_ = shared.admin.RbacV1().ClusterRoles().Delete(context.Background(), role.Name, metav1.DeleteOptions{})
		})
	}
	tok, err := shared.admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return tok.Status.Token
}

// metricsGet gets /metrics from the agent's TLS port (its certificate is
// self-signed) with a bearer token, retried until it answers want (or 15 s
// pass: the RBAC a test just wrote takes a moment to reach the authorizer).
func metricsGet(t *testing.T, addr, token string, want int) (int, string) {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // the agent's self-signed certificate
	var code int
	var body string
	_ = wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 15*time.Second, true, func(ctx context.Context) (bool, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+addr+"/metrics", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			return false, nil // not listening yet
		}
		defer func() { _ = resp.Body.Close() }()
		raw, _ := io.ReadAll(resp.Body)
		code, body = resp.StatusCode, string(raw)
		return code == want, nil
	})
	return code, body
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url) //nolint:gosec,noctx // a test against a local server
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

// With --dra the agent serves the DRA driver: it asks for its GPUs to be
// held for shares (the node label), and publishes only the GPU a standing
// reservation pod holds, with what the scheduler says annotation shares
// hold of it taken off, and without the other mode's device.
func TestNodeAgentPublishesWhatStandingGPUsOffer(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	nodeName := uniqueName("sim-dra-node")
	if _, err := shared.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = shared.admin.CoreV1().Nodes().Delete(context.Background(), nodeName, metav1.DeleteOptions{})
	})
	ns := createNamespace(t, "gpufrac-reserve-dra")
	standing := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "standing-0", Namespace: ns,
			Labels:      map[string]string{api.GPUGroupLabel: ledgers.StandingGroup(0)},
			Annotations: map[string]string{api.SharesHeldAnnotation: api.SharesHeld{MemoryMiB: 40960, Mode: api.TimeSlicing}.String()}},
		Spec: corev1.PodSpec{NodeName: nodeName, Containers: []corev1.Container{{Name: "reserve", Image: "pause"}}},
	}
	if _, err := shared.admin.CoreV1().Pods(ns).Create(ctx, standing, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a := agent.New(agent.Options{
		NodeName: nodeName, SimulateGPUs: "dgxh100", ReservationNamespace: ns, StateDir: t.TempDir(),
		PublishGPULabels: true, ResyncPeriod: 200 * time.Millisecond, DRA: agent.DRAOptions{Enabled: true, StandingGPUs: 3},
	}, shared.admin)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()

	var devices []resourceapi.Device
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := shared.admin.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + nodeName})
		if err != nil {
			return false, err
		}
		devices = nil
		for _, s := range list.Items {
			devices = append(devices, s.Spec.Devices...)
		}
		return len(devices) > 0, nil
	})
	uuid := reservedGPU(t, ns, "standing-0")
	if err != nil {
		t.Fatalf("no device published (standing pod's GPU %q): %v", uuid, err)
	}
	want, _ := api.DRADeviceName(uuid, api.TimeSlicing)
	if len(devices) != 1 || devices[0].Name != want {
		names := []string{}
		for _, d := range devices {
			names = append(names, d.Name)
		}
		t.Fatalf("devices %v, want only %s: the one GPU held for shares, in the mode its shares use", names, want)
	}
	q := devices[0].Capacity[dra.CapacityMemory].Value
	total := simulatedInventory(t, "dgxh100").GPUs[0].MemoryMiB
	if got := q.Value() >> 20; got != total-40960 {
		t.Errorf("memory offered: %dMi, want the GPU's %dMi less the annotation shares' 40960Mi", got, total)
	}
	n, err := shared.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n.Labels[api.LabelStandingGPUs] != "3" {
		t.Errorf("node label %s = %q, want 3", api.LabelStandingGPUs, n.Labels[api.LabelStandingGPUs])
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("agent stopped with error: %v", err)
	}
}

// Issue 54: a simulated node is the same node after its agent restarts:
// its GPUs keep their UUIDs, so the state file, the reservation pods and
// the books that name them still do, and the node is ready for fractions
// again (it used to stay ComputeModeNotExclusive, "no such GPU").
func TestSimulatedAgentRestartsToItsOwnGPUs(t *testing.T) {
	nodeName := uniqueName("restarting-node")
	if _, err := shared.admin.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ns := createNamespace(t, "gpufrac-reserve-r")
	reservationPod(t, ns, "gpu-group-0", nodeName)
	state := t.TempDir()
	ready := func() (corev1.NodeCondition, error) {
		n, err := shared.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return corev1.NodeCondition{}, err
		}
		for _, c := range n.Status.Conditions {
			if c.Type == publish.ConditionReady {
				return c, nil
			}
		}
		return corev1.NodeCondition{}, nil
	}
	run := func(which string) string {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		a := agent.New(agent.Options{
			NodeName: nodeName, SimulateGPUs: "dgxh100", ReservationNamespace: ns, StateDir: state,
			PublishGPULabels: true, ResyncPeriod: 200 * time.Millisecond,
			Injection: injection.Config{ExclusiveProcess: true},
		}, shared.admin)
		done := make(chan error, 1)
		go func() { done <- a.Run(ctx) }()
		var last corev1.NodeCondition
		var gpu string
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			c, err := ready()
			last, gpu = c, reservedGPU(t, ns, "gpu-group-0")
			return err == nil && c.Status == corev1.ConditionTrue && gpu != "", err
		})
		cancel()
		if derr := <-done; derr != nil {
			t.Errorf("%s agent: %v", which, derr)
		}
		if err != nil {
			t.Fatalf("the %s agent: the node never became ready with its reservation annotated: %+v", which, last)
		}
		return gpu
	}
	first := run("first")
	if again := run("restarted"); again != first {
		t.Errorf("the reservation's GPU is %s after the restart, %s before", again, first)
	}
	// The GPU its books name is one the node has, whenever it is read.
	lib, err := inventory.SimulatedFor("dgxh100", nodeName)
	if err != nil {
		t.Fatal(err)
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(inv.GPUs, func(g inventory.GPU) bool { return g.UUID == first }) {
		t.Errorf("the reservation holds %s, which is none of the node's GPUs %+v", first, inv.GPUs)
	}
}
