package api

import "testing"

// BenchmarkParse measures Parse on the shapes admission sees most: a plain
// pod, a shorthand fraction, and canonical keys with a burst limit.
func BenchmarkParse(b *testing.B) {
	cases := []struct {
		name string
		ann  map[string]string
	}{
		{"no-fraction", map[string]string{"app.kubernetes.io/name": "web", "prometheus.io/scrape": "true"}},
		{"shorthand", map[string]string{KeyFraction: "0.5", KeyFractionLimit: "0.75", KeyComputeSharingMode: "sm-sharing"}},
		{"canonical", map[string]string{
			"nvidia.com/container.main.gpu-memory.request": "4Gi",
			"nvidia.com/container.main.gpu-memory.limit":   "8Gi",
			"nvidia.com/container.main.gpu-compute.mode":   "time-slicing",
		}},
	}
	for _, c := range cases {
		pod := newPod(c.ann, "main", "sidecar").pod
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(pod); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
