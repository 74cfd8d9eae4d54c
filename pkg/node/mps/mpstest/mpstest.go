// Package mpstest stands in for the MPS control program, which cannot run
// without a GPU. A test binary re-executes itself as the stand-in: call
// Fake from TestMain when Env is set, and Use in a test to point the
// supervisor's children at it. It speaks the control protocol's commands
// the supervisor uses over the pipe directory: "-f" is the foreground
// daemon, no argument is the client relaying one stdin line.
//
// Files in the pipe directory steer it: "wedged" makes the daemon stop
// answering; "servers" and "clients" hold the PIDs get_server_list and
// get_client_list answer; "threads" records the last default
// active-thread percentage.
// The log directory's "starts" has a line per daemon start and "commands"
// a line per command received.
package mpstest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Env is the variable that, set to 1, makes the test binary act as the
// MPS control program.
const Env = "GPUFRAC_FAKE_MPS"

// Use makes child processes started by the test act as the stand-in.
func Use(t *testing.T) {
	t.Helper()
	t.Setenv(Env, "1")
	// Under -race a child process would otherwise sleep 1s at exit.
	t.Setenv("GORACE", "atexit_sleep_ms=0")
}

// Fake runs the stand-in with the program's arguments and returns its
// exit code.
func Fake(args []string) int {
	pipe := os.Getenv("CUDA_MPS_PIPE_DIRECTORY")
	sock := filepath.Join(pipe, "control")
	if len(args) == 1 && args[0] == "-f" {
		return daemon(pipe, sock)
	}
	in, _ := bufio.NewReader(os.Stdin).ReadString('\n')
	conn, err := net.Dial("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cannot connect to the MPS control daemon:", err)
		return 1
	}
	defer func() { _ = conn.Close() }()
	fmt.Fprint(conn, in)
	_, _ = io.Copy(os.Stdout, conn)
	return 0
}

func daemon(pipe, sock string) int {
	_ = os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	appendLine(filepath.Join(os.Getenv("CUDA_MPS_LOG_DIRECTORY"), "starts"), fmt.Sprint(os.Getpid()))
	for {
		conn, err := l.Accept()
		if err != nil {
			return 1
		}
		line, _ := bufio.NewReader(conn).ReadString('\n')
		line = strings.TrimSpace(line)
		appendLine(filepath.Join(os.Getenv("CUDA_MPS_LOG_DIRECTORY"), "commands"), line)
		if _, err := os.Stat(filepath.Join(pipe, "wedged")); err == nil {
			continue // never answers
		}
		switch {
		case line == "get_server_list":
			fmt.Fprintln(conn, pids(filepath.Join(pipe, "servers")))
		case strings.HasPrefix(line, "get_client_list "):
			fmt.Fprintln(conn, pids(filepath.Join(pipe, "clients")))
		case strings.HasPrefix(line, "terminate "):
			fmt.Fprintln(conn, "")
		case strings.HasPrefix(line, "set_default_active_thread_percentage "):
			pct := strings.TrimPrefix(line, "set_default_active_thread_percentage ")
			_ = os.WriteFile(filepath.Join(pipe, "threads"), []byte(pct), 0o644)
			fmt.Fprintln(conn, pct)
		case line == "quit":
			fmt.Fprintln(conn, "")
			_ = conn.Close()
			return 0
		default:
			fmt.Fprintln(conn, "unknown command")
		}
		_ = conn.Close()
	}
}

// pids answers a list command from a file: one PID per line.
func pids(path string) string {
	data, _ := os.ReadFile(path)
	return strings.Join(strings.Fields(string(data)), "\n")
}

func appendLine(path, line string) {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer func() { _ = f.Close() }()
	fmt.Fprintln(f, line)
}
