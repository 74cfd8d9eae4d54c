package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/placement"
	"github.com/gpufrac/gpufrac/pkg/sim"
)

type replayOptions struct {
	nodes, pods string
	model       string
	count       int
	seeds       string
	policies    string
	tune        float64
	gpuMemory   int64
	out         string
	simOnly     bool
}

func newReplayCommand() *cobra.Command {
	o := replayOptions{}
	cmd := &cobra.Command{
		Use:   "replay --nodes CSV --pods CSV",
		Short: "Place a trace slice with the live scheduler and the simulator, paired, and compare them",
		Long: `replay measures whether a placement policy does in the real kube-scheduler what
it does in gpufrac sim. For each seed it cuts a slice of the trace (the first
--count nodes of --model, and that seed's workload of the pods that may run
there, shuffled and padded to --tune times the slice's GPUs) and, for each
policy:

  - simulates it in the given order (gpufrac sim --order given);
  - starts a local cluster (gpufrac up) whose nodes are the slice's (CPU,
    memory, GPUs, model; each GPU --gpu-memory MiB), with the scheduler on
    that policy, creates every pod held by a scheduling gate, releases them
    one at a time in the same order and waits for each decision;
  - books the live decisions on the simulator's ledgers and reports them
    exactly as the simulator reports its own.

It prints, per run and on average, the GPU allocation at 130% arrived, live
and simulated, and the share of pods the two placed on the same node. The
slices (nodes.csv, pods.csv per seed), one JSON line per run (runs.jsonl) and
the clusters' logs are kept under --out.`,
		Example: `  T=traces/alibaba-gpu-v2023
  gpufrac replay --nodes $T/openb_node_list_gpu_node.csv --pods $T/openb_pod_list_default.csv \
      --model G2 --count 32 --seeds 42-46 --policy gpufrac,fgd --out _output/replay`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runReplay(cmd, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.nodes, "nodes", "", "the trace's node CSV (sn, cpu_milli, memory_mib, gpu, model)")
	f.StringVar(&o.pods, "pods", "", "the trace's pod CSV (name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec])")
	f.StringVar(&o.model, "model", "G2", "the GPU model of the slice's nodes")
	f.IntVar(&o.count, "count", 32, "nodes in the slice (1-100: each is a node agent on this machine)")
	f.StringVar(&o.seeds, "seeds", "42-46", "seeds: a number, a range such as 42-46, or a comma list")
	f.StringVar(&o.policies, "policy", "gpufrac,fgd", "placement policies, comma-separated")
	f.Float64Var(&o.tune, "tune", 1.3, "workload as a multiple of the slice's GPU capacity")
	f.Int64Var(&o.gpuMemory, "gpu-memory", 32000, "MiB of each simulated GPU: a multiple of 1000, so that a trace's milli-GPU share is a whole number of MiB")
	f.StringVar(&o.out, "out", "_output/replay", "directory for the slices, runs.jsonl and the clusters' logs")
	f.BoolVar(&o.simOnly, "sim-only", false, "only simulate the slices (no cluster): to check them quickly")
	_ = cmd.MarkFlagRequired("nodes")
	_ = cmd.MarkFlagRequired("pods")
	return cmd
}

// replayRun is the JSON line of one (seed, policy) pair.
type replayRun struct {
	Seed       int64    `json:"seed"`
	Policy     string   `json:"policy"`
	Pods       int      `json:"pods"`
	SimAlloc   *float64 `json:"sim_alloc_at_130"`
	LiveAlloc  *float64 `json:"live_alloc_at_130,omitempty"`
	SimUnsched int      `json:"sim_unscheduled"`
	LiveUnsch  int      `json:"live_unscheduled"`
	SameNode   float64  `json:"same_node"`
	// FirstDiff is the index of the first pod the two placed on different
	// nodes (-1: none); after it their clusters differ.
	FirstDiff int     `json:"first_difference"`
	LiveSecs  float64 `json:"live_seconds,omitempty"`
}

func runReplay(cmd *cobra.Command, o replayOptions) error {
	policies := strings.Split(o.policies, ",")
	for _, p := range policies {
		if _, err := placement.New(p, nil, placement.StudyCapacity, placement.Supply{}, nil); err != nil || p == "random" {
			return fmt.Errorf("--policy %q: must be policies the scheduler runs, comma-separated: %s", p, strings.Join(placement.Names[:len(placement.Names)-1], ", "))
		}
	}
	seeds, err := sim.ParseSeeds(o.seeds)
	if err != nil {
		return fmt.Errorf("--seeds: %w", err)
	}
	switch {
	case o.count < 1 || o.count > 100:
		return fmt.Errorf("--count %d must be between 1 and 100", o.count)
	case !(o.tune > 0 && o.tune <= 10):
		return fmt.Errorf("--tune %v must be above 0 and at most 10", o.tune)
	case o.gpuMemory < 1000 || o.gpuMemory%1000 != 0:
		return fmt.Errorf("--gpu-memory %d must be a positive multiple of 1000 MiB, so that every milli-GPU share is a whole number of MiB", o.gpuMemory)
	}
	nodes, err := loadCSV(o.nodes, sim.LoadNodes)
	if err != nil {
		return err
	}
	pods, err := loadCSV(o.pods, sim.LoadPods)
	if err != nil {
		return err
	}
	var root, self string
	if !o.simOnly {
		if root, err = checkout.Root(); err != nil {
			return fmt.Errorf("gpufrac replay runs from a gpufrac checkout (it runs gpufrac up, which uses deploy/ and bin/): %w", err)
		}
		if self, err = os.Executable(); err != nil {
			return err
		}
		signal.Ignore(syscall.SIGPIPE, syscall.SIGHUP)
	}
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	jsonl, err := os.Create(filepath.Join(o.out, "runs.jsonl"))
	if err != nil {
		return err
	}
	defer func() { _ = jsonl.Close() }()
	out := cmd.OutOrStdout()
	var runs []replayRun
	for _, seed := range seeds {
		slice, workload, err := sim.Slice(nodes, pods, o.model, o.count, seed, o.tune)
		if err != nil {
			return fmt.Errorf("--model %s --count %d: %w", o.model, o.count, err)
		}
		dir := filepath.Join(o.out, fmt.Sprintf("seed-%d", seed))
		if err := writeSlice(dir, slice, workload); err != nil {
			return err
		}
		for _, policy := range policies {
			simRes, err := sim.Run(slice, workload, sim.Config{Policy: policy, Seed: seed, Given: true}, nil)
			if err != nil {
				return err
			}
			run := replayRun{Seed: seed, Policy: policy, Pods: len(workload), SimUnsched: simRes.Unscheduled}
			run.SimAlloc = allocAt130(simRes)
			if !o.simOnly {
				fmt.Fprintf(out, "seed %d, %s: %d pods on %d %s nodes, live …\n", seed, policy, len(workload), len(slice), o.model)
				live, err := replayLive(cmd, o, root, self, filepath.Join(dir, policy), slice, workload, policy)
				if err != nil {
					return fmt.Errorf("seed %d, policy %s: %w", seed, policy, err)
				}
				run.LiveAlloc, run.LiveUnsch, run.LiveSecs = allocAt130(live), live.Unscheduled, live.Elapsed.Seconds()
				same := 0
				run.FirstDiff = -1
				for i := range live.Placed {
					if live.Placed[i].Node == simRes.Placed[i].Node {
						same++
					} else if run.FirstDiff < 0 {
						run.FirstDiff = i
					}
				}
				run.SameNode = float64(same) / float64(len(workload))
			}
			runs = append(runs, run)
			line, _ := json.Marshal(run)
			if _, err := fmt.Fprintln(jsonl, string(line)); err != nil {
				return err
			}
		}
	}
	printReplay(out, o, runs, policies)
	return nil
}

func writeSlice(dir string, nodes []sim.NodeSpec, pods []sim.PodSpec) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for name, write := range map[string]func(io.Writer) error{
		"nodes.csv": func(w io.Writer) error { return sim.WriteNodes(w, nodes) },
		"pods.csv":  func(w io.Writer) error { return sim.WritePods(w, pods) },
	} {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		if err := write(f); err != nil {
			_ = f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	return nil
}

// replayLive runs one live replay on a fresh local cluster.
func replayLive(cmd *cobra.Command, o replayOptions, root, self, dir string, slice []sim.NodeSpec, workload []sim.PodSpec, policy string) (sim.Result, error) {
	shapes := make([]localcluster.NodeShape, len(slice))
	for i, n := range slice {
		shapes[i] = localcluster.NodeShape{Name: n.Name, CPUMilli: n.CPUMilli, MemoryMiB: n.MemoryMiB, Pods: 1000,
			Machine: fmt.Sprintf("%dx%s@%dMi", n.GPUs, n.Model, o.gpuMemory)}
	}
	if err := os.RemoveAll(dir); err != nil {
		return sim.Result{}, err
	}
	cluster, err := localcluster.Up(cmd.Context(), localcluster.Options{Dir: dir, Shapes: shapes, Policy: policy, Binary: self, Root: root, Progress: io.Discard})
	if err != nil {
		return sim.Result{}, err
	}
	defer func() {
		if err := cluster.Shutdown(); err != nil {
			fmt.Fprintf(cmd.ErrOrStderr(), "gpufrac replay: %v; run gpufrac down --dir %s\n", err, dir)
		}
	}()
	start := time.Now()
	placed, err := cluster.Replay(cmd.Context(), workload, nil)
	if err != nil {
		return sim.Result{}, err
	}
	res, err := sim.Replayed(slice, workload, placed, policy, time.Since(start))
	if err != nil {
		return sim.Result{}, err
	}
	res.Placed = placed
	return res, nil
}

func allocAt130(r sim.Result) *float64 {
	c := r.Discrete(sim.MaxArrived)
	return at(c, c.Alloc, 130)
}

func printReplay(w io.Writer, o replayOptions, runs []replayRun, policies []string) {
	_, _ = fmt.Fprintf(w, "\n%d %s nodes, tune %.2f: GPU allocation (%%) at 130%% arrived\n", o.count, o.model, o.tune)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	_, _ = fmt.Fprintln(tw, "seed\tpolicy\tpods\tsim\tlive\tlive−sim\tsame node\tfirst difference\tlive s\t")
	f := func(v *float64) string {
		if v == nil {
			return "–"
		}
		return fmt.Sprintf("%.2f", *v)
	}
	for _, r := range runs {
		diff := "–"
		if r.LiveAlloc != nil && r.SimAlloc != nil {
			diff = fmt.Sprintf("%+.2f", *r.LiveAlloc-*r.SimAlloc)
		}
		first := "–"
		if r.FirstDiff >= 0 {
			first = fmt.Sprintf("pod %d", r.FirstDiff)
		}
		_, _ = fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\t%s\t%.0f%%\t%s\t%.0f\t\n", r.Seed, r.Policy, r.Pods, f(r.SimAlloc), f(r.LiveAlloc), diff, r.SameNode*100, first, r.LiveSecs)
	}
	for _, p := range policies {
		var simSum, liveSum, same float64
		var n, live int
		for _, r := range runs {
			if r.Policy != p || r.SimAlloc == nil {
				continue
			}
			n++
			simSum += *r.SimAlloc
			same += r.SameNode
			if r.LiveAlloc != nil {
				live++
				liveSum += *r.LiveAlloc
			}
		}
		if n == 0 {
			continue
		}
		liveMean, diff := "–", "–"
		if live == n {
			liveMean = fmt.Sprintf("%.2f", liveSum/float64(n))
			diff = fmt.Sprintf("%+.2f", (liveSum-simSum)/float64(n))
		}
		_, _ = fmt.Fprintf(tw, "mean\t%s\t\t%.2f\t%s\t%s\t%.0f%%\t\t\t\n", p, simSum/float64(n), liveMean, diff, same/float64(n)*100)
	}
	_ = tw.Flush()
}
