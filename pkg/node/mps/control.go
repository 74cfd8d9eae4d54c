package mps

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// DefaultBinary is the MPS control program.
const DefaultBinary = "nvidia-cuda-mps-control"

// Control sends commands to the node's MPS control daemon, the way an
// administrator would: by running the control program against the
// daemon's pipe directory. With v3 a command is argv ("module verb",
// NVIDIA MPS "MPS v3 Interface"); with v2 it is one line on stdin.
type Control struct {
	// Binary is the MPS control program.
	Binary string
	// Root is the node's MPS root (--mps-pipe-dir): the daemon's pipe and
	// log directories are under it.
	Root string
	// Protocol is the interface the daemon speaks.
	Protocol nodeapi.MPS
	// Timeout bounds every command; a daemon that does not answer within
	// it is taken as wedged.
	Timeout time.Duration
}

func (c Control) env() []string {
	return append(os.Environ(), nodeapi.EnvMPSPipeDirectory+"="+nodeapi.PipeDir(c.Root), "CUDA_MPS_LOG_DIRECTORY="+nodeapi.LogDir(c.Root))
}

// Run sends one command and returns the daemon's answer.
func (c Control) Run(ctx context.Context, args ...string) (string, error) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var cmd *exec.Cmd
	if c.Protocol == nodeapi.MPSv3 {
		cmd = exec.CommandContext(ctx, c.Binary, append([]string{"-p", "3"}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, c.Binary)
		cmd.Stdin = strings.NewReader(strings.Join(args, " ") + "\n")
	}
	cmd.Env = c.env()
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	line := strings.Join(args, " ")
	if err := cmd.Run(); err != nil {
		if parent.Err() != nil {
			return "", fmt.Errorf("MPS control %q: interrupted: %w", line, parent.Err())
		}
		if ctx.Err() != nil {
			return "", fmt.Errorf("MPS control %q: no answer within %s", line, timeout)
		}
		return "", fmt.Errorf("MPS control %q: %w: %s", line, err, bytes.TrimSpace(append(errOut.Bytes(), out.Bytes()...)))
	}
	return string(bytes.TrimSpace(out.Bytes())), nil
}

// Ping asks the daemon for its servers: it answers unless it is down or
// wedged. Both interfaces have the command.
func (c Control) Ping(ctx context.Context) error {
	_, err := c.Run(ctx, "get_server_list")
	return err
}

// Namespaces lists the named namespaces of the shared server (not its
// implicit default one).
func (c Control) Namespaces(ctx context.Context) ([]string, error) {
	out, err := c.Run(ctx, "namespace", "list", "--server="+nodeapi.SharedServer)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, f := range strings.Fields(out) {
		if f != "default" {
			names = append(names, f)
		}
	}
	return names, nil
}

// CreateNamespace creates a namespace of the shared server and sets its
// active-thread ceiling, before any client can attach (a ceiling cannot
// be changed with a client attached).
func (c Control) CreateNamespace(ctx context.Context, name string, threads int) error {
	if _, err := c.Run(ctx, "namespace", "create", name, "--server="+nodeapi.SharedServer); err != nil {
		return err
	}
	_, err := c.Run(ctx, "namespace", "set", name, "--server="+nodeapi.SharedServer, "--active-thread-percentage="+strconv.Itoa(threads))
	if err != nil {
		// Never leave an uncapped namespace behind.
		// Even when ctx has ended; briefly: what is left, the next
		// reconciliation deletes.
		cleanup, cancel := context.WithTimeout(context.WithoutCancel(ctx), 300*time.Millisecond)
		defer cancel()
		if derr := c.DeleteNamespace(cleanup, name); derr != nil {
			return fmt.Errorf("%w; and the uncapped namespace could not be deleted: %w", err, derr)
		}
	}
	return err
}

// DeleteNamespace deletes a namespace of the shared server; it fails while
// a client is attached.
func (c Control) DeleteNamespace(ctx context.Context, name string) error {
	_, err := c.Run(ctx, "namespace", "delete", name, "--server="+nodeapi.SharedServer)
	return err
}

// Client is one MPS client process.
type Client struct {
	PID int
	// Server and Namespace route it: "gpufrac" and a container's
	// namespace for sm-sharing; Namespace "default" for the default one.
	Server, Namespace string
}

// Clients lists the daemon's clients: `client list --format=csv,noheader`,
// whose columns are PID, SERVER, DEVICE, NS ("server/namespace (n)") and
// CMD (the table format truncates PIDs).
func (c Control) Clients(ctx context.Context) ([]Client, error) {
	out, err := c.Run(ctx, "client", "list", "--format=csv,noheader")
	if err != nil {
		return nil, err
	}
	return ParseClients(out), nil
}

// ParseClients reads `client list --format=csv,noheader`; lines it cannot
// read (a header, a partial line) are skipped, never guessed at.
func ParseClients(out string) []Client {
	var clients []Client
	for _, line := range strings.Split(out, "\n") {
		fields := strings.Split(strings.TrimSpace(line), ",")
		if len(fields) < 4 {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(fields[0]))
		if err != nil {
			continue
		}
		ns, _, _ := strings.Cut(strings.TrimSpace(fields[3]), " ")
		_, ns, _ = strings.Cut(ns, "/")
		if pid <= 0 {
			continue
		}
		clients = append(clients, Client{PID: pid, Server: strings.TrimSpace(fields[1]), Namespace: ns})
	}
	return clients
}

// Terminate ends one client; the command returns once the client's work
// has drained.
func (c Control) Terminate(ctx context.Context, pid int) error {
	_, err := c.Run(ctx, "client", "terminate", strconv.Itoa(pid))
	return err
}
