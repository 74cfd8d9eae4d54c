package mps

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
)

func TestMain(m *testing.M) {
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:]))
	}
	os.Exit(m.Run())
}

func newSupervisor(t *testing.T, root string) *Supervisor {
	t.Helper()
	mpstest.Use(t)
	s := New(os.Args[0], root)
	s.CommandTimeout, s.MinBackoff, s.MaxBackoff = 2*time.Second, 20*time.Millisecond, 100*time.Millisecond
	return s
}

func starts(t *testing.T, root, key string) int {
	t.Helper()
	data, _ := os.ReadFile(filepath.Join(root, key, "log", "starts"))
	return strings.Count(string(data), "\n")
}

func poll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	}); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func TestNamespacePerContainerWithItsCeiling(t *testing.T) {
	root := t.TempDir()
	s := newSupervisor(t, root)
	ctx := context.Background()
	a, b := Key("uid-a", "main"), Key("uid-b", "llm.v2")
	if err := s.Ensure(ctx, a, 25); err != nil {
		t.Fatal(err)
	}
	if err := s.Ensure(ctx, b, 50); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{a: "25", b: "50"} {
		if got, _ := os.ReadFile(filepath.Join(PipeDir(root, key), "threads")); string(got) != want {
			t.Errorf("namespace %s ceiling = %q, want %q", key, got, want)
		}
	}
	// Ensure is idempotent: no second daemon.
	if err := s.Ensure(ctx, a, 25); err != nil || starts(t, root, a) != 1 {
		t.Errorf("second Ensure: %v, %d starts", err, starts(t, root, a))
	}
	if got := s.Keys(); len(got) != 2 {
		t.Errorf("keys = %v", got)
	}

	commands, _ := os.ReadFile(filepath.Join(root, a, "log", "commands"))
	if !strings.Contains(string(commands), "get_server_list\nset_default_active_thread_percentage 25\n") {
		t.Errorf("daemon of %s received:\n%s", a, commands)
	}

	// Stopping one container drains its daemon only.
	if err := s.Stop(ctx, a, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, a)); !os.IsNotExist(err) {
		t.Errorf("namespace directory left behind: %v", err)
	}
	if _, err := s.Command(ctx, b, "get_server_list"); err != nil {
		t.Errorf("the other namespace stopped answering: %v", err)
	}
	if err := s.Stop(ctx, b, 2*time.Second); err != nil {
		t.Fatal(err)
	}
}

// Stopping a container drains its MPS clients: each client of each server
// is terminated (then the daemon is told to quit).
func TestDrainOrder(t *testing.T) {
	root := t.TempDir()
	s := newSupervisor(t, root)
	ctx := context.Background()
	key := Key("uid-b", "main")
	if err := s.Ensure(ctx, key, 50); err != nil {
		t.Fatal(err)
	}
	pipe := PipeDir(root, key)
	for name, content := range map[string]string{"servers": "4242\n", "clients": "100\n101\n"} {
		if err := os.WriteFile(filepath.Join(pipe, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	drainCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	s.terminateClients(drainCtx, key)
	commands, _ := os.ReadFile(filepath.Join(root, key, "log", "commands"))
	want := "get_server_list\nget_client_list 4242\nterminate 4242 100\nterminate 4242 101\n"
	if !strings.HasSuffix(string(commands), want) {
		t.Errorf("commands:\n%s\nwant them to end with:\n%s", commands, want)
	}
	if err := s.Stop(ctx, key, 3*time.Second); err != nil {
		t.Fatal(err)
	}
}

func TestDaemonThatDiesIsRestartedWithItsCeiling(t *testing.T) {
	root := t.TempDir()
	s := newSupervisor(t, root)
	ctx := context.Background()
	key := Key("uid-a", "main")
	if err := s.Ensure(ctx, key, 30); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Stop(ctx, key, time.Second) }()
	_ = os.Remove(filepath.Join(PipeDir(root, key), "threads"))
	kill(s.PID(key))
	poll(t, "restart", func() bool { return starts(t, root, key) == 2 })
	poll(t, "ceiling set again", func() bool {
		got, _ := os.ReadFile(filepath.Join(PipeDir(root, key), "threads"))
		return string(got) == "30"
	})
}

func TestWedgedDaemonIsRecoveredWithoutTouchingOthers(t *testing.T) {
	root := t.TempDir()
	s := newSupervisor(t, root)
	ctx := context.Background()
	wedged, healthy := Key("uid-a", "main"), Key("uid-b", "main")
	for _, k := range []string{wedged, healthy} {
		if err := s.Ensure(ctx, k, 40); err != nil {
			t.Fatal(err)
		}
		defer func(k string) { _ = s.Stop(ctx, k, time.Second) }(k)
	}
	if err := os.WriteFile(filepath.Join(PipeDir(root, wedged), "wedged"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	recovered := s.Check(ctx)
	if len(recovered) != 1 || recovered[0] != wedged {
		t.Fatalf("recovered %v, want only %s", recovered, wedged)
	}
	_ = os.Remove(filepath.Join(PipeDir(root, wedged), "wedged"))
	poll(t, "wedged daemon restarted", func() bool { return starts(t, root, wedged) == 2 })
	if starts(t, root, healthy) != 1 {
		t.Errorf("healthy namespace restarted %d times", starts(t, root, healthy)-1)
	}
}

func TestStopNeverWaitsPastItsDeadline(t *testing.T) {
	root := t.TempDir()
	s := newSupervisor(t, root)
	ctx := context.Background()
	key := Key("uid-a", "main")
	if err := s.Ensure(ctx, key, 10); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(PipeDir(root, key), "wedged"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_ = s.Stop(ctx, key, 300*time.Millisecond)
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("Stop took %s with a 300ms deadline", took)
	}
	if len(s.Keys()) != 0 {
		t.Errorf("keys after stop: %v", s.Keys())
	}
}

func TestRecoverAfterAgentRestart(t *testing.T) {
	root := t.TempDir()
	first := newSupervisor(t, root)
	ctx := context.Background()
	live, gone := Key("uid-a", "main"), Key("uid-b", "main")
	for _, k := range []string{live, gone} {
		if err := first.Ensure(ctx, k, 20); err != nil {
			t.Fatal(err)
		}
	}
	livePID, gonePID := first.PID(live), first.PID(gone)
	// The agent stops (its daemons keep serving their tenants) and a new
	// agent starts over the same state.
	first.Close()
	second := newSupervisor(t, root)
	if err := second.Recover(ctx, func(k string) bool { return k == live }); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = second.Stop(ctx, live, time.Second) }()
	if got := second.Keys(); len(got) != 1 || got[0] != live {
		t.Fatalf("recovered namespaces %v, want [%s]", got, live)
	}
	if second.PID(live) != livePID {
		t.Errorf("the running daemon (pid %d) was replaced by %d: its tenants lost MPS", livePID, second.PID(live))
	}
	poll(t, "daemon of the vanished container killed", func() bool { return !isMPS(gonePID, os.Args[0]) })
	if _, err := os.Stat(filepath.Join(root, gone)); !os.IsNotExist(err) {
		t.Errorf("namespace of a vanished container kept: %v", err)
	}

	// The adopted daemon wedges: the new agent replaces it with one it owns.
	if err := os.WriteFile(filepath.Join(PipeDir(root, live), "wedged"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := second.Check(ctx); len(got) != 1 {
		t.Fatalf("Check recovered %v", got)
	}
	_ = os.Remove(filepath.Join(PipeDir(root, live), "wedged"))
	poll(t, "replacement answers", func() bool {
		_, err := second.Command(ctx, live, "get_server_list")
		return err == nil && second.PID(live) != livePID
	})
}
