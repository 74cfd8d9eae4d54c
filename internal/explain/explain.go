// Package explain says what gpufrac's node agent would do to a scheduled
// pod's containers: the very judgement its NRI plugin runs at creation and
// in its audit (injection.Judge), over the facts a manifest gives, with the
// node's settings (Node) and the GPUs of a go-nvml mock machine. gpufrac
// explain is its command line.
package explain

import (
	"fmt"
	"io"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/manifest"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// ExitWouldRefuse is gpufrac explain's exit status when a container would
// not be allowed to start.
const ExitWouldRefuse = 1

// Node is a node agent's settings, as its flags give them.
type Node struct {
	// MemoryLimits is --memory-limits (auto: the strongest the mock
	// machine's driver allows).
	MemoryLimits string
	FailOpen     bool
	// SimulateGPUs is the mock machine; GPUMemoryMiB, when set, its GPUs'
	// memory instead.
	SimulateGPUs string
	GPUMemoryMiB int64
	// MPS is the MPS daemon's interface: auto, v3, v2 or none.
	MPS string
	// Injection holds the rest of the agent's settings.
	Injection injection.Config
}

// Pods prints, for every Pod among objs, the decision for each of its
// containers (what explainPod says), and returns ExitWouldRefuse when any
// would be refused, and how many pods it read. An object that could not be
// read as a Pod is an error.
func Pods(out io.Writer, objs []manifest.Object, cfg injection.Config) (code, pods int, err error) {
	for _, obj := range objs {
		if obj.Kind != "Pod" {
			continue
		}
		if obj.Err != nil {
			return code, pods, fmt.Errorf("%s/%s: %w", obj.Namespace, obj.Name, obj.Err)
		}
		pods++
		code = max(code, explainPod(out, obj, cfg))
	}
	return code, pods, nil
}

// Config is the injection configuration a node agent so set would use on
// the mock machine.
func (o Node) Config() (injection.Config, error) {
	cfg := o.Injection
	cfg.FailOpen = o.FailOpen
	if cfg.GPUMemoryReserveMiB < 0 {
		return cfg, fmt.Errorf("--gpu-memory-reserve-mib %d: must be 0 or more", cfg.GPUMemoryReserveMiB)
	}
	if err := nodeapi.CheckBackendFlag(o.MemoryLimits); err != nil {
		return cfg, err
	}
	lib, err := inventory.Simulated(o.SimulateGPUs)
	if err != nil {
		return cfg, err
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		return cfg, err
	}
	cfg.Backend = nodeapi.Backend(o.MemoryLimits)
	if o.MemoryLimits == "auto" {
		// As the agent resolves it; an explicit choice is taken as given,
		// to show a node configured so.
		cfg.Backend, _ = injection.ChooseBackend("auto", inv.Capability())
	}
	if len(inv.GPUs) > 0 {
		cfg.GPUMemoryMiB = inv.GPUs[0].MemoryMiB
	}
	switch o.MPS {
	case "auto":
		// The driver and toolkit backends need r615, which has MPS v3; a
		// node shown with one of them has v3 whatever the mock's driver.
		major, err := mps.DriverMajor(inv.DriverVersion)
		if err != nil {
			return cfg, err
		}
		if cfg.Backend.DriverLimits() {
			major = max(major, mps.ReleaseV3)
		}
		cfg.MPS = mps.ProtocolFor(major)
	case string(nodeapi.MPSv3), string(nodeapi.MPSv2):
		cfg.MPS = nodeapi.MPS(o.MPS)
	case "none":
		cfg.MPS = nodeapi.MPSNone
	default:
		return cfg, fmt.Errorf("--mps %q: must be auto, v3, v2 or none", o.MPS)
	}
	if o.GPUMemoryMiB != 0 {
		if o.GPUMemoryMiB < 0 {
			return cfg, fmt.Errorf("--gpu-memory-mib %d: must be more than 0", o.GPUMemoryMiB)
		}
		cfg.GPUMemoryMiB = o.GPUMemoryMiB
	}
	return cfg, nil
}

// explainPod prints the decision for each of the pod's containers, init
// containers first (the order the kubelet creates them in), and returns
// its exit code.
func explainPod(out io.Writer, obj manifest.Object, cfg injection.Config) int {
	ns := obj.Namespace
	if ns == "" {
		ns = "default"
	}
	pod := injection.Pod{UID: string(obj.Meta.UID), Namespace: ns, Annotations: obj.Template.Annotations}
	if pod.UID == "" {
		pod.UID = "<pod-uid>"
	}
	code := 0
	containers := append(slices.Clone(obj.Template.Spec.InitContainers), obj.Template.Spec.Containers...)
	for i, c := range containers {
		kind := "container"
		if i < len(obj.Template.Spec.InitContainers) {
			kind = "init container"
		}
		fact := containerFacts(pod, obj.Template.Spec, c, cfg)
		d := injection.Judge(fact, cfg)
		head := fmt.Sprintf("%s/%s %s %s", ns, obj.Name, kind, c.Name)
		switch d.Verdict {
		case injection.Refuse:
			fmt.Fprintf(out, "%s: REFUSE: %v\n", head, d.Reason)
			code = ExitWouldRefuse
			continue
		case injection.FailedOpen:
			fmt.Fprintf(out, "%s: FAIL-OPEN: %v\n", head, d.Reason)
		default:
			fmt.Fprintf(out, "%s: RUN\n", head)
		}
		printDecision(out, d)
		if d.Assignment != nil && fact.UID == nil && !fact.UserNamespace && !cfg.AllowRootMPSClients {
			fmt.Fprintln(out, "  note: the manifest does not say its user (runAsUser): the node refuses it if its image runs it as root (uid 0), as a client of the node's MPS daemon")
		}
	}
	return code
}

func printDecision(out io.Writer, d injection.Decision) {
	if d.Adjustment == nil {
		fmt.Fprintln(out, "  nothing changed: the pod asks for no GPU fraction")
		for _, e := range d.Effects {
			if e.Kind == injection.EffectClaimShares {
				fmt.Fprintf(out, "  dra: the container is the one consumer of %s\n", strings.Join(e.Shares, ","))
			}
		}
		return
	}
	if a := d.Assignment; a != nil {
		share := fmt.Sprintf("  share: %s on %s, request %dMi, limit %dMi", a.Mode, strings.Join(a.Devices, ","), a.RequestMiB, a.LimitMiB)
		if !a.Portion.IsZero() {
			share += fmt.Sprintf(", compute portion %s", a.Portion)
		}
		fmt.Fprintln(out, share)
		if a.LimitMiB > a.RequestMiB {
			// Burst reclaim (api.ReclaimOrder): what the limit above the
			// request is worth when the GPU runs short.
			fmt.Fprintf(out, "  burst: above its request of %dMi it may be stopped while its GPU has under --burst-reclaim-below (%d%% by default) of its memory free, unless the node runs --burst-reclaim off: the lowest priority above its request first, then the furthest above it\n",
				a.RequestMiB, api.DefaultReclaimBelowPercent)
		}
	} else {
		fmt.Fprintln(out, "  share: none (the container is shown no GPU)")
	}
	var set, removed []string
	for _, kv := range d.Adjustment.GetEnv() {
		if k, gone := nriapi.IsMarkedForRemoval(kv.Key); gone {
			removed = append(removed, k)
		} else {
			set = append(set, kv.Key+"="+kv.Value)
		}
	}
	// A key removed and then set is replaced: list it once, as set.
	removed = slices.DeleteFunc(removed, func(k string) bool {
		return slices.ContainsFunc(set, func(kv string) bool { return strings.HasPrefix(kv, k+"=") })
	})
	for _, kv := range set {
		fmt.Fprintf(out, "  env set: %s\n", kv)
	}
	for _, k := range removed {
		fmt.Fprintf(out, "  env removed: %s\n", k)
	}
	for _, m := range d.Adjustment.GetMounts() {
		fmt.Fprintf(out, "  mount: %s -> %s (%s, %s)\n", m.Source, m.Destination, m.Type, strings.Join(m.Options, ","))
	}
	for _, h := range d.Adjustment.GetHooks().GetCreateRuntime() {
		fmt.Fprintf(out, "  hook createRuntime: %s env %s\n", strings.Join(h.Args, " "), strings.Join(h.Env, " "))
	}
	if d.Policed != "" {
		fmt.Fprintf(out, "  visibility: %s\n", d.Policed)
	}
	for _, e := range d.Effects {
		switch e.Kind {
		case injection.EffectMPSNamespace:
			fmt.Fprintf(out, "  mps: namespace %s, active-thread ceiling %d%%, set before the container starts\n", e.Namespace, e.Threads)
		case injection.EffectExclusive:
			fmt.Fprintf(out, "  compute mode: %s kept in EXCLUSIVE_PROCESS before the container starts\n", strings.Join(e.Devices, ","))
		case injection.EffectClaimShares:
			fmt.Fprintf(out, "  dra: the container is the one consumer of %s\n", strings.Join(e.Shares, ","))
		}
	}
	for _, n := range d.Notes {
		fmt.Fprintf(out, "  note: %s\n", n)
	}
}

// containerEnv is the container's literal environment, KEY=VALUE, as the
// runtime will pass it (values from ConfigMaps or fields are not known
// here and are left out).
func containerEnv(c corev1.Container) []string {
	var env []string
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env = append(env, e.Name+"="+e.Value)
		}
	}
	return env
}

// containerFacts are the facts the node judges container c by, as far as
// a manifest tells them: its literal environment, its user (runAsUser;
// unknown where neither the container nor the pod says), its user
// namespace (hostUsers: false), its process namespace and privileges, and, where the node polices it, its grant
// as the device plugin would allocate it (placeholders, one per
// nvidia.com/gpu of its limits).
func containerFacts(pod injection.Pod, spec corev1.PodSpec, c corev1.Container, cfg injection.Config) injection.Container {
	fact := injection.Container{Pod: pod, Name: c.Name, Env: containerEnv(c), UserNamespace: spec.HostUsers != nil && !*spec.HostUsers,
		SharedPID: spec.ShareProcessNamespace != nil && *spec.ShareProcessNamespace}
	// As admitted: gpufrac's webhook sets allowPrivilegeEscalation false
	// where a share's container leaves it unset.
	if sc := c.SecurityContext; sc != nil {
		escalates := (sc.AllowPrivilegeEscalation != nil && *sc.AllowPrivilegeEscalation) || (sc.Privileged != nil && *sc.Privileged)
		fact.MayEscalate = &escalates
	}
	if sc := c.SecurityContext; sc != nil && sc.RunAsUser != nil {
		uid := uint32(*sc.RunAsUser)
		fact.UID = &uid
	} else if psc := spec.SecurityContext; psc != nil && psc.RunAsUser != nil {
		uid := uint32(*psc.RunAsUser)
		fact.UID = &uid
	}
	if injection.NeedsGrant(fact, cfg) {
		fact.Grant.Read = true
		n := c.Resources.Limits.Name(api.ResourceGPU, resource.DecimalSI).Value()
		for i := range n {
			fact.Grant.IDs = append(fact.Grant.IDs, fmt.Sprintf("<allocated-%d>", i+1))
		}
	}
	return fact
}
