// Package mps runs MPS the way CUDA 13.4 (driver r615) does it (NVIDIA
// MPS, "MPS v3 Interface", "MPS v3 Namespaces", "MPS v3 Memory
// Partitioning"): one control daemon per node for all its GPUs, with
// memacct on, and one shared server whose namespaces are the sm-sharing
// containers, each with its own active-thread ceiling.
//
// Daemon supervises that daemon (a DaemonSet of its own runs it, never
// rolled by an upgrade, so the node agent's upgrades and restarts do not
// end the tenants' contexts); Manager is the
// node agent's side: it creates each sm-sharing container's namespace
// before the container starts, drains and deletes it at the end, and after
// a daemon restart, which drops every runtime namespace, re-creates those
// of running containers. Control is how both talk to the daemon.
package mps

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/gpufrac/gpufrac/internal/statefile"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// Namespace is one sm-sharing container's MPS namespace.
type Namespace struct {
	Name    string `json:"name"`
	Threads int    `json:"threads"`
	// Pod (namespace/name), PodUID and Container say whose it is, for
	// Events.
	Pod       string `json:"pod"`
	PodUID    string `json:"podUID"`
	Container string `json:"container"`
	// ContainerID is the runtime's container the namespace was last
	// created for: a restarted container reuses the name, and the removal
	// of the old one must not delete the new one's namespace.
	ContainerID string `json:"containerID"`
	// Uncapped: re-creating it failed half-way, so the daemon may hold it
	// without its ceiling; it is never reused as it is.
	Uncapped bool `json:"uncapped,omitempty"`
	// Created is when the agent created it: a reconciliation whose view
	// of the running containers predates it must not delete it.
	Created time.Time `json:"created"`
}

// Manager keeps the shared server's namespaces equal to the sm-sharing
// containers the node runs. Its table is persisted, so the next agent
// knows which namespaces are claimed.
type Manager struct {
	StatePath string
	// Grace is how long a new namespace is kept although no running
	// container claims it yet: it is created before its container exists.
	Grace time.Duration

	// op serializes the operations that change namespaces (Ensure,
	// Remove, Reconcile), daemon commands and table writes included, so
	// none acts on another's half-done work. A channel, so that waiting for
	// it ends with the caller's context.
	op      chan struct{}
	mu      sync.Mutex // guards control and table
	control Control
	table   map[string]Namespace
}

// Control is how the manager reaches the daemon.
func (m *Manager) Control() Control {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.control
}

// SetProtocol records the interface the daemon speaks, once the agent
// knows the driver.
func (m *Manager) SetProtocol(p nodeapi.MPS) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.control.Protocol = p
}

// OpenManager loads the table a previous agent saved at statePath.
func OpenManager(control Control, statePath string) (*Manager, error) {
	m := &Manager{control: control, StatePath: statePath, Grace: time.Minute, table: map[string]Namespace{}, op: make(chan struct{}, 1)}
	var saved []Namespace
	err := statefile.ReadJSON(statePath, &saved)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		// Not discarded: the namespaces it names would be left unclaimed.
		return nil, fmt.Errorf("MPS namespaces: %w; move it aside to start afresh", err)
	}
	for _, ns := range saved {
		m.table[ns.Name] = ns
	}
	return m, nil
}

func (m *Manager) save() error {
	m.mu.Lock()
	list := slices.SortedFunc(maps.Values(m.table), func(a, b Namespace) int { return cmp.Compare(a.Name, b.Name) })
	m.mu.Unlock()
	return statefile.WriteJSON(m.StatePath, list)
}

// List is the table, sorted by name.
func (m *Manager) List() []Namespace {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.SortedFunc(maps.Values(m.table), func(a, b Namespace) int { return cmp.Compare(a.Name, b.Name) })
}

// lock takes op, or gives up when ctx ends.
func (m *Manager) lock(ctx context.Context) error {
	select {
	case m.op <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("MPS namespaces are busy (another change is waiting on the daemon): %w", ctx.Err())
	}
}

func (m *Manager) unlock() { <-m.op }

func (m *Manager) v3() error {
	if p := m.Control().Protocol; p != nodeapi.MPSv3 {
		return fmt.Errorf("sm-sharing needs MPS v3 namespaces (driver r%d); this node's daemon speaks %q", ReleaseV3, p)
	}
	return nil
}

// Ensure makes ns exist in the daemon with its ceiling, and returns when
// it does: before the container's first client can attach. A namespace of
// the same name left by an earlier container of the same pod (a restart)
// is reused when its ceiling is the same, replaced otherwise.
func (m *Manager) Ensure(ctx context.Context, ns Namespace) error {
	if err := m.v3(); err != nil {
		return err
	}
	if ns.Threads < 1 || ns.Threads > 100 {
		return fmt.Errorf("MPS namespace %s: active-thread percentage %d: must be 1 to 100", ns.Name, ns.Threads)
	}
	if err := m.lock(ctx); err != nil {
		return fmt.Errorf("MPS namespace %s: %w", ns.Name, err)
	}
	defer m.unlock()
	existing, err := m.Control().Namespaces(ctx)
	if err != nil {
		return fmt.Errorf("MPS namespace %s: %w", ns.Name, err)
	}
	m.mu.Lock()
	prev, known := m.table[ns.Name]
	m.mu.Unlock()
	ns.Created = time.Now().UTC()
	if slices.Contains(existing, ns.Name) {
		if known && prev.Threads == ns.Threads && !prev.Uncapped {
			return m.put(ns)
		}
		if err := m.Control().DeleteNamespace(ctx, ns.Name); err != nil {
			return fmt.Errorf("MPS namespace %s exists with another ceiling and cannot be replaced: %w", ns.Name, err)
		}
	}
	if err := m.Control().CreateNamespace(ctx, ns.Name, ns.Threads); err != nil {
		return fmt.Errorf("MPS namespace %s: %w", ns.Name, err)
	}
	return m.put(ns)
}

func (m *Manager) put(ns Namespace) error {
	m.mu.Lock()
	m.table[ns.Name] = ns
	m.mu.Unlock()
	return m.save()
}

// Drain terminates the MPS clients match selects, within ctx, at a
// container's stop. It returns the clients it could not terminate in time.
func (m *Manager) Drain(ctx context.Context, match func(Client) bool) ([]int, error) {
	clients, err := m.Control().Clients(ctx)
	if err != nil {
		return nil, err
	}
	var left []int
	var errs []error
	for _, c := range clients {
		if !match(c) {
			continue
		}
		if err := m.Control().Terminate(ctx, c.PID); err != nil {
			left = append(left, c.PID)
			errs = append(errs, err)
		}
	}
	return left, errors.Join(errs...)
}

// Remove deletes the namespace of container containerID, retrying while a
// client is still attached (deletion fails then) until ctx ends, and
// forgets it. A namespace since re-created for another container of the
// same name (a restart) is left to that one.
func (m *Manager) Remove(ctx context.Context, name, containerID string) error {
	if err := m.lock(ctx); err != nil {
		return fmt.Errorf("MPS namespace %s not deleted: %w", name, err)
	}
	defer m.unlock()
	m.mu.Lock()
	ns, known := m.table[name]
	m.mu.Unlock()
	if !known || m.v3() != nil || (containerID != "" && ns.ContainerID != "" && ns.ContainerID != containerID) {
		return nil
	}
	var err error
	for {
		var existing []string
		if existing, err = m.Control().Namespaces(ctx); err == nil {
			if !slices.Contains(existing, name) {
				break
			}
			if err = m.Control().DeleteNamespace(ctx, name); err == nil {
				break
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("MPS namespace %s not deleted: %w", name, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	m.mu.Lock()
	delete(m.table, name)
	m.mu.Unlock()
	return m.save()
}

// RequestReplace asks the daemon's supervisor to replace it (see
// RequestReplace in daemon.go).
func (m *Manager) RequestReplace(why string) error { return RequestReplace(m.Control().Root, why) }

// Reconciled says what Reconcile changed.
type Reconciled struct {
	// Recreated are claimed namespaces the daemon no longer had (it was
	// restarted): their containers' clients lost their contexts.
	Recreated []Namespace
	// Deleted are namespaces no running container claims.
	Deleted []string
}

// Reconcile makes the daemon's namespaces those of the running containers
// (live says which names are): a claimed namespace the daemon lacks is
// created again with its ceiling, one nobody claims is deleted, and the
// table forgets the containers that are gone. A namespace created within
// Grace is left alone: its container may not run yet.
func (m *Manager) Reconcile(ctx context.Context, live func(name string) bool) (Reconciled, error) {
	var r Reconciled
	if m.v3() != nil {
		return r, nil
	}
	if err := m.lock(ctx); err != nil {
		return r, err
	}
	defer m.unlock()
	existing, err := m.Control().Namespaces(ctx)
	if err != nil {
		return r, err
	}
	var errs []error
	for _, ns := range m.List() {
		switch {
		case !live(ns.Name) && time.Since(ns.Created) < m.Grace:
			continue
		case !live(ns.Name):
			if slices.Contains(existing, ns.Name) {
				if err := m.Control().DeleteNamespace(ctx, ns.Name); err != nil {
					errs = append(errs, err)
					continue // still claimed by a client; retried next time
				}
				r.Deleted = append(r.Deleted, ns.Name)
			}
			m.mu.Lock()
			delete(m.table, ns.Name)
			m.mu.Unlock()
		case !slices.Contains(existing, ns.Name) || ns.Uncapped:
			if ns.Uncapped {
				if err := m.Control().DeleteNamespace(ctx, ns.Name); err != nil && slices.Contains(existing, ns.Name) {
					errs = append(errs, err)
					continue
				}
			}
			err := m.Control().CreateNamespace(ctx, ns.Name, ns.Threads)
			m.mu.Lock()
			ns.Uncapped = err != nil
			m.table[ns.Name] = ns
			m.mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				continue
			}
			r.Recreated = append(r.Recreated, ns)
		}
	}
	m.mu.Lock()
	var unclaimed []string
	for _, name := range existing {
		// One a running container uses is left alone even if the table
		// lost it: deleting it would leave that container uncapped.
		if _, ok := m.table[name]; !ok && !slices.Contains(r.Deleted, name) && !live(name) {
			unclaimed = append(unclaimed, name)
		}
	}
	m.mu.Unlock()
	for _, name := range unclaimed {
		if err := m.Control().DeleteNamespace(ctx, name); err != nil {
			errs = append(errs, err)
			continue
		}
		r.Deleted = append(r.Deleted, name)
	}
	return r, errors.Join(append(errs, m.save())...)
}
