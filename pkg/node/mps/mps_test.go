package mps_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func TestMain(m *testing.M) {
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:]))
	}
	os.Exit(m.Run())
}

func self(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return strings.Fields(strings.ReplaceAll(string(data), " ", "_"))
}

func TestConfigPerRelease(t *testing.T) {
	r615, err := mps.Config(615, mps.ConfigOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"[features.memacct]\nenabled = true", "[features.context-share]\nenabled = true\ndefault_socket = \"off\"",
		"[servers.gpufrac]", "[servers.gpufrac.namespaces.default]\nactive_thread_percentage = 1"} {
		if !strings.Contains(string(r615), want) {
			t.Errorf("r615 configuration lacks %q:\n%s", want, r615)
		}
	}
	if strings.Contains(string(r615), "compute_policy") {
		t.Errorf("r615 configuration has an r620 key:\n%s", r615)
	}
	if _, err := mps.Config(615, mps.ConfigOptions{Timeslice: "long"}); err == nil || !strings.Contains(err.Error(), "needs driver r620") {
		t.Errorf("an r620 key asked for on r615: %v, want a refusal", err)
	}
	r620, err := mps.Config(620, mps.ConfigOptions{Timeslice: "long"})
	if err != nil || !strings.Contains(string(r620), "[compute_policy]\ntimeslice = \"long\"") {
		t.Errorf("r620 with a timeslice: %v\n%s", err, r620)
	}
	if _, err := mps.Config(580, mps.ConfigOptions{}); err == nil {
		t.Error("r580 got an MPS v3 configuration")
	}
	if _, err := mps.Config(620, mps.ConfigOptions{Timeslice: "x\"\n[servers.evil]"}); err == nil {
		t.Error("a timeslice that breaks out of its string was accepted")
	}
	for _, tt := range []struct {
		driver string
		want   nodeapi.MPS
	}{{"615.10.02", nodeapi.MPSv3}, {"620.1", nodeapi.MPSv3}, {"580.95.05", nodeapi.MPSv2}} {
		major, err := mps.DriverMajor(tt.driver)
		if err != nil || mps.ProtocolFor(major) != tt.want {
			t.Errorf("driver %s: protocol %q, %v; want %q", tt.driver, mps.ProtocolFor(major), err, tt.want)
		}
	}
	if _, err := mps.DriverMajor("garbage"); err == nil {
		t.Error("a garbage driver version was read")
	}
}

// The stand-in applies a configuration the way the real daemon does: a
// key of another release is a configuration error and the daemon does not
// come up. The generated configurations pass on their own release.
func TestGeneratedConfigurationsStartTheirRelease(t *testing.T) {
	for _, tt := range []struct {
		release int
		opts    mps.ConfigOptions
	}{{615, mps.ConfigOptions{AuditLog: true}}, {620, mps.ConfigOptions{Timeslice: "long"}}} {
		root := mpstest.ShortRoot(t)
		t.Setenv(mpstest.ReleaseEnv, strconv.Itoa(tt.release))
		_, stop := mpstest.StartDaemon(t, root, tt.release)
		stop()
	}
	// An r620 key in an r615 daemon's configuration.
	mpstest.Use(t)
	t.Setenv(mpstest.ReleaseEnv, "615")
	root := mpstest.ShortRoot(t)
	cfg, _ := mps.Config(620, mps.ConfigOptions{Timeslice: "long"})
	path := filepath.Join(root, "bad.toml")
	if err := os.WriteFile(path, cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self(t), "-p", "3", "-f", "-a", path)
	cmd.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+root, "CUDA_MPS_LOG_DIRECTORY="+root)
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), `unknown key "compute_policy"`) {
		t.Errorf("r615 daemon with an r620 key: %v %s; want a configuration error", err, out)
	}
}

func TestDaemonCommandLineAndStatus(t *testing.T) {
	root := mpstest.ShortRoot(t)
	_, stop := mpstest.StartDaemon(t, root, 615)
	st, err := mps.ReadStatus(root)
	if err != nil || !st.Running || st.Generation != 1 || st.Protocol != nodeapi.MPSv3 || st.PID == 0 {
		t.Fatalf("status %+v, %v", st, err)
	}
	cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(st.PID) + "/cmdline")
	args := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")[1:]
	if want := []string{"-p", "3", "-m", "-f", "-a", mps.ConfigPath(root)}; !slices.Equal(args, want) {
		t.Errorf("daemon started with %q, want %q", args, want)
	}
	stop()
	pid := st.PID
	st, _ = mps.ReadStatus(root)
	if st.Running || !strings.Contains(st.LastExit, "stopped") {
		t.Errorf("after stop: %+v", st)
	}
	if syscall.Kill(pid, 0) == nil {
		t.Error("the daemon still runs after the supervisor stopped")
	}
	// Over the socket: the real daemon reads no commands from stdin.
	if got := lines(t, filepath.Join(nodeapi.LogDir(root), "commands")); !slices.Contains(got, "quit") {
		t.Errorf("the supervisor never asked the daemon to quit through its socket: %q", got)
	}
}

// A daemon that dies is restarted with backoff; the new one has none of
// the runtime namespaces, and the manager creates the claimed ones again,
// with their ceilings, and deletes those nobody claims.
func TestRestartDropsNamespacesAndReconcileRecreatesThem(t *testing.T) {
	root := mpstest.ShortRoot(t)
	c, _ := mpstest.StartDaemon(t, root, 615)
	m, err := mps.OpenManager(c, filepath.Join(root, "namespaces.json"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a := mps.Namespace{Name: nodeapi.NamespaceName("uid-a", "main"), Threads: 25, Pod: "ns/a", PodUID: "uid-a", Container: "main"}
	b := mps.Namespace{Name: nodeapi.NamespaceName("uid-b", "main"), Threads: 50, Pod: "ns/b", PodUID: "uid-b", Container: "main"}
	for _, ns := range []mps.Namespace{a, b} {
		if err := m.Ensure(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}
	state, _ := mpstest.ReadState(nodeapi.LogDir(root))
	if state.Namespaces["gpufrac/"+a.Name] != 25 || state.Namespaces["gpufrac/"+b.Name] != 50 {
		t.Fatalf("ceilings %v, want 25 and 50", state.Namespaces)
	}
	if state.Namespaces["gpufrac/default"] != mps.DefaultNamespaceCeiling {
		t.Errorf("the default namespace's ceiling is %d, want %d", state.Namespaces["gpufrac/default"], mps.DefaultNamespaceCeiling)
	}
	if _, err := os.Stat(filepath.Join(nodeapi.NamespaceDir(root, a.Name), "control")); err != nil {
		t.Errorf("namespace directory: %v", err)
	}
	if _, err := c.Run(ctx, "server", "create", "scratch"); err != nil {
		t.Fatal(err)
	}

	st, _ := mps.ReadStatus(root)
	if err := syscall.Kill(st.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a second daemon", func() bool {
		s, _ := mps.ReadStatus(root)
		return s.Generation == 2 && s.Running && c.Ping(ctx) == nil
	})
	st, _ = mps.ReadStatus(root)
	if !strings.Contains(st.LastExit, "exited") {
		t.Errorf("last exit %q, want the crash", st.LastExit)
	}
	if names, _ := c.Namespaces(ctx); len(names) != 0 {
		t.Fatalf("a restarted daemon still has %v", names)
	}
	// The configured server comes back with the daemon; one created at
	// run time does not.
	if servers, err := c.Run(ctx, "server", "list"); err != nil || servers != "gpufrac" {
		t.Errorf("servers after the restart: %q, %v; want only the configured gpufrac", servers, err)
	}
	// b's container is gone; a still runs. (Grace 0: b is not new.)
	m.Grace = 0
	r, err := m.Reconcile(ctx, func(name string) bool { return name == a.Name })
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Recreated) != 1 || r.Recreated[0].Name != a.Name || r.Recreated[0].Pod != a.Pod || len(r.Deleted) != 0 {
		t.Errorf("reconciled %+v, want only %s re-created", r, a.Name)
	}
	state, _ = mpstest.ReadState(nodeapi.LogDir(root))
	if state.Namespaces["gpufrac/"+a.Name] != 25 || len(state.Namespaces) != 2 {
		t.Errorf("after reconcile the daemon has %v, want default and %s at 25%%", state.Namespaces, a.Name)
	}
	if got := m.List(); len(got) != 1 || got[0].Name != a.Name || got[0].Threads != 25 {
		t.Errorf("table %+v, want only %s", got, a.Name)
	}

	// A namespace nobody claims (left by an earlier agent) is deleted.
	if err := c.CreateNamespace(ctx, "gf_stray_0123", 10); err != nil {
		t.Fatal(err)
	}
	r, err = m.Reconcile(ctx, func(name string) bool { return name == a.Name })
	if err != nil || !slices.Equal(r.Deleted, []string{"gf_stray_0123"}) || len(r.Recreated) != 0 {
		t.Errorf("reconcile with a stray namespace: %+v, %v", r, err)
	}

	// One the table lost but a running container uses is left alone.
	if err := c.CreateNamespace(ctx, "gf_untracked_0123", 10); err != nil {
		t.Fatal(err)
	}
	r, err = m.Reconcile(ctx, func(name string) bool { return name == a.Name || name == "gf_untracked_0123" })
	if err != nil || len(r.Deleted) != 0 {
		t.Errorf("reconcile deleted a running container's namespace: %+v, %v", r, err)
	}
	if err := c.DeleteNamespace(ctx, "gf_untracked_0123"); err != nil {
		t.Fatal(err)
	}

	// The next agent reads the table.
	again, err := mps.OpenManager(c, filepath.Join(root, "namespaces.json"))
	if err != nil || !slices.Equal(again.List(), m.List()) || len(again.List()) != 1 {
		t.Errorf("reopened table %+v, %v; want %+v", again.List(), err, m.List())
	}
}

// A namespace is created before its container runs: a reconciliation
// that does not see the container yet leaves a new namespace alone, and
// deletes it once it is past the grace.
func TestReconcileSparesNewNamespaces(t *testing.T) {
	root := mpstest.ShortRoot(t)
	c, _ := mpstest.StartDaemon(t, root, 615)
	m, err := mps.OpenManager(c, filepath.Join(root, "namespaces.json"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ns := mps.Namespace{Name: nodeapi.NamespaceName("uid-new", "main"), Threads: 40}
	if err := m.Ensure(ctx, ns); err != nil {
		t.Fatal(err)
	}
	none := func(string) bool { return false }
	if r, err := m.Reconcile(ctx, none); err != nil || len(r.Deleted) != 0 {
		t.Fatalf("a new namespace was reconciled away: %+v, %v", r, err)
	}
	if names, _ := c.Namespaces(ctx); !slices.Equal(names, []string{ns.Name}) {
		t.Fatalf("namespaces %v", names)
	}
	m.Grace = 0
	if r, err := m.Reconcile(ctx, none); err != nil || !slices.Equal(r.Deleted, []string{ns.Name}) {
		t.Fatalf("past the grace: %+v, %v; want %s deleted", r, err, ns.Name)
	}
	if names, _ := c.Namespaces(ctx); len(names) != 0 || len(m.List()) != 0 {
		t.Errorf("after deletion: daemon %v, table %v", names, m.List())
	}
}

// A wedged daemon is killed with the server it started, and replaced;
// another stack's server on the node (a process of the same program that
// this daemon did not start) is never signalled.
func TestWedgedDaemonIsReplaced(t *testing.T) {
	foreign := exec.Command("bash", "-c", "exec -a nvidia-cuda-mps-server sleep 120")
	if err := foreign.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = foreign.Process.Kill(); _ = foreign.Wait() })
	root := mpstest.ShortRoot(t)
	if err := os.MkdirAll(nodeapi.LogDir(root), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(nodeapi.LogDir(root), "spawn-server"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	c, _ := mpstest.StartDaemon(t, root, 615, func(d *mps.Daemon) { d.ServerBinary = "nvidia-cuda-mps-server" })
	st, _ := mps.ReadStatus(root)
	var own int
	waitFor(t, "the daemon's server started", func() bool {
		raw, err := os.ReadFile(filepath.Join(nodeapi.LogDir(root), "server"))
		own, _ = strconv.Atoi(string(raw))
		return err == nil && own > 0
	})
	if err := os.WriteFile(filepath.Join(nodeapi.LogDir(root), "wedged"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the wedged daemon is killed", func() bool { return syscall.Kill(st.PID, 0) != nil })
	waitFor(t, "the daemon's own server is killed", func() bool { return gone(own) })
	if gone(foreign.Process.Pid) {
		t.Fatal("the supervisor signalled an MPS server it did not start (another stack's)")
	}
	if err := os.Remove(filepath.Join(nodeapi.LogDir(root), "wedged")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a new daemon answers", func() bool {
		s, _ := mps.ReadStatus(root)
		return s.Generation >= 2 && s.Running && c.Ping(context.Background()) == nil
	})
	st, _ = mps.ReadStatus(root)
	if !strings.Contains(st.LastExit, "wedged") {
		t.Errorf("last exit %q, want wedged", st.LastExit)
	}
	if gone(foreign.Process.Pid) {
		t.Fatal("the supervisor signalled an MPS server it did not start (another stack's)")
	}
}

// gone says whether a process has ended: it no longer exists, or is a
// zombie (a child of the test not yet reaped, or of init).
func gone(pid int) bool {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(raw), ')')
	return i < 0 || i+2 >= len(raw) || raw[i+2] == 'Z'
}

// The node agent's replacement requests are rate-limited: the first
// replaces the daemon, a second within MinReplaceInterval is held back
// (the status says until when) and acted on once the interval is over.
func TestReplacementsAreRateLimited(t *testing.T) {
	root := mpstest.ShortRoot(t)
	_, _ = mpstest.StartDaemon(t, root, 615, func(d *mps.Daemon) { d.MinReplaceInterval = 2 * time.Second })
	if err := mps.RequestReplace(root, "wedged once"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first replacement", func() bool {
		s, _ := mps.ReadStatus(root)
		return s.Generation == 2 && s.Running
	})
	first, _ := mps.ReadStatus(root)
	if !strings.Contains(first.LastExit, "wedged once") || first.Replaced.IsZero() {
		t.Fatalf("after the first request: %+v", first)
	}
	if err := mps.RequestReplace(root, "wedged twice"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the second request held back", func() bool {
		s, _ := mps.ReadStatus(root)
		return strings.Contains(s.ReplaceDeferred, "wedged twice (held until")
	})
	if s, _ := mps.ReadStatus(root); s.Generation != 2 || s.PID != first.PID {
		t.Fatalf("replaced again within the interval: %+v", s)
	}
	waitFor(t, "the held request acted on after the interval", func() bool {
		s, _ := mps.ReadStatus(root)
		return s.Generation == 3 && s.Running && s.ReplaceDeferred == "" && strings.Contains(s.LastExit, "wedged twice")
	})
	if s, _ := mps.ReadStatus(root); s.Replaced.Sub(first.Replaced) < 2*time.Second {
		t.Errorf("replacements %s apart, want at least 2s", s.Replaced.Sub(first.Replaced))
	}
}

// A configuration the driver cannot take never starts a daemon, and the
// status says why (the node's condition quotes it).
func TestConfigurationErrorIsRecorded(t *testing.T) {
	root := mpstest.ShortRoot(t)
	d := mps.NewDaemon(self(t), root, 615)
	d.Options.Timeslice = "long"
	err := d.Run(context.Background())
	st, serr := mps.ReadStatus(root)
	if err == nil || serr != nil || st.Running || !strings.Contains(st.LastExit, "needs driver r620") {
		t.Errorf("Run: %v; status %+v, %v; want the r620 key refused and recorded", err, st, serr)
	}
}

// Ceilings are set before a client attaches and cannot change under one;
// a namespace with a client cannot be deleted until the client goes.
func TestNamespacesWithAttachedClients(t *testing.T) {
	root := mpstest.ShortRoot(t)
	c, _ := mpstest.StartDaemon(t, root, 615)
	m, err := mps.OpenManager(c, filepath.Join(root, "namespaces.json"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a := mps.Namespace{Name: nodeapi.NamespaceName("uid-a", "main"), Threads: 25}
	b := mps.Namespace{Name: nodeapi.NamespaceName("uid-b", "main"), Threads: 30}
	for _, ns := range []mps.Namespace{a, b} {
		if err := m.Ensure(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}
	clients := filepath.Join(nodeapi.LogDir(root), "clients")
	if err := os.WriteFile(clients, []byte("101 gpufrac "+a.Name+"\n102 gpufrac "+a.Name+"\n201 gpufrac "+b.Name+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// The same container created again (a restart) keeps its namespace.
	if err := m.Ensure(ctx, a); err != nil {
		t.Errorf("re-ensuring an unchanged namespace with clients: %v", err)
	}
	changed := a
	changed.Threads = 50
	if err := m.Ensure(ctx, changed); err == nil || !strings.Contains(err.Error(), "attached") {
		t.Errorf("changing a ceiling under a client: %v, want the daemon's refusal", err)
	}
	got, err := c.Clients(ctx)
	if err != nil || len(got) != 3 || got[0] != (mps.Client{PID: 101, Server: "gpufrac", Namespace: a.Name}) {
		t.Fatalf("clients %+v, %v", got, err)
	}
	// Draining a's container terminates a's clients only.
	left, err := m.Drain(ctx, func(cl mps.Client) bool { return cl.Namespace == a.Name })
	if err != nil || len(left) != 0 {
		t.Fatalf("drain: %v, %v", left, err)
	}
	if got, _ := c.Clients(ctx); len(got) != 1 || got[0].PID != 201 {
		t.Errorf("after draining a: %+v", got)
	}
	// b is deleted once its client goes, within the deadline.
	go func() {
		time.Sleep(300 * time.Millisecond)
		_ = os.WriteFile(clients, nil, 0o644)
	}()
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	// The removal of an earlier container of b's name (a restart) leaves
	// the namespace to the current one.
	if err := m.Ensure(ctx, mps.Namespace{Name: b.Name, Threads: b.Threads, ContainerID: "ctr-2"}); err != nil {
		t.Fatal(err)
	}
	if err := m.Remove(rctx, b.Name, "ctr-1"); err != nil {
		t.Fatal(err)
	}
	if names, _ := c.Namespaces(ctx); !slices.Contains(names, b.Name) {
		t.Fatalf("removing the old container deleted the new one's namespace: %v", names)
	}
	if err := m.Remove(rctx, b.Name, "ctr-2"); err != nil {
		t.Fatal(err)
	}
	if names, _ := c.Namespaces(ctx); !slices.Equal(names, []string{a.Name}) {
		t.Errorf("namespaces %v, want only %s", names, a.Name)
	}
	// A client that never drains: Drain gives up within its context.
	if err := os.WriteFile(clients, []byte("101 gpufrac "+a.Name+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(nodeapi.LogDir(root), "hang-terminate"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	dctx, dcancel := context.WithTimeout(ctx, 3*time.Second)
	defer dcancel()
	start := time.Now()
	left, err = m.Drain(dctx, func(mps.Client) bool { return true })
	if err == nil || !slices.Equal(left, []int{101}) {
		t.Errorf("a hanging terminate: %v, %v; want client 101 reported", left, err)
	}
	// The hung command is killed at the deadline; its reaping takes a moment.
	if time.Since(start) > 3*time.Second+500*time.Millisecond {
		t.Errorf("drain took %s, past its 3s deadline", time.Since(start))
	}
}

// The legacy interface has no namespaces: sm-sharing is refused, not
// silently uncapped.
func TestLegacyDaemonHasNoNamespaces(t *testing.T) {
	root := mpstest.ShortRoot(t)
	c, _ := mpstest.StartDaemon(t, root, 580)
	if c.Protocol != nodeapi.MPSv2 {
		t.Fatalf("r580 protocol %q", c.Protocol)
	}
	st, _ := mps.ReadStatus(root)
	cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(st.PID) + "/cmdline")
	if args := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")[1:]; !slices.Equal(args, []string{"-f"}) {
		t.Errorf("legacy daemon started with %q, want -f only", args)
	}
	if _, err := os.Stat(mps.ConfigPath(root)); err == nil {
		t.Error("a v3 configuration was written for a legacy daemon")
	}
	m, _ := mps.OpenManager(c, filepath.Join(root, "namespaces.json"))
	err := m.Ensure(context.Background(), mps.Namespace{Name: "gf_x_0", Threads: 25})
	if err == nil || !strings.Contains(err.Error(), "needs MPS v3") {
		t.Errorf("a namespace on a legacy daemon: %v", err)
	}
}

func TestCorruptNamespaceTableIsNotDiscarded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "namespaces.json")
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := mps.OpenManager(mps.Control{}, path); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Errorf("corrupt table: %v", err)
	}
}

// A daemon the supervisor did not start already answers on its pipe
// directory (0.1.0's, in the node agent's pod, during an upgrade): the
// supervisor starts no second one over its socket, says why, and starts
// its own once that one has ended.
func TestSupervisorWaitsForAnotherDaemon(t *testing.T) {
	mpstest.Use(t)
	root := mpstest.ShortRoot(t)
	for _, dir := range []string{nodeapi.PipeDir(root), nodeapi.LogDir(root)} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	other := exec.Command(os.Args[0], "-f")
	other.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+nodeapi.PipeDir(root), "CUDA_MPS_LOG_DIRECTORY="+nodeapi.LogDir(root))
	stdin, err := other.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stdin.Close(); _ = other.Wait() })
	c := mps.Control{Binary: os.Args[0], Root: root, Protocol: nodeapi.MPSv2, Timeout: 5 * time.Second}
	waitFor(t, "the other daemon answers", func() bool { return c.Ping(context.Background()) == nil })

	mpstest.StartDaemon(t, root, 580)
	waitFor(t, "the supervisor to say it waits", func() bool {
		why, err := os.ReadFile(mps.WaitingPath(root))
		return err == nil && strings.Contains(string(why), "another MPS control daemon answers")
	})
	if _, err := mps.ReadStatus(root); err == nil {
		t.Error("the waiting supervisor wrote the daemon status, which is the other daemon's supervisor's")
	}
	if starts := readLines(t, filepath.Join(nodeapi.LogDir(root), "starts")); len(starts) != 1 {
		t.Fatalf("%d daemon starts on one pipe directory, want only the other one's: %v", len(starts), starts)
	}
	_ = stdin.Close() // the stand-in ends at stdin's EOF
	waitFor(t, "the supervisor's own daemon", func() bool {
		s, _ := mps.ReadStatus(root)
		return s.Running && s.PID != other.Process.Pid && c.Ping(context.Background()) == nil
	})
	if _, err := os.Stat(mps.WaitingPath(root)); err == nil {
		t.Error("the supervisor still says it waits, with its own daemon running")
	}
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(raw))
}
