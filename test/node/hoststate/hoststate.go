// Package hoststate records what of a machine a real node could change, so
// that the node tests can show they left it as they found it: the
// iptables and ip6tables rules, the mount table, what is under /run, the
// kernel settings the kubelet tunes, and the top-level cgroups.
//
// The node tests run their node in namespaces of its own (test/node's
// isolate_test.go), so none of this should change; the snapshot taken
// before and after is the check that it did not, not the mechanism.
package hoststate

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// Sysctls are the kernel settings a node's parts could change on the host:
// the kubelet's tunables (k8s.io/component-helpers/node/util/sysctl, set by
// setupKernelTunables unless --protect-kernel-defaults), and IPv4
// forwarding, which the CNI bridge plugin turns on for a gateway bridge
// (per network namespace, so only the host's own matters here).
var Sysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward",
}

// Snapshot is one reading of the host.
type Snapshot struct {
	// IPTables is iptables-save then ip6tables-save, normalised
	// (NormalizeIPTables).
	IPTables []string
	// Mounts are "mount point fstype source" per line of mountinfo.
	Mounts []string
	// Run is every path under /run to runDepth, with "/" after a
	// directory.
	Run []string
	// Sysctls are the values of Sysctls, by name.
	Sysctls map[string]string
	// Cgroups are the top-level cgroups of each hierarchy, as
	// "hierarchy/name".
	Cgroups []string
	// SubtreeControl is the cgroup v2 root's cgroup.subtree_control: the
	// controllers a kubelet enables for its cgroups.
	SubtreeControl string
}

// runDepth is how deep Run looks: a node's parts write their own
// directories and files directly under /run (containerd/, netns/,
// xtables.lock) and one level down (netns/cni-…). Deeper, and under the
// sessions' and systemd's own directories, a machine changes by itself.
const runDepth = 2

// runOwn are /run's directories whose content the machine changes by
// itself (logins, systemd's units): only their names are compared.
var runOwn = []string{"user", "systemd"}

// Options says where to read; the zero value reads this machine.
type Options struct {
	Proc, Run, CgroupRoot string
}

func (o Options) withDefaults() Options {
	if o.Proc == "" {
		o.Proc = "/proc"
	}
	if o.Run == "" {
		o.Run = "/run"
	}
	if o.CgroupRoot == "" {
		o.CgroupRoot = "/sys/fs/cgroup"
	}
	return o
}

// Take reads the host. iptables-save and ip6tables-save must be on PATH
// (Debian's iptables package).
func Take(o Options) (Snapshot, error) {
	o = o.withDefaults()
	var s Snapshot
	var out []byte
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		b, err := exec.Command(save).Output()
		if err != nil {
			return s, fmt.Errorf("%s: %w (Debian's iptables package has it)", save, err)
		}
		out = append(out, b...)
	}
	s.IPTables = NormalizeIPTables(string(out))
	mountinfo, err := os.ReadFile(filepath.Join(o.Proc, "self", "mountinfo"))
	if err != nil {
		return s, err
	}
	if s.Mounts, err = ParseMountinfo(string(mountinfo)); err != nil {
		return s, err
	}
	if s.Run, err = walk(o.Run, runDepth, runOwn); err != nil {
		return s, err
	}
	s.Sysctls = map[string]string{}
	for _, name := range Sysctls {
		raw, err := os.ReadFile(filepath.Join(o.Proc, "sys", name))
		if err != nil {
			return s, err
		}
		s.Sysctls[name] = strings.TrimSpace(string(raw))
	}
	if s.Cgroups, err = topCgroups(o.CgroupRoot); err != nil {
		return s, err
	}
	for _, unified := range []string{o.CgroupRoot, filepath.Join(o.CgroupRoot, "unified")} {
		if raw, err := os.ReadFile(filepath.Join(unified, "cgroup.subtree_control")); err == nil {
			s.SubtreeControl = strings.TrimSpace(string(raw))
			break
		}
	}
	return s, nil
}

// NormalizeIPTables keeps what must be the same before and after: the
// rules and chains, without comments, counters or timestamps.
func NormalizeIPTables(save string) []string {
	var keep []string
	for _, l := range strings.Split(save, "\n") {
		if strings.HasPrefix(l, "#") || strings.TrimSpace(l) == "" {
			continue
		}
		if strings.HasPrefix(l, ":") { // ":CHAIN POLICY [packets:bytes]"
			if f := strings.Fields(l); len(f) >= 2 {
				l = f[0] + " " + f[1]
			}
		}
		keep = append(keep, l)
	}
	return keep
}

// ParseMountinfo is "mount point fstype source" for each line of a
// /proc/<pid>/mountinfo (proc_pid_mountinfo(5)): what a mount is, without
// the IDs that a remount changes.
func ParseMountinfo(mountinfo string) ([]string, error) {
	var mounts []string
	sc := bufio.NewScanner(strings.NewReader(mountinfo))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := slices.Index(fields, "-")
		if sep < 6 || len(fields) < sep+3 {
			return nil, fmt.Errorf("mountinfo: line %q: want at least six fields, \"-\", fstype and source", sc.Text())
		}
		mounts = append(mounts, fields[4]+" "+fields[sep+1]+" "+fields[sep+2])
	}
	return mounts, sc.Err()
}

// walk lists the paths under root to depth levels, relative to it;
// directories end in "/", and the content of those named in own is left
// out. A path that goes while it is walked, or that root may not read
// (another user's FUSE mount), is left out.
func walk(root string, depth int, own []string) ([]string, error) {
	var paths []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) {
				return nil
			}
			return err
		}
		if p == root {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			paths = append(paths, rel+"/")
			if strings.Count(rel, "/")+1 >= depth || slices.Contains(own, rel) {
				return fs.SkipDir
			}
			return nil
		}
		paths = append(paths, rel)
		return nil
	})
	return paths, err
}

// topCgroups are the cgroups directly under each hierarchy mounted under
// root (or root itself, on a unified host).
func topCgroups(root string) ([]string, error) {
	var cgroups []string
	list := func(dir, label string) error {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if e.IsDir() {
				cgroups = append(cgroups, filepath.Join(label, e.Name()))
			}
		}
		return nil
	}
	if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err == nil {
		return cgroups, list(root, ".")
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		if _, err := os.Stat(filepath.Join(root, e.Name(), "cgroup.procs")); err != nil {
			continue // a symlink such as cpu,cpuacct, or not a hierarchy
		}
		if err := list(filepath.Join(root, e.Name()), e.Name()); err != nil {
			return nil, err
		}
	}
	return cgroups, nil
}

// Diff says, one line each, how after differs from before; none when the
// host is as it was.
func Diff(before, after Snapshot) []string {
	var d []string
	d = append(d, diffSets("iptables rule", before.IPTables, after.IPTables)...)
	d = append(d, diffSets("mount", before.Mounts, after.Mounts)...)
	d = append(d, diffSets("/run entry", before.Run, after.Run)...)
	d = append(d, diffSets("cgroup", before.Cgroups, after.Cgroups)...)
	if before.SubtreeControl != after.SubtreeControl {
		d = append(d, fmt.Sprintf("cgroup v2 root's subtree_control: %q before, %q after", before.SubtreeControl, after.SubtreeControl))
	}
	for _, name := range slices.Sorted(maps.Keys(before.Sysctls)) {
		if b, a := before.Sysctls[name], after.Sysctls[name]; b != a {
			d = append(d, fmt.Sprintf("sysctl %s: %s before, %s after", strings.ReplaceAll(name, "/", "."), b, a))
		}
	}
	return d
}

// diffSets compares two lists as multisets: a rule added twice is two
// differences.
func diffSets(what string, before, after []string) []string {
	count := map[string]int{}
	for _, b := range before {
		count[b]++
	}
	for _, a := range after {
		count[a]--
	}
	var d []string
	for _, k := range slices.Sorted(maps.Keys(count)) {
		for c := count[k]; c > 0; c-- {
			d = append(d, fmt.Sprintf("%s gone: %s", what, k))
		}
		for c := count[k]; c < 0; c++ {
			d = append(d, fmt.Sprintf("%s added: %s", what, k))
		}
	}
	return d
}
