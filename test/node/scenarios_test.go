//go:build nodee2e || charte2e

package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

const ns = "default"

func probe(name string, env map[string]string) corev1.Container {
	c := corev1.Container{Name: name, Image: probeImage, ImagePullPolicy: corev1.PullNever}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		c.Env = append(c.Env, corev1.EnvVar{Name: k, Value: env[k]})
	}
	return c
}

// waitRefused waits until the pod's container is held back with why in
// its waiting message, and fails the test if it ever starts.
func waitRefused(t *testing.T, name, why string) {
	t.Helper()
	if err := waitFor("pod "+name+" to be refused", 60*time.Second, func() (bool, error) {
		for _, c := range getPod(t, name).Status.ContainerStatuses {
			if c.State.Running != nil || c.State.Terminated != nil {
				return false, fmt.Errorf("its container started: %+v", c.State)
			}
			if w := c.State.Waiting; w != nil && strings.Contains(w.Message, why) {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Error(err)
	}
}

// tenantUser runs a pod's containers as an ordinary user, as a tenant's
// should: the agent refuses fractional containers that run as root (an MPS
// client as root may quit the node's daemon).
func tenantUser() *corev1.PodSecurityContext {
	return &corev1.PodSecurityContext{RunAsUser: new(int64(1000)), RunAsNonRoot: new(true)}
}

// createPod creates a pod for gpufrac's scheduler and deletes it at the
// end of the test, waiting until the kubelet has stopped its containers.
func createPod(t *testing.T, name string, annotations map[string]string, containers ...corev1.Container) *corev1.Pod {
	t.Helper()
	return createPodWith(t, name, annotations, nil, containers...)
}

// createPodWith is createPod with the pod changed by edit before it is
// created.
func createPodWith(t *testing.T, name string, annotations map[string]string, edit func(*corev1.Pod), containers ...corev1.Container) *corev1.Pod {
	t.Helper()
	off := false
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: annotations},
		Spec: corev1.PodSpec{SchedulerName: "gpufrac", RestartPolicy: corev1.RestartPolicyNever, Containers: containers,
			AutomountServiceAccountToken: &off, EnableServiceLinks: &off, TerminationGracePeriodSeconds: new(int64(2)),
			SecurityContext: tenantUser()},
	}
	if edit != nil {
		edit(pod)
	}
	created, err := theNode.admin.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deletePod(t, name) })
	return created
}

func deletePod(t *testing.T, name string) {
	ctx := context.Background()
	err := theNode.admin.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return
	}
	if err != nil {
		t.Errorf("delete pod %s: %v", name, err)
		return
	}
	if err := waitFor("pod "+name+" to be gone", 60*time.Second, func() (bool, error) {
		_, err := theNode.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Error(err)
	}
}

func getPod(t *testing.T, name string) *corev1.Pod {
	t.Helper()
	pod, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// running waits until the pod runs on the node and returns it.
func running(t *testing.T, name string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	err := waitFor("pod "+name+" Running", 2*time.Minute, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			return false, fmt.Errorf("pod %s ended: %s %s %+v", name, p.Status.Reason, p.Status.Message, p.Status.ContainerStatuses)
		}
		return p.Status.Phase == corev1.PodRunning, nil
	})
	if err != nil {
		t.Fatalf("%v (pod status %+v, annotations %v)", err, pod.Status, pod.Annotations)
	}
	if pod.Spec.NodeName != nodeName {
		t.Fatalf("pod %s runs on %q, not on the real node", name, pod.Spec.NodeName)
	}
	return pod
}

func assignment(t *testing.T, pod *corev1.Pod, container string) api.Assignment {
	t.Helper()
	as, err := api.ParseAssignments(pod.Annotations)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range as {
		if a.Container == container {
			return a
		}
	}
	t.Fatalf("pod %s has no decision for container %s: %v", pod.Name, container, pod.Annotations)
	return api.Assignment{}
}

func containerID(t *testing.T, pod *corev1.Pod, container string) string {
	t.Helper()
	for _, s := range pod.Status.ContainerStatuses {
		if s.Name == container {
			_, id, _ := strings.Cut(s.ContainerID, "://")
			return id
		}
	}
	t.Fatalf("pod %s has no status for container %s", pod.Name, container)
	return ""
}

// checkInjected checks what a fractional container saw against the
// scheduler's decision.
func checkInjected(t *testing.T, r report, a api.Assignment) {
	t.Helper()
	want := map[string]string{
		nodeapi.EnvVisibleDevices:   strings.Join(a.DeviceNames(), ","),
		nodeapi.EnvMemoryRequest:    strconv.FormatInt(a.RequestMiB, 10),
		nodeapi.EnvMemoryLimit:      strconv.FormatInt(a.LimitMiB, 10),
		nodeapi.EnvMPSPipeDirectory: nodeapi.ContainerPipeDir,
	}
	for k, v := range want {
		if r.Env[k] != v {
			t.Errorf("container %s sees %s=%q, the decision says %q", a.Container, k, r.Env[k], v)
		}
	}
	// A time-slicing container's way into the node's MPS daemon: its main
	// socket.
	if !slices.Contains(r.MPSDir, "control") {
		t.Errorf("container %s's MPS pipe directory holds %v, not the daemon's control socket", a.Container, r.MPSDir)
	}
}

// checkLimits checks that the fake driver holds soft = request and hard =
// limit on every assigned GPU for the container's own cgroup, and that the
// cgroup is the container's real one: it exists, ends in the container's
// id and holds the probe's process.
func checkLimits(t *testing.T, pod *corev1.Pod, a api.Assignment, r report) {
	t.Helper()
	id := containerID(t, pod, a.Container)
	calls, err := theNode.limitCalls()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]limitCall{}
	for _, c := range calls {
		if strings.HasSuffix(c.Cgroup, id) {
			got[c.GPU] = c // the last call per GPU is what the driver holds
		}
	}
	if len(got) != len(a.Devices) {
		t.Fatalf("the driver holds limits for container %s on %d GPUs, want %d (%v); all calls: %+v", id, len(got), len(a.Devices), a.Devices, calls)
	}
	for _, uuid := range a.Devices {
		c, ok := got[uuid]
		if !ok {
			t.Errorf("no limits on GPU %s", uuid)
			continue
		}
		if c.Soft != uint64(a.RequestMiB)<<20 || c.Hard != uint64(a.LimitMiB)<<20 {
			t.Errorf("GPU %s: soft %d, hard %d; want request %dMi, limit %dMi", uuid, c.Soft, c.Hard, a.RequestMiB, a.LimitMiB)
		}
		mount, err := enforce.CgroupMount("/proc")
		if err != nil {
			t.Fatal(err)
		}
		if r.Cgroup != "/" && c.Cgroup != filepath.Join(mount, r.Cgroup) {
			t.Errorf("limits set on %s; the container is in %s under %s", c.Cgroup, r.Cgroup, mount)
		}
		// The probe itself runs in that cgroup (the node's PIDs: this test
		// runs in the node's PID namespace).
		procs, err := os.ReadFile(filepath.Join(c.Cgroup, "cgroup.procs"))
		if err != nil {
			t.Errorf("cgroup %s: %v", c.Cgroup, err)
			continue
		}
		var cmds []string
		for _, pid := range strings.Fields(string(procs)) {
			raw, _ := os.ReadFile(filepath.Join("/proc", pid, "cmdline"))
			cmds = append(cmds, strings.TrimRight(strings.ReplaceAll(string(raw), "\x00", " "), " "))
		}
		if !slices.Contains(cmds, "/bin/probe") {
			t.Errorf("the probe does not run in cgroup %s, which holds %q", c.Cgroup, cmds)
		}
	}
}

// A fractional pod placed by gpufrac's scheduler runs through the kubelet,
// containerd and runc: the container sees exactly the decision, and runc's
// createRuntime hook set soft = request, hard = limit on its real cgroup.
func TestFractionalPodRunsWithItsDecision(t *testing.T) {
	createPod(t, "frac", map[string]string{"gpu-memory": "4096", "gpu-memory.limit": "8Gi"}, probe("main", nil))
	pod := running(t, "frac")
	a := assignment(t, pod, "main")
	if a.RequestMiB != 4096 || a.LimitMiB != 8192 || len(a.Devices) != 1 {
		t.Fatalf("decision %+v, want one GPU, request 4096Mi, limit 8192Mi", a)
	}
	r := theNode.probeReport(t, pod, "main")
	checkInjected(t, r, a)
	checkLimits(t, pod, a, r)

	// The GPU came from the reservation pod the scheduler bound there,
	// which the kubelet gave that GPU through the device plugin.
	checkReservation(t, a.Devices[0])
}

// checkReservation finds the reservation pod holding uuid: it runs on the
// node, the kubelet allocated it uuid from the device-plugin stand-in, the
// PodResources API says so, and the agent wrote it on the pod.
func checkReservation(t *testing.T, uuid string) {
	t.Helper()
	list, err := theNode.admin.CoreV1().Pods(api.DefaultReservationNamespace).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var holder *corev1.Pod
	for i, p := range list.Items {
		if p.Annotations[api.ReservedGPUAnnotation] == uuid {
			holder = &list.Items[i]
		}
	}
	if holder == nil {
		t.Fatalf("no reservation pod is annotated with %s: %d reservation pods", uuid, len(list.Items))
	}
	if holder.Spec.NodeName != nodeName {
		t.Errorf("reservation pod %s is on %q", holder.Name, holder.Spec.NodeName)
	}
	if !slices.ContainsFunc(theNode.plugin.allocated(), func(ids []string) bool { return slices.Equal(ids, []string{uuid}) }) {
		t.Errorf("the device plugin never allocated %s; it allocated %v", uuid, theNode.plugin.allocated())
	}
	conn, err := grpc.NewClient("unix://"+theNode.podResourcesSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := podresources.NewPodResourcesListerClient(conn).List(ctx, &podresources.ListPodResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	for _, p := range resp.PodResources {
		for _, c := range p.Containers {
			for _, d := range c.Devices {
				if d.ResourceName == string(api.ResourceGPU) {
					seen = append(seen, p.Namespace+"/"+p.Name+"="+strings.Join(d.DeviceIds, ","))
				}
			}
		}
	}
	if want := holder.Namespace + "/" + holder.Name + "=" + uuid; !slices.Contains(seen, want) {
		t.Errorf("PodResources lists %v, not %s", seen, want)
	}
	if err := waitFor("reservation pod "+holder.Name+" Running", 60*time.Second, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(holder.Namespace).Get(context.Background(), holder.Name, metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning, nil
	}); err != nil {
		t.Error(err)
	}
}

// When the driver refuses the limits, runc's hook fails the container's
// creation: its process never runs, and the pod says why.
func TestLimitsThatCannotBeSetNeverRunTheProcess(t *testing.T) {
	failSet := filepath.Join(theNode.nvmlDir(), "fail-set")
	if err := os.WriteFile(failSet, []byte("999\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(failSet) })
	pod := createPod(t, "refused", map[string]string{"gpu-memory": "2048"}, probe("main", nil))
	var why string
	err := waitFor("pod refused to show why its container did not start", 2*time.Minute, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), "refused", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		for _, s := range p.Status.ContainerStatuses {
			for _, st := range []corev1.ContainerState{s.State, s.LastTerminationState} {
				if st.Waiting != nil && strings.Contains(st.Waiting.Message, "nvmlDeviceSetMemoryLimits_v1") {
					why = st.Waiting.Reason + ": " + st.Waiting.Message
				}
				if st.Terminated != nil && strings.Contains(st.Terminated.Message, "nvmlDeviceSetMemoryLimits_v1") {
					why = st.Terminated.Reason + ": " + st.Terminated.Message
				}
			}
		}
		return why != "", nil
	})
	if err != nil {
		t.Fatalf("%v: status %+v", err, pod.Status)
	}
	t.Logf("the pod says: %s", why)
	a := assignment(t, pod, "main")
	mount, err := enforce.CgroupMount("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"StartError", "gpufrac hook", "GPU " + a.Devices[0], "set memory limits (soft 2048Mi, hard 2048Mi) for cgroup " + mount + "/",
		"nvmlDeviceSetMemoryLimits_v1: Unknown Error"} {
		if !strings.Contains(why, want) {
			t.Errorf("the pod's reason %q does not name %q", why, want)
		}
	}
	if pod.Status.Phase == corev1.PodRunning {
		t.Errorf("pod refused is Running")
	}
	// The process never ran: the container printed nothing.
	logs, _ := filepath.Glob(filepath.Join(theNode.path("pod-logs"), fmt.Sprintf("%s_%s_%s", ns, pod.Name, pod.UID), "main", "*.log"))
	for _, l := range logs {
		if raw, _ := os.ReadFile(l); strings.Contains(string(raw), "probe: ") {
			t.Errorf("the refused container's process ran: %s", raw)
		}
	}
}

// A container that sets the GPU variables itself gets the decision's
// values instead (the image's NVIDIA_VISIBLE_DEVICES=all included), and
// one that would be an MPS client as root is refused; a
// sidecar of the same pod, not a GPU container, sees no GPU. A pod that
// sets a variable its image sets too is never started: the runtime would
// put the pod's value back over the decision's (measured here before the
// node refused it: the container saw "all").
func TestHostileEnvironmentIsReplacedAndSidecarsSeeNoGPU(t *testing.T) {
	hostile := map[string]string{
		nodeapi.EnvMemoryLimit: "999999", nodeapi.EnvMemoryRequest: "999999",
		nodeapi.EnvMPSPipeDirectory: "/tmp/evil", nodeapi.EnvMPSPinnedLimit: "0=999999M",
	}
	createPod(t, "hostile", map[string]string{"gpu-fraction": "0.1"}, probe("main", hostile), probe("sidecar", nil))
	createPod(t, "hostile-twice", map[string]string{"gpu-fraction": "0.1"}, probe("main", map[string]string{nodeapi.EnvVisibleDevices: "all"}))
	root := probe("main", nil)
	root.SecurityContext = &corev1.SecurityContext{RunAsUser: new(int64(0)), RunAsNonRoot: new(false)}
	createPod(t, "as-root", map[string]string{"gpu-fraction": "0.1"}, root)
	waitRefused(t, "as-root", "runs as root (uid 0, no user namespace)")
	waitRefused(t, "hostile-twice", "NVIDIA_VISIBLE_DEVICES is set more than once")
	pod := running(t, "hostile")
	a := assignment(t, pod, "main")
	main := theNode.probeReport(t, pod, "main")
	checkInjected(t, main, a)
	checkLimits(t, pod, a, main)
	if main.Env[nodeapi.EnvMPSPinnedLimit] == hostile[nodeapi.EnvMPSPinnedLimit] {
		t.Errorf("main kept its own %s", nodeapi.EnvMPSPinnedLimit)
	}

	side := theNode.probeReport(t, pod, "sidecar")
	if got := side.Env[nodeapi.EnvVisibleDevices]; got != "void" {
		t.Errorf("the sidecar sees %s=%q, want void", nodeapi.EnvVisibleDevices, got)
	}
	for _, k := range []string{nodeapi.EnvMemoryRequest, nodeapi.EnvMemoryLimit, nodeapi.EnvMPSPipeDirectory, nodeapi.EnvMPSPinnedLimit} {
		if v, ok := side.Env[k]; ok {
			t.Errorf("the sidecar sees %s=%q", k, v)
		}
	}
	id := containerID(t, pod, "sidecar")
	calls, err := theNode.limitCalls()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range calls {
		if strings.HasSuffix(c.Cgroup, id) {
			t.Errorf("the driver got limits for the sidecar: %+v", c)
		}
	}
}

// Every container on the node sees exactly the GPUs granted to it. The
// probe image sets NVIDIA_VISIBLE_DEVICES=all, as NVIDIA's CUDA images do:
// a pod that asks for no GPU sees none (and its Events say why); a
// whole-GPU pod sees exactly the one GPU the device plugin gave it. One
// that also writes "all" in its own env is never started: the kubelet
// puts that after the device plugin's value, so the runtime would keep it
// over any change the agent makes, and the container would see every GPU.
func TestEveryContainerSeesOnlyItsGrant(t *testing.T) {
	gpu := func(env map[string]string) corev1.Container {
		c := probe("main", env)
		c.Resources.Limits = corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}
		return c
	}
	createPod(t, "no-gpu", nil, probe("main", nil))
	createPod(t, "whole-gpu", nil, gpu(nil))
	createPod(t, "whole-gpu-all", nil, gpu(map[string]string{nodeapi.EnvVisibleDevices: "all"}))

	pod := running(t, "no-gpu")
	if got := theNode.probeReport(t, pod, "main").Env[nodeapi.EnvVisibleDevices]; got != "void" {
		t.Errorf("a pod that asked for no GPU sees %s=%q, want void", nodeapi.EnvVisibleDevices, got)
	}
	pod = running(t, "whole-gpu")
	got := theNode.probeReport(t, pod, "main").Env[nodeapi.EnvVisibleDevices]
	if !slices.ContainsFunc(theNode.plugin.allocated(), func(ids []string) bool { return len(ids) == 1 && ids[0] == got }) {
		t.Errorf("the whole-GPU pod sees %s=%q, want exactly the one GPU the device plugin gave it (allocations %v)",
			nodeapi.EnvVisibleDevices, got, theNode.plugin.allocated())
	}
	waitRefused(t, "whole-gpu-all", "NVIDIA_VISIBLE_DEVICES is set more than once")
	if err := waitFor("the GPUAccessRestricted Event", 30*time.Second, func() (bool, error) {
		events, err := theNode.admin.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "reason=GPUAccessRestricted"})
		if err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Name == "no-gpu" && strings.Contains(e.Message, `NVIDIA_VISIBLE_DEVICES="all" names GPUs not granted`) {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Error(err)
	}
}

// pinPod puts a PodDisruptionBudget allowing no disruption on the pod, and
// checks that an eviction is now refused.
func pinPod(t *testing.T, name string) {
	t.Helper()
	ctx := context.Background()
	patch := []byte(`{"metadata":{"labels":{"pinned":"` + name + `"}}}`)
	if _, err := theNode.admin.CoreV1().Pods(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	one := intstr.FromInt32(1)
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"pinned": name}}}}
	if _, err := theNode.admin.PolicyV1().PodDisruptionBudgets(ns).Create(ctx, pdb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = theNode.admin.PolicyV1().PodDisruptionBudgets(ns).Delete(ctx, name, metav1.DeleteOptions{})
	})
	if err := waitFor("the budget to refuse an eviction", 30*time.Second, func() (bool, error) {
		err := theNode.admin.PolicyV1().Evictions(ns).Evict(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			DeleteOptions: &metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}})
		if err == nil {
			return false, fmt.Errorf("a dry-run eviction of %s passed under its budget: the test would prove nothing", name)
		}
		return apierrors.IsTooManyRequests(err), nil
	}); err != nil {
		t.Fatal(err)
	}
}

// A running share is resized in place (SPEC §7): the scheduler grants the
// grow on the pod's GPU, the agent sets the new soft and hard limits on
// the running container's cgroup through the driver (the fake NVML
// records them), and the container is the same one, its process too. A
// shrink of the hard limit below what the driver says the container uses
// is refused with the figures, and nothing is set.
func TestRunningShareIsResizedInPlace(t *testing.T) {
	ctx := context.Background()
	createPod(t, "resize", map[string]string{"gpu-memory": "4096"}, probe("main", nil))
	pod := running(t, "resize")
	a := assignment(t, pod, "main")
	r := theNode.probeReport(t, pod, "main")
	checkLimits(t, pod, a, r)
	id := containerID(t, pod, "main")
	cgroup := lastLimits(t, id, a.Devices[0]).Cgroup
	pids := probePIDs(t, cgroup)

	annotate := func(kv map[string]any) {
		t.Helper()
		patch := fmt.Sprintf(`{"metadata":{"annotations":%s}}`, mustJSON(t, kv))
		if _, err := theNode.admin.CoreV1().Pods(ns).Patch(ctx, "resize", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatalf("annotate %v: %v", kv, err)
		}
	}
	condition := func(want corev1.ConditionStatus, reason string) *corev1.Pod {
		t.Helper()
		var p *corev1.Pod
		err := waitFor("the resize's "+api.ConditionResizeInProgress+" "+string(want)+" "+reason, time.Minute, func() (bool, error) {
			got, err := theNode.admin.CoreV1().Pods(ns).Get(ctx, "resize", metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			p = got
			c, ok := api.PodResizeCondition(p, api.ConditionResizeInProgress)
			return ok && c.Status == want && c.Reason == reason, nil
		})
		if err != nil {
			t.Fatalf("%v (annotations %v, conditions %+v)", err, p.Annotations, p.Status.Conditions)
		}
		return p
	}
	sameContainer := func(p *corev1.Pod) {
		t.Helper()
		if got := containerID(t, p, "main"); got != id || p.Status.ContainerStatuses[0].RestartCount != 0 {
			t.Errorf("the container changed: %s (restarts %d), was %s", got, p.Status.ContainerStatuses[0].RestartCount, id)
		}
		if got := probePIDs(t, cgroup); !slices.Equal(got, pids) {
			t.Errorf("the container's processes changed: %v, were %v", got, pids)
		}
	}

	// Grow: 4Gi → 8Gi, hard 12Gi.
	annotate(map[string]any{api.KeyResizeRequest: "8Gi", api.KeyResizeLimit: "12Gi"})
	grown := condition(corev1.ConditionFalse, api.ReasonResizeDone)
	sameContainer(grown)
	if g := assignment(t, grown, "main"); g.RequestMiB != 8192 || g.LimitMiB != 12288 || !slices.Equal(g.Devices, a.Devices) {
		t.Errorf("granted %+v, want 8192Mi/12288Mi on %v", g, a.Devices)
	}
	// The same cgroup (lastLimits matches the container's ID), named as
	// the agent names it: through its pod's mount of the host's hierarchy
	// in the chart's mode, where the hook names the host's path.
	if c := lastLimits(t, id, a.Devices[0]); c.Soft != 8192<<20 || c.Hard != 12288<<20 {
		t.Errorf("the driver holds %+v after the grow, want soft 8Gi and hard 12Gi", c)
	}

	// The container uses 10000Mi: a hard limit of 6Gi is refused.
	if err := theNode.setUsed(a.Devices[0], cgroup, 10000<<20); err != nil {
		t.Fatal(err)
	}
	calls, _ := theNode.limitCalls()
	annotate(map[string]any{api.KeyResizeRequest: "4Gi", api.KeyResizeLimit: "6Gi"})
	refused := condition(corev1.ConditionTrue, api.ReasonResizeError)
	c, _ := api.PodResizeCondition(refused, api.ConditionResizeInProgress)
	if !strings.Contains(c.Message, "uses 10000Mi, above the hard limit 6144Mi asked; nothing changed") {
		t.Errorf("the refusal says %q", c.Message)
	}
	if after, _ := theNode.limitCalls(); len(after) != len(calls) {
		t.Errorf("a refused resize set limits: %+v", after[len(calls):])
	}
	sameContainer(refused)
	events, err := theNode.admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=resize,reason=GPUResizeRefused"})
	if err != nil || len(events.Items) == 0 {
		t.Errorf("no GPUResizeRefused event: %v", err)
	}
	// Once it uses less, the agent's next resync applies it.
	if err := theNode.setUsed(a.Devices[0], cgroup, 5000<<20); err != nil {
		t.Fatal(err)
	}
	sameContainer(condition(corev1.ConditionFalse, api.ReasonResizeDone))
	if c := lastLimits(t, id, a.Devices[0]); c.Soft != 4096<<20 || c.Hard != 6144<<20 {
		t.Errorf("the driver holds %+v after the shrink, want soft 4Gi and hard 6Gi", c)
	}
}

// lastLimits is the last SetMemoryLimits_v1 the fake driver took for the
// container's cgroup on a GPU: what it holds.
func lastLimits(t *testing.T, containerID, uuid string) limitCall {
	t.Helper()
	calls, err := theNode.limitCalls()
	if err != nil {
		t.Fatal(err)
	}
	var last limitCall
	for _, c := range calls {
		if c.GPU == uuid && strings.HasSuffix(c.Cgroup, containerID) {
			last = c
		}
	}
	if last.Cgroup == "" {
		t.Fatalf("the driver holds no limits for container %s on %s: %+v", containerID, uuid, calls)
	}
	return last
}

// probePIDs are the processes of a container's cgroup.
func probePIDs(t *testing.T, cgroup string) []string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(cgroup, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	pids := strings.Fields(string(raw))
	if len(pids) == 0 {
		t.Fatalf("no process in %s", cgroup)
	}
	return pids
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(raw)
}

// Issue 53: a share's container cannot become root after the node read
// its uid. The webhook sets allowPrivilegeEscalation false on it, so the
// kernel runs its processes with no_new_privs (a setuid-root program
// gains nothing), where an ordinary pod's keep the default; a share that
// would share its process namespace is refused before it runs.
func TestShareCannotGainPrivileges(t *testing.T) {
	createPod(t, "confined", map[string]string{"gpu-memory": "1024"}, probe("main", nil))
	share := running(t, "confined")
	if r := theNode.probeReport(t, share, "main"); r.NoNewPrivs != "1" {
		t.Errorf("the share's process runs with NoNewPrivs %q, want 1", r.NoNewPrivs)
	}
	createPod(t, "ordinary", nil, probe("main", nil))
	plain := running(t, "ordinary")
	if r := theNode.probeReport(t, plain, "main"); r.NoNewPrivs != "0" {
		t.Errorf("an ordinary pod's process runs with NoNewPrivs %q, want 0 (Kubernetes' default): the test would prove nothing", r.NoNewPrivs)
	}
	on := true
	off := false
	shared := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "shared-pid", Namespace: ns, Annotations: map[string]string{"gpu-memory": "1024"}},
		Spec: corev1.PodSpec{SchedulerName: "gpufrac", ShareProcessNamespace: &on, AutomountServiceAccountToken: &off,
			SecurityContext: tenantUser(), Containers: []corev1.Container{probe("main", nil)}}}
	if _, err := theNode.admin.CoreV1().Pods(ns).Create(context.Background(), shared, metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "spec.shareProcessNamespace") {
		if err == nil {
			deletePod(t, "shared-pid")
		}
		t.Errorf("a share sharing its process namespace: %v, want it refused", err)
	}
}
