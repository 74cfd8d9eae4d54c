package clusterview

import (
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// StaleUsage is how old a node's usage reading may be and still be shown:
// an agent that stopped measuring (or an old one) shows no use, not a
// figure from long ago.
const StaleUsage = 5 * time.Minute

// Right-sizing's rules, in one place.
const (
	// MinAdviceSamples: fewer readings than this say too little of a
	// tenant's use to resize it (at the default resync of 30 s, 2.5 min).
	MinAdviceSamples = 5
	// adviceHeadroom is kept above the high percentile of use.
	adviceHeadroom = 1.2
	// adviceStepMiB: suggestions are rounded up to it.
	adviceStepMiB = 256
	// shrinkBelow: a smaller request is suggested only when it saves at
	// least a fifth of the one granted (a resize for a few MiB is noise).
	shrinkBelow = 0.8
	// idleShare and nearLimitShare mark idle and near-limit tenants.
	idleShare      = 0.1
	nearLimitShare = 0.9
)

// Advice is a resize a tenant's use suggests.
type Advice struct {
	// RequestMiB is the request suggested on each of its GPUs (the limit
	// follows a larger request, as a resize does).
	RequestMiB int64 `json:"requestMiB"`
	// Why says from which figures.
	Why string `json:"why"`
	// Command is the exact line that asks for it.
	Command string `json:"command"`
}

// idle: over a full window of readings, the tenant held under a tenth of
// its request and computed nothing.
func idle(t Tenant) bool {
	u := t.Use
	return u != nil && u.Samples >= MinAdviceSamples && u.SMSamples >= MinAdviceSamples && u.P95MiB != nil && u.SMAvgPercent != nil &&
		float64(*u.P95MiB) < idleShare*float64(t.RequestMiB) && *u.SMAvgPercent == 0
}

// nearLimit: it holds nine tenths of its hard limit or more now.
func nearLimit(t Tenant) bool {
	u := t.Use
	return u != nil && u.UsedMiB != nil && t.LimitMiB > 0 && float64(*u.UsedMiB) >= nearLimitShare*float64(t.LimitMiB)
}

// Advise suggests a new request for a pod whose shares are tenants (one
// per GPU; the request is per GPU): the 95th percentile of its use over
// the window, on the GPU it uses most, with a fifth more as headroom,
// rounded up to 256 MiB; never below what it holds now. Smaller only when
// that saves a fifth of the request; larger when it keeps above its
// request (it bursts into memory nobody guarantees it). nil when its
// use is unknown, the window holds too few readings, or the grant fits.
// A claim's share is not resized by annotation: no advice.
func Advise(pod string, tenants []Tenant) *Advice {
	if len(tenants) == 0 || tenants[0].Claim {
		return nil
	}
	request, limit := tenants[0].RequestMiB, tenants[0].LimitMiB
	var p95, now int64
	samples, span := 0, int64(0)
	for _, t := range tenants {
		u := t.Use
		if u == nil || u.P95MiB == nil || u.UsedMiB == nil || u.Samples < MinAdviceSamples {
			return nil
		}
		p95, now = max(p95, *u.P95MiB), max(now, *u.UsedMiB)
		samples, span = max(samples, u.Samples), max(span, u.SpanSeconds)
	}
	want := roundUp(max(int64(math.Ceil(float64(p95)*adviceHeadroom)), now, adviceStepMiB), adviceStepMiB)
	why := fmt.Sprintf("p95 of use %s over %s (%d readings), holds %s now; granted %s (limit %s)",
		mib(p95), time.Duration(span)*time.Second, samples, mib(now), mib(request), mib(limit))
	switch {
	case float64(want) <= shrinkBelow*float64(request):
	case p95 > request:
	default:
		return nil
	}
	ns, name, _ := strings.Cut(pod, "/")
	return &Advice{RequestMiB: want, Why: why,
		Command: fmt.Sprintf("kubectl annotate pod -n %s %s %s=%s --overwrite", ns, name, api.KeyResizeRequest, quantity(want))}
}

// adviseAll gives each pod's tenants their pod's advice.
func adviseAll(v *View) {
	byPod := map[string][]*Tenant{}
	for i := range v.Nodes {
		for j := range v.Nodes[i].Shared {
			for k := range v.Nodes[i].Shared[j].Tenants {
				t := &v.Nodes[i].Shared[j].Tenants[k]
				byPod[t.Pod] = append(byPod[t.Pod], t)
			}
		}
	}
	for pod, ts := range byPod {
		vals := make([]Tenant, len(ts))
		for i, t := range ts {
			vals[i] = *t
		}
		if a := Advise(pod, vals); a != nil {
			for _, t := range ts {
				t.Advice = a
			}
		}
	}
}

// RenderAdvice writes the resizes the tenants' use suggests, each with
// the line that asks for it.
func RenderAdvice(w io.Writer, v View) error {
	var b strings.Builder
	seen := map[string]bool{}
	for _, n := range v.Nodes {
		for _, g := range n.Shared {
			for _, t := range g.Tenants {
				if t.Advice == nil || seen[t.Pod] {
					continue
				}
				seen[t.Pod] = true
				verb := "shrink"
				if t.Advice.RequestMiB > t.RequestMiB {
					verb = "grow"
				}
				fmt.Fprintf(&b, "%s: %s the request %s → %s\n  %s\n  %s\n", t.Pod, verb, mib(t.RequestMiB), mib(t.Advice.RequestMiB), t.Advice.Why, t.Advice.Command)
			}
		}
	}
	if len(seen) == 0 {
		fmt.Fprintf(&b, "no resize to suggest: every tenant with %d readings or more uses about what it is granted\n", MinAdviceSamples)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func roundUp(v, step int64) int64 { return (v + step - 1) / step * step }

// quantity writes MiB as a quantity the resize keys take.
func quantity(v int64) string {
	if v%1024 == 0 {
		return fmt.Sprintf("%dGi", v/1024)
	}
	return fmt.Sprintf("%dMi", v)
}
