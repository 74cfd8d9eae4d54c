package exclusive

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

// machine is a simulated node (whose GPUs have a compute mode, Default at
// first) and its GPUs' UUIDs.
func machine(t *testing.T) (nvml.Interface, []string) {
	t.Helper()
	lib, err := inventory.Simulated("4xH100@81920Mi")
	if err != nil {
		t.Fatal(err)
	}
	inv, err := inventory.Read(lib)
	if err != nil {
		t.Fatal(err)
	}
	var uuids []string
	for _, g := range inv.GPUs {
		uuids = append(uuids, g.UUID)
	}
	return lib, uuids
}

func mode(t *testing.T, lib nvml.Interface, uuid string) nvml.ComputeMode {
	t.Helper()
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		t.Fatalf("%s: %v", uuid, ret)
	}
	m, ret := dev.GetComputeMode()
	if ret != nvml.SUCCESS {
		t.Fatalf("%s: %v", uuid, ret)
	}
	return m
}

func setMode(t *testing.T, lib nvml.Interface, uuid string, m nvml.ComputeMode) {
	t.Helper()
	dev, _ := lib.DeviceGetHandleByUUID(uuid)
	if ret := dev.SetComputeMode(m); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
}

func sorted(uuids ...string) []string { return slices.Sorted(slices.Values(uuids)) }

func set(uuids ...string) map[string]bool {
	s := map[string]bool{}
	for _, u := range uuids {
		s[u] = true
	}
	return s
}

func TestPlan(t *testing.T) {
	for _, tt := range []struct {
		name            string
		shared          map[string]bool
		changed         map[string]nvml.ComputeMode
		ensure, restore []string
	}{
		{"nothing", nil, nil, nil, nil},
		{"shared GPUs are made exclusive", set("b", "a"), nil, []string{"a", "b"}, nil},
		{"a GPU shared no more gets its mode back", set("a"), map[string]nvml.ComputeMode{"a": 0, "b": 0}, []string{"a"}, []string{"b"}},
		{"only what was changed is restored", set(), map[string]nvml.ComputeMode{"c": 2}, nil, []string{"c"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ensure, restore := Plan(tt.shared, tt.changed)
			if !slices.Equal(ensure, tt.ensure) || !slices.Equal(restore, tt.restore) {
				t.Errorf("Plan = %v, %v; want %v, %v", ensure, restore, tt.ensure, tt.restore)
			}
		})
	}
}

// A shared GPU is made exclusive; one an admin made exclusive is left so,
// and kept so when shared no more; the one gpufrac changed gets its mode
// back, also after a restart (the state file).
func TestSyncChangesOnlyWhatItOwns(t *testing.T) {
	lib, g := machine(t)
	path := filepath.Join(t.TempDir(), "compute-modes.json")
	setMode(t, lib, g[1], nvml.COMPUTEMODE_EXCLUSIVE_PROCESS) // the admin's
	setMode(t, lib, g[2], nvml.COMPUTEMODE_PROHIBITED)        // the admin's

	k := Open(lib, path)
	r := k.Sync(set(g[0], g[1], g[2]))
	if len(r.NotExclusive) != 0 || !slices.Equal(r.Set, sorted(g[0], g[2])) {
		t.Fatalf("Sync: %+v", r)
	}
	for _, u := range g[:3] {
		if m := mode(t, lib, u); m != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
			t.Errorf("%s is %s after Sync", u, Mode(m))
		}
	}
	if m := mode(t, lib, g[3]); m != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("an unshared GPU was changed: %s", Mode(m))
	}

	// A new agent reads what the old one changed.
	k = Open(lib, path)
	if got := k.Changed(); len(got) != 2 || got[g[0]] != nvml.COMPUTEMODE_DEFAULT || got[g[2]] != nvml.COMPUTEMODE_PROHIBITED {
		t.Fatalf("after a restart, changed = %v", got)
	}
	r = k.Sync(set())
	if !slices.Equal(r.Restored, sorted(g[0], g[2])) || len(r.RestoreErr) != 0 {
		t.Fatalf("Sync(none): %+v", r)
	}
	want := map[string]nvml.ComputeMode{g[0]: nvml.COMPUTEMODE_DEFAULT, g[1]: nvml.COMPUTEMODE_EXCLUSIVE_PROCESS, g[2]: nvml.COMPUTEMODE_PROHIBITED}
	for u, w := range want {
		if m := mode(t, lib, u); m != w {
			t.Errorf("%s is %s after release, want %s", u, Mode(m), Mode(w))
		}
	}
	if got := Open(lib, path).Changed(); len(got) != 0 {
		t.Errorf("the state file still records %v", got)
	}
}

// Not knowing which GPUs are shared (the reservation pods cannot be read)
// restores nothing.
func TestUnknownSharingRestoresNothing(t *testing.T) {
	lib, g := machine(t)
	k := Open(lib, filepath.Join(t.TempDir(), "m.json"))
	k.Sync(set(g[0]))
	if r := k.Sync(nil); len(r.Restored) != 0 || mode(t, lib, g[0]) != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		t.Errorf("Sync(nil) restored: %+v", r)
	}
}

// A mode changed behind gpufrac's back is set again while shared, and
// left alone once not.
func TestSomeoneElsesChange(t *testing.T) {
	lib, g := machine(t)
	k := Open(lib, filepath.Join(t.TempDir(), "m.json"))
	k.Sync(set(g[0]))
	setMode(t, lib, g[0], nvml.COMPUTEMODE_DEFAULT)
	if r := k.Sync(set(g[0])); !slices.Equal(r.Set, []string{g[0]}) {
		t.Errorf("a shared GPU put back in Default was not made exclusive again: %+v", r)
	}
	setMode(t, lib, g[0], nvml.COMPUTEMODE_PROHIBITED)
	if r := k.Sync(set()); len(r.RestoreErr) != 0 || mode(t, lib, g[0]) != nvml.COMPUTEMODE_PROHIBITED || len(k.Changed()) != 0 {
		t.Errorf("a mode someone else set was overwritten: %+v, %s", r, Mode(mode(t, lib, g[0])))
	}
}

// NVML refusing the change (no root, an old driver) leaves the GPU named
// with the reason; the caller refuses fractions there.
func TestRefusedChangeIsReported(t *testing.T) {
	lib, g := machine(t)
	dev, _ := lib.DeviceGetHandleByUUID(g[0])
	dev.(*server.Device).SetComputeModeFunc = func(nvml.ComputeMode) nvml.Return { return nvml.ERROR_NO_PERMISSION }
	k := Open(lib, filepath.Join(t.TempDir(), "m.json"))
	r := k.Sync(set(g[0], g[1]))
	if len(r.NotExclusive) != 1 || r.NotExclusive[g[0]] == nil || !slices.Equal(r.Set, []string{g[1]}) {
		t.Fatalf("Sync: %+v", r)
	}
	err := r.Err()
	if err == nil || !strings.Contains(err.Error(), "GPU "+g[0]+" is not in EXCLUSIVE_PROCESS") || !strings.Contains(err.Error(), "ERROR_NO_PERMISSION") ||
		strings.Contains(err.Error(), "\n") {
		t.Errorf("Err() = %v", err)
	}
	if err := k.Ensure([]string{g[1], g[0]}); err == nil || !strings.Contains(err.Error(), g[0]) {
		t.Errorf("Ensure = %v", err)
	}
	if err := k.Ensure([]string{g[1]}); err != nil {
		t.Errorf("Ensure on a GPU that can be set: %v", err)
	}
}

// A corrupt state file: shared GPUs are still made exclusive, nothing is
// restored, the file is kept for the admin, and StateErr says what to do.
func TestCorruptStateFile(t *testing.T) {
	lib, g := machine(t)
	path := filepath.Join(t.TempDir(), "m.json")
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	k := Open(lib, path)
	if err := k.StateErr(); err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "delete the file") {
		t.Fatalf("StateErr = %v", err)
	}
	if r := k.Sync(set(g[0])); len(r.NotExclusive) != 0 || mode(t, lib, g[0]) != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		t.Errorf("a shared GPU was not made exclusive: %+v", r)
	}
	if r := k.Sync(set()); len(r.Restored) != 0 || mode(t, lib, g[0]) != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		t.Errorf("restored with an unknown record: %+v", r)
	}
	if data, _ := os.ReadFile(path); string(data) != "{not json" {
		t.Errorf("the corrupt file was overwritten: %q", data)
	}
}
