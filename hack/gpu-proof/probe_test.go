// Package gpuproof holds hack/gpu-proof.sh's CUDA probe. Its tests run the
// probe against csrc/fakecuda.c, a stand-in libcuda.so.1, and the script in a
// machine without a GPU: they check the probe's own logic and output and
// the script's refusal, not a GPU (which only the script, run on one, can
// show).
package gpuproof

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// build compiles csrc/probe.c and csrc/fakecuda.c with the C compiler cgo uses.
func build(t *testing.T) (probe, fakeDir string) {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	dir := t.TempDir()
	probe = filepath.Join(dir, "probe")
	if out, err := exec.Command(cc, "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Wextra", "-Werror", "-O2", "-o", probe, "csrc/probe.c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("cc probe.c: %v\n%s", err, out)
	}
	fakeDir = filepath.Join(dir, "fake")
	if err := os.Mkdir(fakeDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(cc, "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Wextra", "-Werror", "-O2", "-shared", "-fPIC",
		"-o", filepath.Join(fakeDir, "libcuda.so.1"), "csrc/fakecuda.c").CombinedOutput(); err != nil {
		t.Fatalf("cc fakecuda.c: %v\n%s", err, out)
	}
	return probe, fakeDir
}

func run(t *testing.T, probe string, env []string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(probe, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return string(out), exit.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return string(out), 0
}

func TestProbe(t *testing.T) {
	probe, fake := build(t)
	withFake := []string{"LD_LIBRARY_PATH=" + fake}
	tests := []struct {
		name string
		env  []string
		args []string
		code int
		want string
	}{
		{"no driver: says so, exit 2", []string{"LD_LIBRARY_PATH=" + t.TempDir()}, []string{"info"}, 2, "cannot load libcuda.so.1"},
		{"usage", withFake, []string{"alloc"}, 1, "usage: probe"},
		{"a bad size", withFake, []string{"alloc", "-5"}, 1, "want a positive whole number"},
		{"info lists the device", withFake, []string{"info"}, 0, "device 0 GPU-10111213-1415-1617-1819-1a1b1c1d1e1f 81920 MiB Fake GPU"},
		{"cuInit fails: named", append(withFake, "FAKECUDA_INIT_ERROR=100"), []string{"info"}, 3, "CUDA_ERROR_NO_DEVICE (100)"},
		{"alloc within the limit", append(withFake, "FAKECUDA_FREE_MIB=1024"), []string{"alloc", "1024"}, 0, "alloc 1024 MiB: ok"},
		{"alloc and hold", append(withFake, "FAKECUDA_FREE_MIB=1024"), []string{"alloc", "1024", "50"}, 0, "holding 50 ms as pid "},
		{"a bad hold", withFake, []string{"alloc", "1024", "x"}, 1, "probe: hold x: want a positive whole number"},
		{"too many arguments", withFake, []string{"spin", "1", "2"}, 1, "usage: probe"},
		{"alloc past the limit fails", append(withFake, "FAKECUDA_FREE_MIB=1024"), []string{"alloc", "1025"}, 3, "alloc 1025 MiB: failed: CUDA_ERROR_OUT_OF_MEMORY"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, code := run(t, probe, tt.env, tt.args...)
			if code != tt.code || !strings.Contains(out, tt.want) {
				t.Errorf("probe %v: exit %d, want %d; output %q, want it to contain %q", tt.args, code, tt.code, out, tt.want)
			}
		})
	}
}

// spin and work run their kernel for the time asked (the stand-in sleeps
// the kernel's first parameter in nanoseconds: spin's cycles, computed from
// the clock rate, or work's iterations) and print the kernel's interval,
// which the script compares between two processes.
func TestProbeKernels(t *testing.T) {
	probe, fake := build(t)
	for _, tt := range []struct{ args, line string }{
		{"spin 300", `spin 300 ms: start \d+\.\d+ end \d+\.\d+ took (\d+) ms`},
		{"work 300000000", `work 300000000 iters: start \d+\.\d+ end \d+\.\d+ took (\d+) ms`},
	} {
		out, code := run(t, probe, []string{"LD_LIBRARY_PATH=" + fake}, strings.Fields(tt.args)...)
		m := regexp.MustCompile(tt.line).FindStringSubmatch(out)
		if code != 0 || m == nil {
			t.Fatalf("probe %s: exit %d: %q", tt.args, code, out)
		}
		if took, _ := strconv.Atoi(m[1]); took < 300 || took > 900 {
			t.Errorf("probe %s: the kernel took %d ms, want about 300", tt.args, took)
		}
	}
}

// Without a GPU the script stops at once and says why, rather than
// reporting results it could not measure.
func TestScriptRefusesWithoutAGPU(t *testing.T) {
	cmd := exec.Command("bash", "../gpu-proof.sh")
	cmd.Env = append(os.Environ(), "PATH="+t.TempDir()+":/usr/bin:/bin", "GPU_PROOF_OUT="+t.TempDir())
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), "no NVIDIA GPU here") {
		t.Errorf("gpu-proof.sh without a GPU: %v\n%s", err, out)
	}
}
