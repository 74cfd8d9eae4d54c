package localcluster

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/manifest"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// Demo applies the Pods of the examples directory, waits until the
// scheduler has placed them and their (fake) kubelet runs them, prints the cluster view, and shows the
// webhook refusing an invalid pod. Kinds that need a controller (a
// Deployment) are listed, not applied: no controller-manager runs here.
func (c *Cluster) Demo(ctx context.Context, examples string, out io.Writer) error {
	files, err := filepath.Glob(filepath.Join(examples, "*.yaml"))
	if err != nil {
		return err
	}
	slices.Sort(files)
	var created []string
	for _, f := range files {
		raw, err := os.Open(f)
		if err != nil {
			return err
		}
		objects, err := manifest.Decode(raw, f)
		_ = raw.Close()
		if err != nil {
			return err
		}
		for _, o := range objects {
			if o.Kind != "Pod" || o.Template == nil {
				fmt.Fprintf(out, "  skipped %s %s (%s): no controller-manager runs in a local cluster\n", o.Kind, o.Name, filepath.Base(f))
				continue
			}
			pod := &corev1.Pod{ObjectMeta: o.Template.ObjectMeta, Spec: o.Template.Spec}
			pod.Name, pod.Namespace = o.Name, "default"
			if _, err := c.Admin.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("%s: create pod %s: %w", filepath.Base(f), o.Name, err)
			}
			created = append(created, o.Name)
		}
	}
	fmt.Fprintf(out, "  applied %d pods from %s; waiting for the scheduler to place them …\n", len(created), examples)
	var placed, running int
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		placed, running = 0, 0
		for _, name := range created {
			p, err := c.Admin.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if p.Spec.NodeName != "" {
				placed++
			}
			if p.Status.Phase == corev1.PodRunning {
				running++
			}
		}
		return running == len(created), nil
	})
	if err != nil {
		return fmt.Errorf("%d of %d example pods placed, %d Running: %w (kubectl --kubeconfig %s describe pods)",
			placed, len(created), running, err, c.Kubeconfig)
	}
	nodes, err := c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	pods, err := c.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\n  every pod placed and Running; the cluster as `gpufrac top` shows it:\n\n")
	if err := clusterview.Render(out, clusterview.Build(nodes.Items, pods.Items, scheduler.DefaultReservationNamespace, nil)); err != nil {
		return err
	}
	bad := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "too-much", Namespace: "default", Annotations: map[string]string{api.KeyFraction: "1.5"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
	}
	_, err = c.Admin.CoreV1().Pods("default").Create(ctx, bad, metav1.CreateOptions{})
	if err == nil {
		return fmt.Errorf("the webhook admitted a pod asking for gpu-fraction 1.5")
	}
	fmt.Fprintf(out, "\n  an invalid pod (gpu-fraction: \"1.5\") is refused at the API:\n    %s\n", strings.TrimSpace(err.Error()))
	return nil
}
