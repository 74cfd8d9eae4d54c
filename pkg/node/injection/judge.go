package injection

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// A container is judged once, the same way wherever it is judged: at its
// creation (the NRI plugin), while it runs (the plugin's audit), and for a
// person asking (gpufrac explain). The caller gathers every fact about it
// (Container), Judge runs one list of checks (checks) over them, and the
// decision comes back as data: the adjustment, the verdict, and the
// effects the caller carries out before the container starts (Effects).
// Each check has the two faces the kubelet's admit and eviction handlers
// have: what it makes of a container about to be created (admit), and
// why a container that runs already must not keep running (keep).

// Container is every fact the node judges a container by, gathered once
// by the caller: from the runtime (nriplugin), or from a manifest
// (gpufrac explain), which does not know the runtime's facts and says so.
type Container struct {
	// Pod is its pod as the node decides on it: the memory a resize
	// allocated since its sandbox was made already in its annotations.
	Pod Pod
	// Resized says the pod's memory was changed by a resize since its
	// sandbox was made: a container that runs may have been created with
	// the memory of before (its environment does not change), and is held
	// to what the driver holds it to (Held).
	Resized bool
	// Name, Env (KEY=VALUE, as the image and pod set it; as it runs, for
	// a running one) and Mounts of the container.
	Name   string
	Env    []string
	Mounts []*nriapi.Mount
	// UID is the container process's uid; nil where the runtime does not
	// say (NRI before 0.10). UserNamespace: it has one of its own.
	UID           *uint32
	UserNamespace bool
	// SharedPID: its process namespace is another's (the pod's, with
	// shareProcessNamespace; a debug container's target's), from which
	// another container reaches its files through /proc as root.
	SharedPID bool
	// MayEscalate says, from its pod's spec as the API has it, whether its
	// processes may gain privileges (allowPrivilegeEscalation not false,
	// or privileged): a setuid-root program would become root after the
	// uid was checked. nil where the node does not know the pod's spec.
	MayEscalate *bool
	// CDIDevices are the CDI devices the kubelet named for it (its DRA
	// shares among them).
	CDIDevices []string
	// Grant is what it was granted of the node's GPUs outside any gpufrac
	// share; read only where the node polices it and it names GPUs.
	Grant Grant
	// ShareHolder names the running container that consumes one of its
	// gpufrac DRA shares already ("" for none).
	ShareHolder string
	// HeldErr, for a running container of a resized pod on the driver
	// backend, says the driver holds it to limits other than recorded
	// (ErrLimitsDiffer's text); nil otherwise.
	HeldErr error
}

// Grant is what a container was granted: the device plugin's allocation
// and the GPUs of its DRA shares, as device IDs. Err says why it cannot be
// read; Read is false where it was not read (nothing to police).
type Grant struct {
	Read bool
	IDs  []string
	Err  error
}

// ErrGrantUnknown is the visibility check's error when what a container
// was granted cannot be read (not what it names): a container about to be
// created is refused, a running one judged again later, not guessed.
var ErrGrantUnknown = errors.New("which ones it was granted cannot be read")

// Polices says whether the node makes containers of pods in namespace see
// only their grant.
func (cfg Config) Polices(namespace string) bool {
	return cfg.RestrictVisibility && !slices.Contains(cfg.VisibilityExempt, namespace)
}

// NamesGPUs says whether a container outside any gpufrac share names GPUs
// at all (most name none): only then is its grant worth reading. It is
// whether Police, granting nothing, would change anything, without
// building the change: the device list names a GPU, a legacy CUDA image
// leaves it unset (all GPUs), or a device-list mount names one.
func NamesGPUs(env []string, mounts []*nriapi.Mount) bool {
	value, set := lookupSet(env, nodeapi.EnvVisibleDevices)
	switch {
	case !set && lookup(env, envCUDAVersion) != "" && lookup(env, envRequireCUDA) == "":
		return true
	case set && len(ungranted(strings.Split(value, ","), nil)) > 0:
		return true
	}
	for _, m := range mounts {
		if d, ok := mountedDevice(m); ok && len(ungranted([]string{d}, nil)) > 0 {
			return true
		}
	}
	return false
}

// NeedsGrant says whether the visibility check will ask what c was
// granted: the caller reads it then, and only then. (Most containers
// name no GPU: that is asked first.)
func NeedsGrant(c Container, cfg Config) bool {
	return cfg.Polices(c.Pod.Namespace) && NamesGPUs(c.Env, c.Mounts) && !api.AsksForFraction(c.Pod.Annotations)
}

// Effect is something the caller does before the container starts, in
// order; if it fails, the decision becomes Failed's.
type Effect struct {
	Kind EffectKind
	// Namespace and Threads: the MPS namespace to create with its
	// active-thread ceiling (EffectMPSNamespace).
	Namespace string
	Threads   int
	// Devices: the GPUs to keep in EXCLUSIVE_PROCESS (EffectExclusive).
	Devices []string
	// Shares: the DRA shares (CDI device names) the container consumes
	// from now on (EffectClaimShares).
	Shares []string
}

// EffectKind names an Effect.
type EffectKind string

// The effects.
const (
	// EffectMPSNamespace creates the sm-sharing container's namespace of
	// the shared MPS server with its ceiling: without it the container's
	// compute ceiling would be missing.
	EffectMPSNamespace EffectKind = "mps-namespace"
	// EffectExclusive puts the container's GPUs in EXCLUSIVE_PROCESS: in
	// another mode a process of any container could take the GPU's memory
	// outside MPS.
	EffectExclusive EffectKind = "exclusive-process"
	// EffectClaimShares records the container as the one consumer of its
	// DRA shares (their limits go on one cgroup).
	EffectClaimShares EffectKind = "claim-shares"
)

// Failed is the decision when effect e of d failed with err: a share that
// would run without what e gives is unenforceable (refused, or failing
// open no GPU); a share someone else consumes (a race the facts did not
// show) is refused.
func (d Decision) Failed(e Effect, err error, cfg Config) Decision {
	var out Decision
	if e.Kind == EffectClaimShares {
		out = Decision{Verdict: Refuse, Reason: err}
	} else {
		out = Unenforceable(cfg, err)
	}
	out.By = string(e.Kind)
	return out
}

// check is one rule a container is judged by, named in Decision.By. Each
// has a creation face (admit: the decision so far in, the decision out)
// and an audit face (keep: why a running container, d being what its
// creation would be now, must not keep running as it does; "" when it may
// or the check does not speak of it). The faces are dispatched by a switch,
// not held as function values, so that the facts passed by pointer stay on
// the caller's stack (CreateContainer allocates nothing for them).
type check string

// The checks.
const (
	checkTheShare    check = "share"
	checkClientUser  check = "mps-client-user"
	checkOneConsumer check = "one-share-consumer"
	checkVisibility  check = "visibility"
	checkResizedHeld check = "resized-held"
)

// checks are judged in order. One that refuses a container, or fails it
// open with no GPU, decides it; a container that starts with a share
// (run, or failed open with its memory caps) goes through every check.
// The last check that changed the verdict is named in Decision.By.
var checks = []check{checkTheShare, checkClientUser, checkOneConsumer, checkVisibility, checkResizedHeld}

// admit is ch's creation face, changing d in place; ok is false where it
// has nothing to say before a container runs.
func (ch check) admit(c *Container, cfg *Config, d *Decision) (ok bool) {
	switch ch {
	case checkTheShare:
		admitShare(c, cfg, d)
	case checkClientUser:
		admitClientUser(c, cfg, d)
	case checkOneConsumer:
		admitOneConsumer(c, cfg, d)
	case checkVisibility:
		admitVisibility(c, cfg, d)
	default:
		return false
	}
	return true
}

// keep is ch's audit face.
func (ch check) keep(c *Container, cfg *Config, d *Decision) string {
	switch ch {
	case checkTheShare:
		return keepShare(c, cfg, d)
	case checkClientUser:
		return keepClientUser(c, cfg, d)
	case checkOneConsumer:
		return keepOneConsumer(c, cfg, d)
	case checkVisibility:
		return keepVisibility(c, cfg, d)
	case checkResizedHeld:
		return keepHeld(c, cfg, d)
	}
	return ""
}

// Judge is what the node does with container c at its creation.
func Judge(c Container, cfg Config) Decision { return judge(&c, &cfg) }

func judge(c *Container, cfg *Config) Decision {
	d := Decision{Verdict: Run}
	for _, ch := range checks {
		verdict, adj, by := d.Verdict, d.Adjustment, d.By
		if !ch.admit(c, cfg, &d) {
			continue
		}
		if d.Verdict != verdict || d.Adjustment != adj && d.Verdict != Run {
			d.By = string(ch)
		} else {
			d.By = by
		}
		if d.Verdict == Refuse || d.Verdict == FailedOpen && d.Assignment == nil {
			return d
		}
	}
	d.Effects = effects(c, cfg, &d)
	return d
}

// Audit judges a container that runs already: d is what its creation
// would be now, and why it must not keep running ("" when it may).
func Audit(c Container, cfg Config) (d Decision, reason string) {
	d = judge(&c, &cfg)
	for _, ch := range checks {
		if r := ch.keep(&c, &cfg, &d); r != "" {
			return d, r
		}
	}
	return d, ""
}

// effects are what a container that runs needs done before it starts.
func effects(c *Container, cfg *Config, d *Decision) []Effect {
	var out []Effect
	if d.MPSNamespace != "" {
		out = append(out, Effect{Kind: EffectMPSNamespace, Namespace: d.MPSNamespace, Threads: d.Assignment.ActiveThreadPercentage()})
	}
	if d.Assignment != nil && cfg.ExclusiveProcess {
		out = append(out, Effect{Kind: EffectExclusive, Devices: d.Assignment.Devices})
	}
	if shares := DRAShares(c.CDIDevices); len(shares) > 0 {
		out = append(out, Effect{Kind: EffectClaimShares, Shares: shares})
	}
	return out
}

// admitShare is the share the scheduler decided for the container (Decide).
func admitShare(c *Container, cfg *Config, d *Decision) {
	*d = Decide(c.Pod, c.Name, c.Env, *cfg)
}

// keepShare: a running container must be what its creation would make of
// it now, for the variables that carry its share (or hide the GPUs from
// it). A resized pod's memory on the driver backend is judged by what the
// driver holds (keepHeld), not by its environment.
func keepShare(c *Container, cfg *Config, d *Decision) string {
	if d.Verdict == Refuse && d.By == string(checkTheShare) {
		return "running although its GPU fraction cannot be enforced: " + d.Reason.Error()
	}
	if d.Adjustment == nil || d.Policed != "" {
		return ""
	}
	skipMemory := c.Resized && cfg.Backend == nodeapi.BackendDriver
	want := ApplyEnv(c.Env, d.Adjustment)
	for _, key := range []string{nodeapi.EnvVisibleDevices, nodeapi.EnvMemoryRequest, nodeapi.EnvMemoryLimit, nodeapi.EnvMPSThreads, nodeapi.EnvMPSPipeDirectory} {
		if skipMemory && (key == nodeapi.EnvMemoryRequest || key == nodeapi.EnvMemoryLimit) {
			continue
		}
		if got := lookup(c.Env, key); got != want[key] {
			return fmt.Sprintf("%s is %q, want %q", key, got, want[key])
		}
	}
	return ""
}

// admitClientUser: a fractional container (run, or failed open with its
// memory caps) or a DRA share's consumer is a client of the node's MPS
// daemon, which must not be root on the host.
func admitClientUser(c *Container, cfg *Config, d *Decision) {
	if d.Assignment == nil && len(DRAShares(c.CDIDevices)) == 0 {
		// Not a client itself; but one that shares a client's process
		// namespace (a debug container aimed at it) reaches the client's
		// MPS pipe directory through /proc. Refused, never failed open:
		// hiding its GPUs would not hide the client's files.
		if c.SharedPID && !c.UserNamespace && !cfg.AllowRootMPSClients && holdsAnnotationShare(c.Pod) {
			*d = Decision{Verdict: Refuse, Reason: fmt.Errorf("container %q: %w", c.Name, CheckMPSClient(Container{SharedPID: true}, *cfg))}
		}
		return
	}
	if err := CheckMPSClient(*c, *cfg); err != nil {
		*d = Unenforceable(*cfg, fmt.Errorf("container %q: %w", c.Name, err))
	}
}

// holdsAnnotationShare says whether the pod's annotations give one of its
// containers a share.
func holdsAnnotationShare(p Pod) bool {
	as, err := api.ParseAssignments(p.Annotations)
	return err == nil && len(as) > 0
}

// keepClientUser: a root client found running is stopped as one about to
// start would be refused (failing open, it would have no GPU: keepShare
// compares its environment with that).
func keepClientUser(_ *Container, _ *Config, d *Decision) string {
	if d.Verdict == Refuse && d.By == string(checkClientUser) {
		return "running as a client of the node's MPS daemon that must not be one: " + d.Reason.Error()
	}
	return ""
}

// admitOneConsumer: a gpufrac DRA share is enforced on one container at a
// time; the allocator counted it once.
func admitOneConsumer(c *Container, _ *Config, d *Decision) {
	if c.ShareHolder != "" {
		*d = Decision{Verdict: Refuse, Reason: fmt.Errorf("container %q: %s", c.Name, c.ShareHolder)}
	}
}

func keepOneConsumer(_ *Container, _ *Config, d *Decision) string {
	if d.By == string(checkOneConsumer) {
		return "running as a second consumer of a share: " + d.Reason.Error()
	}
	return ""
}

// admitVisibility: a container outside any gpufrac share sees exactly what
// it was granted (Police).
func admitVisibility(c *Container, _ *Config, d *Decision) {
	if d.Assignment != nil || d.Adjustment != nil || !c.Grant.Read {
		return
	}
	if c.Grant.Err != nil {
		*d = Decision{Verdict: Refuse, Reason: fmt.Errorf("the container names GPUs (%s=%q) and %w: %w",
			nodeapi.EnvVisibleDevices, lookup(c.Env, nodeapi.EnvVisibleDevices), ErrGrantUnknown, c.Grant.Err)}
		return
	}
	adj, note, err := Police(c.Env, c.Mounts, c.Grant.IDs)
	switch {
	case err != nil:
		*d = Decision{Verdict: Refuse, Reason: err}
	case adj != nil:
		d.Adjustment, d.Policed = adj, note
	}
}

// keepVisibility: a running container that names GPUs it was not granted
// goes; one whose grant cannot be read now is judged again later.
func keepVisibility(_ *Container, _ *Config, d *Decision) string {
	switch {
	case d.By == string(checkVisibility) && errors.Is(d.Reason, ErrGrantUnknown):
		return ""
	case d.By == string(checkVisibility):
		return "running with GPUs it was not granted: " + d.Reason.Error()
	case d.Policed != "":
		return "running with GPUs it was not granted: " + d.Policed
	}
	return ""
}

// keepHeld: a resized pod's container the driver holds to limits other
// than its own is not enforced.
func keepHeld(c *Container, _ *Config, _ *Decision) string {
	if c.HeldErr != nil {
		return "a resized container's GPU memory limits are not in force: " + c.HeldErr.Error()
	}
	return ""
}

// DRAShares are the gpufrac DRA shares among a container's CDI devices.
func DRAShares(cdi []string) []string {
	var out []string
	for _, d := range cdi {
		if strings.HasPrefix(d, api.DRAShareCDIKind+"=") {
			out = append(out, d)
		}
	}
	return out
}
