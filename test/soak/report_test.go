//go:build soak

package soak

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// report is what a soak did and found.
type report struct {
	Seed          int64
	Duration      time.Duration
	Nodes         int
	Ops, OpErrs   map[string]int
	Faults        map[string]int
	FaultLog      []fault
	SelfExits     map[string]int
	Pods, Placed  int
	P50, P99, Max time.Duration
	Converged     bool
	ConvergeAfter time.Duration
	Unsettled     string
	Violations    []violation
	start         time.Time
}

// fill copies what the soak saw into the report.
func (s *soak) fill(r *report) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r.start = s.start
	r.Ops, r.OpErrs, r.SelfExits = maps.Clone(s.ops), maps.Clone(s.opErrs), maps.Clone(s.selfExits)
	r.Faults = map[string]int{}
	for _, f := range s.faults {
		r.Faults[f.Kind]++
	}
	r.FaultLog = slices.Clone(s.faults)
	r.Pods = len(s.pods)
	times := slices.Clone(s.placeTimes)
	slices.Sort(times)
	r.Placed = len(times)
	if len(times) > 0 {
		r.P50, r.P99, r.Max = times[len(times)*50/100], times[min(len(times)*99/100, len(times)-1)], times[len(times)-1]
	}
	r.Violations = slices.Clone(s.violations)
}

func counts(m map[string]int) string {
	var parts []string
	total := 0
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
		total += m[k]
	}
	return fmt.Sprintf("%d (%s)", total, strings.Join(parts, ", "))
}

func (r report) violationLines() []string {
	var out []string
	for _, v := range r.Violations {
		out = append(out, fmt.Sprintf("  +%s %s [after: %s]", v.At.Sub(r.start).Round(time.Second), v.What, strings.Join(v.Recent, "; ")))
	}
	return out
}

// String is the report as the closing note and docs/soak.md quote it.
func (r report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "soak report: seed %d, %s of load and faults, %d nodes x 8 simulated H100 (driver limits), 2 scheduler and 2 webhook replicas\n", r.Seed, r.Duration, r.Nodes)
	fmt.Fprintf(&b, "operations:  %s\n", counts(r.Ops))
	fmt.Fprintf(&b, "  refused or failed (API server, etcd or a webhook down: the client's error, retried by the next draw): %s\n", counts(r.OpErrs))
	fmt.Fprintf(&b, "faults:      %s\n", counts(r.Faults))
	fmt.Fprintf(&b, "  exited on their own and started again: %s\n", counts(r.SelfExits))
	fmt.Fprintf(&b, "pods seen:   %d; placed %d; time to place p50 %s, p99 %s, max %s (from first seen to bound, faults included)\n",
		r.Pods, r.Placed, r.P50.Round(time.Millisecond), r.P99.Round(time.Millisecond), r.Max.Round(time.Millisecond))
	if r.Converged {
		fmt.Fprintf(&b, "converged:   %s after the last fault ended\n", r.ConvergeAfter.Round(time.Second))
	} else {
		fmt.Fprintf(&b, "converged:   NO, after %s: %s\n", r.ConvergeAfter.Round(time.Second), r.Unsettled)
	}
	fmt.Fprintf(&b, "violations:  %d\n", len(r.Violations))
	for _, l := range r.violationLines() {
		fmt.Fprintln(&b, l)
	}
	fmt.Fprintln(&b, "fault log:")
	for _, f := range r.FaultLog {
		fmt.Fprintf(&b, "  +%-6s %-24s %s\n", f.At.Sub(r.start).Round(time.Second), f.Kind, f.Detail)
	}
	return b.String()
}
