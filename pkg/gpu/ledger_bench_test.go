package gpu

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// BenchmarkFitCluster is one scheduling cycle's filtering: Fit of a
// fractional request on every node of a 5,000-node, 8-GPU-per-node cluster
// that is about half full. One op is the whole cluster.
func BenchmarkFitCluster(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	nodes := make([]*Node, 5000)
	for i := range nodes {
		var ds []*Device
		for g := range 8 {
			ds = append(ds, &Device{Index: g, UUID: fmt.Sprintf("GPU-%d-%d", i, g), Model: "H100", Total: 81920, Reserve: 1024})
		}
		n := NewNode(fmt.Sprintf("n%d", i), 128000, 1<<20, ds...)
		for t := range 8 {
			r := Request{Tenant: fmt.Sprintf("t%d", t), Devices: 1, CPU: 4000, Memory: 16384,
				Share: share(int64(rng.IntN(40000)+1000), api.TimeSlicing, 0)}
			if fit, unfit := n.Fit(r); unfit == nil {
				_ = n.Assign(r, fit[:1])
			}
		}
		nodes[i] = n
	}
	r := Request{Tenant: "new", Devices: 2, CPU: 8000, Memory: 32768, Share: share(20000, api.TimeSlicing, 0)}
	b.ReportAllocs()
	for b.Loop() {
		feasible := 0
		for _, n := range nodes {
			if _, unfit := n.Fit(r); unfit == nil {
				feasible++
			}
		}
		if feasible == 0 {
			b.Fatal("no feasible node")
		}
	}
}
