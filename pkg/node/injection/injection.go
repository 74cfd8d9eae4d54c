// Package injection computes what the node agent's NRI plugin injects into
// a container at creation: a pure function of the pod's annotations, the
// container and the node's configuration, so every shape is table-tested
// without a runtime.
package injection

import (
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// noDevices is the NVIDIA Container Toolkit value that exposes no GPU.
const noDevices = "void"

// HookCommand is the gpufrac subcommand the runtime runs as the
// createRuntime hook to apply driver memory limits.
var HookCommand = []string{"hook", "apply-memory-limits"}

// ChooseBackend resolves --memory-limits against what the node can do:
// "auto" takes the strongest available; an explicit choice the node cannot
// honour is an error (the node then reports not ready), never a silent
// downgrade.
func ChooseBackend(flag string, capability nodeapi.Enforcement) (nodeapi.Backend, error) {
	switch nodeapi.Backend(flag) {
	case "auto":
		switch capability {
		case nodeapi.EnforcementDriver:
			return nodeapi.BackendDriver, nil
		case nodeapi.EnforcementMPSPinned:
			return nodeapi.BackendMPSPinned, nil
		}
		return nodeapi.BackendOff, nil
	case nodeapi.BackendDriver, nodeapi.BackendToolkit:
		if capability != nodeapi.EnforcementDriver {
			return nodeapi.BackendOff, fmt.Errorf("--memory-limits=%s needs driver memory limits (driver r615 and CUDA 13.4), and this node can do %q", flag, capability)
		}
		return nodeapi.Backend(flag), nil
	case nodeapi.BackendMPSPinned:
		if capability == nodeapi.EnforcementNone {
			return nodeapi.BackendOff, fmt.Errorf("--memory-limits=mps-pinned needs a working GPU driver, and this node can do %q", capability)
		}
		return nodeapi.BackendMPSPinned, nil
	case nodeapi.BackendOff:
		return nodeapi.BackendOff, nil
	}
	return nodeapi.BackendOff, nodeapi.CheckBackendFlag(flag)
}

// Config is what the node contributes to every injection.
type Config struct {
	// Backend enforces the memory limits; see ChooseBackend.
	Backend nodeapi.Backend
	// HookPath is the gpufrac binary on the host the runtime runs as the
	// createRuntime hook of the driver backend.
	HookPath string
	// MPSRoot is the node's MPS root (--mps-pipe-dir): the pipe directory
	// of the node's MPS control daemon is under it (nodeapi.PipeDir).
	MPSRoot string
	// MPS is the interface the node's MPS daemon speaks, MPSNone while it
	// does not run: every fractional container is one of its clients, so
	// without it none can start.
	MPS nodeapi.MPS
	// ShimDir is the host directory holding the nvidia-smi view library;
	// "" mounts nothing.
	ShimDir string
	// GPUMemoryMiB is the memory of each of the node's GPUs, as the node
	// publishes it (nvidia.com/gpu.memory); 0 while unknown.
	GPUMemoryMiB int64
	// GPUMemoryReserveMiB is kept back on each GPU (KAI's default is 0),
	// as the node publishes it for the scheduler (api.LabelGPUMemoryReserve):
	// a share of the GPU is a share of GPUMemoryMiB − GPUMemoryReserveMiB.
	GPUMemoryReserveMiB int64
	// FailOpen starts a fractional container that cannot be enforced
	// anyway: with its memory caps when only its compute mode or portion
	// is unusable, with no GPU at all otherwise.
	FailOpen bool
	// AllowRootMPSClients lets a fractional container run as root (uid 0
	// outside a user namespace). By default it is refused: every
	// fractional container is a client of the node's MPS daemon and
	// reaches its control socket, whose administrative commands (quit:
	// every tenant's context gone) the daemon obeys for root and refused
	// for an unprivileged uid (measured on an H200, docs/gpu-proof).
	AllowRootMPSClients bool
	// RestrictVisibility makes every container outside a gpufrac share
	// see only the GPUs granted to it (Police), except in the namespaces
	// of VisibilityExempt: the node's GPU software, which must see every
	// GPU. Only admins create pods there.
	RestrictVisibility bool
	VisibilityExempt   []string
	// ExclusiveProcess keeps a fractional container's GPUs in
	// EXCLUSIVE_PROCESS (EffectExclusive) before it starts.
	ExclusiveProcess bool
}

// Pod is what the injection needs of a pod: its UID (which names the MPS
// namespaces of its containers) and its annotations.
type Pod struct {
	UID         string
	Namespace   string
	Annotations map[string]string
}

// Verdict is what happens to a container at creation.
type Verdict string

// The verdicts.
const (
	// Run: the container starts as Adjustment makes it (enforced, or not
	// fractional at all).
	Run Verdict = "run"
	// FailedOpen: the container's share cannot be enforced as written and
	// the node fails open: it starts as Adjustment makes it, with its
	// memory caps when they could be read, with no GPU otherwise.
	FailedOpen Verdict = "fail-open"
	// Refuse: the container must not start.
	Refuse Verdict = "refuse"
)

// Decision is everything the node agent does for one container at
// creation, decided before anything is done: the NRI plugin carries it
// out and `gpufrac explain` prints it, so the two cannot differ.
type Decision struct {
	Verdict Verdict
	// Adjustment is what the runtime applies; nil when nothing changes
	// (a pod with no fraction) or the container is refused.
	Adjustment *nriapi.ContainerAdjustment
	// Assignment is the GPU share the container gets, as enforced (the
	// portion derived where the scheduler wrote none); nil when it gets no
	// GPU share.
	Assignment *api.Assignment
	// MPSNamespace is the MPS v3 namespace of the shared server to create,
	// with the assignment's thread ceiling, before the container runs
	// (sm-sharing); "" for none.
	MPSNamespace string
	// Notes say what the node did that the scheduler did not write, for
	// the pod's Event.
	Notes []string
	// Reason is why the container is refused or failed open.
	Reason error
	// By names the check that refused the container or failed it open
	// (judge.go's checks, or an Effect's kind); "" when it runs.
	By string
	// Policed says what the visibility check changed of a container
	// outside any gpufrac share that names GPUs it was not granted; "" for
	// nothing.
	Policed string
	// Effects are what the caller does, in order, before the container
	// starts (Judge sets them for a container that runs).
	Effects []Effect
}

// Decide computes the decision for container (its name and current
// environment, KEY=VALUE) of pod. A pod that asks for a fraction without
// a complete scheduler decision is refused, unless the node fails open.
// Containers of a fractional pod that get no GPU are shown none, so an
// image's NVIDIA_VISIBLE_DEVICES=all cannot reach the pod's neighbours.
// A container whose environment the adjustment cannot set (a variable
// both the image and the pod set: the runtime keeps the pod's) is
// refused, failing open or not: not even "no GPU" could be made to hold.
func Decide(pod Pod, container string, env []string, cfg Config) Decision {
	d := decide(pod, container, env, cfg)
	if d.Verdict != Refuse && d.Adjustment != nil {
		if err := CheckApplies(env, d.Adjustment); err != nil {
			return Decision{Verdict: Refuse, Reason: fmt.Errorf("container %q: %w", container, err)}
		}
	}
	return d
}

// CheckApplies says whether adj sets the environment it means to once the
// runtime applies it (ApplyEnv): where env holds a key adj changes more
// than once, the runtime changes only the first entry and puts the later
// ones back, so the last one written, normally the pod's own, wins.
func CheckApplies(env []string, adj *nriapi.ContainerAdjustment) error {
	got := ApplyEnv(env, adj)
	want := map[string]*nriapi.KeyValue{}
	for _, kv := range adj.GetEnv() {
		k, _ := nriapi.IsMarkedForRemoval(kv.Key)
		want[k] = kv
	}
	keys := slices.Sorted(maps.Keys(want))
	for _, k := range keys {
		kv := want[k]
		value, set := got[k]
		_, removed := nriapi.IsMarkedForRemoval(kv.Key)
		if (removed && !set) || (!removed && set && value == kv.Value) {
			continue
		}
		values, _ := lookupSet(env, k)
		return fmt.Errorf("%s is set more than once (%q: by the image and again by the pod), and the runtime keeps the last value over any change the node makes; remove %s from the pod's env",
			k, values, k)
	}
	return nil
}

func decide(pod Pod, container string, env []string, cfg Config) Decision {
	if !api.AsksForFraction(pod.Annotations) {
		return Decision{Verdict: Run}
	}
	assignments, err := api.ParseAssignments(pod.Annotations)
	if err == nil && len(assignments) == 0 {
		err = fmt.Errorf("the pod has GPU-fraction annotations but no scheduler decision (%s): refusing to run it without limits",
			api.ContainerKeyPrefix+"<container>"+api.SuffixDevices)
	}
	var mine *api.Assignment
	for i := range assignments {
		if assignments[i].Container == container {
			mine = &assignments[i]
		}
	}
	if err != nil {
		// A decision whose memory caps read cleanly keeps them when the
		// node fails open; only its compute sharing is dropped.
		if mine != nil && mine.Mode == "" {
			return failOpenWithCaps(*mine, env, cfg, err)
		}
		return Unenforceable(cfg, err)
	}
	if mine == nil {
		adj := &nriapi.ContainerAdjustment{}
		hideGPUs(adj)
		return Decision{Verdict: Run, Adjustment: adj}
	}
	a := *mine
	if err := checkBackend(container, cfg); err != nil {
		return Unenforceable(cfg, err)
	}
	if err := checkToolkitNaming(a, cfg); err != nil {
		return Unenforceable(cfg, err)
	}
	if err := checkMPS(container, cfg); err != nil {
		return Unenforceable(cfg, err)
	}
	if a.Mode == api.SMSharing && cfg.MPS != nodeapi.MPSv3 {
		return failOpenWithCaps(a, env, cfg, fmt.Errorf("container %q: sm-sharing needs MPS v3 namespaces (driver r615 and later) for its compute ceiling, and this node's MPS daemon speaks the legacy interface", container))
	}
	var notes []string
	if a.Mode == api.SMSharing {
		if a.Portion.IsZero() {
			portion, note, err := derivePortion(a, cfg)
			if err != nil {
				return failOpenWithCaps(a, env, cfg, fmt.Errorf("container %q: %w", container, err))
			}
			a.Portion = portion
			notes = append(notes, note)
		}
	}
	adj := &nriapi.ContainerAdjustment{}
	namespace := ""
	if a.Mode == api.SMSharing {
		namespace = nodeapi.NamespaceName(pod.UID, container)
	}
	inject(adj, a, namespace, env, cfg)
	return Decision{Verdict: Run, Adjustment: adj, Assignment: &a, MPSNamespace: namespace, Notes: notes}
}

// derivePortion gives an sm-sharing container the scheduler left without
// a portion (released KAI writes none) the compute share matching its
// memory share: request over the GPU's schedulable memory, in thousandths,
// at least 0.001 and at most 1.
func derivePortion(a api.Assignment, cfg Config) (api.Fraction, string, error) {
	usable := cfg.GPUMemoryMiB - cfg.GPUMemoryReserveMiB
	if cfg.GPUMemoryMiB <= 0 || usable <= 0 {
		return api.Fraction{}, "", fmt.Errorf("sm-sharing without %s needs the GPU's memory to derive a portion, and this node does not know it yet",
			api.ContainerKey(a.Container, api.SuffixComputePortion))
	}
	portion := api.PortionOfMemory(a.RequestMiB, usable)
	note := fmt.Sprintf("container %q: no compute portion was written (as released KAI Scheduler places sm-sharing pods); derived %s from the memory share, %dMi of %dMi schedulable (%dMi − %dMi reserve): MPS thread ceiling %d%%",
		a.Container, portion, a.RequestMiB, usable, cfg.GPUMemoryMiB, cfg.GPUMemoryReserveMiB, max(int(portion.Of(100)), 1))
	return portion, note, nil
}

// checkMPS: every fractional container is a client of the node's MPS
// daemon. Under MPS v3 its memacct feature is what evicts a client over its
// soft limit when memory runs short, so a request is only a guarantee for
// clients (NVIDIA MPS, "MPS v3 Memory Partitioning", Soft and Hard
// Limits); the pinned limit binds only clients too.
func checkMPS(container string, cfg Config) error {
	if cfg.MPSRoot == "" {
		return fmt.Errorf("container %q: GPU fractions are enforced through the node's MPS daemon, and this node has no MPS directory configured (--mps-pipe-dir)", container)
	}
	if cfg.MPS == nodeapi.MPSNone {
		return fmt.Errorf("container %q: the node's MPS control daemon is not running, so the container's memory request could not be guaranteed (memacct) nor its pinned limit applied", container)
	}
	return nil
}

func checkBackend(container string, cfg Config) error {
	switch cfg.Backend {
	case nodeapi.BackendDriver:
		if cfg.HookPath == "" {
			return fmt.Errorf("container %q: the driver memory-limit backend needs the hook binary (--hook-path)", container)
		}
	case nodeapi.BackendToolkit, nodeapi.BackendMPSPinned:
	case nodeapi.BackendOff:
		return fmt.Errorf("container %q: this node enforces no GPU memory limits (memory-limit backend off)", container)
	default:
		return fmt.Errorf("container %q: no memory-limit backend is in effect on this node yet", container)
	}
	return nil
}

// checkToolkitNaming: the toolkit backend's limits come from the
// apply-cuda-memory-limits hook in the CDI spec of NVIDIA's device plugin
// devices, which only a CDI name of that kind selects; bare UUIDs would
// start the container with no limit at all.
func checkToolkitNaming(a api.Assignment, cfg Config) error {
	if cfg.Backend != nodeapi.BackendToolkit || a.CDIKind == api.CDIKindNVIDIAGPU {
		return nil
	}
	return fmt.Errorf("container %q: the toolkit memory-limit backend applies limits through the CDI spec of %s devices, and %s names %s: schedule with deviceNaming cdi, or run the node with --memory-limits driver",
		a.Container, api.CDIKindNVIDIAGPU, api.ContainerKey(a.Container, api.SuffixDevices), strings.Join(a.DeviceNames(), ","))
}

// Unenforceable is the decision for a container whose share cannot be
// enforced for reason err: without fail-open it does not start; with it,
// it starts with no GPU at all, never an unlimited one.
func Unenforceable(cfg Config, err error) Decision {
	if !cfg.FailOpen {
		return Decision{Verdict: Refuse, Reason: err}
	}
	adj := &nriapi.ContainerAdjustment{}
	hideGPUs(adj)
	return Decision{Verdict: FailedOpen, Adjustment: adj, Reason: err,
		Notes: []string{"the node fails open: the container starts with no GPU"}}
}

// failOpenWithCaps is the decision for a container whose memory caps are
// known but whose compute mode or portion is not usable: refused, or on a
// node that fails open, started with its caps as a time-slicing tenant.
func failOpenWithCaps(a api.Assignment, env []string, cfg Config, err error) Decision {
	if !cfg.FailOpen {
		return Decision{Verdict: Refuse, Reason: err}
	}
	if berr := errors.Join(checkMPS(a.Container, cfg), checkBackend(a.Container, cfg), checkToolkitNaming(a, cfg)); berr != nil {
		return Unenforceable(cfg, errors.Join(err, berr))
	}
	a.Mode, a.Portion = api.TimeSlicing, api.Fraction{}
	adj := &nriapi.ContainerAdjustment{}
	inject(adj, a, "", env, cfg)
	return Decision{Verdict: FailedOpen, Adjustment: adj, Assignment: &a, Reason: err,
		Notes: []string{fmt.Sprintf("the node fails open: container %q starts with its memory caps (request %dMi, limit %dMi) but without compute sharing", a.Container, a.RequestMiB, a.LimitMiB)}}
}

func hideGPUs(adj *nriapi.ContainerAdjustment) {
	setEnv(adj, nodeapi.EnvVisibleDevices, noDevices)
	for _, k := range []string{nodeapi.EnvMemoryRequest, nodeapi.EnvMemoryLimit, nodeapi.EnvMPSPinnedLimit, nodeapi.EnvMPSPipeDirectory, nodeapi.EnvMPSThreads} {
		adj.RemoveEnv(k)
	}
}

// edits is what an injection writes: the NRI plugin's container
// adjustment, or the container edits of the CDI spec the DRA driver hands
// the runtime (cdi.go), so that both front doors inject the very same
// environment, mounts and hook for the same share.
type edits interface {
	setEnv(key, value string)
	removeEnv(key string)
	addMount(source, destination string, options []string)
	addCreateRuntimeHook(path string, args, env []string)
}

type nriEdits struct{ adj *nriapi.ContainerAdjustment }

func (e nriEdits) setEnv(key, value string) { setEnv(e.adj, key, value) }
func (e nriEdits) removeEnv(key string)     { e.adj.RemoveEnv(key) }
func (e nriEdits) addMount(source, destination string, options []string) {
	e.adj.AddMount(&nriapi.Mount{Source: source, Destination: destination, Type: "bind", Options: options})
}

func (e nriEdits) addCreateRuntimeHook(path string, args, env []string) {
	e.adj.AddHooks(&nriapi.Hooks{CreateRuntime: []*nriapi.Hook{{Path: path, Args: args, Env: env}}})
}

func inject(adj *nriapi.ContainerAdjustment, a api.Assignment, namespace string, env []string, cfg Config) {
	injectInto(nriEdits{adj}, a, namespace, env, cfg)
}

// injectInto writes a's share into e. env is the container's environment
// as the image and pod set it, where known (NRI); nil otherwise (CDI).
func injectInto(e edits, a api.Assignment, namespace string, env []string, cfg Config) {
	request, limit := strconv.FormatInt(a.RequestMiB, 10), strconv.FormatInt(a.LimitMiB, 10)
	// As the scheduler named them: a CDI name is what makes NVIDIA's
	// runtime apply that device's CDI spec (and its memory-limit hook).
	e.setEnv(nodeapi.EnvVisibleDevices, strings.Join(a.DeviceNames(), ","))
	e.setEnv(nodeapi.EnvMemoryRequest, request)
	e.setEnv(nodeapi.EnvMemoryLimit, limit)
	// The devices appear in the container as ordinals 0..n-1.
	pinned := make([]string, len(a.Devices))
	for i := range a.Devices {
		pinned[i] = fmt.Sprintf("%d=%sM", i, limit)
	}
	e.setEnv(nodeapi.EnvMPSPinnedLimit, strings.Join(pinned, ","))

	// Every fractional container is an MPS client, and sees only its own
	// way in (NVIDIA MPS, "MPS v3 Namespaces", Namespace Routing):
	//   - sm-sharing: the leaf directory of its namespace of the shared
	//     server, whose ceiling was set before it started; its clients
	//     share that server's context with the other sm-sharing tenants;
	//   - time-slicing under v3: the main socket only, not the directory
	//     that also holds the shared server's namespaces; with
	//     default_socket off its clients keep contexts of their own;
	//   - under the legacy v2 interface there are no namespaces: the
	//     daemon's pipe directory, for the pinned limit.
	e.setEnv(nodeapi.EnvMPSPipeDirectory, nodeapi.ContainerPipeDir)
	// A client's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE can only lower its
	// share (the effective one is the lower of it and its namespace's
	// ceiling), so a valid one is kept: as the ceiling where it is lower,
	// untouched for time-slicing (KAI's node operator keeps it too).
	own, hasOwn := ownThreadPercentage(env)
	switch {
	case namespace != "":
		e.setEnv(nodeapi.EnvMPSThreads, strconv.Itoa(min(a.ActiveThreadPercentage(), own)))
		e.addMount(nodeapi.NamespaceDir(cfg.MPSRoot, namespace), nodeapi.ContainerPipeDir, []string{"rbind", "rw"})
	case cfg.MPS == nodeapi.MPSv3:
		if !hasOwn {
			e.removeEnv(nodeapi.EnvMPSThreads)
		}
		// Read-only: a connect() needs no more (a socket is reached through
		// a read-only bind mount; checked on Linux), and the tenant can
		// write nothing of the daemon's.
		e.addMount(filepath.Join(nodeapi.PipeDir(cfg.MPSRoot), "control"), filepath.Join(nodeapi.ContainerPipeDir, "control"), []string{"bind", "ro"})
	default:
		if !hasOwn {
			e.removeEnv(nodeapi.EnvMPSThreads)
		}
		e.addMount(nodeapi.PipeDir(cfg.MPSRoot), nodeapi.ContainerPipeDir, []string{"rbind", "rw"})
	}

	if cfg.ShimDir != "" {
		e.addMount(cfg.ShimDir, nodeapi.ContainerShimDir, []string{"rbind", "ro"})
		e.setEnv(nodeapi.EnvLibraryPath, mergePath(nodeapi.ContainerShimDir, lookup(env, nodeapi.EnvLibraryPath)))
	}

	if cfg.Backend == nodeapi.BackendDriver {
		e.addCreateRuntimeHook(cfg.HookPath, append([]string{cfg.HookPath}, HookCommand...), []string{
			nodeapi.EnvHookContainer + "=" + a.Container,
			nodeapi.EnvHookDevices + "=" + strings.Join(a.Devices, ","),
			nodeapi.EnvHookRequestMiB + "=" + request,
			nodeapi.EnvHookLimitMiB + "=" + limit,
		})
	}
}

// ownThreadPercentage is the container's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
// when it is a whole percentage from 1 to 100 (100 and false otherwise: a
// value MPS would not read as a share is dropped, not kept).
func ownThreadPercentage(env []string) (int, bool) {
	v, set := lookupSet(env, nodeapi.EnvMPSThreads)
	if !set {
		return 100, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 1 || n > 100 {
		return 100, false
	}
	return n, true
}

// ApplyEnv returns the environment env (KEY=VALUE entries) becomes once
// adj's removals and additions are applied, exactly as the runtime applies
// them (NRI's runtime-tools generator, AdjustEnv): an adjusted key's first
// entry takes the new value or goes, but a later entry of the same key is
// put back and, the last one setting a key winning, overrides it. The
// plugin's audit and Police compare with it.
func ApplyEnv(env []string, adj *nriapi.ContainerAdjustment) map[string]string {
	mod := map[string]*nriapi.KeyValue{}
	for _, kv := range adj.GetEnv() {
		k, _ := nriapi.IsMarkedForRemoval(kv.Key)
		mod[k] = kv
	}
	out := make(map[string]string, len(env))
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		if m, adjusted := mod[k]; adjusted {
			delete(mod, k)
			if _, removed := nriapi.IsMarkedForRemoval(m.Key); !removed {
				out[k] = m.Value
			}
			continue
		}
		out[k] = v
	}
	for _, kv := range adj.GetEnv() {
		if _, removed := nriapi.IsMarkedForRemoval(kv.Key); removed {
			continue
		}
		if _, left := mod[kv.Key]; left {
			out[kv.Key] = kv.Value
		}
	}
	return out
}

// setEnv replaces whatever the pod (or another plugin) set for key.
func setEnv(adj *nriapi.ContainerAdjustment, key, value string) {
	adj.RemoveEnv(key)
	adj.AddEnv(key, value)
}

// mergePath puts dir first in a colon-separated path, keeping the rest and
// dropping a previous copy of dir.
func mergePath(dir, path string) string {
	parts := []string{dir}
	for _, p := range strings.Split(path, ":") {
		if p != "" && p != dir {
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, ":")
}

func lookup(env []string, key string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v
		}
	}
	return ""
}
