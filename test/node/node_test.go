//go:build nodee2e || charte2e

// Package node runs gpufrac's node side on a real node of this machine: a
// kubelet, containerd and runc, with the node agent as containerd's NRI
// plugin and `gpufrac hook apply-memory-limits` as runc's createRuntime hook,
// joined to the control plane of `gpufrac up` (kube-apiserver, the webhook,
// the scheduler with GPUFractions). The agent also serves its DRA driver
// to the kubelet, whose claims containerd injects as CDI devices
// (dra_test.go). Only what needs a GPU is a stand-in:
//
//   - libnvidia-ml.so.1 (fakenvml/, C): the GPUs of go-nvml's dgxh100 mock
//     machine, driver r615 with CUDA 13.4; it records SetMemoryLimits_v1;
//   - the device plugin (devicePlugin below): those GPUs' UUIDs, registered
//     with the kubelet over its real device-plugin gRPC API;
//   - nvidia-cuda-mps-control: pkg/node/mps/mpstest, run as this test binary;
//   - the dmem controller: the agent's --cgroup-root names a directory whose
//     cgroup.controllers lists dmem, since this kernel has neither dmem nor
//     misc (and this machine boots cgroup v1 hybrid).
//
// The agent runs as in its DaemonSet: in the node's PID namespace (what
// hostPID is on a node; the node has its own, isolate_test.go), but in a
// cgroup namespace of its own. Each scenario asserts what the container
// itself saw (the probe's JSON line in its log) and what the fake driver
// recorded for its real cgroup. `make node-e2e` builds the parts and runs
// it (-tags nodee2e), as root.
package node

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
	dp "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/internal/runner"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

const (
	nodeName = "node-e2e"
	// The fake driver is r615 with CUDA 13.4: the first with per-cgroup
	// memory limits (inventory.Capability).
	fakeDriver = "615.27.01"
	fakeCUDA   = 13040
	bridge     = "gfnode0"
	// podCIDR is the pods' addresses on the bridge.
	podCIDR    = "10.213.0.0/24"
	probeImage = "localhost/gpufrac/probe:1"
	// standingGPUs of the node's eight are held for shares, so that DRA
	// claims of both compute modes find a GPU each (dra_test.go).
	standingGPUs = 2
)

// theNode is the node every test uses; TestMain starts and stops it.
var theNode *node

// run starts the node, runs the tests, and stops it: a node that leaves
// anything behind fails the run.
func run(m *testing.M, startNode func() (*node, error)) int {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "node e2e: must run as root (containerd, runc and the kubelet need it); run it with `make node-e2e` as root")
		return 1
	}
	// The node runs in namespaces of its own (isolate_test.go): on the
	// host this binary only starts it and checks the host afterwards.
	switch os.Getenv(stageEnv) {
	case "":
		return onHost()
	case stageInit:
		return nodeInit()
	}
	n, err := startNode()
	theNode = n
	code := 0
	if err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: start:", err)
		code = 1
	} else {
		code = m.Run()
	}
	if code != 0 && n != nil {
		n.dumpLogs()
		n.saveLogs()
	}
	if n != nil {
		if err := n.stop(); err != nil {
			fmt.Fprintln(os.Stderr, "node e2e: cleanup:", err)
			code = 1
		}
	}
	return code
}

// node is the running node and the control plane it joined.
type node struct {
	repo, dir string
	gpufrac   string // bin/gpufrac
	nodeBin   string // bin/node: containerd, its shim, ctr, the fake NVML, the images
	// kubeconfig is the admin's, for the kubelet and the tools;
	// downControlPlane stops the control plane.
	kubeconfig       string
	downControlPlane func()
	// nvml is the fake driver's state directory (fakenvml/), when not
	// <dir>/nvml; cleanups run last in stop, after every process.
	nvml     string
	cleanups []func() error
	// beforeStop runs first in stop, with everything still up.
	beforeStop []func() error
	// kubeletKubeconfig is the kubelet's, when not the admin's; images
	// are archives imported into containerd besides the test images;
	// runtimes is containerd configuration for runtime handlers.
	kubeletKubeconfig string
	images            []string
	runtimes          string
	admin             kubernetes.Interface
	gpus              []inventory.GPU
	// metricsAddr is the agent's /metrics (TLS), where it serves them.
	metricsAddr string

	mu    sync.Mutex
	procs map[string]*runner.Process
	// plugin is the device-plugin stand-in; allocations records what the
	// kubelet asked it for.
	plugin *devicePlugin
}

func (n *node) path(parts ...string) string {
	return filepath.Join(append([]string{n.dir}, parts...)...)
}
func (n *node) nvmlDir() string {
	if n.nvml != "" {
		return n.nvml
	}
	return n.path("nvml")
}
func (n *node) containerdSocket() string { return n.path("containerd.sock") }
func (n *node) nriSocket() string        { return n.path("nri", "nri.sock") }
func (n *node) kubeletRoot() string      { return n.path("kubelet") }
func (n *node) mpsRoot() string          { return n.path("m") }
func (n *node) cdiDir() string           { return n.path("cdi-specs") }
func (n *node) podResourcesSocket() string {
	return filepath.Join(n.kubeletRoot(), "pod-resources", "kubelet.sock")
}

// newNode checks what every node needs, and need (paths in the
// repository), and makes its work directory.
func newNode(need ...string) (*node, error) {
	repo, err := checkout.Root()
	if err != nil {
		return nil, err
	}
	// A tmpfs of the node's own (isolate_test.go), made on the host as
	// /tmp/gfn<digits>. Short: an MPS namespace's control socket under it
	// must stay within 83 characters (nodeapi.CheckRoot), so the MPS root
	// is <dir>/m.
	dir := os.Getenv(dirEnv)
	if dir == "" {
		return nil, errors.New(dirEnv + " is not set: the node runs in the namespaces that onHost makes")
	}
	n := &node{repo: repo, dir: dir, gpufrac: filepath.Join(repo, "bin", "gpufrac"), nodeBin: filepath.Join(repo, "bin", "node"), procs: map[string]*runner.Process{}}
	need = append(need, n.gpufrac, filepath.Join(n.nodeBin, "containerd"), filepath.Join(n.nodeBin, "containerd-shim-runc-v2"),
		filepath.Join(n.nodeBin, "ctr"), filepath.Join(n.nodeBin, "lib", "libnvidia-ml.so.1"), filepath.Join(n.nodeBin, "images.tar"),
		filepath.Join(repo, "bin", "kube", "kubelet"), "/usr/sbin/runc", "/usr/lib/cni/bridge")
	for i, p := range need {
		if !filepath.IsAbs(p) {
			need[i] = filepath.Join(repo, p)
		}
	}
	for _, need := range need {
		if _, err := os.Stat(need); err != nil {
			return n, fmt.Errorf("%s is missing: `make node-e2e` (or `make chart-e2e`) builds or installs it", need)
		}
	}
	for _, d := range []string{"logs", "nvml", "cni", "m", "agent", "pod-logs", "dmem-standin", "cdi-specs", "nri"} {
		if err := os.MkdirAll(n.path(d), 0o755); err != nil {
			return n, err
		}
	}
	return n, nil
}

// step is one part of bringing a node up.
type step struct {
	what string
	do   func() error
}

// runSteps runs the steps in order, each reported with its time.
func (n *node) runSteps(steps []step) error {
	for _, s := range steps {
		start := time.Now()
		if err := s.do(); err != nil {
			return fmt.Errorf("%s: %w", s.what, err)
		}
		fmt.Fprintf(os.Stderr, "node e2e: %-48s %5.1fs\n", s.what, time.Since(start).Seconds())
	}
	return nil
}

func (n *node) logFile(name string) *os.File {
	f, err := os.Create(n.path("logs", name+".log"))
	if err != nil {
		return os.Stderr
	}
	return f
}

// writeMachine describes go-nvml's dgxh100 mock machine to the fake
// library: the same UUIDs the device plugin serves.
func (n *node) writeMachine() error {
	lib, err := inventory.Simulated("dgxh100")
	if err != nil {
		return err
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		return err
	}
	n.gpus = inv.GPUs
	var b strings.Builder
	fmt.Fprintf(&b, "%s %d\n", fakeDriver, fakeCUDA)
	for _, g := range inv.GPUs {
		fmt.Fprintf(&b, "%s %d %s %s\n", g.UUID, g.MemoryMiB, g.PCIBusID, g.Product)
	}
	return os.WriteFile(filepath.Join(n.nvmlDir(), "machine"), []byte(b.String()), 0o644)
}

// start runs a component of the node, as gpufrac up runs its own
// (package runner): its own process group, its log in logs/.
func (n *node) start(name string, env []string, bin string, args ...string) error {
	p, err := runner.Start(name, n.path("logs", name+".log"), env, bin, args...)
	if err != nil {
		return err
	}
	n.mu.Lock()
	n.procs[name] = p
	n.mu.Unlock()
	return nil
}

// stopProcess sends SIGTERM and waits; after 15 s, SIGKILL.
func (n *node) stopProcess(name string) {
	n.mu.Lock()
	p := n.procs[name]
	delete(n.procs, name)
	n.mu.Unlock()
	if p != nil {
		runner.Stop(15*time.Second, p)
	}
}

// killProcess ends a process at once, as a crash or an OOM kill would:
// it gets no chance to say it is going.
func (n *node) killProcess(name string) {
	n.mu.Lock()
	p := n.procs[name]
	delete(n.procs, name)
	n.mu.Unlock()
	if p != nil {
		p.Kill()
	}
}

// errNotStarted is exited's error for a process this test never started
// (or stopped): in chart mode the agent is a pod, not a process.
var errNotStarted = errors.New("not started by the test")

func (n *node) exited(name string) error {
	n.mu.Lock()
	p := n.procs[name]
	n.mu.Unlock()
	if p == nil {
		return fmt.Errorf("%s: %w", name, errNotStarted)
	}
	return p.Exited()
}

func waitFor(what string, timeout time.Duration, ok func() (bool, error)) error {
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, timeout, true, func(context.Context) (bool, error) { return ok() })
	if err != nil {
		return fmt.Errorf("waiting for %s: %w", what, err)
	}
	return nil
}

func (n *node) startContainerd() error {
	conf := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "gpufrac-node-e2e", "plugins": [
  {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}}]}`, bridge, podCIDR, n.path("cni-ipam"))
	if err := os.WriteFile(n.path("cni", "10-gpufrac.conflist"), []byte(conf), 0o644); err != nil {
		return err
	}
	// What the spike found this machine needs (docs/research/real-node-spike.md):
	// no AppArmor profile (none is loaded here), runc from Debian, and the
	// sandbox image that mkimage tagged, since none can be pulled.
	config := fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[ttrpc]
  address = "%[3]s.ttrpc"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = %[4]q
  plugin_path = %[5]q
  plugin_config_path = %[5]q
[plugins."io.containerd.internal.v1.opt"]
  path = %[8]q
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "registry.k8s.io/pause:3.10"
[plugins."io.containerd.cri.v1.runtime"]
  disable_apparmor = true
  restrict_oom_score_adj = true
  cdi_spec_dirs = [%[9]q]
[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = %[6]q
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  BinaryName = "/usr/sbin/runc"
  Root = %[7]q
%[10]s`, n.path("containerd", "root"), n.path("containerd", "state"), n.containerdSocket(), n.nriSocket(), n.path("nri-plugins"),
		n.path("cni"), n.path("runc"), n.path("opt"), n.cdiDir(), n.runtimes)
	if err := os.WriteFile(n.path("containerd.toml"), []byte(config), 0o644); err != nil {
		return err
	}
	env := []string{"PATH=" + n.nodeBin + ":" + os.Getenv("PATH")} // the shim is found on PATH
	if err := n.start("containerd", env, filepath.Join(n.nodeBin, "containerd"), "--config", n.path("containerd.toml")); err != nil {
		return err
	}
	if err := waitFor("containerd's socket", 30*time.Second, func() (bool, error) {
		if err := n.exited("containerd"); err != nil {
			return false, err
		}
		c, err := net.Dial("unix", n.containerdSocket())
		if err == nil {
			_ = c.Close()
		}
		return err == nil, nil
	}); err != nil {
		return err
	}
	for _, archive := range append([]string{filepath.Join(n.nodeBin, "images.tar")}, n.images...) {
		out, err := exec.Command(filepath.Join(n.nodeBin, "ctr"), "--address", n.containerdSocket(), "-n", "k8s.io",
			"images", "import", archive).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ctr images import %s: %w\n%s", archive, err, out)
		}
	}
	return nil
}

// freePorts is n free loopback ports.
func freePorts(n int) ([]int, error) {
	ports := make([]int, n)
	for i := range ports {
		p, err := localcluster.FreePort()
		if err != nil {
			return nil, err
		}
		ports[i] = p
	}
	return ports, nil
}

func (n *node) startKubelet() error {
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	port, healthz := ports[0], ports[1]
	// failCgroupV1: this machine is cgroup v1 (hybrid); cgroupfs, not
	// systemd, manages the cgroups, under the node's own (cgroupRoot,
	// made by the host side: isolate_test.go). Authentication and
	// authorization are open on loopback only: the kubelet serves nothing
	// else here. No eviction thresholds or allocatable enforcement: the
	// test machine's disk and memory are not the node's to manage.
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
containerRuntimeEndpoint: unix://%s
failSwapOn: false
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
address: 127.0.0.1
port: %d
healthzBindAddress: 127.0.0.1
healthzPort: %d
readOnlyPort: 0
staticPodPath: ""
podLogsDir: %s
volumePluginDir: %s
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
enforceNodeAllocatable: []
localStorageCapacityIsolation: false
resolvConf: ""
podPidsLimit: -1
`, nodeCgroup, n.containerdSocket(), port, healthz, n.path("pod-logs"), n.path("volume-plugins"))
	if err := os.WriteFile(n.path("kubelet.yaml"), []byte(config), 0o644); err != nil {
		return err
	}
	// The device manager's fixed directory: an earlier run's checkpoint
	// would hand this kubelet allocations of pods it never had.
	if err := clearDevicePlugins(); err != nil {
		return err
	}
	if err := n.start("kubelet", nil, filepath.Join(n.repo, "bin", "kube", "kubelet"), "--config", n.path("kubelet.yaml"),
		"--kubeconfig", cmp.Or(n.kubeletKubeconfig, n.kubeconfig), "--root-dir", n.kubeletRoot(), "--hostname-override", nodeName,
		"--node-ip", nodeAddress, "--v", "2"); err != nil {
		return err
	}
	return waitFor("the kubelet's Node, Ready", 90*time.Second, func() (bool, error) {
		if err := n.exited("kubelet"); err != nil {
			return false, err
		}
		node, err := n.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	})
}

func (n *node) waitFractionReady(timeout time.Duration) error {
	var why string
	err := waitFor("the node's "+api.ConditionFractioningReady, timeout, func() (bool, error) {
		if err := n.exited("node-agent"); err != nil && !errors.Is(err, errNotStarted) {
			return false, err // the agent as a host process (hostnode_test.go) exited
		}
		node, err := n.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range node.Status.Conditions {
			if string(c.Type) == api.ConditionFractioningReady {
				why = fmt.Sprintf("%s %s: %s", c.Status, c.Reason, c.Message)
				return c.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("%w (last: %s)", err, why)
	}
	return nil
}

// devicePlugin stands in for NVIDIA's device plugin: it serves the mock
// machine's GPUs as nvidia.com/gpu, named by UUID as NVIDIA's plugin names
// them, over the kubelet's device-plugin API (v1beta1).
type devicePlugin struct {
	dp.UnimplementedDevicePluginServer
	uuids []string

	mu          sync.Mutex
	allocations [][]string
	stop        chan struct{}
}

func (p *devicePlugin) GetDevicePluginOptions(context.Context, *dp.Empty) (*dp.DevicePluginOptions, error) {
	return &dp.DevicePluginOptions{}, nil
}

func (p *devicePlugin) ListAndWatch(_ *dp.Empty, s dp.DevicePlugin_ListAndWatchServer) error {
	var devs []*dp.Device
	for _, u := range p.uuids {
		devs = append(devs, &dp.Device{ID: u, Health: dp.Healthy})
	}
	if err := s.Send(&dp.ListAndWatchResponse{Devices: devs}); err != nil {
		return err
	}
	select {
	case <-p.stop:
	case <-s.Context().Done():
	}
	return nil
}

func (p *devicePlugin) Allocate(_ context.Context, req *dp.AllocateRequest) (*dp.AllocateResponse, error) {
	resp := &dp.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		p.mu.Lock()
		p.allocations = append(p.allocations, c.DevicesIds)
		p.mu.Unlock()
		resp.ContainerResponses = append(resp.ContainerResponses, &dp.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIds, ",")},
		})
	}
	return resp, nil
}

func (p *devicePlugin) allocated() [][]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.allocations)
}

func (n *node) startDevicePlugin() error {
	p := &devicePlugin{stop: make(chan struct{})}
	for _, g := range n.gpus {
		p.uuids = append(p.uuids, g.UUID)
	}
	// The kubelet serves device plugins at a fixed path, whatever its
	// --root-dir (pluginapi.KubeletSocket); startKubelet empties it.
	dir := dp.DevicePluginPath
	const endpoint = "gpufrac-e2e.sock"
	if err := waitFor("the kubelet's device-plugin socket", 30*time.Second, func() (bool, error) {
		_, err := os.Stat(filepath.Join(dir, "kubelet.sock"))
		return err == nil, nil
	}); err != nil {
		return err
	}
	l, err := net.Listen("unix", filepath.Join(dir, endpoint))
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	dp.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(l) }()
	n.plugin = p
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := dp.NewRegistrationClient(conn).Register(ctx, &dp.RegisterRequest{Version: dp.Version, Endpoint: endpoint, ResourceName: string(api.ResourceGPU)}); err != nil {
		return fmt.Errorf("register with the kubelet: %w", err)
	}
	return waitFor("nvidia.com/gpu on the Node", 60*time.Second, func() (bool, error) {
		node, err := n.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		q := node.Status.Allocatable[api.ResourceGPU]
		return q.Value() == int64(len(p.uuids)), nil
	})
}

// limitCall is one SetMemoryLimits_v1 the fake driver accepted.
type limitCall struct {
	GPU        string
	Soft, Hard uint64
	Cgroup     string
}

func (n *node) limitCalls() ([]limitCall, error) {
	raw, err := os.ReadFile(filepath.Join(n.nvmlDir(), "limits"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var calls []limitCall
	for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		f := strings.Fields(line)
		if len(f) != 6 || f[0] != "set" {
			return nil, fmt.Errorf("fake NVML limits: bad line %q", line)
		}
		soft, err1 := strconv.ParseUint(f[2], 10, 64)
		hard, err2 := strconv.ParseUint(f[3], 10, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("fake NVML limits: bad line %q", line)
		}
		calls = append(calls, limitCall{GPU: f[1], Soft: soft, Hard: hard, Cgroup: f[4]})
	}
	return calls, nil
}

// setUsed makes the fake driver report that cgroup uses bytes on a GPU
// (GetMemoryLimits_v1's currentUsed), by the cgroup directory's device and
// inode, as it matches limits.
func (n *node) setUsed(uuid, cgroup string, bytes uint64) error {
	var st syscall.Stat_t
	if err := syscall.Stat(cgroup, &st); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(n.nvmlDir(), "used"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(f, "%s %d %d:%d\n", uuid, bytes, st.Dev, st.Ino)
	return errors.Join(err, f.Close())
}

// stop takes the node down: pods first (so the kubelet stops their
// containers), then the agent, the kubelet, every CRI sandbox left, the
// shims, containerd, the MPS daemon, the control plane; then it unmounts
// what containerd and the kubelet mounted under the work directory, and
// fails if any process of the node is left.
func (n *node) stop() error {
	var errs []error
	if n.admin != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		for _, ns := range []string{"default", api.DefaultReservationNamespace} {
			_ = n.admin.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}, metav1.ListOptions{})
		}
		cancel()
	}
	for _, f := range n.beforeStop {
		if err := f(); err != nil {
			errs = append(errs, err)
		}
	}
	if n.plugin != nil {
		close(n.plugin.stop)
	}
	n.stopProcess("node-agent")
	n.stopProcess("kubelet")
	if err := n.removeSandboxes(); err != nil {
		errs = append(errs, err)
	}
	n.stopProcess("containerd")
	n.stopProcess("mps-daemon")
	n.mu.Lock()
	var rest []string
	for name := range n.procs {
		rest = append(rest, name)
	}
	n.mu.Unlock()
	for _, name := range rest {
		n.stopProcess(name)
	}
	if n.downControlPlane != nil {
		n.downControlPlane()
	}
	// What an orderly stop left is a failure; it is killed all the same,
	// so that the next run starts clean.
	if left := n.leftovers(); len(left) > 0 {
		errs = append(errs, fmt.Errorf("processes left behind: %s", strings.Join(left, "; ")))
	}
	n.killMatching(n.containerdSocket()) // the shims name containerd's socket
	n.killKubepods()
	for _, c := range n.cleanups {
		if err := c(); err != nil {
			errs = append(errs, err)
		}
	}
	// The work directory, the bridge and the kubelet's fixed directories
	// go with the node's namespaces; what is mounted is unmounted here so
	// that a mount that will not go is reported.
	if err := n.unmountAll(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeSandboxes stops and removes every pod sandbox through CRI, as the
// kubelet would have: that ends each sandbox's and container's processes
// and its network namespace.
func (n *node) removeSandboxes() error {
	if n.exited("containerd") != nil {
		return nil
	}
	conn, err := grpc.NewClient("unix://"+n.containerdSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	rs := cri.NewRuntimeServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	list, err := rs.ListPodSandbox(ctx, &cri.ListPodSandboxRequest{})
	if err != nil {
		return fmt.Errorf("list the pod sandboxes: %w", err)
	}
	var errs []error
	for _, sb := range list.Items {
		if _, err := rs.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
			errs = append(errs, fmt.Errorf("stop sandbox %s: %w", sb.Id, err))
		}
		if _, err := rs.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
			errs = append(errs, fmt.Errorf("remove sandbox %s: %w", sb.Id, err))
		}
	}
	return errors.Join(errs...)
}

// clearDevicePlugins empties the kubelet's device-plugin directory of
// what this test's kubelet and plugin put there.
func clearDevicePlugins() error {
	var errs []error
	for _, f := range []string{"kubelet.sock", "gpufrac-e2e.sock", "kubelet_internal_checkpoint"} {
		if err := os.Remove(filepath.Join(dp.DevicePluginPath, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// cmdlines maps every process to its command line.
func cmdlines() map[int]string {
	out := map[int]string{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(raw) == 0 {
			continue
		}
		out[pid] = strings.TrimSpace(strings.ReplaceAll(string(raw), "\x00", " "))
	}
	return out
}

func (n *node) killMatching(s string) {
	for pid, cmd := range cmdlines() {
		if strings.Contains(cmd, s) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// kubepodsRoots are the kubelet's pod cgroups (cgroupfs driver, under its
// cgroupRoot nodeCgroup): in the unified hierarchy, and in v1's pids
// hierarchy on a hybrid host. Read in the node's PID namespace, they list
// only the node's processes (one it cannot see reads as 0, and is left
// out).
var kubepodsRoots = []string{
	"/sys/fs/cgroup/" + nodeCgroup + "/kubepods", "/sys/fs/cgroup/unified/" + nodeCgroup + "/kubepods", "/sys/fs/cgroup/pids/" + nodeCgroup + "/kubepods",
}

func kubepodsPIDs() []int {
	var pids []int
	for _, root := range kubepodsRoots {
		_ = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil // a cgroup removed meanwhile holds nothing
			}
			raw, _ := os.ReadFile(path)
			for _, f := range strings.Fields(string(raw)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 0 && !slices.Contains(pids, pid) {
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}

// killKubepods kills whatever is still in the pod cgroups (a container
// process whose shim was killed).
func (n *node) killKubepods() {
	for _, pid := range kubepodsPIDs() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// unmountAll lazily unmounts every mount under the work directory,
// deepest first (overlay snapshots, shm, the kubelet's pod volumes).
func (n *node) unmountAll() error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var mounts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], n.dir+"/") {
			mounts = append(mounts, fields[4])
		}
	}
	_ = f.Close()
	slices.SortFunc(mounts, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, m := range mounts {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	return errors.Join(errs...)
}

// leftovers are processes of the node still running: anything naming the
// work directory or a part's binary, and anything in a pod's cgroup.
func (n *node) leftovers() []string {
	time.Sleep(500 * time.Millisecond) // killed processes are reaped
	var left []string
	for _, pid := range kubepodsPIDs() {
		raw, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		left = append(left, fmt.Sprintf("%d %s (in a pod's cgroup)", pid, strings.ReplaceAll(string(raw), "\x00", " ")))
	}
	for pid, cmd := range cmdlines() {
		if strings.Contains(cmd, n.dir) || strings.Contains(cmd, n.nodeBin) || strings.Contains(cmd, filepath.Join(n.repo, "bin", "kube", "kubelet")) {
			state, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
			if strings.Contains(string(state), ") Z ") {
				continue // a zombie awaiting its parent's wait
			}
			left = append(left, fmt.Sprintf("%d %s", pid, cmd))
		}
	}
	return left
}

// saveLogs copies every log of a failed run to _output/node-e2e in the
// repository, which outlives the node's work directory (a tmpfs of the
// node's own, gone with it).
func (n *node) saveLogs() {
	out := filepath.Join(n.repo, "_output", "node-e2e")
	_ = os.RemoveAll(out)
	for _, d := range []string{"logs", "pod-logs", filepath.Join("cluster", "logs")} {
		dst := filepath.Join(out, d)
		if _, err := os.Stat(n.path(d)); err != nil {
			continue // the chart's node has no gpufrac up
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			fmt.Fprintln(os.Stderr, "node e2e: save the logs:", err)
			return
		}
		if out, err := exec.Command("cp", "-a", n.path(d), dst).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "node e2e: save the logs: %v: %s\n", err, out)
		}
	}
	fmt.Fprintln(os.Stderr, "node e2e: every log of this run is in", out)
}

// dumpLogs prints the last lines of each component's log.
func (n *node) dumpLogs() {
	entries, _ := os.ReadDir(n.path("logs"))
	for _, e := range entries {
		raw, _ := os.ReadFile(n.path("logs", e.Name()))
		lines := strings.Split(string(raw), "\n")
		fmt.Fprintf(os.Stderr, "--- %s (last lines)\n%s\n", e.Name(), strings.Join(lines[max(len(lines)-40, 0):], "\n"))
	}
	for _, name := range []string{"kube-apiserver", "scheduler", "webhook"} {
		raw, err := os.ReadFile(filepath.Join(n.path("cluster"), "logs", name+".log"))
		if err != nil {
			continue
		}
		lines := strings.Split(string(raw), "\n")
		fmt.Fprintf(os.Stderr, "--- cluster %s (last lines)\n%s\n", name, strings.Join(lines[max(len(lines)-30, 0):], "\n"))
	}
	// gpufrac's own pods (chart_test.go): every container's last run.
	logs, _ := filepath.Glob(n.path("pod-logs", "gpufrac-system_*", "*", "*.log"))
	for _, l := range logs {
		raw, _ := os.ReadFile(l)
		lines := strings.Split(string(raw), "\n")
		rel, _ := filepath.Rel(n.path("pod-logs"), l)
		fmt.Fprintf(os.Stderr, "--- pod %s (last lines)\n%s\n", rel, strings.Join(lines[max(len(lines)-30, 0):], "\n"))
	}
}

// report is the probe's JSON line (test/node/probe).
type report struct {
	Env    map[string]string `json:"env"`
	MPSDir []string          `json:"mpsDir"`
	Cgroup string            `json:"cgroup"`
	// NoNewPrivs is the probe's /proc/self/status NoNewPrivs.
	NoNewPrivs string `json:"noNewPrivs"`
}

// probeReport waits for container c of pod to print its report and
// returns it, read from the kubelet's log of the container.
func (n *node) probeReport(t *testing.T, pod *corev1.Pod, c string) report {
	t.Helper()
	path := filepath.Join(n.path("pod-logs"), fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID), c, "0.log")
	var r report
	err := waitFor("the probe's report in "+path, 90*time.Second, func() (bool, error) {
		raw, err := os.ReadFile(path)
		if err != nil {
			return false, nil
		}
		for _, line := range strings.Split(string(raw), "\n") {
			// CRI log format: TIME STREAM TAG MESSAGE.
			if _, msg, ok := strings.Cut(line, " stdout F probe: "); ok {
				return true, json.Unmarshal([]byte(msg), &r)
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return r
}
