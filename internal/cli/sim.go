package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/gpufrac/gpufrac/pkg/placement"
	"github.com/gpufrac/gpufrac/pkg/sim"
)

type simOptions struct {
	nodes, pods string
	policy      string
	seeds       string
	tune        float64
	tuneSet     bool
	order       string
	json        bool
	out         string
	published   string
	workers     int
	variant     string
	consolidate int
}

func newSimCommand() *cobra.Command {
	o := simOptions{}
	cmd := &cobra.Command{
		Use:   "sim --nodes CSV --pods CSV",
		Short: "Replay a GPU cluster trace with placement policies (the FGD study's protocol)",
		Long: `sim replays a trace of the Alibaba cluster-trace-gpu-v2023 kind on its GPU nodes
with one or all placement policies, as Weng et al. (ATC '23) measure them: the
pods sorted by name and shuffled with each seed, padded to --tune times the GPU
capacity, placed one at a time and never deleted. It reports the GPU allocation
at 100% and 130% of the capacity arrived and the fragmentation at 80%.

With --order given the pods are replayed as the CSV lists them, each once (no
shuffle, no padding to --tune), ties between nodes going to the earlier by
name: the very sequence a live cluster can be given, to pair the two.

Policies: ` + strings.Join(placement.Names, ", ") + ` (default gpufrac), or all.`,
		Example: `  gpufrac sim --nodes openb_node_list_gpu_node.csv --pods openb_pod_list_default.csv
  gpufrac sim --nodes nodes.csv --pods pods.csv --policy all --seeds 42-51 --out results/`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.tuneSet = cmd.Flags().Changed("tune")
			return runSim(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.nodes, "nodes", "", "node CSV (sn, cpu_milli, memory_mib, gpu, model)")
	f.StringVar(&o.pods, "pods", "", "pod CSV (name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec])")
	f.StringVar(&o.policy, "policy", "gpufrac", "placement policy, or all")
	f.StringVar(&o.seeds, "seeds", "42", "seeds: a number, a range such as 42-51, or a comma list")
	f.Float64Var(&o.tune, "tune", 1.3, "workload as a multiple of the GPU capacity")
	f.StringVar(&o.order, "order", "study", "arrival order: study (each seed shuffles and pads the trace) or given (the CSV's order, each pod once)")
	f.BoolVar(&o.json, "json", false, "print one JSON object per (policy, seed) run")
	f.StringVar(&o.out, "out", "", "directory for curves.csv and allocation.png")
	f.StringVar(&o.published, "published", "", "the study's analysis_allo_discrete.csv, drawn for comparison (default: fgd-atc23-expected-results/ beside --pods, when there)")
	f.IntVar(&o.workers, "parallel", runtime.NumCPU(), "runs at once")
	f.IntVar(&o.consolidate, "consolidate", 0, "also run each policy with consolidation: a pod that fits nowhere may have up to this many best-effort pods (qos BE) moved to make room; 0: no consolidation runs")
	f.StringVar(&o.variant, "variant", "", "derive a mix from --pods first, as the study derived its variants: "+variantNames())
	_ = cmd.MarkFlagRequired("nodes")
	_ = cmd.MarkFlagRequired("pods")
	return cmd
}

// simRun is the JSON line of one (policy, seed) run.
type simRun struct {
	Policy      string   `json:"policy"`
	Seed        int64    `json:"seed"`
	Tune        float64  `json:"tune"`
	Order       string   `json:"order"`
	Pods        int      `json:"pods"`
	Unscheduled int      `json:"unscheduled"`
	AllocAt100  *float64 `json:"alloc_at_100"`
	AllocAt130  *float64 `json:"alloc_at_130"`
	FragAt80    *float64 `json:"frag_at_80"`
	// Consolidate is the moves allowed per pending pod (0: none); Moves
	// the pods moved, Consolidated the pods placed thanks to them.
	Consolidate  int     `json:"consolidate"`
	Moves        int     `json:"moves"`
	Consolidated int     `json:"consolidated"`
	Seconds      float64 `json:"seconds"`
}

func runSim(ctx context.Context, stdout, stderr io.Writer, o simOptions) error {
	policies := []string{o.policy}
	if o.policy == "all" {
		policies = placement.Names
	} else if _, err := placement.New(o.policy, nil, placement.StudyCapacity, placement.Supply{}, nil); err != nil {
		return fmt.Errorf("--policy: %w", err)
	}
	seeds, err := sim.ParseSeeds(o.seeds)
	if err != nil {
		return fmt.Errorf("--seeds: %w", err)
	}
	if !(o.tune > 0 && o.tune <= 10) {
		return fmt.Errorf("--tune %v must be above 0 and at most 10", o.tune)
	}
	given := false
	switch o.order {
	case "study":
	case "given":
		given = true
		if o.tuneSet {
			return fmt.Errorf("--tune %v has no effect with --order given: the pods are replayed as listed, each once", o.tune)
		}
	default:
		return fmt.Errorf("--order %q: must be study or given", o.order)
	}
	if o.consolidate < 0 {
		return fmt.Errorf("--consolidate %d must be 0 (no consolidation runs) or more", o.consolidate)
	}
	if o.workers < 1 {
		return fmt.Errorf("--parallel %d must be at least 1", o.workers)
	}
	nodes, err := loadCSV(o.nodes, sim.LoadNodes)
	if err != nil {
		return err
	}
	pods, err := loadCSV(o.pods, sim.LoadPods)
	if err != nil {
		return err
	}
	workload := strings.TrimSuffix(filepath.Base(o.pods), filepath.Ext(o.pods))
	if o.variant != "" {
		v, err := sim.VariantNamed(o.variant)
		if err != nil {
			return fmt.Errorf("--variant: %w", err)
		}
		if pods, err = v.Derive(pods, sim.VariantSeed); err != nil {
			return err
		}
		workload += "+" + v.Name
	}
	published, err := loadPublished(o, workload)
	if err != nil {
		return err
	}

	type job struct {
		i           int
		policy      string
		seed        int64
		consolidate int
	}
	budgets := []int{0}
	if o.consolidate > 0 {
		budgets = append(budgets, o.consolidate)
	}
	var jobs []job
	for _, p := range policies {
		for _, b := range budgets {
			for _, s := range seeds {
				jobs = append(jobs, job{len(jobs), p, s, b})
			}
		}
	}
	results := make([]sim.Result, len(jobs))
	errs := make([]error, len(jobs))
	bar := newProgress(stderr, len(jobs))
	queue := make(chan job)
	var wg sync.WaitGroup
	for range min(o.workers, len(jobs)) {
		wg.Go(func() {
			for j := range queue {
				results[j.i], errs[j.i] = sim.Run(nodes, pods, sim.Config{Policy: j.policy, Seed: j.seed, Tune: o.tune, Given: given, Consolidate: j.consolidate},
					func(done, total int) { bar.update(j.i, done, total) })
			}
		})
	}
	for _, j := range jobs {
		select {
		case queue <- j:
		case <-ctx.Done():
		}
	}
	close(queue)
	wg.Wait()
	bar.finish()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}

	if o.json {
		enc := json.NewEncoder(stdout)
		for _, r := range results {
			c := r.Discrete(sim.MaxArrived)
			_ = enc.Encode(simRun{Policy: r.Policy, Seed: r.Seed, Tune: r.Tune, Order: o.order, Pods: r.Pods, Unscheduled: r.Unscheduled,
				AllocAt100: at(c, c.Alloc, 100), AllocAt130: at(c, c.Alloc, 130), FragAt80: at(c, c.Frag, 80),
				Consolidate: r.Consolidate, Moves: r.Moves, Consolidated: r.Consolidated,
				Seconds: math.Round(r.Elapsed.Seconds()*1000) / 1000})
		}
	} else {
		printSummary(stdout, workload, results, published)
	}
	if o.out != "" {
		if err := writeOutputs(o.out, workload, results, published); err != nil {
			return err
		}
		if !o.json {
			_, _ = fmt.Fprintf(stdout, "wrote %s and %s\n", filepath.Join(o.out, "curves.csv"), filepath.Join(o.out, "allocation.png"))
		}
	}
	return nil
}

func loadCSV[T any](path string, load func(io.Reader, string) ([]T, error)) ([]T, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	return load(f, path)
}

// loadPublished reads the study's figures for this trace, from --published
// or, when not given, from where the trace directory keeps them; no file
// there means no comparison.
func loadPublished(o simOptions, workload string) (sim.Published, error) {
	path := o.published
	if path == "" {
		path = filepath.Join(filepath.Dir(o.pods), "fgd-atc23-expected-results", "analysis_allo_discrete.csv")
		if _, err := os.Stat(path); err != nil {
			return nil, nil
		}
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--published: %w", err)
	}
	defer func() { _ = f.Close() }()
	p, err := sim.LoadPublished(f, workload)
	if err != nil {
		return nil, fmt.Errorf("--published %s: %w", path, err)
	}
	return p, nil
}

func at(c sim.Curve, values []float64, pct int) *float64 {
	v := c.At(values, pct)
	if math.IsNaN(v) {
		return nil
	}
	return &v
}

// printSummary prints each policy's mean over its seeds, and the study's
// published means for the trace when known.
func printSummary(w io.Writer, workload string, results []sim.Result, published sim.Published) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	_, _ = fmt.Fprintf(w, "trace %s, tune %.2f\n", workload, results[0].Tune)
	consolidating := slices.ContainsFunc(results, func(r sim.Result) bool { return r.Consolidate > 0 })
	head := "policy\tseeds\tpods\tunscheduled\talloc@100%\talloc@130%\tfrag@80%\t"
	if consolidating {
		head += "moves\tmoves/1k placed\t"
	}
	_, _ = fmt.Fprintln(tw, head+"s/run\t")
	var order []string
	by := map[string][]sim.Result{}
	for _, r := range results {
		label := r.Policy
		if r.Consolidate > 0 {
			label = fmt.Sprintf("%s+moves≤%d", r.Policy, r.Consolidate)
		}
		if by[label] == nil {
			order = append(order, label)
		}
		by[label] = append(by[label], r)
	}
	for _, p := range order {
		var pods, unsched, a100, a130, f80, secs, moves float64
		for _, r := range by[p] {
			moves += float64(r.Moves)
			c := r.Discrete(sim.MaxArrived)
			pods += float64(r.Pods)
			unsched += float64(r.Unscheduled)
			a100 += c.At(c.Alloc, 100)
			a130 += c.At(c.Alloc, 130)
			f80 += c.At(c.Frag, 80)
			secs += r.Elapsed.Seconds()
		}
		n := float64(len(by[p]))
		row := fmt.Sprintf("%s\t%d\t%.0f\t%.0f\t%.2f\t%.2f\t%.2f\t", p, len(by[p]), pods/n, unsched/n, a100/n, a130/n, f80/n)
		if consolidating {
			row += fmt.Sprintf("%.1f\t%.2f\t", moves/n, moves/(pods-unsched)*1000)
		}
		_, _ = fmt.Fprintf(tw, "%s%.1f\t\n", row, secs/n)
	}
	_ = tw.Flush()
	if fgd := published["06-FGD"]; fgd != nil {
		_, _ = fmt.Fprintf(w, "published FGD (ATC '23, seeds 42-51): alloc@100%% %.2f, alloc@130%% %.2f\n", fgd[100], fgd[130])
	}
}

func writeOutputs(dir, workload string, results []sim.Result, published sim.Published) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	write := func(name string, fill func(io.Writer) error) error {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		if err := fill(f); err != nil {
			_ = f.Close()
			return fmt.Errorf("%s: %w", name, err)
		}
		return f.Close()
	}
	if err := write("curves.csv", func(w io.Writer) error { return sim.WriteCurves(w, results) }); err != nil {
		return err
	}
	return write("allocation.png", func(w io.Writer) error {
		return sim.PlotAllocation(w, fmt.Sprintf("GPU allocation, %s, tune %.2f", workload, results[0].Tune), results, published)
	})
}

// progress draws one bar for all runs on a terminal, once the work has
// taken a couple of seconds; elsewhere it stays quiet.
type progress struct {
	mu    sync.Mutex
	w     io.Writer
	tty   bool
	start time.Time
	last  time.Time
	done  []float64
	drawn bool
}

func newProgress(w io.Writer, runs int) *progress {
	f, ok := w.(*os.File)
	return &progress{w: w, tty: ok && term.IsTerminal(int(f.Fd())), start: time.Now(), done: make([]float64, runs)}
}

func (p *progress) update(run, done, total int) {
	if !p.tty {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done[run] = float64(done) / float64(max(total, 1))
	now := time.Now()
	if now.Sub(p.start) < 2*time.Second || now.Sub(p.last) < 200*time.Millisecond {
		return
	}
	p.last = now
	var sum float64
	for _, d := range p.done {
		sum += d
	}
	frac := sum / float64(len(p.done))
	const width = 40
	filled := int(frac * width)
	_, _ = fmt.Fprintf(p.w, "\r[%s%s] %3.0f%% of %d runs, %s", strings.Repeat("#", filled), strings.Repeat(".", width-filled),
		frac*100, len(p.done), now.Sub(p.start).Round(time.Second))
	p.drawn = true
}

func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		_, _ = fmt.Fprintln(p.w)
	}
}

func variantNames() string {
	names := make([]string, len(sim.Variants))
	for i, v := range sim.Variants {
		names[i] = v.Name
	}
	return strings.Join(names, ", ")
}
