package scheduler

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/placement"
)

// Args are the GPUFractions plugin's arguments, set under pluginConfig in
// the KubeSchedulerConfiguration.
type Args struct {
	// Policy is the placement policy: one of placement.Names, or spread
	// (least-allocated GPUs first). Default: gpufrac.
	Policy string `json:"policy,omitempty"`
	// GPUMemoryReserveMiB and GPUMemoryReserveMiBByModel are no longer
	// the scheduler's: the reserve is configured once, on the node agent
	// (--gpu-memory-reserve-mib), which enforces it and publishes it on its
	// node (api.LabelGPUMemoryReserve) for every reader. They are decoded
	// only to refuse a configuration that still sets them.
	GPUMemoryReserveMiB        int64            `json:"gpuMemoryReserveMiB,omitempty"`
	GPUMemoryReserveMiBByModel map[string]int64 `json:"gpuMemoryReserveMiBByModel,omitempty"`
	// ReservationNamespace holds the reservation pods; the node agent
	// watches the same namespace. Default gpufrac-reservations.
	ReservationNamespace string `json:"reservationNamespace,omitempty"`
	// ReservationImage runs in each reservation pod; it only has to sleep.
	ReservationImage string `json:"reservationImage,omitempty"`
	// ReservationPriorityClassName keeps reservation pods from being
	// preempted by ordinary pods. Default system-node-critical.
	ReservationPriorityClassName string `json:"reservationPriorityClassName,omitempty"`
	// BindTimeout bounds PreBind's wait for a reservation pod's GPU UUID.
	// Default 2m.
	BindTimeout Duration `json:"bindTimeout,omitempty"`
	// DeviceNaming is how .gpus.devices names the GPUs: uuid (default,
	// GPU-…, for gpufrac's node agent and non-CDI runtimes) or cdi
	// (k8s.device-plugin.nvidia.com/gpu=GPU-…, as KAI writes on clusters
	// whose NVIDIA device plugin uses CDI: with NVIDIA's node operator only
	// that CDI spec carries the toolkit's memory-limit hook, so bare UUIDs
	// there would run without driver limits). gpufrac's node agent reads
	// both.
	DeviceNaming string `json:"deviceNaming,omitempty"`
	// LeaderLease names the scheduler's leader-election Lease,
	// <namespace>/<name> (its leaderElection resourceNamespace and
	// resourceName), when it runs more than one replica: resizes are then
	// decided only by the replica that leads, whose cache holds the pods it
	// is placing. Unset: every replica decides them (one replica).
	LeaderLease string `json:"leaderLease,omitempty"`
	// AllowUncharged places a share whose pod carries no GPU memory charge
	// (api.ResourceGPUMemory): set it where the webhook runs with
	// --gpu-memory-quota=false, and only there. By default such a pod is
	// unschedulable: the webhook charges every pod that asks for a share
	// when it is created, so one without gained its share after (a claim
	// replaced, keys the webhook never saw) and its quota never counted it.
	AllowUncharged bool `json:"allowUncharged,omitempty"`
	// ConsolidationMaxMoves is the most pods consolidation may move for one
	// pod that fits nowhere (docs/scheduler.md, Consolidation); only pods
	// that opted in move. Default 4; 0 turns consolidation off.
	ConsolidationMaxMoves *int `json:"consolidationMaxMoves,omitempty"`
}

// DefaultConsolidationMaxMoves is ConsolidationMaxMoves when unset.
const DefaultConsolidationMaxMoves = 4

// MaxMoves is the consolidation budget the arguments set (0: off).
func (a Args) MaxMoves() int {
	if a.ConsolidationMaxMoves == nil {
		return DefaultConsolidationMaxMoves
	}
	return max(*a.ConsolidationMaxMoves, 0)
}

// Device namings.
const (
	DeviceNamingUUID = "uuid"
	DeviceNamingCDI  = "cdi"
)

// CDIKind is the CDI kind .gpus.devices entries carry, "" for bare UUIDs.
func (a Args) CDIKind() string {
	if a.DeviceNaming == DeviceNamingCDI {
		return api.CDIKindNVIDIAGPU
	}
	return ""
}

// Duration is a time.Duration written as "90s" or "2m".
type Duration struct{ time.Duration }

// UnmarshalJSON reads a Go duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("must be a duration string such as \"90s\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

// MarshalJSON writes a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// Defaults of Args.
const (
	DefaultReservationNamespace = api.DefaultReservationNamespace
	DefaultReservationImage     = "registry.k8s.io/pause:3.10"
	DefaultPriorityClassName    = "system-node-critical"
	DefaultBindTimeout          = 2 * time.Minute
	// PolicySpread puts each fraction on the least allocated GPU: the
	// opposite of packing, for workloads that want room to burst.
	PolicySpread = "spread"
)

// PolicyNames lists the policies the plugin accepts, the default first:
// the simulator's, less random (a baseline, not a policy to run), and
// spread.
func PolicyNames() []string {
	return append(slices.DeleteFunc(slices.Clone(placement.Names), func(n string) bool { return n == "random" }), PolicySpread)
}

// DecodeArgs reads the plugin's arguments strictly (an unknown field is an
// error, so that a typo does not silently leave a default in force), fills
// the defaults and validates them.
func DecodeArgs(obj runtime.Object) (Args, error) {
	var a Args
	if obj != nil {
		raw, err := rawArgs(obj)
		if err != nil {
			return Args{}, err
		}
		if len(raw) > 0 {
			dec := json.NewDecoder(bytes.NewReader(raw))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&a); err != nil {
				return Args{}, fmt.Errorf("GPUFractions args: %w", err)
			}
		}
	}
	a.Default()
	return a, a.Validate()
}

func rawArgs(obj runtime.Object) ([]byte, error) {
	u, ok := obj.(*runtime.Unknown)
	if !ok {
		return nil, fmt.Errorf("GPUFractions args: want runtime.Unknown, got %T", obj)
	}
	if u.ContentType == runtime.ContentTypeYAML {
		raw, err := yaml.YAMLToJSON(u.Raw)
		if err != nil {
			return nil, fmt.Errorf("GPUFractions args: %w", err)
		}
		return raw, nil
	}
	return u.Raw, nil
}

// Default fills unset fields.
func (a *Args) Default() {
	if a.Policy == "" {
		a.Policy = placement.Names[0]
	}
	if a.ReservationNamespace == "" {
		a.ReservationNamespace = DefaultReservationNamespace
	}
	if a.ReservationImage == "" {
		a.ReservationImage = DefaultReservationImage
	}
	if a.ReservationPriorityClassName == "" {
		a.ReservationPriorityClassName = DefaultPriorityClassName
	}
	if a.BindTimeout.Duration == 0 {
		a.BindTimeout.Duration = DefaultBindTimeout
	}
	if a.DeviceNaming == "" {
		a.DeviceNaming = DeviceNamingUUID
	}
}

// Validate reports the first bad field: its name, value and rule.
func (a Args) Validate() error {
	if m := a.ConsolidationMaxMoves; m != nil && *m < 0 {
		return fmt.Errorf("GPUFractions args: consolidationMaxMoves %d must be 0 (no consolidation) or more", *m)
	}
	if !slices.Contains(PolicyNames(), a.Policy) {
		return fmt.Errorf("GPUFractions args: policy %q is not known: use one of %s", a.Policy, strings.Join(PolicyNames(), ", "))
	}
	if a.GPUMemoryReserveMiB != 0 || len(a.GPUMemoryReserveMiBByModel) > 0 {
		return fmt.Errorf("GPUFractions args: gpuMemoryReserveMiB %d / gpuMemoryReserveMiBByModel %v: the reserve is set once, on the node agent (--gpu-memory-reserve-mib, --gpu-memory-reserve-mib-by-model), which publishes it on each node as %s; remove it from the scheduler's args",
			a.GPUMemoryReserveMiB, a.GPUMemoryReserveMiBByModel, api.LabelGPUMemoryReserve)
	}
	if errs := validation.IsDNS1123Label(a.ReservationNamespace); len(errs) > 0 {
		return fmt.Errorf("GPUFractions args: reservationNamespace %q is not a namespace name: %s", a.ReservationNamespace, strings.Join(errs, "; "))
	}
	if strings.TrimSpace(a.ReservationImage) != a.ReservationImage || strings.ContainsAny(a.ReservationImage, " \t\n") {
		return fmt.Errorf("GPUFractions args: reservationImage %q must be an image reference without spaces", a.ReservationImage)
	}
	if a.BindTimeout.Duration < time.Second {
		return fmt.Errorf("GPUFractions args: bindTimeout %s must be at least 1s", a.BindTimeout.Duration)
	}
	if a.LeaderLease != "" {
		ns, name, ok := strings.Cut(a.LeaderLease, "/")
		if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
			return fmt.Errorf("GPUFractions args: leaderLease %q must be <namespace>/<name>, the leaderElection resourceNamespace and resourceName", a.LeaderLease)
		}
	}
	if a.DeviceNaming != DeviceNamingUUID && a.DeviceNaming != DeviceNamingCDI {
		return fmt.Errorf("GPUFractions args: deviceNaming %q must be %s (bare GPU UUIDs) or %s (%s=<UUID>, for NVIDIA's node operator on CDI clusters)",
			a.DeviceNaming, DeviceNamingUUID, DeviceNamingCDI, api.CDIKindNVIDIAGPU)
	}
	return nil
}
