package nriplugin

import (
	"context"
	"fmt"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/go-logr/logr"
	"k8s.io/klog/v2"
)

// BenchmarkCreateContainer is the plugin's work in the runtime's
// CreateContainer request, off the wire: a time-slicing fraction (judged,
// injected, recorded as a tenant), a pod with no fraction whose image
// names every GPU (judged and policed against its grant), and an ordinary
// container (judged, nothing to do) as the baseline.
func BenchmarkCreateContainer(b *testing.B) {
	// Discarded: the policed case logs each change, which is not the
	// work measured.
	ctx := klog.NewContext(context.Background(), logr.Discard())
	granted := func(context.Context, PodRef, string, []string) ([]string, error) { return []string{"GPU-b"}, nil }
	c := cfg
	c.RestrictVisibility = true
	p := New(Options{Injection: c, Grants: granted})
	cases := []struct {
		name string
		pod  *nriapi.PodSandbox
		env  []string
	}{
		{"ordinary", sandbox("p0", "web", map[string]string{"app": "web"}), []string{"PATH=/bin"}},
		{"policed", sandbox("p1", "whole", map[string]string{"app": "train"}), []string{"NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin"}},
		{"fraction", sandbox("p2", "llm", scheduled), []string{"NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin"}},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			i := 0
			for b.Loop() {
				i++
				ctr := container(fmt.Sprintf("c%d", i%64), c.pod.Id, "main", c.env...)
				if _, _, err := p.CreateContainer(ctx, c.pod, ctr); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
