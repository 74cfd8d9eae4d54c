package explain

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/pkg/manifest"
	"github.com/gpufrac/gpufrac/pkg/node/injection"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/mps/mpstest"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
	"github.com/gpufrac/gpufrac/pkg/node/nriplugin"
)

func TestMain(m *testing.M) {
	// The MPS stand-in re-executes the test binary (mpstest).
	if os.Getenv(mpstest.Env) == "1" {
		os.Exit(mpstest.Fake(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// nodeCase is one container on one node: the node's settings (explain's
// flags, from which the agent's configuration is made the same way), the
// pod as scheduled, and the facts only the runtime knows, which explain
// cannot read from a manifest.
type nodeCase struct {
	name string
	node func(*Node)
	pod  *corev1.Pod // its container "main" is judged
	// Runtime facts: its CDI devices (a DRA share), another pod's running
	// container consuming that share first, a grant that cannot be read.
	cdi      []string
	holder   bool
	grantErr error
	want     string // RUN, FAIL-OPEN or REFUSE
	reason   string // in the reason, where there is one
}

func (c nodeCase) runtimeOnly() bool { return len(c.cdi) > 0 || c.holder || c.grantErr != nil }

// withoutRuntimeFacts is the case as explain sees it.
func (c nodeCase) withoutRuntimeFacts() nodeCase {
	c.cdi, c.holder, c.grantErr = nil, false, nil
	return c
}

const share = "gpu.gpufrac.io/share=claim-1-gpu"

func agreementPod(ns string, annotations map[string]string, env []string, mutate ...func(*corev1.Pod)) *corev1.Pod {
	c := corev1.Container{Name: "main", Image: "cuda"}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		c.Env = append(c.Env, corev1.EnvVar{Name: k, Value: v})
	}
	p := &corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "p", UID: "uid-p", Annotations: annotations},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{c}}}
	for _, m := range mutate {
		m(p)
	}
	return p
}

func runAs(uid int64) func(*corev1.Pod) {
	return func(p *corev1.Pod) { p.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsUser: ptr.To(uid)} }
}

func wholeGPUs(n int64) func(*corev1.Pod) {
	return func(p *corev1.Pod) {
		p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{"nvidia.com/gpu": *resource.NewQuantity(n, resource.DecimalSI)}
	}
}

var (
	timeSlicing = map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.main.gpus.devices": "GPU-a",
		"nvidia.com/container.main.gpu-memory.request": "40448Mi", "nvidia.com/container.main.gpu-memory.limit": "40448Mi"}
	smSharing = map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "10Gi",
		"nvidia.com/container.main.gpu-compute.mode": "sm-sharing", "nvidia.com/container.main.gpu-compute.portion": "0.25"}
	smSharingNoPortion = map[string]string{"nvidia.com/container.main.gpus.devices": "GPU-a", "nvidia.com/container.main.gpu-memory.request": "20480Mi",
		"nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}
	sidecar = map[string]string{"gpu-fraction": "0.5", "nvidia.com/container.trainer.gpus.devices": "GPU-a",
		"nvidia.com/container.trainer.gpu-memory.request": "40448Mi"}
	unscheduled = map[string]string{"gpu-fraction": "0.5"}
)

func failOpen(o *Node)   { o.FailOpen = true }
func backendOff(o *Node) { o.MemoryLimits = "off" }
func mpsDown(o *Node)    { o.MPS = "none" }
func legacyMPS(o *Node)  { o.MPS = "v2" }
func toolkit(o *Node)    { o.MemoryLimits = "toolkit" }
func allowRoot(o *Node)  { o.Injection.AllowRootMPSClients = true }
func noPolicing(o *Node) { o.Injection.RestrictVisibility = false }
func both(f ...func(*Node)) func(*Node) {
	return func(o *Node) {
		for _, g := range f {
			g(o)
		}
	}
}

// nodeCases are the node's cases: every check of the judgement, each
// verdict, each way a node can be set.
var nodeCases = []nodeCase{
	{name: "ordinary pod", pod: agreementPod("ml", nil, []string{"PATH=/bin"}), want: "RUN"},
	{name: "ordinary pod naming every GPU is policed to none", pod: agreementPod("ml", nil, []string{"NVIDIA_VISIBLE_DEVICES=all"}), want: "RUN"},
	{name: "ordinary pod naming every GPU, node not policing", node: noPolicing, pod: agreementPod("ml", nil, []string{"NVIDIA_VISIBLE_DEVICES=all"}), want: "RUN"},
	{name: "exempt namespace keeps what it names", pod: agreementPod("gpu-operator", nil, []string{"NVIDIA_VISIBLE_DEVICES=all"}), want: "RUN"},
	{name: "whole-GPU pod naming every GPU sees its allocation", pod: agreementPod("ml", nil, []string{"NVIDIA_VISIBLE_DEVICES=all"}, wholeGPUs(2)), want: "RUN"},
	{name: "whole-GPU pod naming its allocation", pod: agreementPod("ml", nil, []string{"NVIDIA_VISIBLE_DEVICES=<allocated-1>"}, wholeGPUs(1)), want: "RUN"},
	{name: "ordinary pod naming every GPU twice", pod: agreementPod("ml", nil, []string{"NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=all"}), want: "REFUSE", reason: "set more than once"},
	{name: "grant unreadable", pod: agreementPod("ml", nil, []string{"NVIDIA_VISIBLE_DEVICES=all"}), grantErr: errors.New("PodResources: connection refused"), want: "REFUSE", reason: "cannot be read"},
	{name: "time-slicing fraction, hostile env", pod: agreementPod("ml", timeSlicing, []string{"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_GPU_MEMORY_LIMIT=999999", "CUDA_MPS_PIPE_DIRECTORY=/tmp/evil"}), want: "RUN"},
	{name: "sm-sharing fraction", pod: agreementPod("ml", smSharing, nil), want: "RUN"},
	{name: "sm-sharing without a portion derives it", pod: agreementPod("ml", smSharingNoPortion, nil), want: "RUN"},
	{name: "sidecar of a fractional pod sees no GPU", pod: agreementPod("ml", sidecar, []string{"NVIDIA_VISIBLE_DEVICES=all"}), want: "RUN"},
	{name: "fraction never scheduled", pod: agreementPod("ml", unscheduled, nil), want: "REFUSE", reason: "no scheduler has assigned"},
	{name: "fraction never scheduled, failing open", node: failOpen, pod: agreementPod("ml", unscheduled, []string{"NVIDIA_VISIBLE_DEVICES=all"}), want: "FAIL-OPEN"},
	{name: "sm-sharing on the legacy MPS interface", node: legacyMPS, pod: agreementPod("ml", smSharing, nil), want: "REFUSE", reason: "legacy interface"},
	{name: "sm-sharing on the legacy MPS interface, failing open", node: both(legacyMPS, failOpen), pod: agreementPod("ml", smSharing, nil), want: "FAIL-OPEN"},
	{name: "no memory-limit backend", node: backendOff, pod: agreementPod("ml", timeSlicing, nil), want: "REFUSE", reason: "enforces no GPU memory limits"},
	{name: "MPS daemon down", node: mpsDown, pod: agreementPod("ml", timeSlicing, nil), want: "REFUSE", reason: "not running"},
	{name: "MPS daemon down, failing open", node: both(mpsDown, failOpen), pod: agreementPod("ml", timeSlicing, []string{"NVIDIA_VISIBLE_DEVICES=all"}), want: "FAIL-OPEN"},
	{name: "toolkit backend with bare UUIDs", node: toolkit, pod: agreementPod("ml", timeSlicing, nil), want: "REFUSE", reason: "deviceNaming cdi"},
	{name: "fraction writing its own device list twice", pod: agreementPod("ml", timeSlicing, []string{"NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_VISIBLE_DEVICES=all"}), want: "REFUSE", reason: "set more than once"},
	{name: "fraction as root", pod: agreementPod("ml", timeSlicing, nil, runAs(0)), want: "REFUSE", reason: "runs as root"},
	{name: "fraction as root, failing open", node: failOpen, pod: agreementPod("ml", timeSlicing, []string{"NVIDIA_VISIBLE_DEVICES=all"}, runAs(0)), want: "FAIL-OPEN"},
	{name: "sm-sharing failing open to its memory caps, as root", node: both(legacyMPS, failOpen), pod: agreementPod("ml", smSharing, []string{"NVIDIA_VISIBLE_DEVICES=all"}, runAs(0)), want: "FAIL-OPEN", reason: "runs as root"},
	{name: "fraction as root in a user namespace", pod: agreementPod("ml", timeSlicing, nil, runAs(0), func(p *corev1.Pod) { p.Spec.HostUsers = ptr.To(false) }), want: "RUN"},
	{name: "fraction as root, allowed", node: allowRoot, pod: agreementPod("ml", timeSlicing, nil, runAs(0)), want: "RUN"},
	{name: "fraction as a user", pod: agreementPod("ml", timeSlicing, nil, runAs(1000)), want: "RUN"},
	{name: "DRA share consumer", pod: agreementPod("ml", nil, nil, runAs(1000)), cdi: []string{share}, want: "RUN"},
	{name: "DRA share's second consumer", pod: agreementPod("ml", nil, nil, runAs(1000)), cdi: []string{share}, holder: true, want: "REFUSE", reason: "consumed already"},
	{name: "DRA share consumer as root", pod: agreementPod("ml", nil, nil, runAs(0)), cdi: []string{share}, want: "REFUSE", reason: "runs as root"},
}

// TestCreationAuditAndExplainAgree: for every case of the node, what the
// NRI plugin does at creation, what its audit makes of the container
// running (as created, and as it would run had the node done nothing),
// and what `gpufrac explain` prints are one judgement.
func TestCreationAuditAndExplainAgree(t *testing.T) {
	root := mpstest.ShortRoot(t)
	// Patient probes: a daemon a loaded machine answers late is not
	// replaced under the cases (which would refuse an sm-sharing one).
	control, _ := mpstest.StartDaemon(t, root, 615, func(d *mps.Daemon) { d.ProbeInterval, d.CommandTimeout = time.Second, 10*time.Second })
	for _, c := range nodeCases {
		t.Run(c.name, func(t *testing.T) {
			o := Node{MemoryLimits: "driver", MPS: "v3", SimulateGPUs: "dgxh100",
				Injection: injection.Config{HookPath: "/opt/gpufrac/bin/gpufrac", MPSRoot: root, RestrictVisibility: true, ExclusiveProcess: true, VisibilityExempt: []string{"gpu-operator"}}}
			if c.node != nil {
				c.node(&o)
			}
			cfg, err := o.Config()
			if err != nil {
				t.Fatal(err)
			}
			n := newAgreementNode(t, control, cfg, o.FailOpen, c)

			created := n.create(t, c)
			if created.verdict != c.want || !strings.Contains(created.reason, c.reason) {
				t.Fatalf("creation: %s (%s), want %s (%s)", created.verdict, created.reason, c.want, c.reason)
			}

			// Explain sees the manifest; what only the runtime knows it
			// takes as absent, and agrees with creation on that.
			seen := created
			if c.runtimeOnly() {
				seen = newAgreementNode(t, control, cfg, o.FailOpen, c.withoutRuntimeFacts()).create(t, c.withoutRuntimeFacts())
			}
			explained := explainOf(t, c.pod, o)
			if explained.verdict != seen.verdict || !strings.Contains(explained.reason, seen.reasonCore) {
				t.Errorf("explain: %s (%s), creation of what it sees: %s (%s)", explained.verdict, explained.reason, seen.verdict, seen.reasonCore)
			}
			if diff := cmpEnv(explained.env, seen.env); diff != "" {
				t.Errorf("explain and creation change the environment differently: %s", diff)
			}

			// The audit keeps what creation made, and stops what creation
			// would not have let run so.
			raw := containerEnv(c.pod.Spec.Containers[0])
			if created.verdict != "REFUSE" {
				if why := newAgreementNode(t, control, cfg, o.FailOpen, c).audit(t, c, created.running); why != "" {
					t.Errorf("the audit stops the container as created: %s", why)
				}
			}
			why := newAgreementNode(t, control, cfg, o.FailOpen, c).audit(t, c, raw)
			// A grant that cannot be read is judged again later, not guessed.
			wantStopped := created.verdict == "REFUSE" && c.grantErr == nil ||
				created.verdict != "REFUSE" && !sameJudgedEnv(raw, created.running)
			if (why != "") != wantStopped {
				t.Errorf("the audit of the container run without the node's changes: stopped %v (%q), want stopped %v", why != "", why, wantStopped)
			}
		})
	}
}

// agreementNode is a node agent's NRI plugin on cfg, with what it reads of
// the runtime and the kubelet as the case says.
type agreementNode struct {
	p   *nriplugin.Plugin
	rec *agreementRecorder
}

func newAgreementNode(t *testing.T, control mps.Control, cfg injection.Config, failOpen bool, c nodeCase) *agreementNode {
	t.Helper()
	m, err := mps.OpenManager(control, filepath.Join(t.TempDir(), "namespaces.json"))
	if err != nil {
		t.Fatal(err)
	}
	rec := &agreementRecorder{}
	grants := func(_ context.Context, _ nriplugin.PodRef, _ string, _ []string) ([]string, error) {
		if c.grantErr != nil {
			return nil, c.grantErr
		}
		n := c.pod.Spec.Containers[0].Resources.Limits.Name("nvidia.com/gpu", resource.DecimalSI).Value()
		var ids []string
		for i := range n {
			ids = append(ids, fmt.Sprintf("<allocated-%d>", i+1))
		}
		return ids, nil
	}
	p := nriplugin.New(nriplugin.Options{Injection: cfg, FailOpen: failOpen, Reporter: rec, Evictor: rec, MPS: m, Grants: grants,
		EnsureExclusive: func([]string) error { return nil }})
	return &agreementNode{p: p, rec: rec}
}

type outcome struct {
	verdict, reason string
	// reasonCore is the reason without what only the runtime's answer
	// adds (the pod and container it names).
	reasonCore string
	env        map[string]string // set ("" value: removed)
	running    []string          // the container's environment once created
}

func sandboxOf(pod *corev1.Pod) *nriapi.PodSandbox {
	return &nriapi.PodSandbox{Id: "sb-" + pod.Name, Name: pod.Name, Namespace: pod.Namespace, Uid: string(pod.UID), Annotations: pod.Annotations}
}

func containerOf(pod *corev1.Pod, c nodeCase, id string, env []string) *nriapi.Container {
	ctr := &nriapi.Container{Id: id, PodSandboxId: "sb-" + pod.Name, Name: "main", Env: env, State: nriapi.ContainerState_CONTAINER_RUNNING, Pid: 0}
	if sc := pod.Spec.SecurityContext; sc != nil && sc.RunAsUser != nil {
		ctr.User = &nriapi.User{Uid: uint32(*sc.RunAsUser)}
	}
	if pod.Spec.HostUsers != nil && !*pod.Spec.HostUsers {
		ctr.Linux = &nriapi.LinuxContainer{Namespaces: []*nriapi.LinuxNamespace{{Type: "user"}}}
	}
	for _, d := range c.cdi {
		ctr.CDIDevices = append(ctr.CDIDevices, &nriapi.CDIDevice{Name: d})
	}
	return ctr
}

// holderPod is another pod whose running container consumes the share.
var holderPod = agreementPod("ml", nil, nil, runAs(1000), func(p *corev1.Pod) { p.Name, p.UID = "holder", "uid-holder" })

func (n *agreementNode) create(t *testing.T, c nodeCase) outcome {
	t.Helper()
	ctx := context.Background()
	if c.holder {
		if _, _, err := n.p.CreateContainer(ctx, sandboxOf(holderPod), containerOf(holderPod, c, "holder", nil)); err != nil {
			t.Fatalf("the share's first consumer: %v", err)
		}
	}
	env := containerEnv(c.pod.Spec.Containers[0])
	adj, _, err := n.p.CreateContainer(ctx, sandboxOf(c.pod), containerOf(c.pod, c, "c1", env))
	out := outcome{verdict: "RUN", env: map[string]string{}}
	if err != nil {
		out.verdict, out.reason = "REFUSE", err.Error()
		out.reasonCore = err.Error()[strings.LastIndex(err.Error(), ": its GPU fraction cannot be enforced: ")+1:]
		if refused := n.rec.get(&n.rec.refused); len(refused) == 1 {
			out.reasonCore = refused[0]
			out.reasonCore = strings.TrimPrefix(out.reasonCore, "its GPU fraction cannot be enforced: ")
		}
		return out
	}
	if failed := n.rec.get(&n.rec.failedOpen); len(failed) > 0 {
		out.verdict, out.reason = "FAIL-OPEN", failed[0]
		out.reasonCore, _, _ = strings.Cut(failed[0], "; ")
	}
	for _, kv := range adj.GetEnv() {
		if k, removed := nriapi.IsMarkedForRemoval(kv.Key); removed {
			if _, set := out.env[k]; !set {
				out.env[k] = ""
			}
		} else {
			out.env[k] = kv.Value
		}
	}
	after := injection.ApplyEnv(env, adj)
	for _, k := range slices.Sorted(maps.Keys(after)) {
		out.running = append(out.running, k+"="+after[k])
	}
	return out
}

// audit is the plugin's audit of the case's container running with env;
// it returns why the container was stopped ("" when it was not).
func (n *agreementNode) audit(t *testing.T, c nodeCase, env []string) string {
	t.Helper()
	pods := []*nriapi.PodSandbox{sandboxOf(c.pod)}
	ctrs := []*nriapi.Container{}
	if c.holder {
		pods = append(pods, sandboxOf(holderPod))
		ctrs = append(ctrs, containerOf(holderPod, c, "holder", nil))
	}
	ctrs = append(ctrs, containerOf(c.pod, c, "c1", env))
	if _, err := n.p.Synchronize(context.Background(), pods, ctrs); err != nil {
		t.Fatal(err)
	}
	n.p.WaitForEvictions()
	for _, e := range n.rec.get(&n.rec.evicted) {
		if pod, why, _ := strings.Cut(e, ": "); pod == c.pod.Name {
			return why
		}
	}
	return ""
}

// sameJudgedEnv: the variables that carry a share, or hide the GPUs, are
// the same in both environments.
func sameJudgedEnv(a, b []string) bool {
	ma, mb := injection.ApplyEnv(a, nil), injection.ApplyEnv(b, nil)
	for _, k := range []string{nodeapi.EnvVisibleDevices, nodeapi.EnvMemoryRequest, nodeapi.EnvMemoryLimit, nodeapi.EnvMPSThreads, nodeapi.EnvMPSPipeDirectory} {
		if ma[k] != mb[k] {
			return false
		}
	}
	return true
}

// explainOf runs explain (gpufrac explain's core: a manifest in, what it
// prints out) on the pod as node o, and reads what it prints of container
// main.
func explainOf(t *testing.T, pod *corev1.Pod, o Node) outcome {
	t.Helper()
	raw, err := yaml.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := manifest.Decode(bytes.NewReader(raw), "<test>")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := o.Config()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if _, pods, err := Pods(&out, objs, cfg); err != nil || pods != 1 {
		t.Fatalf("explain: %d pods, %v", pods, err)
	}
	got := outcome{env: map[string]string{}}
	for _, line := range strings.Split(out.String(), "\n") {
		switch {
		case strings.Contains(line, " container main: "):
			_, rest, _ := strings.Cut(line, " container main: ")
			got.verdict, got.reason, _ = strings.Cut(rest, ": ")
		case strings.HasPrefix(line, "  env set: "):
			k, v, _ := strings.Cut(strings.TrimPrefix(line, "  env set: "), "=")
			got.env[k] = v
		case strings.HasPrefix(line, "  env removed: "):
			got.env[strings.TrimPrefix(line, "  env removed: ")] = ""
		}
	}
	if got.verdict == "" {
		t.Fatalf("explain printed nothing of container main:\n%s", out.String())
	}
	return got
}

func cmpEnv(a, b map[string]string) string {
	if maps.Equal(a, b) {
		return ""
	}
	return fmt.Sprintf("explain %v, creation %v", a, b)
}

// agreementRecorder is the plugin's Reporter and Evictor here.
type agreementRecorder struct {
	mu                           sync.Mutex
	refused, failedOpen, evicted []string
}

func (r *agreementRecorder) add(list *[]string, s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	*list = append(*list, s)
}

func (r *agreementRecorder) get(list *[]string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(*list)
}

func (r *agreementRecorder) Refused(_ nriplugin.PodRef, _ string, err error) {
	r.add(&r.refused, err.Error())
}
func (r *agreementRecorder) FailedOpen(_ nriplugin.PodRef, _ string, err error) {
	r.add(&r.failedOpen, err.Error())
}
func (r *agreementRecorder) Evicted(nriplugin.PodRef, string, string)      {}
func (r *agreementRecorder) ReleaseFailed(nriplugin.PodRef, string, error) {}
func (r *agreementRecorder) Enforced(nriplugin.PodRef, string, string)     {}
func (r *agreementRecorder) Unenforced(nriplugin.PodRef, string, string)   {}
func (r *agreementRecorder) MPSRestarted(nriplugin.PodRef, string, string) {}
func (r *agreementRecorder) Policed(nriplugin.PodRef, string, string)      {}
func (r *agreementRecorder) Evict(_ context.Context, pod nriplugin.PodRef, reason string) error {
	r.add(&r.evicted, pod.Name+": "+reason)
	return nil
}
