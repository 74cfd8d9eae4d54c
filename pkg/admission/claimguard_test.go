package admission

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/gpufrac/gpufrac/pkg/api"
)

type pods []corev1.Pod

func (p pods) Pods(context.Context, string) ([]corev1.Pod, error) { return p, nil }

// Issue 53: a claim of gpufrac's made (or swapped in) after a pod that
// names it was charged is refused while that pod's charge does not cover
// it, whatever scheduler the pod has; a pod charged enough, an ended one,
// or a claim of another driver passes.
func TestClaimGuard(t *testing.T) {
	naming := func(name, claim, charge string, edit func(*corev1.Pod)) corev1.Pod {
		p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name)},
			Spec: corev1.PodSpec{SchedulerName: "default-scheduler", Containers: []corev1.Container{{Name: "main"}},
				ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To(claim)}}}}
		if charge != "" {
			p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{api.ResourceGPUMemory: resource.MustParse(charge)}
		}
		if edit != nil {
			edit(&p)
		}
		return p
	}
	claim := func(name string, spec resourceapi.ResourceClaimSpec) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"}, Spec: spec}
	}
	g := ClaimGuard{Claims: claims{specs: map[string]resourceapi.ResourceClaimSpec{}}}
	for _, c := range []struct {
		name  string
		pods  pods
		claim *resourceapi.ResourceClaim
		want  string
	}{
		{"made after an uncharged pod", pods{naming("early", "later", "", nil)}, claim("later", share(api.DRAClassTimeSlicing, "8Gi", "")),
			`resourceclaim later "8Gi" cannot be created now: pod early names it and was charged 0 of gpufrac.io/gpu-memory when it was created, less than its claims of gpu.gpufrac.io would hold (8Gi)`},
		{"its limit counts", pods{naming("p", "c", "8Gi", nil)}, claim("c", share(api.DRAClassTimeSlicing, "8Gi", "16Gi")), "would hold (16Gi)"},
		{"charged enough", pods{naming("p", "c", "8Gi", nil)}, claim("c", share(api.DRAClassTimeSlicing, "8Gi", "")), ""},
		{"an ended pod", pods{naming("p", "c", "", func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded })}, claim("c", share(api.DRAClassTimeSlicing, "8Gi", "")), ""},
		{"another pod's claim", pods{naming("p", "other", "", nil)}, claim("c", share(api.DRAClassTimeSlicing, "8Gi", "")), ""},
		{"another driver's claim", pods{naming("p", "c", "", nil)}, claim("c", share("gpu.example.com", "8Gi", "")), ""},
	} {
		g.Pods = c.pods
		err := g.Review(context.Background(), c.claim)
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	// The claim the controller makes from a pod's template: its owner pod.
	owner := naming("trainer", "", "", func(p *corev1.Pod) {
		p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")}}
	})
	made := claim("trainer-gpu-x7k2p", share(api.DRAClassTimeSlicing, "20Gi", ""))
	made.OwnerReferences = []metav1.OwnerReference{{Kind: "Pod", Name: "trainer", UID: owner.UID}}
	made.Annotations = map[string]string{"resource.kubernetes.io/pod-claim-name": "gpu"}
	g.Pods = pods{owner}
	if err := g.Review(context.Background(), made); err == nil || !strings.Contains(err.Error(), "pod trainer names it and was charged 0") {
		t.Errorf("a template's claim swapped after its pod: %v", err)
	}
}
