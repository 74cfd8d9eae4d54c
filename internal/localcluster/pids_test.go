package localcluster

import (
	"context"
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
		{"a word", "12 5 up\nabc 5 etcd\n", `line 2: "abc" is not a process id`},
		{"a negative pid", "-3 5 up\n", `line 1: "-3" is not a process id`},
		{"a start time that is not a number", "12 soon up\n", `line 1: start time "soon" is not a positive number`},
		// A start time of 0 would match whatever process has the pid now.
		{"no start time", "12 0 up\n", `line 1: start time "0" is not a positive number`},
		{"a bare pid", "12\n", `line 1: "12": want pid, start time and name`},
		{"nothing but a comment", headerReady + "\n", "names no process"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, pidFile), []byte(tc.file), 0o644); err != nil {
				t.Fatal(err)
			}
			if _, _, err := ReadPIDs(dir); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ReadPIDs(%q) = %v, want an error with %q", tc.file, err, tc.want)
			}
		})
	}
	if _, _, err := ReadPIDs(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no local cluster is running") {
		t.Errorf("ReadPIDs of a directory without a pid file = %v", err)
	}
}

// The file's header says whether up was ready; a name may hold spaces.
func TestReadPIDsReadsReadinessAndNames(t *testing.T) {
	dir := t.TempDir()
	for _, header := range []string{headerStarting, headerReady} {
		if err := os.WriteFile(filepath.Join(dir, pidFile), []byte(header+"\n12 7 gpufrac up\n13  8  etcd\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		procs, ready, err := ReadPIDs(dir)
		want := []Proc{{PID: 12, Start: 7, Name: "gpufrac up"}, {PID: 13, Start: 8, Name: "etcd"}}
		if err != nil || ready != (header == headerReady) || fmt.Sprint(procs) != fmt.Sprint(want) || procs[0] != want[0] {
			t.Errorf("ReadPIDs after %q = %v, %v, %v", header, procs, ready, err)
		}
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
	if (Proc{PID: 1 << 30, Start: self.Start}).Running() {
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
	b.WriteString(headerReady + "\n")
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

// procStat counts stat's fields after the command name's last ')': a name
// with spaces and parentheses does not shift the start time.
func TestProcStatReadsPastAnOddCommandName(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "a) b (c")
	if err := os.Symlink("/bin/sleep", bin); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
	if err != nil || !strings.Contains(string(stat), "(a) b (c)") {
		t.Fatalf("stat %q, %v: the command name is not the odd one", stat, err)
	}
	self, _ := procOf(os.Getpid(), "test")
	state, start, ok := procStat(cmd.Process.Pid)
	// Started after this test process, within the minute (clock ticks are
	// usually 100 a second).
	if !ok || state == "" || start < self.Start || start > self.Start+60*1000 {
		t.Errorf("procStat = %q, %d, %v; this process started at %d", state, start, ok, self.Start)
	}
}

// WaitReady returns for a ready up, waits for one still starting, and
// gives up at once on one that ended before it was ready.
func TestWaitReady(t *testing.T) {
	self, _ := procOf(os.Getpid(), "gpufrac up")
	line := fmt.Sprintf("%d %d %s\n", self.PID, self.Start, self.Name)
	dir := t.TempDir()
	write := func(content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, pidFile), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(headerReady + "\n" + line)
	if err := WaitReady(context.Background(), dir, time.Second); err != nil {
		t.Errorf("a ready up: %v", err)
	}

	write(headerStarting + "\n" + line)
	if err := WaitReady(context.Background(), dir, 500*time.Millisecond); err == nil || !strings.Contains(err.Error(), "was not ready within 500ms") {
		t.Errorf("an up still starting: %v", err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		write(headerReady + "\n" + line)
	}()
	if err := WaitReady(context.Background(), dir, 10*time.Second); err != nil {
		t.Errorf("an up that becomes ready: %v", err)
	}

	// Seen starting, then its file removed (up failed, and stopped what it
	// had started): at once, not after the timeout.
	write(headerStarting + "\n" + line)
	go func() {
		time.Sleep(300 * time.Millisecond)
		_ = os.Remove(filepath.Join(dir, pidFile))
	}()
	// Only the early return says "stopped"; the timeout says "within".
	if err := WaitReady(context.Background(), dir, time.Minute); err == nil || !strings.Contains(err.Error(), "stopped before it was ready") {
		t.Errorf("an up that failed: %v", err)
	}

	// A file left by an up killed long ago is not a ready cluster.
	gone := self
	gone.Start++
	write(headerReady + "\n" + fmt.Sprintf("%d %d %s\n", gone.PID, gone.Start, gone.Name))
	if err := WaitReady(context.Background(), dir, 500*time.Millisecond); err == nil || !strings.Contains(err.Error(), "which is not running") {
		t.Errorf("a stale pid file: %v", err)
	}
}
