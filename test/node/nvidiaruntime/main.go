// Command nvidiaruntime stands in for nvidia-container-runtime, the NVIDIA
// runtime class's handler, on the chart test's node (test/node, -tags
// charte2e), which has no GPU and no driver. Like the real one, it is an
// OCI runtime that edits the container's spec and then runs runc: on
// `create`, for a process whose NVIDIA_VISIBLE_DEVICES asks for GPUs, it
// adds what the NVIDIA Container Toolkit injects — the driver's
// libnvidia-ml.so.1 and nvidia-cuda-mps-control, here the fake NVML and the
// MPS stand-in — and the environment they need. And for the machine's
// cgroups: a container that mounts the host's /sys/fs/cgroup gets the
// host's cgroup v2 hierarchy there (on a hybrid host it is mounted
// elsewhere), and, as this kernel has no dmem controller, a
// cgroup.controllers over the hierarchy's own that lists dmem.
//
// It reads its configuration from the file beside it, named as it is with
// .json appended, and runs the runc that configuration names.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
)

// config is what the test writes beside the binary.
type config struct {
	Runc string `json:"runc"`
	// Mounts are bind mounts added to a GPU container: host path to
	// container path.
	Mounts []mount `json:"mounts"`
	// Env is added to a GPU container's process.
	Env []string `json:"env"`
	// Cgroup is the host's cgroup v2 mount, which a container mounting
	// /sys/fs/cgroup gets; Controllers is the file bound over its
	// cgroup.controllers.
	Cgroup      string `json:"cgroup"`
	Controllers string `json:"controllers"`
}

type mount struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
	ReadOnly    bool   `json:"readOnly"`
}

func main() {
	self, err := os.Executable()
	if err == nil {
		err = run(self, os.Args[1:])
	}
	fmt.Fprintln(os.Stderr, "nvidia-container-runtime stand-in:", err)
	os.Exit(1)
}

func run(self string, args []string) error {
	raw, err := os.ReadFile(self + ".json")
	if err != nil {
		return err
	}
	var cfg config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return fmt.Errorf("%s.json: %w", self, err)
	}
	if i := slices.Index(args, "create"); i >= 0 {
		bundle := "."
		for j := i + 1; j < len(args)-1; j++ {
			if args[j] == "--bundle" || args[j] == "-b" {
				bundle = args[j+1]
			}
		}
		if err := edit(bundle+"/config.json", cfg); err != nil {
			return err
		}
	}
	return syscall.Exec(cfg.Runc, append([]string{cfg.Runc}, args...), os.Environ())
}

// edit changes the spec in place, keeping every field it does not know.
func edit(path string, cfg config) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var spec map[string]any
	if err := json.Unmarshal(raw, &spec); err != nil {
		return err
	}
	mounts, _ := spec["mounts"].([]any)
	for _, m := range mounts {
		if m, ok := m.(map[string]any); ok && m["source"] == "/sys/fs/cgroup" && m["type"] == "bind" {
			m["source"] = cfg.Cgroup
			mounts = append(mounts, map[string]any{"type": "bind", "source": cfg.Controllers,
				"destination": m["destination"].(string) + "/cgroup.controllers", "options": []any{"rbind", "ro"}})
		}
	}
	process, _ := spec["process"].(map[string]any)
	env, _ := process["env"].([]any)
	if wantsGPUs(env) {
		for _, m := range cfg.Mounts {
			opts := []any{"rbind", "nosuid", "nodev"}
			if m.ReadOnly {
				opts = append(opts, "ro")
			}
			mounts = append(mounts, map[string]any{"type": "bind", "source": m.Source, "destination": m.Destination, "options": opts})
		}
		for _, e := range cfg.Env {
			env = append(env, e)
		}
		process["env"] = env
	}
	spec["mounts"] = mounts
	out, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o600)
}

// wantsGPUs is the toolkit's rule: NVIDIA_VISIBLE_DEVICES set, and not
// void or none.
func wantsGPUs(env []any) bool {
	for _, e := range env {
		if s, ok := e.(string); ok {
			if v, ok := strings.CutPrefix(s, "NVIDIA_VISIBLE_DEVICES="); ok {
				return v != "" && v != "void" && v != "none"
			}
		}
	}
	return false
}
