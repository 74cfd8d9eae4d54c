// Package drain replaces a node's MPS daemon the way an operator drains a
// node: close the node to new fractions, evict its shares through the
// Eviction API (so every PodDisruptionBudget is honoured) within a
// deadline, delete the daemon's pod so that its DaemonSet starts one from
// the current template, wait for the new daemon and the node agent's
// readiness, and reopen the node (gpufrac mps-replace).
//
// The daemon's DaemonSet is updateStrategy OnDelete: a helm upgrade never
// replaces it, because every tenant's GPU context lives in it. This is the
// one path that does, once nothing depends on it.
package drain

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/publish"
)

// Options say what to drain and how long to wait.
type Options struct {
	Node string
	// Namespace and Selector find the node's MPS daemon pod (the chart's
	// <release>-mps DaemonSet).
	Namespace, Selector string
	// Timeout bounds the evictions: shares a disruption budget still
	// holds then are left running, the node stays closed, and Run fails
	// naming them.
	Timeout time.Duration
	// ReadyTimeout bounds the wait for the new daemon and the agent.
	ReadyTimeout time.Duration
	// DrainOnly closes the node and evicts its shares, leaving the daemon
	// and the closure (a GPU Operator driver upgrade replaces the daemon
	// itself); Reopen only removes the closure.
	DrainOnly, Reopen bool
	// Poll is how often evictions are retried and readiness checked.
	Poll time.Duration
	// Out gets a line per step.
	Out io.Writer
}

// ClosedBy is the closure label's value this package writes.
const ClosedBy = "mps-replace"

// Run drains the node as opts say.
func Run(ctx context.Context, client kubernetes.Interface, opts Options) error {
	if opts.Poll <= 0 {
		opts.Poll = 2 * time.Second
	}
	if opts.Out == nil {
		opts.Out = io.Discard
	}
	node, err := client.CoreV1().Nodes().Get(ctx, opts.Node, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("node %q: %w", opts.Node, err)
	}
	if opts.Reopen {
		if by, closed := api.FractionsClosed(node.Labels); closed && by != ClosedBy {
			return fmt.Errorf("node %s was closed to fractions by %q, not by mps-replace: remove the label %s yourself if you mean to reopen it", opts.Node, by, api.LabelFractionsClosed)
		}
		return reopen(ctx, client, opts)
	}
	if by, closed := api.FractionsClosed(node.Labels); closed && by != ClosedBy {
		// Someone else's closure: reopening at the end would undo it.
		return fmt.Errorf("node %s is already closed to fractions by %q (label %s): nothing done; drain it when they are done", opts.Node, by, api.LabelFractionsClosed)
	}
	if !opts.DrainOnly {
		// Before anything is evicted: a wrong namespace or selector must
		// not cost the tenants their pods.
		pod, err := daemonPod(ctx, client, opts)
		if err != nil {
			return err
		}
		if pod == nil {
			return fmt.Errorf("no MPS daemon pod on node %s (namespace %s, selector %s): nothing evicted; name the release's with -n and --selector", opts.Node, opts.Namespace, opts.Selector)
		}
	}
	closedAt := time.Now()
	if err := label(ctx, client, opts.Node, api.CloseToFractions(ClosedBy)); err != nil {
		return fmt.Errorf("closing node %s to new fractions: %w", opts.Node, err)
	}
	fmt.Fprintf(opts.Out, "node %s: closed to new fractions (label %s=%s)\n", opts.Node, api.LabelFractionsClosed, ClosedBy)
	if err := waitClosed(ctx, client, opts, closedAt); err != nil {
		return err
	}
	if err := evictShares(ctx, client, opts); err != nil {
		return err
	}
	if opts.DrainOnly {
		fmt.Fprintf(opts.Out, "node %s: no shares left; it stays closed until gpufrac mps-replace %s --reopen\n", opts.Node, opts.Node)
		return nil
	}
	if err := replaceDaemon(ctx, client, opts); err != nil {
		return fmt.Errorf("%w; node %s stays closed to new fractions (gpufrac mps-replace %s --reopen opens it)", err, opts.Node, opts.Node)
	}
	return reopen(ctx, client, opts)
}

func reopen(ctx context.Context, client kubernetes.Interface, opts Options) error {
	if err := label(ctx, client, opts.Node, api.CloseToFractions("")); err != nil {
		return fmt.Errorf("reopening node %s to fractions: %w", opts.Node, err)
	}
	fmt.Fprintf(opts.Out, "node %s: open to fractions\n", opts.Node)
	return nil
}

func label(ctx context.Context, client kubernetes.Interface, node string, w api.Write) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": w.MergePatch()}})
	if err != nil {
		return err
	}
	_, err = client.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// shares are the node's pods that hold a GPU share: placed (or asking
// for) a fraction by annotation, or holding a claim of gpufrac's DRA
// driver. They are MPS clients of the node's daemon.
func shares(ctx context.Context, client kubernetes.Interface, node string) ([]corev1.Pod, error) {
	pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String()})
	if err != nil {
		return nil, err
	}
	var out []corev1.Pod
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		share := api.HasDecision(p.Annotations) || api.AsksForFraction(p.Annotations)
		for _, s := range p.Status.ResourceClaimStatuses {
			if share || s.ResourceClaimName == nil {
				continue
			}
			claim, err := client.ResourceV1().ResourceClaims(p.Namespace).Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				if apierrors.IsNotFound(err) {
					continue
				}
				return nil, fmt.Errorf("claim %s/%s of pod %s: %w", p.Namespace, *s.ResourceClaimName, p.Name, err)
			}
			held, err := api.ClaimShares(claim)
			share = err != nil || len(held) > 0 // a claim of ours it cannot read is still ours
		}
		if share {
			out = append(out, p)
		}
	}
	return out, nil
}

// evictShares evicts the node's shares through the Eviction API until none
// is left or opts.Timeout passes: a budget that refuses now may allow later
// (an evicted replica started elsewhere), so refused evictions are retried.
func evictShares(ctx context.Context, client kubernetes.Interface, opts Options) error {
	deadline := time.Now().Add(opts.Timeout)
	asked := map[types.UID]bool{}
	for {
		left, err := shares(ctx, client, opts.Node)
		if err != nil {
			return fmt.Errorf("listing node %s's shares: %w", opts.Node, err)
		}
		if len(left) == 0 {
			fmt.Fprintf(opts.Out, "node %s: every share evicted\n", opts.Node)
			return nil
		}
		var blocked []string
		for _, p := range left {
			if p.DeletionTimestamp != nil {
				continue // evicted, terminating
			}
			err := client.PolicyV1().Evictions(p.Namespace).Evict(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
				DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &p.UID}}})
			switch {
			case err == nil:
				if !asked[p.UID] {
					fmt.Fprintf(opts.Out, "node %s: evicted pod %s/%s\n", opts.Node, p.Namespace, p.Name)
				}
				asked[p.UID] = true
			case apierrors.IsNotFound(err), apierrors.IsConflict(err):
				// gone, or another pod of that name now
			case apierrors.IsTooManyRequests(err):
				why, budget := reason(err)
				if !budget {
					why = "the API server asks to retry: " + why
				}
				blocked = append(blocked, fmt.Sprintf("%s/%s (%s)", p.Namespace, p.Name, why))
			default:
				return fmt.Errorf("evicting pod %s/%s: %w", p.Namespace, p.Name, err)
			}
		}
		if time.Now().After(deadline) {
			names := make([]string, 0, len(left))
			for _, p := range left {
				name := p.Namespace + "/" + p.Name
				if p.DeletionTimestamp != nil {
					name += " (terminating)"
				}
				names = append(names, name)
			}
			slices.Sort(names)
			msg := fmt.Sprintf("node %s: %d share(s) still on the node after %s: %s", opts.Node, len(left), opts.Timeout, strings.Join(names, ", "))
			if len(blocked) > 0 {
				msg += "; evictions refused: " + strings.Join(blocked, ", ")
			}
			return errors.New(msg + "; the MPS daemon was not replaced, and the node stays closed to new fractions (run again, or --reopen)")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(opts.Poll):
		}
	}
}

// reason is the API server's word on a refused eviction, and whether a
// disruption budget refused it (429 is also the API server's throttling).
func reason(err error) (string, bool) {
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return err.Error(), false
	}
	s := status.Status()
	if s.Details != nil {
		for _, c := range s.Details.Causes {
			if c.Type == policyv1.DisruptionBudgetCause {
				return c.Message, true
			}
		}
	}
	return s.Message, false
}

// waitClosed waits until the node agent has seen the closure: schedulers
// other than gpufrac's read its readiness condition, and it offers no DRA
// share once it has. Seen: its condition says ClosedToFractions, or (not
// ready for a reason of its own, which then shows) it has published twice
// since. An agent older than 0.2.0 never does: then the node must be
// cordoned, which closes it to every new pod.
func waitClosed(ctx context.Context, client kubernetes.Interface, opts Options, closedAt time.Time) error {
	deadline := time.Now().Add(opts.ReadyTimeout)
	var beats []time.Time
	for {
		n, err := client.CoreV1().Nodes().Get(ctx, opts.Node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if n.Spec.Unschedulable {
			return nil
		}
		if c, ok := api.FractioningCondition(n); ok {
			hb := c.LastHeartbeatTime.Time
			if c.Reason == publish.ReasonClosed && !hb.Before(closedAt.Truncate(time.Second)) {
				return nil
			}
			if hb.After(closedAt) && !slices.ContainsFunc(beats, hb.Equal) {
				beats = append(beats, hb)
			}
			if len(beats) >= 2 {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("node %s: its node agent did not confirm the closure within %s (an agent older than 0.2.0 does not read %s: cordon the node, kubectl cordon %s, and run this again); nothing evicted, the node stays labelled closed",
				opts.Node, opts.ReadyTimeout, api.LabelFractionsClosed, opts.Node)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(opts.Poll):
		}
	}
}

// replaceDaemon deletes the node's MPS daemon pod and waits for its
// DaemonSet's new pod to be Ready (a daemon runs) and the node agent to
// report the node ready again (it saw the new daemon, its namespaces are
// in place).
func replaceDaemon(ctx context.Context, client kubernetes.Interface, opts Options) error {
	old, err := daemonPod(ctx, client, opts)
	if err != nil {
		return err
	}
	if old == nil {
		return fmt.Errorf("no MPS daemon pod on node %s (namespace %s, selector %s)", opts.Node, opts.Namespace, opts.Selector)
	}
	// Once more, just before: nothing may be left on the daemon.
	left, err := shares(ctx, client, opts.Node)
	if err != nil {
		return fmt.Errorf("listing node %s's shares before replacing its MPS daemon: %w", opts.Node, err)
	}
	if len(left) > 0 {
		return fmt.Errorf("node %s: %d share(s) appeared after the drain (%s/%s first): the MPS daemon was not replaced", opts.Node, len(left), left[0].Namespace, left[0].Name)
	}
	if err := client.CoreV1().Pods(old.Namespace).Delete(ctx, old.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &old.UID}}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting the MPS daemon pod %s/%s: %w", old.Namespace, old.Name, err)
	}
	fmt.Fprintf(opts.Out, "node %s: deleted the MPS daemon pod %s; waiting for its DaemonSet's new one\n", opts.Node, old.Name)
	deadline := time.Now().Add(opts.ReadyTimeout)
	var last string
	for {
		pod, err := daemonPod(ctx, client, opts)
		switch {
		case err != nil:
			last = err.Error()
		case pod == nil || pod.UID == old.UID:
			last = "no new MPS daemon pod yet"
		case !podReady(pod):
			last = "the new MPS daemon pod " + pod.Name + " is not Ready"
		default:
			ready, why, err := agentReady(ctx, client, opts.Node, pod)
			switch {
			case err != nil:
				last = err.Error()
			case ready:
				fmt.Fprintf(opts.Out, "node %s: MPS daemon pod %s Ready, and the node agent reports the node ready\n", opts.Node, pod.Name)
				return nil
			default:
				last = why
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the node's new MPS daemon was not in service within %s: %s", opts.ReadyTimeout, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(opts.Poll):
		}
	}
}

// agentReady says whether the node agent has seen the new daemon: its
// readiness condition is heard after the daemon pod became ready, and
// says nothing but the closure.
func agentReady(ctx context.Context, client kubernetes.Interface, node string, daemon *corev1.Pod) (bool, string, error) {
	n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return false, "", err
	}
	c, ok := api.FractioningCondition(n)
	switch {
	case !ok:
		return false, "the node reports no " + api.ConditionFractioningReady + " condition (is the node agent running?)", nil
	case c.LastHeartbeatTime.Time.Before(readySince(daemon)):
		return false, "the node agent has not resynced since the new daemon started", nil
	case c.Status == corev1.ConditionTrue || c.Reason == publish.ReasonClosed:
		return true, "", nil
	}
	return false, fmt.Sprintf("the node agent reports %s=%s (%s: %s)", api.ConditionFractioningReady, c.Status, c.Reason, c.Message), nil
}

func daemonPod(ctx context.Context, client kubernetes.Interface, opts Options) (*corev1.Pod, error) {
	pods, err := client.CoreV1().Pods(opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: opts.Selector,
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", opts.Node).String()})
	if err != nil {
		return nil, fmt.Errorf("finding the MPS daemon pod: %w", err)
	}
	for i, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			return &pods.Items[i], nil
		}
	}
	return nil, nil
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func readySince(p *corev1.Pod) time.Time {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.LastTransitionTime.Time
		}
	}
	return time.Time{}
}
