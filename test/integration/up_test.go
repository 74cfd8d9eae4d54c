package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
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
		`denied the request: container "main": gpu-fraction "1.5" must be greater than 0 and less than 1`,
		"stopped; no process left",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// `gpufrac down` stops a running `gpufrac up` and every process it started.
func TestLocalClusterDown(t *testing.T) {
	dir := t.TempDir()
	up := exec.Command(gpufracBinary(t), "up", "--nodes", "1", "--dir", dir)
	log, err := os.Create(filepath.Join(dir, "up.out"))
	if err != nil {
		t.Fatal(err)
	}
	up.Stdout, up.Stderr = log, log
	if err := up.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- up.Wait() }()
	var pids []int
	deadline := time.Now().Add(2 * time.Minute)
	for len(pids) < 6 && time.Now().Before(deadline) { // up, etcd, kube-apiserver, an agent, KWOK, the scheduler
		time.Sleep(200 * time.Millisecond)
		raw, _ := os.ReadFile(filepath.Join(dir, "up.pid"))
		pids = pids[:0]
		for _, f := range strings.Fields(string(raw)) {
			if p, err := strconv.Atoi(f); err == nil {
				pids = append(pids, p)
			}
		}
	}
	if len(pids) < 6 {
		raw, _ := os.ReadFile(filepath.Join(dir, "up.out"))
		t.Fatalf("up.pid lists %v, want up and its 5 children\n%s", pids, raw)
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
