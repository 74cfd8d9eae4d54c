package agent

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	"github.com/gpufrac/gpufrac/pkg/node/enforce"
	"github.com/gpufrac/gpufrac/pkg/node/exclusive"
	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// An upgraded node agent adopts what the previous release's left on the
// node: its state files, written by v0.1.0's own code (hack/skew), read
// with this release's readers, give back what was written.
func TestReadsTheStateOfTheLastRelease(t *testing.T) {
	dir := filepath.Join("testdata", "v0.1.0")
	leases, err := enforce.OpenLeases(filepath.Join(dir, "leases.json"))
	if err != nil {
		t.Fatal(err)
	}
	wantLeases := map[string]enforce.Lease{"4f1c0ffee": {Pod: "team-a/trainer", Container: "main", Cgroup: "/sys/fs/cgroup/kubepods/pod1/4f1c0ffee",
		Devices: []string{"GPU-0"}, RequestMiB: 4096, LimitMiB: 8192, Boot: "b00t"}}
	if diff := cmp.Diff(wantLeases, leases.All()); diff != "" {
		t.Errorf("GPU memory leases (-v0.1.0 +read):\n%s", diff)
	}

	modes := exclusive.Open(nil, filepath.Join(dir, exclusive.StateFile))
	if err := modes.StateErr(); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]nvml.ComputeMode{"GPU-0": nvml.COMPUTEMODE_DEFAULT}, modes.Changed()); diff != "" {
		t.Errorf("compute modes to give back (-v0.1.0 +read):\n%s", diff)
	}

	m, err := mps.OpenManager(mps.Control{}, filepath.Join(dir, "mps-namespaces.json"))
	if err != nil {
		t.Fatal(err)
	}
	wantNS := []mps.Namespace{{Name: "team-a-trainer-main", Threads: 25, Pod: "team-a/trainer", PodUID: "uid-1", Container: "main", ContainerID: "4f1c0ffee",
		Created: time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)}}
	if diff := cmp.Diff(wantNS, m.List()); diff != "" {
		t.Errorf("MPS namespaces (-v0.1.0 +read):\n%s", diff)
	}

	st, err := mps.ReadStatus(dir)
	if err != nil {
		t.Fatal(err)
	}
	wantSt := mps.Status{PID: 4242, Generation: 3, Protocol: nodeapi.MPSv3, Release: 615, Started: time.Date(2026, 12, 4, 9, 0, 0, 0, time.UTC),
		Running: true, LastExit: "exited: exit status 0"}
	if diff := cmp.Diff(wantSt, st); diff != "" {
		t.Errorf("the MPS daemon's status (-v0.1.0 +read):\n%s", diff)
	}
}
