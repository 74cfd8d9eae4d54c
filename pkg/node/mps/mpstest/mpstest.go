// Package mpstest stands in for the MPS control program, which cannot run
// without a GPU. A test binary re-executes itself as the stand-in: call
// Fake from TestMain when Env is set, and Use in a test to point child
// processes at it.
//
// It models what NVIDIA documents of the program (MPS "MPS v3 Interface",
// "MPS v3 Namespaces", "MPS v3 Configuration File") and what KAI's node
// operator measured on r615:
//
//   - "-f" runs the control daemon in the foreground; it takes commands on
//     its socket only, never from stdin (r580, measured: docs/gpu-proof),
//     and ends at stdin's EOF (a test's convenience); "-p 3" selects v3, "-a FILE" applies a TOML
//     configuration whose keys must all be the driver release's
//     (GPUFRAC_FAKE_MPS_RELEASE, default 615): any other key is a
//     configuration error and the daemon exits 1;
//   - the daemon's socket is $CUDA_MPS_PIPE_DIRECTORY/control, and every
//     namespace of a server has $PIPE/<server>/<namespace>/control;
//   - without "-f" it is the client: with "-p 3" the command is its
//     arguments (server create|list, namespace create|set|delete|list|get,
//     client list|terminate, get_server_list, quit), without it one stdin
//     line;
//   - servers and namespaces created at run time live in the daemon only:
//     a restart drops them (those of the configuration come back); set and
//     delete fail while a client is attached.
//
// Files in the log directory ($CUDA_MPS_LOG_DIRECTORY) steer and record
// it: "clients" lists attached clients, one "PID SERVER NAMESPACE" per
// line; "wedged" makes the daemon stop answering; "hang-terminate" makes
// client terminate never return; "starts" gets a line per daemon start,
// "commands" one per command, and "state.json" the namespaces after each;
// "spawn-server" makes the daemon start a server, a child of its own in a
// session of its own (program nvidia-cuda-mps-server), whose PID it writes
// to "server", and end it when it quits.
package mpstest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// Env is the variable that, set to 1, makes the test binary act as the
// MPS control program.
const Env = "GPUFRAC_FAKE_MPS"

// ReleaseEnv is the driver release the stand-in plays (default 615).
const ReleaseEnv = "GPUFRAC_FAKE_MPS_RELEASE"

// Use makes child processes started by the test act as the stand-in.
func Use(t *testing.T) {
	t.Helper()
	t.Setenv(Env, "1")
	// Under -race a child process would otherwise sleep 1s at exit.
	t.Setenv("GORACE", "atexit_sleep_ms=0")
}

// State is what the daemon records in state.json.
type State struct {
	// Namespaces maps "server/namespace" to its active-thread percentage
	// (0: none set).
	Namespaces map[string]int `json:"namespaces"`
	Protocol   int            `json:"protocol"`
}

// ReadState reads the daemon's last recorded state under logDir.
func ReadState(logDir string) (State, error) {
	var s State
	data, err := os.ReadFile(filepath.Join(logDir, "state.json"))
	if err != nil {
		return s, err
	}
	return s, json.Unmarshal(data, &s)
}

// Fake runs the stand-in with the program's arguments and returns its
// exit code.
func Fake(args []string) int {
	pipe, logDir := os.Getenv("CUDA_MPS_PIPE_DIRECTORY"), os.Getenv("CUDA_MPS_LOG_DIRECTORY")
	protocol := 2
	if len(args) >= 2 && args[0] == "-p" {
		if args[1] != "3" {
			fmt.Fprintln(os.Stderr, "unsupported protocol", args[1])
			return 1
		}
		protocol, args = 3, args[2:]
	}
	if slices.Contains(args, "-f") {
		return daemon(pipe, logDir, protocol, args)
	}
	line := strings.Join(args, "\t")
	if protocol == 2 {
		in, _ := bufio.NewReader(os.Stdin).ReadString('\n')
		line = strings.Join(strings.Fields(in), "\t")
	}
	conn, err := net.Dial("unix", filepath.Join(pipe, "control"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "Cannot find MPS control daemon process:", err)
		return 1
	}
	defer func() { _ = conn.Close() }()
	fmt.Fprintln(conn, line)
	answer, _ := io.ReadAll(conn)
	if rest, failed := strings.CutPrefix(string(answer), "ERROR "); failed {
		fmt.Fprint(os.Stderr, rest)
		return 1
	}
	fmt.Fprint(os.Stdout, string(answer))
	return 0
}

type fakeDaemon struct {
	mu         sync.Mutex
	pipe, log  string
	protocol   int
	namespaces map[string]int // "server/ns" -> threads
	servers    []string
}

func daemon(pipe, logDir string, protocol int, args []string) int {
	d := &fakeDaemon{pipe: pipe, log: logDir, protocol: protocol, namespaces: map[string]int{}}
	if i := slices.Index(args, "-a"); i >= 0 && i+1 < len(args) {
		if err := d.configure(args[i+1]); err != nil {
			fmt.Fprintln(os.Stderr, "MPS configuration error:", err)
			return 1
		}
	}
	// A new daemon knows no runtime namespace: their directories go.
	for _, server := range d.listServerDirs() {
		_ = os.RemoveAll(filepath.Join(pipe, server))
	}
	for key := range d.namespaces {
		_ = d.makeDir(key)
	}
	sock := filepath.Join(pipe, "control")
	_ = os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	appendLine(filepath.Join(logDir, "starts"), fmt.Sprint(os.Getpid()))
	if server := startServer(logDir); server != nil {
		defer func() { _ = server.Process.Kill(); _ = server.Wait() }()
	}
	d.record()
	quit := make(chan struct{})
	var once sync.Once
	end := func() { once.Do(func() { close(quit) }) }
	go func() {
		// The real foreground daemon reads no commands from stdin (r580,
		// measured: docs/gpu-proof): a "quit" line here does nothing, quit
		// comes over the socket. This one ends at stdin's EOF only so that
		// a test whose supervisor was killed leaves no daemon behind.
		_, _ = io.Copy(io.Discard, os.Stdin)
		end()
	}()
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			go d.serve(conn, end)
		}
	}()
	<-quit
	_ = l.Close()
	return 0
}

// startServer starts a server when the log directory asks for one: out of
// the daemon's process group, so only its parentage says whose it is.
func startServer(logDir string) *exec.Cmd {
	if !exists(filepath.Join(logDir, "spawn-server")) {
		return nil
	}
	cmd := exec.Command("bash", "-c", "exec -a nvidia-cuda-mps-server sleep 600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "cannot start the MPS server stand-in:", err)
		return nil
	}
	_ = os.WriteFile(filepath.Join(logDir, "server"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644)
	return cmd
}

func (d *fakeDaemon) listServerDirs() []string {
	entries, _ := os.ReadDir(d.pipe)
	var dirs []string
	for _, e := range entries {
		if e.IsDir() {
			dirs = append(dirs, e.Name())
		}
	}
	return dirs
}

func (d *fakeDaemon) makeDir(key string) error {
	dir := filepath.Join(d.pipe, key)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "control"), nil, 0o644)
}

// The configuration keys of each release (NVIDIA MPS, "MPS v3
// Configuration File" for 615 and 620), as patterns over dotted key paths.
var (
	keys615 = []string{
		`schema_version`,
		`servers`, `servers\.[a-z0-9_]+`,
		`servers\.[a-z0-9_]+\.(allowed_devices|pinned_memory_limit|active_thread_percentage|client_priority|uid|locality_domains)`,
		`servers\.[a-z0-9_]+\.namespaces`, `servers\.[a-z0-9_]+\.namespaces\.[a-z0-9_]+`,
		`servers\.[a-z0-9_]+\.namespaces\.[a-z0-9_]+\.(pinned_memory_limit|active_thread_percentage|client_priority)`,
		`servers\.[a-z0-9_]+\.devices`, `servers\.[a-z0-9_]+\.devices\.uuid`,
		`servers\.[a-z0-9_]+\.devices\.sm_partitions`, `servers\.[a-z0-9_]+\.devices\.sm_partitions\.(name|chunks|include_remainder)`,
		`features`, `features\.memacct`, `features\.memacct\.(enabled|audit_log)`,
		`features\.context-share`, `features\.context-share\.(enabled|default_socket)`,
	}
	keys620 = append(slices.Clone(keys615),
		`compute_policy`, `compute_policy\.(timeslice|timeslice_yield_level)`,
		`servers\.[a-z0-9_]+\.timeslice_pct`,
		`servers\.[a-z0-9_]+\.namespaces\.[a-z0-9_]+\.(cgroup|cgroup_depth)`,
		`servers\.[a-z0-9_]+\.namespaces\.[a-z0-9_]+\.devices`, `servers\.[a-z0-9_]+\.namespaces\.[a-z0-9_]+\.devices\.(uuid|sm_partition)`,
		`servers\.[a-z0-9_]+\.devices\.sm_partitions\.(shareable|max_chunks)`,
		`features\.memacct\.force_polling`,
	)
)

func (d *fakeDaemon) configure(path string) error {
	release, _ := strconv.Atoi(os.Getenv(ReleaseEnv))
	if release == 0 {
		release = 615
	}
	allowed := keys615
	if release >= 620 {
		allowed = keys620
	}
	re := regexp.MustCompile(`^(` + strings.Join(allowed, "|") + `)$`)
	var doc map[string]any
	meta, err := toml.DecodeFile(path, &doc)
	if err != nil {
		return err
	}
	for _, k := range meta.Keys() {
		if !re.MatchString(k.String()) {
			return fmt.Errorf("%s: unknown key %q for driver r%d", path, k.String(), release)
		}
	}
	servers, _ := doc["servers"].(map[string]any)
	for name, v := range servers {
		d.servers = append(d.servers, name)
		d.namespaces[name+"/default"] = 0
		body, _ := v.(map[string]any)
		nss, _ := body["namespaces"].(map[string]any)
		for ns, nv := range nss {
			threads := 0
			if m, ok := nv.(map[string]any); ok {
				if t, ok := m["active_thread_percentage"].(int64); ok {
					threads = int(t)
				}
			}
			d.namespaces[name+"/"+ns] = threads
		}
	}
	return nil
}

func (d *fakeDaemon) serve(conn net.Conn, quit func()) {
	defer func() { _ = conn.Close() }()
	line, _ := bufio.NewReader(conn).ReadString('\n')
	args := strings.Split(strings.TrimSpace(line), "\t")
	appendLine(filepath.Join(d.log, "commands"), strings.Join(args, " "))
	if exists(filepath.Join(d.log, "wedged")) {
		select {} // never answers
	}
	out, err := d.command(args)
	if err != nil {
		fmt.Fprint(conn, "ERROR "+err.Error()+"\n")
		return
	}
	fmt.Fprint(conn, out)
	if len(args) == 1 && args[0] == "quit" {
		quit()
	}
}

func flag(args []string, name string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	return ""
}

func (d *fakeDaemon) command(args []string) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.record()
	switch {
	case len(args) == 1 && args[0] == "get_server_list":
		return "4242\n", nil
	case len(args) == 1 && args[0] == "quit":
		return "", nil
	case len(args) >= 2 && args[0] == "namespace" && d.protocol == 3:
		return d.namespace(args[1], args[2:])
	case len(args) == 2 && args[0] == "server" && args[1] == "list" && d.protocol == 3:
		servers := slices.Sorted(slices.Values(d.servers))
		return strings.Join(servers, "\n") + "\n", nil
	case len(args) == 3 && args[0] == "server" && args[1] == "create" && d.protocol == 3:
		if slices.Contains(d.servers, args[2]) {
			return "", fmt.Errorf("server %s already exists", args[2])
		}
		d.servers = append(d.servers, args[2])
		d.namespaces[args[2]+"/default"] = 0
		return "", d.makeDir(args[2] + "/default")
	case len(args) >= 2 && args[0] == "client" && args[1] == "list" && d.protocol == 3:
		var b strings.Builder
		for _, c := range d.clients() {
			fmt.Fprintf(&b, "%s,%s,GPU-00000000-0000-0000-0000-000000000000,%s/%s (0),python\n", c[0], c[1], c[1], c[2])
		}
		return b.String(), nil
	case len(args) == 3 && args[0] == "client" && args[1] == "terminate" && d.protocol == 3:
		if exists(filepath.Join(d.log, "hang-terminate")) {
			d.mu.Unlock()
			select {}
		}
		var keep []string
		found := false
		for _, c := range d.clients() {
			if c[0] == args[2] {
				found = true
				continue
			}
			keep = append(keep, strings.Join(c, " "))
		}
		if !found {
			return "", fmt.Errorf("no client with PID %s", args[2])
		}
		return "", os.WriteFile(filepath.Join(d.log, "clients"), []byte(strings.Join(keep, "\n")+"\n"), 0o644)
	}
	return "", fmt.Errorf("unknown command %q", strings.Join(args, " "))
}

func (d *fakeDaemon) namespace(verb string, args []string) (string, error) {
	server := flag(args, "server")
	if verb == "list" {
		var names []string
		for key := range d.namespaces {
			if s, ns, _ := strings.Cut(key, "/"); s == server {
				names = append(names, ns)
			}
		}
		slices.Sort(names)
		return strings.Join(names, "\n") + "\n", nil
	}
	if len(args) == 0 || !regexp.MustCompile(`^[a-z0-9_]+$`).MatchString(args[0]) {
		return "", fmt.Errorf("namespace %s: a name of [a-z0-9_]+ is required", verb)
	}
	name := args[0]
	if verb == "get" && len(args) >= 3 {
		server = args[1]
	}
	if !slices.Contains(d.servers, server) {
		return "", fmt.Errorf("no server %q", server)
	}
	key := server + "/" + name
	threads, ok := d.namespaces[key]
	attached := d.attached(server, name)
	switch verb {
	case "create":
		if ok {
			return "", fmt.Errorf("namespace %s already exists", key)
		}
		d.namespaces[key] = 0
		return "", d.makeDir(key)
	case "set":
		if !ok {
			return "", fmt.Errorf("no namespace %s", key)
		}
		if attached {
			return "", fmt.Errorf("namespace %s has attached clients", key)
		}
		pct, err := strconv.Atoi(flag(args, "active-thread-percentage"))
		if err != nil || pct < 1 || pct > 100 {
			return "", fmt.Errorf("bad --active-thread-percentage")
		}
		d.namespaces[key] = pct
		return "", nil
	case "delete":
		if !ok {
			return "", fmt.Errorf("no namespace %s", key)
		}
		if attached {
			return "", fmt.Errorf("namespace %s has attached clients", key)
		}
		delete(d.namespaces, key)
		return "", os.RemoveAll(filepath.Join(d.pipe, key))
	case "get":
		if !ok {
			return "", fmt.Errorf("no namespace %s", key)
		}
		if len(args) >= 3 && args[2] == "pipe_directory" {
			return filepath.Join(d.pipe, key) + "\n", nil
		}
		return strconv.Itoa(threads) + "\n", nil
	}
	return "", fmt.Errorf("unknown namespace verb %q", verb)
}

// clients reads the attached clients: PID, server, namespace.
func (d *fakeDaemon) clients() [][]string {
	data, _ := os.ReadFile(filepath.Join(d.log, "clients"))
	var out [][]string
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) == 3 {
			out = append(out, f)
		}
	}
	return out
}

func (d *fakeDaemon) attached(server, ns string) bool {
	for _, c := range d.clients() {
		if c[1] == server && c[2] == ns {
			return true
		}
	}
	return false
}

func (d *fakeDaemon) record() {
	data, _ := json.Marshal(State{Namespaces: d.namespaces, Protocol: d.protocol})
	tmp := filepath.Join(d.log, "state.json.tmp")
	if os.WriteFile(tmp, data, 0o644) == nil {
		_ = os.Rename(tmp, filepath.Join(d.log, "state.json"))
	}
}

func exists(path string) bool { _, err := os.Stat(path); return err == nil }

func appendLine(path, line string) {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer func() { _ = f.Close() }()
	fmt.Fprintln(f, line)
}

// ShortRoot is an MPS root short enough for a unix socket path (the
// daemon's limit), which t.TempDir's names are not; removed at the end.
func ShortRoot(t *testing.T) string {
	t.Helper()
	root, err := os.MkdirTemp("/tmp", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	return root
}

// StartDaemon supervises a daemon of the stand-in (the test binary) under
// root, as driver release, with short probes and backoff (configure may
// change them), and returns once it answers, with its control client and a
// stop that ends the supervisor and waits for it (also run at the end).
func StartDaemon(t *testing.T, root string, release int, configure ...func(*mps.Daemon)) (mps.Control, func()) {
	t.Helper()
	Use(t)
	d := mps.NewDaemon(os.Args[0], root, release)
	d.ProbeInterval, d.CommandTimeout, d.MinBackoff, d.MaxBackoff, d.StopGrace = 50*time.Millisecond, 500*time.Millisecond, 20*time.Millisecond, 100*time.Millisecond, 2*time.Second
	d.ServerBinary = "" // never kill the host's MPS servers; a test that checks it names one
	for _, f := range configure {
		f(d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := d.Run(ctx); err != nil {
			t.Errorf("MPS daemon supervisor: %v", err)
		}
	}()
	stop := func() { cancel(); <-done }
	t.Cleanup(stop)
	// Each command re-executes the test binary, built with -race in make
	// test: on a loaded 2-core machine that has taken over a second.
	c := mps.Control{Binary: os.Args[0], Root: root, Protocol: d.Protocol(), Timeout: 5 * time.Second}
	for deadline := time.Now().Add(10 * time.Second); c.Ping(context.Background()) != nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			stop()
			t.Fatal("the MPS daemon did not answer within 10s")
		}
	}
	return c, stop
}

// Ceiling is the active-thread ceiling the stand-in daemon under root has
// for a namespace of the shared server, -1 if it has no such namespace.
func Ceiling(t testing.TB, root, name string) int {
	t.Helper()
	st, err := ReadState(nodeapi.LogDir(root))
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := st.Namespaces[nodeapi.SharedServer+"/"+name]; ok {
		return v
	}
	return -1
}
