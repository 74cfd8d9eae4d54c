package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/internal/statefile"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// Status is what the daemon's supervisor tells the node agent, in
// Root/daemon.json: which daemon runs, how many times one was started
// (a new generation has none of the old one's runtime namespaces, and its
// clients lost their contexts), and why the last one ended.
type Status struct {
	PID        int         `json:"pid"`
	Generation int         `json:"generation"`
	Protocol   nodeapi.MPS `json:"protocol"`
	Release    int         `json:"release"`
	Started    time.Time   `json:"started"`
	// Running is false between a daemon's end and the next start.
	Running bool `json:"running"`
	// LastExit says why the previous daemon of this supervisor ended.
	LastExit string `json:"lastExit,omitempty"`
	// Replaced is when the daemon was last replaced at the node agent's
	// request; ReplaceDeferred, while set, is a request held back until
	// Replaced + MinReplaceInterval (with its reason).
	Replaced        time.Time `json:"replaced,omitzero"`
	ReplaceDeferred string    `json:"replaceDeferred,omitempty"`
}

// replacePath is where the node agent asks for the daemon's replacement:
// a wedged server (clients that never finish terminating) is invisible to
// the control daemon's own probe, which keeps answering.
func replacePath(root string) string { return filepath.Join(root, "replace") }

// RequestReplace asks the supervisor to replace the daemon at its next
// probe, saying why.
func RequestReplace(root, why string) error {
	return statefile.Write(replacePath(root), []byte(why))
}

// replaceRequest reads a replacement request, leaving it in place.
func replaceRequest(root string) (string, bool) {
	data, err := os.ReadFile(replacePath(root))
	if err != nil {
		return "", false
	}
	return strings.TrimSpace(string(data)), true
}

// takeReplaceRequest reads and clears a replacement request.
func takeReplaceRequest(root string) (string, bool) {
	why, ok := replaceRequest(root)
	if ok {
		_ = os.Remove(replacePath(root))
	}
	return why, ok
}

// WaitingPath is where a supervisor that waits for a daemon it did not
// start (on its pipe directory) says so; it is gone once its own runs.
func WaitingPath(root string) string { return filepath.Join(root, "supervisor-waiting") }

// StatusPath is where the supervisor writes its Status under root.
func StatusPath(root string) string { return filepath.Join(root, "daemon.json") }

// ConfigPath is where the daemon's generated configuration is written.
func ConfigPath(root string) string { return filepath.Join(root, "mps-control.toml") }

// ReadStatus reads the supervisor's status.
func ReadStatus(root string) (Status, error) {
	var s Status
	err := statefile.ReadJSON(StatusPath(root), &s)
	return s, err
}

// Daemon supervises the node's one MPS control daemon: it generates the
// configuration for the driver, runs the daemon in the foreground (so a
// crash is seen at once), probes it, replaces it when it exits or stops
// answering (with backoff), and on stop asks it to quit.
type Daemon struct {
	// Binary is the MPS control program; ServerBinary the server it
	// starts: the daemon's own servers are killed with a wedged daemon, so
	// no stray server keeps the GPU.
	Binary, ServerBinary string
	// Root is the node's MPS root (--mps-pipe-dir).
	Root string
	// Release is the driver's major release: it picks the interface and
	// the configuration keys.
	Release int
	Options ConfigOptions
	// ProcRoot is the host's /proc, to find the daemon's servers.
	ProcRoot string
	// ProbeInterval is how often the daemon is asked for its servers;
	// CommandTimeout how long an answer may take. Two missed answers in a
	// row make it wedged.
	ProbeInterval, CommandTimeout time.Duration
	// MinBackoff and MaxBackoff bound the delay before a restart.
	MinBackoff, MaxBackoff time.Duration
	// StopGrace is how long a quitting daemon may take before it is killed.
	StopGrace time.Duration
	// MinReplaceInterval rate-limits the node agent's replacement
	// requests: every replacement ends every tenant's context and gets
	// every fractional pod deleted, so a tenant that can wedge the shared
	// server again and again (a client killed mid-kernel) must not be
	// able to do that to the node's other tenants at will. A request
	// within the interval waits for its end (the status says so).
	MinReplaceInterval time.Duration
}

// NewDaemon returns a supervisor with the defaults filled in.
func NewDaemon(binary, root string, release int) *Daemon {
	return &Daemon{Binary: binary, ServerBinary: "nvidia-cuda-mps-server", Root: root, Release: release, ProcRoot: "/proc",
		ProbeInterval: 5 * time.Second, CommandTimeout: 10 * time.Second,
		MinBackoff: time.Second, MaxBackoff: 30 * time.Second, StopGrace: 30 * time.Second, MinReplaceInterval: DefaultMinReplaceInterval}
}

// DefaultMinReplaceInterval is the least time between two replacements
// of the daemon at the node agent's request.
const DefaultMinReplaceInterval = 10 * time.Minute

// Protocol is the interface the daemon speaks.
func (d *Daemon) Protocol() nodeapi.MPS { return ProtocolFor(d.Release) }

func (d *Daemon) control() Control {
	return Control{Binary: d.Binary, Root: d.Root, Protocol: d.Protocol(), Timeout: d.CommandTimeout}
}

// prepare makes the daemon's directories and returns its command line.
func (d *Daemon) prepare() ([]string, error) {
	if err := nodeapi.CheckRoot(d.Root); err != nil {
		return nil, err
	}
	for _, dir := range []string{nodeapi.PipeDir(d.Root), nodeapi.LogDir(d.Root)} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("MPS root: %w", err)
		}
	}
	return d.args()
}

// args is the daemon's command line: v3 in the foreground, multi-user
// (containers run as any uid), with the generated configuration; v2 in the
// foreground.
func (d *Daemon) args() ([]string, error) {
	if d.Protocol() != nodeapi.MPSv3 {
		return []string{"-f"}, nil
	}
	cfg, err := Config(d.Release, d.Options)
	if err != nil {
		return nil, err
	}
	if err := statefile.Write(ConfigPath(d.Root), cfg); err != nil {
		return nil, fmt.Errorf("MPS configuration: %w", err)
	}
	return []string{"-p", "3", "-m", "-f", "-a", ConfigPath(d.Root)}, nil
}

// Run supervises the daemon until ctx ends, then stops it. It returns an
// error only when the daemon cannot be configured at all.
func (d *Daemon) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("mpsRoot", d.Root, "release", d.Release, "protocol", d.Protocol())
	prev, _ := ReadStatus(d.Root)
	// The last replacement's time survives the supervisor's restarts: the
	// rate limit must not reset with the daemon's pod.
	status := Status{Generation: prev.Generation, Protocol: d.Protocol(), Release: d.Release, Replaced: prev.Replaced}
	args, err := d.prepare()
	if err != nil {
		// Said where the node agent reads it, so the node's condition
		// names the cause instead of "no daemon has been started".
		status.LastExit = "cannot start: " + err.Error()
		d.writeStatus(logger, status)
		return err
	}
	backoff := d.MinBackoff
	for ctx.Err() == nil {
		// A daemon this supervisor did not start answers on the same pipe
		// directory (an upgrade from 0.1.0, whose daemon ran in the node
		// agent's pod, until that pod is rolled): a second one there would
		// take over its socket under its clients. Wait for it to end.
		// The status file stays that daemon's supervisor's: this one says
		// why it waits in a file of its own (WaitingPath).
		if err := d.control().Ping(ctx); err == nil {
			why := "another MPS control daemon answers on " + nodeapi.PipeDir(d.Root) + " (one this supervisor did not start); this one starts once that one ends"
			if err := statefile.Write(WaitingPath(d.Root), []byte(why)); err != nil {
				logger.Error(err, "Cannot record why the supervisor waits")
			}
			logger.Info("Another MPS control daemon answers on the pipe directory; waiting for it to end", "after", d.MaxBackoff)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(d.MaxBackoff):
			}
			continue
		}
		_ = os.Remove(WaitingPath(d.Root))
		started := time.Now()
		status.Generation++
		reason, err := d.once(ctx, logger, args, &status)
		if err != nil {
			reason = err.Error()
		}
		status.Running, status.PID, status.LastExit = false, 0, reason
		d.writeStatus(logger, status)
		if ctx.Err() != nil {
			return nil
		}
		if time.Since(started) > 2*d.MaxBackoff {
			backoff = d.MinBackoff // it ran a good while: a fresh failure
		}
		logger.Info("MPS control daemon ended; restarting it", "reason", reason, "after", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, d.MaxBackoff)
	}
	return nil
}

// once runs one daemon until it exits, stops answering, or ctx ends, and
// says which.
func (d *Daemon) once(ctx context.Context, logger klog.Logger, args []string, status *Status) (string, error) {
	cmd := exec.Command(d.Binary, args...)
	cmd.Env = d.control().env()
	// Its own process group: a wedged daemon is killed with the servers
	// it started.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Its stdin is a pipe the supervisor holds, not the supervisor's own:
	// the daemon takes no commands there (r580, measured: docs/gpu-proof)
	// and must not read what is meant for its supervisor.
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", err
	}
	logFile, err := os.OpenFile(filepath.Join(nodeapi.LogDir(d.Root), "daemon.out"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err == nil {
		defer func() { _ = logFile.Close() }()
		cmd.Stdout, cmd.Stderr = logFile, logFile
	}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start %s: %w", d.Binary, err)
	}
	status.PID, status.Started, status.Running = cmd.Process.Pid, time.Now().UTC(), true
	d.writeStatus(logger, *status)
	logger.Info("Started the MPS control daemon", "pid", cmd.Process.Pid, "generation", status.Generation, "args", args)

	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	probe := time.NewTicker(d.ProbeInterval)
	defer probe.Stop()
	missed := 0
	for {
		select {
		case err := <-exited:
			return fmt.Sprintf("exited: %v (its output is in %s)", errOrZero(err), filepath.Join(nodeapi.LogDir(d.Root), "daemon.out")), nil
		case <-ctx.Done():
			return fmt.Sprintf("stopped: its supervisor (the MPS daemon's pod) is shutting down (%s)", errOrZero(d.quit(stdin, cmd, exited))), nil
		case <-probe.C:
			if why, asked := replaceRequest(d.Root); asked {
				if until := status.Replaced.Add(d.MinReplaceInterval); time.Now().Before(until) {
					deferred := fmt.Sprintf("%s (held until %s: the daemon was replaced at %s, and replacements are at least %s apart)",
						why, until.UTC().Format(time.RFC3339), status.Replaced.UTC().Format(time.RFC3339), d.MinReplaceInterval)
					if status.ReplaceDeferred != deferred {
						logger.Info("Holding back a replacement of the MPS daemon: the last one was too recent", "reason", why, "until", until)
						status.ReplaceDeferred = deferred
						d.writeStatus(logger, *status)
					}
				} else {
					_, _ = takeReplaceRequest(d.Root)
					_ = d.kill(cmd, exited) // killed on purpose: its exit status says nothing
					status.Replaced, status.ReplaceDeferred = time.Now().UTC(), ""
					return "replaced at the node agent's request: " + why, nil
				}
			}
			if err := d.control().Ping(ctx); err != nil {
				if ctx.Err() != nil {
					continue
				}
				if processGone(cmd.Process.Pid) {
					// Dead, not wedged: its exit is on its way (a
					// loaded node can reap it later than two probes).
					err := <-exited
					return fmt.Sprintf("exited: %v (its output is in %s)", errOrZero(err), filepath.Join(nodeapi.LogDir(d.Root), "daemon.out")), nil
				}
				missed++
				logger.Info("MPS control daemon did not answer", "missed", missed, "err", err)
				if missed >= 2 {
					_ = d.kill(cmd, exited) // killed on purpose: its exit status says nothing
					return fmt.Sprintf("wedged: no answer to two probes (%v); killed it and its servers", err), nil
				}
				continue
			}
			missed = 0
		}
	}
}

func errOrZero(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// quit asks the daemon to quit (which ends its servers and clients), and
// kills it after StopGrace. It returns how the daemon ended. The daemon is
// asked through its socket, as nvidia-cuda-mps-control asks it: one in the
// foreground reads no commands from stdin (r580, measured: a "quit" written
// there was never logged, and the daemon was killed at StopGrace with its
// servers; docs/gpu-proof).
func (d *Daemon) quit(stdin io.WriteCloser, cmd *exec.Cmd, exited chan error) error {
	// The supervisor's context is done: the command gets one of its own.
	// Legacy quit answers only once its servers are gone, so a timeout
	// here is no failure; StopGrace bounds the wait.
	_, _ = d.control().Run(context.Background(), "quit")
	_ = stdin.Close()
	select {
	case err := <-exited:
		return err
	case <-time.After(d.StopGrace):
		return d.kill(cmd, exited)
	}
}

// kill ends the daemon's process group and the MPS servers it started,
// and returns how the daemon ended. The daemon's servers are found before
// it dies (its orphans are reparented to the host's init): its children,
// and those whose environment names its pipe directory (servers started
// for it are handed that directory; the supervisor starts no daemon where
// another answers, so no other daemon serves it). Only those are
// signalled, never a server of another MPS daemon on the node (NVIDIA's
// device plugin's, a DRA driver's per-claim daemon).
func (d *Daemon) kill(cmd *exec.Cmd, exited chan error) error {
	servers := serversOf(d.ProcRoot, cmd.Process.Pid, nodeapi.PipeDir(d.Root), d.ServerBinary)
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	var err error
	select {
	case err = <-exited:
	case <-time.After(5 * time.Second):
		err = fmt.Errorf("pid %d did not end within 5s of SIGKILL", cmd.Process.Pid)
	}
	for _, s := range servers {
		// The same process still: a PID reused since carries another
		// start time.
		if now, ok := readProc(d.ProcRoot, s.pid); ok && now.started == s.started {
			_ = syscall.Kill(s.pid, syscall.SIGKILL)
		}
	}
	return err
}

// proc is what kill needs of a process: its parent, its program (argv[0]'s
// base name; comm is cut at 15 characters) and its start time (in clock
// ticks after boot, which tells a reused PID apart).
type proc struct {
	pid, ppid int
	program   string
	started   string
}

// readProc reads a process under procRoot.
func readProc(procRoot string, pid int) (proc, bool) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	stat, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return proc{}, false
	}
	// The fields after the command name, which is in parentheses and may
	// hold spaces: state, ppid, ... starttime is the 22nd field overall.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return proc{}, false
	}
	fields := strings.Fields(string(stat[i+1:]))
	if len(fields) < 20 {
		return proc{}, false
	}
	ppid, err := strconv.Atoi(fields[1])
	if err != nil {
		return proc{}, false
	}
	cmdline, _ := os.ReadFile(filepath.Join(dir, "cmdline"))
	argv0, _, _ := strings.Cut(string(cmdline), "\x00")
	return proc{pid: pid, ppid: ppid, program: filepath.Base(argv0), started: fields[19]}, true
}

// serversOf lists the processes under procRoot whose program is name's
// and which are parent's children or have CUDA_MPS_PIPE_DIRECTORY=pipeDir.
func serversOf(procRoot string, parent int, pipeDir, name string) []proc {
	if name == "" {
		return nil
	}
	entries, err := os.ReadDir(procRoot)
	if err != nil {
		return nil
	}
	var found []proc
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, ok := readProc(procRoot, pid); ok && p.program == filepath.Base(name) && (p.ppid == parent || environ(procRoot, pid)["CUDA_MPS_PIPE_DIRECTORY"] == pipeDir) {
			found = append(found, p)
		}
	}
	return found
}

func (d *Daemon) writeStatus(logger klog.Logger, s Status) {
	if err := statefile.WriteJSON(StatusPath(d.Root), s); err != nil {
		logger.Error(err, "Cannot record the MPS daemon's status; the node agent will see it as down")
	}
}

// ErrNoDaemon is the reason when no supervisor has ever run.
var ErrNoDaemon = errors.New("no MPS control daemon has been started on this node (is the chart's <release>-mps DaemonSet's pod running on it?)")

// processGone says whether a child has died: it is a zombie waiting to be
// reaped, or no longer exists.
func processGone(pid int) bool {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the command name, which is in parentheses.
	i := bytes.LastIndexByte(raw, ')')
	return i < 0 || i+2 >= len(raw) || raw[i+2] == 'Z' || raw[i+2] == 'X'
}

// environ is a process's environment under procRoot (empty if unreadable).
func environ(procRoot string, pid int) map[string]string {
	raw, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "environ"))
	env := map[string]string{}
	if err != nil {
		return env
	}
	for _, kv := range strings.Split(string(raw), "\x00") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	return env
}
