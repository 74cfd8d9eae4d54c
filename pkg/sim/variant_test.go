package sim

import (
	"slices"
	"strings"
	"testing"
)

// A variant reaches its share by adding the trace's own pods of its kind,
// reproducibly, and reproduces the study's multigpu30 mix from the
// default trace.
func TestVariantsAddPodsOfTheirKindToTheirShare(t *testing.T) {
	_, pods := load(t)
	for _, v := range Variants {
		out, err := v.Derive(pods, 1)
		if err != nil {
			t.Fatal(err)
		}
		var kind, total int64
		for i, p := range out {
			d := v.Demand(p)
			total += d
			if v.Kind(p) {
				kind += d
			}
			if i >= len(pods) && (!v.Kind(p) || !strings.Contains(p.Name, "-"+v.Name+"-")) {
				t.Fatalf("%s: added pod %+v is not of the variant's kind", v.Name, p)
			}
		}
		if share := float64(kind) / float64(total); share < v.Share || share > v.Share+0.01 {
			t.Errorf("%s: the kind's share is %.3f, want %.2f", v.Name, share, v.Share)
		}
		again, _ := v.Derive(pods, 1)
		if !slices.EqualFunc(again, out, podsEqual) {
			t.Errorf("%s: the same seed drew other pods", v.Name)
		}
	}
	// The study's own multigpu30 has 8,508 pods; drawn the same way from
	// the default trace's 8,152 the count lands close.
	v := Variant{Name: "mg30", Kind: func(p PodSpec) bool { return p.NumGPU > 1 }, Demand: PodSpec.GPURequest, Share: 0.3}
	out, err := v.Derive(pods, 1)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(out); n < 8400 || n > 8600 {
		t.Errorf("30%% multi-GPU demand: %d pods, want about the study's 8,508", n)
	}
	if _, err := VariantNamed("nope"); err == nil || !strings.Contains(err.Error(), "multigpu50") {
		t.Errorf("an unknown variant: %v, want the list", err)
	}
}
