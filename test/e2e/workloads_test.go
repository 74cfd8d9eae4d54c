package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpufrac/gpufrac/internal/localcluster"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/audit"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

// podTemplate is a fractional pod's template for a workload's controller
// (kube-controller-manager, started by gpufrac up).
func podTemplate(app string, annotations map[string]string, restart corev1.RestartPolicy) corev1.PodTemplateSpec {
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": app}, Annotations: annotations},
		Spec: corev1.PodSpec{SchedulerName: "gpufrac", RestartPolicy: restart,
			Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
	}
}

// placed waits until the pods of namespace ns that match selector are want
// in number (none terminating), each bound with its decision and in
// phase, and returns them; then the audit must be clean (no GPU
// over-committed, no mixed modes, no stray reservation pod).
func placed(t *testing.T, c *localcluster.Cluster, ns, selector string, want int, phase corev1.PodPhase) []corev1.Pod {
	t.Helper()
	ctx := context.Background()
	var got []corev1.Pod
	var why string
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return false, err
		}
		got = list.Items
		if len(got) != want {
			why = fmt.Sprintf("%d pods, want %d", len(got), want)
			return false, nil
		}
		for _, p := range got {
			a, err := api.ParseAssignments(p.Annotations)
			switch {
			case p.DeletionTimestamp != nil:
				why = p.Name + " is terminating"
			case p.Spec.NodeName == "" || err != nil || len(a) != 1 || len(a[0].Devices) != 1:
				why = fmt.Sprintf("%s: node %q, decision %v, %v", p.Name, p.Spec.NodeName, a, err)
			case p.Status.Phase != phase:
				why = fmt.Sprintf("%s is %s, want %s", p.Name, p.Status.Phase, phase)
			default:
				continue
			}
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%s in %s: %s: %v", selector, ns, why, err)
	}
	auditClean(t, c)
	return got
}

// auditClean waits for the audit to be clean (the scheduler collects a
// reservation pod a moment after its last tenant goes) and fails with
// what it says if it does not become so.
func auditClean(t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		nodes, pods := snapshot(t, c)
		return len(audit.Check(nodes.Items, pods.Items, nil, audit.Options{Now: time.Now()})) == 0, nil
	})
	if err != nil {
		checkAudit(t, c)
	}
}

// reservationsMatchTenants waits until every GPU group live pods still
// use has its one reservation pod, and no group has two: what a workload's
// deletion leaves. The other reservation pods are idle ones, kept for the
// next shares (the scheduler deletes them for whole-GPU pods).
func reservationsMatchTenants(t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	var used, held map[string]int
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		_, pods := snapshot(t, c)
		used, held = map[string]int{}, map[string]int{}
		for _, p := range pods.Items {
			if p.Namespace == scheduler.DefaultReservationNamespace {
				held[p.Labels[api.GPUGroupLabel]]++
				continue
			}
			if p.Spec.NodeName == "" || p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
				continue
			}
			for _, g := range api.SplitList(p.Annotations[api.GPUGroupsAnnotation]) {
				used[g] = 1
			}
		}
		for g := range used {
			if held[g] != 1 {
				return false, nil
			}
		}
		for _, n := range held {
			if n != 1 {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("reservation pods by GPU group %v, want one for each group live pods use %v, and none twice", held, used)
	}
}

// leastPrivilege checks kube-controller-manager's own identity: it may
// watch, and mint its controllers' tokens in kube-system, and do nothing
// of what they do themselves (each acts as its own service account).
func leastPrivilege(t *testing.T, dir string) {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(dir, "controller-manager.kubeconfig"))
	if err != nil {
		t.Fatal(err)
	}
	kcm, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		attrs authorizationv1.ResourceAttributes
		want  bool
	}{
		{authorizationv1.ResourceAttributes{Namespace: "kube-system", Verb: "create", Resource: "serviceaccounts", Subresource: "token"}, true},
		{authorizationv1.ResourceAttributes{Namespace: "default", Verb: "watch", Resource: "pods"}, true},
		// Its informers, the garbage collector's over every resource
		// included, list what they watch: Secrets too (as upstream's
		// role allows), but it may not read one by name or change one.
		{authorizationv1.ResourceAttributes{Namespace: "kube-system", Verb: "list", Resource: "secrets"}, true},
		{authorizationv1.ResourceAttributes{Namespace: "default", Verb: "create", Resource: "serviceaccounts", Subresource: "token"}, false},
		{authorizationv1.ResourceAttributes{Namespace: "default", Verb: "create", Resource: "pods"}, false},
		{authorizationv1.ResourceAttributes{Namespace: "default", Verb: "delete", Resource: "pods"}, false},
		{authorizationv1.ResourceAttributes{Namespace: "default", Verb: "update", Group: "apps", Resource: "deployments", Subresource: "status"}, false},
		{authorizationv1.ResourceAttributes{Namespace: "kube-system", Verb: "get", Resource: "secrets"}, false},
		{authorizationv1.ResourceAttributes{Namespace: "kube-system", Verb: "create", Resource: "secrets"}, false},
		{authorizationv1.ResourceAttributes{Namespace: "kube-system", Verb: "create", Group: "coordination.k8s.io", Resource: "leases"}, false},
	} {
		review := &authorizationv1.SelfSubjectAccessReview{Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &tc.attrs}}
		got, err := kcm.AuthorizationV1().SelfSubjectAccessReviews().Create(context.Background(), review, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Status.Allowed != tc.want {
			t.Errorf("kube-controller-manager's own identity: %s %s/%s in %q allowed %v, want %v",
				tc.attrs.Verb, tc.attrs.Resource, tc.attrs.Subresource, tc.attrs.Namespace, got.Status.Allowed, tc.want)
		}
	}
}

// workloads runs what users apply first through kube-controller-manager:
// a Deployment of fractional replicas scaled 20 → 40 → 5, a Job of 10
// completions, a pod whose claim comes from a ResourceClaimTemplate, a
// StatefulSet and a DaemonSet; deleting them frees every MiB they held.
func workloads(t *testing.T, c *localcluster.Cluster, dir string) {
	ctx := context.Background()
	leastPrivilege(t, dir)
	allocated := func() int64 {
		nodes, pods := snapshot(t, c)
		return clusterview.Build(nodes.Items, pods.Items, nil).Summary.AllocatedMiB
	}
	before := allocated()
	const ns = "apps"
	if _, err := c.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deploy := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "inference"},
		Spec: appsv1.DeploymentSpec{
			Replicas: new(int32(20)),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "inference"}},
			Template: podTemplate("inference", map[string]string{api.KeyFraction: "0.25"}, corev1.RestartPolicyAlways),
		},
	}
	if _, err := c.Admin.AppsV1().Deployments(ns).Create(ctx, deploy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	placed(t, c, ns, "app=inference", 20, corev1.PodRunning)
	// A budget over the replicas gets its status (the disruption
	// controller), so evictions under it are judged, not refused outright.
	pdb := &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "inference"},
		Spec: policyv1.PodDisruptionBudgetSpec{MinAvailable: new(intstr.FromInt32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "inference"}}},
	}
	if _, err := c.Admin.PolicyV1().PodDisruptionBudgets(ns).Create(ctx, pdb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		got, err := c.Admin.PolicyV1().PodDisruptionBudgets(ns).Get(ctx, "inference", metav1.GetOptions{})
		return err == nil && got.Status.ExpectedPods == 20 && got.Status.DisruptionsAllowed == 19, err
	})
	if err != nil {
		t.Fatalf("the PodDisruptionBudget got no status: %v", err)
	}
	for _, n := range []int32{40, 5} {
		scale := &autoscalingv1.Scale{ObjectMeta: metav1.ObjectMeta{Name: "inference", Namespace: ns}, Spec: autoscalingv1.ScaleSpec{Replicas: n}}
		if _, err := c.Admin.AppsV1().Deployments(ns).UpdateScale(ctx, "inference", scale, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		pods := placed(t, c, ns, "app=inference", int(n), corev1.PodRunning)
		// The shares of a 0.25 replica: four to a GPU at most.
		perGPU := map[string]int{}
		for _, p := range pods {
			a, _ := api.ParseAssignments(p.Annotations)
			perGPU[p.Spec.NodeName+"/"+a[0].Devices[0]]++
		}
		for gpu, k := range perGPU {
			if k > 4 {
				t.Errorf("%d replicas of a 0.25 fraction on %s", k, gpu)
			}
		}
	}

	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: "train"},
		Spec: batchv1.JobSpec{
			Completions: new(int32(10)), Parallelism: new(int32(4)),
			Template: podTemplate("train", map[string]string{api.KeyMemory: "16384"}, corev1.RestartPolicyNever),
		},
	}
	if _, err := c.Admin.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		j, err := c.Admin.BatchV1().Jobs(ns).Get(ctx, "train", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, cond := range j.Status.Conditions {
			if cond.Type == batchv1.JobComplete && cond.Status == corev1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("the Job did not complete: %v", err)
	}
	// Every completion ran on a GPU share of its own decision; done, it
	// holds none.
	placed(t, c, ns, "app=train", 10, corev1.PodSucceeded)

	// A claim template becomes a claim for the pod that names it
	// (kube-controller-manager's resourceclaim controller); no scheduler
	// places the pod.
	tmpl := &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "one-gpu"},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: "gpu.example.com"}}},
		}}},
	}
	if _, err := c.Admin.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	claimer := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "claimer"},
		Spec: corev1.PodSpec{SchedulerName: "none",
			ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: new("one-gpu")}},
			Containers:     []corev1.Container{{Name: "main", Image: "cuda", Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}}}},
	}
	if _, err := c.Admin.CoreV1().Pods(ns).Create(ctx, claimer, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.Admin.CoreV1().Pods(ns).Get(ctx, "claimer", metav1.GetOptions{})
		if err != nil || len(p.Status.ResourceClaimStatuses) != 1 || p.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
			return false, err
		}
		claim, err := c.Admin.ResourceV1().ResourceClaims(ns).Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // the status may name it a moment before a read sees it
		}
		return len(claim.OwnerReferences) == 1 && claim.OwnerReferences[0].UID == p.UID, nil
	})
	if err != nil {
		t.Fatalf("no claim made from the template for the pod: %v", err)
	}

	// Deleting the Deployment deletes its ReplicaSet and pods (garbage
	// collector); their GPUs and reservation pods are freed. Deleting the
	// namespace deletes the rest (namespace controller).
	if err := c.Admin.AppsV1().Deployments(ns).Delete(ctx, "inference", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	placed(t, c, ns, "app=inference", 0, corev1.PodRunning)
	reservationsMatchTenants(t, c)
	// Every GPU memory MiB the workloads held is free again (the Job's
	// Succeeded pods and the unplaced claimer hold none).
	if after := allocated(); after != before {
		t.Errorf("GPU memory allocated %d MiB after deleting the Deployment, %d MiB before it", after, before)
	}

	// A StatefulSet's replicas come one after another (each waits for the
	// one before to be Ready); a DaemonSet puts one pod on every GPU node.
	sts := &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: "shard"},
		Spec: appsv1.StatefulSetSpec{
			Replicas: new(int32(3)),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "shard"}},
			Template: podTemplate("shard", map[string]string{api.KeyMemory: "8192"}, corev1.RestartPolicyAlways),
		},
	}
	if _, err := c.Admin.AppsV1().StatefulSets(ns).Create(ctx, sts, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	placed(t, c, ns, "app=shard", 3, corev1.PodRunning)
	nodes, _ := snapshot(t, c)
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "probe"},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "probe"}},
			Template: podTemplate("probe", map[string]string{api.KeyFraction: "0.05"}, corev1.RestartPolicyAlways),
		},
	}
	ds.Spec.Template.Spec.NodeSelector = map[string]string{"gpufrac.io/simulated": "true"}
	if _, err := c.Admin.AppsV1().DaemonSets(ns).Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	perNode := map[string]int{}
	for _, p := range placed(t, c, ns, "app=probe", len(nodes.Items), corev1.PodRunning) {
		perNode[p.Spec.NodeName]++
	}
	if len(perNode) != len(nodes.Items) {
		t.Errorf("the DaemonSet's pods are on %d of %d nodes: %v", len(perNode), len(nodes.Items), perNode)
	}

	if err := c.Admin.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.Admin.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
	if err != nil {
		t.Fatalf("namespace %s was not deleted: %v", ns, err)
	}
	reservationsMatchTenants(t, c)
	auditClean(t, c)
	if after := allocated(); after != before {
		t.Errorf("GPU memory allocated %d MiB after deleting the namespace, %d MiB before its workloads", after, before)
	}
}
