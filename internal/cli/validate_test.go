package cli

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// runCLI runs the real command tree as main would, returning stdout,
// stderr and the exit code.
func runCLI(t *testing.T, stdin string, args ...string) (string, string, int) {
	t.Helper()
	cmd := NewRootCommand()
	var out, errOut bytes.Buffer
	cmd.SetIn(strings.NewReader(stdin))
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err := cmd.Execute()
	code := 0
	var exit *ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.Code
	case err != nil:
		t.Fatalf("command failed outside validation: %v", err)
	}
	return out.String(), errOut.String(), code
}

func TestValidateExamplesAllOK(t *testing.T) {
	files, err := filepath.Glob("../../examples/*.yaml")
	if err != nil || len(files) < 6 {
		t.Fatalf("examples: %v %v", files, err)
	}
	out, errOut, code := runCLI(t, "", append([]string{"validate"}, files...)...)
	if code != 0 || errOut != "" {
		t.Fatalf("exit %d, stderr %q, stdout:\n%s", code, errOut, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for _, l := range lines {
		if !strings.HasPrefix(l, "OK ") || strings.HasSuffix(l, "no GPU fraction") {
			t.Errorf("example is not a valid fractional request: %s", l)
		}
	}
	// Every way to ask is shown: fraction, memory, burst, sm-sharing,
	// multi-device, a Deployment.
	for _, want := range []string{
		"request=0.5 limit=0.5 mode=time-slicing devices=1",
		"request=4096Mi limit=4096Mi",
		"request=0.25 limit=0.5",
		"request=4096Mi limit=8192Mi",
		"mode=sm-sharing",
		"devices=2",
		"OK Deployment ",
		"OK ResourceClaimTemplate default/quarter-gpu: DRA share gpu of gpu.gpufrac.io memory=20Gi",
		"OK Pod default/dra-quarter: GPU through DRA claims gpu",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no example gives %q; output:\n%s", want, out)
		}
	}
}

func TestValidateInvalidManifest(t *testing.T) {
	out, errOut, code := runCLI(t, "", "validate", "testdata/invalid.yaml")
	want := []string{
		`INVALID Pod team-a/whole-share: container "main": gpu-fraction "1" must be greater than 0 and less than 1`,
		`INVALID Pod default/forged: container "main": nvidia.com/container.main.gpus.devices "GPU-8f6c2a1e" is written by the scheduler and cannot be set in a manifest: remove it`,
		`INVALID Deployment default/both-ways: container "main": resources.limits[nvidia.com/gpu] "1" cannot be combined with GPU-fraction annotations on the same pod: ask for whole GPUs or for a fraction, not both; ` +
			`container "main": gpu-memory "4096" cannot be combined with gpu-fraction: ask for a share of a GPU or for an amount of memory, not both; ` +
			`container "main": gpu-fraction.limit "0.750001" must have at most 5 decimal places`,
		`INVALID CronJob default/nightly: gpu-fraction-container-name "trainer" names a container that is not in the pod (containers: main); ` +
			`container "trainer": gpu-memory "4Gi" must be a positive whole number of MiB without a unit, such as 4096`,
		`INVALID StatefulSet default/misplaced: metadata.annotations[gpu-fraction] "0.5" is on the StatefulSet itself, where nothing reads it: move it to the pod template's metadata.annotations`,
		`INVALID Pod default/unquoted: line 88: metadata.annotations[gpu-fraction] 0.50 is a number, not a string: quote it as "0.50"`,
		`SKIP Service default/web: no pod template`,
		`INVALID ResourceClaimTemplate default/no-memory: spec.spec.devices.requests[0](gpu).capacity.requests.memory "": a share of gpu.gpufrac.io must name its memory, at least 1Mi (20Gi)`,
	}
	if diff := cmp.Diff(want, strings.Split(strings.TrimSpace(out), "\n")); diff != "" {
		t.Errorf("output (-want +got):\n%s", diff)
	}
	if code != exitInvalid || errOut != "" {
		t.Errorf("exit %d stderr %q, want %d and nothing", code, errOut, exitInvalid)
	}
}

func TestValidateJSONListFromStdin(t *testing.T) {
	data, err := os.ReadFile("testdata/valid-list.json")
	if err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runCLI(t, string(data), "validate", "-")
	want := []string{
		"OK Job ml/train: container=main request=0.5 limit=0.9 mode=time-slicing devices=1",
		"OK DaemonSet ml/probe: no GPU fraction",
		"OK ReplicaSet ml/rs: container=main request=2048Mi limit=2048Mi mode=time-slicing devices=1",
	}
	if diff := cmp.Diff(want, strings.Split(strings.TrimSpace(out), "\n")); diff != "" {
		t.Errorf("output (-want +got):\n%s", diff)
	}
	if code != 0 || errOut != "" {
		t.Errorf("exit %d stderr %q", code, errOut)
	}
}

func TestValidateUnreadableInput(t *testing.T) {
	tests := []struct {
		name       string
		stdin      string
		args       []string
		wantOut    string
		wantStderr string
	}{
		{"YAML syntax error after a good document", "", []string{"testdata/unparsable.yaml"},
			"OK Pod default/fine: no GPU fraction\n", "error: testdata/unparsable.yaml:15: found unexpected end of stream\n"},
		{"document without kind", "apiVersion: v1\nmetadata:\n  name: what\n", []string{"-"},
			"", "error: <stdin>:1: not a Kubernetes object: it has no kind\n"},
		{"document that is a list", "---\n- a\n- b\n", []string{"-"},
			"", "error: <stdin>:2: not a Kubernetes object: the document is not a mapping\n"},
		{"tab indentation", "kind: Pod\nmetadata:\n\tname: x\n", []string{"-"},
			"", "error: <stdin>:3: found character that cannot start any token\n"},
		{"missing file, later file still checked", "", []string{"testdata/nothere.yaml", "../../examples/fraction.yaml"},
			"OK Pod default/fraction-half: container=main request=0.5 limit=0.5 mode=time-slicing devices=1\n",
			"error: open testdata/nothere.yaml: no such file or directory\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, errOut, code := runCLI(t, tt.stdin, append([]string{"validate"}, tt.args...)...)
			if code != exitUnreadable {
				t.Errorf("exit %d, want %d", code, exitUnreadable)
			}
			if out != tt.wantOut {
				t.Errorf("stdout %q, want %q", out, tt.wantOut)
			}
			if errOut != tt.wantStderr {
				t.Errorf("stderr %q, want %q", errOut, tt.wantStderr)
			}
		})
	}
}

func TestValidateDirectory(t *testing.T) {
	out, _, code := runCLI(t, "", "validate", "../../examples")
	if code != 0 || strings.Count(out, "OK ") < 7 {
		t.Errorf("exit %d, output:\n%s", code, out)
	}
}

func TestValidateNeedsAFile(t *testing.T) {
	cmd := NewRootCommand()
	cmd.SetArgs([]string{"validate"})
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetErr(&bytes.Buffer{})
	if err := cmd.Execute(); err == nil {
		t.Error("validate with no arguments succeeded")
	}
}
