package enforce

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/go-cmp/cmp"

	"github.com/gpufrac/gpufrac/pkg/node/enforce/enforcetest"
)

func newMachine(t *testing.T, n int) (*server.Server, *enforcetest.Driver, []string) {
	t.Helper()
	return enforcetest.NewMachine(n)
}

// cgRel is a container's cgroup as /proc/<pid>/cgroup shows it, cg as NVML
// names it.
const (
	cgRel = "/kubepods.slice/kubepods-burstable.slice/cri-containerd-abc.scope"
	cg    = enforcetest.CgroupFS + cgRel
)

func TestApplySetsSoftAndHardOnEveryDevice(t *testing.T) {
	lib, d, uuids := newMachine(t, 4)
	l := Limits{Container: "main", Devices: uuids[1:3], RequestMiB: 40448, LimitMiB: 60672}
	if err := Apply(lib, cg, l); err != nil {
		t.Fatal(err)
	}
	for _, u := range uuids[1:3] {
		if got := d.Get(u, cg); got.SoftLimit != 40448<<20 || got.HardLimit != 60672<<20 {
			t.Errorf("GPU %s: %+v", u, got)
		}
	}
	for _, u := range []string{uuids[0], uuids[3]} {
		if got := d.Get(u, cg); got != (nvml.MemoryLimits_v1{}) {
			t.Errorf("GPU %s not assigned but limited: %+v", u, got)
		}
	}
	if err := Release(lib, cg, uuids[1:3]); err != nil {
		t.Fatal(err)
	}
	if got := d.Get(uuids[1], cg); got.SoftLimit != 0 || got.HardLimit != 60672<<20 {
		t.Errorf("after release: %+v, want soft 0 and the hard limit kept", got)
	}
}

func TestApplyFailsClosedAndReleasesWhatItSet(t *testing.T) {
	lib, d, uuids := newMachine(t, 2)
	d.FailSet = uuids[1]
	err := Apply(lib, cg, Limits{Devices: uuids, RequestMiB: 1024, LimitMiB: 2048})
	if err == nil {
		t.Fatal("Apply succeeded although the driver refused")
	}
	for _, want := range []string{"GPU " + uuids[1], "cgroup " + cg, "nvmlDeviceSetMemoryLimits_v1", "ERROR_NOT_SUPPORTED"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if got := d.Get(uuids[0], cg); got.SoftLimit != 0 {
		t.Errorf("first GPU keeps a soft limit after the failure: %+v", got)
	}

	if err := Apply(lib, cg, Limits{Devices: []string{"GPU-not-here"}, RequestMiB: 1, LimitMiB: 1}); err == nil || !strings.Contains(err.Error(), "GPU GPU-not-here") {
		t.Errorf("unknown GPU: %v", err)
	}
}

func TestApplyWithoutTheDriverFails(t *testing.T) {
	err := Apply(nvml.New(), cg, Limits{Devices: []string{"GPU-a"}, RequestMiB: 1, LimitMiB: 1})
	if err == nil || !strings.Contains(err.Error(), "nvmlInit") {
		t.Errorf("Apply without NVML: %v (want an nvmlInit error: this machine has no driver)", err)
	}
}

func TestLimitsFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	l, err := LimitsFromEnv(env(map[string]string{"GPUFRAC_CONTAINER": "main", "GPUFRAC_DEVICES": "GPU-a,GPU-b",
		"GPUFRAC_MEMORY_REQUEST_MIB": "1024", "GPUFRAC_MEMORY_LIMIT_MIB": "2048"}))
	if err != nil || l.Container != "main" || len(l.Devices) != 2 || l.RequestMiB != 1024 || l.LimitMiB != 2048 {
		t.Errorf("LimitsFromEnv = %+v, %v", l, err)
	}
	cdi, err := LimitsFromEnv(env(map[string]string{"GPUFRAC_DEVICES": "k8s.device-plugin.nvidia.com/gpu=GPU-a",
		"GPUFRAC_MEMORY_REQUEST_MIB": "1", "GPUFRAC_MEMORY_LIMIT_MIB": "1"}))
	if err != nil || len(cdi.Devices) != 1 || cdi.Devices[0] != "GPU-a" {
		t.Errorf("CDI name: %+v, %v (NVML wants the bare UUID)", cdi, err)
	}
	for _, bad := range []map[string]string{
		{},
		{"GPUFRAC_DEVICES": "GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "x", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
		{"GPUFRAC_DEVICES": "GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "2", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
		{"GPUFRAC_DEVICES": "GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "0", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
		{"GPUFRAC_DEVICES": "0,1", "GPUFRAC_MEMORY_REQUEST_MIB": "1", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
		{"GPUFRAC_DEVICES": "GPU-a,GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "1", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
	} {
		if _, err := LimitsFromEnv(env(bad)); err == nil {
			t.Errorf("accepted %v", bad)
		}
	}
}

func TestCgroupOf(t *testing.T) {
	proc := enforcetest.Proc(t, map[int]string{42: cgRel})
	// cgroup v1 only
	if err := os.MkdirAll(filepath.Join(proc, "43"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "43", "cgroup"), []byte("12:memory:/docker/x\n11:cpu:/docker/x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := CgroupOf(proc, 42); err != nil || got != cg {
		t.Errorf("CgroupOf(42) = %q, %v; want %q", got, err, cg)
	}
	if _, err := CgroupOf(proc, 43); err == nil || !strings.Contains(err.Error(), "cgroup v2") {
		t.Errorf("cgroup v1: %v", err)
	}
	if _, err := CgroupOf(proc, 44); err == nil {
		t.Error("missing pid resolved")
	}
}

// In the agent's pod the kernel writes other containers' cgroups relative
// to the pod's own cgroup namespace ("/../../podB/ctrB"). They are resolved
// through the host's hierarchy mounted into the pod (its mountinfo root is
// "/../../../.."), by finding the agent itself in that tree.
func TestCgroupOfFromAPrivateCgroupNamespace(t *testing.T) {
	host := t.TempDir() // the host's /sys/fs/cgroup, as mounted into the pod
	for dir, procs := range map[string]string{
		"kubepods/besteffort/podA/ctrA":   strconv.Itoa(os.Getpid()) + "\n", // the agent
		"kubepods/besteffort/podB/ctrB":   "4242\n",
		"system.slice/containerd.service": "77\n",
	} {
		if err := os.MkdirAll(filepath.Join(host, dir), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(host, dir, "cgroup.procs"), []byte(procs), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	proc := func(hostRoot string, cgroups map[string]string) string {
		proc := t.TempDir()
		cgroups["self"] = "/"
		for pid, cg := range cgroups {
			if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(proc, pid, "cgroup"), []byte("0::"+cg+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		// The runtime's mount of the pod's own namespace, and the host's.
		mountinfo := "1210 1200 0:26 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n" +
			"1211 1200 0:26 " + hostRoot + " " + host + " ro,nosuid - cgroup2 cgroup2 rw\n"
		if err := os.WriteFile(filepath.Join(proc, "self", "mountinfo"), []byte(mountinfo), 0o644); err != nil {
			t.Fatal(err)
		}
		return proc
	}
	p := proc("/../../../..", map[string]string{"42": "/../../podB/ctrB", "77": "/../../../../system.slice/containerd.service", "88": "/../../../../../x"})
	for pid, want := range map[int]string{
		42: filepath.Join(host, "kubepods/besteffort/podB/ctrB"),
		77: filepath.Join(host, "system.slice/containerd.service"),
	} {
		if got, err := CgroupOf(p, pid); err != nil || got != want {
			t.Errorf("CgroupOf(%d) = %q, %v; want %q", pid, got, err, want)
		}
	}
	if got, err := CgroupOf(p, 88); err == nil || !strings.Contains(err.Error(), "climbs above") {
		t.Errorf("a path above the root: %q, %v", got, err)
	}
	// A mount whose root the kernel puts three levels up, while the agent
	// is four levels deep in it: not the hierarchy's root, so refused.
	if got, err := CgroupOf(proc("/../../..", map[string]string{"42": "/../../podB/ctrB"}), 42); err == nil || !strings.Contains(err.Error(), "disagree") {
		t.Errorf("an inconsistent mount: %q, %v", got, err)
	}
}

// The cgroup v2 mount is read from mountinfo: /sys/fs/cgroup on a v2 host,
// the unified mount of a hybrid one, with mountinfo's escapes undone.
func TestCgroupMount(t *testing.T) {
	for _, tt := range []struct{ name, mountinfo, want, wantErr string }{
		{"cgroup v2", "30 24 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n", "/sys/fs/cgroup", ""},
		{"hybrid", "31 24 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n32 31 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n" +
			"40 31 0:35 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n", "/sys/fs/cgroup/unified", ""},
		{"preferred", "40 24 0:35 / /run/other rw - cgroup2 cgroup2 rw\n41 24 0:35 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", "/sys/fs/cgroup", ""},
		{"escaped", "40 24 0:35 / /mnt/cgroup\\040v2 rw - cgroup2 cgroup2 rw\n", "/mnt/cgroup v2", ""},
		{"optional fields", "40 24 0:35 / /sys/fs/cgroup rw shared:4 master:1 - cgroup2 cgroup2 rw\n", "/sys/fs/cgroup", ""},
		{"cgroup v1", "32 31 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", "", "no cgroup2 file system"},
	} {
		proc := t.TempDir()
		if err := os.MkdirAll(filepath.Join(proc, "self"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, "self", "mountinfo"), []byte(tt.mountinfo), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := CgroupMount(proc)
		if got != tt.want || (tt.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%s: CgroupMount = %q, %v; want %q, %q", tt.name, got, err, tt.want, tt.wantErr)
		}
	}
	if _, err := CgroupMount(t.TempDir()); err == nil || !strings.Contains(err.Error(), "mountinfo") {
		t.Errorf("no mountinfo: %v", err)
	}
}

func TestReadState(t *testing.T) {
	s, err := ReadState(strings.NewReader(`{"ociVersion":"1.2.0","id":"abc","status":"creating","pid":4242,"bundle":"/run/x"}`))
	if err != nil || s.Pid != 4242 || s.ID != "abc" {
		t.Errorf("ReadState = %+v, %v", s, err)
	}
	if _, err := ReadState(strings.NewReader(`{"id":"abc"}`)); err == nil {
		t.Error("state without pid accepted")
	}
	if _, err := ReadState(strings.NewReader(`not json`)); err == nil {
		t.Error("garbage accepted")
	}
}

func TestVerifyDetectsMissingOrChangedLimits(t *testing.T) {
	lib, d, uuids := newMachine(t, 2)
	l := Limits{Devices: uuids, RequestMiB: 1024, LimitMiB: 2048}
	if err := Verify(lib, cg, l); err == nil || !strings.Contains(err.Error(), "has soft 0Mi and hard 0Mi, want 1024Mi and 2048Mi") {
		t.Errorf("limits never set: %v", err)
	}
	if err := Apply(lib, cg, l); err != nil {
		t.Fatal(err)
	}
	if err := Verify(lib, cg, l); err != nil {
		t.Errorf("limits as set: %v", err)
	}
	d.Set(uuids[1], cg, nvml.MemoryLimits_v1{SoftLimit: 1024 << 20, HardLimit: 80 << 30})
	if err := Verify(lib, cg, l); err == nil || !strings.Contains(err.Error(), "GPU "+uuids[1]) {
		t.Errorf("raised hard limit not detected: %v", err)
	}
}

// The hook end to end: a real OCI state document, a cgroup v2 tree under a
// fake /proc, and a driver that records every SetMemoryLimits_v1 call.
func TestRunHookEndToEnd(t *testing.T) {
	const rel = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-abc.scope"
	const cgroup = enforcetest.CgroupFS + rel
	proc := enforcetest.Proc(t, map[int]string{4242: rel})
	state := `{"ociVersion":"1.2.0","id":"abc","status":"creating","pid":4242,"bundle":"/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc",` +
		`"annotations":{"io.kubernetes.cri.container-name":"main"}}`
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	base := map[string]string{"GPUFRAC_CONTAINER": "main", "GPUFRAC_MEMORY_REQUEST_MIB": "40448", "GPUFRAC_MEMORY_LIMIT_MIB": "60672"}

	lib, drv, uuids := newMachine(t, 3)
	vars := maps.Clone(base)
	vars["GPUFRAC_DEVICES"] = uuids[0] + "," + uuids[2]
	if err := RunHook(strings.NewReader(state), env(vars), proc, lib); err != nil {
		t.Fatal(err)
	}
	want := []enforcetest.Call{
		{GPU: uuids[0], Cgroup: cgroup, Soft: 40448 << 20, Hard: 60672 << 20},
		{GPU: uuids[2], Cgroup: cgroup, Soft: 40448 << 20, Hard: 60672 << 20},
	}
	if diff := cmp.Diff(want, drv.Calls()); diff != "" {
		t.Errorf("SetMemoryLimits_v1 calls (-want +got):\n%s", diff)
	}

	failures := []struct {
		name    string
		state   string
		vars    map[string]string // GPUFRAC_DEVICES is filled with the machine's first and third GPU
		failGPU int               // index of the GPU whose driver refuses; -1 for none
		want    string
	}{
		{"missing cgroup", strings.Replace(state, "4242", "4343", 1), base, -1, "cgroup of pid 4343"},
		{"NVML error", state, base, 2, "nvmlDeviceSetMemoryLimits_v1: ERROR_NOT_SUPPORTED"},
		{"request above limit", state, map[string]string{"GPUFRAC_MEMORY_REQUEST_MIB": "2048", "GPUFRAC_MEMORY_LIMIT_MIB": "1024"}, -1,
			"GPUFRAC_MEMORY_LIMIT_MIB 1024 is below GPUFRAC_MEMORY_REQUEST_MIB 2048"},
		{"not an OCI state", "{", base, -1, "read the OCI state"},
	}
	for _, f := range failures {
		t.Run(f.name, func(t *testing.T) {
			lib, drv, uuids := newMachine(t, 3)
			vars := maps.Clone(f.vars)
			vars["GPUFRAC_DEVICES"] = uuids[0] + "," + uuids[2]
			if f.failGPU >= 0 {
				drv.FailSet = uuids[f.failGPU]
			}
			err := RunHook(strings.NewReader(f.state), env(vars), proc, lib)
			if err == nil || !strings.Contains(err.Error(), f.want) {
				t.Fatalf("error %v, want it to contain %q", err, f.want)
			}
			if f.failGPU < 0 && len(drv.Calls()) != 0 {
				t.Errorf("limits set although the hook failed before NVML: %+v", drv.Calls())
			}
			// Whatever was set before the failure is released again.
			if got := drv.Get(uuids[0], cgroup); got.SoftLimit != 0 {
				t.Errorf("GPU %s keeps soft limit %d after the hook failed", uuids[0], got.SoftLimit)
			}
		})
	}
}

func TestCheckCgroup(t *testing.T) {
	for _, tt := range []struct {
		name, controllers, wantErr string
		v1                         bool
	}{
		{name: "dmem", controllers: "cpuset cpu io memory dmem pids"},
		{name: "misc fallback", controllers: "cpu memory misc"},
		{name: "neither", controllers: "cpu memory pids", wantErr: "neither the dmem controller"},
		{name: "cgroup v1", v1: true, wantErr: "not a cgroup v2 hierarchy"},
	} {
		root := t.TempDir()
		if !tt.v1 {
			if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte(tt.controllers+"\n"), 0o444); err != nil {
				t.Fatal(err)
			}
		}
		err := CheckCgroup(root)
		if (tt.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%s: %v, want %q", tt.name, err, tt.wantErr)
		}
	}
}

// After a reboot the driver holds none of the recorded limits, and a gone
// cgroup took its limits with it: those leases are dropped, not released
// (their release would fail and be reported forever). A lease of a live
// cgroup from this boot, or from a table that predates boot IDs, stays.
func TestPruneDropsLeasesOfEarlierBootsAndGoneCgroups(t *testing.T) {
	dir := t.TempDir()
	live := filepath.Join(dir, "live")
	if err := os.Mkdir(live, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "leases.json")
	l, err := OpenLeases(path)
	if err != nil {
		t.Fatal(err)
	}
	for id, lease := range map[string]Lease{
		"rebooted":  {Cgroup: live, Boot: "boot-1"},
		"gone":      {Cgroup: filepath.Join(dir, "gone"), Boot: "boot-2"},
		"this-boot": {Cgroup: live, Boot: "boot-2"},
		"old-table": {Cgroup: live},
	} {
		if err := l.Put(id, lease); err != nil {
			t.Fatal(err)
		}
	}
	exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
	dropped, err := l.Prune("boot-2", exists)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"gone", "rebooted"}; !slices.Equal(dropped, want) {
		t.Errorf("dropped %v, want %v", dropped, want)
	}
	reopened, err := OpenLeases(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := reopened.IDs(), []string{"old-table", "this-boot"}; !slices.Equal(got, want) {
		t.Errorf("the table on disk keeps %v, want %v", got, want)
	}
	proc := t.TempDir()
	if err := os.MkdirAll(filepath.Join(proc, "sys", "kernel", "random"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "sys", "kernel", "random", "boot_id"), []byte("abc-123\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := BootID(proc); got != "abc-123" {
		t.Errorf("BootID = %q", got)
	}
}

func TestResizeChangesARunningContainersLimits(t *testing.T) {
	lib, d, uuids := newMachine(t, 2)
	from := Limits{Container: "main", Devices: uuids, RequestMiB: 8192, LimitMiB: 8192}
	if err := Apply(lib, cg, from); err != nil {
		t.Fatal(err)
	}
	to := Limits{Container: "main", Devices: uuids, RequestMiB: 16384, LimitMiB: 20480}
	if err := Resize(lib, cg, uuids, from, to); err != nil {
		t.Fatal(err)
	}
	for _, u := range uuids {
		if got := d.Get(u, cg); got.SoftLimit != 16384<<20 || got.HardLimit != 20480<<20 {
			t.Errorf("GPU %s after the grow: %+v", u, got)
		}
	}
	// A shrink below what the container uses changes nothing.
	d.SetUsed(uuids[1], cg, 6000<<20+1)
	calls := len(d.Calls())
	err := Resize(lib, cg, uuids, to, Limits{Devices: uuids, RequestMiB: 4096, LimitMiB: 6000})
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "uses 6001Mi, above the hard limit 6000Mi") || !strings.Contains(err.Error(), uuids[1]) {
		t.Errorf("a shrink below the memory in use: %v", err)
	}
	if len(d.Calls()) != calls {
		t.Errorf("a refused shrink set limits: %v", d.Calls()[calls:])
	}
	// At the memory in use it is taken.
	if err := Resize(lib, cg, uuids, to, Limits{Devices: uuids, RequestMiB: 4096, LimitMiB: 6001}); err != nil {
		t.Errorf("a shrink to the memory in use: %v", err)
	}
}

// Issue 53: a shrink read the container's use before setting the new
// limit and never after: one that allocated in between kept more than
// its new limit while the books counted the rest free.
func TestShrinkRacedByAnAllocationIsTakenBack(t *testing.T) {
	lib, d, uuids := newMachine(t, 2)
	from := Limits{Devices: uuids, RequestMiB: 8192, LimitMiB: 16384}
	if err := Apply(lib, cg, from); err != nil {
		t.Fatal(err)
	}
	d.SetUsed(uuids[0], cg, 2000<<20)
	d.UseOnSet = 7000 << 20
	err := Resize(lib, cg, uuids, from, Limits{Devices: uuids, RequestMiB: 4096, LimitMiB: 6000})
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "grew to 7000Mi while its hard limit was lowered to 6000Mi") {
		t.Errorf("a shrink raced by an allocation: %v", err)
	}
	for _, u := range uuids {
		if got := d.Get(u, cg); got.SoftLimit != 8192<<20 || got.HardLimit != 16384<<20 {
			t.Errorf("GPU %s keeps %+v, want the old limits back", u, got)
		}
	}
	// A grow never takes anything back.
	d.UseOnSet = 20000 << 20
	if err := Resize(lib, cg, uuids, from, Limits{Devices: uuids, RequestMiB: 8192, LimitMiB: 32768}); err != nil {
		t.Errorf("a grow: %v", err)
	}
}

func TestResizeThatFailsMidwayPutsBackWhatItChanged(t *testing.T) {
	lib, d, uuids := newMachine(t, 2)
	from := Limits{Devices: uuids, RequestMiB: 8192, LimitMiB: 8192}
	if err := Apply(lib, cg, from); err != nil {
		t.Fatal(err)
	}
	d.FailSet = uuids[1]
	err := Resize(lib, cg, uuids, from, Limits{Devices: uuids, RequestMiB: 16384, LimitMiB: 16384})
	if err == nil || !strings.Contains(err.Error(), "GPU "+uuids[1]) {
		t.Fatalf("a resize the driver refused on one GPU: %v", err)
	}
	if got := d.Get(uuids[0], cg); got.SoftLimit != 8192<<20 || got.HardLimit != 8192<<20 {
		t.Errorf("the GPU changed before the failure keeps %+v, want the old limits back", got)
	}
}

// KillCgroup kills every process its cgroup lists (here a real process,
// listed in a stand-in cgroup directory).
func TestKillCgroupKillsEveryProcess(t *testing.T) {
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(fmt.Sprintf("%d\n", cmd.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	n, err := KillCgroup(dir)
	if err != nil || n != 1 {
		t.Fatalf("KillCgroup: %d killed, %v", n, err)
	}
	select {
	case err := <-done:
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
			t.Errorf("the process ended with %v, want SIGKILL", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the process still runs")
	}
	if n, err := KillCgroup(filepath.Join(dir, "gone")); err != nil || n != 0 {
		t.Errorf("a cgroup that is gone: %d, %v", n, err)
	}
}
