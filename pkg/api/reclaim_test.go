package api

import (
	"slices"
	"testing"
)

// The order stops the lowest priority above its request first, then the
// furthest above it; a tenant within its request is never in it, however
// low its priority.
func TestReclaimOrder(t *testing.T) {
	in := []Burst{
		{Pod: "ns/prod", Priority: 1000, RequestMiB: 4096, UsedMiB: 12288},
		{Pod: "ns/notebook-a", RequestMiB: 4096, UsedMiB: 5120},
		{Pod: "ns/notebook-b", RequestMiB: 4096, UsedMiB: 8192},
		{Pod: "ns/within", Priority: -10, RequestMiB: 8192, UsedMiB: 8192},
		{Pod: "ns/idle", Priority: -10, RequestMiB: 8192, UsedMiB: 10},
	}
	var got []string
	for _, b := range ReclaimOrder(in) {
		got = append(got, b.Pod)
	}
	if want := []string{"ns/notebook-b", "ns/notebook-a", "ns/prod"}; !slices.Equal(got, want) {
		t.Errorf("order %v, want %v", got, want)
	}
	if in[0].Pod != "ns/prod" {
		t.Error("ReclaimOrder reordered its input")
	}
	if s := in[2].String(); s != "ns/notebook-b (priority 0, 4Gi above its request)" {
		t.Errorf("String() = %q", s)
	}
}

func TestUnderPressure(t *testing.T) {
	for _, c := range []struct {
		free, total int64
		below       int
		want        bool
	}{
		{4000, 81920, 5, true}, {4096, 81920, 5, false}, {0, 0, 5, false}, {100, 81920, 0, false},
	} {
		if got := UnderPressure(c.free, c.total, c.below); got != c.want {
			t.Errorf("UnderPressure(%d, %d, %d) = %v, want %v", c.free, c.total, c.below, got, c.want)
		}
	}
}
