//go:build nodee2e

// The scenarios that stop, kill or corrupt the node agent run as a host
// process (hostnode_test.go), not as the chart's pod (chart_test.go).

package node

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// With the agent down (killed: a stopped agent marks the node not ready
// first, and the scheduler then places nothing there), a fractional
// container starts without our adjustment, since the runtime goes on
// without a plugin. When the agent comes back, its audit of the runtime's
// containers evicts exactly that pod and leaves the enforced one running.
// A killed agent clears nothing: its node stays Ready as last published.
// Once its heartbeat is older than the bound it published (three 2 s
// resyncs, at least 30 s), the scheduler sends the node no fraction and
// says why; once the agent is back, the waiting pod is placed and runs
// with its limits.
func TestSilentAgentsNodeTakesNoFractions(t *testing.T) {
	node, err := theNode.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := node.Labels[api.LabelAgentHeartbeat]; got != "30" {
		t.Fatalf("the agent publishes a heartbeat bound of %q s, want 30", got)
	}
	theNode.killProcess("node-agent")
	killed := time.Now()
	t.Cleanup(func() {
		if theNode.exited("node-agent") != nil {
			if err := theNode.startAgent(); err != nil {
				t.Error(err)
			}
		}
	})
	time.Sleep(time.Until(killed.Add(31 * time.Second)))
	createPod(t, "after-silence", map[string]string{"gpu-memory": "1024"}, probe("main", nil))
	const want = "gpufrac agent has not been heard from"
	if err := waitFor("the scheduler to refuse the silent node", 30*time.Second, func() (bool, error) {
		p := getPod(t, "after-silence")
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("placed on %s with its agent silent", p.Spec.NodeName)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, want) {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatal(err)
	}
	// Still refused a few seconds on: nothing else opens the node.
	time.Sleep(3 * time.Second)
	if p := getPod(t, "after-silence"); p.Spec.NodeName != "" {
		t.Fatalf("placed on %s with its agent silent", p.Spec.NodeName)
	}
	if err := theNode.startAgent(); err != nil {
		t.Fatal(err)
	}
	pod := running(t, "after-silence")
	checkLimits(t, pod, assignment(t, pod, "main"), theNode.probeReport(t, pod, "main"))
}

// A corrupt state file does not put the agent in a crash loop: it keeps
// running, the node is not ready with the file named and what to do, and
// no fraction is placed; once the file is moved aside and the agent
// restarted, the node is ready again.
func TestCorruptStateMakesTheNodeNotReady(t *testing.T) {
	leases := theNode.path("agent", "leases.json")
	theNode.killProcess("node-agent")
	saved, err := os.ReadFile(leases)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if saved != nil {
			_ = os.WriteFile(leases, saved, 0o600)
		} else {
			_ = os.Remove(leases)
		}
		theNode.killProcess("node-agent")
		if err := theNode.startAgent(); err != nil {
			t.Error(err)
		}
		if err := theNode.waitFractionReady(time.Minute); err != nil {
			t.Error(err)
		}
	})
	if err := os.WriteFile(leases, []byte("{torn"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := theNode.startAgent(); err != nil {
		t.Fatal(err)
	}
	var message string
	if err := waitFor("the node to say its agent's state is unreadable", time.Minute, func() (bool, error) {
		if err := theNode.exited("node-agent"); err != nil {
			return false, err
		}
		node, err := theNode.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		cond, ok := api.FractioningCondition(node)
		message = cond.Message
		return ok && cond.Status == corev1.ConditionFalse && cond.Reason == "AgentStateUnreadable", nil
	}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(message, leases) || !strings.Contains(message, "restart the agent") {
		t.Errorf("the reason does not name the file and the fix: %q", message)
	}
	time.Sleep(5 * time.Second) // two resyncs: still running
	if err := theNode.exited("node-agent"); err != nil {
		t.Fatalf("the agent did not keep running: %v", err)
	}
}

// An unenforced container (started while the agent was down) is stopped
// once the agent is back, its pod's disruption budget notwithstanding;
// the enforced one is left alone.
func TestAgentOutageStopsOnlyTheUnenforced(t *testing.T) {
	createPod(t, "enforced", map[string]string{"gpu-memory": "4096"}, probe("main", nil))
	enforced := running(t, "enforced")
	a := assignment(t, enforced, "main")
	checkLimits(t, enforced, a, theNode.probeReport(t, enforced, "main"))

	theNode.killProcess("node-agent")
	t.Cleanup(func() {
		if theNode.exited("node-agent") != nil {
			if err := theNode.startAgent(); err != nil {
				t.Error(err)
			}
		}
	})
	// Small enough for the GPU enforced already holds, so no new
	// reservation pod (whose GPU only the agent would name) is needed.
	// Issue 53: its tenant gives it a year to stop, and a preStop hook
	// that takes as long; the agent's stop must not wait for either.
	year := int64(365 * 24 * 3600)
	createPodWith(t, "unadjusted", map[string]string{"gpu-memory": "1024"}, func(p *corev1.Pod) {
		p.Spec.TerminationGracePeriodSeconds = &year
		p.Spec.Containers[0].Lifecycle = &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Exec: &corev1.ExecAction{Command: []string{"/bin/sleep", "31536000"}}}}
	}, probe("main", nil))
	unadjusted := running(t, "unadjusted")
	r := theNode.probeReport(t, unadjusted, "main")
	if v, ok := r.Env[nodeapi.EnvMemoryLimit]; ok {
		t.Fatalf("with the agent down the container was adjusted anyway (%s=%s)", nodeapi.EnvMemoryLimit, v)
	}
	// Its tenant's disruption budget allows no disruption: an eviction is
	// refused, and the pod must go anyway.
	pinPod(t, "unadjusted")

	if err := theNode.startAgent(); err != nil {
		t.Fatal(err)
	}
	// Gone, not only asked to go: its containers stopped and the kubelet
	// removed it, within the agent's security grace (2s here) and a resync.
	if err := waitFor("the unadjusted pod to be stopped and gone", 90*time.Second, func() (bool, error) {
		p, err := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), "unadjusted", metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && p.UID != unadjusted.UID) {
			return true, nil
		}
		return false, err
	}); err != nil {
		p, _ := theNode.admin.CoreV1().Pods(ns).Get(context.Background(), "unadjusted", metav1.GetOptions{})
		if p != nil {
			t.Logf("deletion %v, grace %v", p.DeletionTimestamp, p.DeletionGracePeriodSeconds)
		}
		t.Fatal(err)
	}
	// The audit is done; the enforced pod stays through two more resyncs
	// (2 s each) and gets no eviction.
	time.Sleep(5 * time.Second)
	events, err := theNode.admin.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=enforced"})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events.Items {
		if strings.Contains(e.Reason, "Evict") || strings.Contains(e.Message, "evict") {
			t.Errorf("the enforced pod got %s: %s", e.Reason, e.Message)
		}
	}
	after := getPod(t, "enforced")
	if after.UID != enforced.UID || after.DeletionTimestamp != nil || after.Status.Phase != corev1.PodRunning {
		t.Errorf("the enforced pod did not survive the audit: uid %s→%s, deleting %v, phase %s", enforced.UID, after.UID, after.DeletionTimestamp, after.Status.Phase)
	}
	if id := containerID(t, after, "main"); id != containerID(t, enforced, "main") {
		t.Errorf("the enforced container was replaced: %s", id)
	}
	if err := theNode.waitFractionReady(time.Minute); err != nil {
		t.Error(err)
	}
}
