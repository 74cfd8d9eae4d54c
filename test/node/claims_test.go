//go:build nodee2e || charte2e

package node

import (
	"context"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

// Claims of gpufrac's DRA driver, for the node's tests and the chart's.

// shareClaim is a claim of one share of gpufrac's driver: memory (and, in
// the sm-sharing class, compute percent), with a hard limit in its
// opaque config.
func shareClaim(t *testing.T, name, class, memory, compute, limit string) *resourceapi.ResourceClaim {
	t.Helper()
	req := map[resourceapi.QualifiedName]resource.Quantity{api.DRACapacityMemory: resource.MustParse(memory)}
	if compute != "" {
		req[api.DRACapacityCompute] = resource.MustParse(compute)
	}
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: class, Capacity: &resourceapi.CapacityRequirements{Requests: req}}}}
	c.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{
		Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: api.DRADriver, Parameters: runtime.RawExtension{
			Raw: []byte(`{"apiVersion":"` + api.ShareConfigAPIVersion + `","kind":"` + api.ShareConfigKind + `","memoryLimit":"` + limit + `"}`)}},
	}}}
	created, err := theNode.admin.ResourceV1().ResourceClaims(ns).Create(context.Background(), c, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		err := theNode.admin.ResourceV1().ResourceClaims(ns).Delete(context.Background(), name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete claim %s: %v", name, err)
		}
	})
	return created
}

// claimPod creates a probe pod whose container "main" uses the claim.
func claimPod(t *testing.T, name, claim string) {
	t.Helper()
	c := probe("main", nil)
	c.Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	off := false
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{SchedulerName: "gpufrac", RestartPolicy: corev1.RestartPolicyNever, Containers: []corev1.Container{c},
			ResourceClaims:               []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}},
			AutomountServiceAccountToken: &off, EnableServiceLinks: &off, TerminationGracePeriodSeconds: new(int64(2)),
			SecurityContext: tenantUser()},
	}
	if _, err := theNode.admin.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deletePod(t, name) })
}

// claimShare is the one share a claim was allocated, as both front doors
// read it, for container main.
func claimShare(t *testing.T, name string) (api.Assignment, types.UID) {
	t.Helper()
	c, err := theNode.admin.ResourceV1().ResourceClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	shares, err := api.ClaimShares(c)
	if err != nil || len(shares) != 1 {
		t.Fatalf("claim %s: shares %+v, %v; want one", name, shares, err)
	}
	a := shares[0].Assignment
	a.Container = "main"
	// A device name carries the UUID lower-cased (DNS label); the node
	// enforces the GPU as NVML names it.
	i := slices.IndexFunc(theNode.gpus, func(g inventory.GPU) bool { return strings.EqualFold(g.UUID, a.Devices[0]) })
	if i < 0 {
		t.Fatalf("claim %s: its device names GPU %s, which the node does not have", name, a.Devices[0])
	}
	a.Devices = []string{theNode.gpus[i].UUID}
	return a, c.UID
}
