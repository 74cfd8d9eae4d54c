package cli

import (
	"errors"
	"strings"
	"testing"
)

// exclusiveProcess runs the command and returns its output, exit code and
// error message.
func exclusiveProcess(t *testing.T, args ...string) (string, int, string) {
	t.Helper()
	cmd := NewRootCommand()
	var out strings.Builder
	cmd.SetOut(&out)
	cmd.SetErr(&strings.Builder{})
	cmd.SetArgs(append([]string{"exclusive-process"}, args...))
	err := cmd.Execute()
	var exit *ExitError
	switch {
	case err == nil:
		return out.String(), 0, ""
	case errors.As(err, &exit):
		return out.String(), exit.Code, exit.Err.Error()
	}
	t.Fatalf("exclusive-process: %v", err)
	return "", 0, ""
}

// The command prints every GPU's mode, names a GPU it cannot make
// exclusive (exit 1), and checks its flags (exit 2). What it does to
// modes is package exclusive's, tested there: a simulated machine is new
// (new UUIDs) at every run, so it cannot carry a mode from one to the next.
func TestExclusiveProcessCommand(t *testing.T) {
	dir := t.TempDir()
	out, code, msg := exclusiveProcess(t, "--state-dir", dir, "--simulate-gpus", "2xH100@81920Mi")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 2 || !strings.HasPrefix(lines[0], "GPU 0 GPU-") || !strings.HasSuffix(lines[0], ": Default") {
		t.Fatalf("status: exit %d %q\n%s", code, msg, out)
	}
	_, code, msg = exclusiveProcess(t, "--state-dir", dir, "--simulate-gpus", "2xH100@81920Mi", "--hold", "GPU-gone")
	if code != 1 || !strings.Contains(msg, "GPU GPU-gone not made exclusive: no such GPU: NVML lists no GPU GPU-gone") {
		t.Errorf("--hold of an unknown GPU: exit %d, %q", code, msg)
	}
	for _, tt := range []struct {
		args []string
		want string
	}{
		{nil, "--state-dir is required"},
		{[]string{"--state-dir", dir, "--hold", "x", "--restore"}, "--hold and --restore exclude each other"},
	} {
		if _, code, msg := exclusiveProcess(t, tt.args...); code != 2 || !strings.Contains(msg, tt.want) {
			t.Errorf("%v: exit %d, %q; want 2 and %q", tt.args, code, msg, tt.want)
		}
	}
}
