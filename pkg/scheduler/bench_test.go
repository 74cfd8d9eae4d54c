package scheduler

import (
	"fmt"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// BenchmarkFilterScore is the plugin's work per node and pod: Filter and
// Score of a 0.3 share on an 8-GPU node with half its GPUs partly used,
// under each policy, against the Filter of a whole-GPU pod as baseline.
// Filter is the plugin's: FilterAt the scheduler's snapshot of the node
// (the Node the cache has, as almost always).
func BenchmarkFilterScore(b *testing.B) {
	c := NewCache(testArgs())
	n := node("n1", 8, 81920, true)
	n.ResourceVersion = "4242"
	c.SetNode(n)
	for i := range 4 {
		g := fmt.Sprintf("g%d", i)
		uuid := fmt.Sprintf("GPU-%04x", i)
		c.SetPod(reservationPod("n1", g, uuid))
		c.SetPod(placedPod("p"+g, "n1", int64(10000*(i+1)), api.TimeSlicing, "", []string{g}, []string{uuid}))
	}
	share := ask("new", 24576, api.TimeSlicing, 1)
	b.Run("whole/filter", func(b *testing.B) {
		for b.Loop() {
			c.FilterAt(n, Ask{UID: "w", Whole: 1}, view{gpus: 8, gpusFree: 4})
		}
	})
	for _, name := range PolicyNames() {
		p, err := placementFor(name, c)
		if err != nil {
			b.Fatal(err)
		}
		b.Run("share/"+name, func(b *testing.B) {
			for b.Loop() {
				if !c.FilterAt(n, share, view{}).Fits {
					b.Fatal("does not fit")
				}
				c.Score("n1", share, p, Host{})
			}
		})
	}
}
