// Package enforcetest gives tests a GPU machine whose driver keeps
// per-cgroup memory limits: go-nvml's mock devices with a limit table
// behind SetMemoryLimits_v1/GetMemoryLimits_v1. The real driver needs a
// GPU and the kernel's dmem controller, which test machines lack.
package enforcetest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Driver is the limit table.
type Driver struct {
	mu     sync.Mutex
	limits map[string]nvml.MemoryLimits_v1 // uuid + cgroup →
	used   map[string]uint64               // uuid + cgroup → bytes in use
	calls  []Call
	// FailSet makes SetMemoryLimits_v1 fail on this GPU.
	FailSet string
	// FailGets makes the next FailGets GetMemoryLimits_v1 calls fail
	// (ERROR_UNKNOWN), as a transient driver error would.
	FailGets int
	// UseOnSet, when set, is the memory (bytes) a cgroup is found using
	// once a limit has been set on it: a tenant that allocated between a
	// resize's read of its use and the new limit.
	UseOnSet uint64
}

// NewMachine returns n mock H100s sharing one limit table, and their UUIDs.
func NewMachine(n int) (*server.Server, *Driver, []string) {
	s := dgxh100.NewWithGPUs(gpus.Multiple(n, gpus.H100_SXM5_80GB)...)
	d := &Driver{limits: map[string]nvml.MemoryLimits_v1{}, used: map[string]uint64{}}
	var uuids []string
	for _, dev := range s.Devices {
		dev := dev.(*server.Device)
		uuid := dev.UUID
		uuids = append(uuids, uuid)
		dev.SetMemoryLimits_v1Func = func(cgroup string, soft, hard uint64) nvml.Return {
			d.mu.Lock()
			defer d.mu.Unlock()
			d.calls = append(d.calls, Call{GPU: uuid, Cgroup: cgroup, Soft: soft, Hard: hard})
			if uuid == d.FailSet {
				return nvml.ERROR_NOT_SUPPORTED
			}
			// The driver opens the cgroup by its full sysfs path.
			if !strings.HasPrefix(cgroup, CgroupFS+"/") {
				return nvml.ERROR_OPERATING_SYSTEM
			}
			d.limits[uuid+cgroup] = nvml.MemoryLimits_v1{NameSpace: cgroup, SoftLimit: soft, HardLimit: hard}
			if d.UseOnSet > 0 {
				d.used[uuid+cgroup] = d.UseOnSet
			}
			return nvml.SUCCESS
		}
		dev.GetMemoryLimits_v1Func = func(cgroup string) (nvml.MemoryLimits_v1, nvml.Return) {
			d.mu.Lock()
			defer d.mu.Unlock()
			if d.FailGets > 0 {
				d.FailGets--
				return nvml.MemoryLimits_v1{}, nvml.ERROR_UNKNOWN
			}
			l := d.limits[uuid+cgroup]
			if used, ok := d.used[uuid+cgroup]; ok {
				l.CurrentUsed = used
			}
			return l, nvml.SUCCESS
		}
	}
	return s, d, uuids
}

// Call is one SetMemoryLimits_v1 call, as the driver received it.
type Call struct {
	GPU, Cgroup string
	Soft, Hard  uint64
}

// Calls returns every SetMemoryLimits_v1 call so far, in order.
func (d *Driver) Calls() []Call {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Call(nil), d.calls...)
}

// Get returns the limits of cgroup on a GPU.
func (d *Driver) Get(uuid, cgroup string) nvml.MemoryLimits_v1 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.limits[uuid+cgroup]
}

// FailNextGets makes the next n GetMemoryLimits_v1 calls fail.
func (d *Driver) FailNextGets(n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.FailGets = n
}

// Set overwrites the limits of cgroup on a GPU, as something outside
// gpufrac might.
func (d *Driver) Set(uuid, cgroup string, l nvml.MemoryLimits_v1) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.limits[uuid+cgroup] = l
}

// SetUsed says how much memory cgroup uses on a GPU, as the driver
// reports it (currentUsed), whatever limits are set since.
func (d *Driver) SetUsed(uuid, cgroup string, bytes uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.used[uuid+cgroup] = bytes
}

// CgroupFS is where the fake /proc of Proc says cgroup v2 is mounted.
const CgroupFS = "/sys/fs/cgroup"

// Proc writes a fake /proc: each pid's cgroup file puts it in its cgroup v2
// path (relative to the mount, as the kernel writes it), and self/mountinfo
// mounts cgroup v2 at CgroupFS. It returns the directory.
func Proc(t testing.TB, cgroups map[int]string) string {
	t.Helper()
	proc := t.TempDir()
	write := func(path, content string) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(proc, "self", "mountinfo"), fmt.Sprintf("24 31 0:22 / /sys ro,nosuid - sysfs sysfs rw\n"+
		"28 24 0:25 / %s rw,nosuid,nodev,noexec shared:4 - cgroup2 cgroup2 rw,nsdelegate\n", CgroupFS))
	for pid, cg := range cgroups {
		write(filepath.Join(proc, strconv.Itoa(pid), "cgroup"), "0::"+cg+"\n")
	}
	return proc
}
