// Package nodeapi holds the names the node packages share: the
// environment the node sets in a container, the memory-limit backends and
// enforcement levels, and the layout of the node's MPS pipe directory. It
// does no I/O and imports nothing of gpufrac's, so the pure injection
// package and the packages that do the I/O (mps, inventory, the NRI
// plugin) agree on one definition of each.
package nodeapi

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
)

// Environment variables the node sets. Pod-provided values of all of them
// are replaced, never trusted.
const (
	EnvVisibleDevices   = "NVIDIA_VISIBLE_DEVICES"
	EnvMemoryRequest    = "NVIDIA_GPU_MEMORY_REQUEST" // MiB, read by NVIDIA Container Toolkit's memory-limit hook
	EnvMemoryLimit      = "NVIDIA_GPU_MEMORY_LIMIT"   // MiB
	EnvMPSPinnedLimit   = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
	EnvMPSPipeDirectory = "CUDA_MPS_PIPE_DIRECTORY"
	EnvMPSThreads       = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
	EnvLibraryPath      = "LD_LIBRARY_PATH"

	// Hook environment: what the createRuntime hook applies.
	EnvHookDevices    = "GPUFRAC_DEVICES"
	EnvHookRequestMiB = "GPUFRAC_MEMORY_REQUEST_MIB"
	EnvHookLimitMiB   = "GPUFRAC_MEMORY_LIMIT_MIB"
	EnvHookContainer  = "GPUFRAC_CONTAINER"
)

// Backend is how a node enforces fractional containers' memory limits.
type Backend string

// The backends, strongest first.
const (
	// BackendDriver: the createRuntime hook sets per-cgroup soft and hard
	// limits in the driver (CUDA 13.4, driver r615, kernel dmem controller).
	BackendDriver Backend = "driver"
	// BackendToolkit: NVIDIA Container Toolkit's CDI hook sets the same
	// driver limits from NVIDIA_GPU_MEMORY_REQUEST/_LIMIT.
	BackendToolkit Backend = "toolkit"
	// BackendMPSPinned: only the MPS server's pinned-memory limit
	// (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) on the container's MPS clients; a
	// process that is not an MPS client is not bound by it. Weak.
	BackendMPSPinned Backend = "mps-pinned"
	// BackendOff: no enforcement; fractional containers are refused (or,
	// failing open, get no GPU).
	BackendOff Backend = "off"
	// BackendUnset: not decided yet, until the agent has read the GPUs;
	// fractional containers are refused meanwhile.
	BackendUnset Backend = ""
)

// Backends are the values --memory-limits accepts besides "auto".
var Backends = []Backend{BackendDriver, BackendToolkit, BackendMPSPinned, BackendOff}

// CheckBackendFlag validates --memory-limits before the node is known.
func CheckBackendFlag(flag string) error {
	if flag == "auto" || slices.Contains(Backends, Backend(flag)) {
		return nil
	}
	return fmt.Errorf("--memory-limits %q: must be auto, driver, toolkit, mps-pinned or off", flag)
}

// DriverLimits reports whether the backend sets the driver's per-cgroup
// soft and hard limits (and so needs cgroup v2 with a dmem or misc
// backend, and MPS memacct for the soft limit).
func (b Backend) DriverLimits() bool { return b == BackendDriver || b == BackendToolkit }

// Enforcement is the strongest memory enforcement a node can do.
type Enforcement string

const (
	// EnforcementDriver means per-cgroup soft and hard limits set in the
	// driver (CUDA 13.4, driver r615 and later); a tenant cannot bypass them.
	EnforcementDriver Enforcement = "driver"
	// EnforcementMPSPinned means only MPS's pinned memory limit, which a
	// process that avoids MPS can bypass. Weak.
	EnforcementMPSPinned Enforcement = "mps-pinned"
	// EnforcementNone means no memory enforcement is possible.
	EnforcementNone Enforcement = "none"
)

// MPS is which MPS control interface the node's daemon speaks.
type MPS string

const (
	// MPSNone means no MPS daemon runs (or it is down): no container can be an
	// MPS client.
	MPSNone MPS = ""
	// MPSv3 is nvidia-cuda-mps-control -p 3 (driver r615 and later): named
	// servers, namespaces with their own thread ceilings, memacct.
	MPSv3 MPS = "v3"
	// MPSv2 is the legacy interface (drivers before r615): one server per
	// user, no namespaces, no memacct; the pinned limit binds its clients.
	MPSv2 MPS = "v2"
)

// MPS pipe layout on the host, under the node's MPS root (--mps-pipe-dir).
// The daemon's CUDA_MPS_PIPE_DIRECTORY is Root/pipe; on r615 a namespace
// of a server is routed by socket path, $PIPE/<server>/<namespace>/control
// (NVIDIA MPS, "MPS v3 Namespaces", Namespace Routing), and the main
// socket is $PIPE/control.
const (
	// SharedServer is the one MPS v3 server the sm-sharing containers'
	// namespaces belong to: its clients share a context, so their kernels
	// run concurrently (and form one fault domain).
	SharedServer = "gpufrac"
	// ContainerPipeDir is where a fractional container sees its MPS pipe
	// directory (its CUDA_MPS_PIPE_DIRECTORY).
	ContainerPipeDir = "/run/nvidia/mps"
	// ContainerShimDir is where it sees the nvidia-smi view library.
	ContainerShimDir = "/usr/local/gpufrac/lib"
)

// PipeDir is the daemon's pipe directory under root.
func PipeDir(root string) string { return filepath.Join(root, "pipe") }

// LogDir is the daemon's log directory under root.
func LogDir(root string) string { return filepath.Join(root, "log") }

// NamespaceDir is the leaf pipe directory of one namespace of the shared
// server: all an sm-sharing container may see.
func NamespaceDir(root, namespace string) string {
	return filepath.Join(PipeDir(root), SharedServer, namespace)
}

// maxNamespacePath bounds the length of a namespace's control socket path.
// A socket path is limited to 107 bytes (sun_path), and KAI's node
// operator measured a 117-character pipe path making an r615 daemon fail
// silently; its cap is 83.
const maxNamespacePath = 83

// NamespaceName names the MPS namespace of a pod's container, the same
// every time it is computed (at creation, stop, removal, and by the next
// agent): "gf_" + up to 16 characters of the container's name + "_" + 20
// hex characters of a hash of the pod UID and the name. MPS namespace
// names are [a-z0-9_]+.
func NamespaceName(podUID, container string) string {
	sum := sha256.Sum256([]byte(podUID + "/" + container))
	var b strings.Builder
	for _, r := range strings.ToLower(container) {
		if b.Len() == 16 {
			break
		}
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return "gf_" + b.String() + "_" + hex.EncodeToString(sum[:10])
}

// CheckRoot refuses an MPS root under which a namespace's control socket
// path would be too long for the daemon.
func CheckRoot(root string) error {
	longest := filepath.Join(NamespaceDir(root, NamespaceName("", strings.Repeat("x", 16))), "control")
	if len(longest) > maxNamespacePath {
		return fmt.Errorf("--mps-pipe-dir %q: a namespace's control socket would be %s (%d characters); MPS needs at most %d: use a shorter directory",
			root, longest, len(longest), maxNamespacePath)
	}
	return nil
}
