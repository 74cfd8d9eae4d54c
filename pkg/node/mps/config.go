package mps

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// The driver releases the MPS interfaces arrived with.
const (
	// ReleaseV3 is the first driver with MPS v3 (servers, namespaces,
	// memacct, the TOML configuration file): r615, CUDA 13.4.
	ReleaseV3 = 615
	// ReleaseV3Policy is the first with the r620 configuration keys
	// ([compute_policy], cgroup-routed namespaces, ...).
	ReleaseV3Policy = 620
)

// DriverMajor reads the major release of an NVML driver version string
// ("615.10.02" is 615).
func DriverMajor(driverVersion string) (int, error) {
	major, _, _ := strings.Cut(driverVersion, ".")
	m, err := strconv.Atoi(major)
	if err != nil || m <= 0 {
		return 0, fmt.Errorf("driver version %q: not a release number", driverVersion)
	}
	return m, nil
}

// ProtocolFor is the MPS interface a driver release offers: v3 from r615,
// the legacy v2 interface before.
func ProtocolFor(major int) nodeapi.MPS {
	if major >= ReleaseV3 {
		return nodeapi.MPSv3
	}
	return nodeapi.MPSv2
}

// ConfigOptions are the operator's choices for the daemon's configuration
// beyond what gpufrac always sets.
type ConfigOptions struct {
	// Timeslice is the r620 [compute_policy] timeslice (NVIDIA's example
	// value is "long"): how long the GPU gives each context, such as each
	// time-slicing container's, before switching. "" leaves the driver's
	// default. An r615 daemon rejects the key, so it is an error there.
	Timeslice string
	// AuditLog turns on memacct's audit log (r615).
	AuditLog bool
}

// Config is the TOML configuration (NVIDIA MPS, "MPS v3 Configuration
// File") the node's control daemon starts with (-a), for driver release
// major:
//
//   - [features.memacct] enabled: the server accounts every client's GPU
//     memory against its cgroup's soft limit and evicts a client over it
//     when memory runs short: what makes a request a guarantee;
//   - [features.context-share] with default_socket = "off": clients of the
//     main socket ($PIPE/control, the time-slicing containers) keep
//     contexts of their own, time-sliced by the GPU, while clients routed
//     to a named server share its context;
//   - [servers.gpufrac]: the one shared server whose namespaces the
//     sm-sharing containers are, with its implicit default namespace
//     capped at 1% of the SMs, so a client that reaches it uncapped gets
//     next to nothing.
//
// Keys of a later release are written only for a driver that has them:
// "any other key is a configuration error" on r615.
func Config(major int, opts ConfigOptions) ([]byte, error) {
	if ProtocolFor(major) != nodeapi.MPSv3 {
		return nil, fmt.Errorf("driver r%d has no MPS v3 configuration file (needs r%d); the daemon runs the legacy interface without one", major, ReleaseV3)
	}
	var b strings.Builder
	b.WriteString("# Written by the gpufrac node agent; regenerated at every daemon start.\n")
	b.WriteString("schema_version = \"1.0\"\n\n")
	b.WriteString("[features.memacct]\nenabled = true\n")
	fmt.Fprintf(&b, "audit_log = %t\n\n", opts.AuditLog)
	b.WriteString("[features.context-share]\nenabled = true\ndefault_socket = \"off\"\n\n")
	fmt.Fprintf(&b, "[servers.%s]\n\n", nodeapi.SharedServer)
	fmt.Fprintf(&b, "[servers.%s.namespaces.default]\nactive_thread_percentage = %d\n", nodeapi.SharedServer, DefaultNamespaceCeiling)
	if opts.Timeslice != "" {
		if major < ReleaseV3Policy {
			return nil, fmt.Errorf("--mps-timeslice %q: [compute_policy] timeslice needs driver r%d, and this node runs r%d, whose daemon rejects the key", opts.Timeslice, ReleaseV3Policy, major)
		}
		if !timeslice.MatchString(opts.Timeslice) {
			return nil, fmt.Errorf("--mps-timeslice %q: must be a word of [a-z0-9_] (NVIDIA's example: long)", opts.Timeslice)
		}
		fmt.Fprintf(&b, "\n[compute_policy]\ntimeslice = %q\n", opts.Timeslice)
	}
	return []byte(b.String()), nil
}

var timeslice = regexp.MustCompile(`^[a-z0-9_]{1,32}$`)

// DefaultNamespaceCeiling is the active-thread percentage of the shared
// server's default namespace, which no container is given.
const DefaultNamespaceCeiling = 1
