package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// This file is named to sort last: go test runs files in name order, and
// this test stops the shared webhook server (it starts it again when done).

// Runs last (it stops the webhook server): the scope of the configurations
// keeps ordinary pods flowing through an outage, while fractional pods
// fail closed.
func TestZZWebhookOutage(t *testing.T) {
	ctx := context.Background()
	shared.stopWebhook()
	t.Cleanup(func() {
		if err := shared.startWebhook(); err != nil {
			t.Errorf("restart the webhook server: %v", err)
		}
	})
	select {
	case err := <-shared.webhookDone:
		if err != nil {
			t.Fatalf("webhook server stopped with error: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("webhook server did not stop")
	}
	if _, err := shared.alice.CoreV1().Pods("default").Create(ctx, fracPod(nil), metav1.CreateOptions{}); err != nil {
		t.Errorf("plain pod blocked by a webhook outage: %v", err)
	}
	whole := fracPod(nil)
	whole.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: resource.MustParse("2")}
	if _, err := shared.alice.CoreV1().Pods("default").Create(ctx, whole, metav1.CreateOptions{}); err != nil {
		t.Errorf("whole-GPU pod blocked by a webhook outage: %v", err)
	}
	_, err := shared.alice.CoreV1().Pods("default").Create(ctx, fracPod(map[string]string{"gpu-fraction": "0.5"}), metav1.CreateOptions{})
	if err == nil || !strings.Contains(err.Error(), "failed calling webhook") {
		t.Errorf("fractional pod admitted without its webhook (want fail closed): %v", err)
	}
}
