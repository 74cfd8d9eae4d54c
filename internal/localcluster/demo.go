package localcluster

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/audit"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/node/dra"
)

// demoNamespace is where the demo applies the examples that name none.
const demoNamespace = metav1.NamespaceDefault

// Demo applies every object of the examples directory (Pods, and the
// Deployments kube-controller-manager turns into pods), waits until the
// scheduler has placed every pod they ask for and its (fake) kubelet runs
// it, prints the cluster view, and shows the webhook refusing an invalid
// pod.
func (c *Cluster) Demo(ctx context.Context, examples string, out io.Writer) error {
	files, err := filepath.Glob(filepath.Join(examples, "*.yaml"))
	if err != nil {
		return err
	}
	slices.Sort(files)
	cl, err := client.New(c.AdminConfig, client.Options{})
	if err != nil {
		return err
	}
	var created []*unstructured.Unstructured
	for _, f := range files {
		objects, err := readObjects(f)
		if err != nil {
			return err
		}
		if c.opts.DRAStandingGPUs == 0 && slices.ContainsFunc(objects, usesDRA) {
			fmt.Fprintf(out, "  skipped %s: it asks through DRA, which this cluster's node agents do not serve\n", filepath.Base(f))
			continue
		}
		for _, o := range objects {
			namespaced, err := cl.IsObjectNamespaced(o)
			if err != nil {
				return fmt.Errorf("%s: %s %s: %w", filepath.Base(f), o.GetKind(), o.GetName(), err)
			}
			if namespaced && o.GetNamespace() == "" {
				o.SetNamespace(demoNamespace)
			}
			if err := cl.Create(ctx, o); err != nil {
				return fmt.Errorf("%s: create %s %s: %w", filepath.Base(f), o.GetKind(), o.GetName(), err)
			}
			created = append(created, o)
		}
	}
	var kinds []string
	for _, o := range created {
		kinds = append(kinds, o.GetKind()+" "+o.GetName())
	}
	fmt.Fprintf(out, "  applied %d objects from %s (%s); waiting until every pod they ask for is placed and Running …\n",
		len(created), examples, strings.Join(kinds, ", "))
	var notReady string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, o := range created {
			live := o.DeepCopy()
			if err := cl.Get(ctx, client.ObjectKeyFromObject(o), live); err != nil {
				return false, err
			}
			if why := notRunning(live); why != "" {
				notReady = o.GetKind() + " " + o.GetName() + ": " + why
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("%s: %w (kubectl --kubeconfig %s describe pods)", notReady, err, c.Kubeconfig)
	}
	nodes, err := c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	pods, err := c.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	if c.opts.DRAStandingGPUs != 0 {
		if err := c.demoClaimBeside(ctx, out); err != nil {
			return err
		}
		if pods, err = c.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{}); err != nil {
			return err
		}
	}
	claims, err := c.claims(ctx)
	if err != nil {
		return err
	}
	// The agents measure their tenants' use every resync (2 s here): wait
	// a little for a reading of each, so that top's used column is filled.
	for deadline := time.Now().Add(20 * time.Second); !everyTenantMeasured(clusterview.Build(nodes.Items, pods.Items, claims)) && time.Now().Before(deadline); {
		time.Sleep(time.Second)
		if nodes, err = c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "\n  every pod placed and Running; the cluster as `gpufrac top` shows it (use as the simulated GPUs report it):\n\n")
	if err := clusterview.Render(out, clusterview.Build(nodes.Items, pods.Items, claims)); err != nil {
		return err
	}
	if v := audit.Check(nodes.Items, pods.Items, claims, audit.Options{Now: time.Now(), OrphanGrace: time.Minute}); len(v) > 0 {
		return fmt.Errorf("the audit finds %d violation(s), the first: %s", len(v), v[0])
	}
	fmt.Fprintf(out, "\n  `gpufrac audit`, claims included: clean\n")
	bad := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "too-much", Namespace: demoNamespace, Annotations: map[string]string{api.KeyFraction: "1.5"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
	}
	_, err = c.Admin.CoreV1().Pods(demoNamespace).Create(ctx, bad, metav1.CreateOptions{})
	if err == nil {
		return fmt.Errorf("the webhook admitted a pod asking for gpu-fraction 1.5")
	}
	fmt.Fprintf(out, "\n  an invalid pod (gpu-fraction: \"1.5\") is refused at the API:\n    %s\n", strings.TrimSpace(err.Error()))
	return nil
}

// everyTenantMeasured says whether each pod's share has a reading of its
// use (a claim's share has none on a simulated node: no pod asks for it).
func everyTenantMeasured(v clusterview.View) bool {
	for _, n := range v.Nodes {
		for _, g := range n.Shared {
			for _, t := range g.Tenants {
				if !t.Claim && t.Use == nil {
					return false
				}
			}
		}
	}
	return true
}

func (c *Cluster) claims(ctx context.Context) ([]resourceapi.ResourceClaim, error) {
	if c.opts.DRAStandingGPUs == 0 {
		return nil, nil
	}
	list, err := c.Admin.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// besideCandidate finds a time-slicing GPU that an annotated pod shares,
// that the node's DRA driver offers, with at least share MiB free: its
// node, UUID and the pod. When there is none, it says why, GPU by GPU.
func (c *Cluster) besideCandidate(ctx context.Context, share int64) (node, gpu, beside, why string, err error) {
	nodes, err := c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", "", "", "", err
	}
	pods, err := c.Admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", "", "", "", err
	}
	claims, err := c.claims(ctx)
	if err != nil {
		return "", "", "", "", err
	}
	offered, err := OfferedGPUs(ctx, c.Admin)
	if err != nil {
		return "", "", "", "", err
	}
	view := clusterview.Build(nodes.Items, pods.Items, claims)
	var seen []string
	for _, n := range view.Nodes {
		for _, g := range n.Shared {
			pod := ""
			for _, t := range g.Tenants {
				if !t.Claim {
					pod = t.Pod
					break
				}
			}
			switch {
			case pod == "" || g.Mode != api.TimeSlicing:
				continue
			case !strings.HasPrefix(g.UUID, "GPU-") || !offered[n.Name][strings.ToLower(g.UUID)]:
				seen = append(seen, fmt.Sprintf("%s %s: not offered to claims", n.Name, g.UUID))
			case g.FreeMiB < share:
				seen = append(seen, fmt.Sprintf("%s %s: %dMi free", n.Name, g.UUID, g.FreeMiB))
			default:
				return n.Name, g.UUID, pod, "", nil
			}
		}
	}
	if len(seen) == 0 {
		return "", "", "", "no annotated pod shares a time-slicing GPU", nil
	}
	return "", "", "", strings.Join(seen, "; "), nil
}

// demoClaimBeside shows both front doors on one GPU: it finds a
// time-slicing GPU an annotated pod shares, with room left, and asks for
// 4Gi of that very GPU through a ResourceClaim (a CEL selector on the
// device's uuid). The scheduler books the claim on the same ledger as the
// pod, the node offers the allocator only what the pod leaves, and the
// node would enforce both alike.
func (c *Cluster) demoClaimBeside(ctx context.Context, out io.Writer) error {
	const share = 4096
	// What the step needs (an annotated time-slicing pod on a GPU the DRA
	// driver offers, with room) is waited for, not assumed: the slices
	// follow the standing pods' annotations a resync later.
	var node, gpu, beside, why string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		var err error
		node, gpu, beside, why, err = c.besideCandidate(ctx, share)
		return node != "", err
	})
	if node == "" && why != "" {
		return fmt.Errorf("no time-slicing GPU that the DRA driver offers, with an annotated pod and 4Gi free, to show a claim beside it (%s): %w", why, err)
	}
	if node == "" {
		return fmt.Errorf("looking for a GPU to show a claim beside an annotated pod: %w", err)
	}
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "beside", Namespace: demoNamespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: api.DRAClassTimeSlicing,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
					Expression: fmt.Sprintf(`device.attributes[%q].uuid == %q`, api.DRADriver, gpu)}}},
				Capacity: &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{
					api.DRACapacityMemory: *resource.NewQuantity(share<<20, resource.BinarySI)}},
			},
		}}}},
	}
	if _, err := c.Admin.ResourceV1().ResourceClaims(demoNamespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create claim %s: %w", claim.Name, err)
	}
	claimName := claim.Name
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "dra-beside", Namespace: demoNamespace},
		Spec: corev1.PodSpec{
			SchedulerName:  "gpufrac",
			RestartPolicy:  corev1.RestartPolicyNever,
			NodeSelector:   map[string]string{"kubernetes.io/hostname": node},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claimName}},
			Containers: []corev1.Container{{Name: "main", Image: "nvcr.io/nvidia/cuda:13.0.0-base-ubuntu24.04",
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}}},
		},
	}
	if _, err := c.Admin.CoreV1().Pods(demoNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create pod %s: %w", pod.Name, err)
	}
	fmt.Fprintf(out, "\n  a DRA claim beside an annotated pod: claim %s/beside asks for 4Gi of GPU %s on %s, which %s shares …\n", demoNamespace, gpu, node, beside)
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.Admin.CoreV1().Pods(demoNamespace).Get(ctx, pod.Name, metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning, err
	})
	if err != nil {
		return fmt.Errorf("pod %s/%s with the claim is not Running: %w (kubectl --kubeconfig %s describe pod %s)", demoNamespace, pod.Name, err, c.Kubeconfig, pod.Name)
	}
	got, err := c.Admin.ResourceV1().ResourceClaims(demoNamespace).Get(ctx, claimName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	shares, err := api.ClaimShares(got)
	if err != nil {
		return fmt.Errorf("claim %s/%s: %w", demoNamespace, claimName, err)
	}
	if len(shares) != 1 || !strings.EqualFold(shares[0].Assignment.Devices[0], gpu) {
		return fmt.Errorf("claim %s/%s: allocated %v, want a share of GPU %s", demoNamespace, claimName, shares, gpu)
	}
	fmt.Fprintf(out, "  allocated by kube-scheduler's DRA allocator on that GPU (%dMi), Running beside %s\n", shares[0].Assignment.RequestMiB, beside)
	return nil
}

// OfferedGPUs lists, by node, the GPUs (lower-case UUIDs) that a device
// of gpufrac's DRA driver offers claims in the published ResourceSlices.
func OfferedGPUs(ctx context.Context, client kubernetes.Interface) (map[string]map[string]bool, error) {
	list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := map[string]map[string]bool{}
	for _, s := range list.Items {
		if s.Spec.Driver != api.DRADriver || s.Spec.NodeName == nil {
			continue
		}
		for _, d := range s.Spec.Devices {
			if a, ok := d.Attributes[dra.AttrUUID]; ok && a.StringValue != nil {
				if out[*s.Spec.NodeName] == nil {
					out[*s.Spec.NodeName] = map[string]bool{}
				}
				out[*s.Spec.NodeName][strings.ToLower(*a.StringValue)] = true
			}
		}
	}
	return out, nil
}

// usesDRA says whether an object is, or needs, a ResourceClaim.
func usesDRA(o *unstructured.Unstructured) bool {
	switch o.GetKind() {
	case "ResourceClaim", "ResourceClaimTemplate":
		return true
	}
	claims, _, _ := unstructured.NestedSlice(o.Object, "spec", "resourceClaims")
	return len(claims) > 0
}

// readObjects reads the objects of a YAML file, skipping empty documents.
func readObjects(path string) ([]*unstructured.Unstructured, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	var out []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bufio.NewReader(f), 4096)
	for {
		o := &unstructured.Unstructured{}
		if err := dec.Decode(&o.Object); errors.Is(err, io.EOF) {
			return out, nil
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(o.Object) == 0 {
			continue
		}
		if o.GetKind() == "" || o.GetName() == "" {
			return nil, fmt.Errorf("%s: an object without kind or metadata.name", path)
		}
		out = append(out, o)
	}
}

// notRunning says why a workload's pods are not all Running yet ("" once
// they are): a Pod by its phase, a Deployment, ReplicaSet or StatefulSet
// by its ready replicas. Other kinds are not waited for.
func notRunning(o *unstructured.Unstructured) string {
	switch o.GetKind() {
	case "Pod":
		phase, _, _ := unstructured.NestedString(o.Object, "status", "phase")
		if phase != string(corev1.PodRunning) {
			return "phase " + cmp.Or(phase, "unset")
		}
	case "Deployment", "ReplicaSet", "StatefulSet":
		want, found, _ := unstructured.NestedInt64(o.Object, "spec", "replicas")
		if !found {
			want = 1
		}
		ready, _, _ := unstructured.NestedInt64(o.Object, "status", "readyReplicas")
		if ready != want {
			return fmt.Sprintf("%d of %d replicas ready", ready, want)
		}
	}
	return ""
}
