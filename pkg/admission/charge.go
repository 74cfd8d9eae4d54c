package admission

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"gomodules.xyz/jsonpatch/v2"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Charger sizes what a pod is charged to its namespace's GPU memory quota
// (api.ResourceGPUMemory): its annotation share and its claims of
// gpufrac's driver, counted together. ResourceQuota's admission runs after
// the mutating webhooks, so the charge it counts is this one.
type Charger struct {
	// LargestGPUMiB is the memory of the largest GPU any node reports
	// (0: none yet); a share of a GPU is charged as on it.
	LargestGPUMiB func() int64
	// Claims reads the claims, templates and classes a pod names; nil:
	// claims are charged nothing (tests of annotation pods only).
	Claims ClaimSource
	// Off charges nothing (--gpu-memory-quota=false): quota then does not
	// bound GPU memory, as the flag says.
	Off bool
}

// ClaimSource reads what a pod's claims ask for.
type ClaimSource interface {
	// ClaimSpec is the spec of a claim (template: false) or of the claim a
	// template makes (template: true); found is false when there is none.
	ClaimSpec(ctx context.Context, namespace, name string, template bool) (spec *resourceapi.ResourceClaimSpec, found bool, err error)
	// ClassLimitMiB is the memory limit a DeviceClass's ShareConfig gives.
	ClassLimitMiB(ctx context.Context, class string) (int64, error)
}

// Charge is the pod's charge in MiB; charged is false for a pod that
// asks for no share and names no claim (nothing to write). A claim that
// does not exist yet is charged nothing: the scheduler never places a pod
// whose shares are more than its charge, so such a pod, if the claim turns
// out to be gpufrac's, stays pending with a reason instead of running
// uncharged. Errors are the API's (fail closed) or a share that cannot be
// sized.
func (c Charger) Charge(ctx context.Context, pod *corev1.Pod) (mib int64, charged bool, err error) {
	if c.Off {
		return 0, false, nil
	}
	largest := int64(0)
	if c.LargestGPUMiB != nil {
		largest = c.LargestGPUMiB()
	}
	var claims api.ClaimLookup
	if c.Claims != nil {
		claims = func(pc corev1.PodResourceClaim) (*resourceapi.ResourceClaimSpec, bool, error) {
			switch {
			case pc.ResourceClaimName != nil:
				return c.Claims.ClaimSpec(ctx, pod.Namespace, *pc.ResourceClaimName, false)
			case pc.ResourceClaimTemplateName != nil:
				return c.Claims.ClaimSpec(ctx, pod.Namespace, *pc.ResourceClaimTemplateName, true)
			}
			return nil, false, nil // not asked: ClaimsUsage skips such a claim
		}
	}
	u, err := api.PodUsage(pod, largest, claims, func(class string) (int64, error) { return c.Claims.ClassLimitMiB(ctx, class) })
	if err != nil {
		return 0, false, err
	}
	return u.MiB(), u.Charged, nil
}

// chargePatches writes mib as the pod's only charge: on the container
// that holds its share (the annotated one, or the first to use a claim,
// or the first), as request and limit (an extended resource's must be
// equal), and off every other container, so that what quota counts is
// exactly what the webhook sized and never what the pod's author wrote.
// mib below 0 writes none: every charge comes off.
func chargePatches(pod *corev1.Pod, mib int64) []jsonpatch.JsonPatchOperation {
	target := chargedContainer(pod)
	if mib < 0 {
		target = -1
	}
	name := strings.ReplaceAll(string(api.ResourceGPUMemory), "/", "~1") // JSON pointer: "/" is "~1"
	q := api.ChargeQuantity(mib)
	var patches []jsonpatch.JsonPatchOperation
	set := func(base string, list corev1.ResourceList) {
		if list == nil {
			patches = append(patches, jsonpatch.JsonPatchOperation{Operation: "add", Path: base, Value: map[string]string{string(api.ResourceGPUMemory): q.String()}})
			return
		}
		patches = append(patches, jsonpatch.JsonPatchOperation{Operation: "add", Path: base + "/" + name, Value: q.String()})
	}
	drop := func(base string, list corev1.ResourceList) {
		if api.Charges(list) {
			patches = append(patches, jsonpatch.JsonPatchOperation{Operation: "remove", Path: base + "/" + name})
		}
	}
	for i, c := range pod.Spec.Containers {
		base := "/spec/containers/" + strconv.Itoa(i) + "/resources"
		if i == target {
			set(base+"/requests", c.Resources.Requests)
			set(base+"/limits", c.Resources.Limits)
			continue
		}
		drop(base+"/requests", c.Resources.Requests)
		drop(base+"/limits", c.Resources.Limits)
	}
	for i, c := range pod.Spec.InitContainers {
		base := "/spec/initContainers/" + strconv.Itoa(i) + "/resources"
		drop(base+"/requests", c.Resources.Requests)
		drop(base+"/limits", c.Resources.Limits)
	}
	return patches
}

// chargedContainer is the index of the container a pod's charge is put on.
func chargedContainer(pod *corev1.Pod) int {
	if reqs, err := api.Parse(pod); err == nil && len(reqs) > 0 {
		for i, c := range pod.Spec.Containers {
			if c.Name == reqs[0].Container {
				return i
			}
		}
	}
	for i, c := range pod.Spec.Containers {
		if len(c.Resources.Claims) > 0 {
			return i
		}
	}
	return 0
}

// APIClaims is a ClaimSource on the API server. It needs get on
// resourceclaims and resourceclaimtemplates (every namespace) and on
// deviceclasses: read-only, justified in deploy/webhook/server.yaml.
type APIClaims struct {
	Client kubernetes.Interface
}

// ClaimSpec implements ClaimSource.
func (a APIClaims) ClaimSpec(ctx context.Context, namespace, name string, template bool) (*resourceapi.ResourceClaimSpec, bool, error) {
	if template {
		t, err := a.Client.ResourceV1().ResourceClaimTemplates(namespace).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil, false, nil
		}
		if err != nil {
			return nil, false, fmt.Errorf("read ResourceClaimTemplate %s/%s to charge its GPU memory to quota: %w", namespace, name, err)
		}
		return &t.Spec.Spec, true, nil
	}
	c, err := a.Client.ResourceV1().ResourceClaims(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read ResourceClaim %s/%s to charge its GPU memory to quota: %w", namespace, name, err)
	}
	return &c.Spec, true, nil
}

// ClassLimitMiB implements ClaimSource; a class that does not exist gives
// no limit (the allocator refuses its claims).
func (a APIClaims) ClassLimitMiB(ctx context.Context, class string) (int64, error) {
	c, err := a.Client.ResourceV1().DeviceClasses().Get(ctx, class, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read DeviceClass %s to charge its shares to quota: %w", class, err)
	}
	return api.ClassLimitMiB(c)
}

// NewCharger is a Charger on the API server: the largest GPU from the
// nodes' memory labels (an informer that keeps only nodes' labels; it
// needs list and watch on nodes) and the claims read as pods name them.
// It runs until ctx ends; HasSynced says when the nodes were first read.
func NewCharger(ctx context.Context, client kubernetes.Interface) (c Charger, hasSynced func() bool) {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = api.LabelGPUMemory }))
	nodes := factory.Core().V1().Nodes()
	informer := nodes.Informer()
	// Only the labels are read: keep nothing else of a node in memory.
	_ = informer.SetTransform(func(obj any) (any, error) {
		if n, ok := obj.(*corev1.Node); ok {
			return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: n.Labels, ResourceVersion: n.ResourceVersion}}, nil
		}
		return obj, nil
	})
	lister := nodes.Lister()
	factory.Start(ctx.Done())
	largest := func() int64 {
		all, err := lister.List(labels.Everything())
		if err != nil {
			return 0
		}
		var most int64
		for _, n := range all {
			if v, ok := api.GPUMemoryMiB(n.Labels); ok {
				most = max(most, v)
			}
		}
		return most
	}
	return Charger{LargestGPUMiB: largest, Claims: APIClaims{Client: client}}, informer.HasSynced
}
