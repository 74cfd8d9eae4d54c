// Command probe runs inside the node test's containers and reports, as one
// JSON line on stdout, what the container itself sees: its environment, the
// MPS pipe directory it was given, and its cgroup. Then it waits for SIGTERM,
// so that the container stays running while the test looks at it. It is
// built static (CGO_ENABLED=0): the image has nothing but BusyBox.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
)

// Report is what the probe prints, after the prefix "probe: ".
type Report struct {
	Env map[string]string `json:"env"`
	// MPSDir lists $CUDA_MPS_PIPE_DIRECTORY's entries; absent when the
	// variable is unset or the directory cannot be read.
	MPSDir []string `json:"mpsDir,omitempty"`
	// Cgroup is the cgroup v2 path of /proc/self/cgroup ("0::" line).
	Cgroup string `json:"cgroup"`
	// NoNewPrivs is /proc/self/status's NoNewPrivs: "1" when setuid
	// programs and file capabilities gain the process nothing.
	NoNewPrivs string `json:"noNewPrivs"`
}

func main() {
	r := Report{Env: map[string]string{}}
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		r.Env[k] = v
	}
	if dir := os.Getenv("CUDA_MPS_PIPE_DIRECTORY"); dir != "" {
		if entries, err := os.ReadDir(dir); err == nil {
			for _, e := range entries {
				r.MPSDir = append(r.MPSDir, e.Name())
			}
			sort.Strings(r.MPSDir)
		}
	}
	if raw, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		for _, line := range strings.Split(string(raw), "\n") {
			if path, ok := strings.CutPrefix(line, "0::"); ok {
				r.Cgroup = path
			}
		}
	}
	if raw, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, line := range strings.Split(string(raw), "\n") {
			if v, ok := strings.CutPrefix(line, "NoNewPrivs:"); ok {
				r.NoNewPrivs = strings.TrimSpace(v)
			}
		}
	}
	out, err := json.Marshal(r)
	if err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		os.Exit(1)
	}
	fmt.Printf("probe: %s\n", out)
	if len(os.Args) > 1 && os.Args[1] == "--exit" {
		return
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
