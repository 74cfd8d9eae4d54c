// Package enforce applies a container's GPU memory limits in the driver:
// CUDA 13.4 (driver r615) keeps, per cgroup, a soft (guaranteed) and a hard
// device-memory limit, set through NVML's SetMemoryLimits_v1 and backed by
// the kernel's dmem cgroup controller. The runtime runs `gpufrac hook
// apply-memory-limits` as a createRuntime hook, after the container's
// cgroup exists and before its process runs; a failure there fails the
// container's creation.
package enforce

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	rspec "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

const mebibyte = uint64(1) << 20

// Limits is what to enforce for one container on each of its GPUs.
type Limits struct {
	Container  string
	Devices    []string // GPU UUIDs
	RequestMiB uint64
	LimitMiB   uint64
}

// LimitsFromEnv reads the limits the NRI plugin put in the hook's
// environment (see package injection).
func LimitsFromEnv(getenv func(string) string) (Limits, error) {
	l := Limits{Container: getenv(nodeapi.EnvHookContainer)}
	devices := getenv(nodeapi.EnvHookDevices)
	if devices == "" {
		return Limits{}, fmt.Errorf("%s is empty: the hook was not configured by the gpufrac NRI plugin", nodeapi.EnvHookDevices)
	}
	// The plugin passes bare UUIDs; CDI names are read too, since the
	// device list is the scheduler's and NVML wants the UUID.
	uuids, _, bad := api.ParseDeviceList(devices)
	if bad != "" {
		return Limits{}, fmt.Errorf("%s %q: %s", nodeapi.EnvHookDevices, devices, bad)
	}
	l.Devices = uuids
	var err error
	if l.RequestMiB, err = positive(getenv, nodeapi.EnvHookRequestMiB); err != nil {
		return Limits{}, err
	}
	if l.LimitMiB, err = positive(getenv, nodeapi.EnvHookLimitMiB); err != nil {
		return Limits{}, err
	}
	if l.LimitMiB < l.RequestMiB {
		return Limits{}, fmt.Errorf("%s %d is below %s %d", nodeapi.EnvHookLimitMiB, l.LimitMiB, nodeapi.EnvHookRequestMiB, l.RequestMiB)
	}
	return l, nil
}

func positive(getenv func(string) string, key string) (uint64, error) {
	v := getenv(key)
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("%s %q must be a positive number of MiB", key, v)
	}
	return n, nil
}

// ReadState reads the OCI state the runtime passes a hook on stdin.
func ReadState(r io.Reader) (rspec.State, error) {
	var s rspec.State
	if err := json.NewDecoder(r).Decode(&s); err != nil {
		return s, fmt.Errorf("read the OCI state from stdin: %w", err)
	}
	if s.Pid <= 0 {
		return s, fmt.Errorf("OCI state of container %q has no pid", s.ID)
	}
	return s, nil
}

// CgroupOf names pid's cgroup as NVML wants it: the full path of its
// cgroup v2 directory in sysfs, e.g.
// /sys/fs/cgroup/kubepods.slice/.../cri-containerd-<id>.scope. nvml.h says
// nameSpace is the "Full path to sysfs cgroup file name" and that a path
// the driver cannot open is NVML_ERROR_OPERATING_SYSTEM; NVIDIA's MPS v3
// memory partitioning guide sets limits on "/sys/fs/cgroup/mygroup". The
// path must be one the calling process can open, so it is built from this
// process's own mounts (procRoot/self/mountinfo; procRoot is normally
// /proc): /sys/fs/cgroup on a cgroup v2 host, /sys/fs/cgroup/unified on a
// hybrid one. Only the unified hierarchy carries the dmem controller.
//
// The kernel writes /proc/<pid>/cgroup relative to the reader's cgroup
// namespace, with "../ entries for each ancestor level" when the target
// lies outside it (cgroup_namespaces(7)). runc runs the hook in the
// host's namespace, but the node agent's pod has one of its own: containerd
// gives every unprivileged container one on cgroup v2
// (internal/cri/server/container_create.go). Such a path is resolved
// through the mount of the host's hierarchy (see cgroupMount).
func CgroupOf(procRoot string, pid int) (string, error) {
	rel, err := cgroupPath(procRoot, strconv.Itoa(pid))
	if err != nil {
		return "", err
	}
	m, err := cgroupMount(procRoot)
	if err != nil {
		return "", fmt.Errorf("cgroup of pid %d: %w", pid, err)
	}
	if m.up == 0 && !climbs(rel) {
		return filepath.Join(m.point, rel), nil
	}
	root, err := namespaceRoot(procRoot, m)
	if err != nil {
		return "", fmt.Errorf("cgroup of pid %d (%s, outside this process's cgroup namespace): %w", pid, rel, err)
	}
	if ups(rel) > depth(root) {
		return "", fmt.Errorf("cgroup of pid %d: %s climbs above %s, the root of the hierarchy mounted at %s", pid, rel, root, m.point)
	}
	return filepath.Join(m.point, path.Join(root, rel)), nil
}

func cgroupPath(procRoot, pid string) (string, error) {
	f, err := os.Open(filepath.Join(procRoot, pid, "cgroup"))
	if err != nil {
		return "", fmt.Errorf("cgroup of pid %s: %w", pid, err)
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok && p != "" {
			return p, nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("cgroup of pid %s: %w", pid, err)
	}
	return "", fmt.Errorf("pid %s is in no cgroup v2 hierarchy: driver memory limits need cgroup v2 with the dmem controller (kernel 6.14 or later)", pid)
}

// climbs tells whether a cgroup path leaves the reader's namespace.
func climbs(p string) bool { return p == "/.." || strings.HasPrefix(p, "/../") }

// ups counts a path's leading ".." components.
func ups(p string) int {
	n := 0
	for _, c := range strings.Split(strings.TrimPrefix(p, "/"), "/") {
		if c != ".." {
			break
		}
		n++
	}
	return n
}

func depth(p string) int {
	if p = strings.Trim(p, "/"); p == "" {
		return 0
	}
	return strings.Count(p, "/") + 1
}

// mount is a cgroup2 mount as mountinfo shows it: where it is mounted,
// and how many levels above the reader's cgroup namespace root its root
// lies (mountinfo's root field, "/" or "/../.."; 0 in the host's
// namespace).
type mount struct {
	point string
	up    int
}

// CgroupMount is where this process sees the cgroup v2 hierarchy mounted
// (see cgroupMount).
func CgroupMount(procRoot string) (string, error) {
	m, err := cgroupMount(procRoot)
	return m.point, err
}

// cgroupMount picks, from procRoot/self/mountinfo (proc(5)), the cgroup2
// mount that shows the most of the hierarchy: the one whose root lies
// highest above this process's cgroup namespace root. In a pod that is the
// host's /sys/fs/cgroup mounted in, not the runtime's mount of the pod's
// own namespace. Among equals, /sys/fs/cgroup is preferred, then the first.
func cgroupMount(procRoot string) (mount, error) {
	file := filepath.Join(procRoot, "self", "mountinfo")
	raw, err := os.ReadFile(file)
	if err != nil {
		return mount{}, fmt.Errorf("find the cgroup v2 mount: %w", err)
	}
	best := mount{up: -1}
	for _, line := range strings.Split(string(raw), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		fields, fs := strings.Fields(pre), strings.Fields(post)
		if !ok || len(fields) < 5 || len(fs) == 0 || fs[0] != "cgroup2" {
			continue
		}
		root := unescapeMount(fields[3])
		if root != "/" && ups(root) != depth(root) {
			continue // a mount of a subtree: names below it only
		}
		m := mount{point: unescapeMount(fields[4]), up: ups(root)}
		if m.up > best.up || (m.up == best.up && m.point == "/sys/fs/cgroup" && best.point != "/sys/fs/cgroup") {
			best = m
		}
	}
	if best.up < 0 {
		return mount{}, fmt.Errorf("%s lists no cgroup2 file system with the hierarchy's root: driver memory limits need cgroup v2 (mounted at /sys/fs/cgroup; in the node agent's pod, the host's /sys/fs/cgroup)", file)
	}
	return best, nil
}

// namespaceRoots caches, per mount, where this process's cgroup namespace
// root lies below the mount's root; it never changes.
var namespaceRoots sync.Map

// namespaceRoot is the path, below mount m's root, of this process's
// cgroup namespace root. The kernel says only how many levels up the
// mount's root is; the names come from finding this process in the
// mount's tree: the directory whose cgroup.procs lists its pid (as the
// reader's PID namespace numbers it: the agent runs with hostPID).
func namespaceRoot(procRoot string, m mount) (string, error) {
	if m.up == 0 {
		return "/", nil
	}
	if v, ok := namespaceRoots.Load(m); ok {
		return v.(string), nil
	}
	self, err := cgroupPath(procRoot, "self")
	if err != nil {
		return "", err
	}
	pid := strconv.Itoa(os.Getpid())
	var found string
	walkErr := filepath.WalkDir(m.point, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() || found != "" {
			return nil // an unreadable cgroup is not this process's
		}
		raw, _ := os.ReadFile(filepath.Join(p, "cgroup.procs"))
		for _, f := range strings.Fields(string(raw)) {
			if f == pid {
				found = "/" + strings.TrimPrefix(strings.TrimPrefix(p, m.point), "/")
				return filepath.SkipAll
			}
		}
		return nil
	})
	if walkErr != nil {
		return "", walkErr
	}
	if found == "" {
		return "", fmt.Errorf("pid %s (this process) is in no cgroup under %s: mount the host's /sys/fs/cgroup and run in the host PID namespace", pid, m.point)
	}
	root := path.Clean(strings.TrimSuffix(found, strings.TrimPrefix(self, "/")))
	if self != "/" && !strings.HasSuffix(found, self) || depth(root) != m.up {
		return "", fmt.Errorf("this process is in %s under %s and in %s of its namespace, whose root is %d levels below the mount's: they disagree", found, m.point, self, m.up)
	}
	namespaceRoots.Store(m, root)
	return root, nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, "\\") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// RunHook is the createRuntime hook: the OCI state on stdin, the limits in
// the environment the NRI plugin gave the hook, the container's cgroup
// from procRoot, the limits set through lib. Any error must fail the
// container's creation.
func RunHook(stdin io.Reader, getenv func(string) string, procRoot string, lib nvml.Interface) error {
	state, err := ReadState(stdin)
	if err != nil {
		return err
	}
	limits, err := LimitsFromEnv(getenv)
	if err != nil {
		return fmt.Errorf("container %s: %w", state.ID, err)
	}
	cgroup, err := CgroupOf(procRoot, state.Pid)
	if err != nil {
		return fmt.Errorf("container %s: %w", state.ID, err)
	}
	if err := Apply(lib, cgroup, limits); err != nil {
		return fmt.Errorf("container %s (%s): %w", state.ID, limits.Container, err)
	}
	return nil
}

// Apply sets soft = request and hard = limit for cgroup on every device,
// then reads them back. Any failure is an error naming the GPU, the cgroup
// and the NVML error; the limits already set are released first so a
// failed container leaves nothing reserved.
func Apply(lib nvml.Interface, cgroup string, l Limits) error {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("apply GPU memory limits to cgroup %s: nvmlInit: %w", cgroup, ret)
	}
	defer func() { _ = lib.Shutdown() }()
	soft, hard := l.RequestMiB*mebibyte, l.LimitMiB*mebibyte
	var done []nvml.Device
	for _, uuid := range l.Devices {
		dev, ret := lib.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			return errors.Join(fmt.Errorf("GPU %s for cgroup %s: nvmlDeviceGetHandleByUUID: %w", uuid, cgroup, ret), release(done, cgroup))
		}
		if ret := dev.SetMemoryLimits_v1(cgroup, soft, hard); ret != nvml.SUCCESS {
			return errors.Join(fmt.Errorf("GPU %s: set memory limits (soft %dMi, hard %dMi) for cgroup %s: nvmlDeviceSetMemoryLimits_v1: %w",
				uuid, l.RequestMiB, l.LimitMiB, cgroup, ret), release(done, cgroup))
		}
		done = append(done, dev)
		if err := check(dev, uuid, cgroup, soft, hard); err != nil {
			return errors.Join(err, release(done, cgroup))
		}
	}
	return nil
}

// check reads a cgroup's limits on one device back and compares them.
func check(dev nvml.Device, uuid, cgroup string, soft, hard uint64) error {
	got, ret := dev.GetMemoryLimits_v1(cgroup)
	if ret != nvml.SUCCESS {
		return fmt.Errorf("GPU %s: read back memory limits of cgroup %s: nvmlDeviceGetMemoryLimits_v1: %w", uuid, cgroup, ret)
	}
	if got.SoftLimit != soft || got.HardLimit != hard {
		return limitsDiffer(fmt.Sprintf("GPU %s: cgroup %s has soft %dMi and hard %dMi, want %dMi and %dMi",
			uuid, cgroup, got.SoftLimit/mebibyte, got.HardLimit/mebibyte, soft/mebibyte, hard/mebibyte))
	}
	return nil
}

// ErrLimitsDiffer is in Verify's error when the driver was read and holds
// other limits than the container's: a definite answer, unlike an NVML
// call that failed (which a later try may pass).
var ErrLimitsDiffer = errors.New("the driver holds other limits")

type limitsDiffer string

func (e limitsDiffer) Error() string        { return string(e) }
func (e limitsDiffer) Is(target error) bool { return target == ErrLimitsDiffer }

// Verify checks, after the container started, that the driver still holds
// its limits on every device (nothing reset or bypassed them).
func Verify(lib nvml.Interface, cgroup string, l Limits) error {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("verify GPU memory limits of cgroup %s: nvmlInit: %w", cgroup, ret)
	}
	defer func() { _ = lib.Shutdown() }()
	var errs []error
	for _, uuid := range l.Devices {
		dev, ret := lib.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("GPU %s: nvmlDeviceGetHandleByUUID: %w", uuid, ret))
			continue
		}
		errs = append(errs, check(dev, uuid, cgroup, l.RequestMiB*mebibyte, l.LimitMiB*mebibyte))
	}
	return errors.Join(errs...)
}

// release zeroes the soft limit, which otherwise stays reserved up the
// cgroup tree after the container's cgroup goes away; the hard limit stays
// as it is until the cgroup is gone.
func release(devs []nvml.Device, cgroup string) error {
	var errs []error
	for _, dev := range devs {
		uuid, _ := dev.GetUUID()
		current, ret := dev.GetMemoryLimits_v1(cgroup)
		if ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("GPU %s: read memory limits of cgroup %s to release them: %w", uuid, cgroup, ret))
			continue
		}
		if ret := dev.SetMemoryLimits_v1(cgroup, 0, current.HardLimit); ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("GPU %s: release the soft memory limit of cgroup %s: %w", uuid, cgroup, ret))
		}
	}
	return errors.Join(errs...)
}

// Release zeroes cgroup's limits on every device, at container stop.
func Release(lib nvml.Interface, cgroup string, devices []string) error {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("release GPU memory limits of cgroup %s: nvmlInit: %w", cgroup, ret)
	}
	defer func() { _ = lib.Shutdown() }()
	var devs []nvml.Device
	var errs []error
	for _, uuid := range devices {
		dev, ret := lib.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("GPU %s: nvmlDeviceGetHandleByUUID: %w", uuid, ret))
			continue
		}
		devs = append(devs, dev)
	}
	return errors.Join(append(errs, release(devs, cgroup))...)
}

// CheckCgroup tells whether the driver's per-cgroup memory limits can work
// on this host, whose cgroup file system is mounted at root: they need
// cgroup v2 (NVIDIA MPS, "MPS v3 Memory Partitioning": cgroup v2 at
// /sys/fs/cgroup) and one of the driver's two backends, the kernel's dmem
// controller (6.14 and later) or the driver's misc fallback, both of which
// show as controllers of the root cgroup.
func CheckCgroup(root string) error {
	data, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%s is not a cgroup v2 hierarchy (cgroup v1 or a hybrid layout): driver memory limits need cgroup v2; boot with systemd.unified_cgroup_hierarchy=1", root)
	}
	if err != nil {
		return fmt.Errorf("cannot read the cgroup controllers: %w", err)
	}
	controllers := strings.Fields(string(data))
	for _, c := range []string{"dmem", "misc"} {
		for _, have := range controllers {
			if have == c {
				return nil
			}
		}
	}
	return fmt.Errorf("the cgroup v2 root %s has neither the dmem controller (kernel 6.14 and later) nor misc (the driver's fallback), so the driver cannot account GPU memory per cgroup; it has: %s",
		root, strings.Join(controllers, " "))
}

// ErrInUse is in Resize's error when a container already uses more of a
// GPU than the hard limit asked: nothing is changed.
var ErrInUse = errors.New("the container uses more than the new hard limit")

// Resize holds a running container's cgroup to new limits on every device
// (SPEC §7): the same NVML call as at creation, on the cgroup its process
// runs in. It first reads what the cgroup uses on each device
// (GetMemoryLimits_v1's currentUsed) and refuses, changing nothing, a hard
// limit below it: the driver would fail the container's next allocation
// with memory it already holds. A device that fails midway has the devices
// already changed put back to from, so the container is never left
// without limits.
func Resize(lib nvml.Interface, cgroup string, devices []string, from, to Limits) error {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("resize GPU memory limits of cgroup %s: nvmlInit: %w", cgroup, ret)
	}
	defer func() { _ = lib.Shutdown() }()
	devs := make([]nvml.Device, len(devices))
	for i, uuid := range devices {
		dev, ret := lib.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("GPU %s for cgroup %s: nvmlDeviceGetHandleByUUID: %w", uuid, cgroup, ret)
		}
		got, ret := dev.GetMemoryLimits_v1(cgroup)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("GPU %s: read the memory cgroup %s uses: nvmlDeviceGetMemoryLimits_v1: %w", uuid, cgroup, ret)
		}
		if got.CurrentUsed > to.LimitMiB*mebibyte {
			return fmt.Errorf("%w: GPU %s: cgroup %s uses %dMi, above the hard limit %dMi asked; nothing changed",
				ErrInUse, uuid, cgroup, (got.CurrentUsed+mebibyte-1)/mebibyte, to.LimitMiB)
		}
		devs[i] = dev
	}
	for i, dev := range devs {
		if ret := dev.SetMemoryLimits_v1(cgroup, to.RequestMiB*mebibyte, to.LimitMiB*mebibyte); ret != nvml.SUCCESS {
			err := fmt.Errorf("GPU %s: set memory limits (soft %dMi, hard %dMi) for cgroup %s: nvmlDeviceSetMemoryLimits_v1: %w",
				devices[i], to.RequestMiB, to.LimitMiB, cgroup, ret)
			for j := range i {
				if ret := devs[j].SetMemoryLimits_v1(cgroup, from.RequestMiB*mebibyte, from.LimitMiB*mebibyte); ret != nvml.SUCCESS {
					err = errors.Join(err, fmt.Errorf("GPU %s: put back soft %dMi, hard %dMi for cgroup %s: %w", devices[j], from.RequestMiB, from.LimitMiB, cgroup, ret))
				}
			}
			return err
		}
	}
	for i, dev := range devs {
		if err := check(dev, devices[i], cgroup, to.RequestMiB*mebibyte, to.LimitMiB*mebibyte); err != nil {
			return err
		}
	}
	// What the container used was read before the new limit was set; it
	// may have allocated since. A shrink that lands below its use now is
	// taken back: the memory it holds would be counted free by the books.
	if to.LimitMiB < from.LimitMiB {
		for i, dev := range devs {
			got, ret := dev.GetMemoryLimits_v1(cgroup)
			if ret != nvml.SUCCESS || got.CurrentUsed <= to.LimitMiB*mebibyte {
				continue // unread: check has just read the limits themselves
			}
			err := fmt.Errorf("%w: GPU %s: cgroup %s grew to %dMi while its hard limit was lowered to %dMi; the old limits are put back",
				ErrInUse, devices[i], cgroup, (got.CurrentUsed+mebibyte-1)/mebibyte, to.LimitMiB)
			for j, d := range devs {
				if ret := d.SetMemoryLimits_v1(cgroup, from.RequestMiB*mebibyte, from.LimitMiB*mebibyte); ret != nvml.SUCCESS {
					err = errors.Join(err, fmt.Errorf("GPU %s: put back soft %dMi, hard %dMi for cgroup %s: %w", devices[j], from.RequestMiB, from.LimitMiB, cgroup, ret))
				}
			}
			return err
		}
	}
	return nil
}

// Held reads the limits the driver holds cgroup to on every device: the
// same soft and hard limit on each, or an error naming what differs or is
// missing (no limits at all is an error: nothing holds the container).
func Held(lib nvml.Interface, cgroup string, devices []string) (Limits, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return Limits{}, fmt.Errorf("read GPU memory limits of cgroup %s: nvmlInit: %w", cgroup, ret)
	}
	defer func() { _ = lib.Shutdown() }()
	var held Limits
	for i, uuid := range devices {
		dev, ret := lib.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			return Limits{}, fmt.Errorf("GPU %s: nvmlDeviceGetHandleByUUID: %w", uuid, ret)
		}
		got, ret := dev.GetMemoryLimits_v1(cgroup)
		if ret != nvml.SUCCESS {
			return Limits{}, fmt.Errorf("GPU %s: read the memory limits of cgroup %s: nvmlDeviceGetMemoryLimits_v1: %w", uuid, cgroup, ret)
		}
		l := Limits{Devices: devices, RequestMiB: got.SoftLimit / mebibyte, LimitMiB: got.HardLimit / mebibyte}
		switch {
		case got.HardLimit == 0 || got.HardLimit == nvml.DEVICE_MEMORY_LIMIT_MAX || got.SoftLimit == 0:
			return Limits{}, limitsDiffer(fmt.Sprintf("GPU %s: cgroup %s has no memory limits (soft %d, hard %d bytes)", uuid, cgroup, got.SoftLimit, got.HardLimit))
		case i > 0 && (l.RequestMiB != held.RequestMiB || l.LimitMiB != held.LimitMiB):
			return Limits{}, limitsDiffer(fmt.Sprintf("GPU %s: cgroup %s has soft %dMi and hard %dMi, GPU %s soft %dMi and hard %dMi",
				uuid, cgroup, l.RequestMiB, l.LimitMiB, devices[0], held.RequestMiB, held.LimitMiB))
		}
		held = l
	}
	return held, nil
}

// KillCgroup sends SIGKILL to every process of the cgroup (its
// cgroup.procs, read again until it lists none not killed already, as
// processes may fork while it is read) and says how many it killed. It
// needs CAP_KILL (or root with every capability) and the host's PID
// namespace; the cgroup file system may be mounted read-only.
func KillCgroup(cgroup string) (int, error) {
	killed := map[int]bool{}
	for range 10 {
		raw, err := os.ReadFile(filepath.Join(cgroup, "cgroup.procs"))
		if errors.Is(err, fs.ErrNotExist) {
			return len(killed), nil // the cgroup is gone: so are its processes
		}
		if err != nil {
			return len(killed), fmt.Errorf("list the processes of cgroup %s: %w", cgroup, err)
		}
		fresh := 0
		for _, f := range strings.Fields(string(raw)) {
			pid, err := strconv.Atoi(f)
			if err != nil || pid <= 0 || killed[pid] {
				continue
			}
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return len(killed), fmt.Errorf("kill process %d of cgroup %s: %w", pid, cgroup, err)
			}
			killed[pid], fresh = true, fresh+1
		}
		if fresh == 0 {
			return len(killed), nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return len(killed), fmt.Errorf("cgroup %s kept listing new processes while they were killed", cgroup)
}
