package localcluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestReadPIDsRefusesWhatIsNotAPidFile(t *testing.T) {
	for _, tc := range []struct {
		name, file, want string
	}{
		{"a word", "12 0 up\nabc 0 etcd\n", `line 2: "abc" is not a process id`},
		{"a negative pid", "-3 0 up\n", `line 1: "-3" is not a process id`},
		{"a start time that is not a number", "12 soon up\n", `line 1: start time "soon" is not a number`},
		{"nothing but a comment", "# pid start-time name\n", "names no process"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, pidFile), []byte(tc.file), 0o644); err != nil {
				t.Fatal(err)
			}
			if _, err := ReadPIDs(dir); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ReadPIDs(%q) = %v, want an error with %q", tc.file, err, tc.want)
			}
		})
	}
	if _, err := ReadPIDs(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no local cluster is running") {
		t.Errorf("ReadPIDs of a directory without a pid file = %v", err)
	}
}

// A file of bare pids (written before start times and names were) still
// reads: such a process matches whatever started at that pid.
func TestReadPIDsReadsBarePids(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, pidFile), []byte("12\n13\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	procs, err := ReadPIDs(dir)
	if err != nil || len(procs) != 2 || procs[1] != (Proc{PID: 13, Name: "process"}) {
		t.Fatalf("ReadPIDs = %v, %v", procs, err)
	}
}

// A pid the kernel has given another process since is not the process
// recorded: Running tells them apart by start time.
func TestRunningTellsAReusedPidApart(t *testing.T) {
	self, ok := procOf(os.Getpid(), "test")
	if !ok || self.Start == 0 {
		t.Fatalf("procOf(self) = %v, %v", self, ok)
	}
	if !self.Running() {
		t.Error("this process is not Running")
	}
	reused := self
	reused.Start++
	if reused.Running() {
		t.Error("a process of the same pid that started at another time counts as Running")
	}
	if (Proc{PID: 1 << 30}).Running() {
		t.Error("a pid no process has counts as Running")
	}
}

// sleeper starts a process that runs until killed; ignoreTerm makes it
// ignore SIGTERM, as a wedged component would. It is reaped when it ends.
func sleeper(t *testing.T, name string, ignoreTerm bool) Proc {
	t.Helper()
	script := "exec sleep 600"
	if ignoreTerm {
		script = "trap '' TERM; while :; do sleep 0.1; done"
	}
	cmd := exec.Command("sh", "-c", script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	p, ok := procOf(cmd.Process.Pid, name)
	if !ok {
		t.Fatalf("no /proc entry for %s", name)
	}
	return p
}

// Stop stops up and then whatever up left, SIGKILLs what ignores SIGTERM,
// reports the processes that were gone before it began, and never signals
// a pid that another process has taken since.
func TestStopStopsWhatUpLeftAndSaysWhatWasGone(t *testing.T) {
	up := sleeper(t, "gpufrac up", false)
	etcd := sleeper(t, "etcd", false)
	apiserver := sleeper(t, "kube-apiserver", true) // ignores SIGTERM
	dead := sleeper(t, "scheduler", false)
	if err := exec.Command("kill", "-9", fmt.Sprint(dead.PID)).Run(); err != nil {
		t.Fatal(err)
	}
	// This test's own pid, recorded with another start time: a process
	// that took the pid of one up had started. Stop must leave it alone.
	reused, _ := procOf(os.Getpid(), "dashboard")
	reused.Start++
	deadline := time.Now().Add(5 * time.Second)
	for dead.Running() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}

	dir := t.TempDir()
	var b strings.Builder
	for _, p := range []Proc{up, etcd, apiserver, dead, reused} {
		fmt.Fprintf(&b, "%d %d %s\n", p.PID, p.Start, p.Name)
	}
	if err := os.WriteFile(filepath.Join(dir, pidFile), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	report, err := Stop(dir, 300*time.Millisecond)
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	for _, p := range []Proc{up, etcd, apiserver} {
		if p.Running() {
			t.Errorf("%v still running after Stop", p)
		}
	}
	if got := fmt.Sprint(report.Stopped); got != fmt.Sprint([]Proc{up, etcd, apiserver}) {
		t.Errorf("Stopped = %s, want up, etcd and kube-apiserver", got)
	}
	if got := fmt.Sprint(report.Gone); got != fmt.Sprint([]Proc{dead, reused}) {
		t.Errorf("Gone = %s, want the killed scheduler and the reused pid", got)
	}
	if _, err := os.Stat(filepath.Join(dir, pidFile)); !os.IsNotExist(err) {
		t.Errorf("the pid file is still there after a clean Stop: %v", err)
	}
}
