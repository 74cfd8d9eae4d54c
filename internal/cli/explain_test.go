package cli

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func explainExit(t *testing.T, in string, args ...string) (string, int) {
	t.Helper()
	cmd := NewRootCommand()
	var out bytes.Buffer
	cmd.SetIn(strings.NewReader(in))
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append(append([]string{"explain"}, args...), "-"))
	err := cmd.Execute()
	var exit *ExitError
	switch {
	case err == nil:
		return out.String(), 0
	case errors.As(err, &exit):
		if exit.Err != nil {
			out.WriteString(exit.Err.Error())
		}
		return out.String(), exit.Code
	}
	t.Fatalf("explain: %v", err)
	return "", 0
}

func TestExplainExitCodes(t *testing.T) {
	const scheduled = `apiVersion: v1
kind: Pod
metadata:
  name: p
  annotations:
    nvidia.com/container.main.gpus.devices: GPU-0a
    nvidia.com/container.main.gpu-memory.request: 2Gi
spec:
  containers: [{name: main, image: cuda}]
`
	for _, tt := range []struct {
		name, in string
		args     []string
		code     int
		want     string
	}{
		{"would run", scheduled, nil, 0, "default/p container main: RUN"},
		{"would refuse", scheduled, []string{"--memory-limits", "off"}, 1, "REFUSE: container \"main\": this node enforces no GPU memory limits"},
		{"not YAML", "kind: [", nil, 2, "explain: <stdin>:1"},
		{"no pod", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n", nil, 2, "holds no Pod"},
		{"bad flag value", scheduled, []string{"--memory-limits", "strong"}, 2, `--memory-limits "strong": must be auto, driver, toolkit, mps-pinned or off`},
		{"unknown machine", scheduled, []string{"--simulate-gpus", "dgx1"}, 2, `--simulate-gpus "dgx1": unknown machine`},
		{"a burst above the request", strings.Replace(scheduled, "gpu-memory.request: 2Gi", "gpu-memory.request: 2Gi\n    nvidia.com/container.main.gpu-memory.limit: 4Gi", 1), nil, 0,
			"burst: above its request of 2048Mi it may be stopped while its GPU has under --burst-reclaim-below (5% by default) of its memory free"},
		{"auto on a pre-r615 mock machine", scheduled, []string{"--memory-limits", "auto", "--simulate-gpus", "dgxa100"}, 0, "env set: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			out, code := explainExit(t, tt.in, tt.args...)
			if code != tt.code || !strings.Contains(out, tt.want) {
				t.Errorf("exit %d, want %d; output lacks %q:\n%s", code, tt.code, tt.want, out)
			}
		})
	}
}
