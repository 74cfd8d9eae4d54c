package usage

import (
	"hash/fnv"
	"math"
	"time"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// The simulated loads a pod on a simulated node may name
// (api.SimulatedLoadAnnotation); without one, its name picks one.
const (
	LoadIdle   = "idle"   // holds a few percent of its request, computes nothing
	LoadSteady = "steady" // about half its request, a third of the SMs
	LoadBusy   = "busy"   // close to its request, most of the SMs
	LoadBursty = "bursty" // swings from a third of its request up to its limit
	// LoadGreedy holds most of its limit all along: above its request
	// whenever its limit is, a share burst reclaim stops first. Only an
	// annotation names it (Loads, which names pick from, leaves it out).
	LoadGreedy = "greedy"
)

// Loads are the simulated loads, in the order a pod's name picks them.
var Loads = []string{LoadIdle, LoadSteady, LoadBusy, LoadBursty}

// Model is what a simulated node's GPUs report: a deterministic use per
// tenant, a function of its pod's load, its grant and the time (a slow
// wave), so that `make demo`, `gpufrac top` and the dashboard show use
// on a machine with no GPU, the same on every run at the same time.
type Model struct{}

// LoadOf is the simulated load of a tenant: its pod's annotation if it
// names one, else one picked by its pod's name.
func LoadOf(t Tenant) string {
	if t.Load == LoadGreedy {
		return LoadGreedy
	}
	for _, l := range Loads {
		if t.Load == l {
			return l
		}
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(t.PodKey()))
	return Loads[h.Sum32()%uint32(len(Loads))]
}

// Measure is the model's reading of tenants at now.
func (Model) Measure(tenants []Tenant, gpus []string, now time.Time) Measurement {
	m := Measurement{At: now}
	used := map[string]int64{}
	sm := map[string]int64{}
	for _, t := range tenants {
		h := fnv.New32a()
		_, _ = h.Write([]byte(t.PodKey() + "/" + t.Container))
		phase := float64(h.Sum32()%1000) / 1000 * 2 * math.Pi
		// One wave of ten minutes, another of 47 seconds: readings a
		// resync apart differ, and a window has a shape.
		slow := math.Sin(2*math.Pi*float64(now.Unix()%600)/600 + phase)
		fast := math.Sin(2*math.Pi*float64(now.Unix()%47)/47 + phase)
		req, limit := float64(t.RequestMiB), float64(max(t.LimitMiB, t.RequestMiB))
		var memMiB, smPct float64
		switch LoadOf(t) {
		case LoadIdle:
			memMiB, smPct = req*(0.04+0.01*fast), 0
		case LoadSteady:
			memMiB, smPct = req*(0.55+0.05*slow+0.01*fast), 35+5*fast
		case LoadBusy:
			memMiB, smPct = req*(0.93+0.03*slow+0.01*fast), 88+6*fast
		case LoadBursty:
			low, high := req/3, limit
			memMiB, smPct = low+(high-low)*(0.5+0.5*slow), 50+40*slow
		case LoadGreedy:
			memMiB, smPct = limit*(0.95+0.02*slow+0.01*fast), 60+10*fast
		}
		portion := 1.0
		if t.Mode == api.SMSharing {
			portion = 0.5 // a share of the SMs cannot use them all
		}
		for _, uuid := range t.Devices {
			c := Container{Tenant: t, GPU: uuid, Processes: 1,
				MemoryBytes: Known(int64(math.Max(memMiB, 1)) << 20), SMPercent: Known(int64(math.Round(math.Max(smPct*portion, 0))))}
			used[uuid] += c.MemoryBytes.Value
			sm[uuid] += c.SMPercent.Value
			m.Containers = append(m.Containers, c)
		}
	}
	for _, uuid := range gpus {
		m.GPUs = append(m.GPUs, GPU{UUID: uuid, MemoryBytes: Known(used[uuid]), UnattributedBytes: Known(0), SMPercent: Known(min(sm[uuid], 100)),
			PerProcessMemory: true, PerProcessSM: true})
	}
	return m
}
