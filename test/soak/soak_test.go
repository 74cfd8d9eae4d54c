//go:build soak

// Package soak runs gpufrac's whole stack on a local cluster (gpufrac up's:
// real etcd and kube-apiserver, two webhook replicas, two scheduler
// replicas under leader election, kube-controller-manager, KWOK, one
// simulated node agent per node) under a seeded random workload and random
// faults for SOAK_DURATION, and checks the invariants all along, not only
// at the end (`make soak`, docs/development.md). A failing run prints its
// seed: SOAK_SEED=<seed> replays the same choices.
package soak

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

// settings are a soak's knobs, from the environment.
type settings struct {
	Seed     int64
	Duration time.Duration
	Nodes    int
	// Report, when set, is a file the report is written to as well.
	Report string
}

func readSettings(t *testing.T) settings {
	t.Helper()
	s := settings{Seed: 1, Duration: 3 * time.Minute, Nodes: 4, Report: os.Getenv("SOAK_REPORT")}
	if v := os.Getenv("SOAK_SEED"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("SOAK_SEED %q: must be an integer", v)
		}
		s.Seed = n
	}
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 30*time.Second {
			t.Fatalf("SOAK_DURATION %q: must be a duration of at least 30s (3m, 10m, 1h)", v)
		}
		s.Duration = d
	}
	if v := os.Getenv("SOAK_NODES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 2 || n > 16 {
			t.Fatalf("SOAK_NODES %q: must be a whole number from 2 to 16 (a node is removed and re-added)", v)
		}
		s.Nodes = n
	}
	return s
}

func TestSoak(t *testing.T) {
	cfg := readSettings(t)
	t.Logf("soak: seed %d, %s, %d nodes (replay: make soak SOAK_SEED=%d SOAK_DURATION=%s)", cfg.Seed, cfg.Duration, cfg.Nodes, cfg.Seed, cfg.Duration)
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	// make soak has just built bin/gpufrac; go test alone builds its own.
	bin := os.Getenv("SOAK_BINARY")
	if bin == "" {
		bin = filepath.Join(t.TempDir(), "gpufrac")
		build := exec.Command("go", "build", "-o", bin, "./cmd/gpufrac")
		build.Dir = root
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
	}
	dir := t.TempDir()
	ctx := context.Background()
	c, err := localcluster.Up(ctx, localcluster.Options{
		Dir: dir, Nodes: cfg.Nodes, Binary: bin, Root: root, Progress: io.Discard,
		// The driver with per-cgroup limits: the one backend a resize is
		// applied by.
		Machine:           "dgxh100" + inventory.DriverLimitsSuffix,
		DRAStandingGPUs:   1,
		SchedulerReplicas: 2, WebhookReplicas: 2, APIProxy: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		defer c.Down()
		if t.Failed() {
			for _, name := range c.Components() {
				raw, _ := os.ReadFile(filepath.Join(dir, "logs", name+".log"))
				lines := strings.Split(string(raw), "\n")
				t.Logf("%s log (last lines):\n%s", name, strings.Join(lines[max(len(lines)-20, 0):], "\n"))
			}
		}
	})
	s, err := newSoak(ctx, c, dir, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rep := s.run(ctx, cfg.Duration)
	text := rep.String()
	t.Log("\n" + text)
	if cfg.Report != "" {
		if err := os.WriteFile(cfg.Report, []byte(text), 0o644); err != nil {
			t.Error(err)
		}
	}
	if len(rep.Violations) > 0 {
		t.Fatalf("%d invariant violations (seed %d; replay: make soak SOAK_SEED=%d SOAK_DURATION=%s):\n%s",
			len(rep.Violations), cfg.Seed, cfg.Seed, cfg.Duration, strings.Join(rep.violationLines(), "\n"))
	}
	if !rep.Converged {
		t.Fatalf("the cluster did not converge within %s of the last fault (seed %d): %s", convergeBound, cfg.Seed, rep.Unsettled)
	}
	if rep.Placed == 0 {
		t.Fatal("no pod was placed: the soak measured nothing")
	}
}
