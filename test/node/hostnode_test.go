//go:build nodee2e

package node

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
)

// TestMain runs the node's parts as host processes, with the control plane
// of gpufrac up.
func TestMain(m *testing.M) {
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:])) // a child playing nvidia-cuda-mps-control
	}
	os.Exit(run(m, startNode))
}

// startNode brings the node up in order: the control plane, containerd
// (with the images), the MPS daemon, the kubelet, the device plugin, the
// node agent; it returns once the node reports
// gpu-fractioning.nvidia.com/Ready.
func startNode() (*node, error) {
	n, err := newNode()
	if err != nil {
		return n, err
	}
	return n, n.runSteps([]step{
		{"control plane (gpufrac up, no simulated nodes)", n.startControlPlane},
		{"fake NVML machine", n.writeMachine},
		{"containerd with NRI, images imported", n.startContainerd},
		{"MPS daemon (stand-in control program)", n.startMPS},
		{"kubelet", n.startKubelet},
		{"device plugin stand-in", n.startDevicePlugin},
		{"node agent", func() error { return n.startAgent() }},
		{"node ready for fractions", func() error { return n.waitFractionReady(2 * time.Minute) }},
	})
}
func (n *node) startControlPlane() error {
	c, err := localcluster.Up(context.Background(), localcluster.Options{
		Dir: n.path("cluster"), Nodes: 0, Machine: "dgxh100", Binary: n.gpufrac, Root: n.repo, Progress: n.logFile("cluster-up"),
		// The DRA driver's RBAC and DeviceClasses; the node agent serves it.
		DRAStandingGPUs: standingGPUs,
	})
	if err != nil {
		return err
	}
	n.admin, n.kubeconfig, n.downControlPlane = c.Admin, c.Kubeconfig, c.Down
	return nil
}

// nvmlEnv is what a process needs to load the fake driver library.
func (n *node) nvmlEnv() []string {
	return []string{"LD_LIBRARY_PATH=" + filepath.Join(n.nodeBin, "lib"), "GPUFRAC_FAKE_NVML_DIR=" + n.nvmlDir()}
}

// mpsEnv makes a process's nvidia-cuda-mps-control the stand-in: this
// test binary, with mpstest.Env set.
func (n *node) mpsEnv() []string { return []string{mpstest.Env + "=1", "GORACE=atexit_sleep_ms=0"} }

func (n *node) startMPS() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	// No --driver-version: the daemon asks the fake NVML, as on a GPU node.
	return n.start("mps-daemon", append(n.mpsEnv(), n.nvmlEnv()...), n.gpufrac, "mps-daemon",
		"--mps-pipe-dir", n.mpsRoot(), "--mps-control", self, "--probe-interval", "1s")
}

func (n *node) startAgent() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	// The dmem controller's stand-in (see the package comment).
	if err := os.WriteFile(n.path("dmem-standin", "cgroup.controllers"), []byte("cpuset cpu io memory hugetlb pids dmem\n"), 0o644); err != nil {
		return err
	}
	// runc gives a hook only the environment of its hook spec, so the
	// hook is a wrapper that finds the fake library.
	hook := fmt.Sprintf("#!/bin/sh\nexport %s\nexec %s \"$@\"\n", strings.Join(n.nvmlEnv(), " "), n.gpufrac)
	if err := os.WriteFile(n.path("hook"), []byte(hook), 0o755); err != nil {
		return err
	}
	// As in its DaemonSet, the agent gets a cgroup namespace of its own
	// (containerd gives every unprivileged container one on cgroup v2), so
	// it reads other containers' cgroups as "/../kubepods/...": it runs in
	// a cgroup of its own, under unshare --cgroup.
	cg, err := n.agentCgroup()
	if err != nil {
		return err
	}
	n.cleanups = append(n.cleanups, func() error { _ = os.Remove(cg); return nil })
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	n.metricsAddr = fmt.Sprintf("127.0.0.1:%d", ports[0])
	return n.start("node-agent", append(n.mpsEnv(), n.nvmlEnv()...), "/bin/sh", "-c", `echo $$ > "$0/cgroup.procs" && exec unshare --cgroup "$@"`, cg,
		n.gpufrac, "node-agent", "--node-name", nodeName, "--kubeconfig", filepath.Join(n.path("cluster"), "node-agent.kubeconfig"),
		"--nri-socket", n.nriSocket(), "--pod-resources-socket", n.podResourcesSocket(),
		"--state-dir", n.path("agent"), "--hook-path", n.path("hook"), "--mps-pipe-dir", n.mpsRoot(), "--mps-control", self,
		"--cgroup-root", n.path("dmem-standin"), "--publish-gpu-labels", "--health-addr", "", "--metrics-addr", n.metricsAddr, "--resync-period", "2s", "--usage-publish-period", "2s",
		"--security-stop-grace", "2s",
		// The DRA driver: registered with this kubelet, its prepared
		// claims' CDI specs where containerd reads them.
		"--dra", "--dra-standing-gpus", strconv.Itoa(standingGPUs),
		"--dra-plugin-dir", filepath.Join(n.kubeletRoot(), "plugins", api.DRADriver),
		"--dra-registrar-dir", filepath.Join(n.kubeletRoot(), "plugins_registry"), "--dra-cdi-dir", n.cdiDir())
}

// agentCgroup is the agent's own cgroup v2 directory, made once.
func (n *node) agentCgroup() (string, error) {
	mount, err := enforce.CgroupMount("/proc")
	if err != nil {
		return "", err
	}
	cg := filepath.Join(mount, nodeCgroup, "agent")
	return cg, os.MkdirAll(cg, 0o755)
}
