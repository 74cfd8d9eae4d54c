// Package mps supervises MPS for sm-sharing containers. Each container gets
// its own MPS "namespace": a control daemon (nvidia-cuda-mps-control -f,
// run in the foreground so the agent owns it) on a pipe directory of its
// own, with the container's active-thread ceiling set as the daemon's
// default before the container's first client connects. One tenant's
// daemon failing or wedging never touches another's. Namespaces are
// persisted so an agent restart adopts or recovers them.
package mps

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/internal/statefile"
)

// DefaultBinary is the MPS control program.
const DefaultBinary = "nvidia-cuda-mps-control"

// Supervisor runs and watches the per-container MPS control daemons.
type Supervisor struct {
	// Binary is the MPS control program.
	Binary string
	// Root is the host directory holding one directory per namespace.
	Root string
	// CommandTimeout bounds every control command; a daemon that does not
	// answer within it is wedged.
	CommandTimeout time.Duration
	// MinBackoff and MaxBackoff bound the restart delay of a daemon that
	// keeps exiting.
	MinBackoff, MaxBackoff time.Duration
	// StatePath is where the namespaces are recorded for the next agent;
	// default Root/namespaces.json.
	StatePath string

	mu     sync.Mutex
	spaces map[string]*space
}

// space is one namespace.
type space struct {
	Key     string `json:"key"`
	Threads int    `json:"threads"`
	PID     int    `json:"pid"`

	stopping bool
	exited   chan struct{} // closed when the daemon process we started exits
}

// New returns a supervisor over root with the defaults filled in.
func New(binary, root string) *Supervisor {
	return &Supervisor{Binary: binary, Root: root, CommandTimeout: 5 * time.Second,
		MinBackoff: time.Second, MaxBackoff: 30 * time.Second, spaces: map[string]*space{}}
}

var unsafeKey = regexp.MustCompile(`[^A-Za-z0-9._-]`)

// Key names the namespace of a pod's container.
func Key(podUID, container string) string {
	return unsafeKey.ReplaceAllString(podUID+"_"+container, "_")
}

// PipeDir is the host pipe directory of a namespace: what the container
// mounts as its CUDA_MPS_PIPE_DIRECTORY.
func PipeDir(root, key string) string { return filepath.Join(root, key, "pipe") }

func (s *Supervisor) logDir(key string) string { return filepath.Join(s.Root, key, "log") }
func (s *Supervisor) statePath() string {
	if s.StatePath != "" {
		return s.StatePath
	}
	return filepath.Join(s.Root, "namespaces.json")
}

// Ensure makes namespace key run with the given active-thread percentage,
// starting its daemon if needed, and returns when the daemon answers.
func (s *Supervisor) Ensure(ctx context.Context, key string, threads int) error {
	s.mu.Lock()
	sp, ok := s.spaces[key]
	if !ok {
		sp = &space{Key: key, Threads: threads}
		s.spaces[key] = sp
	}
	sp.stopping, sp.Threads = false, threads
	running := sp.exited != nil || sp.PID > 0 // started here, or adopted
	s.mu.Unlock()
	if !running {
		if err := s.start(ctx, sp); err != nil {
			return err
		}
	}
	if err := s.waitReady(ctx, key); err != nil {
		return err
	}
	if _, err := s.Command(ctx, key, fmt.Sprintf("set_default_active_thread_percentage %d", threads)); err != nil {
		return fmt.Errorf("MPS namespace %s: set the active-thread ceiling to %d%%: %w", key, threads, err)
	}
	return s.save()
}

// start launches a namespace's daemon and keeps restarting it with
// backoff until the namespace is stopped.
func (s *Supervisor) start(ctx context.Context, sp *space) error {
	for _, dir := range []string{PipeDir(s.Root, sp.Key), s.logDir(sp.Key)} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("MPS namespace %s: %w", sp.Key, err)
		}
	}
	cmd, err := s.launch(sp.Key)
	if err != nil {
		return err
	}
	exited := make(chan struct{})
	s.mu.Lock()
	sp.PID, sp.exited = cmd.Process.Pid, exited
	s.mu.Unlock()
	go s.watch(klog.FromContext(ctx), sp, cmd, exited)
	return nil
}

func (s *Supervisor) launch(key string) (*exec.Cmd, error) {
	cmd := exec.Command(s.Binary, "-f")
	cmd.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+PipeDir(s.Root, key), "CUDA_MPS_LOG_DIRECTORY="+s.logDir(key))
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("MPS namespace %s: start %s: %w", key, s.Binary, err)
	}
	return cmd, nil
}

// watch restarts a daemon that exits on its own, with backoff, until the
// namespace is stopped.
func (s *Supervisor) watch(logger klog.Logger, sp *space, cmd *exec.Cmd, exited chan struct{}) {
	backoff := s.MinBackoff
	for {
		err := cmd.Wait()
		close(exited)
		logger.Info("MPS control daemon exited", "namespace", sp.Key, "err", err)
		for {
			time.Sleep(backoff)
			backoff = min(backoff*2, s.MaxBackoff)
			// Check and relaunch under the lock, so a Stop in between
			// either prevents the launch or sees (and stops) the new daemon.
			s.mu.Lock()
			if sp.stopping {
				s.mu.Unlock()
				return
			}
			next, err := s.launch(sp.Key)
			if err != nil {
				s.mu.Unlock()
				logger.Error(err, "Cannot restart the MPS control daemon; retrying", "namespace", sp.Key, "after", backoff)
				continue
			}
			exited = make(chan struct{})
			sp.PID, sp.exited = next.Process.Pid, exited
			threads := sp.Threads
			s.mu.Unlock()
			cmd = next
			go s.reapplyCeiling(sp.Key, threads)
			break
		}
	}
}

// reapplyCeiling sets a restarted daemon's default ceiling again: a new
// daemon starts without it.
func (s *Supervisor) reapplyCeiling(key string, threads int) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.waitReady(ctx, key); err == nil {
		_, _ = s.Command(ctx, key, fmt.Sprintf("set_default_active_thread_percentage %d", threads))
	}
}

func (s *Supervisor) waitReady(ctx context.Context, key string) error {
	deadline := time.Now().Add(s.CommandTimeout * 2)
	var err error
	for time.Now().Before(deadline) {
		if _, err = s.Command(ctx, key, "get_server_list"); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("MPS namespace %s: the control daemon does not answer: %w", key, err)
}

// Command sends one control command to a namespace's daemon and returns
// its answer, within CommandTimeout.
func (s *Supervisor) Command(ctx context.Context, key, line string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.CommandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.Binary)
	cmd.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+PipeDir(s.Root, key), "CUDA_MPS_LOG_DIRECTORY="+s.logDir(key))
	cmd.Stdin = bytes.NewBufferString(line + "\n")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("%q: no answer within %s", line, s.CommandTimeout)
		}
		return "", fmt.Errorf("%q: %w: %s", line, err, bytes.TrimSpace(errOut.Bytes()))
	}
	return string(bytes.TrimSpace(out.Bytes())), nil
}

// Stop drains a namespace: it asks the daemon to quit (ending the
// container's MPS clients) and waits at most deadline, then kills it, so a
// container's stop is never held beyond the runtime's own deadline.
func (s *Supervisor) Stop(ctx context.Context, key string, deadline time.Duration) error {
	s.mu.Lock()
	sp, ok := s.spaces[key]
	if !ok {
		s.mu.Unlock()
		return nil
	}
	sp.stopping = true
	exited, pid := sp.exited, sp.PID
	delete(s.spaces, key)
	s.mu.Unlock()

	drainCtx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	s.terminateClients(drainCtx, key)
	_, quitErr := s.Command(drainCtx, key, "quit")
	if !waitExit(exited, pid, deadline) {
		kill(pid)
		waitExit(exited, pid, time.Second)
	}
	err := errors.Join(s.save(), os.RemoveAll(filepath.Join(s.Root, key)))
	if quitErr != nil {
		klog.FromContext(ctx).Info("MPS daemon did not quit cleanly; killed it", "namespace", key, "err", quitErr)
	}
	return err
}

// terminateClients ends every MPS client of a namespace's servers, within
// ctx: get_server_list, get_client_list per server, terminate per client.
func (s *Supervisor) terminateClients(ctx context.Context, key string) {
	servers, err := s.Command(ctx, key, "get_server_list")
	if err != nil {
		return
	}
	for _, server := range strings.Fields(servers) {
		clients, err := s.Command(ctx, key, "get_client_list "+server)
		if err != nil {
			continue
		}
		for _, client := range strings.Fields(clients) {
			_, _ = s.Command(ctx, key, "terminate "+server+" "+client)
		}
	}
}

// Check probes every daemon; one that does not answer is wedged and is
// killed, and its watcher restarts it. Healthy namespaces are untouched.
// It returns the namespaces it recovered.
func (s *Supervisor) Check(ctx context.Context) []string {
	s.mu.Lock()
	var keys []string
	for k, sp := range s.spaces {
		if !sp.stopping {
			keys = append(keys, k)
		}
	}
	s.mu.Unlock()
	slices.Sort(keys)
	var recovered []string
	for _, key := range keys {
		if _, err := s.Command(ctx, key, "get_server_list"); err == nil {
			continue
		}
		s.mu.Lock()
		sp := s.spaces[key]
		pid, owned := sp.PID, sp.exited != nil
		s.mu.Unlock()
		klog.FromContext(ctx).Info("MPS control daemon is wedged; restarting it", "namespace", key, "pid", pid)
		kill(pid)
		if !owned {
			// Adopted from a previous agent: no watcher restarts it.
			s.mu.Lock()
			sp.PID = 0
			s.mu.Unlock()
			if err := s.start(ctx, sp); err != nil {
				klog.FromContext(ctx).Error(err, "Cannot restart the MPS control daemon", "namespace", key)
			}
		}
		recovered = append(recovered, key)
	}
	return recovered
}

// Close stops supervising without stopping the daemons: at agent shutdown
// the tenants keep their MPS, and the next agent adopts the daemons.
func (s *Supervisor) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sp := range s.spaces {
		sp.stopping = true
	}
}

// PID is the daemon process of a namespace, 0 if none.
func (s *Supervisor) PID(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sp, ok := s.spaces[key]; ok {
		return sp.PID
	}
	return 0
}

// Keys lists the running namespaces, sorted.
func (s *Supervisor) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.spaces))
}

// Recover is called once at agent start with the namespaces a previous
// agent recorded: a namespace whose container still runs keeps its daemon
// when that daemon answers (its tenants are not disturbed) and gets a new
// one otherwise; a namespace whose container is gone is drained.
func (s *Supervisor) Recover(ctx context.Context, live func(key string) bool) error {
	data, err := os.ReadFile(s.statePath())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var saved []space
	if err := json.Unmarshal(data, &saved); err != nil {
		return fmt.Errorf("MPS namespaces %s are corrupt: %w", s.statePath(), err)
	}
	var errs []error
	for _, sp := range saved {
		alive := sp.PID > 0 && isMPS(sp.PID, s.Binary)
		if !live(sp.Key) {
			if alive {
				kill(sp.PID)
			}
			errs = append(errs, os.RemoveAll(filepath.Join(s.Root, sp.Key)))
			continue
		}
		if alive {
			if _, err := s.Command(ctx, sp.Key, "get_server_list"); err == nil {
				s.mu.Lock()
				s.spaces[sp.Key] = &space{Key: sp.Key, Threads: sp.Threads, PID: sp.PID}
				s.mu.Unlock()
				klog.FromContext(ctx).Info("Adopted a running MPS control daemon", "namespace", sp.Key, "pid", sp.PID)
				continue
			}
			kill(sp.PID)
		}
		errs = append(errs, s.Ensure(ctx, sp.Key, sp.Threads))
	}
	return errors.Join(append(errs, s.save())...)
}

func (s *Supervisor) save() error {
	s.mu.Lock()
	saved := make([]space, 0, len(s.spaces))
	for _, key := range slices.Sorted(maps.Keys(s.spaces)) {
		sp := s.spaces[key]
		saved = append(saved, space{Key: sp.Key, Threads: sp.Threads, PID: sp.PID})
	}
	s.mu.Unlock()
	return statefile.WriteJSON(s.statePath(), saved)
}

func waitExit(exited chan struct{}, pid int, d time.Duration) bool {
	if exited != nil {
		select {
		case <-exited:
			return true
		case <-time.After(d):
			return false
		}
	}
	// A daemon we did not start (adopted after a restart): poll its pid.
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if pid <= 0 || syscall.Kill(pid, 0) != nil {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

func kill(pid int) {
	if pid > 0 {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// isMPS reports whether pid still runs the MPS binary (and is not a
// recycled pid of something else).
func isMPS(pid int, binary string) bool {
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	argv0, _, _ := bytes.Cut(cmdline, []byte{0})
	return filepath.Base(string(argv0)) == filepath.Base(binary)
}
