package admission

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	"gomodules.xyz/jsonpatch/v2"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/gpufrac/gpufrac/pkg/manifest"
)

// Paths the webhook server serves; deploy/webhook names them.
const (
	ValidatePath = "/validate"
	MutatePath   = "/mutate"
)

// Validator is the validating webhook: pods (create and update), the pod
// templates of workloads, and the ResourceClaims (and templates) that ask
// gpufrac's DRA driver for a share.
type Validator struct {
	Identity Identity
	// Guard reviews a new claim of gpufrac's driver against the charges
	// of the pods that name it; nil: not reviewed (quota off).
	Guard *ClaimGuard
}

var _ admission.Handler = (*Validator)(nil)

// Handle reviews one admission request.
func (v *Validator) Handle(ctx context.Context, req admission.Request) admission.Response {
	logger := klog.FromContext(ctx).WithValues("kind", req.Kind.Kind, "namespace", req.Namespace, "name", req.Name,
		"operation", req.Operation, "user", req.UserInfo.Username)
	op := Operation(req.Operation)
	if op != Create && op != Update {
		return admission.Allowed("")
	}
	var err error
	var warnings []string
	switch {
	case req.Kind.Group == "" && req.Kind.Kind == "Pod":
		var pod, old *corev1.Pod
		if pod, err = decodePod(req.Object.Raw); err != nil {
			return admission.Errored(http.StatusBadRequest, err)
		}
		if op == Update {
			if old, err = decodePod(req.OldObject.Raw); err != nil {
				return admission.Errored(http.StatusBadRequest, err)
			}
		}
		switch req.SubResource {
		case "ephemeralcontainers":
			err = v.Identity.ReviewEphemeral(old, pod)
		case "status":
			if err = v.Identity.ReviewPhase(req.UserInfo.Username, req.UserInfo.Groups, old, pod); err == nil {
				warnings, err = v.Identity.ReviewPod(op, req.UserInfo.Username, old, pod)
			}
		default:
			warnings, err = v.Identity.ReviewPod(op, req.UserInfo.Username, old, pod)
		}
	case req.Kind.Group == "" && req.Kind.Kind == "Binding":
		var b corev1.Binding
		if err := json.Unmarshal(req.Object.Raw, &b); err != nil {
			return admission.Errored(http.StatusBadRequest, fmt.Errorf("decode binding: %w", err))
		}
		err = v.Identity.ReviewBinding(req.UserInfo.Username, b.Annotations)
	case req.Kind.Group == "resource.k8s.io" && req.Kind.Kind == "ResourceClaim":
		var c resourceapi.ResourceClaim
		if err := json.Unmarshal(req.Object.Raw, &c); err != nil {
			return admission.Errored(http.StatusBadRequest, fmt.Errorf("decode ResourceClaim: %w", err))
		}
		if err = manifest.ValidateClaim(c.Spec, "spec"); err == nil && v.Guard != nil {
			if c.Namespace == "" {
				c.Namespace = req.Namespace
			}
			err = v.Guard.Review(ctx, &c)
		}
	case req.Kind.Group == "resource.k8s.io" && req.Kind.Kind == "ResourceClaimTemplate":
		var c resourceapi.ResourceClaimTemplate
		if err := json.Unmarshal(req.Object.Raw, &c); err != nil {
			return admission.Errored(http.StatusBadRequest, fmt.Errorf("decode ResourceClaimTemplate: %w", err))
		}
		err = manifest.ValidateClaim(c.Spec.Spec, "spec.spec")
	default:
		warnings, err = v.Identity.ReviewWorkload(req.Kind.Kind, req.Object.Raw)
	}
	if err != nil {
		logger.V(2).Info("Denied", "reason", err.Error())
		return admission.Denied(err.Error()).WithWarnings(warnings...)
	}
	return admission.Allowed("").WithWarnings(warnings...)
}

// Mutator is the mutating webhook for pod creation: it writes the
// canonical keys and the selection label, optionally sends fractional
// pods to gpufrac's scheduler, and charges every pod that asks for a
// share (annotations or claims) its GPU memory (api.ResourceGPUMemory).
type Mutator struct {
	// SchedulerName, when set, becomes the schedulerName of fractional pods
	// that did not choose a scheduler.
	SchedulerName string
	// Charger sizes the pod's GPU memory charge.
	Charger Charger
	// AllowRootMPSClients is the node agents' --allow-root-mps-clients:
	// a pod holding a share may then gain privileges and share its
	// process namespace (clientPatches).
	AllowRootMPSClients bool
}

var _ admission.Handler = (*Mutator)(nil)

// Handle mutates one pod creation.
func (m *Mutator) Handle(ctx context.Context, req admission.Request) admission.Response {
	if req.Operation != admissionv1.Create || req.Kind.Group != "" || req.Kind.Kind != "Pod" {
		return admission.Allowed("")
	}
	pod, err := decodePod(req.Object.Raw)
	if err != nil {
		return admission.Errored(http.StatusBadRequest, err)
	}
	if pod.Namespace == "" {
		pod.Namespace = req.Namespace // not set on the object when the request's URL names it
	}
	// Patch only what changes: re-encoding the whole pod could rewrite
	// fields this webhook knows nothing about.
	var patches []jsonpatch.JsonPatchOperation
	annotations, labels, fractional := Normalise(pod)
	if fractional {
		patches = append(patches,
			jsonpatch.JsonPatchOperation{Operation: "add", Path: "/metadata/annotations", Value: annotations},
			jsonpatch.JsonPatchOperation{Operation: "add", Path: "/metadata/labels", Value: labels})
	}
	mib, charged, err := m.Charger.Charge(ctx, pod)
	if err != nil {
		return admission.Denied(err.Error())
	}
	if charged {
		patches = append(patches, chargePatches(pod, mib)...)
	} else {
		patches = append(patches, stripCharge(pod)...)
	}
	if fractional || mib > 0 {
		client, err := clientPatches(pod, m.AllowRootMPSClients)
		if err != nil {
			return admission.Denied(err.Error())
		}
		patches = append(patches, client...)
	}
	// A pod with a share, by annotations or by claims of gpufrac's driver
	// (a charge above 0 without a fraction), goes to gpufrac's scheduler,
	// whose one ledger books both.
	if m.SchedulerName != "" && (fractional || mib > 0) && (pod.Spec.SchedulerName == "" || pod.Spec.SchedulerName == corev1.DefaultSchedulerName) {
		patches = append(patches, jsonpatch.JsonPatchOperation{Operation: "add", Path: "/spec/schedulerName", Value: m.SchedulerName})
	}
	if len(patches) == 0 {
		return admission.Allowed("")
	}
	return admission.Patched("normalised GPU-fraction annotations; charged GPU memory to quota", patches...)
}

func decodePod(raw []byte) (*corev1.Pod, error) {
	var pod corev1.Pod
	if err := json.Unmarshal(raw, &pod); err != nil {
		return nil, fmt.Errorf("cannot read the pod: %w", err)
	}
	return &pod, nil
}
