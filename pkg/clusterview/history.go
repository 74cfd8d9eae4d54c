package clusterview

import "time"

// Sample is one reading in a short history: when (Unix seconds), the
// memory in use and the SM utilisation (nil: unknown).
type Sample struct {
	At      int64  `json:"t"`
	UsedMiB int64  `json:"u"`
	SM      *int64 `json:"sm,omitempty"`
}

// History is the dashboard's short memory of use, per GPU and per tenant
// on a GPU: the readings of the last Span, in memory only (no database:
// a restarted dashboard starts again). Each reading is kept once, however
// often the view is rebuilt in between.
type History struct {
	Span    time.Duration
	gpus    map[string][]Sample // node/uuid
	tenants map[string][]Sample // node/uuid/pod
}

// NewHistory remembers span of readings.
func NewHistory(span time.Duration) *History {
	return &History{Span: span, gpus: map[string][]Sample{}, tenants: map[string][]Sample{}}
}

// Record adds v's readings and forgets the GPUs and tenants v no longer
// has.
func (h *History) Record(v View) {
	seenGPU, seenTenant := map[string]bool{}, map[string]bool{}
	for _, n := range v.Nodes {
		if n.UsageAt.IsZero() {
			continue
		}
		at := n.UsageAt.Unix()
		cutoff := n.UsageAt.Add(-h.Span).Unix()
		for _, g := range n.Shared {
			key := n.Name + "/" + g.UUID
			if g.Use != nil && g.Use.UsedMiB != nil {
				seenGPU[key] = true
				h.gpus[key] = appendSample(h.gpus[key], Sample{At: at, UsedMiB: *g.Use.UsedMiB, SM: g.Use.SMPercent}, cutoff)
			}
			for _, t := range g.Tenants {
				if t.Use == nil || t.Use.UsedMiB == nil {
					continue
				}
				key := key + "/" + t.Pod
				seenTenant[key] = true
				h.tenants[key] = appendSample(h.tenants[key], Sample{At: at, UsedMiB: *t.Use.UsedMiB, SM: t.Use.SMPercent}, cutoff)
			}
		}
	}
	for k := range h.gpus {
		if !seenGPU[k] {
			delete(h.gpus, k)
		}
	}
	for k := range h.tenants {
		if !seenTenant[k] {
			delete(h.tenants, k)
		}
	}
}

func appendSample(s []Sample, x Sample, cutoff int64) []Sample {
	if len(s) > 0 && s[len(s)-1].At >= x.At {
		return s // the same reading, seen again
	}
	s = append(s, x)
	first := 0
	for first < len(s) && s[first].At <= cutoff {
		first++
	}
	return s[first:]
}

// Attach puts the histories into v's GPUs and tenants.
func (h *History) Attach(v *View) {
	for i := range v.Nodes {
		n := &v.Nodes[i]
		for j := range n.Shared {
			g := &n.Shared[j]
			key := n.Name + "/" + g.UUID
			g.History = h.gpus[key]
			for k := range g.Tenants {
				g.Tenants[k].History = h.tenants[key+"/"+g.Tenants[k].Pod]
			}
		}
	}
}
