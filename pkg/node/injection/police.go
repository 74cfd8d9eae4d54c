package injection

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// What NVIDIA's container toolkit reads to choose a container's GPUs,
// besides NVIDIA_VISIBLE_DEVICES (nvidia-container-toolkit,
// internal/config/image/cuda_image.go): an image is "legacy" when it sets
// CUDA_VERSION and not NVIDIA_REQUIRE_CUDA, and then an unset device list
// means all GPUs; with the volume-mounts strategy the list is read from
// mounts of /dev/null under DeviceListAsVolumeMountsRoot.
const (
	envCUDAVersion      = "CUDA_VERSION"
	envRequireCUDA      = "NVIDIA_REQUIRE_CUDA"
	deviceMountsRoot    = "/var/run/nvidia-container-devices"
	deviceMountSource   = "/dev/null"
	noDevicesButDrivers = "none"
)

// Police makes a container that holds no gpufrac share (a pod with no
// fraction, a whole-GPU pod, a DRA consumer) see exactly the GPUs granted
// to it: granted are the device IDs the device plugin allocated to the
// container (the kubelet's PodResources API, "GPU-<uuid>", "GPU-<uuid>::n"
// for a shared replica, "MIG-<uuid>", or an index where the plugin names
// devices so) and the GPUs of its DRA shares. Any other request, in
// NVIDIA_VISIBLE_DEVICES (an image's "all", a pod's own value) or in the
// toolkit's volume-mounts list, is replaced: by the granted list, by
// "void" when nothing is granted. It returns nil when the container asks
// for nothing more than it was granted, and otherwise the adjustment with
// a note for the pod's Event. A container whose environment no adjustment
// can correct (the variable set twice, the last value wrong: the runtime
// puts it back, see ApplyEnv) is an error: it must not start.
func Police(env []string, mounts []*nriapi.Mount, granted []string) (*nriapi.ContainerAdjustment, string, error) {
	allowed := grantedIDs(granted)
	adj := &nriapi.ContainerAdjustment{}
	var notes []string
	value, set := lookupSet(env, nodeapi.EnvVisibleDevices)
	want := strings.Join(allowed, ",")
	if want == "" {
		want = noDevices
	}
	switch {
	case !set:
		// Unset means no GPU, except for a legacy CUDA image, where the
		// toolkit reads it as all of them (set but empty is none).
		if lookup(env, envCUDAVersion) != "" && lookup(env, envRequireCUDA) == "" {
			setEnv(adj, nodeapi.EnvVisibleDevices, want)
			notes = append(notes, fmt.Sprintf("the image is a legacy CUDA image (CUDA_VERSION without NVIDIA_REQUIRE_CUDA), for which NVIDIA's toolkit takes an unset %s as all GPUs: set to %q", nodeapi.EnvVisibleDevices, want))
		}
	default:
		if bad := ungranted(strings.Split(value, ","), allowed); len(bad) > 0 {
			setEnv(adj, nodeapi.EnvVisibleDevices, want)
			notes = append(notes, fmt.Sprintf("%s=%q names GPUs not granted to the container (%s): set to %q", nodeapi.EnvVisibleDevices, value, strings.Join(bad, ","), want))
		}
	}
	for _, m := range mounts {
		device, ok := mountedDevice(m)
		if !ok || len(ungranted([]string{device}, allowed)) == 0 {
			continue
		}
		adj.RemoveMount(m.GetDestination())
		notes = append(notes, fmt.Sprintf("the device-list mount %s names a GPU not granted to the container: removed", m.GetDestination()))
	}
	if len(notes) == 0 {
		return nil, "", nil
	}
	if got, ok := ApplyEnv(env, adj)[nodeapi.EnvVisibleDevices]; ok {
		if bad := ungranted(strings.Split(got, ","), allowed); len(bad) > 0 {
			return nil, "", fmt.Errorf("%s is set more than once (%q), and the runtime keeps the last value, %q, over any change the node makes: it names GPUs not granted to the container (%s); remove %s from the pod's env (the device plugin sets it)",
				nodeapi.EnvVisibleDevices, value, got, strings.Join(bad, ","), nodeapi.EnvVisibleDevices)
		}
	}
	return adj, strings.Join(notes, "; "), nil
}

// grantedIDs are the device IDs a container may name: the granted ones,
// a shared replica ("GPU-x::2") by its GPU, once each, in order.
func grantedIDs(granted []string) []string {
	var out []string
	for _, id := range granted {
		id, _, _ = strings.Cut(strings.TrimSpace(id), "::")
		if id != "" && !slices.Contains(out, id) {
			out = append(out, id)
		}
	}
	return out
}

// ungranted are the entries of a device list that name a GPU not in
// allowed. An entry is a device ID, or a CDI name whose device is one
// ("nvidia.com/gpu=GPU-x"); "void" and "none" name no GPU; "all", an
// index the plugin did not grant, or another CDI device name one.
func ungranted(entries, allowed []string) []string {
	var bad []string
	for _, e := range entries {
		e = strings.TrimSpace(e)
		switch {
		case e == "" || e == noDevices || e == noDevicesButDrivers:
			continue
		case slices.Contains(allowed, e):
			continue
		}
		if i := strings.LastIndex(e, "="); i > 0 && slices.Contains(allowed, e[i+1:]) {
			continue
		}
		bad = append(bad, e)
	}
	return bad
}

// mountedDevice is the device a mount requests under the toolkit's
// volume-mounts strategy: /dev/null mounted at
// /var/run/nvidia-container-devices/<device>.
func mountedDevice(m *nriapi.Mount) (string, bool) {
	if filepath.Clean(m.GetSource()) != deviceMountSource {
		return "", false
	}
	rest, ok := strings.CutPrefix(filepath.Clean(m.GetDestination()), deviceMountsRoot+"/")
	if !ok || rest == "" || strings.HasPrefix(rest, "imex/") {
		return "", false // IMEX channels are not GPUs
	}
	// CDI requests are cdi/<vendor>/<class>/<device> or
	// cdi/<vendor>/<class>=<device>: the device is the last part.
	if cdi, ok := strings.CutPrefix(rest, "cdi/"); ok {
		parts := strings.FieldsFunc(cdi, func(r rune) bool { return r == '/' || r == '=' })
		if len(parts) == 0 {
			return rest, true
		}
		return parts[len(parts)-1], true
	}
	return rest, true
}

// lookupSet is key's value in env, every occurrence's entries together
// (a list with the key twice is judged on both), and whether it is set.
func lookupSet(env []string, key string) (string, bool) {
	var values []string
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			values = append(values, v)
		}
	}
	return strings.Join(values, ","), len(values) > 0
}

// CheckMPSClientUser refuses a container that would be a client of the
// node's MPS daemon as root on the host: uid is the container process's
// (nil where the runtime does not say, containerd before 2.x: then it is
// not known, and not refused), userNamespace whether the container has a
// user namespace of its own (its uid 0 is then no host root).
func CheckMPSClientUser(uid *uint32, userNamespace bool, cfg Config) error {
	return CheckMPSClient(Container{UID: uid, UserNamespace: userNamespace}, cfg)
}

// CheckMPSClient refuses a container that is or may become root on the
// host as a client of the node's MPS daemon: root by uid
// (CheckMPSClientUser), or by what its pod lets it do after the uid was
// read (c.SharedPID, c.MayEscalate). In a user namespace none of these is
// host root.
func CheckMPSClient(c Container, cfg Config) error {
	if cfg.AllowRootMPSClients || c.UserNamespace {
		return nil
	}
	if c.SharedPID {
		return fmt.Errorf("it shares its process namespace with another container (the pod's shareProcessNamespace, or a debug container's target), which could reach its MPS pipe directory through /proc as root and quit the node's MPS daemon, ending every tenant's GPU context: drop shareProcessNamespace and targeted debug containers, or run the pod in a user namespace (hostUsers: false)")
	}
	if c.MayEscalate != nil && *c.MayEscalate {
		return fmt.Errorf("it may gain privileges (securityContext.allowPrivilegeEscalation is not false, or it is privileged): a setuid-root program would make it root, and root may quit the node's MPS daemon, ending every tenant's GPU context: set allowPrivilegeEscalation false (gpufrac's webhook does at creation), or run the pod in a user namespace (hostUsers: false)")
	}
	uid := c.UID
	if uid == nil || *uid != 0 {
		return nil
	}
	return fmt.Errorf("it runs as root (uid 0, no user namespace), and as a client of the node's MPS daemon root may quit it, ending every tenant's GPU context: run it as another user (securityContext.runAsUser, runAsNonRoot), in a user namespace (hostUsers: false), or have the admin start the agent with --allow-root-mps-clients")
}
