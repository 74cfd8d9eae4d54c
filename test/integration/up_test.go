package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpufrac/gpufrac/internal/testenv"
)

// `gpufrac up --demo` brings the whole stack up on loopback, places the
// examples, shows the view and a refusal, and stops everything.
func TestLocalClusterDemo(t *testing.T) {
	dir := t.TempDir()
	out, err := exec.Command(gpufracBinary(t), "up", "--demo", "--nodes", "2", "--dir", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("gpufrac up --demo: %v\n%s", err, out)
	}
	for _, want := range []string{
		"gpufrac up: ready in", "every pod placed and Running", "gpu-node-1  8 × NVIDIA-H100-80GB-HBM3 80Gi  ready",
		"default/fraction-half", "compute 0.25", "0 fraction(s) pending",
		// Both front doors on one GPU, and the audit of both.
		"a DRA claim beside an annotated pod", "allocated by kube-scheduler's DRA allocator on that GPU (4096Mi)",
		"claim default/beside/gpu", "claim default/dra-quarter-gpu-", "`gpufrac audit`, claims included: clean",
		`denied the request: container "main": gpu-fraction "1.5" must be greater than 0 and less than 1`,
		"stopped; no process left",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// startUp runs `gpufrac up --nodes n` in the background and returns once
// it reports running, with its state directory and its exit status to
// come. It fails the test if up exits or stalls first.
func startUp(t *testing.T, nodes int) (dir string, done <-chan error) {
	t.Helper()
	dir = t.TempDir()
	up := exec.Command(gpufracBinary(t), "up", "--nodes", strconv.Itoa(nodes), "--dir", dir)
	log, err := os.Create(filepath.Join(dir, "up.out"))
	if err != nil {
		t.Fatal(err)
	}
	up.Stdout, up.Stderr = log, log
	if err := up.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- up.Wait() }()
	deadline := time.After(2 * time.Minute)
	for {
		raw, _ := os.ReadFile(filepath.Join(dir, "up.out"))
		if strings.Contains(string(raw), "gpufrac up: running") {
			return dir, exited
		}
		select {
		case err := <-exited:
			t.Fatalf("gpufrac up exited (%v) before it was running:\n%s", err, raw)
		case <-deadline:
			_ = up.Process.Kill()
			t.Fatalf("gpufrac up was not running after 2 minutes:\n%s", raw)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// `gpufrac down` stops a running `gpufrac up` and every process it started.
func TestLocalClusterDown(t *testing.T) {
	dir, done := startUp(t, 1)
	var pids []int
	raw, _ := os.ReadFile(filepath.Join(dir, "up.pid"))
	for _, f := range strings.Fields(string(raw)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	if len(pids) != 8 { // up, etcd, kube-apiserver, an agent, KWOK, the scheduler, kube-controller-manager, the dashboard
		t.Fatalf("up.pid lists %v, want up and its 7 children", pids)
	}
	if out, err := exec.Command(gpufracBinary(t), "down", "--dir", dir).CombinedOutput(); err != nil {
		t.Fatalf("gpufrac down: %v\n%s", err, out)
	}
	if err := <-done; err != nil {
		t.Errorf("gpufrac up exited with %v", err)
	}
	for _, pid := range pids {
		if stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat"); err == nil && !strings.Contains(string(stat), ") Z ") {
			t.Errorf("process %d still running after gpufrac down: %s", pid, stat)
		}
	}
}

// The README's five-minute tour works as written: its commands, after the
// set-up block, run against a `gpufrac up` cluster with the kubectl built
// alongside kube-apiserver, and say what the README says they say.
func TestReadmeTour(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	kubeDir, err := testenv.AssetsDir()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(kubeDir, "kubectl")); err != nil {
		t.Fatalf("kubectl not in %s: run `make kube-binaries`", kubeDir)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	tour, _, _ := strings.Cut(string(readme[strings.Index(string(readme), "## A five-minute tour"):])[3:], "\n## ")
	blocks := regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(tour, -1)
	if len(blocks) != 3 {
		t.Fatalf("the tour has %d shell blocks, want 3 (set-up, apply, refusals)", len(blocks))
	}

	bin := gpufracBinary(t)
	dir, done := startUp(t, 2)
	t.Cleanup(func() {
		_ = exec.Command(bin, "down", "--dir", dir).Run()
		if err := <-done; err != nil {
			t.Errorf("gpufrac up exited with %v", err)
		}
	})

	// The tour's own commands, with this test's binary and state directory;
	// the test stops the cluster itself.
	script := blocks[1][1] + blocks[2][1]
	script = strings.ReplaceAll(script, "bin/gpufrac down\n", "")
	script = strings.ReplaceAll(script, "bin/gpufrac ", bin+" ")
	cmd := exec.Command("bash", "-c", script)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "KUBECONFIG="+filepath.Join(dir, "kubeconfig"), "PATH="+kubeDir+":"+os.Getenv("PATH"))
	raw, _ := cmd.CombinedOutput()
	out := string(raw)
	before, after, found := strings.Cut(out, `pod "trainer" deleted`)
	if !found {
		t.Fatalf("the tour did not delete its pods:\n%s", out)
	}
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`pod/trainer created`),
		regexp.MustCompile(`deployment.apps/server created`),
		regexp.MustCompile(`pod/trainer condition met`),
		regexp.MustCompile(`trainer\s+1/1\s+Running`),
		regexp.MustCompile(`deployment "server" successfully rolled out`),
		regexp.MustCompile(`(?m)^server-\S+\s+1/1\s+Running(?s:.*)^server-\S+\s+1/1\s+Running`),
		regexp.MustCompile(`default/trainer\s+40Gi\s+40Gi`),
		regexp.MustCompile(`default/server-\S+\s+20Gi\s+20Gi\s+compute 0.25(?s:.*)default/server-\S+\s+20Gi\s+20Gi\s+compute 0.25`),
		regexp.MustCompile(`"nvidia.com/container.main.gpus.devices":"GPU-`),
		regexp.MustCompile(`denied the request: .*nvidia.com/container.main.gpus.devices`),
		regexp.MustCompile(`OK Pod default/fraction-half`),
		regexp.MustCompile(`audit: clean`),
	} {
		if !want.MatchString(before) {
			t.Errorf("the tour's output lacks %q:\n%s", want, before)
		}
	}
	if strings.Contains(after, "default/trainer") || strings.Contains(after, "default/server") || !strings.Contains(after, "idle GPUs: 8") {
		t.Errorf("after the delete, gpufrac top still shows the tour's pods:\n%s", after)
	}

	// As the kubectl plugin the README says it is: kubectl-gpufrac on PATH.
	plugins := t.TempDir()
	if err := os.Symlink(bin, filepath.Join(plugins, "kubectl-gpufrac")); err != nil {
		t.Fatal(err)
	}
	plugin := exec.Command(filepath.Join(kubeDir, "kubectl"), "gpufrac", "top", "-o", "json")
	plugin.Env = append(os.Environ(), "KUBECONFIG="+filepath.Join(dir, "kubeconfig"), "PATH="+plugins+":"+os.Getenv("PATH"))
	if raw, err := plugin.CombinedOutput(); err != nil || !strings.Contains(string(raw), `"gpu-node-2"`) {
		t.Errorf("kubectl gpufrac top -o json: %v\n%s", err, raw)
	}
}
