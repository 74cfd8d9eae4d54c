package enforce

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/gpufrac/gpufrac/pkg/node/enforce/enforcetest"
)

func newMachine(t *testing.T, n int) (*server.Server, *enforcetest.Driver, []string) {
	t.Helper()
	return enforcetest.NewMachine(n)
}

const cg = "/kubepods.slice/kubepods-burstable.slice/cri-containerd-abc.scope"

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
	for _, bad := range []map[string]string{
		{},
		{"GPUFRAC_DEVICES": "GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "x", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
		{"GPUFRAC_DEVICES": "GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "2", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
		{"GPUFRAC_DEVICES": "GPU-a", "GPUFRAC_MEMORY_REQUEST_MIB": "0", "GPUFRAC_MEMORY_LIMIT_MIB": "1"},
	} {
		if _, err := LimitsFromEnv(env(bad)); err == nil {
			t.Errorf("accepted %v", bad)
		}
	}
}

func TestCgroupOf(t *testing.T) {
	proc := t.TempDir()
	write := func(pid, content string) {
		if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, pid, "cgroup"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("42", "0::"+cg+"\n")
	write("43", "12:memory:/docker/x\n11:cpu:/docker/x\n") // cgroup v1 only
	if got, err := CgroupOf(proc, 42); err != nil || got != cg {
		t.Errorf("CgroupOf(42) = %q, %v", got, err)
	}
	if _, err := CgroupOf(proc, 43); err == nil || !strings.Contains(err.Error(), "cgroup v2") {
		t.Errorf("cgroup v1: %v", err)
	}
	if _, err := CgroupOf(proc, 44); err == nil {
		t.Error("missing pid resolved")
	}
	// This very process, through the real /proc.
	if _, err := CgroupOf("/proc", os.Getpid()); err != nil {
		t.Logf("this machine's own cgroup: %v", err)
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
