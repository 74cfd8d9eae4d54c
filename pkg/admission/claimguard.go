package admission

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// A pod is charged for its claims when it is created (Charger): a claim
// that does not exist yet, or one of another driver, is charged nothing.
// The claim its pod names can then be made, or replaced, as one of
// gpufrac's: gpufrac's scheduler refuses such a pod, but any other
// scheduler with DRA (kube-scheduler's DynamicResources) would allocate it
// from gpufrac's published slices, and the node would run a share no
// quota counted. So the claim itself is refused while a pod that names it
// holds less charge than its claims would then hold.

// PodSource lists a namespace's pods.
type PodSource interface {
	Pods(ctx context.Context, namespace string) ([]corev1.Pod, error)
}

// Pods implements PodSource; it needs list on pods (every namespace,
// read-only: deploy/webhook/server.yaml).
func (a APIClaims) Pods(ctx context.Context, namespace string) ([]corev1.Pod, error) {
	list, err := a.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list the pods of namespace %s to check what they were charged: %w", namespace, err)
	}
	return list.Items, nil
}

// ClaimGuard reviews the creation of a claim of gpufrac's driver against
// the charges of the pods that name it.
type ClaimGuard struct {
	Claims ClaimSource
	Pods   PodSource
}

// podClaimNameAnnotation is what the resource claim controller writes on a
// claim it makes from a pod's template: the pod's name for the claim
// (k8s.io/dynamic-resource-allocation/resourceclaim).
const podClaimNameAnnotation = "resource.kubernetes.io/pod-claim-name"

// Review refuses claim (being created in its namespace) when a pod that
// names it, by name or as the claim made from its template, was charged
// less than its claims of gpufrac's driver would hold with it.
func (g ClaimGuard) Review(ctx context.Context, claim *resourceapi.ResourceClaim) error {
	classLimit := func(class string) (int64, error) { return g.Claims.ClassLimitMiB(ctx, class) }
	mib, err := api.ClaimChargeMiB(claim.Spec, classLimit)
	if err != nil || mib == 0 {
		return err // refused by the claim's own validation, or no share of gpufrac's
	}
	pods, err := g.Pods.Pods(ctx, claim.Namespace)
	if err != nil {
		return err
	}
	for i := range pods {
		p := &pods[i]
		entry, ok := namingEntry(p, claim)
		if !ok || api.PodEnded(p) || p.DeletionTimestamp != nil {
			continue
		}
		lookup := func(pc corev1.PodResourceClaim) (*resourceapi.ResourceClaimSpec, bool, error) {
			switch {
			case pc.Name == entry:
				return &claim.Spec, true, nil
			case pc.ResourceClaimName != nil:
				return g.Claims.ClaimSpec(ctx, p.Namespace, *pc.ResourceClaimName, false)
			case pc.ResourceClaimTemplateName != nil:
				return g.Claims.ClaimSpec(ctx, p.Namespace, *pc.ResourceClaimTemplateName, true)
			}
			return nil, false, nil
		}
		u, err := api.ClaimsUsage(p, lookup, classLimit)
		if err != nil {
			return err
		}
		// Only the claims: the pod's annotation share, if any, is
		// gpufrac's scheduler's to check against the rest of its charge.
		if charged, _ := api.ChargedMiB(&p.Spec); u.ClaimsMiB > charged {
			return api.ErrorList{{Key: "resourceclaim " + claim.Name, Value: api.FormatMiB(mib),
				Rule: fmt.Sprintf("cannot be created now: pod %s names it and was charged %s of %s when it was created, less than its claims of %s would hold (%s); create the claim first, then the pod",
					p.Name, api.FormatMiB(charged), api.ResourceGPUMemory, api.DRADriver, api.FormatMiB(u.ClaimsMiB))}}
		}
	}
	return nil
}

// namingEntry is the name of the pod's entry (spec.resourceClaims) that
// claim is: the claim by name, or the claim the controller makes from the
// entry's template (its owner is the pod, and it says which entry).
func namingEntry(p *corev1.Pod, claim *resourceapi.ResourceClaim) (string, bool) {
	for _, pc := range p.Spec.ResourceClaims {
		if pc.ResourceClaimName != nil && *pc.ResourceClaimName == claim.Name {
			return pc.Name, true
		}
	}
	for _, o := range claim.OwnerReferences {
		if o.Kind == "Pod" && o.UID == p.UID {
			if name := claim.Annotations[podClaimNameAnnotation]; name != "" {
				return name, true
			}
			// Without the annotation: the claim is named <pod>-<entry>-<suffix>.
			for _, pc := range p.Spec.ResourceClaims {
				if strings.HasPrefix(claim.Name, p.Name+"-"+pc.Name+"-") || claim.GenerateName == p.Name+"-"+pc.Name+"-" {
					return pc.Name, true
				}
			}
		}
	}
	return "", false
}
