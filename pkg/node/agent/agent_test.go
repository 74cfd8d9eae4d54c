package agent

import (
	"testing"

	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/publish"
)

// The node derives sm-sharing portions with the reserve the scheduler
// charged with: per model by the node's product label, else the global one.
func TestReserveForFollowsTheSchedulersKeys(t *testing.T) {
	opts := Options{Injection: injection.Config{GPUMemoryReserveMiB: 256},
		GPUMemoryReserveMiBByModel: map[string]int64{"NVIDIA-H100-80GB-HBM3": 1024}}
	for product, want := range map[string]int64{"NVIDIA-H100-80GB-HBM3": 1024, "NVIDIA-A100-SXM4-80GB": 256, "": 256} {
		if got := reserveFor(opts, map[string]string{publish.LabelGPUProduct: product}); got != want {
			t.Errorf("product %q: reserve %d, want %d", product, got, want)
		}
	}
}
