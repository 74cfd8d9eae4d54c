// Package exclusive keeps the GPUs that a node shares through MPS in the
// EXCLUSIVE_PROCESS compute mode, and gives each back the mode it had once
// it is shared no more.
//
// Why: in the Default compute mode a process that is not an MPS client (a
// tenant that unsets CUDA_MPS_PIPE_DIRECTORY, or points it elsewhere)
// creates a context of its own beside the MPS server, outside every limit
// MPS applies. Measured on an H200 with driver r580 (docs/gpu-proof): such a
// process allocated 5120 MiB on a GPU whose tenant was pinned to 4096 MiB;
// in EXCLUSIVE_PROCESS the same process got CUDA_ERROR_DEVICE_UNAVAILABLE
// at cuCtxCreate while the server's clients kept working. NVIDIA's MPS
// guide sets the mode before starting the daemon ("Starting MPS control
// daemon": nvidia-smi -i 0 -c EXCLUSIVE_PROCESS), and its r615 guide says
// "Exclusive-mode restrictions are applied to the MPS server, not MPS
// clients" ("When to Use MPS", Limitations).
//
// Only modes this package changed are ever set back: a GPU an admin put
// in EXCLUSIVE_PROCESS stays so. What it changed is kept in a state file,
// written before each change, so that an agent restart (or `gpufrac
// exclusive-process --restore` after an uninstall) knows what to restore.
package exclusive

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpufrac/gpufrac/internal/statefile"
)

// Mode names a compute mode as nvidia-smi does.
func Mode(m nvml.ComputeMode) string {
	switch m {
	case nvml.COMPUTEMODE_DEFAULT:
		return "Default"
	case nvml.COMPUTEMODE_EXCLUSIVE_THREAD:
		return "Exclusive_Thread"
	case nvml.COMPUTEMODE_PROHIBITED:
		return "Prohibited"
	case nvml.COMPUTEMODE_EXCLUSIVE_PROCESS:
		return "Exclusive_Process"
	}
	return fmt.Sprintf("mode %d", m)
}

// Plan says which GPUs to put in EXCLUSIVE_PROCESS (the shared ones) and
// which to give their mode back (those this package changed that are shared
// no more). changed maps a GPU's UUID to the mode it had before. Sorted, so
// that the order of NVML calls is the same every time.
func Plan(shared map[string]bool, changed map[string]nvml.ComputeMode) (ensure, restore []string) {
	for uuid := range shared {
		ensure = append(ensure, uuid)
	}
	for uuid := range changed {
		if !shared[uuid] {
			restore = append(restore, uuid)
		}
	}
	slices.Sort(ensure)
	slices.Sort(restore)
	return ensure, restore
}

// Report is what a Sync did and could not do.
type Report struct {
	// NotExclusive are the shared GPUs left in another mode, and why:
	// fractions on them cannot be enforced.
	NotExclusive map[string]error
	// Set and Restored are the GPUs whose mode this Sync changed.
	Set, Restored []string
	// RestoreErr says why a GPU could not be given its mode back.
	RestoreErr map[string]error
}

// Err is the one-line reason a shared GPU is not exclusive, or nil.
func (r Report) Err() error {
	if len(r.NotExclusive) == 0 {
		return nil
	}
	uuids := slices.Sorted(maps.Keys(r.NotExclusive))
	return notExclusive(uuids[0], r.NotExclusive[uuids[0]])
}

// notExclusive is the one-line reason a shared GPU could not be made
// exclusive, for the node's readiness and a refused container alike.
func notExclusive(uuid string, err error) error {
	return fmt.Errorf("GPU %s is not in EXCLUSIVE_PROCESS (%w), so a process outside MPS could use it past every share", uuid, err)
}

// StateFile is the Keeper's file in the node agent's state directory,
// which `gpufrac exclusive-process` reads too.
const StateFile = "compute-modes.json"

// Keeper changes compute modes through NVML and remembers what it changed.
// It is safe for concurrent use: the agent's resync and the NRI plugin's
// CreateContainer both call it.
type Keeper struct {
	mu   sync.Mutex
	lib  nvml.Interface
	path string
	// changed maps each GPU this package put in EXCLUSIVE_PROCESS to the
	// mode it had before.
	changed map[string]nvml.ComputeMode
	// stateErr is why the state file could not be read: nothing is then
	// restored (the modes to restore are unknown), and Sync says so.
	stateErr error
}

// state is the file's form.
type state struct {
	// Previous maps a GPU's UUID to the mode it had before gpufrac set
	// EXCLUSIVE_PROCESS, as NVML numbers it.
	Previous map[string]int `json:"previous"`
}

// Open reads what an earlier Keeper changed from path. A corrupt file is
// not fatal: shared GPUs are still made exclusive, nothing is restored,
// and StateErr names the file and the fix.
func Open(lib nvml.Interface, path string) *Keeper {
	k := &Keeper{lib: lib, path: path, changed: map[string]nvml.ComputeMode{}}
	var s state
	switch err := statefile.ReadJSON(path, &s); {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		k.stateErr = fmt.Errorf("%w; the compute modes gpufrac changed are unknown, so none is restored: check the GPUs with nvidia-smi -q -d COMPUTE, then delete the file", err)
	default:
		for uuid, m := range s.Previous {
			k.changed[uuid] = nvml.ComputeMode(m)
		}
	}
	return k
}

// StateErr is why the state file could not be read, or nil.
func (k *Keeper) StateErr() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.stateErr
}

// Changed is what this Keeper (or an earlier one) changed: UUID to the
// mode the GPU had before.
func (k *Keeper) Changed() map[string]nvml.ComputeMode {
	k.mu.Lock()
	defer k.mu.Unlock()
	return maps.Clone(k.changed)
}

// Ensure puts each GPU in EXCLUSIVE_PROCESS; the error names the first it
// could not.
func (k *Keeper) Ensure(uuids []string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(uuids) == 0 {
		return nil
	}
	if ret := k.lib.Init(); ret != nvml.SUCCESS {
		return fmt.Errorf("GPU %s: its compute mode cannot be checked: NVML: %w", uuids[0], ret)
	}
	defer func() { _ = k.lib.Shutdown() }() // nothing to do if releasing the library fails
	for _, uuid := range uuids {
		if _, err := k.ensure(uuid); err != nil {
			return notExclusive(uuid, err)
		}
	}
	return nil
}

// Sync makes the shared GPUs exclusive and gives the others this package
// changed their mode back. shared is nil when the node does not know which
// GPUs it shares: then nothing is restored.
func (k *Keeper) Sync(shared map[string]bool) Report {
	k.mu.Lock()
	defer k.mu.Unlock()
	r := Report{NotExclusive: map[string]error{}, RestoreErr: map[string]error{}}
	changed := k.changed
	if shared == nil || k.stateErr != nil {
		changed = nil // what to restore, or whether to, is unknown
	}
	ensure, restore := Plan(shared, changed)
	if len(ensure)+len(restore) == 0 {
		return r
	}
	if ret := k.lib.Init(); ret != nvml.SUCCESS {
		for _, uuid := range ensure {
			r.NotExclusive[uuid] = fmt.Errorf("its compute mode cannot be checked: NVML: %w", ret)
		}
		for _, uuid := range restore {
			r.RestoreErr[uuid] = fmt.Errorf("NVML: %w", ret)
		}
		return r
	}
	defer func() { _ = k.lib.Shutdown() }()
	for _, uuid := range ensure {
		set, err := k.ensure(uuid)
		if err != nil {
			r.NotExclusive[uuid] = err
		} else if set {
			r.Set = append(r.Set, uuid)
		}
	}
	for _, uuid := range restore {
		if err := k.restore(uuid); err != nil {
			r.RestoreErr[uuid] = err
		} else {
			r.Restored = append(r.Restored, uuid)
		}
	}
	return r
}

// ensure puts one GPU in EXCLUSIVE_PROCESS, recording its mode first; set
// says whether it changed it.
func (k *Keeper) ensure(uuid string) (set bool, err error) {
	dev, current, err := k.read(uuid)
	if err != nil {
		return false, err
	}
	if current == nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		return false, nil
	}
	if _, known := k.changed[uuid]; !known {
		// Written before the change: a crash between the two leaves a
		// record of a mode to restore, never a change nobody knows of.
		// A corrupt file is left for the admin to read (StateErr).
		k.changed[uuid] = current
		if err := k.save(); err != nil {
			delete(k.changed, uuid)
			return false, fmt.Errorf("cannot record its mode %s before changing it: %w", Mode(current), err)
		}
	}
	if ret := dev.SetComputeMode(nvml.COMPUTEMODE_EXCLUSIVE_PROCESS); ret != nvml.SUCCESS {
		return false, fmt.Errorf("NVML cannot set it from %s: %w (the caller needs CAP_SYS_ADMIN and the GPU's device node)", Mode(current), ret)
	}
	// Read back: a mode NVML accepted but did not apply is no mode.
	_, now, err := k.read(uuid)
	if err != nil {
		return false, fmt.Errorf("NVML accepted EXCLUSIVE_PROCESS, then: %w", err)
	}
	if now != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		return false, fmt.Errorf("NVML accepted EXCLUSIVE_PROCESS but reads back %s", Mode(now))
	}
	return true, nil
}

// restore gives one GPU the mode it had before this package changed it.
func (k *Keeper) restore(uuid string) error {
	previous := k.changed[uuid]
	dev, current, err := k.read(uuid)
	switch {
	case errors.Is(err, errNotFound):
		// The GPU is gone (replaced, or the node's GPUs changed):
		// nothing to give back.
	case err != nil:
		return err
	case current == nvml.COMPUTEMODE_EXCLUSIVE_PROCESS:
		if ret := dev.SetComputeMode(previous); ret != nvml.SUCCESS {
			return fmt.Errorf("NVML cannot set GPU %s back to %s: %w", uuid, Mode(previous), ret)
		}
	default:
		// Someone else changed it since: theirs to keep.
	}
	delete(k.changed, uuid)
	if err := k.save(); err != nil {
		k.changed[uuid] = previous
		return fmt.Errorf("GPU %s is back in %s, but the record of it cannot be updated: %w", uuid, Mode(previous), err)
	}
	return nil
}

var errNotFound = errors.New("no such GPU")

func (k *Keeper) read(uuid string) (nvml.Device, nvml.ComputeMode, error) {
	dev, ret := k.lib.DeviceGetHandleByUUID(uuid)
	if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
		return nil, 0, fmt.Errorf("%w: NVML lists no GPU %s", errNotFound, uuid)
	}
	if ret != nvml.SUCCESS {
		return nil, 0, fmt.Errorf("NVML cannot find GPU %s: %w", uuid, ret)
	}
	mode, ret := dev.GetComputeMode()
	if ret != nvml.SUCCESS {
		return nil, 0, fmt.Errorf("NVML cannot read its compute mode: %w", ret)
	}
	return dev, mode, nil
}

func (k *Keeper) save() error {
	if k.stateErr != nil {
		return nil // the corrupt file stays for the admin to read
	}
	s := state{Previous: map[string]int{}}
	for uuid, m := range k.changed {
		s.Previous[uuid] = int(m)
	}
	return statefile.WriteJSON(k.path, s)
}
