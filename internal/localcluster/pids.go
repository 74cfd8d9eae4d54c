package localcluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// StopGrace is how long `gpufrac down` lets up stop in order before it
// kills it: up gives its components 10 s, then kube-apiserver and etcd
// 10 s each.
const StopGrace = 60 * time.Second

// pidFile is where `gpufrac up` records the processes it runs, for
// `gpufrac down`: itself first, then every process it started.
const pidFile = "up.pid"

// Proc is a process `gpufrac up` started, as the pid file records it: its
// pid, its start time (clock ticks after boot, /proc/<pid>/stat field 22)
// and its component's name. The start time tells a process from a later
// one the kernel gave the same pid, which down must never signal.
type Proc struct {
	PID   int
	Start uint64
	Name  string
}

func (p Proc) String() string { return fmt.Sprintf("%s (pid %d)", p.Name, p.PID) }

// Running says whether the process still runs: its pid exists, started
// when recorded, and is not a zombie (a child whose parent was killed
// may wait a while to be reaped).
func (p Proc) Running() bool {
	state, start, ok := procStat(p.PID)
	return ok && start == p.Start && state != "Z" && state != "X"
}

// procStat reads a process's state and start time from /proc/<pid>/stat.
func procStat(pid int) (state string, start uint64, ok bool) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", 0, false
	}
	// The command name (field 2) may hold spaces and parentheses: the
	// fields are counted after its last ')'.
	rest := string(stat)
	if i := strings.LastIndexByte(rest, ')'); i >= 0 {
		rest = rest[i+1:]
	}
	fields := strings.Fields(rest) // fields[0] is field 3, the state
	if len(fields) < 20 {
		return "", 0, false
	}
	start, err = strconv.ParseUint(fields[19], 10, 64)
	return fields[0], start, err == nil
}

// procOf is the running process pid, named name, with its start time.
func procOf(pid int, name string) (Proc, bool) {
	_, start, ok := procStat(pid)
	return Proc{PID: pid, Start: start, Name: name}, ok
}

// DefaultDir is where a local cluster keeps its state unless told
// otherwise: the user's state directory ($XDG_STATE_HOME/gpufrac, by
// default ~/.local/state/gpufrac), so that `gpufrac down` and `gpufrac
// wait` find the cluster from any directory, as `gpufrac up` left it.
func DefaultDir() (string, error) {
	if dir := os.Getenv("XDG_STATE_HOME"); filepath.IsAbs(dir) {
		return filepath.Join(dir, "gpufrac"), nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("no state directory for the local cluster (give one with --dir): %w", err)
	}
	return filepath.Join(home, ".local", "state", "gpufrac"), nil
}

// The pid file's first line says whether up is still starting or ready.
const (
	headerStarting = "# starting: pid start-time name of a gpufrac up, itself first (gpufrac down and wait read it)"
	headerReady    = "# ready: pid start-time name of a gpufrac up, itself first (gpufrac down and wait read it)"
)

// writePIDs writes the pid file: this process first, then every process
// it started (etcd and kube-apiserver included), so that `gpufrac down`
// can stop them all, also after this process was killed outright. Up
// writes it as it starts each process, then marks it ready; Crash writes
// it again. It is replaced whole (a rename), so that a reader never sees
// half of it.
func (c *Cluster) writePIDs(ready bool) error {
	self, ok := procOf(os.Getpid(), "gpufrac up")
	if !ok {
		return errors.New("cannot read this process's own /proc entry")
	}
	procs := []Proc{self}
	for _, p := range c.procs {
		if q, ok := procOf(p.PID(), p.Name); ok {
			procs = append(procs, q)
		}
	}
	var b strings.Builder
	b.WriteString(map[bool]string{false: headerStarting, true: headerReady}[ready] + "\n")
	for _, p := range procs {
		fmt.Fprintf(&b, "%d %d %s\n", p.PID, p.Start, p.Name)
	}
	path := filepath.Join(c.opts.Dir, pidFile)
	if err := os.WriteFile(path+".tmp", []byte(b.String()), 0o644); err != nil {
		return err
	}
	return os.Rename(path+".tmp", path)
}

// ReadPIDs reads the pid file of the `gpufrac up` whose state is in dir:
// up itself first, then the processes it started, and whether up said it
// was ready.
func ReadPIDs(dir string) (procs []Proc, ready bool, err error) {
	path := filepath.Join(dir, pidFile)
	raw, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, fmt.Errorf("no local cluster is running (no %s)", path)
	}
	if err != nil {
		return nil, false, err
	}
	for i, line := range strings.Split(string(raw), "\n") {
		line = strings.TrimSpace(line)
		if line == headerReady {
			ready = true
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 3 {
			return nil, false, fmt.Errorf("%s line %d: %q: want pid, start time and name", path, i+1, line)
		}
		p := Proc{Name: strings.Join(f[2:], " ")}
		if p.PID, err = strconv.Atoi(f[0]); err != nil || p.PID <= 0 {
			return nil, false, fmt.Errorf("%s line %d: %q is not a process id", path, i+1, f[0])
		}
		// A start time of 0 would match any process of that pid: down must
		// never signal a process it cannot tell is up's.
		if p.Start, err = strconv.ParseUint(f[1], 10, 64); err != nil || p.Start == 0 {
			return nil, false, fmt.Errorf("%s line %d: start time %q is not a positive number", path, i+1, f[1])
		}
		procs = append(procs, p)
	}
	if len(procs) == 0 {
		return nil, false, fmt.Errorf("%s names no process", path)
	}
	return procs, ready, nil
}

// StopReport is what Stop did, process by process.
type StopReport struct {
	// Stopped were running and are not any more.
	Stopped []Proc
	// Gone had exited before Stop began: they died, or were replaced by a
	// process up did not start.
	Gone []Proc
	// Left still run: not even SIGKILL stopped them.
	Left []Proc
}

// Stop stops the `gpufrac up` whose state is in dir and every process it
// started. It asks up to stop first (up stops its children in order) and
// waits for it up to timeout, then SIGKILLs it if need be; then it stops,
// by SIGTERM and after timeout SIGKILL, every process of the pid file
// still running: a child up could not stop, or all of them when up was
// killed outright. It never trusts that up's exit means its children's.
// The error names every process left running.
func Stop(dir string, timeout time.Duration) (StopReport, error) {
	procs, _, err := ReadPIDs(dir)
	if err != nil {
		return StopReport{}, err
	}
	var report StopReport
	var wasRunning []Proc
	for _, p := range procs {
		if p.Running() {
			wasRunning = append(wasRunning, p)
		} else {
			report.Gone = append(report.Gone, p)
		}
	}
	if up := procs[0]; up.Running() {
		terminate([]Proc{up}, timeout)
	}
	// What up left, in the order up stops it: its components, then
	// kube-apiserver, then etcd (stopped under a live kube-apiserver, etcd
	// would leave it retrying until its own grace period ends).
	components, apiserver, etcd := inStopOrder(procs[1:], func(p Proc) string { return p.Name })
	for _, group := range [][]Proc{components, apiserver, etcd} {
		terminate(group, min(timeout, 10*time.Second))
	}
	for _, p := range wasRunning {
		if p.Running() {
			report.Left = append(report.Left, p)
		} else {
			report.Stopped = append(report.Stopped, p)
		}
	}
	if len(report.Left) > 0 {
		var names []string
		for _, p := range report.Left {
			names = append(names, p.String())
		}
		return report, fmt.Errorf("could not stop %s: still running after SIGKILL", strings.Join(names, ", "))
	}
	_ = os.Remove(filepath.Join(dir, pidFile))
	return report, nil
}

// terminate sends SIGTERM to those of procs still running, waits up to
// timeout, then SIGKILLs what still runs and waits a few seconds more for
// the kernel to end them.
func terminate(procs []Proc, timeout time.Duration) {
	running := func() []Proc {
		var out []Proc
		for _, p := range procs {
			if p.Running() {
				out = append(out, p)
			}
		}
		return out
	}
	for _, step := range []struct {
		sig  syscall.Signal
		wait time.Duration
	}{{syscall.SIGTERM, timeout}, {syscall.SIGKILL, 5 * time.Second}} {
		left := running()
		if len(left) == 0 {
			return
		}
		for _, p := range left {
			_ = syscall.Kill(p.PID, step.sig)
		}
		_ = wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, step.wait, true, func(context.Context) (bool, error) {
			return len(running()) == 0, nil
		})
	}
}

// WaitReady waits until the `gpufrac up` whose state is in dir is ready:
// up marks its pid file ready once every node is (and, with DRA, offers
// claims its standing GPUs), and removes the file when it stops. It gives
// up at once when an up it saw running ends before it was ready; a file
// left by an up that was killed earlier names a process that no longer
// runs, and is waited past (a new up replaces it as it starts).
func WaitReady(ctx context.Context, dir string, timeout time.Duration) error {
	var (
		seen *Proc
		last error
	)
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		procs, ready, err := ReadPIDs(dir)
		switch {
		case err != nil && seen != nil:
			return false, fmt.Errorf("%v stopped before it was ready (see its output)", *seen)
		case err != nil:
			last = err
			return false, nil
		case procs[0].Running():
			seen = &procs[0]
			return ready, nil
		case seen != nil && *seen == procs[0]:
			return false, fmt.Errorf("%v exited before it was ready (see its output)", *seen)
		}
		last = fmt.Errorf("%s names %v, which is not running (left by an up that was killed?)", filepath.Join(dir, pidFile), procs[0])
		return false, nil
	})
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return ctx.Err()
	case wait.Interrupted(err) && seen != nil:
		return fmt.Errorf("%v was not ready within %v", *seen, timeout)
	case wait.Interrupted(err) && last != nil:
		return fmt.Errorf("no gpufrac up became ready within %v: %w", timeout, last)
	}
	return err
}

// inStopOrder sorts what up runs into the order it is stopped in: its
// components, then kube-apiserver, then etcd (stopped under a live
// kube-apiserver, etcd would leave it retrying until its own grace ends).
func inStopOrder[T any](all []T, name func(T) string) (components, apiserver, etcd []T) {
	for _, p := range all {
		switch name(p) {
		case "kube-apiserver":
			apiserver = append(apiserver, p)
		case "etcd":
			etcd = append(etcd, p)
		default:
			components = append(components, p)
		}
	}
	return components, apiserver, etcd
}
