// Package placement scores where a GPU request should go: on which node
// and on which of its GPUs. Policies are pure functions of a pkg/gpu node
// ledger and a request; the scheduler plugin and the trace simulator call
// the same code. Amounts are in the ledger's unit (MiB in the scheduler,
// milli-GPU in the simulator).
package placement

import (
	"cmp"
	"math"
	"slices"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// Shape is a task shape of the workload with its frequency P: the CPU it
// asks, and either NumGPU whole GPUs (Share 0) or Share of one GPU, on
// any of Models (empty: any model). A CPU-only shape has NumGPU 0.
type Shape struct {
	CPU int64
	// Memory is the shape's mean memory request; only gpufrac's policy
	// uses it (the study's shapes have none).
	Memory int64
	NumGPU int
	Share  int64
	Models []string
	P      float64
}

// Key identifies a shape regardless of its frequency.
type Key struct {
	CPU    int64
	NumGPU int
	Share  int64
	Models string
}

// Key returns the shape's identity.
func (s Shape) Key() Key {
	return Key{CPU: s.CPU, NumGPU: s.NumGPU, Share: s.Share, Models: strings.Join(s.Models, "|")}
}

// Coverage is the share of a workload's tasks whose shapes make its
// estimate: the "typical pods" threshold of Weng et al. (ATC '23), used by
// the simulator and the scheduler alike.
const Coverage = 0.95

// Popular returns the most frequent shapes among keys (one per task) until
// they cover the given share of the tasks, most frequent first, with P
// renormalised over the kept shapes. This is the "typical pods" estimate
// of Weng et al. (ATC '23): CPU-only tasks are counted, ties are broken
// by the larger shape first.
func Popular(keys []Key, coverage float64) []Shape {
	counts := map[Key]int{}
	for _, k := range keys {
		counts[k]++
	}
	distinct := make([]Key, 0, len(counts))
	for k := range counts {
		distinct = append(distinct, k)
	}
	slices.SortFunc(distinct, func(a, b Key) int {
		return cmp.Or(cmp.Compare(counts[b], counts[a]), cmp.Compare(b.CPU, a.CPU), cmp.Compare(b.Share, a.Share),
			cmp.Compare(b.NumGPU, a.NumGPU), strings.Compare(b.Models, a.Models))
	})
	var shapes []Shape
	covered := 0
	for _, k := range distinct {
		if float64(covered) >= coverage*float64(len(keys)) {
			break
		}
		covered += counts[k]
		s := Shape{CPU: k.CPU, NumGPU: k.NumGPU, Share: k.Share, P: float64(counts[k])}
		if k.Models != "" {
			s.Models = strings.Split(k.Models, "|")
		}
		shapes = append(shapes, s)
	}
	for i := range shapes {
		shapes[i].P /= float64(covered)
	}
	return shapes
}

// view is the part of a node ledger fragmentation depends on, copied so
// that a policy can try a placement without touching the ledger.
type view struct {
	cpuFree int64 // -1 when the node does not track CPU
	memFree int64 // -1 when the node does not track memory
	models  []string
	free    []int64 // schedulable amount left per GPU
	full    []int64 // schedulable amount per GPU
}

func viewOf(n *gpu.Node) view {
	v := view{cpuFree: -1, memFree: -1, models: make([]string, len(n.Devices)), free: make([]int64, len(n.Devices)), full: make([]int64, len(n.Devices))}
	if n.CPU > 0 {
		used, _ := n.Used()
		v.cpuFree = n.CPU - used
	}
	if n.Memory > 0 {
		_, used := n.Used()
		v.memFree = n.Memory - used
	}
	for i, d := range n.Devices {
		v.models[i], v.free[i], v.full[i] = d.Model, d.Free(), d.Schedulable()
	}
	return v
}

// with returns v with free copied into buf, so that a policy can try a
// placement per candidate GPU without allocating each time.
func (v view) with(buf []int64) view {
	v.free = buf[:copy(buf, v.free)]
	return v
}

// take charges r on devices of the view.
func (v *view) take(r gpu.Request, devices []int) {
	if v.cpuFree >= 0 {
		v.cpuFree -= r.CPU
	}
	if v.memFree >= 0 {
		v.memFree -= r.Memory
	}
	for _, i := range devices {
		if r.Whole > 0 {
			v.free[i] = 0
		} else {
			v.free[i] -= r.Share.Request
		}
	}
}

func (v view) idle() int64 {
	var sum int64
	for _, f := range v.free {
		sum += f
	}
	return sum
}

// frag is the node's expected fragmentation over shapes (SPEC §4.5): for
// each shape, weighted by P, the free GPU amount it cannot use. A shape
// the node cannot host at all (CPU, model, too few GPUs with room, or no
// GPU wanted) cannot use any of it; one it can host cannot use the GPUs
// too small for it.
func (v view) frag(shapes []Shape) float64 {
	idle := v.idle()
	if idle == 0 {
		return 0
	}
	var frag float64
	for i := range shapes {
		s := &shapes[i]
		frag += s.P * float64(v.unusable(s, idle))
	}
	return frag
}

func (v view) unusable(s *Shape, idle int64) int64 {
	if s.NumGPU == 0 || (v.cpuFree >= 0 && v.cpuFree < s.CPU) {
		return idle
	}
	var small int64
	room := 0
	for i, f := range v.free {
		if len(s.Models) > 0 && !slices.Contains(s.Models, v.models[i]) {
			small += f
			continue
		}
		need := s.Share
		if need == 0 {
			need = v.full[i]
		}
		if f >= need && f > 0 {
			room++
		} else {
			small += f
		}
	}
	if room < s.NumGPU {
		return idle
	}
	return small
}

// Fragmentation is a node's expected fragmentation over shapes, in the
// ledger's unit (SPEC §4.5).
func Fragmentation(n *gpu.Node, shapes []Shape) float64 {
	return viewOf(n).frag(shapes)
}

// manyCopies is, in one pass over the shapes, what FGD's one-more-copy
// view misses. unused: the free GPU amount the shapes could not use even
// if only they arrived from now on (for each shape, weighted by P, the
// free amount less what as many copies as the node's GPUs hold and its
// CPU and memory feed would take), so CPU for three more tasks strands the
// rest of eight idle GPUs and a GPU with room for two tasks but not three
// wastes the remainder. stranded: the part of that GPU room the host
// cannot feed (copies by GPU beyond copies by CPU and memory, times
// their size).
func (v view) manyCopies(shapes []Shape) (unused, stranded float64) {
	idle := v.idle()
	if idle == 0 {
		return 0, 0
	}
	for i := range shapes {
		s := &shapes[i]
		if s.NumGPU == 0 {
			unused += s.P * float64(idle)
			continue
		}
		byGPU, per := v.copies(s)
		host := v.hosted(s)
		unused += s.P * float64(idle-min(byGPU, host)*per)
		if byGPU > host {
			stranded += s.P * float64((byGPU-host)*per)
		}
	}
	return unused, stranded
}

// hosted is how many copies of s the node's free CPU and memory can feed.
func (v view) hosted(s *Shape) int64 {
	n := int64(math.MaxInt64)
	if v.cpuFree >= 0 && s.CPU > 0 {
		n = min(n, v.cpuFree/s.CPU)
	}
	if v.memFree >= 0 && s.Memory > 0 {
		n = min(n, v.memFree/s.Memory)
	}
	return n
}

// copies is how many copies of s the node's GPUs could hold, ignoring
// CPU, and the GPU amount each takes.
func (v view) copies(s *Shape) (n, per int64) {
	if s.Share > 0 {
		for i, f := range v.free {
			if len(s.Models) == 0 || slices.Contains(s.Models, v.models[i]) {
				n += f / s.Share
			}
		}
		return n, s.Share
	}
	idleGPUs := int64(0)
	for i, f := range v.free {
		if f > 0 && f == v.full[i] && (len(s.Models) == 0 || slices.Contains(s.Models, v.models[i])) {
			idleGPUs++
			per = f
		}
	}
	return idleGPUs / int64(s.NumGPU), per * int64(s.NumGPU)
}

// WithMemory returns shapes with each one's Memory set to the mean memory
// of the tasks of its key (keys[i] asked mems[i]).
func WithMemory(shapes []Shape, keys []Key, mems []int64) []Shape {
	sum, n := map[Key]int64{}, map[Key]int64{}
	for i, k := range keys {
		sum[k] += mems[i]
		n[k]++
	}
	out := slices.Clone(shapes)
	for i := range out {
		if c := n[out[i].Key()]; c > 0 {
			out[i].Memory = sum[out[i].Key()] / c
		}
	}
	return out
}
