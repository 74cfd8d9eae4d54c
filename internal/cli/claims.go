package cli

import (
	"context"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// listClaims lists every ResourceClaim, for the shares gpufrac's DRA
// driver gives beside the annotation shares. A cluster that does not
// serve resource.k8s.io/v1 has none. Any other failure is an error, not
// an empty list: an audit that cannot read the claims could call an
// over-committed GPU clean.
func listClaims(ctx context.Context, client kubernetes.Interface) ([]resourceapi.ResourceClaim, error) {
	list, err := client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list ResourceClaims (DRA shares of the same GPUs; the caller needs list on resourceclaims.resource.k8s.io): %w", err)
	}
	return list.Items, nil
}
