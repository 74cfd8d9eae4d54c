package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BenchmarkPodCreateThroughAPIServer creates 1,000 fractional pods (each
// through the mutating and validating webhooks over TLS) and, as the
// baseline in the same run, 1,000 plain pods that the webhooks' scope
// skips. It reports p50/p99 create latency of both and their ratio. Run
// with -benchtime 1x: each iteration is the whole 2 × 1,000 creates.
func BenchmarkPodCreateThroughAPIServer(b *testing.B) {
	const pods = 1000
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		ns := fmt.Sprintf("bench-%d-%d", time.Now().UnixNano(), i)
		if _, err := shared.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		measure := func(annotations map[string]string) []time.Duration {
			lat := make([]time.Duration, 0, pods)
			for j := range pods {
				p := fracPod(annotations)
				p.Namespace, p.Name = ns, fmt.Sprintf("p-%d-%d", len(annotations), j)
				start := time.Now()
				if _, err := shared.alice.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
			}
			slices.Sort(lat)
			return lat
		}
		plain := measure(nil)
		frac := measure(map[string]string{"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75"})
		pct := func(l []time.Duration, q float64) float64 {
			return float64(l[int(q*float64(len(l)-1))].Microseconds()) / 1000
		}
		b.ReportMetric(pct(frac, 0.50), "frac-p50-ms")
		b.ReportMetric(pct(frac, 0.99), "frac-p99-ms")
		b.ReportMetric(pct(plain, 0.50), "plain-p50-ms")
		b.ReportMetric(pct(plain, 0.99), "plain-p99-ms")
		b.ReportMetric(pct(frac, 0.99)/pct(plain, 0.99), "p99-ratio")
	}
}
