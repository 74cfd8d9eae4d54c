package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/internal/cli"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
)

// gpufracTop runs `gpufrac top` with args against the cluster.
func gpufracTop(t *testing.T, kubeconfig string, args ...string) string {
	t.Helper()
	cmd := cli.NewRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append([]string{"top", "--kubeconfig", kubeconfig}, args...))
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		t.Fatalf("gpufrac top %v: %v\n%s", args, err, out.String())
	}
	return out.String()
}

// On `gpufrac up`, whose simulated GPUs report a modelled use, `gpufrac
// top` shows a used figure per tenant; --advise suggests a smaller share
// for an idle tenant, with the exact kubectl line, never below what it
// holds now, and nothing for a busy one.
func TestTopShowsUseAndAdvice(t *testing.T) {
	c, _ := up(t, 1)
	ctx := context.Background()
	for name, load := range map[string]string{"idle-share": "idle", "busy-share": "busy"} {
		p := pod(name, map[string]string{api.KeyMemory: "8192", api.SimulatedLoadAnnotation: load})
		if _, err := c.Admin.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	running(t, c, "default")
	var view clusterview.View
	tenants := map[string]clusterview.Tenant{}
	// The agents resync every 2 s: five readings make a window to advise on.
	err := wait.PollUntilContextTimeout(ctx, time.Second, 90*time.Second, true, func(context.Context) (bool, error) {
		view = clusterview.View{}
		if err := json.Unmarshal([]byte(gpufracTop(t, c.Kubeconfig, "-o", "json")), &view); err != nil {
			return false, err
		}
		for _, n := range view.Nodes {
			for _, g := range n.Shared {
				for _, tn := range g.Tenants {
					tenants[tn.Pod] = tn
				}
			}
		}
		idle, busy := tenants["default/idle-share"], tenants["default/busy-share"]
		return idle.Use != nil && busy.Use != nil && idle.Use.Samples >= clusterview.MinAdviceSamples && busy.Use.Samples >= clusterview.MinAdviceSamples, nil
	})
	if err != nil {
		t.Fatalf("no window of use on the tenants: %v: %+v", err, tenants)
	}
	idle, busy := tenants["default/idle-share"], tenants["default/busy-share"]
	if *idle.Use.UsedMiB > 1024 || *busy.Use.UsedMiB < 7000 {
		t.Errorf("used: idle %d MiB, busy %d MiB of 8Gi", *idle.Use.UsedMiB, *busy.Use.UsedMiB)
	}
	if idle.Advice == nil || idle.Advice.RequestMiB >= idle.RequestMiB || idle.Advice.RequestMiB < *idle.Use.UsedMiB {
		t.Errorf("idle tenant's advice %+v (request %d MiB, holds %d MiB): want a smaller request, not below what it holds", idle.Advice, idle.RequestMiB, *idle.Use.UsedMiB)
	}
	if !idle.Idle {
		t.Errorf("the idle tenant is not marked idle: %+v", idle.Use)
	}
	if busy.Advice != nil || busy.Idle {
		t.Errorf("busy tenant advised %+v, idle %v: want nothing", busy.Advice, busy.Idle)
	}

	text := gpufracTop(t, c.Kubeconfig, "--advise")
	var idleLine string
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, "default/idle-share") && strings.Contains(line, "8Gi") {
			idleLine = line
		}
	}
	if idleLine == "" || strings.HasSuffix(strings.Fields(idleLine)[3], "-") {
		t.Errorf("top's line for the idle tenant has no used figure: %q\n%s", idleLine, text)
	}
	want := fmt.Sprintf("kubectl annotate pod -n default idle-share %s=", api.KeyResizeRequest)
	if !strings.Contains(text, "default/idle-share: shrink the request 8Gi → ") || !strings.Contains(text, want) {
		t.Errorf("--advise lacks the idle tenant's shrink and its command %q:\n%s", want, text)
	}
	if strings.Contains(text, "default/busy-share: ") {
		t.Errorf("--advise suggests a resize for the busy tenant:\n%s", text)
	}
}
