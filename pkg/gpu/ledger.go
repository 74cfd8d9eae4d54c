// Package gpu keeps one node's GPU ledger: each GPU's capacity, reserve
// and tenants (fractional shares with their mode and compute portion, or a
// whole-GPU owner), plus the node's CPU and memory. Fit says where a
// request can go and, when nowhere, why; Assign and Release are exact
// inverses. The invariants the scheduler promises (no GPU's requests above
// its schedulable memory, one compute mode per GPU, sm-sharing portions at
// most 1, whole GPUs never shared) are enforced here. The package is pure:
// amounts are plain integers (MiB in the scheduler, milli-GPU in the
// simulator), so both use the same ledger.
package gpu

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// FullPortion is a whole GPU's compute, in thousandths.
const FullPortion = 1000

// Share is a fractional tenant's part of one GPU.
type Share struct {
	// Request is charged against the GPU's schedulable memory.
	Request int64
	// Limit is the tenant's hard cap; it is not charged.
	Limit int64
	Mode  api.ComputeMode
	// Portion is the sm-sharing compute share in thousandths (0 for
	// time-slicing).
	Portion int64
}

// Device is one GPU.
type Device struct {
	Index   int
	UUID    string
	Model   string
	Total   int64
	Reserve int64
	// SharedOnly marks a GPU held for sharing at all times: a standing
	// reservation pod holds it against the device plugin, so that shares
	// from either front door (annotations, DRA claims) can land on it
	// while no whole-GPU pod can. Shares may use it; whole GPUs may not.
	SharedOnly bool
	// Closed marks a GPU no new share may join: tenants run on it whose
	// reservation pod is gone (deleted under them), so nothing holds it
	// against the device plugin any more, and a reservation pod made again
	// for their group would be given whichever GPU is free, not this one.
	// It opens again once its tenants are gone.
	Closed bool

	whole   string           // the whole-GPU tenant, if any
	shares  map[string]Share // fractional tenants
	charged int64            // sum of the shares' requests
	portion int64            // sum of the shares' portions
}

// Schedulable is the memory fractions may be charged: total − reserve.
func (d *Device) Schedulable() int64 { return max(d.Total-d.Reserve, 0) }

// Free is the schedulable memory no tenant holds (0 when a whole-GPU
// tenant owns the GPU).
func (d *Device) Free() int64 {
	if d.whole != "" {
		return 0
	}
	return d.Schedulable() - d.charged
}

// Idle reports whether the GPU has no tenant at all.
func (d *Device) Idle() bool { return d.whole == "" && len(d.shares) == 0 }

// Whole returns the whole-GPU tenant, or "".
func (d *Device) Whole() string { return d.whole }

// Mode is the compute mode of the GPU's fractional tenants ("" when none).
func (d *Device) Mode() api.ComputeMode {
	for _, s := range d.shares {
		return s.Mode
	}
	return ""
}

// Charged is the sum of the fractional tenants' requests.
func (d *Device) Charged() int64 { return d.charged }

// Portion is the sum of the sm-sharing tenants' portions, in thousandths.
func (d *Device) Portion() int64 { return d.portion }

// Shares returns a copy of the fractional tenants' shares.
func (d *Device) Shares() map[string]Share { return maps.Clone(d.shares) }

// Request is what a tenant asks of a node: either Whole GPUs, or the same
// Share on each of Devices distinct GPUs; and CPU and memory.
type Request struct {
	Tenant  string
	Whole   int
	Devices int
	Share   Share
	// CPU (milli-CPU) and Memory are charged against the node's when it
	// tracks them.
	CPU, Memory int64
	// Models restricts the GPU model; empty allows any.
	Models []string
}

// Reason says why a request does not fit a node.
type Reason string

// The reasons, most specific first.
const (
	ReasonCPU     Reason = "InsufficientCPU"
	ReasonMemory  Reason = "InsufficientMemory"
	ReasonModel   Reason = "GPUModelNotAllowed"
	ReasonWhole   Reason = "NotEnoughIdleGPUs"
	ReasonGPUs    Reason = "NotEnoughGPUMemory"
	ReasonMode    Reason = "ComputeModeConflict"
	ReasonCompute Reason = "ComputePortionExceeded"
	ReasonInvalid Reason = "InvalidRequest"
	ReasonUnheld  Reason = "GPUNotHeldForShares"
	// ReasonTooLarge: a share larger than its GPU's schedulable memory,
	// which no amount of freeing makes fit.
	ReasonTooLarge Reason = "LargerThanGPU"
)

// Unfit explains a rejection: the reason and the numbers behind it.
type Unfit struct {
	Reason Reason
	Detail string
}

func (u *Unfit) Error() string { return string(u.Reason) + ": " + u.Detail }

// Node is one node's ledger.
type Node struct {
	Name string
	// CPU (milli-CPU) and Memory are the node's allocatable amounts; 0
	// means not tracked.
	CPU, Memory int64
	Devices     []*Device

	cpuUsed, memUsed int64
	held             map[string]holding
}

// holding is what one tenant holds, for Release.
type holding struct {
	Request Request
	Devices []int
}

// NewNode returns an empty ledger over devices.
func NewNode(name string, cpu, memory int64, devices ...*Device) *Node {
	for _, d := range devices {
		d.shares = map[string]Share{}
	}
	return &Node{Name: name, CPU: cpu, Memory: memory, Devices: devices, held: map[string]holding{}}
}

// Fit returns the indices (into Devices) of every GPU that could take the
// request, or why the node cannot: at least Whole idle GPUs, or Devices
// distinct GPUs, none Closed, each with the share's request free, a
// compatible mode and, for sm-sharing, compute left.
func (n *Node) Fit(r Request) ([]int, *Unfit) { return n.fit(r, true) }

// fit is Fit; closing says whether Closed GPUs are refused: they are to a
// new share (Fit), not to a tenant that already runs there (Assign books
// the cache's tenants again on a rebuild, and new ones only on GPUs Fit
// chose).
func (n *Node) fit(r Request, closing bool) ([]int, *Unfit) {
	if u := validate(r); u != nil {
		return nil, u
	}
	if n.CPU > 0 && n.cpuUsed+r.CPU > n.CPU {
		return nil, &Unfit{ReasonCPU, fmt.Sprintf("requested %dm CPU, %dm of %dm free", r.CPU, n.CPU-n.cpuUsed, n.CPU)}
	}
	if n.Memory > 0 && n.memUsed+r.Memory > n.Memory {
		return nil, &Unfit{ReasonMemory, fmt.Sprintf("requested %d memory, %d of %d free", r.Memory, n.Memory-n.memUsed, n.Memory)}
	}
	var fit []int
	var modelOK, openOK, memoryOK, modeOK int
	for i, d := range n.Devices {
		if len(r.Models) > 0 && !slices.Contains(r.Models, d.Model) {
			continue
		}
		modelOK++
		if r.Whole > 0 {
			if d.Idle() && !d.SharedOnly {
				fit = append(fit, i)
			}
			continue
		}
		if closing && d.Closed {
			continue
		}
		openOK++
		if d.Free() < r.Share.Request {
			continue
		}
		memoryOK++
		if m := d.Mode(); m != "" && m != r.Share.Mode {
			continue
		}
		modeOK++
		if r.Share.Mode == api.SMSharing && d.portion+r.Share.Portion > FullPortion {
			continue
		}
		fit = append(fit, i)
	}
	need := max(r.Whole, r.Devices)
	if len(fit) >= need {
		return fit, nil
	}
	switch {
	case modelOK < need:
		return nil, &Unfit{ReasonModel, fmt.Sprintf("%d GPUs of models %s, %d needed", modelOK, strings.Join(r.Models, "|"), need)}
	case r.Whole > 0:
		return nil, &Unfit{ReasonWhole, fmt.Sprintf("%d idle GPUs, %d needed", len(fit), need)}
	case openOK < need:
		return nil, &Unfit{ReasonUnheld, fmt.Sprintf("%d GPUs open to new shares, %d needed (the others run shares whose reservation pod is gone)", openOK, need)}
	case memoryOK < need:
		return nil, &Unfit{ReasonGPUs, fmt.Sprintf("%d GPUs with %d free, %d needed", memoryOK, r.Share.Request, need)}
	case modeOK < need:
		return nil, &Unfit{ReasonMode, fmt.Sprintf("%d GPUs free for %s, %d needed", modeOK, r.Share.Mode, need)}
	}
	return nil, &Unfit{ReasonCompute, fmt.Sprintf("%d GPUs with %d/1000 compute left, %d needed", len(fit), r.Share.Portion, need)}
}

func validate(r Request) *Unfit {
	bad := func(format string, args ...any) *Unfit { return &Unfit{ReasonInvalid, fmt.Sprintf(format, args...)} }
	switch {
	case r.Tenant == "":
		return bad("no tenant")
	case r.Whole < 0 || r.Devices < 0 || r.CPU < 0 || r.Memory < 0:
		return bad("negative amounts")
	case r.Whole > 0 && r.Devices > 0:
		return bad("whole GPUs and a share at once")
	case r.Devices > 0 && (r.Share.Request <= 0 || r.Share.Limit < r.Share.Request):
		return bad("share request %d, limit %d: want 0 < request ≤ limit", r.Share.Request, r.Share.Limit)
	case r.Devices > 0 && r.Share.Mode != api.TimeSlicing && r.Share.Mode != api.SMSharing:
		return bad("compute mode %q", r.Share.Mode)
	case r.Devices > 0 && r.Share.Mode == api.SMSharing && (r.Share.Portion <= 0 || r.Share.Portion > FullPortion):
		return bad("sm-sharing portion %d/1000", r.Share.Portion)
	case r.Devices > 0 && r.Share.Mode == api.TimeSlicing && r.Share.Portion != 0:
		return bad("time-slicing with a compute portion")
	}
	return nil
}

// Assign gives the tenant the request on exactly the given devices, which
// must be distinct, as many as asked, and each able to take it.
func (n *Node) Assign(r Request, devices []int) error {
	if n.held == nil {
		return fmt.Errorf("node %s: a host view (WithHost) books nothing; assign on the ledger itself", n.Name)
	}
	if _, taken := n.held[r.Tenant]; taken {
		return fmt.Errorf("tenant %s already holds resources on node %s", r.Tenant, n.Name)
	}
	fit, unfit := n.fit(r, false)
	if unfit != nil {
		return fmt.Errorf("node %s: %w", n.Name, unfit)
	}
	need := max(r.Whole, r.Devices)
	if len(devices) != need {
		return fmt.Errorf("tenant %s: %d devices given, %d needed", r.Tenant, len(devices), need)
	}
	seen := map[int]bool{}
	for _, i := range devices {
		if seen[i] || !slices.Contains(fit, i) {
			return fmt.Errorf("tenant %s: device %d is repeated or cannot take the request", r.Tenant, i)
		}
		seen[i] = true
	}
	n.book(r, devices)
	return nil
}

// book charges a checked request to its devices: Assign's and Record's
// shared last step, of which Release is the inverse.
func (n *Node) book(r Request, devices []int) {
	for _, i := range devices {
		d := n.Devices[i]
		if r.Whole > 0 {
			d.whole = r.Tenant
			continue
		}
		d.shares[r.Tenant] = r.Share
		d.charged += r.Share.Request
		d.portion += r.Share.Portion
	}
	n.cpuUsed += r.CPU
	n.memUsed += r.Memory
	n.held[r.Tenant] = holding{Request: r, Devices: slices.Clone(devices)}
}

// Release returns everything the tenant holds.
func (n *Node) Release(tenant string) error {
	h, ok := n.held[tenant]
	if !ok {
		return fmt.Errorf("tenant %s holds nothing on node %s", tenant, n.Name)
	}
	for _, i := range h.Devices {
		d := n.Devices[i]
		if h.Request.Whole > 0 {
			d.whole = ""
			continue
		}
		delete(d.shares, tenant)
		d.charged -= h.Request.Share.Request
		d.portion -= h.Request.Share.Portion
	}
	n.cpuUsed -= h.Request.CPU
	n.memUsed -= h.Request.Memory
	delete(n.held, tenant)
	return nil
}

// FitResize says why a share tenant's share cannot become s on the GPUs it
// holds, or nil when it can: the same mode and compute portion (a running
// client's compute ceiling cannot change), and on each GPU the new request
// within what is free plus the tenant's own. A shrink always fits.
func (n *Node) FitResize(tenant string, s Share) *Unfit {
	h, ok := n.held[tenant]
	if !ok || h.Request.Devices == 0 {
		return &Unfit{ReasonInvalid, fmt.Sprintf("tenant %s holds no share on node %s", tenant, n.Name)}
	}
	old := h.Request.Share
	r := h.Request
	r.Share = s
	if u := validate(r); u != nil {
		return u
	}
	if s.Mode != old.Mode || s.Portion != old.Portion {
		return &Unfit{ReasonMode, fmt.Sprintf("a resize changes memory only: mode %s and compute portion %d/1000 stay", old.Mode, old.Portion)}
	}
	for _, i := range h.Devices {
		d := n.Devices[i]
		switch {
		case s.Request > d.Schedulable():
			return &Unfit{ReasonTooLarge, fmt.Sprintf("GPU %d has %dMi schedulable memory, %dMi asked", d.Index, d.Schedulable(), s.Request)}
		case s.Request > old.Request && d.Free()+old.Request < s.Request:
			return &Unfit{ReasonGPUs, fmt.Sprintf("GPU %d has %dMi free beside this share's %dMi, %dMi asked", d.Index, d.Free(), old.Request, s.Request)}
		}
	}
	return nil
}

// Resize changes a share tenant's share in place on the GPUs it holds, as
// the cluster reports it (as Record, fitting or not: Violations says what
// it breaks); FitResize is what the scheduler asks first.
func (n *Node) Resize(tenant string, s Share) error {
	h, ok := n.held[tenant]
	if !ok || h.Request.Devices == 0 {
		return fmt.Errorf("tenant %s holds no share on node %s", tenant, n.Name)
	}
	r := h.Request
	r.Share = s
	if u := validate(r); u != nil {
		return fmt.Errorf("node %s: %w", n.Name, u)
	}
	for _, i := range h.Devices {
		d := n.Devices[i]
		d.shares[tenant] = s
		d.charged += s.Request - h.Request.Share.Request
		d.portion += s.Portion - h.Request.Share.Portion
	}
	n.held[tenant] = holding{Request: r, Devices: h.Devices}
	return nil
}

// Holds returns the devices a tenant holds, and whether it holds any.
func (n *Node) Holds(tenant string) ([]int, bool) {
	h, ok := n.held[tenant]
	return slices.Clone(h.Devices), ok
}

// Held returns what a tenant holds: its request and devices, and whether
// it holds anything.
func (n *Node) Held(tenant string) (Request, []int, bool) {
	h, ok := n.held[tenant]
	return h.Request, slices.Clone(h.Devices), ok
}

// Used returns the node's charged CPU and memory.
func (n *Node) Used() (cpu, memory int64) { return n.cpuUsed, n.memUsed }

// WithHost returns n as seen with its host's CPU (milli-CPU) and memory:
// what the node can allocate and what its pods already request, GPU or
// not. The scheduler's ledger books GPUs only, while kube-scheduler counts
// every pod's CPU and memory; the policies need both to see GPUs the host
// can no longer feed. The copy shares n's GPUs and is for reading (Fit,
// the policies' scores): Assign and Record refuse to book on it.
func (n *Node) WithHost(cpu, cpuUsed, memory, memUsed int64) *Node {
	return n.WithHostIn(new(Node), cpu, cpuUsed, memory, memUsed)
}

// WithHostIn is WithHost written into dst, which it returns: for callers
// that rate many nodes and keep one view per node rather than allocate.
func (n *Node) WithHostIn(dst *Node, cpu, cpuUsed, memory, memUsed int64) *Node {
	*dst = *n
	dst.CPU, dst.cpuUsed, dst.Memory, dst.memUsed = cpu, cpuUsed, memory, memUsed
	dst.held = nil
	return dst
}

// Clone is a deep copy of the ledger, to book and release on without
// touching n: preemption weighs the node with some tenants gone and
// others added (scheduler's what-if). A host view (WithHost) clones into
// a host view.
func (n *Node) Clone() *Node {
	c := *n
	c.Devices = make([]*Device, len(n.Devices))
	for i, d := range n.Devices {
		dc := *d
		dc.shares = maps.Clone(d.shares)
		if dc.shares == nil {
			dc.shares = map[string]Share{}
		}
		c.Devices[i] = &dc
	}
	if n.held != nil {
		c.held = make(map[string]holding, len(n.held))
		for t, h := range n.held {
			c.held[t] = holding{Request: h.Request, Devices: slices.Clone(h.Devices)}
		}
	}
	return &c
}

// Record books the tenant on exactly the given devices as the cluster
// reports it, whether or not it fits: an audit, or a view of what runs,
// must count every pod the API shows, and Violations then says what the
// booking breaks. Only the bookkeeping is checked (a valid request, a
// tenant booked once, distinct devices of the node, as many as asked).
func (n *Node) Record(r Request, devices []int) error {
	if n.held == nil {
		return fmt.Errorf("node %s: a host view (WithHost) books nothing; record on the ledger itself", n.Name)
	}
	if _, taken := n.held[r.Tenant]; taken {
		return fmt.Errorf("tenant %s already holds resources on node %s", r.Tenant, n.Name)
	}
	if u := validate(r); u != nil {
		return fmt.Errorf("node %s: %w", n.Name, u)
	}
	if need := max(r.Whole, r.Devices); len(devices) != need {
		return fmt.Errorf("tenant %s: %d devices given, %d needed", r.Tenant, len(devices), need)
	}
	seen := map[int]bool{}
	for _, i := range devices {
		if seen[i] || i < 0 || i >= len(n.Devices) {
			return fmt.Errorf("tenant %s: device %d is repeated or not on node %s", r.Tenant, i, n.Name)
		}
		seen[i] = true
	}
	for _, i := range devices {
		if d := n.Devices[i]; r.Whole > 0 && d.whole != "" {
			return fmt.Errorf("tenant %s: GPU %d is already held whole by %s", r.Tenant, d.Index, d.whole)
		}
	}
	n.book(r, devices)
	return nil
}

// Violation is one GPU breaking a promise the ledger keeps, with the
// tenants involved.
type Violation struct {
	// Device is the index into the node's Devices.
	Device  int
	Kind    ViolationKind
	Detail  string
	Tenants []string
}

// ViolationKind names the promise broken.
type ViolationKind string

// The promises of SPEC §2 a GPU can break.
const (
	OverCommitted  ViolationKind = "OverCommitted"
	MixedModes     ViolationKind = "MixedModes"
	ComputeOverOne ViolationKind = "ComputeOverOne"
	WholeShared    ViolationKind = "WholeShared"
)

// Violations lists every GPU invariant the node's bookings break, GPU by
// GPU. A ledger filled by Assign has none; one filled by Record has those
// of the cluster it was read from. A device of unknown size (Total 0) is
// not judged for memory.
func (n *Node) Violations() []Violation {
	var out []Violation
	for i, d := range n.Devices {
		tenants := slices.Sorted(maps.Keys(d.shares))
		modes := map[api.ComputeMode]bool{}
		for _, s := range d.shares {
			modes[s.Mode] = true
		}
		if d.Total > 0 && d.charged > d.Schedulable() {
			out = append(out, Violation{i, OverCommitted, fmt.Sprintf("tenants request %d of %d schedulable (%d − %d reserve)", d.charged, d.Schedulable(), d.Total, d.Reserve), tenants})
		}
		if len(modes) > 1 {
			out = append(out, Violation{i, MixedModes, fmt.Sprintf("runs both %s and %s", api.TimeSlicing, api.SMSharing), tenants})
		}
		if d.portion > FullPortion {
			out = append(out, Violation{i, ComputeOverOne, fmt.Sprintf("sm-sharing portions sum to %d/1000", d.portion), tenants})
		}
		if d.whole != "" && len(d.shares) > 0 {
			out = append(out, Violation{i, WholeShared, fmt.Sprintf("held whole by %s and shared by fractions", d.whole), append([]string{d.whole}, tenants...)})
		}
	}
	return out
}

// Check verifies every invariant and the ledger's own sums; a ledger
// filled by Assign keeps them, so an error there is a bug to report.
func (n *Node) Check() error {
	var cpu, mem int64
	for _, h := range n.held {
		cpu += h.Request.CPU
		mem += h.Request.Memory
	}
	if cpu != n.cpuUsed || mem != n.memUsed || (n.CPU > 0 && cpu > n.CPU) || (n.Memory > 0 && mem > n.Memory) {
		return fmt.Errorf("node %s: CPU %d/%d, memory %d/%d (held: %d, %d)", n.Name, n.cpuUsed, n.CPU, n.memUsed, n.Memory, cpu, mem)
	}
	for _, d := range n.Devices {
		var charged, portion int64
		for tenant, s := range d.shares {
			charged += s.Request
			portion += s.Portion
			if h, ok := n.held[tenant]; !ok || !slices.Contains(h.Devices, slices.Index(n.Devices, d)) {
				return fmt.Errorf("GPU %d: share of %s not recorded as held", d.Index, tenant)
			}
		}
		if charged != d.charged || portion != d.portion {
			return fmt.Errorf("GPU %d: charged %d (sum %d), portion %d (sum %d)", d.Index, d.charged, charged, d.portion, portion)
		}
	}
	if v := n.Violations(); len(v) > 0 {
		return fmt.Errorf("GPU %d: %s: %s: %v", n.Devices[v[0].Device].Index, v[0].Kind, v[0].Detail, v[0].Tenants)
	}
	return nil
}
