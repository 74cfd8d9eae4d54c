//go:build soak

package soak

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/api"
)

const (
	ns = "soak"
	// kindLabel says what made a pod: bare, whole, deploy, job, claim.
	kindLabel = "soak.gpufrac.io/kind"
	// settleBound is how long the cluster may take, after a pod appears
	// or a fault ends (the later), to place a pod that fits or to clear
	// a finding that is not a broken promise but a step not yet taken
	// (a reservation pod not yet collected).
	settleBound = 90 * time.Second
	// convergeBound is how long the cluster may take to settle after the
	// last fault.
	convergeBound = 5 * time.Minute
	// leaseDuration is deploy/scheduler/config.yaml's (kube-scheduler's
	// default): how long a killed leader keeps its Lease.
	leaseDuration = 15 * time.Second
)

// podLife is what the soak saw of one pod.
type podLife struct {
	key     string // namespace/name
	kind    string
	seen    time.Time // first seen (the informer's add)
	bound   time.Time // first seen bound
	node    string
	devices string // its decision's GPUs, as first seen
}

type fault struct {
	Kind    string
	At, End time.Time
	Detail  string
}

type violation struct {
	At     time.Time
	What   string
	Recent []string // the last faults before it
}

type soak struct {
	c   *localcluster.Cluster
	dir string
	cfg settings
	// rng draws the workload, frng the faults: each goroutine its own,
	// so that a seed replays both.
	rng, frng *rand.Rand
	client    kubernetes.Interface
	heartbeat time.Duration
	start     time.Time

	mu           sync.Mutex
	pods         map[types.UID]*podLife
	deletedByUs  map[string]bool
	removedSince map[string]time.Time // node → removed at, while removed
	removedEver  map[string][]time.Time
	readded      map[string]time.Time // node → registered again at
	agentDown    map[string]time.Time // node → agent stopped at, while stopped
	keepStopped  map[string]bool
	faults       []fault
	lastFaultEnd time.Time
	faulting     bool // a fault is in progress
	ops, opErrs  map[string]int
	violations   []violation
	reported     map[string]bool
	persisting   map[string]time.Time
	selfExits    map[string]int
	logOffset    map[string]int64
	placeTimes   []time.Duration
	lost         int
}

func newSoak(ctx context.Context, c *localcluster.Cluster, dir string, cfg settings) (*soak, error) {
	s := &soak{c: c, dir: dir, cfg: cfg, rng: rand.New(rand.NewSource(cfg.Seed)), frng: rand.New(rand.NewSource(cfg.Seed ^ 0x5eed)), client: c.Admin,
		pods: map[types.UID]*podLife{}, deletedByUs: map[string]bool{}, removedSince: map[string]time.Time{}, removedEver: map[string][]time.Time{},
		readded: map[string]time.Time{}, agentDown: map[string]time.Time{}, keepStopped: map[string]bool{}, ops: map[string]int{}, opErrs: map[string]int{},
		reported: map[string]bool{}, persisting: map[string]time.Time{}, selfExits: map[string]int{}, logOffset: map[string]int64{}}
	if _, err := s.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "quarter", Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpufrac.io",
				Capacity: &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse("20Gi")}}}}}}}}}
	if _, err := s.client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	nodes, err := s.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, n := range nodes.Items {
		if h := api.AgentHeartbeat(&n); h.Bound > s.heartbeat {
			s.heartbeat = h.Bound
		}
	}
	if s.heartbeat == 0 {
		s.heartbeat = api.DefaultAgentHeartbeat
	}
	return s, nil
}

// run drives the workload and the faults for d, then lets the cluster
// converge, checking the invariants throughout, and reports.
func (s *soak) run(ctx context.Context, d time.Duration) report {
	s.start = time.Now()
	factory := informers.NewSharedInformerFactoryWithOptions(s.client, 0, informers.WithNamespace(ns))
	informer := factory.Core().V1().Pods().Informer()
	_, _ = informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.onPod(o, false) },
		UpdateFunc: func(_, o any) { s.onPod(o, false) },
		DeleteFunc: func(o any) { s.onPod(o, true) },
	})
	stop := make(chan struct{})
	factory.Start(stop)
	factory.WaitForCacheSync(stop)
	defer close(stop)

	loadCtx, endLoad := context.WithTimeout(ctx, d)
	defer endLoad()
	checkCtx, endChecks := context.WithCancel(ctx)
	defer endChecks()
	var wg sync.WaitGroup
	wg.Go(func() { s.workload(loadCtx) })
	wg.Go(func() { s.inject(loadCtx) })
	var checks sync.WaitGroup
	checks.Go(func() { s.every(checkCtx, 3*time.Second, s.check) })
	checks.Go(func() { s.every(checkCtx, 2*time.Second, s.supervise) })
	wg.Wait()

	// The last fault has ended (inject undoes its own before it returns).
	s.mu.Lock()
	s.lastFaultEnd = time.Now()
	s.mu.Unlock()
	rep := report{Seed: s.cfg.Seed, Duration: d, Nodes: s.cfg.Nodes}
	settled := time.Now()
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, convergeBound, true, func(ctx context.Context) (bool, error) {
		rep.Unsettled = s.unsettled(ctx)
		return rep.Unsettled == "", nil
	})
	rep.Converged = err == nil
	rep.ConvergeAfter = time.Since(settled)
	s.check(ctx) // one last look, settled
	endChecks()
	checks.Wait()
	s.fill(&rep)
	return rep
}

func (s *soak) every(ctx context.Context, period time.Duration, do func(context.Context)) {
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			do(ctx)
		}
	}
}

// onPod follows each pod of the soak's namespace: when it was first seen
// and bound, that its decision never changes, and that no pod the soak
// made itself disappears unless the soak or a node's removal took it.
func (s *soak) onPod(obj any, deleted bool) {
	if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj, deleted = tomb.Obj, true
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	key := pod.Namespace + "/" + pod.Name
	life := s.pods[pod.UID]
	if life == nil {
		life = &podLife{key: key, kind: pod.Labels[kindLabel], seen: now}
		s.pods[pod.UID] = life
	}
	if deleted {
		if (life.kind == "bare" || life.kind == "whole") && !s.deletedByUs[key] && !s.nodeRemovedSince(life.node, life.seen) {
			s.lost++
			s.violate(now, "", fmt.Sprintf("pod %s (%s) was deleted, not by the soak, on node %q that was never removed", key, life.kind, life.node))
		}
		return
	}
	if pod.Spec.NodeName != "" && life.bound.IsZero() {
		life.bound, life.node = now, pod.Spec.NodeName
		s.placeTimes = append(s.placeTimes, now.Sub(life.seen))
		if since, down := s.agentDown[pod.Spec.NodeName]; down && api.HasDecision(pod.Annotations) && now.Sub(since) > s.heartbeat+10*time.Second {
			s.violate(now, "", fmt.Sprintf("share %s was bound to node %s, whose agent has been down since %s (%s; its heartbeat bound is %s)",
				key, pod.Spec.NodeName, since.Format("15:04:05"), now.Sub(since).Round(time.Second), s.heartbeat))
		}
	}
	devices := decisionDevices(pod)
	if devices == "" {
		return
	}
	if life.devices == "" {
		life.devices = devices
	} else if life.devices != devices {
		s.violate(now, "", fmt.Sprintf("pod %s: its decision moved from GPUs %s to %s", key, life.devices, devices))
		life.devices = devices
	}
}

// decisionDevices are the GPUs every container's decision names, in one
// string.
func decisionDevices(pod *corev1.Pod) string {
	as, err := api.ParseAssignments(pod.Annotations)
	if err != nil {
		return ""
	}
	var all []string
	for _, a := range as {
		all = append(all, a.Container+"="+strings.Join(a.Devices, ","))
	}
	return strings.Join(all, ";")
}

// nodeRemovedSince says whether node was removed at some time after t.
// Called with the lock held.
func (s *soak) nodeRemovedSince(node string, t time.Time) bool {
	if _, now := s.removedSince[node]; now {
		return true
	}
	for _, at := range s.removedEver[node] {
		if at.After(t) {
			return true
		}
	}
	return false
}

// violate records a broken invariant once (by key, "": by what), with the faults
// before it. Called with the lock held.
func (s *soak) violate(at time.Time, key, what string) {
	if key == "" {
		key = what
	}
	if s.reported[key] {
		return
	}
	s.reported[key] = true
	var recent []string
	for _, f := range s.faults[max(len(s.faults)-3, 0):] {
		recent = append(recent, fmt.Sprintf("%s %s at +%s", f.Kind, f.Detail, f.At.Sub(s.start).Round(time.Second)))
	}
	s.violations = append(s.violations, violation{At: at, What: what, Recent: recent})
}

// supervise starts again what exited on its own, as a Deployment or a
// DaemonSet would (a scheduler that lost its Lease exits, say); what a
// fault keeps stopped stays stopped.
func (s *soak) supervise(context.Context) {
	s.mu.Lock()
	var keep []string
	for name := range s.keepStopped {
		keep = append(keep, name)
	}
	s.mu.Unlock()
	started, err := s.c.Revive(keep...)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, name := range started {
		s.selfExits[name]++
		s.markRestart(name)
	}
	if err != nil {
		s.violate(time.Now(), "", fmt.Sprintf("could not start an exited component again: %v", err))
	}
}

// markRestart notes where a component's log stood when it (re)started:
// what it says after that is the new process's. Called with the lock held.
func (s *soak) markRestart(name string) {
	if fi, err := os.Stat(filepath.Join(s.dir, "logs", name+".log")); err == nil {
		s.logOffset[name] = fi.Size()
	}
}

// leader is the scheduler replica that leads now: the one whose log, since
// it last started, says it acquired the Lease (both run on this host, so
// the Lease's holder, <hostname>_<uuid>, does not tell them apart).
func (s *soak) leader() (leader, standby string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	replicas := []string{"scheduler", "scheduler-2"}
	for i, name := range replicas {
		raw, err := os.ReadFile(filepath.Join(s.dir, "logs", name+".log"))
		if err != nil || int64(len(raw)) < s.logOffset[name] {
			continue
		}
		// client-go's leaderelection: `"Successfully acquired lease" lock=...`.
		if strings.Contains(strings.ToLower(string(raw[s.logOffset[name]:])), "successfully acquired lease") {
			return name, replicas[1-i]
		}
	}
	return "", ""
}

// list is the pods of the soak's namespace.
func (s *soak) list(ctx context.Context) ([]corev1.Pod, error) {
	l, err := s.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

func (s *soak) count(op string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ops[op]++
	if err != nil {
		s.opErrs[op]++
	}
}

// pod is a tenant pod of the soak: one container, no node chosen.
func pod(name, kind string, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{kindLabel: kind}, Annotations: annotations},
		Spec: corev1.PodSpec{SchedulerName: "gpufrac", Containers: []corev1.Container{{Name: "main", Image: "cuda",
			Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")}}}}},
	}
}

// deployment is a Deployment of replicas fractional pods.
func deployment(name string, replicas int32, annotations map[string]string) *appsv1.Deployment {
	p := pod("", "deploy", annotations)
	labels := map[string]string{kindLabel: "deploy", "app": name}
	return &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{Replicas: &replicas, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: annotations}, Spec: p.Spec}}}
}

// job is a Job of completions fractional pods, two at a time.
func job(name string, completions int32, annotations map[string]string) *batchv1.Job {
	p := pod("", "job", annotations)
	p.Spec.RestartPolicy = corev1.RestartPolicyNever
	parallelism := int32(2)
	return &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: batchv1.JobSpec{Completions: &completions, Parallelism: &parallelism,
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{kindLabel: "job"}, Annotations: annotations}, Spec: p.Spec}}}
}
