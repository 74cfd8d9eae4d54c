package admission

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// claims is a ClaimSource over fixed specs ("claim:NAME", "template:NAME").
type claims struct {
	specs map[string]resourceapi.ResourceClaimSpec
	class int64
	err   error
}

func (c claims) ClaimSpec(_ context.Context, _, name string, template bool) (*resourceapi.ResourceClaimSpec, bool, error) {
	if c.err != nil {
		return nil, false, c.err
	}
	key := "claim:" + name
	if template {
		key = "template:" + name
	}
	s, ok := c.specs[key]
	return &s, ok, nil
}

func (c claims) ClassLimitMiB(context.Context, string) (int64, error) { return c.class, nil }

func share(class, memory string, limit string) resourceapi.ResourceClaimSpec {
	s := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
		Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, Capacity: &resourceapi.CapacityRequirements{
			Requests: map[resourceapi.QualifiedName]resource.Quantity{api.DRACapacityMemory: resource.MustParse(memory)}}}}}}}
	if limit != "" {
		s.Devices.Config = []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: api.DRADriver, Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"` + limit + `"}`)}}}}}
	}
	return s
}

// mutated is p after the mutator's patches, as the API server stores it.
func mutated(t *testing.T, m *Mutator, p *corev1.Pod) (*corev1.Pod, string) {
	t.Helper()
	resp := m.Handle(context.Background(), request(t, admissionv1.Create, podKind, "alice", nil, p))
	if !resp.Allowed {
		return nil, resp.Result.Message
	}
	raw, _ := json.Marshal(p)
	ops, _ := json.Marshal(resp.Patches)
	patch, err := jsonpatch.DecodePatch(ops)
	if err != nil {
		t.Fatal(err)
	}
	if raw, err = patch.Apply(raw); err != nil {
		t.Fatalf("patches %s do not apply: %v", ops, err)
	}
	var out corev1.Pod
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatal(err)
	}
	return &out, ""
}

func TestMutatorChargesGPUMemory(t *testing.T) {
	largest := func() int64 { return 81920 }
	src := claims{specs: map[string]resourceapi.ResourceClaimSpec{
		"template:quarter":   share(api.DRAClassTimeSlicing, "20Gi", ""),
		"template:burst":     share(api.DRAClassSMSharing, "10Gi", "30Gi"),
		"claim:other-driver": share("example.com-dongle", "1Gi", ""),
		"claim:tiny":         share(api.DRAClassTimeSlicing, "1Mi", ""), // the allocator rounds it up to 256Mi
	}}
	withClaims := func(names ...string) *corev1.Pod {
		p := pod(nil, "")
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "side"})
		for _, n := range names {
			kind, name, _ := strings.Cut(n, ":")
			pc := corev1.PodResourceClaim{Name: name}
			if kind == "template" {
				pc.ResourceClaimTemplateName = ptr.To(name)
			} else {
				pc.ResourceClaimName = ptr.To(name)
			}
			p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, pc)
			p.Spec.Containers[1].Resources.Claims = append(p.Spec.Containers[1].Resources.Claims, corev1.ResourceClaim{Name: name})
		}
		return p
	}
	forged := pod(ann{"gpu-memory": "1024"}, "")
	forged.Spec.Containers[0].Resources.Requests = corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("1Mi")}
	forged.Spec.Containers = append(forged.Spec.Containers, corev1.Container{Name: "b", Resources: corev1.ResourceRequirements{
		Limits: corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("1Mi")}, Requests: corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("1Mi")}}})
	forged.Spec.InitContainers = []corev1.Container{{Name: "init", Resources: corev1.ResourceRequirements{
		Limits: corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("100Gi")}, Requests: corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse("100Gi")}}}}
	cases := []struct {
		name      string
		charger   Charger
		pod       *corev1.Pod
		container string // where the charge goes ("": none written)
		want      string
		denied    string
	}{
		{"memory with a limit: the limit", Charger{}, pod(ann{"gpu-memory": "4096", "gpu-memory.limit": "8Gi"}, ""), "main", "8Gi", ""},
		{"memory on two GPUs", Charger{}, pod(ann{"gpu-memory": "4096", "gpu-fraction-num-devices": "2"}, ""), "main", "8Gi", ""},
		{"a share of the largest GPU", Charger{LargestGPUMiB: largest}, pod(ann{"gpu-fraction": "0.5"}, ""), "main", "40Gi", ""},
		{"a share's limit", Charger{LargestGPUMiB: largest}, pod(ann{"gpu-fraction": "0.25", "gpu-fraction.limit": "0.75"}, ""), "main", "60Gi", ""},
		{"a share before any GPU node", Charger{}, pod(ann{"gpu-fraction": "0.5"}, ""), "", "", `container "main" asks for a share of a GPU (0.5), but no node reports its GPUs' memory yet`},
		{"the author's own charge is replaced", Charger{}, forged, "main", "1Gi", ""},
		{"a claim from a template", Charger{Claims: src}, withClaims("template:quarter"), "side", "20Gi", ""},
		{"a claim's burst limit", Charger{Claims: src}, withClaims("template:burst"), "side", "30Gi", ""},
		{"two claims", Charger{Claims: src}, withClaims("template:quarter", "template:burst"), "side", "50Gi", ""},
		{"the allocator's minimum", Charger{Claims: src}, withClaims("claim:tiny"), "side", "256Mi", ""},
		{"another driver's claim: nothing", Charger{Claims: src}, withClaims("claim:other-driver"), "", "", ""},
		{"a claim not made yet: charged 0", Charger{Claims: src}, withClaims("claim:later"), "side", "0", ""},
		{"the class's limit", Charger{Claims: claims{specs: src.specs, class: 40960}}, withClaims("template:quarter"), "side", "40Gi", ""},
		{"charging off (--gpu-memory-quota=false)", Charger{Off: true}, pod(ann{"gpu-memory": "4096"}, ""), "", "", ""},
		{"API failure fails closed", Charger{Claims: claims{err: errors.New("forbidden")}}, withClaims("template:quarter"), "", "", "forbidden"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, denied := mutated(t, &Mutator{SchedulerName: "gpufrac", Charger: c.charger}, c.pod)
			if c.denied != "" {
				if !strings.Contains(denied, c.denied) {
					t.Fatalf("denied %q, want it to say %q", denied, c.denied)
				}
				return
			}
			if denied != "" {
				t.Fatalf("denied: %s", denied)
			}
			mib, charged := api.ChargedMiB(&out.Spec)
			if !charged {
				if c.container != "" {
					t.Fatalf("no charge written, want %s on %q", c.want, c.container)
				}
				return
			}
			if c.container == "" {
				t.Fatalf("charged %dMi, want no charge", mib)
			}
			for _, ctr := range append(out.Spec.Containers, out.Spec.InitContainers...) {
				req, inReq := ctr.Resources.Requests[api.ResourceGPUMemory]
				lim, inLim := ctr.Resources.Limits[api.ResourceGPUMemory]
				if ctr.Name != c.container {
					if inReq || inLim {
						t.Errorf("container %q keeps a charge (%v, %v)", ctr.Name, req, lim)
					}
					continue
				}
				if req.String() != c.want || lim.String() != c.want {
					t.Errorf("container %q charged request %s, limit %s; want %s", ctr.Name, req.String(), lim.String(), c.want)
				}
			}
			if want := resource.MustParse(c.want); mib != want.Value()>>20 {
				t.Errorf("ChargedMiB = %d, want %s", mib, c.want)
			}
		})
	}
}

// A claim pod is sent to gpufrac's scheduler, like a fractional one; a pod
// whose claims are another driver's is not.
func TestMutatorSendsClaimPodsToGpufrac(t *testing.T) {
	src := claims{specs: map[string]resourceapi.ResourceClaimSpec{
		"claim:ours": share(api.DRAClassTimeSlicing, "20Gi", ""), "claim:theirs": share("dongle", "1Gi", "")}}
	for name, want := range map[string]string{"ours": "gpufrac", "theirs": ""} {
		p := pod(nil, "")
		p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "c", ResourceClaimName: ptr.To(name)}}
		out, denied := mutated(t, &Mutator{SchedulerName: "gpufrac", Charger: Charger{Claims: src}}, p)
		if denied != "" || out.Spec.SchedulerName != want {
			t.Errorf("claim %s: schedulerName %q (denied %q), want %q", name, out.Spec.SchedulerName, denied, want)
		}
	}
}
