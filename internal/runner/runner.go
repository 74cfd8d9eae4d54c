// Package runner runs a component as a child process, the one way the
// local cluster (gpufrac up: etcd, kube-apiserver, the agents, KWOK, the
// scheduler, ...) and the real-node tests (containerd, the kubelet, ...)
// do: in a process group of its own, so that stopping it stops what it
// started; its output appended to its log file; ended when its parent is
// (Pdeathsig), so that a killed parent leaves none behind. Pdeathsig
// follows the thread that started the child: start none from a goroutine
// that locks its OS thread and then exits.
package runner

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// Process is one component running.
type Process struct {
	Name string
	Bin  string
	Args []string
	// Env is added to the parent's environment.
	Env []string
	// Log is where its output goes.
	Log string

	cmd  *exec.Cmd
	done chan struct{}
}

// Start runs bin with args as the component name, its output appended to
// log, env added to this process's environment.
func Start(name, log string, env []string, bin string, args ...string) (*Process, error) {
	f, err := os.OpenFile(log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{Name: name, Bin: bin, Args: args, Env: env, Log: log, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); _ = f.Close(); close(p.done) }()
	return p, nil
}

// Restart starts the same component again (after it was stopped or
// killed), into the same log.
func (p *Process) Restart() (*Process, error) {
	return Start(p.Name, p.Log, p.Env, p.Bin, p.Args...)
}

// PID is its process ID.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Done is closed once it has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited is nil while it runs, and otherwise says how it ended and where
// its log is.
func (p *Process) Exited() error {
	select {
	case <-p.done:
		return fmt.Errorf("%s exited (%v); its log: %s", p.Name, p.cmd.ProcessState, p.Log)
	default:
		return nil
	}
}

// Kill ends its whole process group at once, as a crash or an OOM kill
// would, and waits for it.
func (p *Process) Kill() {
	_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
	<-p.done
}

// Stop stops procs together: SIGTERM to each, and after grace (one
// deadline for all) SIGKILL to the process group of each still running.
func Stop(grace time.Duration, procs ...*Process) {
	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	// A timer's channel gives one value: once it has fired, every
	// process still running is killed, not only the first.
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	expired := false
	for _, p := range procs {
		if !expired {
			select {
			case <-p.done:
				continue
			case <-deadline.C:
				expired = true
			}
		}
		p.Kill()
	}
}
