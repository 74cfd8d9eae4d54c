package gpu

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"pgregory.net/rapid"

	"github.com/gpufrac/gpufrac/pkg/api"
)

func node(gpus int, model string) *Node {
	var ds []*Device
	for i := range gpus {
		ds = append(ds, &Device{Index: i, UUID: fmt.Sprintf("GPU-%d", i), Model: model, Total: 81920, Reserve: 1024})
	}
	return NewNode("n1", 64000, 262144, ds...)
}

func share(req int64, mode api.ComputeMode, portion int64) Share {
	return Share{Request: req, Limit: req, Mode: mode, Portion: portion}
}

func TestFitExplainsEveryReason(t *testing.T) {
	n := node(2, "H100")
	must := func(r Request, devices ...int) {
		t.Helper()
		if err := n.Assign(r, devices); err != nil {
			t.Fatal(err)
		}
	}
	must(Request{Tenant: "ts", Devices: 1, Share: share(40000, api.TimeSlicing, 0)}, 0)
	must(Request{Tenant: "sm", Devices: 1, Share: share(10000, api.SMSharing, 600)}, 1)

	tests := []struct {
		name string
		r    Request
		want Reason
		fit  []int
	}{
		{"time-slicing fits GPU 0 only (mode)", Request{Tenant: "a", Devices: 1, Share: share(30000, api.TimeSlicing, 0)}, "", []int{0}},
		{"sm-sharing fits GPU 1 only", Request{Tenant: "a", Devices: 1, Share: share(10000, api.SMSharing, 400)}, "", []int{1}},
		{"two GPUs in one mode do not exist", Request{Tenant: "a", Devices: 2, Share: share(1000, api.TimeSlicing, 0)}, ReasonMode, nil},
		{"memory", Request{Tenant: "a", Devices: 1, Share: share(80000, api.TimeSlicing, 0)}, ReasonGPUs, nil},
		{"compute portion", Request{Tenant: "a", Devices: 1, Share: share(1000, api.SMSharing, 500)}, ReasonCompute, nil},
		{"model", Request{Tenant: "a", Devices: 1, Share: share(1, api.TimeSlicing, 0), Models: []string{"A100"}}, ReasonModel, nil},
		{"no idle GPU for a whole-GPU pod", Request{Tenant: "a", Whole: 1}, ReasonWhole, nil},
		{"CPU", Request{Tenant: "a", Devices: 1, Share: share(1, api.TimeSlicing, 0), CPU: 64001}, ReasonCPU, nil},
		{"node memory", Request{Tenant: "a", Devices: 1, Share: share(1, api.TimeSlicing, 0), Memory: 262145}, ReasonMemory, nil},
		{"invalid: limit below request", Request{Tenant: "a", Devices: 1, Share: Share{Request: 2, Limit: 1, Mode: api.TimeSlicing}}, ReasonInvalid, nil},
		{"invalid: both whole and share", Request{Tenant: "a", Whole: 1, Devices: 1, Share: share(1, api.TimeSlicing, 0)}, ReasonInvalid, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fit, unfit := n.Fit(tt.r)
			switch {
			case tt.want == "" && unfit != nil:
				t.Fatalf("unfit: %v", unfit)
			case tt.want == "" && !slices.Equal(fit, tt.fit):
				t.Errorf("fit = %v, want %v", fit, tt.fit)
			case tt.want != "" && (unfit == nil || unfit.Reason != tt.want):
				t.Errorf("got %v (fit %v), want %s", unfit, fit, tt.want)
			}
		})
	}
}

func TestWholeGPUsAndFractionsNeverShare(t *testing.T) {
	n := node(2, "H100")
	if err := n.Assign(Request{Tenant: "whole", Whole: 1}, []int{0}); err != nil {
		t.Fatal(err)
	}
	if fit, _ := n.Fit(Request{Tenant: "f", Devices: 1, Share: share(1, api.TimeSlicing, 0)}); !slices.Equal(fit, []int{1}) {
		t.Errorf("fractions fit %v, want only the idle GPU 1", fit)
	}
	if err := n.Assign(Request{Tenant: "f", Devices: 1, Share: share(1, api.TimeSlicing, 0)}, []int{0}); err == nil {
		t.Error("fraction assigned to a whole-GPU pod's GPU")
	}
	if err := n.Assign(Request{Tenant: "f", Devices: 1, Share: share(1, api.TimeSlicing, 0)}, []int{1}); err != nil {
		t.Fatal(err)
	}
	if _, unfit := n.Fit(Request{Tenant: "w2", Whole: 1}); unfit == nil || unfit.Reason != ReasonWhole {
		t.Errorf("whole GPU onto a shared GPU: %v", unfit)
	}
	if err := n.Assign(Request{Tenant: "f", Devices: 1, Share: share(1, api.TimeSlicing, 0)}, []int{1}); err == nil {
		t.Error("a tenant assigned twice")
	}
	var unfit *Unfit
	_, u := n.Fit(Request{Tenant: "x", Whole: 1})
	if !errors.As(error(u), &unfit) {
		t.Errorf("Unfit is not an error: %T", u)
	}
}

func TestSharedOnlyGPUsTakeSharesNeverWholePods(t *testing.T) {
	n := node(2, "H100")
	n.Devices[0].SharedOnly = true
	if fit, _ := n.Fit(Request{Tenant: "w", Whole: 1}); !slices.Equal(fit, []int{1}) {
		t.Errorf("whole GPUs fit %v, want only GPU 1 (GPU 0 is held for sharing)", fit)
	}
	if _, unfit := n.Fit(Request{Tenant: "w", Whole: 2}); unfit == nil || unfit.Reason != ReasonWhole {
		t.Errorf("two whole GPUs with one held for sharing: %v, want %s", unfit, ReasonWhole)
	}
	if err := n.Assign(Request{Tenant: "w", Whole: 1}, []int{0}); err == nil {
		t.Error("a whole-GPU pod was assigned a GPU held for sharing")
	}
	if fit, _ := n.Fit(Request{Tenant: "f", Devices: 2, Share: share(1024, api.TimeSlicing, 0)}); !slices.Equal(fit, []int{0, 1}) {
		t.Errorf("shares fit %v, want both GPUs", fit)
	}
}

// A Closed GPU takes no new share (Fit), and says so when that is why a
// share does not fit; a tenant that already runs there is still booked
// (Assign, as the scheduler's cache books its tenants again).
func TestClosedGPUsTakeNoNewShare(t *testing.T) {
	n := node(2, "H100")
	n.Devices[0].Closed = true
	if fit, _ := n.Fit(Request{Tenant: "f", Devices: 1, Share: share(1024, api.TimeSlicing, 0)}); !slices.Equal(fit, []int{1}) {
		t.Errorf("shares fit %v, want only GPU 1 (GPU 0 is closed)", fit)
	}
	if _, unfit := n.Fit(Request{Tenant: "f", Devices: 2, Share: share(1024, api.TimeSlicing, 0)}); unfit == nil || unfit.Reason != ReasonUnheld {
		t.Errorf("two GPUs with one closed: %v, want %s", unfit, ReasonUnheld)
	}
	if err := n.Assign(Request{Tenant: "running", Devices: 1, Share: share(1024, api.TimeSlicing, 0)}, []int{0}); err != nil {
		t.Errorf("a tenant running on a closed GPU could not be booked: %v", err)
	}
}

// dump renders the whole ledger, to compare states exactly.
func dump(n *Node) string {
	var b strings.Builder
	cpu, mem := n.Used()
	fmt.Fprintf(&b, "cpu=%d mem=%d held=%v\n", cpu, mem, slices.Sorted(maps.Keys(n.held)))
	for _, d := range n.Devices {
		shares := d.Shares()
		keys := slices.Sorted(maps.Keys(shares))
		fmt.Fprintf(&b, "gpu%d whole=%q charged=%d portion=%d", d.Index, d.Whole(), d.Charged(), d.Portion())
		for _, k := range keys {
			fmt.Fprintf(&b, " %s=%+v", k, shares[k])
		}
		b.WriteString("\n")
	}
	return b.String()
}

// Random sequences of assignments and releases never break an invariant,
// and releasing what was just assigned restores the ledger exactly.
func TestLedgerProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var ds []*Device
		for i := range rapid.IntRange(1, 8).Draw(t, "gpus") {
			total := rapid.Int64Range(1000, 200000).Draw(t, "total")
			ds = append(ds, &Device{Index: i, Model: rapid.SampledFrom([]string{"H100", "A100"}).Draw(t, "model"),
				Total: total, Reserve: rapid.Int64Range(0, total/10).Draw(t, "reserve")})
		}
		n := NewNode("n", rapid.Int64Range(0, 128000).Draw(t, "cpu"), rapid.Int64Range(0, 1<<20).Draw(t, "mem"), ds...)
		var tenants []string
		for step := range rapid.IntRange(1, 60).Draw(t, "steps") {
			if len(tenants) > 0 && rapid.Bool().Draw(t, "release") {
				i := rapid.IntRange(0, len(tenants)-1).Draw(t, "which")
				if err := n.Release(tenants[i]); err != nil {
					t.Fatal(err)
				}
				tenants = slices.Delete(tenants, i, i+1)
			} else {
				r := Request{Tenant: fmt.Sprintf("t%d", step), CPU: rapid.Int64Range(0, 16000).Draw(t, "podcpu"),
					Memory: rapid.Int64Range(0, 65536).Draw(t, "podmem")}
				if rapid.IntRange(0, 4).Draw(t, "kind") == 0 {
					r.Whole = rapid.IntRange(1, 4).Draw(t, "whole")
				} else {
					mode := rapid.SampledFrom([]api.ComputeMode{api.TimeSlicing, api.SMSharing}).Draw(t, "mode")
					req := rapid.Int64Range(1, 100000).Draw(t, "request")
					r.Devices = rapid.IntRange(1, 3).Draw(t, "devices")
					r.Share = Share{Request: req, Limit: req + rapid.Int64Range(0, 1000).Draw(t, "burst"), Mode: mode}
					if mode == api.SMSharing {
						r.Share.Portion = rapid.Int64Range(1, 1000).Draw(t, "portion")
					}
				}
				if rapid.Bool().Draw(t, "constrained") {
					r.Models = []string{"H100"}
				}
				before := dump(n)
				fit, unfit := n.Fit(r)
				if unfit != nil {
					if err := n.Assign(r, fit); err == nil {
						t.Fatalf("assigned a request Fit rejected: %v", unfit)
					}
					if dump(n) != before {
						t.Fatal("a rejected Assign changed the ledger")
					}
					continue
				}
				chosen := rapid.Permutation(fit).Draw(t, "order")[:max(r.Whole, r.Devices)]
				if err := n.Assign(r, chosen); err != nil {
					t.Fatalf("Assign on devices Fit offered: %v", err)
				}
				if err := n.Check(); err != nil {
					t.Fatal(err)
				}
				if rapid.Bool().Draw(t, "undo") {
					if err := n.Release(r.Tenant); err != nil {
						t.Fatal(err)
					}
					if after := dump(n); after != before {
						t.Fatalf("Release is not the inverse of Assign:\nbefore %s\nafter  %s", before, after)
					}
					continue
				}
				tenants = append(tenants, r.Tenant)
			}
			if err := n.Check(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// Record books what a cluster reports, broken or not, and Violations names
// each broken promise with its tenants; Assign would have refused them all.
func TestRecordKeepsWhatRunsAndViolationsSayWhatItBreaks(t *testing.T) {
	n := node(3, "H100") // 80896 schedulable per GPU
	book := func(tenant string, r Request, devices ...int) {
		t.Helper()
		r.Tenant = tenant
		if err := n.Record(r, devices); err != nil {
			t.Fatalf("Record %s: %v", tenant, err)
		}
	}
	book("big1", Request{Devices: 1, Share: share(50000, api.TimeSlicing, 0)}, 0)
	book("big2", Request{Devices: 1, Share: share(40000, api.TimeSlicing, 0)}, 0)
	book("sm1", Request{Devices: 1, Share: share(1000, api.SMSharing, 600)}, 1)
	book("sm2", Request{Devices: 1, Share: share(1000, api.SMSharing, 600)}, 1)
	book("ts", Request{Devices: 1, Share: share(1000, api.TimeSlicing, 0)}, 1)
	book("whole", Request{Whole: 1}, 2)
	book("squatter", Request{Devices: 1, Share: share(1000, api.TimeSlicing, 0)}, 2)
	got := map[ViolationKind][]string{}
	for _, v := range n.Violations() {
		got[v.Kind] = append(got[v.Kind], fmt.Sprintf("%d %v", v.Device, v.Tenants))
	}
	want := map[ViolationKind][]string{
		OverCommitted:  {"0 [big1 big2]"},
		MixedModes:     {"1 [sm1 sm2 ts]"},
		ComputeOverOne: {"1 [sm1 sm2 ts]"},
		WholeShared:    {"2 [whole squatter]"},
	}
	if !maps.EqualFunc(got, want, slices.Equal) {
		t.Errorf("violations %v, want %v", got, want)
	}
	if err := n.Check(); err == nil {
		t.Error("Check passes a ledger that breaks its invariants")
	}
	for _, bad := range []struct {
		r       Request
		devices []int
	}{
		{Request{Tenant: "big1", Whole: 1}, []int{1}}, // booked twice
		{Request{Tenant: "x", Whole: 1}, []int{2}},    // held whole already
		{Request{Tenant: "y", Devices: 1}, []int{0}},  // invalid share
		{Request{Tenant: "z", Whole: 1}, []int{7}},    // not a device
		{Request{Tenant: "w", Whole: 2}, []int{0, 0}}, // repeated
		{Request{Tenant: "v", Whole: 2}, []int{0}},    // too few
	} {
		if err := n.Record(bad.r, bad.devices); err == nil {
			t.Errorf("Record(%+v, %v) accepted", bad.r, bad.devices)
		}
	}
	for _, tenant := range []string{"big1", "big2", "sm1", "sm2", "ts", "whole", "squatter"} {
		if err := n.Release(tenant); err != nil {
			t.Fatal(err)
		}
	}
	if v := n.Violations(); len(v) > 0 || n.Check() != nil {
		t.Errorf("after release: %v, %v", v, n.Check())
	}
}

// A host view rates like the ledger with the host's CPU and memory, and
// books nothing: the ledger it was taken from stays as it was.
func TestHostViewReadsAndNeverBooks(t *testing.T) {
	n := NewNode("n", 0, 0, &Device{Index: 0, Total: 1000}, &Device{Index: 1, Total: 1000})
	v := n.WithHost(4000, 3000, 1024, 0)
	r := Request{Tenant: "t", Whole: 1, CPU: 2000}
	if _, unfit := v.Fit(r); unfit == nil || unfit.Reason != ReasonCPU {
		t.Errorf("Fit on a view with 1000m CPU free: %v, want %s", unfit, ReasonCPU)
	}
	r.CPU = 500
	if err := v.Assign(r, []int{0}); err == nil {
		t.Error("Assign booked on a host view")
	}
	if err := v.Record(r, []int{0}); err == nil {
		t.Error("Record booked on a host view")
	}
	if !n.Devices[0].Idle() || n.Devices[0].Whole() != "" {
		t.Error("booking on a view changed the ledger's GPU")
	}
	if cpu, _ := n.Used(); cpu != 0 || n.CPU != 0 {
		t.Errorf("the ledger's CPU changed: used %d of %d", cpu, n.CPU)
	}
}

func TestResizeGrowsOnlyIntoFreeMemoryAndNeverMoves(t *testing.T) {
	n := node(2, "H100") // 80Gi less 1Gi reserve each
	if err := n.Assign(Request{Tenant: "a", Devices: 1, Share: share(8192, api.TimeSlicing, 0)}, []int{0}); err != nil {
		t.Fatal(err)
	}
	if err := n.Assign(Request{Tenant: "b", Devices: 1, Share: share(60000, api.TimeSlicing, 0)}, []int{0}); err != nil {
		t.Fatal(err)
	}
	free := n.Devices[0].Free() // 80896 - 68192 = 12704
	for _, c := range []struct {
		name   string
		share  Share
		reason Reason // "" when it fits
	}{
		{"grow into the free memory", share(8192+free, api.TimeSlicing, 0), ""},
		{"grow past it", share(8192+free+1, api.TimeSlicing, 0), ReasonGPUs},
		{"larger than the GPU", share(80897, api.TimeSlicing, 0), ReasonTooLarge},
		{"shrink", share(1024, api.TimeSlicing, 0), ""},
		{"a burst limit is not charged", Share{Request: 8192, Limit: 80000, Mode: api.TimeSlicing}, ""},
		{"another mode", share(8192, api.SMSharing, 100), ReasonMode},
		{"limit below request", Share{Request: 8192, Limit: 4096, Mode: api.TimeSlicing}, ReasonInvalid},
	} {
		t.Run(c.name, func(t *testing.T) {
			u := n.FitResize("a", c.share)
			if (u == nil) != (c.reason == "") || (u != nil && u.Reason != c.reason) {
				t.Fatalf("FitResize = %v, want reason %q", u, c.reason)
			}
		})
	}
	if u := n.FitResize("nobody", share(1, api.TimeSlicing, 0)); u == nil {
		t.Error("a tenant that holds nothing can be resized")
	}
	if err := n.Resize("a", share(8192+free, api.TimeSlicing, 0)); err != nil {
		t.Fatal(err)
	}
	if d := n.Devices[0]; d.Free() != 0 || d.Charged() != 8192+free+60000 || d.Shares()["a"].Request != 8192+free {
		t.Errorf("after the grow: free %d, charged %d, shares %v", d.Free(), d.Charged(), d.Shares())
	}
	if held, _ := n.Holds("a"); !slices.Equal(held, []int{0}) {
		t.Errorf("the resized tenant holds %v, want GPU 0 still", held)
	}
	if err := n.Check(); err != nil {
		t.Error(err)
	}
	// Released after a resize, the GPU is as before the tenant came.
	if err := n.Release("a"); err != nil {
		t.Fatal(err)
	}
	if d := n.Devices[0]; d.Charged() != 60000 {
		t.Errorf("after release: charged %d, want b's 60000", d.Charged())
	}
}

// A clone books and releases apart from its original: preemption's what-if
// removes victims from a clone while the cache's ledger keeps them.
func TestCloneIsIndependent(t *testing.T) {
	n := node(2, "H100")
	if err := n.Assign(Request{Tenant: "a", Devices: 1, Share: share(40000, api.SMSharing, 500)}, []int{0}); err != nil {
		t.Fatal(err)
	}
	if err := n.Assign(Request{Tenant: "w", Whole: 1}, []int{1}); err != nil {
		t.Fatal(err)
	}
	c := n.Clone()
	if err := c.Release("a"); err != nil {
		t.Fatal(err)
	}
	if err := c.Release("w"); err != nil {
		t.Fatal(err)
	}
	if err := c.Assign(Request{Tenant: "b", Devices: 2, Share: share(80000, api.TimeSlicing, 0)}, []int{0, 1}); err != nil {
		t.Fatalf("the clone with both tenants gone: %v", err)
	}
	if d := n.Devices[0]; d.Charged() != 40000 || d.Portion() != 500 || d.Mode() != api.SMSharing || n.Devices[1].Whole() != "w" {
		t.Errorf("the original changed with its clone: GPU 0 charged %d portion %d mode %s, GPU 1 whole %q", d.Charged(), d.Portion(), d.Mode(), n.Devices[1].Whole())
	}
	if _, held := n.Holds("b"); held {
		t.Error("a tenant booked on the clone is held by the original")
	}
	if err := n.Check(); err != nil {
		t.Error(err)
	}
	if err := c.Check(); err != nil {
		t.Error(err)
	}
}
