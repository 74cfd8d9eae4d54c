package cli

import (
	"errors"
	"strings"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/node/enforce/enforcetest"
)

// On a machine without the NVIDIA driver the hook must fail the
// container's creation, naming the cgroup and the NVML error.
func TestHookFailsClosedWithoutTheDriver(t *testing.T) {
	proc := enforcetest.Proc(t, map[int]string{4242: "/kubepods.slice/pod-x/cri-containerd-abc.scope"})
	t.Setenv("GPUFRAC_CONTAINER", "main")
	t.Setenv("GPUFRAC_DEVICES", "GPU-a")
	t.Setenv("GPUFRAC_MEMORY_REQUEST_MIB", "1024")
	t.Setenv("GPUFRAC_MEMORY_LIMIT_MIB", "2048")
	state := `{"ociVersion":"1.2.0","id":"abc","status":"creating","pid":4242,"bundle":"/run/abc"}`
	cmd := NewRootCommand()
	cmd.SetIn(strings.NewReader(state))
	cmd.SetArgs([]string{"hook", "apply-memory-limits", "--proc-root", proc})
	err := cmd.Execute()
	var exit *ExitError
	if !errors.As(err, &exit) || exit.Code != 1 {
		t.Fatalf("error %v, want exit 1", err)
	}
	for _, want := range []string{"container abc (main)", "cgroup /sys/fs/cgroup/kubepods.slice/pod-x/cri-containerd-abc.scope"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	// No driver here: NVML does not initialise. (On a GPU node the made-up
	// UUID fails one step later.)
	if !strings.Contains(err.Error(), "nvmlInit") && !strings.Contains(err.Error(), "GPU GPU-a") {
		t.Errorf("error %q names neither NVML's init nor the GPU", err)
	}

	// Without the plugin's environment the hook refuses as well.
	t.Setenv("GPUFRAC_DEVICES", "")
	cmd = NewRootCommand()
	cmd.SetIn(strings.NewReader(state))
	cmd.SetArgs([]string{"hook", "apply-memory-limits", "--proc-root", proc})
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "GPUFRAC_DEVICES is empty") {
		t.Errorf("unconfigured hook: %v", err)
	}
}
