package api

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The annotation never outgrows its bound, whatever the tenants name
// their pods: entries are left out, and counted; what is written reads
// back.
func TestUsageWriteStaysWithinItsBound(t *testing.T) {
	used := int64(100)
	u := NodeUsage{At: time.Unix(1_800_000_000, 0).UTC(), WindowSeconds: 3600}
	for i := range 2000 {
		u.Pods = append(u.Pods, PodGPUUsage{Pod: fmt.Sprintf("ns/%s-%04d", strings.Repeat("x", 240), i), GPU: "GPU-0", UsedMiB: &used, Samples: 3})
	}
	ann, err := UsageWrite(u)
	if err != nil {
		t.Fatal(err)
	}
	value := *ann[UsageAnnotation]
	if len(value) > maxUsageBytes {
		t.Errorf("annotation of %d bytes, bound %d", len(value), maxUsageBytes)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Annotations: map[string]string{UsageAnnotation: value}}}
	back, ok, err := UsageOf(node)
	if !ok || err != nil || back.Omitted == 0 || len(back.Pods)+back.Omitted != 2000 || !back.At.Equal(u.At) {
		t.Errorf("read back: ok %v err %v, %d pods + %d omitted", ok, err, len(back.Pods), back.Omitted)
	}
	if len(u.Pods) != 2000 {
		t.Error("UsageWrite changed its argument")
	}
	node.Annotations[UsageAnnotation] = "{not json"
	if _, ok, err := UsageOf(node); !ok || err == nil || !strings.Contains(err.Error(), "node n1: annotation "+UsageAnnotation) {
		t.Errorf("a garbled annotation: ok %v, err %v", ok, err)
	}
	if _, ok, err := UsageOf(&corev1.Node{}); ok || err != nil {
		t.Errorf("no annotation: ok %v, err %v", ok, err)
	}
}

// Whatever the annotation holds, reading it never panics, and what reads
// back writes again within its bound.
func FuzzUsageOf(f *testing.F) {
	f.Add(`{"at":"2026-12-06T00:00:00Z","windowSeconds":3600,"pods":[{"pod":"a/b","gpu":"GPU-0","usedMiB":5,"samples":1,"smSamples":1,"spanSeconds":0}]}`)
	f.Add(`{"pods":[{"usedMiB":-1}]}`)
	f.Add(`null`)
	f.Fuzz(func(t *testing.T, raw string) {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Annotations: map[string]string{UsageAnnotation: raw}}}
		u, ok, err := UsageOf(node)
		if !ok || err != nil {
			return
		}
		ann, err := UsageWrite(u)
		if err != nil {
			t.Fatalf("a usage read back does not write: %v", err)
		}
		if len(*ann[UsageAnnotation]) > maxUsageBytes && len(u.Pods) > 0 {
			t.Fatalf("written past the bound: %d bytes", len(*ann[UsageAnnotation]))
		}
	})
}
