package sim

import (
	"encoding/csv"
	"fmt"
	"io"
	"math/rand"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpufrac/gpufrac/pkg/ledgers"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// Slice cuts a trace down to what a live cluster on this machine can
// replay: the first count nodes of model (by name), and one seed's
// workload of the pods that may run there (a GPU spec that allows model,
// or none; CPU, memory and GPUs that some node of the slice has), shuffled
// and padded or thinned to tune × the slice's GPUs as Run prepares a
// seed's workload. The GPU spec is dropped (every node of the slice has
// that model) and each pod is renamed p<index>-<name>, since padding
// repeats pods and a cluster needs distinct names.
func Slice(nodes []NodeSpec, pods []PodSpec, model string, count int, seed int64, tune float64) ([]NodeSpec, []PodSpec, error) {
	var slice []NodeSpec
	for _, n := range nodes {
		if n.Model == model && n.GPUs > 0 {
			slice = append(slice, n)
		}
	}
	if len(slice) < count {
		return nil, nil, fmt.Errorf("the node list has %d GPU nodes of model %q, %d asked", len(slice), model, count)
	}
	slices.SortStableFunc(slice, func(a, b NodeSpec) int { return strings.Compare(a.Name, b.Name) })
	slice = slice[:count]
	fits := func(p PodSpec) bool {
		if len(p.GPUSpec) > 0 && !slices.Contains(p.GPUSpec, model) {
			return false
		}
		return slices.ContainsFunc(slice, func(n NodeSpec) bool {
			return p.CPUMilli <= n.CPUMilli && p.MemoryMiB <= n.MemoryMiB && p.NumGPU <= n.GPUs
		})
	}
	var eligible []PodSpec
	for _, p := range pods {
		if fits(p) {
			p.GPUSpec = nil
			eligible = append(eligible, p)
		}
	}
	if len(eligible) == 0 {
		return nil, nil, fmt.Errorf("no pod of the trace may run on its %s nodes", model)
	}
	var capacity int64
	for _, n := range slice {
		capacity += int64(n.GPUs) * MilliGPU
	}
	rng := rand.New(rand.NewSource(seed))
	rng.Int() // drawn in the study's order, as Run draws
	workload := Workload(eligible, rng, tune, capacity)
	for i := range workload {
		workload[i].Name = fmt.Sprintf("p%05d-%s", i, workload[i].Name)
	}
	return slice, workload, nil
}

// WriteNodes writes nodes as a node CSV that LoadNodes reads.
func WriteNodes(w io.Writer, nodes []NodeSpec) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"sn", "cpu_milli", "memory_mib", "gpu", "model"})
	for _, n := range nodes {
		_ = cw.Write([]string{n.Name, i64(n.CPUMilli), i64(n.MemoryMiB), strconv.Itoa(n.GPUs), n.Model})
	}
	cw.Flush()
	return cw.Error()
}

// WritePods writes pods as a pod CSV that LoadPods reads.
func WritePods(w io.Writer, pods []PodSpec) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"})
	for _, p := range pods {
		_ = cw.Write([]string{p.Name, i64(p.CPUMilli), i64(p.MemoryMiB), strconv.Itoa(p.NumGPU), i64(p.GPUMilli), strings.Join(p.GPUSpec, "|")})
	}
	cw.Flush()
	return cw.Error()
}

func i64(v int64) string { return strconv.FormatInt(v, 10) }

// Placement is where a live scheduler put one pod of a replay: its node
// ("" when it placed it nowhere) and, for a share, the GPU group the
// share joined (pods of one group share one GPU).
type Placement struct {
	Node  string
	Group string
}

// Replayed turns a live replay of pods (in their given order) into the
// Result a Given run of the simulator reports for the same pods: each
// placed pod is booked on the simulator's ledger of its node, whole GPUs
// on idle ones and a share on its group's GPU, and the cluster is sampled
// after each pod with the simulator's own fragmentation measure. Groups
// are booked as the scheduler and audit book them (ledgers.Layout, slots
// named by GPU group over the simulator's node). GPUs of a node are alike,
// so which idle GPU a new group or a whole-GPU pod takes changes no
// figure. A placement the ledger refuses means the live scheduler
// over-committed a node: it is an error.
func Replayed(nodeSpecs []NodeSpec, pods []PodSpec, placed []Placement, policy string, elapsed time.Duration) (Result, error) {
	if len(placed) != len(pods) {
		return Result{}, fmt.Errorf("%d placements for %d pods", len(placed), len(pods))
	}
	nodes := Cluster(nodeSpecs)
	byName := map[string]int{}
	var capacity int64
	for i, n := range nodes {
		byName[n.Name] = i
		capacity += int64(len(n.Devices)) * MilliGPU
	}
	keys := make([]placement.Key, len(pods))
	for i, p := range pods {
		keys[i] = p.Shape()
	}
	s := newState(nodes, nil, placement.Popular(keys, Coverage))
	layouts := make([]ledgers.Layout, len(nodes))
	for i, n := range nodes {
		layouts[i] = ledgers.Layout{Ledger: n, Groups: map[string]int{}, Conflicts: map[string]string{}}
	}
	res := Result{Policy: policy, Given: true, Pods: len(pods), CapacityMilli: capacity, Samples: make([]Sample, 0, len(pods)), Elapsed: elapsed}
	var arrived, alloc int64
	for i, p := range pods {
		arrived += p.GPURequest()
		pl := placed[i]
		if pl.Node == "" {
			res.Unscheduled++
			res.Samples = append(res.Samples, Sample{ArrivedMilli: arrived, AllocMilli: alloc, Frag: s.frag})
			continue
		}
		ni, ok := byName[pl.Node]
		if !ok {
			return Result{}, fmt.Errorf("pod %s: placed on node %s, which is not a GPU node of the list", p.Name, pl.Node)
		}
		r := p.Request(fmt.Sprintf("%s#%d", p.Name, i))
		if _, unfit := nodes[ni].Fit(r); unfit != nil {
			return Result{}, fmt.Errorf("pod %s: placed on node %s, which cannot take it: %w", p.Name, pl.Node, unfit)
		}
		t := ledgers.Tenant{Request: r}
		if r.Devices > 0 {
			if pl.Group == "" {
				return Result{}, fmt.Errorf("pod %s: a share placed on node %s without a GPU group", p.Name, pl.Node)
			}
			t.Groups = strings.Split(pl.Group, ",")
		}
		l := &layouts[ni]
		if l.Place(t, func(string) bool { return false }); l.Conflicts[r.Tenant] != "" {
			return Result{}, fmt.Errorf("pod %s: placed on node %s where the ledger refuses it (the live scheduler over-committed a GPU): %s", p.Name, pl.Node, l.Conflicts[r.Tenant])
		}
		s.changed(ni)
		alloc += p.GPURequest()
		res.Samples = append(res.Samples, Sample{ArrivedMilli: arrived, AllocMilli: alloc, Frag: s.frag})
	}
	return res, nil
}
