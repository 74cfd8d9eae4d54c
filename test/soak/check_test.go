//go:build soak

package soak

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/audit"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// broken are the audit's findings that are a promise broken the moment
// they are seen (a GPU over its memory, modes mixed, a whole GPU shared, a
// decision that names no GPU or no valid one); the others (a reservation
// pod not yet collected, a GPU its node has not yet accounted) are steps
// the cluster has yet to take, findings only once they outlast
// settleBound.
var broken = []audit.Kind{audit.OverCommitted, audit.MixedModes, audit.ComputeOverOne, audit.WholeShared,
	audit.TooManyGPUs, audit.NoDevices, audit.BadDecision}

// check looks at the whole cluster once: the audit, the reservation pods
// against the groups their tenants use, and the pods that wait although a
// GPU is free for them.
func (s *soak) check(ctx context.Context) {
	issues, err := s.issues(ctx)
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		return // the API server is down (a fault): the next look sees
	}
	current := map[string]bool{}
	for _, is := range issues {
		if is.broken && !s.rejoining(is.node, now) {
			s.violate(now, is.key, is.what)
			continue
		}
		current[is.key] = true
		first, ok := s.persisting[is.key]
		if !ok {
			s.persisting[is.key] = now
			continue
		}
		if now.Sub(first) >= settleBound && now.Sub(s.lastFaultEnd) >= settleBound && !s.faulting {
			s.violate(now, is.key, fmt.Sprintf("%s (for %s)", is.what, now.Sub(first).Round(time.Second)))
		}
	}
	for key := range s.persisting {
		if !current[key] {
			delete(s.persisting, key)
		}
	}
}

// rejoining says whether node is away or came back less than settleBound
// ago: until its agent publishes its GPUs again, the pods still bound to
// it cannot be read against them. Called with the lock held.
func (s *soak) rejoining(node string, now time.Time) bool {
	if _, away := s.removedSince[node]; away {
		return true
	}
	at, ok := s.readded[node]
	return ok && now.Sub(at) < settleBound
}

// issue is one thing wrong: key names it across looks (the objects, not
// the figures, which change), what says it; node is where, if known.
type issue struct {
	key, what, node string
	broken          bool
}

// issues are what is wrong with the cluster now.
func (s *soak) issues(ctx context.Context) ([]issue, error) {
	nodes, err := s.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	pods, err := s.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	claims, err := s.client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []issue
	nodeOf := map[string]string{}
	for _, p := range pods.Items {
		nodeOf[p.Namespace+"/"+p.Name] = p.Spec.NodeName
	}
	for _, v := range audit.Check(nodes.Items, pods.Items, claims.Items, audit.Options{OrphanGrace: 30 * time.Second, Now: time.Now()}) {
		node, ok := nodeOf[v.Object]
		if !ok {
			node, _, _ = strings.Cut(v.Object, "/") // node/GPU
		}
		out = append(out, issue{key: fmt.Sprintf("audit %s %s", v.Kind, v.Object), what: "audit: " + v.String(), node: node, broken: slices.Contains(broken, v.Kind)})
	}
	// Every GPU group live tenants use has its one reservation pod, and
	// no group has two.
	used, held := map[string]bool{}, map[string]int{}
	for _, p := range pods.Items {
		if p.Namespace == scheduler.DefaultReservationNamespace {
			if p.DeletionTimestamp == nil {
				held[p.Spec.NodeName+"/"+p.Labels[api.GPUGroupLabel]]++
			}
			continue
		}
		if p.Spec.NodeName == "" || p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		for _, g := range api.SplitList(p.Annotations[api.GPUGroupsAnnotation]) {
			used[p.Spec.NodeName+"/"+g] = true
		}
	}
	for g := range used {
		if held[g] != 1 {
			out = append(out, issue{key: "group held " + g, what: fmt.Sprintf("GPU group %s is used by live pods and held by %d reservation pods, want 1", g, held[g])})
		}
	}
	for g, n := range held {
		if n > 1 && used[g] {
			continue // said above
		}
		if n > 1 {
			out = append(out, issue{key: "group held " + g, what: fmt.Sprintf("GPU group %s is held by %d reservation pods", g, n)})
		}
	}
	// A pod that waits while a ready node has enough GPUs nobody holds.
	view := clusterview.Build(nodes.Items, pods.Items, claims.Items)
	s.mu.Lock()
	down := map[string]bool{}
	for n := range s.agentDown {
		down[n] = true
	}
	s.mu.Unlock()
	idle := 0
	for _, n := range view.Nodes {
		if n.Ready && !down[n.Name] {
			idle = max(idle, n.Idle)
		}
	}
	for _, p := range pods.Items {
		if p.Namespace != ns || p.Spec.NodeName != "" || p.DeletionTimestamp != nil || p.Labels[kindLabel] == "claim" {
			continue
		}
		if need := devicesAsked(&p); need > 0 && need <= idle {
			out = append(out, issue{key: "waits " + p.Name, what: fmt.Sprintf("pod %s waits for %d GPU(s) while a ready node has %d nobody holds", p.Name, need, idle)})
		}
	}
	return out, nil
}

// devicesAsked is how many GPUs a pod needs on one node: a share's
// devices, or its whole GPUs.
func devicesAsked(p *corev1.Pod) int {
	reqs, err := api.Parse(api.Intent(p))
	if err == nil && len(reqs) > 0 {
		n := 0
		for _, r := range reqs {
			n += r.Devices
		}
		return n
	}
	for _, c := range p.Spec.Containers {
		if q, ok := c.Resources.Limits[api.ResourceGPU]; ok {
			return int(q.Value())
		}
	}
	return 0
}

// unsettled says what still keeps the cluster from its steady state, ""
// when nothing does: no finding of any kind, every pod that fits placed.
func (s *soak) unsettled(ctx context.Context) string {
	issues, err := s.issues(ctx)
	if err != nil {
		return err.Error()
	}
	var what []string
	for _, is := range issues {
		what = append(what, is.what)
	}
	sort.Strings(what)
	return strings.Join(what, "; ")
}
