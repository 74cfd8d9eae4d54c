package nriplugin

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// Enforcement states of a fractional container.
const (
	// StateInjected: created with its limits injected; for the driver
	// backend not yet verified.
	StateInjected = "injected"
	// StateEnforced: the driver holds its limits (verified after start),
	// or its backend enforces without a read-back.
	StateEnforced = "enforced"
	// StateUnverified: started, but reading its limits back failed (an
	// NVML call, not a mismatch); re-read at each resync, and evicted
	// if that keeps failing (maxVerifyTries).
	StateUnverified = "unverified"
	// StateUnenforced: found running without its limits; evicted.
	StateUnenforced = "unenforced"
	// StateFailOpen: started without a GPU because the node fails open.
	StateFailOpen = "fail_open"
)

// Tenant is one fractional container on the node, for metrics.
type Tenant struct {
	// ID is the container's runtime ID (set by Tenants).
	ID         string
	Pod        PodRef
	Container  string
	Devices    []string
	RequestMiB int64
	LimitMiB   int64
	Mode       api.ComputeMode
	Backend    string
	State      string
	// Namespace is its MPS namespace (sm-sharing), "" for none.
	Namespace string
	// Groups are the GPU groups gpufrac's scheduler wrote with its decision
	// (api.DecisionGroups), one per device; nil for another scheduler's.
	// Its GPU is held only while its own group's reservation pod holds it.
	Groups []string

	// As decided at creation, so later hooks do not parse the pod's
	// annotations again.
	assignment api.Assignment
	notes      []string
	// started is when the container was created (zero when the runtime
	// did not say): one created before the node's MPS daemon started has
	// mounts naming an older daemon's sockets.
	started time.Time
	// cgroup is the container's cgroup once started (driver backend);
	// verifyTries counts the read-backs that failed.
	cgroup      string
	verifyTries int
	// evicted: its pod's eviction was accepted; mpsReported: its pod was
	// told the MPS daemon was replaced under it.
	evicted, mpsReported bool
	// pid is its first process (host PID), once started; stopAsked is
	// when the node first asked for its pod to go, killed whether the
	// node has since killed its processes itself (Options.KillAfter).
	pid       uint32
	stopAsked time.Time
	killed    bool
}

// tenants tracks the fractional containers by container ID.
type tenants struct {
	mu sync.Mutex
	m  map[string]Tenant
}

func (t *tenants) set(id string, tenant Tenant) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]Tenant{}
	}
	t.m[id] = tenant
}

func (t *tenants) get(id string) (Tenant, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	tenant, ok := t.m[id]
	return tenant, ok
}

// update changes the tenant id, if known, with f.
func (t *tenants) update(id string, f func(*Tenant)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if tenant, ok := t.m[id]; ok {
		f(&tenant)
		t.m[id] = tenant
	}
}

// ids lists the tenants' container IDs.
func (t *tenants) ids() map[string]Tenant {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]Tenant, len(t.m))
	for id, tenant := range t.m {
		out[id] = tenant
	}
	return out
}

func (t *tenants) remove(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, id)
}

// retain drops the containers not in live.
func (t *tenants) retain(live map[string]bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id := range t.m {
		if !live[id] {
			delete(t.m, id)
		}
	}
}

func (t *tenants) list() []Tenant {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Tenant, 0, len(t.m))
	for id, tenant := range t.m {
		tenant.ID = id
		out = append(out, tenant)
	}
	slices.SortFunc(out, func(a, b Tenant) int {
		return strings.Compare(a.Pod.Namespace+"/"+a.Pod.Name+"/"+a.Container, b.Pod.Namespace+"/"+b.Pod.Name+"/"+b.Container)
	})
	return out
}

func tenantOf(sandbox *nriapi.PodSandbox, d injection.Decision, backend, state string, started time.Time) Tenant {
	a := *d.Assignment
	var groups []string
	if g := api.DecisionGroups(sandbox.GetAnnotations()); len(g) == len(a.Devices) {
		groups = g
	}
	return Tenant{Pod: refOf(sandbox), Container: a.Container, Devices: a.Devices, RequestMiB: a.RequestMiB, LimitMiB: a.LimitMiB,
		Mode: a.Mode, Backend: backend, State: state, Namespace: d.MPSNamespace, Groups: groups, assignment: a, notes: d.Notes, started: started}
}

// runningTenant is the tenant record of a container the audit found
// running: created when the runtime says, with the memory the driver
// holds it to where a resize changed it (r), unenforced when it must go
// (reason).
func runningTenant(pod *nriapi.PodSandbox, ctr *nriapi.Container, d injection.Decision, r running, backend, reason string) Tenant {
	var created time.Time
	if ns := ctr.GetCreatedAt(); ns > 0 {
		created = time.Unix(0, ns)
	}
	t := tenantOf(pod, d, backend, StateEnforced, created)
	t.cgroup, t.pid = r.cgroup, ctr.GetPid()
	if r.held != nil {
		t.RequestMiB, t.LimitMiB = int64(r.held.RequestMiB), int64(r.held.LimitMiB)
		t.assignment.RequestMiB, t.assignment.LimitMiB = t.RequestMiB, t.LimitMiB
	}
	if reason != "" {
		t.State = StateUnenforced
	}
	return t
}

// forPod is the tenant of a pod's container, with its container ID.
func (t *tenants) forPod(uid, container string) (string, Tenant, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, tenant := range t.m {
		if tenant.Pod.UID == uid && tenant.Container == container {
			return id, tenant, true
		}
	}
	return "", Tenant{}, false
}

// Resize holds the running container of pod uid to new memory limits
// (SPEC §7), through the driver's per-cgroup limits (enforce.Resize, which
// refuses a hard limit below what the container uses). held says whether
// the container is held to them now, or already was (created since with
// them); false with no error when it is not running here yet: its
// creation hook applies the pod's allocation then.
func (p *Plugin) Resize(uid, container string, to api.Memory) (held bool, err error) {
	// Never beside an audit, which reads the limits this changes.
	p.auditMu.Lock()
	defer p.auditMu.Unlock()
	id, t, ok := p.tenants.forPod(uid, container)
	switch {
	case !ok, t.State != StateEnforced:
		// Not running here, or its limits not verified yet (Reverify
		// reads them back against its record): tried again later.
		return false, nil
	case t.RequestMiB == to.RequestMiB && t.LimitMiB == to.LimitMiB:
		return true, nil
	case t.Backend != string(nodeapi.BackendDriver):
		return false, fmt.Errorf("container %s of pod %s/%s is held to its memory by the %q backend, which cannot change a running container's limit", container, t.Pod.Namespace, t.Pod.Name, t.Backend)
	case t.cgroup == "" || p.opts.NVML == nil:
		return false, nil // not started: its limits are verified, and resized, once it is
	}
	from := enforce.Limits{Container: container, Devices: t.Devices, RequestMiB: uint64(t.RequestMiB), LimitMiB: uint64(t.LimitMiB)}
	limits := enforce.Limits{Container: container, Devices: t.Devices, RequestMiB: uint64(to.RequestMiB), LimitMiB: uint64(to.LimitMiB)}
	if err := enforce.Resize(p.opts.NVML, t.cgroup, t.Devices, from, limits); err != nil {
		return false, fmt.Errorf("container %s of pod %s/%s: %w", container, t.Pod.Namespace, t.Pod.Name, err)
	}
	p.tenants.update(id, func(t *Tenant) {
		t.RequestMiB, t.LimitMiB = to.RequestMiB, to.LimitMiB
		t.assignment.RequestMiB, t.assignment.LimitMiB = to.RequestMiB, to.LimitMiB
	})
	return true, nil
}
