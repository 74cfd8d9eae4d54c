package placement

import (
	"fmt"
	"math/rand"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/gpu"
)

// benchCluster is 5,000 nodes of 8 GPUs (milli-GPU), about half used by
// shares and whole GPUs, like a cluster in the middle of the day.
func benchCluster(b *testing.B) []*gpu.Node {
	rng := rand.New(rand.NewSource(1))
	nodes := make([]*gpu.Node, 5000)
	for i := range nodes {
		used := make([]int64, 8)
		for g := range used {
			used[g] = []int64{0, 0, 0, 1000, 500, 810, 320, 470}[rng.Intn(8)]
		}
		nodes[i] = node(b, fmt.Sprintf("node-%04d", i), 96000, "G2", used...)
	}
	return nodes
}

// benchShapes is the default trace's workload estimate, roughly.
var benchShapes = []Shape{
	{CPU: 11000, NumGPU: 1, P: 0.28}, {CPU: 3000, NumGPU: 1, Share: 810, P: 0.13}, {CPU: 4000, NumGPU: 1, Share: 470, P: 0.09},
	{CPU: 12000, P: 0.05}, {CPU: 32000, P: 0.04}, {CPU: 8000, NumGPU: 1, Share: 320, P: 0.04},
	{CPU: 6000, NumGPU: 1, Share: 650, P: 0.03}, {CPU: 64000, NumGPU: 8, P: 0.01}, {CPU: 16000, NumGPU: 2, P: 0.01},
	{CPU: 8000, NumGPU: 1, Share: 230, P: 0.02}, {CPU: 4000, NumGPU: 1, Share: 460, P: 0.02}, {CPU: 8000, NumGPU: 1, P: 0.28},
}

// One op is a whole scheduling cycle for one share request: Fit on every
// node, then the policy's Score on every node that fits.
func benchmarkCycle(b *testing.B, p Policy) {
	nodes := benchCluster(b)
	r := share("new", 470, 4000)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		feasible := 0
		for _, n := range nodes {
			fit, unfit := n.Fit(r)
			if unfit != nil {
				continue
			}
			feasible++
			_ = p.Score(n, r, fit)
		}
		if feasible == 0 {
			b.Fatal("no feasible node")
		}
	}
}

func BenchmarkCycleFitOnly(b *testing.B) {
	nodes := benchCluster(b)
	r := share("new", 470, 4000)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		for _, n := range nodes {
			_, _ = n.Fit(r)
		}
	}
}

func BenchmarkCycleBestFit(b *testing.B) { benchmarkCycle(b, BestFit{Max: StudyCapacity}) }
func BenchmarkCycleFGD(b *testing.B)     { benchmarkCycle(b, FGD{Shapes: benchShapes}) }
func BenchmarkCycleGpufrac(b *testing.B) { benchmarkCycle(b, NewOurs(benchShapes, Supply{})) }
