// Package nriplugin is the node agent's NRI plugin: at container creation
// it injects exactly what the pod's scheduler decision says (through
// package injection), refuses fractional containers it cannot enforce, and
// on every (re)connection audits the containers already running.
package nriplugin

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/node/injection"
)

// Name and index the plugin registers with; the index orders it after
// device plugins' own NRI injections, so its values win.
const (
	Name  = "gpufrac"
	Index = "90"
)

// PodRef names a pod for events and evictions.
type PodRef struct {
	Namespace, Name, UID string
}

func refOf(pod *nriapi.PodSandbox) PodRef {
	return PodRef{Namespace: pod.GetNamespace(), Name: pod.GetName(), UID: pod.GetUid()}
}

// Reporter records what the plugin did to a pod, as Kubernetes Events and
// metrics.
type Reporter interface {
	// Refused: a fractional container was not allowed to start.
	Refused(pod PodRef, container string, err error)
	// FailedOpen: a fractional container starts with no GPU because the
	// node is configured to fail open.
	FailedOpen(pod PodRef, container string, err error)
	// Evicted: a running container lacked its enforcement and its pod was
	// evicted.
	Evicted(pod PodRef, container, reason string)
}

// Evictor evicts a pod (through the Eviction API, so disruption budgets
// are honoured).
type Evictor interface {
	Evict(ctx context.Context, pod PodRef, reason string) error
}

// Options configure the plugin.
type Options struct {
	Injection injection.Config
	// FailOpen starts unenforceable fractional containers with no GPU
	// instead of refusing them.
	FailOpen bool
	Reporter Reporter
	Evictor  Evictor
}

// Plugin implements the NRI hooks the node agent needs.
type Plugin struct {
	opts       Options
	injection  atomic.Pointer[injection.Config]
	registered atomic.Bool
}

// New returns a plugin; Run connects it to the runtime.
func New(opts Options) *Plugin {
	p := &Plugin{opts: opts}
	p.SetInjection(opts.Injection)
	return p
}

// SetInjection replaces the node configuration used from the next
// container on, e.g. once the agent knows which memory-limit backend the
// driver allows.
func (p *Plugin) SetInjection(cfg injection.Config) { p.injection.Store(&cfg) }

// Registered reports whether the runtime has accepted the plugin and
// synchronized it (from then on it sees every container creation), for
// the node's readiness.
func (p *Plugin) Registered() bool { return p.registered.Load() }

// Run registers with the runtime over its NRI socket and serves until ctx
// ends or the runtime goes away.
func (p *Plugin) Run(ctx context.Context, socketPath string) error {
	s, err := stub.New(p, stub.WithPluginName(Name), stub.WithPluginIdx(Index), stub.WithSocketPath(socketPath),
		stub.WithOnClose(func() { p.registered.Store(false) }))
	if err != nil {
		return fmt.Errorf("NRI plugin: %w", err)
	}
	defer p.registered.Store(false)
	return s.Run(ctx)
}

// Serve keeps the plugin connected until ctx ends, reconnecting with
// exponential backoff (from minBackoff to maxBackoff) whenever the runtime
// goes away, as it does when containerd restarts. Each reconnection
// synchronizes, and so audits what runs.
func (p *Plugin) Serve(ctx context.Context, socketPath string, minBackoff, maxBackoff time.Duration) {
	logger := klog.FromContext(ctx)
	backoff := minBackoff
	for ctx.Err() == nil {
		start := time.Now()
		err := p.Run(ctx, socketPath)
		if ctx.Err() != nil {
			return
		}
		if time.Since(start) > time.Minute {
			backoff = minBackoff // it was connected for a while: a fresh failure
		}
		logger.Info("NRI plugin disconnected from the runtime; reconnecting", "socket", socketPath, "err", err, "after", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, maxBackoff)
	}
}

// Configure is called when the runtime accepts the plugin.
func (p *Plugin) Configure(ctx context.Context, _, runtime, version string) (stub.EventMask, error) {
	klog.FromContext(ctx).Info("Registered with the container runtime", "runtime", runtime, "version", version)
	return 0, nil // the stub subscribes to the events this type implements
}

// CreateContainer injects the container's GPU share, or refuses it.
func (p *Plugin) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	adj, err := injection.Adjust(pod.GetAnnotations(), ctr.GetName(), ctr.GetEnv(), *p.injection.Load())
	if err == nil {
		return adj, nil, nil
	}
	logger := klog.FromContext(ctx).WithValues("pod", pod.GetNamespace()+"/"+pod.GetName(), "container", ctr.GetName())
	if p.opts.FailOpen {
		logger.Info("Starting the container without a GPU: its fraction cannot be enforced and the node fails open", "reason", err.Error())
		if p.opts.Reporter != nil {
			p.opts.Reporter.FailedOpen(refOf(pod), ctr.GetName(), err)
		}
		return injection.FailOpen(), nil, nil
	}
	logger.Info("Refusing the container: its GPU fraction cannot be enforced", "reason", err.Error())
	if p.opts.Reporter != nil {
		p.opts.Reporter.Refused(refOf(pod), ctr.GetName(), err)
	}
	return nil, nil, fmt.Errorf("gpufrac: pod %s/%s container %q: %w", pod.GetNamespace(), pod.GetName(), ctr.GetName(), err)
}

// Synchronize audits the containers that run already when the plugin
// (re)connects: any fractional container created without its injection
// (the agent was down, or the plugin was not registered yet) is evicted so
// it comes back enforced. An empty list is taken as it is: nothing is
// wiped or assumed.
func (p *Plugin) Synchronize(ctx context.Context, pods []*nriapi.PodSandbox, ctrs []*nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	logger := klog.FromContext(ctx)
	byID := make(map[string]*nriapi.PodSandbox, len(pods))
	for _, pod := range pods {
		byID[pod.GetId()] = pod
	}
	evicted := map[string]bool{}
	for _, ctr := range ctrs {
		pod := byID[ctr.GetPodSandboxId()]
		if pod == nil || evicted[pod.GetId()] || ctr.GetState() != nriapi.ContainerState_CONTAINER_RUNNING {
			continue
		}
		reason := p.missingEnforcement(pod, ctr)
		if reason == "" {
			continue
		}
		logger.Info("Evicting a pod whose GPU fraction is not enforced", "pod", pod.GetNamespace()+"/"+pod.GetName(),
			"container", ctr.GetName(), "reason", reason)
		evicted[pod.GetId()] = true
		if p.opts.Evictor != nil {
			if err := p.opts.Evictor.Evict(ctx, refOf(pod), reason); err != nil {
				logger.Error(err, "Eviction failed; the container keeps running unenforced", "pod", pod.GetNamespace()+"/"+pod.GetName())
				continue
			}
		}
		if p.opts.Reporter != nil {
			p.opts.Reporter.Evicted(refOf(pod), ctr.GetName(), reason)
		}
	}
	p.registered.Store(true)
	return nil, nil
}

// missingEnforcement compares a running container's environment with what
// CreateContainer would have injected; "" means it is enforced (or needs
// nothing).
func (p *Plugin) missingEnforcement(pod *nriapi.PodSandbox, ctr *nriapi.Container) string {
	adj, err := injection.Adjust(pod.GetAnnotations(), ctr.GetName(), ctr.GetEnv(), *p.injection.Load())
	if err != nil {
		if p.opts.FailOpen && envValue(ctr.GetEnv(), injection.EnvVisibleDevices) == "void" {
			return ""
		}
		return "running although its GPU fraction cannot be enforced: " + err.Error()
	}
	if adj == nil {
		return ""
	}
	// The container's environment must already be what the injection
	// would make it, for the variables that carry the limits.
	want := injection.ApplyEnv(ctr.GetEnv(), adj)
	for _, key := range []string{injection.EnvVisibleDevices, injection.EnvMemoryRequest, injection.EnvMemoryLimit, injection.EnvMPSThreads} {
		if got := envValue(ctr.GetEnv(), key); got != want[key] {
			return fmt.Sprintf("%s is %q, want %q", key, got, want[key])
		}
	}
	return ""
}

func envValue(env []string, key string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v
		}
	}
	return ""
}
