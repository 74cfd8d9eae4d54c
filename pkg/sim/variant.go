package sim

import (
	"fmt"
	"math/rand"
	"slices"
	"strings"
)

// Variant is a mix derived from a trace the way the study derived its
// multigpu* and cpu* traces from the default one: pods of one kind, drawn
// from the trace's own pods of that kind, are added until the kind carries
// a target share of a demand.
type Variant struct {
	Name string
	// Kind selects the pods that are drawn and counted.
	Kind func(PodSpec) bool
	// Demand is what each pod counts for.
	Demand func(PodSpec) int64
	// Share is the kind's target share of the total demand.
	Share float64
}

// Variants are the mixes gpufrac's margin over FGD is measured on besides
// the shipped traces: beyond the study's heaviest multi-GPU (multigpu30,
// where multi-GPU pods ask 30% of the GPUs) and CPU (cpu300, where
// CPU-only pods ask 45% of the CPU) mixes.
var Variants = []Variant{
	{Name: "multigpu50", Kind: func(p PodSpec) bool { return p.NumGPU > 1 }, Demand: PodSpec.GPURequest, Share: 0.5},
	{Name: "multigpu70", Kind: func(p PodSpec) bool { return p.NumGPU > 1 }, Demand: PodSpec.GPURequest, Share: 0.7},
	{Name: "cpuonly60", Kind: func(p PodSpec) bool { return p.NumGPU == 0 }, Demand: func(p PodSpec) int64 { return p.CPUMilli }, Share: 0.6},
	{Name: "cpuonly50", Kind: func(p PodSpec) bool { return p.NumGPU == 0 }, Demand: func(p PodSpec) int64 { return p.CPUMilli }, Share: 0.5},
}

// VariantSeed draws a variant's added pods: one fixed seed, so that a
// variant is one trace, whatever seeds then shuffle it.
const VariantSeed = 1

// VariantNamed returns the variant of that name.
func VariantNamed(name string) (Variant, error) {
	for _, v := range Variants {
		if v.Name == name {
			return v, nil
		}
	}
	names := make([]string, len(Variants))
	for i, v := range Variants {
		names[i] = v.Name
	}
	return Variant{}, fmt.Errorf("no variant %q: one of %s", name, strings.Join(names, ", "))
}

// Derive adds pods of the variant's kind, drawn with the seed from the
// trace's pods of that kind (sorted by name, so that the draw does not
// depend on the file's order), until the kind's share of the demand
// reaches the target; the added pods are named <name>-<variant>-<n>. A
// trace already at or above the share is returned as it is.
func (v Variant) Derive(pods []PodSpec, seed int64) ([]PodSpec, error) {
	var pool []PodSpec
	var kind, total int64
	for _, p := range pods {
		d := v.Demand(p)
		total += d
		if v.Kind(p) && d > 0 {
			kind += d
			pool = append(pool, p)
		}
	}
	if len(pool) == 0 {
		return nil, fmt.Errorf("variant %s: the trace has no pod of its kind, with a demand, to draw from", v.Name)
	}
	if !(v.Share > 0 && v.Share < 1) {
		return nil, fmt.Errorf("variant %s: share %v must be between 0 and 1", v.Name, v.Share)
	}
	slices.SortStableFunc(pool, func(a, b PodSpec) int { return strings.Compare(a.Name, b.Name) })
	rng := rand.New(rand.NewSource(seed))
	out := slices.Clone(pods)
	for n := 0; float64(kind) < v.Share*float64(total); n++ {
		p := pool[rng.Intn(len(pool))]
		d := v.Demand(p)
		p.Name = fmt.Sprintf("%s-%s-%d", p.Name, v.Name, n)
		out = append(out, p)
		kind += d
		total += d
	}
	return out, nil
}
