// Package sim holds the trace-driven placement experiments of SPEC §4 (the
// protocol of Weng et al., ATC '23, on Alibaba's cluster-trace-gpu-v2023):
// reading the node and pod CSVs, preparing a seed's workload, the popular
// task shapes and the fragmentation metric. Placement decisions are made
// on the same pkg/gpu ledgers the scheduler uses, with GPUs measured in
// milli-GPU.
package sim

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"slices"
	"strconv"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/gpu"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// MilliGPU is one whole GPU in the trace's unit.
const MilliGPU = 1000

// NodeSpec is one row of openb_node_list_*.csv.
type NodeSpec struct {
	Name      string
	CPUMilli  int64
	MemoryMiB int64
	GPUs      int
	Model     string
}

// PodSpec is one row of openb_pod_list_*.csv.
type PodSpec struct {
	Name      string
	CPUMilli  int64
	MemoryMiB int64
	NumGPU    int
	GPUMilli  int64
	// GPUSpec lists the allowed GPU models; empty allows any.
	GPUSpec []string
	// Movable says that consolidation may move the pod (its controller
	// makes it again elsewhere): the trace's best-effort pods (qos BE),
	// the batch work a platform lets the scheduler restart.
	Movable bool
}

// GPURequest is the pod's GPU demand in milli-GPU.
func (p PodSpec) GPURequest() int64 {
	if p.NumGPU == 1 && p.GPUMilli < MilliGPU {
		return p.GPUMilli
	}
	return int64(p.NumGPU) * MilliGPU
}

// Shares reports whether the pod takes part of one GPU.
func (p PodSpec) Shares() bool { return p.NumGPU == 1 && p.GPUMilli > 0 && p.GPUMilli < MilliGPU }

// LoadNodes reads a node CSV (sn, cpu_milli, memory_mib, gpu, model).
func LoadNodes(r io.Reader, file string) ([]NodeSpec, error) {
	rows, col, err := readCSV(r, file, "sn", "cpu_milli", "memory_mib", "gpu", "model")
	if err != nil {
		return nil, err
	}
	var nodes []NodeSpec
	for i, row := range rows {
		n := NodeSpec{Name: row[col["sn"]], Model: row[col["model"]]}
		var errs []error
		n.CPUMilli, errs = parseInt(row[col["cpu_milli"]], "cpu_milli", errs)
		n.MemoryMiB, errs = parseInt(row[col["memory_mib"]], "memory_mib", errs)
		var g int64
		g, errs = parseInt(row[col["gpu"]], "gpu", errs)
		n.GPUs = int(g)
		if len(errs) > 0 {
			return nil, fmt.Errorf("%s:%d: %w", file, i+2, errors.Join(errs...))
		}
		nodes = append(nodes, n)
	}
	return nodes, nil
}

// LoadPods reads a pod CSV (name, cpu_milli, memory_mib, num_gpu,
// gpu_milli, and optionally gpu_spec and qos; other columns are ignored).
func LoadPods(r io.Reader, file string) ([]PodSpec, error) {
	rows, col, err := readCSV(r, file, "name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
	if err != nil {
		return nil, err
	}
	var pods []PodSpec
	for i, row := range rows {
		p := PodSpec{Name: row[col["name"]]}
		var errs []error
		var n int64
		p.CPUMilli, errs = parseInt(row[col["cpu_milli"]], "cpu_milli", errs)
		p.MemoryMiB, errs = parseInt(row[col["memory_mib"]], "memory_mib", errs)
		n, errs = parseInt(row[col["num_gpu"]], "num_gpu", errs)
		p.NumGPU = int(n)
		p.GPUMilli, errs = parseInt(row[col["gpu_milli"]], "gpu_milli", errs)
		if c, ok := col["qos"]; ok {
			p.Movable = strings.TrimSpace(row[c]) == "BE"
		}
		if c, ok := col["gpu_spec"]; ok {
			if spec := strings.TrimSpace(row[c]); spec != "" && spec != "nan" {
				p.GPUSpec = strings.Split(spec, "|")
			}
		}
		switch {
		case p.GPUMilli > MilliGPU:
			errs = append(errs, fmt.Errorf("gpu_milli %d must be at most %d", p.GPUMilli, MilliGPU))
		case p.NumGPU > 1 && p.GPUMilli != MilliGPU:
			errs = append(errs, fmt.Errorf("num_gpu %d with gpu_milli %d: a pod of several GPUs must take them whole (gpu_milli %d)", p.NumGPU, p.GPUMilli, MilliGPU))
		case (p.NumGPU == 0) != (p.GPUMilli == 0):
			errs = append(errs, fmt.Errorf("num_gpu %d with gpu_milli %d: both must be 0 or both positive", p.NumGPU, p.GPUMilli))
		}
		if len(errs) > 0 {
			return nil, fmt.Errorf("%s:%d: %w", file, i+2, errors.Join(errs...))
		}
		pods = append(pods, p)
	}
	return pods, nil
}

func readCSV(r io.Reader, file string, want ...string) ([][]string, map[string]int, error) {
	rows, err := csv.NewReader(r).ReadAll()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", file, err)
	}
	if len(rows) == 0 {
		return nil, nil, fmt.Errorf("%s: empty", file)
	}
	col := map[string]int{}
	for i, name := range rows[0] {
		col[strings.TrimSpace(name)] = i
	}
	for _, w := range want {
		if _, ok := col[w]; !ok {
			return nil, nil, fmt.Errorf("%s: no %q column (have %s)", file, w, strings.Join(rows[0], ","))
		}
	}
	return rows[1:], col, nil
}

func parseInt(s, field string, errs []error) (int64, []error) {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64) // some exports write 4000.0
	if err != nil || v < 0 || v != float64(int64(v)) {
		return 0, append(errs, fmt.Errorf("%s %q must be a non-negative whole number", field, s))
	}
	return int64(v), errs
}

// Cluster builds one empty ledger per GPU node (nodes without GPUs are not
// part of the experiment), GPUs measured in milli-GPU.
// They come sorted by name, the order the study's simulator creates them.
func Cluster(specs []NodeSpec) []*gpu.Node {
	var nodes []*gpu.Node
	specs = slices.Clone(specs)
	slices.SortStableFunc(specs, func(a, b NodeSpec) int { return strings.Compare(a.Name, b.Name) })
	for _, s := range specs {
		if s.GPUs == 0 {
			continue
		}
		devices := make([]*gpu.Device, s.GPUs)
		for i := range devices {
			devices[i] = &gpu.Device{Index: i, UUID: fmt.Sprintf("%s-gpu%d", s.Name, i), Model: s.Model, Total: MilliGPU}
		}
		nodes = append(nodes, gpu.NewNode(s.Name, s.CPUMilli, s.MemoryMiB, devices...))
	}
	return nodes
}

// Workload prepares a seed's arrival order (SPEC §4.2) as the study's
// simulator does with its seeded generator: the pods sorted by name and
// shuffled; then, if their GPU request is below tune × capacityMilli,
// padded with random re-draws of the name-sorted trace until the next
// draw would pass it (like the study, that test adds the drawn pod's
// per-GPU milli-GPU, not its total), and if above, thinned by removing
// random pods until it is not.
func Workload(pods []PodSpec, rng *rand.Rand, tune float64, capacityMilli int64) []PodSpec {
	byName := slices.Clone(pods)
	slices.SortStableFunc(byName, func(a, b PodSpec) int { return strings.Compare(a.Name, b.Name) })
	out := slices.Clone(byName)
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	limit := tune * float64(capacityMilli)
	var total int64
	for _, p := range out {
		total += p.GPURequest()
	}
	for len(out) > 0 && float64(total) > limit {
		i := rng.Intn(len(out))
		total -= out[i].GPURequest()
		out = slices.Delete(out, i, i+1)
	}
	for len(byName) > 0 && float64(total) < limit {
		p := byName[rng.Intn(len(byName))]
		if float64(total+p.GPUMilli) > limit {
			break
		}
		total += p.GPURequest()
		out = append(out, p)
	}
	return out
}

// Shape is the pod's task shape for the fragmentation estimate.
func (p PodSpec) Shape() placement.Key {
	k := placement.Key{CPU: p.CPUMilli, NumGPU: p.NumGPU, Models: strings.Join(p.GPUSpec, "|")}
	if p.Shares() {
		k.Share = p.GPUMilli
	}
	return k
}

// Request is the pod as a ledger request: a time-sliced share of one GPU,
// whole GPUs, or CPU and memory only.
func (p PodSpec) Request(tenant string) gpu.Request {
	r := gpu.Request{Tenant: tenant, CPU: p.CPUMilli, Memory: p.MemoryMiB, Models: p.GPUSpec}
	switch {
	case p.Shares():
		r.Devices = 1
		r.Share = gpu.Share{Request: p.GPUMilli, Limit: p.GPUMilli, Mode: api.TimeSlicing}
	case p.NumGPU > 0:
		r.Whole = p.NumGPU
	}
	return r
}
