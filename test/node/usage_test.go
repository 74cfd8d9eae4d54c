//go:build nodee2e

package node

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// The stand-in driver lists processes of three containers, each in its
// own pod (two MPS clients and a plain compute process), a host process
// and one that has exited: the agent's /metrics shows each container's
// memory and SM under its own pod's labels, the host process's memory as
// nobody's, the exited one nowhere; the Node carries the same figures for
// `gpufrac top`. Then the processes go, and so do their figures.
func TestUsageIsMeasuredPerPod(t *testing.T) {
	token := metricsReaderToken(t)
	names := []string{"use-a", "use-b", "use-c"}
	for _, name := range names {
		createPod(t, name, map[string]string{"gpu-memory": "4096"}, probe("main", nil))
	}
	t.Cleanup(func() {
		for _, name := range names {
			deletePod(t, name)
		}
	})
	pids, gpus, modes := map[string]int{}, map[string]string{}, map[string]api.ComputeMode{}
	for _, name := range names {
		pod := running(t, name)
		theNode.probeReport(t, pod, "main")
		pids[name] = containerPID(t, pod, "main")
		a := assignment(t, pod, "main")
		gpus[name], modes[name] = a.Devices[0], a.Mode
	}
	host := os.Getpid() // a process outside every pod
	exited := exec.Command("true")
	if err := exited.Run(); err != nil {
		t.Fatal(err)
	}
	gone := exited.Process.Pid
	lines := []string{
		fmt.Sprintf("%s %d %d 40 mps", gpus["use-a"], pids["use-a"], int64(3)<<30),
		fmt.Sprintf("%s %d %d 10 mps", gpus["use-b"], pids["use-b"], int64(1)<<30),
		fmt.Sprintf("%s %d %d 0 compute", gpus["use-c"], pids["use-c"], int64(512)<<20),
		fmt.Sprintf("%s %d %d 0 compute", gpus["use-a"], host, int64(700)<<20),
		fmt.Sprintf("%s %d %d 30 compute", gpus["use-a"], gone, int64(7)<<30),
	}
	processes := filepath.Join(theNode.nvmlDir(), "processes")
	if err := os.WriteFile(processes, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(processes) })

	series := func(metric, pod, gpu string) string {
		return fmt.Sprintf(`%s{container="main",gpu_uuid="%s",mode="%s",namespace="%s",node="%s",pod="%s"}`, metric, gpu, modes[pod], ns, nodeName, pod)
	}
	want := map[string]string{
		series("gpufrac_container_gpu_memory_used_bytes", "use-a", gpus["use-a"]):      "3.221225472e+09",
		series("gpufrac_container_gpu_sm_utilization_percent", "use-a", gpus["use-a"]): "40",
		series("gpufrac_container_gpu_memory_used_bytes", "use-b", gpus["use-b"]):      "1.073741824e+09",
		series("gpufrac_container_gpu_sm_utilization_percent", "use-b", gpus["use-b"]): "10",
		series("gpufrac_container_gpu_memory_used_bytes", "use-c", gpus["use-c"]):      "5.36870912e+08",
		series("gpufrac_container_gpu_sm_utilization_percent", "use-c", gpus["use-c"]): "0",
	}
	var body string
	err := waitFor("the three containers' use in /metrics", 60*time.Second, func() (bool, error) {
		body = scrape(t, token)
		for s, v := range want {
			if !strings.Contains(body, s+" "+v+"\n") {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v; the agent's usage metrics:\n%s", err, grep(body, "gpufrac_container_gpu_memory_used_bytes", "gpufrac_container_gpu_sm", "gpufrac_gpu_memory_unattributed"))
	}
	// The host process is nobody's; the exited one is not counted at all
	// (were it, use-a's GPU would show 7 GiB more).
	unattributed := fmt.Sprintf(`gpufrac_gpu_memory_unattributed_bytes{gpu_uuid="%s"} %s`, gpus["use-a"], "7.340032e+08")
	if !strings.Contains(body, unattributed+"\n") {
		t.Errorf("want %s; got:\n%s", unattributed, grep(body, "gpufrac_gpu_memory_unattributed"))
	}
	if strings.Contains(body, "7.516192768e+09") {
		t.Errorf("the exited PID's 7 GiB is counted:\n%s", grep(body, "7.516192768e+09"))
	}

	// The Node carries the same figures, per pod and GPU, for top and the
	// dashboard.
	err = waitFor("the Node's usage annotation", 30*time.Second, func() (bool, error) {
		node, err := theNode.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		u, ok, err := api.UsageOf(node)
		if !ok || err != nil {
			return false, err
		}
		a, okA := u.Of(ns+"/use-a", gpus["use-a"])
		c, okC := u.Of(ns+"/use-c", gpus["use-c"])
		return okA && okC && a.UsedMiB != nil && *a.UsedMiB == 3072 && a.SMPercent != nil && *a.SMPercent == 40 &&
			c.UsedMiB != nil && *c.UsedMiB == 512, nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// The processes end: no memory is left on anyone.
	if err := os.WriteFile(processes, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := waitFor("use-a's memory back to 0", 30*time.Second, func() (bool, error) {
		body = scrape(t, token)
		return strings.Contains(body, series("gpufrac_container_gpu_memory_used_bytes", "use-a", gpus["use-a"])+" 0\n"), nil
	}); err != nil {
		t.Fatalf("%v:\n%s", err, grep(body, "gpufrac_container_gpu_memory_used_bytes"))
	}
}

// containerPID is the host PID of a container's process, found through
// its cgroup (the container ID names the cgroup directory).
func containerPID(t *testing.T, pod *corev1.Pod, container string) int {
	t.Helper()
	var id string
	for _, s := range pod.Status.ContainerStatuses {
		if s.Name == container {
			_, id, _ = strings.Cut(s.ContainerID, "://")
		}
	}
	if id == "" {
		t.Fatalf("pod %s has no container %s running", pod.Name, container)
	}
	for _, pid := range kubepodsPIDs() {
		raw, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cgroup"))
		if err == nil && strings.Contains(string(raw), id) {
			return pid
		}
	}
	t.Fatalf("no process of container %s (%s) in the pod cgroups", container, id)
	return 0
}

// metricsReaderToken is a token of a service account that may get
// /metrics (the chart's gpufrac-metrics-reader role).
func metricsReaderToken(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	const name = "usage-metrics-reader"
	if _, err := theNode.admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name},
		Rules: []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}}}
	if _, err := theNode.admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: ns, Name: name}}}
	if _, err := theNode.admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		_ = theNode.admin.RbacV1().ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{})
		_ = theNode.admin.RbacV1().ClusterRoles().Delete(ctx, name, metav1.DeleteOptions{})
		_ = theNode.admin.CoreV1().ServiceAccounts(ns).Delete(ctx, name, metav1.DeleteOptions{})
	})
	tok, err := theNode.admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return tok.Status.Token
}

// scrape gets the agent's /metrics ("" until it answers 200).
func scrape(t *testing.T, token string) string {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // the agent's self-signed certificate
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, "https://"+theNode.metricsAddr+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := client.Do(req)
	if err != nil {
		return ""
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return ""
	}
	return string(raw)
}

// grep keeps the lines of body that contain any of words.
func grep(body string, words ...string) string {
	var out []string
	for _, line := range strings.Split(body, "\n") {
		for _, w := range words {
			if strings.Contains(line, w) && !strings.HasPrefix(line, "#") {
				out = append(out, line)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
