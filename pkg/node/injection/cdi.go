package injection

import (
	"fmt"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// ImageLibraryPath is the library path the CDI edits assume the image
// has when they put the nvidia-smi view first: a CDI spec can only set an
// environment variable, not extend the image's, and this is what NVIDIA's
// CUDA images set (and what the container toolkit's libraries are found
// under).
const ImageLibraryPath = "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"

// ShareEdits are the CDI container edits that enforce a DRA claim's share
// a on this node: the same environment, MPS way in, nvidia-smi view and
// createRuntime hook the NRI plugin injects for an annotated container
// with the same share (inject), so that both front doors enforce alike.
// namespace is the share's MPS v3 namespace (sm-sharing), "" for
// time-slicing.
//
// A share that cannot be enforced is an error: the DRA driver then fails
// the claim's preparation, and the kubelet retries it; a claim never
// fails open (a pod that asked through DRA asked for the driver's
// enforcement, and an unenforced start is what --fail-open exists to
// allow for annotated pods only).
func ShareEdits(a api.Assignment, namespace string, cfg Config) (*cdispec.ContainerEdits, error) {
	if err := checkShare(a, namespace, cfg); err != nil {
		return nil, err
	}
	e := cdiEdits{&cdispec.ContainerEdits{}}
	injectInto(e, a, namespace, []string{nodeapi.EnvLibraryPath + "=" + ImageLibraryPath}, cfg)
	return e.edits, nil
}

func checkShare(a api.Assignment, namespace string, cfg Config) error {
	var errs []error
	if len(a.Devices) == 0 {
		errs = append(errs, fmt.Errorf("claim share %q names no GPU", a.Container))
	}
	if a.RequestMiB <= 0 || a.LimitMiB < a.RequestMiB {
		errs = append(errs, fmt.Errorf("claim share %q: request %dMi and limit %dMi: the request must be above 0 and the limit at least the request", a.Container, a.RequestMiB, a.LimitMiB))
	}
	if cfg.Backend == nodeapi.BackendToolkit {
		// The toolkit applies limits from the CDI spec of NVIDIA's device
		// plugin devices, which a DRA share is not one of.
		errs = append(errs, fmt.Errorf("claim share %q: the toolkit memory-limit backend enforces only devices of NVIDIA's device plugin; DRA shares need --memory-limits driver or mps-pinned", a.Container))
	} else if err := checkBackend(a.Container, cfg); err != nil {
		errs = append(errs, err)
	}
	if err := checkMPS(a.Container, cfg); err != nil {
		errs = append(errs, err)
	}
	if a.Mode == api.SMSharing {
		switch {
		case cfg.MPS != nodeapi.MPSv3:
			errs = append(errs, fmt.Errorf("claim share %q: sm-sharing needs MPS v3 namespaces (driver r615 and later) for its compute ceiling, and this node's MPS daemon does not offer them", a.Container))
		case namespace == "":
			errs = append(errs, fmt.Errorf("claim share %q: sm-sharing without an MPS namespace", a.Container))
		case a.Portion.IsZero():
			errs = append(errs, fmt.Errorf("claim share %q: sm-sharing without a compute portion", a.Container))
		}
	}
	return api.JoinLine(errs...)
}

// cdiEdits writes an injection as CDI container edits. A CDI spec can add
// but not remove: its environment entries replace the container's for the
// same keys when the runtime applies them, and a removal is dropped
// (every one inject makes is of a variable it sets to nothing useful for
// the tenant, such as a thread ceiling on a time-slicing share; see
// inject).
type cdiEdits struct{ edits *cdispec.ContainerEdits }

func (e cdiEdits) setEnv(key, value string) {
	e.removeEnv(key)
	e.edits.Env = append(e.edits.Env, key+"="+value)
}

func (e cdiEdits) removeEnv(key string) {
	kept := e.edits.Env[:0]
	for _, kv := range e.edits.Env {
		if k, _, _ := strings.Cut(kv, "="); k != key {
			kept = append(kept, kv)
		}
	}
	e.edits.Env = kept
}

func (e cdiEdits) addMount(source, destination string, options []string) {
	e.edits.Mounts = append(e.edits.Mounts, &cdispec.Mount{HostPath: source, ContainerPath: destination, Type: "bind", Options: options})
}

func (e cdiEdits) addCreateRuntimeHook(path string, args, env []string) {
	e.edits.Hooks = append(e.edits.Hooks, &cdispec.Hook{HookName: "createRuntime", Path: path, Args: args, Env: env})
}

// Outcome is what a runtime ends up with for a container, in one form for
// both front doors, so that they can be compared: the environment after
// the edits, the mounts and the createRuntime hooks.
type Outcome struct {
	Env    map[string]string
	Mounts []string
	Hooks  []string
}

// OutcomeOfNRI is the outcome of an NRI adjustment on a container whose
// environment was env.
func OutcomeOfNRI(env []string, adj *nriapi.ContainerAdjustment) Outcome {
	out := Outcome{Env: ApplyEnv(env, adj)}
	for _, m := range adj.GetMounts() {
		out.Mounts = append(out.Mounts, m.Source+" -> "+m.Destination+" "+m.Type+" "+strings.Join(m.Options, ","))
	}
	for _, h := range adj.GetHooks().GetCreateRuntime() {
		out.Hooks = append(out.Hooks, h.Path+" "+strings.Join(h.Args, " ")+" env "+strings.Join(h.Env, " "))
	}
	return out
}

// OutcomeOfCDI is the outcome of CDI container edits on a container whose
// environment was env, applied as CDI's ContainerEdits.Apply does: an
// environment entry replaces the container's of the same key.
func OutcomeOfCDI(env []string, e *cdispec.ContainerEdits) Outcome {
	out := Outcome{Env: ApplyEnv(env, &nriapi.ContainerAdjustment{})}
	for _, kv := range e.Env {
		k, v, _ := strings.Cut(kv, "=")
		out.Env[k] = v
	}
	for _, m := range e.Mounts {
		out.Mounts = append(out.Mounts, m.HostPath+" -> "+m.ContainerPath+" "+m.Type+" "+strings.Join(m.Options, ","))
	}
	for _, h := range e.Hooks {
		if h.HookName == "createRuntime" {
			out.Hooks = append(out.Hooks, h.Path+" "+strings.Join(h.Args, " ")+" env "+strings.Join(h.Env, " "))
		}
	}
	return out
}
