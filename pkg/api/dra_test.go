package api

import (
	"errors"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
)

func TestParseShareConfig(t *testing.T) {
	ok := `{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig"`
	for in, want := range map[string]int64{
		ok + `}`:                            0,
		ok + `,"memoryLimit":"30Gi"}`:       30720,
		ok + `,"memoryLimit":"1536Mi"}`:     1536,
		ok + `,"memoryLimit":"2147483648"}`: 2048,
	} {
		got, err := ParseShareConfig([]byte(in))
		if err != nil || got != want {
			t.Errorf("%s: %d, %v; want %d", in, got, err, want)
		}
	}
	for in, want := range map[string]string{
		ok + `,"memoryLimit":"lots"}`:              `memoryLimit "lots"`,
		ok + `,"memoryLimit":"-1Gi"}`:              `memoryLimit "-1Gi"`,
		ok + `,"memoryLimit":"100Ki"}`:             "at least 1Mi",
		ok + `,"memorylimit":"1Gi"}`:               `unknown field "memorylimit"`,
		`{"apiVersion":"v1","kind":"ShareConfig"}`: `apiVersion "v1"`,
		`{"apiVersion":"gpu.gpufrac.io/v1alpha1"}`: `kind ""`,
		`[1]`:                         "cannot unmarshal",
		ok + `} {}`:                   "after top-level value",
		ok + `,"kind":"ShareConfig"}`: "duplicate field",
		``:                            "unexpected end",
	} {
		if _, err := ParseShareConfig([]byte(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one saying %q", in, err, want)
		}
	}
}

func FuzzParseShareConfig(f *testing.F) {
	f.Add([]byte(`{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"30Gi"}`))
	f.Add([]byte(`{"memoryLimit":"1e3"}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		limit, err := ParseShareConfig(raw)
		if err == nil && limit < 0 {
			t.Fatalf("%q: negative limit %d", raw, limit)
		}
		if err != nil && (strings.Contains(err.Error(), "\n") || !strings.HasPrefix(err.Error(), "opaque parameters")) {
			t.Fatalf("%q: error %q is not one line naming the parameters", raw, err)
		}
	})
}

func claimSpec(class string, caps map[string]string, config string) resourceapi.ResourceClaimSpec {
	r := resourceapi.ExactDeviceRequest{DeviceClassName: class}
	if caps != nil {
		r.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for k, v := range caps {
			r.Capacity.Requests[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
	}
	spec := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &r}}}}
	if config != "" {
		spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{
			Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: DRADriver, Parameters: runtime.RawExtension{Raw: []byte(config)}}}}}
	}
	return spec
}

func TestValidateClaim(t *testing.T) {
	limit := func(l string) string {
		return `{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"` + l + `"}`
	}
	for name, spec := range map[string]resourceapi.ResourceClaimSpec{
		"time-slicing":           claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "20Gi"}, ""),
		"time-slicing, burst":    claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "20Gi"}, limit("30Gi")),
		"sm-sharing":             claimSpec(DRAClassSMSharing, map[string]string{"memory": "10Gi", "compute": "25"}, ""),
		"another driver's class": claimSpec("gpu.nvidia.com", nil, ""),
	} {
		if err := ValidateClaim(spec); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if err := ValidateClaim(firstAvailable(limit("10Gi"), "gpu/small")); err != nil {
		t.Errorf("a limit for the small alternative only: %v", err)
	}
	many := claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "1Gi"}, "")
	many.Devices.Requests[0].Exactly.Count = 2
	for name, tc := range map[string]struct {
		spec resourceapi.ResourceClaimSpec
		want string
	}{
		"no memory":              {claimSpec(DRAClassTimeSlicing, nil, ""), "capacity.requests.memory \"\": a share"},
		"sm-sharing, no compute": {claimSpec(DRAClassSMSharing, map[string]string{"memory": "1Gi"}, ""), "compute \"\": an sm-sharing share"},
		"compute 0.5":            {claimSpec(DRAClassSMSharing, map[string]string{"memory": "1Gi", "compute": "500m"}, ""), "whole percent"},
		"compute 150":            {claimSpec(DRAClassSMSharing, map[string]string{"memory": "1Gi", "compute": "150"}, ""), "from 1 to 100"},
		"compute on time-slicing": {claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "1Gi", "compute": "10"}, ""),
			"has no compute portion"},
		"another capacity": {claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "1Gi", "cores": "2"}, ""), "requests.cores: not a capacity"},
		"two devices":      {many, "one share of one GPU"},
		"bad config":       {claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "1Gi"}, `{"kind":"x"}`), "spec.devices.config[0]: opaque parameters"},
		"limit below":      {claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "20Gi"}, limit("10Gi")), "memoryLimit 10240Mi is below request gpu's memory 20480Mi"},
		"limit below the minimum share": {claimSpec(DRAClassTimeSlicing, map[string]string{"memory": "100Mi"}, limit("200Mi")),
			"memoryLimit 200Mi is below request gpu's memory 256Mi"},
		"subrequest limit below": {firstAvailable(limit("10Gi"), "gpu/big"), "below request gpu/big's memory 20480Mi"},
		"main request's limit":   {firstAvailable(limit("10Gi"), "gpu"), "below request gpu/big's memory 20480Mi"},
	} {
		err := ValidateClaim(tc.spec)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one saying %q", name, err, tc.want)
		}
	}
}

// firstAvailable is a claim with two alternatives, gpu/big (20Gi) and
// gpu/small (5Gi), and a config for the named requests.
func firstAvailable(config, requests string) resourceapi.ResourceClaimSpec {
	sub := func(name, mem string) resourceapi.DeviceSubRequest {
		return resourceapi.DeviceSubRequest{Name: name, DeviceClassName: DRAClassTimeSlicing,
			Capacity: &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{DRACapacityMemory: resource.MustParse(mem)}}}
	}
	spec := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
		FirstAvailable: []resourceapi.DeviceSubRequest{sub("big", "20Gi"), sub("small", "5Gi")}}}}}
	spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{Requests: []string{requests}, DeviceConfiguration: resourceapi.DeviceConfiguration{
		Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: DRADriver, Parameters: runtime.RawExtension{Raw: []byte(config)}}}}}
	return spec
}

func TestJoinLine(t *testing.T) {
	if JoinLine(nil, nil) != nil {
		t.Error("JoinLine of nothing is not nil")
	}
	if got := JoinLine(errors.New("a"), nil, errors.New("b")).Error(); got != "a; b" {
		t.Errorf("JoinLine = %q", got)
	}
}
