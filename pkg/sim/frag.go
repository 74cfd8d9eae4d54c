package sim

import (
	"cmp"
	"slices"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// Shape is a popular task shape with its frequency P among the GPU pods.
type Shape struct {
	CPUMilli int64
	NumGPU   int
	GPUMilli int64
	GPUSpec  []string
	P        float64
}

// perGPU is what the shape needs of each GPU it uses, in milli-GPU.
func (s Shape) perGPU() int64 {
	if s.NumGPU == 1 && s.GPUMilli < MilliGPU {
		return s.GPUMilli
	}
	return MilliGPU
}

// PopularShapes returns the most frequent (cpu, num_gpu, gpu_milli,
// gpu_spec) shapes of the GPU pods, most frequent first, until they cover
// the given share of those pods, with P renormalised over the kept shapes
// (SPEC §4.5). CPU-only pods are left out: they hold no GPU and so cannot
// be blocked by GPU fragments (as in the study's default).
func PopularShapes(pods []PodSpec, coverage float64) []Shape {
	type key struct {
		cpu, milli int64
		num        int
		spec       string
	}
	counts := map[key]int{}
	total := 0
	for _, p := range pods {
		if p.NumGPU == 0 {
			continue
		}
		counts[key{p.CPUMilli, p.GPUMilli, p.NumGPU, strings.Join(p.GPUSpec, "|")}]++
		total++
	}
	keys := make([]key, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b key) int {
		return cmp.Or(cmp.Compare(counts[b], counts[a]), cmp.Compare(a.num, b.num), cmp.Compare(a.milli, b.milli),
			cmp.Compare(a.cpu, b.cpu), strings.Compare(a.spec, b.spec))
	})
	var shapes []Shape
	covered := 0
	for _, k := range keys {
		if total > 0 && float64(covered) >= coverage*float64(total) {
			break
		}
		covered += counts[k]
		s := Shape{CPUMilli: k.cpu, NumGPU: k.num, GPUMilli: k.milli, P: float64(counts[k])}
		if k.spec != "" {
			s.GPUSpec = strings.Split(k.spec, "|")
		}
		shapes = append(shapes, s)
	}
	for i := range shapes {
		shapes[i].P /= float64(covered)
	}
	return shapes
}

// Fragmentation is a node's expected idle milli-GPU that the popular
// shapes cannot use (SPEC §4.5): for each shape, weighted by P, all idle
// GPU capacity when the shape does not fit the node at all (CPU, model or
// GPUs), and otherwise the idle capacity of the GPUs too small for it.
func Fragmentation(n *gpu.Node, shapes []Shape) float64 {
	cpuUsed, _ := n.Used()
	var frag float64
	for _, s := range shapes {
		var idle, tooSmall int64
		var fitting int
		modelOK := true
		for _, d := range n.Devices {
			free := d.Free()
			idle += free
			if len(s.GPUSpec) > 0 && !slices.Contains(s.GPUSpec, d.Model) {
				modelOK = false
			}
			if free >= s.perGPU() {
				fitting++
			} else {
				tooSmall += free
			}
		}
		fits := modelOK && (n.CPU == 0 || cpuUsed+s.CPUMilli <= n.CPU) && fitting >= max(s.NumGPU, 1)
		if fits {
			frag += s.P * float64(tooSmall)
		} else {
			frag += s.P * float64(idle)
		}
	}
	return frag
}
