//go:build soak

package soak

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
)

// faultKinds are the faults the soak injects, by weight.
var faultKinds = []struct {
	name   string
	weight int
}{
	{"kill-leading-scheduler", 3}, {"kill-standby-scheduler", 2}, {"kill-webhook-replica", 2},
	{"node-agent-down", 3}, {"restart-kube-apiserver", 1}, {"restart-etcd", 1},
	{"node-removed", 1}, {"cut-api-connections", 2}, {"slow-api", 2},
}

// inject runs one fault at a time, each 15 to 35 s after the previous one
// ended, until ctx ends; every fault it started is undone before it
// returns (a stopped agent started, a removed node back).
func (s *soak) inject(ctx context.Context) {
	total := 0
	for _, k := range faultKinds {
		total += k.weight
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(15+s.frng.Intn(21)) * time.Second):
		}
		n := s.frng.Intn(total)
		kind := ""
		for _, k := range faultKinds {
			if n -= k.weight; n < 0 {
				kind = k.name
				break
			}
		}
		f := fault{Kind: kind, At: time.Now()}
		s.mu.Lock()
		s.faulting = true
		s.mu.Unlock()
		detail, err := s.fault(ctx, kind)
		f.Detail, f.End = detail, time.Now()
		if err != nil {
			f.Detail += fmt.Sprintf(" (failed: %v)", err)
		}
		s.mu.Lock()
		s.faulting = false
		s.faults = append(s.faults, f)
		if f.End.After(s.lastFaultEnd) {
			s.lastFaultEnd = f.End
		}
		if err != nil {
			s.violate(f.End, "", fmt.Sprintf("fault %s %s could not be injected or undone: %v", kind, detail, err))
		}
		s.mu.Unlock()
	}
}

// hold waits d, or less if ctx ends: a fault that holds a component down
// is still undone.
func hold(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// fault injects one fault and undoes it; it returns what it hit. Its end
// is when the cluster has the component back (a killed leader's Lease
// expires, kube-apiserver answers again).
func (s *soak) fault(ctx context.Context, kind string) (string, error) {
	nodes := s.c.Nodes()
	switch kind {
	case "kill-leading-scheduler", "kill-standby-scheduler":
		leader, standby := s.leader()
		target := leader
		if kind == "kill-standby-scheduler" {
			target = standby
		}
		if target == "" {
			target = "scheduler"
		}
		err := s.c.Crash(target)
		s.mu.Lock()
		s.markRestart(target)
		s.mu.Unlock()
		if kind == "kill-leading-scheduler" {
			hold(context.Background(), leaseDuration) // the standby takes over once the Lease expires
		}
		return target, err
	case "kill-webhook-replica":
		target := fmt.Sprintf("webhook-%d", 1+s.frng.Intn(2))
		return target, s.c.Crash(target)
	case "node-agent-down":
		node := nodes[s.frng.Intn(len(nodes))]
		agent := "node-agent-" + node
		down := time.Duration(10+s.frng.Intn(21)) * time.Second
		s.mu.Lock()
		s.keepStopped[agent] = true
		s.mu.Unlock()
		err := s.c.Stop(agent)
		s.mu.Lock()
		s.agentDown[node] = time.Now()
		s.mu.Unlock()
		hold(context.Background(), down)
		// Started before supervise may: one agent per node, never two.
		if serr := s.c.Start(agent); err == nil {
			err = serr
		}
		s.mu.Lock()
		delete(s.keepStopped, agent)
		delete(s.agentDown, node)
		s.mu.Unlock()
		return fmt.Sprintf("%s for %s", node, down), err
	case "restart-kube-apiserver", "restart-etcd":
		target := "kube-apiserver"
		if kind == "restart-etcd" {
			target = "etcd"
		}
		if err := s.c.Crash(target); err != nil {
			return target, err
		}
		return target, s.apiReady()
	case "node-removed":
		node := nodes[s.frng.Intn(len(nodes))]
		agent := "node-agent-" + node
		// Longer than the pod garbage collector's quarantine (40 s, then
		// its 20 s period) at times, so that the node's pods go.
		away := time.Duration(20+s.frng.Intn(61)) * time.Second
		s.mu.Lock()
		s.keepStopped[agent] = true
		s.removedSince[node] = time.Now()
		s.mu.Unlock()
		err := s.c.RemoveNode(context.Background(), node)
		hold(context.Background(), away)
		aerr := s.c.AddNode(context.Background(), node)
		s.mu.Lock()
		s.removedEver[node] = append(s.removedEver[node], s.removedSince[node])
		s.readded[node] = time.Now()
		delete(s.removedSince, node)
		delete(s.keepStopped, agent)
		s.mu.Unlock()
		if err == nil {
			err = aerr
		}
		return fmt.Sprintf("%s for %s", node, away), err
	case "cut-api-connections":
		return fmt.Sprintf("%d connections", s.c.APIProxy.Cut()), nil
	case "slow-api":
		delay := time.Duration(100+s.frng.Intn(701)) * time.Millisecond
		span := time.Duration(10+s.frng.Intn(11)) * time.Second
		s.c.APIProxy.SetDelay(delay)
		hold(context.Background(), span)
		s.c.APIProxy.SetDelay(0)
		return fmt.Sprintf("%s per chunk for %s", delay, span), nil
	}
	return "", fmt.Errorf("no fault %q", kind)
}

// apiReady waits until kube-apiserver answers /readyz again.
func (s *soak) apiReady() error {
	client, err := rest.HTTPClientFor(s.c.AdminConfig)
	if err != nil {
		return err
	}
	return wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.c.AdminConfig.Host+"/readyz", nil)
		if err != nil {
			return false, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return false, nil //nolint:nilerr // not serving yet
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
}
