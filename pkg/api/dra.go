package api

import (
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
	kjson "sigs.k8s.io/json"
)

// The opaque configuration of gpufrac's DRA driver (gpu.gpufrac.io): what a
// ResourceClaim (or DeviceClass) passes in spec.devices.config[].opaque.
// parameters besides the share the allocator records (SPEC §5).
const (
	ShareConfigAPIVersion = "gpu.gpufrac.io/v1alpha1"
	ShareConfigKind       = "ShareConfig"
)

// ShareConfig is a claim's opaque configuration for a share.
type ShareConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// MemoryLimit is the hard limit the share may burst to, on each of its
	// GPUs; empty: the limit is the request (capacity.requests.memory).
	MemoryLimit string `json:"memoryLimit,omitempty"`
}

// ParseShareConfig reads a ShareConfig and returns its memory limit in MiB
// (0: none given). Unknown fields, another kind or version, and a limit
// that is not a positive quantity are errors naming the field.
func ParseShareConfig(raw []byte) (limitMiB int64, err error) {
	var c ShareConfig
	// As the API server reads objects: field names case-sensitive, unknown
	// and duplicate fields refused.
	strict, err := kjson.UnmarshalStrict(raw, &c, kjson.DisallowUnknownFields, kjson.DisallowDuplicateFields)
	if err == nil {
		err = errors.Join(strict...)
	}
	if err != nil {
		return 0, fmt.Errorf("opaque parameters of driver gpu.gpufrac.io: %s", strings.ReplaceAll(strings.TrimPrefix(err.Error(), "json: "), "\n", "; "))
	}
	if c.APIVersion != ShareConfigAPIVersion || c.Kind != ShareConfigKind {
		return 0, fmt.Errorf("opaque parameters of driver gpu.gpufrac.io: apiVersion %q, kind %q: must be %s, %s", c.APIVersion, c.Kind, ShareConfigAPIVersion, ShareConfigKind)
	}
	if c.MemoryLimit == "" {
		return 0, nil
	}
	q, err := resource.ParseQuantity(c.MemoryLimit)
	if err != nil || q.Sign() <= 0 || q.Value()>>20 <= 0 {
		return 0, fmt.Errorf("opaque parameters of driver gpu.gpufrac.io: memoryLimit %q: must be a quantity of at least 1Mi (20Gi, 30720Mi)", c.MemoryLimit)
	}
	return q.Value() >> 20, nil
}
