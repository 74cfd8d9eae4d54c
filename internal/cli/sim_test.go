package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSimJSONRunsPerPolicyAndSeed(t *testing.T) {
	out, errOut, code := runCLI(t, "", "sim", "--nodes", "testdata/trace/nodes.csv", "--pods", "testdata/trace/pods.csv",
		"--policy", "all", "--seeds", "1-2", "--json")
	if code != 0 || errOut != "" {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 6*2 {
		t.Fatalf("%d JSON lines, want 12 (6 policies × 2 seeds):\n%s", len(lines), out)
	}
	seen := map[string]bool{}
	for _, l := range lines {
		var r map[string]any
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		for _, k := range []string{"policy", "seed", "tune", "pods", "unscheduled", "alloc_at_100", "alloc_at_130", "frag_at_80", "seconds"} {
			if _, ok := r[k]; !ok {
				t.Errorf("%q has no %s", l, k)
			}
		}
		if r["tune"].(float64) != 1.3 || r["pods"].(float64) < 6 {
			t.Errorf("run %v: want tune 1.3 and the 6 pods padded", r)
		}
		seen[r["policy"].(string)] = true
	}
	if len(seen) != 6 {
		t.Errorf("policies = %v", seen)
	}
}

// --order given replays the CSV's 6 pods once each, with no tune.
func TestSimGivenOrder(t *testing.T) {
	out, errOut, code := runCLI(t, "", "sim", "--nodes", "testdata/trace/nodes.csv", "--pods", "testdata/trace/pods.csv",
		"--policy", "bestfit", "--order", "given", "--json")
	if code != 0 || errOut != "" {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	var r map[string]any
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &r); err != nil {
		t.Fatalf("%q: %v", out, err)
	}
	if r["order"] != "given" || r["pods"].(float64) != 6 || r["tune"].(float64) != 0 {
		t.Errorf("run %v: want order given, the 6 listed pods, tune 0", r)
	}
}

func TestSimSummaryAndOutputs(t *testing.T) {
	dir := t.TempDir()
	out, _, code := runCLI(t, "", "sim", "--nodes", "testdata/trace/nodes.csv", "--pods", "testdata/trace/pods.csv", "--out", dir)
	if code != 0 || !strings.Contains(out, "gpufrac") || !strings.Contains(out, "alloc@130%") {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	csv, err := os.ReadFile(filepath.Join(dir, "curves.csv"))
	if err != nil || !strings.HasPrefix(string(csv), "policy,seed,arrived_pct,alloc_pct,frag_amount_pct,frag_rate_pct\ngpufrac,42,") {
		t.Errorf("curves.csv: %v\n%.200s", err, csv)
	}
	png, err := os.ReadFile(filepath.Join(dir, "allocation.png"))
	if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
		t.Errorf("allocation.png: %v, %d bytes", err, len(png))
	}
}

func TestSimBadFlagsSayWhatIsWrong(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--policy", "tetris"}, `--policy: policy "tetris" is not known: use one of gpufrac, fgd, bestfit, gpupacking, dotprod, random`},
		{[]string{"--seeds", "9-3"}, `--seeds: seeds "9-3": "9-3" must be a whole number or a range low-high`},
		{[]string{"--tune", "0"}, "--tune 0 must be above 0 and at most 10"},
		{[]string{"--order", "random"}, `--order "random": must be study or given`},
		{[]string{"--order", "given", "--tune", "2"}, "--tune 2 has no effect with --order given"},
		{[]string{"--pods", "testdata/trace/missing.csv"}, "testdata/trace/missing.csv: no such file"},
		{[]string{"--pods", "testdata/trace/nodes.csv"}, `no "name" column`},
	} {
		args := append([]string{"sim", "--nodes", "testdata/trace/nodes.csv", "--pods", "testdata/trace/pods.csv"}, c.args...)
		cmd := NewRootCommand()
		cmd.SetArgs(args)
		cmd.SetOut(&bytes.Buffer{})
		cmd.SetErr(&bytes.Buffer{})
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: err = %v, want %q", c.args, err, c.want)
		}
	}
}
