package enforce

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/gpufrac/gpufrac/internal/statefile"
)

// Lease records that a container's cgroup holds memory limits on some
// GPUs, so the agent can release them when the container stops, also
// after the agent itself restarted.
type Lease struct {
	Pod        string   `json:"pod"` // namespace/name, for logs, events and metrics
	Container  string   `json:"container"`
	Cgroup     string   `json:"cgroup"`
	Devices    []string `json:"devices"`
	RequestMiB uint64   `json:"requestMiB"`
	LimitMiB   uint64   `json:"limitMiB"`
	// Boot is the host's boot ID when the lease was taken ("" in tables
	// written before it was recorded): a reboot cleared its limits.
	Boot string `json:"boot,omitempty"`
}

// Leases is the agent's persistent table of leases by container ID.
type Leases struct {
	path string
	mu   sync.Mutex
	m    map[string]Lease
}

// OpenLeases loads the table from path, or starts an empty one when the
// file does not exist. A file that cannot be read is an error: dropping it
// would leak every soft limit it records.
func OpenLeases(path string) (*Leases, error) {
	l := &Leases{path: path, m: map[string]Lease{}}
	data, err := os.ReadFile(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return l, nil
	case err != nil:
		return nil, fmt.Errorf("read GPU memory leases %s: %w", path, err)
	}
	if err := json.Unmarshal(data, &l.m); err != nil {
		return nil, fmt.Errorf("GPU memory leases %s are corrupt (%w): fix or move the file; it is not discarded because it records limits still to release", path, err)
	}
	return l, nil
}

// Put records a lease and persists the table.
func (l *Leases) Put(id string, lease Lease) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.m[id] = lease
	return l.save()
}

// Take removes and returns a lease, persisting the table.
func (l *Leases) Take(id string) (Lease, bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	lease, ok := l.m[id]
	if !ok {
		return Lease{}, false, nil
	}
	delete(l.m, id)
	return lease, true, l.save()
}

// All returns a copy of the table.
func (l *Leases) All() map[string]Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.m)
}

// IDs lists the containers holding leases, sorted.
func (l *Leases) IDs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Sorted(maps.Keys(l.m))
}

// Prune drops the leases nothing is left to release for: those taken
// before the host last booted (boot is the current boot ID; the driver's
// limits did not survive the reboot), and those whose cgroup is gone
// ("removing the cgroup will also clear any limits", NVML's
// nvmlDeviceSetMemoryLimits_v1). It returns the dropped container IDs.
// A lease whose cgroup may still exist stays, to be released.
func (l *Leases) Prune(boot string, cgroupExists func(string) bool) ([]string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var dropped []string
	for id, lease := range l.m {
		rebooted := boot != "" && lease.Boot != "" && lease.Boot != boot
		if rebooted || !cgroupExists(lease.Cgroup) {
			delete(l.m, id)
			dropped = append(dropped, id)
		}
	}
	slices.Sort(dropped)
	if len(dropped) == 0 {
		return nil, nil
	}
	return dropped, l.save()
}

// BootID is the host's boot ID (procRoot/sys/kernel/random/boot_id), ""
// where it cannot be read.
func BootID(procRoot string) string {
	raw, err := os.ReadFile(filepath.Join(procRoot, "sys", "kernel", "random", "boot_id"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(raw))
}

// save writes the table atomically (a crash leaves the old or the new one).
func (l *Leases) save() error { return statefile.WriteJSON(l.path, l.m) }
