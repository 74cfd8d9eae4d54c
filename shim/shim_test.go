package shim

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func cc(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("cc", args...).CombinedOutput(); err != nil {
		t.Fatalf("cc %v: %v\n%s", args, err, out)
	}
}

// memquery runs the test program with the shim first on its library path
// and returns its output lines.
func memquery(t *testing.T, program, shimDir string, env ...string) []string {
	t.Helper()
	cmd := exec.Command(program)
	cmd.Env = append([]string{"LD_LIBRARY_PATH=" + shimDir}, env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("memquery: %v\n%s", err, out)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}

func TestShimReportsTheContainerLimitAsTotal(t *testing.T) {
	dir := t.TempDir()
	shimDir, realDir := filepath.Join(dir, "shim"), filepath.Join(dir, "real")
	if _, err := Build("cc", shimDir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(realDir, 0o755); err != nil {
		t.Fatal(err)
	}
	fake := filepath.Join(realDir, LibraryName)
	cc(t, "-shared", "-fPIC", "-o", fake, "testdata/fake_nvml.c")
	program := filepath.Join(dir, "memquery")
	cc(t, "-o", program, "testdata/memquery.c", "-ldl")

	// A 20 GiB limit: total 20480 MiB, the driver's reserve is not the
	// container's. On GPU 0 used is the container's own process (3 GiB,
	// not the other tenant's 5 GiB); GPU 1 names no process, so the GPU's
	// 10 GiB stand. Functions the fake lacks (nvmlDeviceGetName) answer
	// FUNCTION_NOT_FOUND (13) through the shim.
	got := memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+fake, "NVIDIA_GPU_MEMORY_LIMIT=20480")
	want := []string{
		"gpu=0 total=20480 used=3072 free=17408 v2total=20480 v2reserved=0 v2free=17408 name=13",
		"gpu=1 total=20480 used=10240 free=10240 v2total=20480 v2reserved=0 v2free=10240 name=13",
		"export table: 5eed", // nvidia-smi's version check reaches the real library's table
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("with a limit (-want +got):\n%s", diff)
	}

	// The driver's limit for the process's own cgroup wins over the one
	// the container was created with: a resize changes it. The cgroup is
	// named as the driver wants it, by its full sysfs path.
	own, err := ownCgroup()
	if err != nil {
		t.Fatal(err)
	}
	got = memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+fake, "NVIDIA_GPU_MEMORY_LIMIT=20480", "FAKE_CGROUP="+own, "FAKE_CGROUP_HARD_MIB=4096")
	if !strings.HasPrefix(got[0], "gpu=0 total=4096 used=3072 free=1024 ") {
		t.Errorf("with the driver's limit for its cgroup: %q", got)
	}
	got = memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+fake, "NVIDIA_GPU_MEMORY_LIMIT=20480", "FAKE_CGROUP=/sys/fs/cgroup/another", "FAKE_CGROUP_HARD_MIB=4096")
	if !strings.HasPrefix(got[0], "gpu=0 total=20480 ") {
		t.Errorf("with a limit for another cgroup only: %q", got)
	}

	// Use above the limit is shown as the limit, never more than total.
	got = memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+fake, "NVIDIA_GPU_MEMORY_LIMIT=2048")
	if !strings.HasPrefix(got[0], "gpu=0 total=2048 used=2048 free=0 ") || !strings.HasPrefix(got[1], "gpu=1 total=2048 used=2048 free=0 ") {
		t.Errorf("use above the limit: %q", got)
	}

	// Without a limit the shim is transparent.
	got = memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+fake)
	if !strings.HasPrefix(got[0], "gpu=0 total=81920 used=10240 free=71680 v2total=81920 v2reserved=512 ") {
		t.Errorf("without a limit: %q", got[0])
	}

	// The real library found on the library path after the shim, as where
	// the driver's libraries are on LD_LIBRARY_PATH (GKE's
	// /usr/local/nvidia/lib64) rather than in the system's directories.
	got = memquery(t, program, shimDir, "LD_LIBRARY_PATH="+shimDir+"::"+filepath.Join(dir, "none")+":"+realDir, "NVIDIA_GPU_MEMORY_LIMIT=20480")
	if len(got) != 3 || !strings.HasPrefix(got[0], "gpu=0 total=20480 used=3072 ") {
		t.Errorf("real library on LD_LIBRARY_PATH: %q", got)
	}

	// No real library (this machine has no driver): calls fail cleanly.
	got = memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+filepath.Join(dir, "missing.so"))
	if diff := cmp.Diff([]string{"init=13"}, got); diff != "" {
		t.Errorf("without the real library (-want +got):\n%s", diff)
	}

	// The shim never takes itself for the real library.
	got = memquery(t, program, shimDir, "GPUFRAC_REAL_NVML="+filepath.Join(shimDir, LibraryName))
	if diff := cmp.Diff([]string{"init=13"}, got); diff != "" {
		t.Errorf("pointed at itself (-want +got):\n%s", diff)
	}
}

// ownCgroup is this process's cgroup v2 as the driver names it.
func ownCgroup() (string, error) {
	raw, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return "/sys/fs/cgroup" + p, nil
		}
	}
	return "", errors.New("/proc/self/cgroup has no cgroup v2 line")
}

func TestGeneratorCoversTheHeader(t *testing.T) {
	dir, err := HeaderDir()
	if err != nil {
		t.Fatal(err)
	}
	header, err := os.ReadFile(filepath.Join(dir, "nvml.h"))
	if err != nil {
		t.Fatal(err)
	}
	src, err := GenerateForwarders(header, Overridden)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"nvmlReturn_t nvmlInit(void) {",
		"nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {",
		"    return f(device, name, length);",
		"nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(",
		"const char *nvmlErrorString(nvmlReturn_t result) {",
	} {
		if !strings.Contains(string(src), want) {
			t.Errorf("generated forwarders lack %q", want)
		}
	}
	for _, o := range Overridden {
		if strings.Contains(string(src), "nvmlReturn_t "+o+"(") {
			t.Errorf("%s is overridden but was also generated", o)
		}
	}
	if n := strings.Count(string(src), "gpufrac_real_symbol(\""); n < 400 {
		t.Errorf("only %d forwarders", n)
	}
}

func TestArgNames(t *testing.T) {
	got, err := argNames("nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos, char serial[16]")
	if err != nil || !cmp.Equal(got, []string{"device", "infoCount", "infos", "serial"}) {
		t.Errorf("argNames = %v, %v", got, err)
	}
	if got, err := argNames("void"); err != nil || got != nil {
		t.Errorf("void: %v, %v", got, err)
	}
}
