//go:build charte2e && !nodee2e

// With -tags charte2e (`make chart-e2e`), the same real node runs gpufrac
// as users install it: the image of `make image`, imported into containerd
// under the chart's default name, and `helm install` of deploy/helm/gpufrac
// with its defaults. Every gpufrac part is a real pod: the scheduler and
// the webhook (Deployments, reached through their Service by way of
// kube-proxy), the node agent and its MPS daemon (a DaemonSet, with the
// init container that puts the hook and the view library on the host).
// The cluster around it is what the chart needs anywhere: kube-apiserver
// serving the kubernetes Service's address with service-account tokens and
// the Node authorizer, kube-controller-manager (workload controllers,
// service accounts, the root CA), a default scheduler, kube-proxy.
//
// What a test node needs besides (the chart's values for its paths, and):
//
//   - the RuntimeClass nvidia, as the GPU Operator creates it, whose
//     handler is a stand-in for nvidia-container-runtime (nvidiaruntime/):
//     it injects the fake NVML and the MPS stand-in into a container that
//     asks for GPUs, as the toolkit injects the driver's, and shows a
//     container that mounts /sys/fs/cgroup the dmem stand-in;
//   - the fake NVML at the driver's place on the host
//     (/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1), where the hook the
//     init container installs finds it, and its state in FAKE_NVML_DIR;
//   - the device-plugin stand-in, and the GPU Feature Discovery label
//     nvidia.com/gpu.present, set by the test.

package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpufrac/gpufrac/internal/controlplane"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

const (
	// fakeNVMLDir is fakenvml.c's FAKE_NVML_DIR: the hook runc runs has no
	// environment to name another.
	fakeNVMLDir = "/run/gpufrac-fake-nvml"
	// hostDriverLib is where Debian's NVIDIA driver puts NVML.
	hostDriverLib = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
	release       = "gpufrac"
	releaseNS     = "gpufrac-system"
	serviceCIDR   = "10.96.0.0/24"
	// apiServiceIP is the kubernetes Service's address, the first of
	// serviceCIDR: pods reach the API server there through kube-proxy.
	apiServiceIP = "10.96.0.1"
)

// chartHostDirs are the chart's host directories (values.yaml defaults):
// an uninstall leaves them, as the chart README says. On the test node
// they are the node's own (isolate_test.go), and go with it.
var chartHostDirs = []string{"/opt/gpufrac", "/var/lib/gpufrac", "/run/gpufrac"}

func TestMain(m *testing.M) {
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:])) // nvidia-cuda-mps-control, in the agent's pod
	}
	os.Exit(run(m, startChartNode))
}

func startChartNode() (*node, error) {
	n, err := newNode("bin/kube/kube-apiserver", "bin/kube/etcd", "bin/kube/kube-controller-manager", "bin/kube/kube-proxy",
		"bin/helm", "bin/image/gpufrac.oci.tar", "bin/image/next/gpufrac.oci.tar", "bin/node/nvidia-container-runtime")
	if err != nil {
		return n, err
	}
	n.nvml = fakeNVMLDir
	// The image, and the same one under the tag <appVersion>-next with
	// another digest (make chart-e2e): what helm upgrade moves to.
	n.images = append(n.images, filepath.Join(n.repo, "bin", "image", "gpufrac.oci.tar"), filepath.Join(n.repo, "bin", "image", "next", "gpufrac.oci.tar"))
	return n, n.runSteps([]step{
		{"etcd, kube-apiserver (package controlplane: client certificates, Node+RBAC)", n.startAPIServer},
		{"kube-controller-manager, default scheduler", n.startControllers},
		{"fake NVML at the driver's place", n.installDriver},
		{"containerd (NRI, runtime nvidia), images imported", func() error { return n.withNvidiaRuntime(n.startContainerd) }},
		{"kubelet", n.startKubelet},
		{"kube-proxy (iptables)", n.startKubeProxy},
		{"device plugin stand-in", n.startDevicePlugin},
		{"helm install (the image, chart defaults)", n.helmInstall},
		{"node ready for fractions", func() error { return n.waitFractionReady(3 * time.Minute) }},
	})
}

// startAPIServer runs etcd and kube-apiserver as gpufrac up runs them
// (package controlplane), shaped for a cluster with a real node: the
// kubelet joins as system:node:<name> (Node authorization,
// NodeRestriction), and pods reach the API server at the node's own
// address (isolate_test.go), the kubernetes Service's endpoint, with their
// service-account tokens.
func (n *node) startAPIServer() error {
	cp, err := controlplane.New(n.dir, localcluster.FreePort, controlplane.Options{Nodes: true,
		AdvertiseAddress: net.ParseIP(nodeAddress), ServiceIP: net.ParseIP(apiServiceIP), ServiceCIDR: serviceCIDR})
	if err != nil {
		return err
	}
	if err := n.start("etcd", nil, filepath.Join(n.repo, "bin", "kube", "etcd"), cp.EtcdArgs()...); err != nil {
		return err
	}
	if err := n.start("kube-apiserver", nil, filepath.Join(n.repo, "bin", "kube", "kube-apiserver"), cp.APIServerArgs()...); err != nil {
		return err
	}
	for _, kc := range []struct{ file, user, group string }{{"admin.kubeconfig", "gpufrac-test-admin", "system:masters"}, {"kubelet.kubeconfig", "system:node:" + nodeName, "system:nodes"}} {
		data, err := cp.KubeConfig(kc.user, kc.group)
		if err != nil {
			return err
		}
		if err := os.WriteFile(n.path(kc.file), data, 0o600); err != nil {
			return err
		}
	}
	n.kubeconfig, n.kubeletKubeconfig = n.path("admin.kubeconfig"), n.path("kubelet.kubeconfig")
	cfg, err := cp.Config("gpufrac-test-admin", "system:masters")
	if err != nil {
		return err
	}
	if n.admin, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	return waitFor("kube-apiserver /readyz", 90*time.Second, func() (bool, error) {
		for _, p := range []string{"etcd", "kube-apiserver"} {
			if err := n.exited(p); err != nil {
				return false, err
			}
		}
		body, err := n.admin.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		return err == nil && string(body) == "ok", nil
	})
}

// chartControllers are the kube-controller-manager controllers the chart
// needs: its workloads, their pods' service accounts and the CA their
// tokens' volumes carry, the webhook Service's endpoints, and cleaning up
// after an uninstall.
var chartControllers = []string{
	"daemonset-controller", "deployment-controller", "replicaset-controller", "serviceaccount-controller",
	"root-ca-certificate-publisher-controller", "endpointslice-controller", "garbage-collector-controller", "namespace-controller",
	// Takes off the not-ready taint the API server puts on a new node.
	"node-lifecycle-controller",
	// Computes what each PodDisruptionBudget allows, which the Eviction
	// API reads (without it every budget refuses, "still being processed").
	"disruption-controller",
}

func (n *node) startControllers() error {
	if err := n.start("kube-controller-manager", nil, filepath.Join(n.repo, "bin", "kube", "kube-controller-manager"),
		"--kubeconfig", n.kubeconfig, "--controllers", strings.Join(chartControllers, ","), "--root-ca-file", controlplane.CAFile(n.dir),
		"--leader-elect=false", "--secure-port", "0"); err != nil {
		return err
	}
	// The stock scheduler places what the chart's own pods are; gpufrac's
	// (a pod of the chart) places fractions.
	if err := n.start("default-scheduler", nil, n.gpufrac, "scheduler", "--kubeconfig", n.kubeconfig, "--leader-elect=false", "--secure-port", "0"); err != nil {
		return err
	}
	return waitFor("the default ServiceAccount and kube-root-ca.crt", 60*time.Second, func() (bool, error) {
		for _, p := range []string{"kube-controller-manager", "default-scheduler"} {
			if err := n.exited(p); err != nil {
				return false, err
			}
		}
		ctx := context.Background()
		_, err1 := n.admin.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		_, err2 := n.admin.CoreV1().ConfigMaps(ns).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		return err1 == nil && err2 == nil, nil
	})
}

// installDriver puts the fake NVML where the driver's library is, with
// the machine it reports. Both are the node's: the driver's directory is
// an overlay and /run a tmpfs of its own (isolate_test.go), so a real
// driver's library on the host stays as it is.
func (n *node) installDriver() error {
	if err := os.MkdirAll(fakeNVMLDir, 0o755); err != nil {
		return err
	}
	if err := n.writeMachine(); err != nil {
		return err
	}
	lib, err := os.ReadFile(filepath.Join(n.nodeBin, "lib", "libnvidia-ml.so.1"))
	if err != nil {
		return err
	}
	return os.WriteFile(hostDriverLib, lib, 0o644)
}

// withNvidiaRuntime sets up the runtime class nvidia's handler (the
// stand-in) for containerd's configuration, then runs start.
func (n *node) withNvidiaRuntime(start func() error) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cgroup, err := enforce.CgroupMount("/proc")
	if err != nil {
		return err
	}
	bin := n.path("nvidia-container-runtime")
	data, err := os.ReadFile(filepath.Join(n.nodeBin, "nvidia-container-runtime"))
	if err != nil {
		return err
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(n.path("dmem-standin", "cgroup.controllers"), []byte("cpuset cpu io memory hugetlb pids dmem\n"), 0o644); err != nil {
		return err
	}
	cfg, err := json.Marshal(map[string]any{
		"runc": "/usr/sbin/runc",
		"mounts": []map[string]any{
			{"source": filepath.Join(n.nodeBin, "lib", "libnvidia-ml.so.1"), "destination": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "readOnly": true},
			{"source": self, "destination": "/usr/bin/nvidia-cuda-mps-control", "readOnly": true},
			{"source": fakeNVMLDir, "destination": fakeNVMLDir},
		},
		"env":         []string{mpstest.Env + "=1", "GORACE=atexit_sleep_ms=0"},
		"cgroup":      cgroup,
		"controllers": n.path("dmem-standin", "cgroup.controllers"),
	})
	if err != nil {
		return err
	}
	if err := os.WriteFile(bin+".json", cfg, 0o644); err != nil {
		return err
	}
	n.runtimes = fmt.Sprintf(`[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]
  BinaryName = %q
  Root = %q
`, bin, n.path("runc"))
	return start()
}

func (n *node) startKubeProxy() error {
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	metrics, healthz := ports[0], ports[1]
	proxy := filepath.Join(n.repo, "bin", "kube", "kube-proxy")
	// Its rules are the node's network namespace's, and go with it.
	if err := n.start("kube-proxy", nil, proxy, "--kubeconfig", n.kubeconfig, "--hostname-override", nodeName, "--proxy-mode", "iptables",
		"--cluster-cidr", podCIDR, "--iptables-localhost-nodeports=false",
		// 0: leave this machine's conntrack table and timeouts as they are.
		"--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0", "--conntrack-tcp-timeout-close-wait", "0",
		"--metrics-bind-address", fmt.Sprintf("127.0.0.1:%d", metrics), "--healthz-bind-address", fmt.Sprintf("127.0.0.1:%d", healthz), "--v", "2"); err != nil {
		return err
	}
	return waitFor("kube-proxy's rule for the kubernetes Service", 60*time.Second, func() (bool, error) {
		if err := n.exited("kube-proxy"); err != nil {
			return false, err
		}
		out, _ := exec.Command("iptables-save", "-t", "nat").Output()
		return strings.Contains(string(out), apiServiceIP+"/32"), nil
	})
}

// helmValues are the chart's defaults but for what a test node needs: its
// paths, and the GPU labels GPU Feature Discovery would set.
func (n *node) helmValues() []string {
	return []string{
		"--set", "nodeAgent.nriSocketDir=" + filepath.Dir(n.nriSocket()),
		"--set", "nodeAgent.podResourcesDir=" + filepath.Dir(n.podResourcesSocket()),
		"--set", "nodeAgent.publishGPULabels=true",
		// A shorter resync than the default 30s: the tests wait for the
		// agent's resyncs (its readiness, what it does to stale
		// containers), and the suite runs on two cores in CI.
		"--set", "nodeAgent.resyncPeriod=10s",
	}
}

// draValues turn on the chart's DRA front door on the test node: the
// kubelet's plugin directories under its root, prepared claims' CDI specs
// where containerd reads them, and two GPUs standing for shares, as in
// the node's own tests.
func (n *node) draValues() []string {
	return []string{"--set", "nodeAgent.dra.enabled=true", "--set", "nodeAgent.dra.standingGPUs=" + strconv.Itoa(standingGPUs),
		"--set", "nodeAgent.dra.pluginDir=" + filepath.Join(n.kubeletRoot(), "plugins", api.DRADriver),
		"--set", "nodeAgent.dra.registrarDir=" + filepath.Join(n.kubeletRoot(), "plugins_registry"),
		"--set", "nodeAgent.dra.cdiDir=" + n.cdiDir()}
}

func (n *node) helm(args ...string) ([]byte, error) {
	cmd := exec.Command(filepath.Join(n.repo, "bin", "helm"), append(args, "--kubeconfig", n.kubeconfig)...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+n.path("helm", "cache"), "HELM_CONFIG_HOME="+n.path("helm", "config"), "HELM_DATA_HOME="+n.path("helm", "data"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("helm %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

func (n *node) helmInstall() error {
	ctx := context.Background()
	// What the GPU Operator and GPU Feature Discovery give a GPU node.
	if _, err := n.admin.NodeV1().RuntimeClasses().Create(ctx, &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "nvidia"}, Handler: "nvidia"}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	patch := []byte(`{"metadata":{"labels":{"nvidia.com/gpu.present":"true"}}}`)
	if _, err := n.admin.CoreV1().Nodes().Patch(ctx, nodeName, "application/strategic-merge-patch+json", patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	n.beforeStop = append(n.beforeStop, n.uninstall)
	args := append([]string{"install", release, filepath.Join(n.repo, "deploy", "helm", "gpufrac"), "-n", releaseNS, "--create-namespace", "--wait", "--timeout", "3m"}, n.helmValues()...)
	out, err := n.helm(args...)
	if err != nil {
		return fmt.Errorf("%w\n%s", err, n.describeRelease())
	}
	fmt.Fprintf(os.Stderr, "%s", out)
	return nil
}

// describeRelease says where the release's pods are, for a failure.
func (n *node) describeRelease() string {
	pods, err := n.admin.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "pod %s: %s on %q", p.Name, p.Status.Phase, p.Spec.NodeName)
		for _, c := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			fmt.Fprintf(&b, "; %s ready=%v restarts=%d %+v", c.Name, c.Ready, c.RestartCount, c.State)
		}
		for _, c := range p.Status.Conditions {
			if c.Status != corev1.ConditionTrue {
				fmt.Fprintf(&b, "; %s=%s %s", c.Type, c.Reason, c.Message)
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// uninstall is `helm uninstall`, and what the README says it leaves: no
// gpufrac object, no process, no rule for its Services, and on the host
// only chartHostDirs.
func (n *node) uninstall() error {
	// The check below can fail: the release's Services have rules now.
	if rules, err := releaseRules(); err != nil || len(rules) == 0 {
		return fmt.Errorf("before helm uninstall, kube-proxy has no rule for the release's Services (%v): the check of what the uninstall leaves would prove nothing", err)
	}
	if _, err := n.helm("uninstall", release, "-n", releaseNS, "--wait", "--timeout", "2m"); err != nil {
		return err
	}
	ctx := context.Background()
	var left []string
	if err := waitFor("the release's pods and the reservation namespace gone", 2*time.Minute, func() (bool, error) {
		left = nil
		for _, namespace := range []string{releaseNS, api.DefaultReservationNamespace} {
			pods, err := n.admin.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			for _, p := range pods.Items {
				left = append(left, "pod "+namespace+"/"+p.Name)
			}
		}
		if _, err := n.admin.CoreV1().Namespaces().Get(ctx, api.DefaultReservationNamespace, metav1.GetOptions{}); err == nil {
			left = append(left, "namespace "+api.DefaultReservationNamespace)
		}
		return len(left) == 0, nil
	}); err != nil {
		return fmt.Errorf("%w: %v", err, left)
	}
	// The tenants' pods were deleted just before: their processes go too.
	var procs []string
	_ = waitFor("no process in a pod's cgroup", time.Minute, func() (bool, error) {
		procs = n.podProcesses()
		return len(procs) == 0, nil
	})
	left = append(append(left, n.gpufracObjects(ctx)...), procs...)
	// kube-proxy takes the Services' rules out on its next sync.
	var rules []string
	_ = waitFor("no iptables rule for the release's Services", time.Minute, func() (bool, error) {
		var err error
		rules, err = releaseRules()
		return err == nil && len(rules) == 0, err
	})
	left = append(left, rules...)
	if len(left) > 0 {
		return fmt.Errorf("helm uninstall left %s", strings.Join(left, "; "))
	}
	return n.checkHostFiles()
}

// releaseRules are the node's iptables and ip6tables rules that belong to
// the release: kube-proxy's for its Services, which name them in a
// comment ("gpufrac-system/gpufrac-webhook:https cluster IP"). The rest of
// the node's tables is not gpufrac's and is not checked: the kubelet's own
// chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT, made on
// its first start) and kube-proxy's for the kubernetes Service. All of it
// is the node's network namespace's, and goes with it.
func releaseRules() ([]string, error) {
	var rules []string
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		out, err := exec.Command(save).Output()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", save, err)
		}
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, releaseNS+"/") {
				rules = append(rules, "iptables rule "+l)
			}
		}
	}
	return rules, nil
}

// gpufracObjects lists the cluster's objects labelled as gpufrac's.
func (n *node) gpufracObjects(ctx context.Context) []string {
	sel := metav1.ListOptions{LabelSelector: "app.kubernetes.io/part-of=gpufrac"}
	var left []string
	add := func(kind string, names []string, err error) {
		if err != nil {
			left = append(left, kind+": "+err.Error())
		}
		for _, name := range names {
			left = append(left, kind+" "+name)
		}
	}
	cr, err := n.admin.RbacV1().ClusterRoles().List(ctx, sel)
	add("ClusterRole", namesOf(cr, err), err)
	crb, err := n.admin.RbacV1().ClusterRoleBindings().List(ctx, sel)
	add("ClusterRoleBinding", namesOf(crb, err), err)
	mw, err := n.admin.AdmissionregistrationV1().MutatingWebhookConfigurations().List(ctx, sel)
	add("MutatingWebhookConfiguration", namesOf(mw, err), err)
	vw, err := n.admin.AdmissionregistrationV1().ValidatingWebhookConfigurations().List(ctx, sel)
	add("ValidatingWebhookConfiguration", namesOf(vw, err), err)
	vap, err := n.admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().List(ctx, sel)
	add("ValidatingAdmissionPolicy", namesOf(vap, err), err)
	vapb, err := n.admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().List(ctx, sel)
	add("ValidatingAdmissionPolicyBinding", namesOf(vapb, err), err)
	r, err := n.admin.RbacV1().Roles("").List(ctx, sel)
	add("Role", namesOf(r, err), err)
	rb, err := n.admin.RbacV1().RoleBindings("").List(ctx, sel)
	add("RoleBinding", namesOf(rb, err), err)
	for _, kind := range []string{"ServiceAccount", "ConfigMap", "Secret", "Service"} {
		var names []string
		var err error
		switch kind {
		case "ServiceAccount":
			l, e := n.admin.CoreV1().ServiceAccounts("").List(ctx, sel)
			names, err = namesOf(l, e), e
		case "ConfigMap":
			l, e := n.admin.CoreV1().ConfigMaps("").List(ctx, sel)
			names, err = namesOf(l, e), e
		case "Secret":
			l, e := n.admin.CoreV1().Secrets("").List(ctx, sel)
			names, err = namesOf(l, e), e
		case "Service":
			l, e := n.admin.CoreV1().Services("").List(ctx, sel)
			names, err = namesOf(l, e), e
		}
		add(kind, names, err)
	}
	return left
}

// namesOf is the names of a list's items.
func namesOf(list any, err error) []string {
	if err != nil {
		return nil
	}
	raw, _ := json.Marshal(list)
	var l struct {
		Items []struct {
			Metadata metav1.ObjectMeta `json:"metadata"`
		} `json:"items"`
	}
	_ = json.Unmarshal(raw, &l)
	var names []string
	for _, i := range l.Items {
		names = append(names, i.Metadata.Namespace+"/"+i.Metadata.Name)
	}
	return names
}

// podProcesses are processes still in a pod's cgroup.
func (n *node) podProcesses() []string {
	var left []string
	cmd := cmdlines()
	for _, pid := range kubepodsPIDs() {
		left = append(left, fmt.Sprintf("process %d (%s)", pid, cmd[pid]))
	}
	return left
}

// checkHostFiles: after an uninstall, gpufrac's files on the host are
// only in chartHostDirs.
func (n *node) checkHostFiles() error {
	var outside []string
	for _, root := range []string{"/opt", "/var/lib", "/run", "/etc"} {
		entries, err := os.ReadDir(root)
		if err != nil {
			continue
		}
		for _, e := range entries {
			p := filepath.Join(root, e.Name())
			if strings.Contains(e.Name(), "gpufrac") && !slices.Contains(chartHostDirs, p) && p != fakeNVMLDir {
				outside = append(outside, p)
			}
		}
	}
	if len(outside) > 0 {
		return fmt.Errorf("gpufrac files outside the chart README's host directories: %v", outside)
	}
	return nil
}

// agentPod is the node agent's pod on the node, once Running.
func agentPod(t *testing.T) *corev1.Pod {
	t.Helper()
	return runningPod(t, "node-agent", "the node agent's pod")
}

// mpsPod is the node's MPS daemon pod, once Running.
func mpsPod(t *testing.T) *corev1.Pod {
	t.Helper()
	return runningPod(t, "mps", "the MPS daemon's pod")
}

// runningPod is the release's pod of a component on the node, once
// Running (not being deleted).
func runningPod(t *testing.T, component, what string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	if err := waitFor(what+" Running", 2*time.Minute, func() (bool, error) {
		pods, err := theNode.admin.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + release + "-" + component})
		if err != nil {
			return false, err
		}
		for i, p := range pods.Items {
			if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
				pod = &pods.Items[i]
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("%v\n%s", err, theNode.describeRelease())
	}
	return pod
}

// The chart's pods serve their health endpoints as the kubelet probes
// them: checked through the pod network, as a user's kubectl would.
func TestChartPodsAreReady(t *testing.T) {
	// helm install --wait does not wait for a DaemonSet that updates
	// OnDelete (the MPS daemon's), whose readiness probe may not have run
	// yet: give every pod a probe period or two.
	var pods *corev1.PodList
	if err := waitFor("every pod of the release Ready", time.Minute, func() (bool, error) {
		var err error
		pods, err = theNode.admin.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, p := range pods.Items {
			if !slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
				return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
			}) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Errorf("%v: %s", err, theNode.describeRelease())
	}
	components := map[string]int{}
	for _, p := range pods.Items {
		components[strings.TrimPrefix(p.Labels["app.kubernetes.io/name"], release+"-")]++
	}
	for c, want := range map[string]int{"scheduler": 2, "webhook": 2, "node-agent": 1, "mps": 1} {
		if components[c] != want {
			t.Errorf("%d %s pods, want %d (the chart's defaults): %v", components[c], c, want, components)
		}
	}
	agent := agentPod(t)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(fmt.Sprintf("http://%s:8082/readyz", agent.Status.PodIP))
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the agent's /readyz at %s: %s", agent.Status.PodIP, resp.Status)
	}
}

// containerProcess is the first process of a running container: the
// lowest PID whose cgroup names the container's ID (this test runs in the
// node's PID namespace).
func containerProcess(t *testing.T, id string) int {
	t.Helper()
	dirs, _ := os.ReadDir("/proc")
	first := 0
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", d.Name(), "cgroup"))
		if err == nil && strings.Contains(string(raw), id) && (first == 0 || pid < first) {
			first = pid
		}
	}
	if first == 0 {
		t.Fatalf("no process of container %s", id)
	}
	return first
}

// privileges is what the chart README's table says a container of the
// chart runs with.
type privileges struct {
	uid  string
	caps uint64 // CapEff, CapPrm and CapBnd
	// mounts are the container's own mounts besides the runtime's (/proc,
	// /dev, /sys and what they hold, /etc/hosts and friends, the service
	// account token): mount point, "ro" when read-only.
	mounts map[string]string
}

const (
	capKill     = 1 << 5
	capSysAdmin = 1 << 21
)

func TestChartPodsRunWithLeastPrivilege(t *testing.T) {
	// The stand-in runtime class nvidia's injections: what NVIDIA's
	// toolkit injects on a GPU node (the driver's NVML and MPS control).
	injected := map[string]string{"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1": "ro", "/usr/bin/nvidia-cuda-mps-control": "ro", fakeNVMLDir: "rw"}
	want := map[string]privileges{
		"scheduler": {uid: "65532", mounts: map[string]string{"/etc/gpufrac": "ro", "/tmp": "rw"}},
		"webhook":   {uid: "65532", mounts: map[string]string{"/etc/gpufrac/webhook-certs": "ro", "/tmp": "rw"}},
		"agent": {uid: "0", caps: capKill | capSysAdmin, mounts: map[string]string{
			filepath.Dir(theNode.nriSocket()): "rw", filepath.Dir(theNode.podResourcesSocket()): "ro", "/var/lib/gpufrac": "rw",
			"/host/proc": "ro", "/host/sys/fs/cgroup": "ro", "/run/gpufrac/mps": "rw", "/tmp": "rw",
			// The dmem stand-in's cgroup.controllers (nvidiaruntime).
			"/host/sys/fs/cgroup/cgroup.controllers": "ro"}},
		"mps": {uid: "0", mounts: map[string]string{"/host/proc": "ro", "/run/gpufrac/mps": "rw", "/tmp": "rw"}},
	}
	for _, c := range []string{"agent", "mps"} {
		for m, mode := range injected {
			want[c].mounts[m] = mode
		}
	}
	pods, err := theNode.admin.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, p := range pods.Items {
		name := p.Labels["app.kubernetes.io/name"]
		if p.Spec.HostNetwork || p.Spec.HostIPC || (p.Spec.HostPID != (strings.HasSuffix(name, "-node-agent") || strings.HasSuffix(name, "-mps"))) {
			t.Errorf("pod %s: hostNetwork %v, hostIPC %v, hostPID %v; only the node agent's and the MPS daemon's pods share one of the host's namespaces (PID)", p.Name, p.Spec.HostNetwork, p.Spec.HostIPC, p.Spec.HostPID)
		}
		for _, s := range p.Status.ContainerStatuses {
			w, ok := want[s.Name]
			if !ok {
				t.Errorf("pod %s has container %s, which the chart README's table does not list", p.Name, s.Name)
				continue
			}
			seen[s.Name] = true
			_, id, _ := strings.Cut(s.ContainerID, "://")
			pid := containerProcess(t, id)
			checkPrivileges(t, p.Name+"/"+s.Name, pid, w)
		}
	}
	for c := range want {
		if !seen[c] {
			t.Errorf("no running container %s was checked", c)
		}
	}
}

func checkPrivileges(t *testing.T, what string, pid int, w privileges) {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	status := map[string]string{}
	for _, l := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			status[k] = strings.TrimSpace(v)
		}
	}
	if uids := strings.Fields(status["Uid"]); len(uids) != 4 || slices.ContainsFunc(uids, func(u string) bool { return u != w.uid }) {
		t.Errorf("%s runs as uid %q, want %s", what, status["Uid"], w.uid)
	}
	for _, set := range []string{"CapEff", "CapPrm", "CapBnd"} {
		caps, err := strconv.ParseUint(status[set], 16, 64)
		if err != nil || caps != w.caps {
			t.Errorf("%s: %s %s, want %016x", what, set, status[set], w.caps)
		}
	}
	if status["NoNewPrivs"] != "1" {
		t.Errorf("%s: NoNewPrivs %q, want 1 (allowPrivilegeEscalation: false)", what, status["NoNewPrivs"])
	}
	raw, err = os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		f := strings.Fields(l)
		if len(f) < 6 {
			continue
		}
		point, mode := f[4], "rw"
		if slices.Contains(strings.Split(f[5], ","), "ro") {
			mode = "ro"
		}
		if point == "/" {
			if mode != "ro" {
				t.Errorf("%s: its root file system is writable", what)
			}
			continue
		}
		fstype := ""
		if _, post, ok := strings.Cut(l, " - "); ok {
			fstype = strings.Fields(post)[0]
		}
		if runtimeMount(point, fstype) || underOneOf(point, w.mounts) {
			continue
		}
		got[point] = mode
	}
	for point, mode := range w.mounts {
		if g, ok := got[point]; !ok {
			t.Errorf("%s: no mount at %s, which the chart README's table lists", what, point)
		} else if g != mode {
			t.Errorf("%s: %s is mounted %s, want %s", what, point, g, mode)
		}
		delete(got, point)
	}
	if len(got) > 0 {
		t.Errorf("%s: mounts the chart README's table does not list: %v", what, got)
	}
}

// runtimeMount is a mount every container gets from the kubelet and the
// runtime: containerd's default mounts, and the paths its default spec
// masks or makes read-only (containerd's oci/spec.go), and on a cgroup v1
// (hybrid) host the runtime's cgroup hierarchies under /sys/fs/cgroup;
// nothing else under /proc, /dev or /sys passes.
func runtimeMount(point, fstype string) bool {
	if strings.HasPrefix(point, "/sys/fs/cgroup/") && (fstype == "cgroup" || fstype == "cgroup2") {
		return true
	}
	return slices.Contains([]string{
		"/proc", "/dev", "/dev/pts", "/dev/mqueue", "/dev/shm", "/dev/termination-log", "/sys", "/sys/fs/cgroup",
		"/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
		"/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
		"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
		"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/var/run/secrets/kubernetes.io/serviceaccount",
	}, point)
}

// underOneOf: below (not at) a listed mount, as what an rbind of the
// host's /proc brings along.
func underOneOf(point string, mounts map[string]string) bool {
	for m := range mounts {
		if strings.HasPrefix(point, m+"/") {
			if _, listed := mounts[point]; !listed {
				return true
			}
		}
	}
	return false
}

// Each component's service account may do what the chart README's table
// says and not more: asked of the API server as that account.
func TestChartServiceAccountsHoldLeastPrivilege(t *testing.T) {
	type ask struct {
		verb, resource, sub, namespace string
		allowed                        bool
	}
	cases := map[string][]ask{
		release + "-webhook": {
			{"list", "nodes", "", "", true}, {"get", "resourceclaims", "", ns, true}, {"list", "pods", "", ns, true},
			{"update", "pods", "", ns, false}, {"create", "pods", "", ns, false}, {"get", "secrets", "", releaseNS, false},
		},
		release + "-scheduler": {
			{"create", "pods", "", api.DefaultReservationNamespace, true}, {"patch", "pods", "", ns, true}, {"create", "pods", "binding", ns, true},
			{"patch", "pods", "status", ns, true}, {"list", "resourcequotas", "", ns, true}, {"update", "resourcequotas", "", ns, false},
			{"create", "pods", "", ns, false}, {"get", "secrets", "", ns, false}, {"delete", "nodes", "", "", false},
		},
		release + "-node-agent": {
			{"patch", "nodes", "", "", true}, {"patch", "nodes", "status", "", true}, {"delete", "pods", "", ns, true},
			{"patch", "pods", "", api.DefaultReservationNamespace, true},
			{"create", "pods", "", ns, false}, {"patch", "pods", "", ns, false}, {"get", "secrets", "", releaseNS, false},
			{"list", "pods", "", ns, true}, {"patch", "pods", "status", ns, true}, {"update", "pods", "status", ns, false},
			{"update", "daemonsets", "", releaseNS, false},
		},
	}
	ctx := context.Background()
	for sa, asks := range cases {
		tr, err := theNode.admin.CoreV1().ServiceAccounts(releaseNS).CreateToken(ctx, sa, &authnv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("a token of %s: %v", sa, err)
		}
		cfg, err := clientcmd.BuildConfigFromFlags("", theNode.kubeconfig)
		if err != nil {
			t.Fatal(err)
		}
		// The service account's token, and nothing of the admin's: its
		// client certificate would authenticate first.
		cfg.BearerToken, cfg.BearerTokenFile = tr.Status.Token, ""
		cfg.CertData, cfg.KeyData, cfg.CertFile, cfg.KeyFile = nil, nil, "", ""
		as, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range asks {
			group := ""
			if a.resource == "resourceclaims" {
				group = "resource.k8s.io"
			}
			if a.resource == "daemonsets" {
				group = "apps"
			}
			r, err := as.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authzv1.SelfSubjectAccessReview{Spec: authzv1.SelfSubjectAccessReviewSpec{
				ResourceAttributes: &authzv1.ResourceAttributes{Verb: a.verb, Group: group, Resource: a.resource, Subresource: a.sub, Namespace: a.namespace}}}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if r.Status.Allowed != a.allowed {
				t.Errorf("%s may %s %s/%s in %q: %v, want %v", sa, a.verb, a.resource, a.sub, a.namespace, r.Status.Allowed, a.allowed)
			}
		}
	}
}

// replacedAgent waits for the DaemonSet's agent pod that is not old, and
// for the node to take fractions again.
func replacedAgent(t *testing.T, old *corev1.Pod) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	if err := waitFor("a new node agent pod Running", 3*time.Minute, func() (bool, error) {
		pods, err := theNode.admin.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + release + "-node-agent"})
		if err != nil {
			return false, err
		}
		for i, p := range pods.Items {
			if p.UID != old.UID && p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
				pod = &pods.Items[i]
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("%v\n%s", err, theNode.describeRelease())
	}
	if err := theNode.waitFractionReady(2 * time.Minute); err != nil {
		t.Fatal(err)
	}
	return pod
}

// waitGone waits until the pod is deleted (or being deleted).
func waitGone(t *testing.T, pod *corev1.Pod, why string) {
	t.Helper()
	if err := waitFor("pod "+pod.Name+" "+why, 2*time.Minute, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), pod.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && (p.UID != pod.UID || p.DeletionTimestamp != nil)) {
			return true, nil
		}
		return false, err
	}); err != nil {
		t.Fatal(err)
	}
}

// A fractional container that starts while the node has no agent (the
// DaemonSet's pod is gone: here GPU Feature Discovery's label was taken
// off, as a driver upgrade does) runs without its adjustment, since the
// runtime goes on without its NRI plugin. Once the DaemonSet's pod is
// back, the agent's audit stops it, its disruption budget notwithstanding.
func TestContainerStartedWithoutTheAgentIsStopped(t *testing.T) {
	ctx := context.Background()
	setLabel := func(value *string) {
		t.Helper()
		v := "null"
		if value != nil {
			v = strconv.Quote(*value)
		}
		patch := []byte(`{"metadata":{"labels":{"nvidia.com/gpu.present":` + v + `}}}`)
		if _, err := theNode.admin.CoreV1().Nodes().Patch(ctx, nodeName, "application/merge-patch+json", patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	present := "true"
	t.Cleanup(func() { setLabel(&present) })
	// Placed while the agent runs; its main container starts once the
	// init container's sleep is over, with the agent gone by then.
	off := false
	late := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "late", Namespace: ns, Annotations: map[string]string{"gpu-memory": "1024"}},
		Spec: corev1.PodSpec{SchedulerName: "gpufrac", RestartPolicy: corev1.RestartPolicyNever,
			// Long enough for the agent's pod to terminate (its grace
			// period is the default 30 s) before main is created.
			InitContainers: []corev1.Container{{Name: "wait", Image: probeImage, ImagePullPolicy: corev1.PullNever, Command: []string{"/bin/sleep", "40"}}},
			Containers:     []corev1.Container{probe("main", nil)}, AutomountServiceAccountToken: &off, EnableServiceLinks: &off,
			TerminationGracePeriodSeconds: new(int64(2)), SecurityContext: tenantUser()},
	}
	if _, err := theNode.admin.CoreV1().Pods(ns).Create(ctx, late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deletePod(t, "late") })
	if err := waitFor("pod late's init container running", time.Minute, func() (bool, error) {
		p := getPod(t, "late")
		return len(p.Status.InitContainerStatuses) == 1 && p.Status.InitContainerStatuses[0].State.Running != nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	old := agentPod(t)
	setLabel(nil)
	if err := waitFor("the agent's pod gone", time.Minute, func() (bool, error) {
		_, err := theNode.admin.CoreV1().Pods(releaseNS).Get(ctx, old.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatal(err)
	}
	unadjusted := running(t, "late")
	if r := theNode.probeReport(t, unadjusted, "main"); r.Env[nodeapi.EnvMemoryLimit] != "" {
		t.Fatalf("with no agent the container was adjusted anyway (%s=%s)", nodeapi.EnvMemoryLimit, r.Env[nodeapi.EnvMemoryLimit])
	}
	pinPod(t, "late")
	setLabel(&present)
	replacedAgent(t, old)
	waitGone(t, unadjusted, "evicted: it runs without its limits")
}

// mpsRoot is the chart's nodeAgent.mpsPipeDir, the node's own /run.
const mpsRoot = "/run/gpufrac/mps"

// startShares runs a time-slicing and an sm-sharing share, each under a
// PodDisruptionBudget that allows no disruption: what an upgrade or a
// restart of gpufrac must leave running.
func startShares(t *testing.T, prefix string) []string {
	t.Helper()
	names := []string{prefix + "-ts", prefix + "-sm"}
	createPod(t, names[0], map[string]string{"gpu-memory": "2048"}, probe("main", nil))
	createPod(t, names[1], map[string]string{"gpu-memory": "2048", api.KeyComputeSharingMode: string(api.SMSharing)}, probe("main", nil))
	for _, n := range names {
		pod := running(t, n)
		checkLimits(t, pod, assignment(t, pod, "main"), theNode.probeReport(t, pod, "main"))
		pinPod(t, n)
	}
	return names
}

// identity is what a pod that was neither deleted nor restarted keeps:
// its UID, and its containers' IDs and restart counts.
func identity(t *testing.T, name string) string {
	t.Helper()
	p, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return "gone: " + err.Error()
	}
	if p.DeletionTimestamp != nil {
		return "being deleted"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "uid %s", p.UID)
	for _, c := range p.Status.ContainerStatuses {
		fmt.Fprintf(&b, "; %s %s restarts %d running %v", c.Name, c.ContainerID, c.RestartCount, c.State.Running != nil)
	}
	return b.String()
}

func identities(t *testing.T, names []string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, n := range names {
		out[n] = identity(t, n)
	}
	return out
}

// daemonStatus is the node's MPS daemon as its supervisor records it.
func daemonStatus(t *testing.T) mps.Status {
	t.Helper()
	st, err := mps.ReadStatus(mpsRoot)
	if err != nil || !st.Running {
		t.Fatalf("the node's MPS daemon: %+v, %v", st, err)
	}
	return st
}

// waitResyncs waits until the node agent has published its node n more
// times: what it does to stale containers it does at a resync.
func waitResyncs(t *testing.T, n int) {
	t.Helper()
	heartbeat := func() time.Time {
		node, err := theNode.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return time.Time{}
		}
		c, _ := api.FractioningCondition(node)
		return c.LastHeartbeatTime.Time
	}
	last := heartbeat()
	for i := 0; i < n; i++ {
		if err := waitFor("the node agent's next resync", 2*time.Minute, func() (bool, error) {
			h := heartbeat()
			if h.After(last) {
				last = h
				return true, nil
			}
			return false, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
}

// checkUntouched: after one more resync of the agent (the first, which
// judges every running container, made the node ready), every share is the
// same pod with the same containers, none restarted, its limits still what
// the driver (the fake NVML) holds, on the same MPS daemon process.
func checkUntouched(t *testing.T, what string, before map[string]string, daemon mps.Status) {
	t.Helper()
	waitResyncs(t, 1)
	for name, was := range before {
		if now := identity(t, name); now != was {
			t.Errorf("%s: pod %s changed: was %s, now %s", what, name, was, now)
			continue
		}
		pod := getPod(t, name)
		checkLimits(t, pod, shareOf(t, pod), theNode.probeReport(t, pod, "main"))
	}
	if now := daemonStatus(t); now.PID != daemon.PID || now.Generation != daemon.Generation {
		t.Errorf("%s: the MPS daemon was replaced: pid %d generation %d, was pid %d generation %d (%s)", what, now.PID, now.Generation, daemon.PID, daemon.Generation, now.LastExit)
	}
}

// shareOf is the share of a pod's container main: its claim's, for a pod
// with a claim of gpufrac's DRA driver, else its annotations'.
func shareOf(t *testing.T, pod *corev1.Pod) api.Assignment {
	t.Helper()
	if len(pod.Spec.ResourceClaims) > 0 && pod.Spec.ResourceClaims[0].ResourceClaimName != nil {
		a, _ := claimShare(t, *pod.Spec.ResourceClaims[0].ResourceClaimName)
		return a
	}
	return assignment(t, pod, "main")
}

// newShareEnforced: a share placed now runs with its limits.
func newShareEnforced(t *testing.T, name string) {
	t.Helper()
	createPod(t, name, map[string]string{"gpu-memory": "1024"}, probe("main", nil))
	pod := running(t, name)
	checkLimits(t, pod, assignment(t, pod, "main"), theNode.probeReport(t, pod, "main"))
}

// The node agent's pod deleted as a user would (kubectl delete pod) comes
// back from its DaemonSet, and its container killed (SIGKILL, as the
// kernel's OOM killer ends it) is restarted by the kubelet: either way the
// node's running shares are untouched (no pod deleted or restarted, the
// same MPS daemon, their limits in force), and a share placed afterwards
// is enforced. The MPS daemon is a DaemonSet of its own; the new agent
// adopts it.
func TestAgentRestartsKillNobody(t *testing.T) {
	names := startShares(t, "restart")
	before, daemon := identities(t, names), daemonStatus(t)

	old := agentPod(t)
	if err := theNode.admin.CoreV1().Pods(releaseNS).Delete(context.Background(), old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	agent := replacedAgent(t, old)
	checkUntouched(t, "agent pod deleted", before, daemon)

	var id string
	var restarts int32
	for _, c := range agent.Status.ContainerStatuses {
		if c.Name == "agent" {
			_, id, _ = strings.Cut(c.ContainerID, "://")
			restarts = c.RestartCount
		}
	}
	if err := syscall.Kill(containerProcess(t, id), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := waitFor("the agent container restarted", 2*time.Minute, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(releaseNS).Get(context.Background(), agent.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range p.Status.ContainerStatuses {
			if c.Name == "agent" && c.RestartCount > restarts && c.Ready {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := theNode.waitFractionReady(2 * time.Minute); err != nil {
		t.Fatal(err)
	}
	checkUntouched(t, "agent container killed", before, daemon)
	newShareEnforced(t, "restart-after")
}

// mpsReplace runs gpufrac mps-replace on the node as an operator would.
func mpsReplace(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(theNode.repo, "bin", "gpufrac"), append([]string{"mps-replace", nodeName, "--kubeconfig", theNode.kubeconfig,
		"-n", releaseNS, "--selector", "app.kubernetes.io/name=" + release + "-mps", "--poll", "1s"}, args...)...)
	out, err := cmd.CombinedOutput()
	t.Logf("gpufrac mps-replace %v:\n%s", args, out)
	return string(out), err
}

// Replacing the node's MPS daemon is a drain: gpufrac mps-replace closes
// the node to fractions, evicts its shares as their disruption budgets
// allow (one without a budget goes, one whose budget refuses stays, and
// the command fails at its deadline naming it, leaving the daemon and the
// node closed), touches no other pod, and once the budget allows it
// replaces the daemon and reopens the node, where a share placed while it
// was closed now runs enforced.
func TestMPSReplaceDrainsByBudget(t *testing.T) {
	ctx := context.Background()
	createPod(t, "drain-free", map[string]string{"gpu-memory": "1024"}, probe("main", nil))
	createPod(t, "drain-pinned", map[string]string{"gpu-memory": "1024"}, probe("main", nil))
	createPod(t, "drain-plain", nil, probe("main", nil))
	for _, n := range []string{"drain-free", "drain-pinned", "drain-plain"} {
		running(t, n)
	}
	free := getPod(t, "drain-free")
	pinPod(t, "drain-pinned")
	kept := identities(t, []string{"drain-pinned", "drain-plain"})
	daemon := daemonStatus(t)

	out, err := mpsReplace(t, "--timeout", "20s")
	if err == nil {
		t.Fatal("mps-replace succeeded with a share its budget refuses to evict")
	}
	if !strings.Contains(out, ns+"/drain-pinned") || !strings.Contains(out, "disruption budget") {
		t.Errorf("mps-replace does not name the share its budget holds: %s", out)
	}
	waitGone(t, free, "evicted by mps-replace")
	for name, was := range kept {
		if now := identity(t, name); now != was {
			t.Errorf("pod %s changed while its budget refused: was %s, now %s", name, was, now)
		}
	}
	if now := daemonStatus(t); now.PID != daemon.PID {
		t.Errorf("the MPS daemon was replaced with a share left on it (pid %d, was %d)", now.PID, daemon.PID)
	}
	// Closed: a share created now is not placed on the node.
	createPod(t, "drain-late", map[string]string{"gpu-memory": "1024"}, probe("main", nil))
	if err := waitFor("drain-late held back: the node is closed", time.Minute, func() (bool, error) {
		p := getPod(t, "drain-late")
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("placed on the closed node %s", p.Spec.NodeName)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, "closed to new fractions") {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Error(err)
	}

	// The budget's owner lets it go.
	if err := theNode.admin.PolicyV1().PodDisruptionBudgets(ns).Delete(ctx, "drain-pinned", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pinned := getPod(t, "drain-pinned")
	if _, err := mpsReplace(t, "--timeout", "2m"); err != nil {
		t.Fatal(err)
	}
	waitGone(t, pinned, "evicted by mps-replace")
	if now := identity(t, "drain-plain"); now != kept["drain-plain"] {
		t.Errorf("mps-replace touched a pod that holds no share: was %s, now %s", kept["drain-plain"], now)
	}
	if now := daemonStatus(t); now.PID == daemon.PID || now.Generation == daemon.Generation {
		t.Errorf("the MPS daemon was not replaced: %+v", now)
	}
	node, err := theNode.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if by, closed := api.FractionsClosed(node.Labels); closed {
		t.Errorf("the node is still closed (%s) after mps-replace succeeded", by)
	}
	late := running(t, "drain-late")
	checkLimits(t, late, assignment(t, late, "main"), theNode.probeReport(t, late, "main"))
}

// createdThrough is what happened to pods created one after another while
// the scheduler and the webhook were upgraded.
type createdThrough struct {
	names          []string
	created, error int
	errors         []string
}

// createWhile creates a fraction every interval until stop closes, as a
// client would (no retries of its own beyond client-go's).
func createWhile(stop <-chan struct{}, interval time.Duration) createdThrough {
	var r createdThrough
	off := false
	for i := 0; ; i++ {
		select {
		case <-stop:
			return r
		case <-time.After(interval):
		}
		name := fmt.Sprintf("through-%d", i)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: map[string]string{"gpu-memory": "256"}},
			Spec: corev1.PodSpec{SchedulerName: "gpufrac", RestartPolicy: corev1.RestartPolicyNever, Containers: []corev1.Container{probe("main", nil)},
				AutomountServiceAccountToken: &off, EnableServiceLinks: &off, TerminationGracePeriodSeconds: new(int64(2)), SecurityContext: tenantUser()}}
		r.created++
		if _, err := theNode.admin.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
			r.error++
			r.errors = append(r.errors, err.Error())
			continue
		}
		r.names = append(r.names, name)
	}
}

// helm upgrade to an image of another digest, with a changed node-agent
// value, rolls the agent, the scheduler and the webhook, and kills nobody:
// the node's shares, time-slicing and sm-sharing by annotation and by DRA
// claim (the chart's DRA front door turned on first, by an upgrade too),
// under budgets allowing no disruption, are the same
// pods and containers, unrestarted, on the same MPS daemon (its DaemonSet
// is OnDelete), their limits in force; the new agent runs with the value;
// fractions created all through the upgrade are admitted and placed; and
// a share placed afterwards is enforced.
func TestHelmUpgradeRollsTheAgent(t *testing.T) {
	// The DRA front door first: an upgrade too (values only), after which
	// DRA shares run beside the annotated ones.
	chart := filepath.Join(theNode.repo, "deploy", "helm", "gpufrac")
	withDRA := append(theNode.helmValues(), theNode.draValues()...)
	first := agentPod(t)
	if _, err := theNode.helm(append([]string{"upgrade", release, chart, "-n", releaseNS, "--wait", "--timeout", "3m"}, withDRA...)...); err != nil {
		t.Fatal(err)
	}
	replacedAgent(t, first)
	names := startShares(t, "upgrade")
	shareClaim(t, "upgrade-ts-claim", api.DRADriver, "2Gi", "", "4Gi")
	claimPod(t, "upgrade-dra-ts", "upgrade-ts-claim")
	shareClaim(t, "upgrade-sm-claim", "sm-sharing."+api.DRADriver, "1Gi", "25", "1Gi")
	claimPod(t, "upgrade-dra-sm", "upgrade-sm-claim")
	for _, n := range []string{"upgrade-dra-ts", "upgrade-dra-sm"} {
		pod := running(t, n)
		checkLimits(t, pod, shareOf(t, pod), theNode.probeReport(t, pod, "main"))
		pinPod(t, n)
		names = append(names, n)
	}
	before, daemon := identities(t, names), daemonStatus(t)
	old := agentPod(t)
	oldMPS := mpsPod(t)
	image := old.Spec.Containers[0].Image
	_, tag, _ := strings.Cut(image, ":")

	stop := make(chan struct{})
	loop := make(chan createdThrough, 1)
	go func() { loop <- createWhile(stop, time.Second) }()
	args := append([]string{"upgrade", release, chart, "-n", releaseNS, "--wait", "--timeout", "3m"},
		append(withDRA, "--set", "nodeAgent.resyncPeriod=20s", "--set", "image.tag="+tag+"-next")...)
	_, err := theNode.helm(args...)
	close(stop)
	through := <-loop
	for _, n := range through.names {
		t.Cleanup(func() { deletePod(t, n) })
	}
	if err != nil {
		t.Fatal(err)
	}
	agent := replacedAgent(t, old)
	var flags []string
	for _, c := range agent.Spec.Containers {
		if c.Name == "agent" {
			flags = c.Args
			if c.Image == image {
				t.Errorf("the new agent runs the old image %s", c.Image)
			}
		}
	}
	if !slices.Contains(flags, "--resync-period=20s") {
		t.Errorf("the new agent runs with %v, not the upgraded value", flags)
	}
	// The scheduler and the webhook rolled too (the image changed): the
	// fractions above were created and placed through their roll.
	for _, name := range []string{release + "-scheduler", release + "-webhook"} {
		pods, err := theNode.admin.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + name})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil && p.Spec.Containers[0].Image == image {
				t.Errorf("%s pod %s still runs the old image %s after the upgrade", name, p.Name, image)
			}
		}
	}
	if now := mpsPod(t); now.UID != oldMPS.UID {
		t.Errorf("helm upgrade replaced the MPS daemon's pod (%s, was %s)", now.Name, oldMPS.Name)
	}
	checkUntouched(t, "helm upgrade", before, daemon)

	// Placed and running, each still the pod created, also after one more
	// resync of the new agent: none deleted (a container created while no
	// agent served would start unadjusted, and be deleted by the next).
	placed, lost := 0, map[string]string{}
	count := func() (bool, error) {
		placed, lost = 0, map[string]string{}
		for _, n := range through.names {
			p, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), n, metav1.GetOptions{})
			switch {
			case err != nil:
				lost[n] = err.Error()
			case p.DeletionTimestamp != nil:
				lost[n] = "being deleted"
			case p.Status.Phase == corev1.PodRunning:
				placed++
			}
		}
		return placed+len(lost) == len(through.names), nil
	}
	if err := waitFor("the pods created through the upgrade placed and running", 3*time.Minute, count); err != nil {
		t.Error(err)
	}
	waitResyncs(t, 1)
	if done, err := count(); !done || err != nil {
		t.Errorf("after one more resync of the agent: %d of %d running, lost %v (%v)", placed, len(through.names), lost, err)
	}
	t.Logf("pods created through helm upgrade: %d created, %d admitted, %d placed and running, %d failed %v, %d lost %v", through.created, len(through.names), placed, through.error, through.errors, len(lost), lost)
	if through.error > 0 || len(lost) > 0 {
		t.Errorf("%d of %d creations failed during the upgrade (%v), %d pods lost (%v)", through.error, through.created, through.errors, len(lost), lost)
	}
	for _, n := range through.names {
		deletePod(t, n)
	}
	newShareEnforced(t, "upgrade-after")
}

// The GPU Operator's upgrade controller at pod-restart-required (the
// node's driver pod is being replaced, and its driver manager unloads the
// modules): the node agent's and the MPS daemon's pods leave the node, as
// the operator's own operands do, so that neither holds the driver. At
// uncordon-required both are back, the node takes fractions again, and a
// share placed then is enforced.
func TestDriverUpgradeStepsAside(t *testing.T) {
	ctx := context.Background()
	setState := func(state string) {
		t.Helper()
		v := "null"
		if state != "" {
			v = strconv.Quote(state)
		}
		patch := []byte(`{"metadata":{"labels":{"nvidia.com/gpu-driver-upgrade-state":` + v + `}}}`)
		if _, err := theNode.admin.CoreV1().Nodes().Patch(ctx, nodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { setState("") })
	oldAgent, oldMPS := agentPod(t), mpsPod(t)
	setState("pod-restart-required")
	if err := waitFor("the agent's and the MPS daemon's pods gone from the node", 2*time.Minute, func() (bool, error) {
		for _, name := range []string{release + "-node-agent", release + "-mps"} {
			pods, err := theNode.admin.CoreV1().Pods(releaseNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + name})
			if err != nil || len(pods.Items) > 0 {
				return false, err
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("%v\n%s", err, theNode.describeRelease())
	}
	setState("uncordon-required")
	replacedAgent(t, oldAgent)
	if now := mpsPod(t); now.UID == oldMPS.UID {
		t.Errorf("the MPS daemon's pod %s stayed through the driver's replacement", now.Name)
	}
	newShareEnforced(t, "after-driver")
}
