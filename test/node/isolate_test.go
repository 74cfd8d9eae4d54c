//go:build nodee2e || charte2e

package node

// The node runs in namespaces of its own, the way kind and KWOK-in-a-
// container isolate a node, so that it leaves the host as it found it by
// construction, not by cleaning up after itself:
//
//   - a network namespace: the kubelet's firewall chains, kube-proxy's
//     rules, the CNI bridge and IP forwarding are the node's, and go with
//     it; the node has one address of its own (nodeAddress, on one end of
//     a veth pair: this kernel has no dummy interfaces) besides loopback,
//     and a default route into that pair, which leads nowhere (components
//     look for a default route to find the node's address);
//   - a mount namespace: containerd's and the kubelet's mounts; /run a
//     fresh tmpfs, as on a kind node; /tmp, /etc, /opt, /var/lib and the
//     driver's library directory overlays whose writes stay in the node;
//     the work directory a tmpfs; and the kubelet's kernel tunables masked
//     with the values it wants, so it never writes the host's
//     (setupKernelTunables sets vm.overcommit_memory, kernel.panic, ...
//     unless they are already so);
//   - a PID namespace, whose first process is a small init that reaps the
//     node's orphans: when it ends, for whatever reason (a failure, a
//     kill of the run), the kernel ends every process of the node.
//
// What must be checked on the host is what these namespaces do not hold:
// the cgroups the kubelet makes (it names them from the root of each
// hierarchy), which the host side removes once the node is gone. Around
// it all, the host side takes hoststate snapshots before and after and
// fails the run on any difference.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	utilsysctl "k8s.io/component-helpers/node/util/sysctl"

	"github.com/gpufrac/gpufrac/test/node/hoststate"
)

const (
	// stageEnv is where a process of the node test stands: unset on the
	// host, stageInit for the namespaces' first process, stageNode for
	// the test itself.
	stageEnv  = "GPUFRAC_NODE_E2E_STAGE"
	stageInit = "init"
	stageNode = "node"
	// dirEnv is the node's work directory: made on the host, a tmpfs in
	// the node.
	dirEnv = "GPUFRAC_NODE_E2E_DIR"
	// nodeInterface carries nodeAddress, the node's own address: the API
	// server advertises it, pods reach it through the bridge, and the
	// kubelet reports it (--node-ip). Its default route goes into the veth
	// pair and no further: kube-apiserver finds its address by the default
	// route, and nothing the node does goes out.
	nodeInterface = "gfhost0"
	nodeAddress   = "10.214.0.1"
	// nodeCgroup is the node's cgroup in every hierarchy, which the host
	// side makes before the run and removes after: the kubelet's
	// cgroupRoot (its pods are in <nodeCgroup>/kubepods, never in another
	// kubelet's /kubepods), and the host-process agent's cgroup's parent.
	nodeCgroup = "gpufrac-node-e2e"
)

// kubeletTunables are the kernel settings the kubelet sets unless they
// already have its values (setupKernelTunables in
// pkg/kubelet/cm/container_manager_linux.go, v1.37): the node sees them
// so, and the host's stay as they are.
var kubeletTunables = map[string]int{
	utilsysctl.VMOvercommitMemory: utilsysctl.VMOvercommitMemoryAlways,
	utilsysctl.VMPanicOnOOM:       utilsysctl.VMPanicOnOOMInvokeOOMKiller,
	utilsysctl.KernelPanic:        utilsysctl.KernelPanicRebootTimeout,
	utilsysctl.KernelPanicOnOops:  utilsysctl.KernelPanicOnOopsAlways,
	utilsysctl.RootMaxKeys:        utilsysctl.RootMaxKeysSetting,
	utilsysctl.RootMaxBytes:       utilsysctl.RootMaxBytesSetting,
}

// overlaid are the host directories a node writes into (temporary files,
// such as the control plane's certificates; the chart's host paths, the
// kubelet's device-plugin directory and its /var/log/containers links,
// whatever its podLogsDir; the driver's library place): the node sees them
// as they are (this test binary is under /tmp), and its writes stay in it.
var overlaid = []string{"/tmp", "/etc", "/opt", "/var/lib", "/var/log", "/usr/lib/x86_64-linux-gnu"}

// onHost runs the node test in a node of its own and checks that the host
// is as before. It is the test binary's first stage.
func onHost() int {
	// One node test at a time: they share nodeCgroup.
	if lock, err := os.Open("/sys/fs/cgroup"); err == nil {
		defer func() { _ = lock.Close() }()
		if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); errors.Is(err, syscall.EWOULDBLOCK) {
			fmt.Fprintln(os.Stderr, "node e2e: another node test runs on this machine (it holds a lock on /sys/fs/cgroup): run one at a time")
			return 1
		}
	}
	if err := clearEarlierRun(); err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: what an earlier run left:", err)
		return 1
	}
	before, err := hoststate.Take(hoststate.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: the host before the run:", err)
		return 1
	}
	dir, err := os.MkdirTemp("/tmp", "gfn")
	if err == nil {
		err = makeNodeCgroups()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "node e2e:", err)
		return 1
	}
	code, err := runStage(stageInit, dir, syscall.CLONE_NEWNS|syscall.CLONE_NEWNET|syscall.CLONE_NEWPID|syscall.CLONE_NEWUTS|syscall.CLONE_NEWIPC)
	if err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: start the node's namespaces:", err)
		code = 1
	}
	// The node's first process has ended, and with it every process,
	// mount and network of the node. Its cgroups remain: they are the
	// host's.
	errs := []error{os.Remove(dir)}
	for _, h := range cgroupHierarchies() {
		errs = append(errs, removeCgroup(filepath.Join(h, nodeCgroup)))
	}
	after, err := hoststate.Take(hoststate.Options{})
	if err = errors.Join(append(errs, err)...); err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: after the run:", err)
		return 1
	}
	if d := hoststate.Diff(before, after); len(d) > 0 {
		fmt.Fprintf(os.Stderr, "node e2e: the run changed the host:\n  %s\n", strings.Join(d, "\n  "))
		return 1
	}
	fmt.Fprintf(os.Stderr, "node e2e: the host is as before the run: %d iptables and ip6tables lines, %d mounts, %d entries under /run, %d kernel settings, %d top-level cgroups\n",
		len(after.IPTables), len(after.Mounts), len(after.Run), len(after.Sysctls), len(after.Cgroups))
	return code
}

// clearEarlierRun removes what a run that was killed leaves on the host:
// its empty cgroups and its work directory's mount point.
func clearEarlierRun() error {
	var errs []error
	for _, h := range cgroupHierarchies() {
		if cg := filepath.Join(h, nodeCgroup); isDir(cg) {
			fmt.Fprintf(os.Stderr, "node e2e: removing the cgroup %s, left by an earlier run\n", cg)
			errs = append(errs, removeCgroup(cg))
		}
	}
	stale, _ := filepath.Glob("/tmp/gfn*")
	for _, d := range stale {
		if entries, err := os.ReadDir(d); err == nil && len(entries) == 0 {
			_ = os.Remove(d) // an earlier run's work directory's mount point
		}
	}
	return errors.Join(errs...)
}

// cgroupHierarchies are the host's cgroup hierarchies: /sys/fs/cgroup on
// a unified host; each controller's (and the unified one) on a hybrid host.
func cgroupHierarchies() []string {
	const root = "/sys/fs/cgroup"
	if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err == nil {
		return []string{root}
	}
	entries, _ := os.ReadDir(root)
	var hierarchies []string
	for _, e := range entries {
		// A directory with cgroup.procs, not a link such as cpu,cpuacct.
		if h := filepath.Join(root, e.Name()); e.IsDir() && isDir(h) {
			if _, err := os.Stat(filepath.Join(h, "cgroup.procs")); err == nil {
				hierarchies = append(hierarchies, h)
			}
		}
	}
	return hierarchies
}

// makeNodeCgroups makes nodeCgroup in every hierarchy; in a cgroup v1
// cpuset hierarchy with the root's CPUs and memory nodes, which a new
// cpuset needs before a process can join it.
func makeNodeCgroups() error {
	for _, h := range cgroupHierarchies() {
		cg := filepath.Join(h, nodeCgroup)
		if err := os.Mkdir(cg, 0o755); err != nil {
			return fmt.Errorf("make the node's cgroup: %w", err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := os.ReadFile(filepath.Join(h, f)); err == nil && filepath.Base(h) == "cpuset" {
				if err := os.WriteFile(filepath.Join(cg, f), v, 0o644); err != nil {
					return fmt.Errorf("make the node's cgroup: %s: %w", f, err)
				}
			}
		}
	}
	return nil
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// removeCgroup removes a cgroup and the cgroups under it, deepest first.
// A cgroup that still holds a process cannot be removed, and says so.
func removeCgroup(root string) error {
	var dirs []string
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	slices.SortFunc(dirs, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	for _, d := range dirs {
		var err error
		// A process killed a moment ago may still be leaving its cgroup.
		for range 50 {
			if err = syscall.Rmdir(d); err == nil || errors.Is(err, syscall.ENOENT) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil && !errors.Is(err, syscall.ENOENT) {
			procs, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			return fmt.Errorf("remove cgroup %s (processes: %q): %w", d, strings.Fields(string(procs)), err)
		}
	}
	return nil
}

// forwarded are the signals the host side and the node's init pass on to
// the test: an interrupt, a stop, and go test's SIGQUIT at its timeout, so
// that the test itself prints its goroutines, and the host side, which
// keeps running, still checks the host.
var forwarded = []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT}

// runStage runs this test binary again, with its arguments, as stage in
// new namespaces (flags), and returns its exit code. It ends with this
// process (Pdeathsig), and the forwarded signals are passed on to it.
func runStage(stage, dir string, flags uintptr) (int, error) {
	// Pdeathsig follows the thread that started the child.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), stageEnv+"="+stage, dirEnv+"="+dir)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	// The runtime's check that the parent is alive after setting
	// Pdeathsig reads the parent as PID 0 in the new PID namespace and
	// signals the child; the kernel drops that, as it drops any signal
	// from inside a namespace to its first process that has no handler.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: flags, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return 1, err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, forwarded...)
	defer signal.Stop(sig)
	go func() {
		for s := range sig {
			_ = cmd.Process.Signal(s)
		}
	}()
	err := cmd.Wait()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exitCode(exit.Sys().(syscall.WaitStatus)), nil
	}
	return 0, err
}

func exitCode(ws syscall.WaitStatus) int {
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

// nodeInit is the first process of the node's namespaces: it makes the
// node's mounts and network, runs the test as its child, reaps every
// orphan of the node meanwhile (a shim, a container's process), and
// exits with the test's code, which ends the node.
func nodeInit() int {
	if err := makeNode(os.Getenv(dirEnv)); err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: make the node:", err)
		return 1
	}
	runtime.LockOSThread()
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), stageEnv+"="+stageNode)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "node e2e: start the test in the node:", err)
		return 1
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, forwarded...)
	go func() {
		for s := range sig {
			_ = cmd.Process.Signal(s)
		}
	}()
	// As PID 1, every orphan of the node is this process's child: reap
	// them all (not cmd.Wait, which would race this loop), until the test
	// itself ends.
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "node e2e: wait for the test in the node:", err)
			return 1
		}
		if pid == cmd.Process.Pid {
			return exitCode(ws)
		}
	}
}

// makeNode makes the node's mounts and network, in its fresh namespaces.
func makeNode(dir string) error {
	if dir == "" {
		return errors.New(dirEnv + " is not set")
	}
	mount := func(source, target, fstype string, flags uintptr, data string) error {
		if err := syscall.Mount(source, target, fstype, flags, data); err != nil {
			return fmt.Errorf("mount %s (%s) on %s: %w", source, fstype, target, err)
		}
		return nil
	}
	// Nothing mounted here reaches the host.
	if err := mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return err
	}
	// This PID namespace's processes, for ps, the leftovers check and
	// the agent's hostPID view.
	if err := mount("proc", "/proc", "proc", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := mount("node-e2e-run", "/run", "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV, "mode=0755"); err != nil {
		return err
	}
	// The overlays' upper layers and the masked settings, on the node's
	// /run: out of the way of the work directory, which is under /tmp.
	layers := filepath.Join("/run", "node-e2e-layers")
	for i, d := range overlaid {
		if !isDir(d) {
			return fmt.Errorf("%s is not a directory on this host: the node would write into the host where it makes it (make it, empty, and run again)", d)
		}
		layer := filepath.Join(layers, strconv.Itoa(i))
		upper, work := filepath.Join(layer, "upper"), filepath.Join(layer, "work")
		if err := errors.Join(os.MkdirAll(upper, 0o755), os.MkdirAll(work, 0o755)); err != nil {
			return err
		}
		if err := mount("node-e2e", d, "overlay", 0, fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", d, upper, work)); err != nil {
			return err
		}
	}
	// The work directory: the host made its mount point, which the /tmp
	// overlay shows.
	if err := mount("node-e2e", dir, "tmpfs", 0, "mode=0755"); err != nil {
		return err
	}
	for name, value := range kubeletTunables {
		f := filepath.Join(layers, "sysctl", strings.ReplaceAll(name, "/", "."))
		if err := errors.Join(os.MkdirAll(filepath.Dir(f), 0o755), os.WriteFile(f, []byte(strconv.Itoa(value)+"\n"), 0o644)); err != nil {
			return err
		}
		if err := mount(f, filepath.Join("/proc/sys", name), "", syscall.MS_BIND, ""); err != nil {
			return err
		}
	}
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", nodeInterface, "type", "veth", "peer", "name", nodeInterface + "-peer"},
		{"addr", "add", nodeAddress + "/32", "dev", nodeInterface},
		{"link", "set", nodeInterface, "up"},
		{"link", "set", nodeInterface + "-peer", "up"},
		{"route", "add", "default", "dev", nodeInterface},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %w: %s (Debian's iproute2 has ip)", strings.Join(args, " "), err, out)
		}
	}
	return nil
}
