// Package chart renders the Helm chart deploy/helm/gpufrac with the real
// Helm (bin/helm, built by make helm) and checks what it renders: that it
// says what the reference manifests in deploy/ say, that its certificates
// are sound, and that the real kube-apiserver accepts all of it and
// enforces the node agent's bound.
package chart

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"
	schedscheme "k8s.io/kubernetes/pkg/scheduler/apis/config/scheme"
	schedvalidation "k8s.io/kubernetes/pkg/scheduler/apis/config/validation"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/testenv"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/metrics"
	"github.com/gpufrac/gpufrac/pkg/scheduler"
)

const (
	release   = "gpufrac"
	namespace = "gpufrac-system"
)

// render runs helm template on the chart with extra arguments (--set ...)
// and returns the objects, or helm's error output.
func render(t *testing.T, args ...string) ([]*unstructured.Unstructured, error) {
	t.Helper()
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	helm := filepath.Join(root, "bin", "helm")
	if _, err := os.Stat(helm); err != nil {
		t.Fatalf("%s not found: run `make helm` (or `make test`, which builds it)", helm)
	}
	cmd := exec.Command(helm, append([]string{"template", release, filepath.Join(root, "deploy", "helm", "gpufrac"),
		"--namespace", namespace, "--kube-version", "1.37.2"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("helm template: %w: %s", err, stderr.String())
	}
	return decode(t, out), nil
}

func mustRender(t *testing.T, args ...string) []*unstructured.Unstructured {
	t.Helper()
	objs, err := render(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

func decode(t *testing.T, raw []byte) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	for {
		var m map[string]any
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			return objs
		}
		if err != nil {
			t.Fatal(err)
		}
		if m != nil {
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
}

func readManifests(t *testing.T, files ...string) []*unstructured.Unstructured {
	t.Helper()
	root, _ := checkout.Root()
	var objs []*unstructured.Unstructured
	for _, f := range files {
		raw, err := os.ReadFile(filepath.Join(root, "deploy", f))
		if err != nil {
			t.Fatal(err)
		}
		objs = append(objs, decode(t, raw)...)
	}
	return objs
}

func find(objs []*unstructured.Unstructured, kind, ns, name string) *unstructured.Unstructured {
	for _, o := range objs {
		if o.GetKind() == kind && o.GetNamespace() == ns && o.GetName() == name {
			return o
		}
	}
	return nil
}

func kinds(objs []*unstructured.Unstructured) []string {
	var out []string
	for _, o := range objs {
		out = append(out, o.GetKind()+" "+o.GetName())
	}
	return out
}

var spaces = regexp.MustCompile(`\s+`)

// webhooks returns a configuration's webhooks with what may differ between
// an install and the reference manifest (the CA, the expression's line
// breaks) taken out.
func webhooks(t *testing.T, o *unstructured.Unstructured) []any {
	t.Helper()
	list, _, _ := unstructured.NestedSlice(o.Object, "webhooks")
	for _, w := range list {
		w := w.(map[string]any)
		unstructured.RemoveNestedField(w, "clientConfig", "caBundle")
		conds, _, _ := unstructured.NestedSlice(w, "matchConditions")
		for _, c := range conds {
			c := c.(map[string]any)
			c["expression"] = strings.TrimSpace(spaces.ReplaceAllString(c["expression"].(string), " "))
		}
		_ = unstructured.SetNestedSlice(w, conds, "matchConditions")
	}
	return list
}

// With its defaults, the chart grants exactly the RBAC of the reference
// manifests in deploy/, registers the same webhooks, and mounts the same
// scheduler configuration: one definition of least privilege.
func TestChartSaysWhatDeploySays(t *testing.T) {
	chart := mustRender(t)
	ref := readManifests(t, "scheduler/scheduler.yaml", "node-agent/node-agent.yaml", "webhook/server.yaml", "webhook/configurations.yaml")
	compared := 0
	for _, r := range ref {
		c := find(chart, r.GetKind(), r.GetNamespace(), r.GetName())
		var fields [][]string
		switch r.GetKind() {
		case "ClusterRole", "Role":
			fields = [][]string{{"rules"}}
		case "ClusterRoleBinding", "RoleBinding":
			fields = [][]string{{"roleRef"}, {"subjects"}}
		case "ServiceAccount", "Service":
			fields = [][]string{{"automountServiceAccountToken"}, {"spec", "ports"}}
		case "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding":
			fields = [][]string{{"spec"}}
		case "DaemonSet", "Deployment":
			if c == nil {
				t.Errorf("the chart has no %s %s/%s", r.GetKind(), r.GetNamespace(), r.GetName())
				continue
			}
			// Images and probes differ by design; what a pod may do may not.
			if diff := cmp.Diff(privileges(t, r), privileges(t, c)); diff != "" {
				t.Errorf("%s %s/%s: the chart's pod may do other than deploy/'s (-deploy +chart):\n%s", r.GetKind(), r.GetNamespace(), r.GetName(), diff)
			}
			compared++
			continue
		case "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration":
			if c == nil {
				t.Errorf("the chart has no %s %s", r.GetKind(), r.GetName())
				continue
			}
			if diff := cmp.Diff(webhooks(t, r), webhooks(t, c)); diff != "" {
				t.Errorf("%s %s: the chart differs from deploy/ (-deploy +chart):\n%s", r.GetKind(), r.GetName(), diff)
			}
			compared++
			continue
		case "ConfigMap":
			if c == nil {
				t.Errorf("the chart has no ConfigMap %s/%s", r.GetNamespace(), r.GetName())
				continue
			}
			var a, b map[string]any
			ra, _, _ := unstructured.NestedString(r.Object, "data", "config.yaml")
			rb, _, _ := unstructured.NestedString(c.Object, "data", "config.yaml")
			if err := utilyaml.Unmarshal([]byte(ra), &a); err != nil {
				t.Fatal(err)
			}
			if err := utilyaml.Unmarshal([]byte(rb), &b); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(a, b); diff != "" {
				t.Errorf("scheduler configuration: the chart differs from deploy/ (-deploy +chart):\n%s", diff)
			}
			compared++
			continue
		default:
			continue
		}
		if c == nil {
			t.Errorf("the chart has no %s %s/%s; it has %v", r.GetKind(), r.GetNamespace(), r.GetName(), kinds(chart))
			continue
		}
		for _, f := range fields {
			a, _, _ := unstructured.NestedFieldNoCopy(r.Object, f...)
			b, _, _ := unstructured.NestedFieldNoCopy(c.Object, f...)
			if diff := cmp.Diff(a, b); diff != "" {
				t.Errorf("%s %s/%s .%s: the chart differs from deploy/ (-deploy +chart):\n%s", r.GetKind(), r.GetNamespace(), r.GetName(), strings.Join(f, "."), diff)
			}
		}
		compared++
	}
	if compared < 20 {
		t.Fatalf("compared only %d objects", compared)
	}
	// And nothing more is granted or narrowed than deploy/ says.
	for _, c := range chart {
		switch c.GetKind() {
		case "ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding":
			if find(ref, c.GetKind(), c.GetNamespace(), c.GetName()) == nil {
				t.Errorf("the chart has %s %s/%s, which deploy/ does not", c.GetKind(), c.GetNamespace(), c.GetName())
			}
		}
	}
}

// privileges is what a workload's pod may do: its identity, host
// namespaces, volumes, and each container's security context, mounts
// and arguments (bar the image's name).
func privileges(t *testing.T, o *unstructured.Unstructured) map[string]any {
	t.Helper()
	spec, _, _ := unstructured.NestedMap(o.Object, "spec", "template", "spec")
	var pod corev1.PodSpec
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(spec, &pod); err != nil {
		t.Fatal(err)
	}
	out := map[string]any{"serviceAccountName": pod.ServiceAccountName, "hostPID": pod.HostPID, "hostNetwork": pod.HostNetwork,
		"hostIPC": pod.HostIPC, "securityContext": pod.SecurityContext, "volumes": pod.Volumes}
	for _, c := range append(pod.InitContainers, pod.Containers...) {
		out["container "+c.Name] = map[string]any{"securityContext": c.SecurityContext, "volumeMounts": c.VolumeMounts}
	}
	return out
}

// The scheduler configuration the chart renders is one kube-scheduler
// accepts, with arguments the plugin accepts, for the defaults and for
// every setting the values offer.
func TestChartSchedulerConfigIsValid(t *testing.T) {
	for _, set := range []string{
		"",
		"scheduler.policy=fgd,nodeAgent.gpuMemoryReserveMiB=1024,nodeAgent.gpuMemoryReserveMiBByModel.NVIDIA-H100-80GB-HBM3=2048,scheduler.bindTimeout=30s,scheduler.schedulerName=fractions",
	} {
		var args []string
		if set != "" {
			args = []string{"--set", set}
		}
		cm := find(mustRender(t, args...), "ConfigMap", namespace, "gpufrac-scheduler-config")
		raw, _, _ := unstructured.NestedString(cm.Object, "data", "config.yaml")
		obj, _, err := schedscheme.Codecs.UniversalDecoder().Decode([]byte(raw), nil, nil)
		if err != nil {
			t.Fatalf("--set %q: kube-scheduler cannot read the configuration: %v\n%s", set, err, raw)
		}
		cfg := obj.(*schedconfig.KubeSchedulerConfiguration)
		if err := schedvalidation.ValidateKubeSchedulerConfiguration(cfg); err != nil {
			t.Fatalf("--set %q: %v", set, err)
		}
		if len(cfg.Profiles) != 1 || len(cfg.Profiles[0].PluginConfig) == 0 {
			t.Fatalf("--set %q: profiles %+v", set, cfg.Profiles)
		}
		// Only the leading replica starts informers, and with them the
		// plugin's collector, which writes (standing reservation pods,
		// held shares, orphans, resizes): a standby writes nothing.
		if !cfg.DelayCacheUntilActive || !cfg.LeaderElection.LeaderElect {
			t.Errorf("--set %q: delayCacheUntilActive %v, leaderElect %v: a standby replica would run the plugin's collector", set, cfg.DelayCacheUntilActive, cfg.LeaderElection.LeaderElect)
		}
		var pluginArgs scheduler.Args
		found := false
		for _, pc := range cfg.Profiles[0].PluginConfig {
			if pc.Name == scheduler.Name {
				found = true
				pluginArgs, err = scheduler.DecodeArgs(pc.Args)
				if err != nil {
					t.Fatalf("--set %q: %v", set, err)
				}
			}
		}
		if !found {
			t.Fatalf("--set %q: no %s arguments", set, scheduler.Name)
		}
		if set != "" && (pluginArgs.Policy != "fgd" || cfg.Profiles[0].SchedulerName != "fractions") {
			t.Errorf("--set %q: got %+v, profile %s", set, pluginArgs, cfg.Profiles[0].SchedulerName)
		}
		if set != "" {
			// The reserve is the node agent's alone: it publishes it on
			// its node, where the scheduler reads it.
			var ds appsv1.DaemonSet
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(find(mustRender(t, args...), "DaemonSet", namespace, "gpufrac-node-agent").Object, &ds); err != nil {
				t.Fatal(err)
			}
			agentArgs := ds.Spec.Template.Spec.Containers[0].Args
			if !slices.Contains(agentArgs, "--gpu-memory-reserve-mib=1024") || !slices.Contains(agentArgs, "--gpu-memory-reserve-mib-by-model=NVIDIA-H100-80GB-HBM3=2048") {
				t.Errorf("--set %q: node agent args %v lack the reserve", set, agentArgs)
			}
		}
	}
	// The scheduler's former values fail the render with where they went.
	if _, err := render(t, "--set", "scheduler.gpuMemoryReserveMiB=1024"); err == nil || !strings.Contains(err.Error(), "moved to nodeAgent.gpuMemoryReserveMiB") {
		t.Errorf("render with scheduler.gpuMemoryReserveMiB: %v, want it refused with where the value moved", err)
	}
}

// Without cert-manager the chart generates a CA and a serving certificate
// for the webhook's Service name, and both configurations trust that CA;
// with cert-manager it asks cert-manager for them instead.
func TestChartCertificates(t *testing.T) {
	t.Run("generated", func(t *testing.T) {
		objs := mustRender(t)
		secret := find(objs, "Secret", namespace, "gpufrac-webhook-tls")
		if secret == nil {
			t.Fatalf("no Secret gpufrac-webhook-tls: %v", kinds(objs))
		}
		pemOf := func(key string) []byte {
			s, _, _ := unstructured.NestedString(secret.Object, "data", key)
			raw, err := base64.StdEncoding.DecodeString(s)
			if err != nil {
				t.Fatalf("%s: %v", key, err)
			}
			return raw
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pemOf("ca.crt")) {
			t.Fatal("ca.crt holds no certificate")
		}
		block, _ := pem.Decode(pemOf("tls.crt"))
		if block == nil {
			t.Fatal("tls.crt holds no certificate")
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cert.Verify(x509.VerifyOptions{DNSName: "gpufrac-webhook.gpufrac-system.svc", Roots: roots}); err != nil {
			t.Fatalf("the serving certificate does not verify for the Service: %v", err)
		}
		if key, _ := pem.Decode(pemOf("tls.key")); key == nil {
			t.Fatal("tls.key holds no key")
		}
		ca, _, _ := unstructured.NestedString(secret.Object, "data", "ca.crt")
		for _, kind := range []string{"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"} {
			list, _, _ := unstructured.NestedSlice(find(objs, kind, "", "gpufrac").Object, "webhooks")
			for _, w := range list {
				if got, _, _ := unstructured.NestedString(w.(map[string]any), "clientConfig", "caBundle"); got != ca {
					t.Errorf("%s: a webhook's caBundle is not the generated CA", kind)
				}
			}
		}
	})
	for name, args := range map[string][]string{
		"cert-manager found":  {"--api-versions", "cert-manager.io/v1"},
		"cert-manager forced": {"--set", "webhook.certificates.provider=certManager"},
	} {
		t.Run(name, func(t *testing.T) {
			objs := mustRender(t, args...)
			if s := find(objs, "Secret", namespace, "gpufrac-webhook-tls"); s != nil {
				t.Error("a generated Secret next to cert-manager's")
			}
			cert := find(objs, "Certificate", namespace, "gpufrac-webhook")
			if cert == nil || find(objs, "Issuer", namespace, "gpufrac-webhook") == nil {
				t.Fatalf("no Certificate and Issuer: %v", kinds(objs))
			}
			secretName, _, _ := unstructured.NestedString(cert.Object, "spec", "secretName")
			dns, _, _ := unstructured.NestedStringSlice(cert.Object, "spec", "dnsNames")
			if secretName != "gpufrac-webhook-tls" || !slices.Contains(dns, "gpufrac-webhook.gpufrac-system.svc") {
				t.Errorf("Certificate: secret %q, names %v", secretName, dns)
			}
			for _, kind := range []string{"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"} {
				o := find(objs, kind, "", "gpufrac")
				if o.GetAnnotations()["cert-manager.io/inject-ca-from"] != "gpufrac-system/gpufrac-webhook" {
					t.Errorf("%s: no cert-manager CA injection: %v", kind, o.GetAnnotations())
				}
			}
		})
	}
	t.Run("a bad provider is refused", func(t *testing.T) {
		_, err := render(t, "--set", "webhook.certificates.provider=vault")
		if err == nil || !strings.Contains(err.Error(), `webhook.certificates.provider "vault": must be auto, certManager or generated`) {
			t.Fatalf("got %v", err)
		}
	})
}

// With scheduler.enabled=false (another scheduler, e.g. KAI's, places the
// pods) nothing of the scheduler is installed and the webhook no longer
// redirects pods to it.
func TestChartWithoutScheduler(t *testing.T) {
	objs := mustRender(t, "--set", "scheduler.enabled=false", "--set", "webhook.extraSchedulerUsers={system:serviceaccount:kai-scheduler:kai-scheduler}")
	for _, o := range objs {
		if strings.Contains(o.GetName(), "scheduler") {
			t.Errorf("%s %s installed with the scheduler off", o.GetKind(), o.GetName())
		}
	}
	dep := find(objs, "Deployment", namespace, "gpufrac-webhook")
	containers, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
	args, _, _ := unstructured.NestedStringSlice(containers[0].(map[string]any), "args")
	if slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--scheduler-name") }) ||
		!slices.Contains(args, "--scheduler-user=system:serviceaccount:kai-scheduler:kai-scheduler") {
		t.Errorf("webhook args: %v", args)
	}
	schedulerUsersAgree(t, objs, "chart without the scheduler")
}

// The users whose Bindings skip the webhook are exactly the webhook's
// --scheduler-user list: in deploy/, and in the chart with its defaults.
func TestBindingGuardSkipsOnlyTheWebhooksSchedulerUsers(t *testing.T) {
	schedulerUsersAgree(t, readManifests(t, "webhook/server.yaml", "webhook/configurations.yaml"), "deploy/")
	schedulerUsersAgree(t, mustRender(t), "chart")
}

// schedulerUsersAgree checks that the Binding webhook's match condition
// not-from-the-scheduler names the users the webhook's Deployment passes
// as --scheduler-user, in the same order: a user the condition trusts but
// the webhook does not would get decisions past the guard.
func schedulerUsersAgree(t *testing.T, objs []*unstructured.Unstructured, where string) {
	t.Helper()
	dep := find(objs, "Deployment", namespace, "gpufrac-webhook")
	if dep == nil {
		t.Fatalf("%s: no webhook Deployment", where)
	}
	containers, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
	args, _, _ := unstructured.NestedStringSlice(containers[0].(map[string]any), "args")
	users := []string{}
	for _, a := range args {
		if u, ok := strings.CutPrefix(a, "--scheduler-user="); ok {
			users = append(users, u)
		}
	}
	list, err := json.Marshal(users)
	if err != nil {
		t.Fatal(err)
	}
	want := "!(request.userInfo.username in " + string(list) + ")"
	var got []string
	for _, o := range objs {
		if o.GetKind() != "ValidatingWebhookConfiguration" {
			continue
		}
		for _, w := range webhooks(t, o) {
			w := w.(map[string]any)
			if w["name"] != "bindings.validate.gpufrac.io" {
				continue
			}
			conds, _, _ := unstructured.NestedSlice(w, "matchConditions")
			for _, c := range conds {
				if c := c.(map[string]any); c["name"] == "not-from-the-scheduler" {
					got = append(got, c["expression"].(string))
				}
			}
		}
	}
	if len(got) != 1 || got[0] != want {
		t.Errorf("%s: the Binding webhook's not-from-the-scheduler conditions are %q, want exactly %q (the webhook's --scheduler-user list)", where, got, want)
	}
}

// The real kube-apiserver accepts every object the chart renders (schemas,
// CEL expressions, RBAC), and the admission policy keeps each node agent
// to its own node and that node's pods.
func TestChartInstallsAndBoundsTheNodeAgent(t *testing.T) {
	env, err := testenv.New()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := env.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	admin, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	resources, err := admin.Discovery().ServerPreferredResources()
	if err != nil {
		t.Fatal(err)
	}
	plural := map[schema.GroupVersionKind]string{}
	for _, list := range resources {
		gv, _ := schema.ParseGroupVersion(list.GroupVersion)
		for _, r := range list.APIResources {
			plural[gv.WithKind(r.Kind)] = r.Name
		}
	}
	// A log shipper's path allowed; everything else stays refused.
	for _, o := range mustRender(t, "--set", "podSecurity.allowedHostPaths={/data,/opt/models/,/var/log}") {
		gvk := o.GroupVersionKind()
		res, ok := plural[gvk]
		if !ok {
			t.Fatalf("%s %s: kube-apiserver v1.37 serves no %s", gvk.Kind, o.GetName(), gvk)
		}
		var client dynamic.ResourceInterface = dyn.Resource(gvk.GroupVersion().WithResource(res))
		if o.GetNamespace() != "" {
			client = dyn.Resource(gvk.GroupVersion().WithResource(res)).Namespace(o.GetNamespace())
		}
		if _, err := client.Create(ctx, o, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Fatalf("kube-apiserver refuses %s %s: %v", gvk.Kind, o.GetName(), err)
		}
	}

	for _, n := range []string{"gpu-a", "gpu-b"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The agent on gpu-a, as its pod-bound token presents it.
	agent := func(node string) kubernetes.Interface {
		c := rest.CopyConfig(cfg)
		c.Impersonate = rest.ImpersonationConfig{
			UserName: "system:serviceaccount:gpufrac-system:gpufrac-node-agent",
			Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:gpufrac-system", "system:authenticated"},
		}
		if node != "" {
			c.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
		}
		return kubernetes.NewForConfigOrDie(c)
	}
	label := func(client kubernetes.Interface, node string) error {
		_, err := client.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType,
			[]byte(`{"metadata":{"labels":{"nvidia.com/gpu.count":"8"}}}`), metav1.PatchOptions{})
		return err
	}
	// The policy takes effect once the API server has loaded it.
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return label(agent("gpu-a"), "gpu-b") != nil, nil
	})
	if err != nil {
		t.Fatal("the agent on gpu-a could still label gpu-b after 30s")
	}
	err = label(agent("gpu-a"), "gpu-b")
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), `the gpufrac node agent on node "gpu-a" may change only its own node and its pods, not nodes "gpu-b"`) {
		t.Errorf("agent on gpu-a labelling gpu-b: %v", err)
	}
	if err := label(agent("gpu-a"), "gpu-a"); err != nil {
		t.Errorf("agent on gpu-a labelling gpu-a: %v", err)
	}
	// On its own node, only gpufrac's labels and the inventory ones.
	patchOwn := func(patch string) error {
		_, err := agent("gpu-a").CoreV1().Nodes().Patch(ctx, "gpu-a", types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		return err
	}
	if err := patchOwn(`{"metadata":{"labels":{"gpufrac.io/agent-heartbeat-seconds":"30"}}}`); err != nil {
		t.Errorf("agent on gpu-a writing a gpufrac.io label on its node: %v", err)
	}
	if err := patchOwn(`{"metadata":{"labels":{"topology.kubernetes.io/zone":"z"}}}`); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "labels changed: topology.kubernetes.io/zone") {
		t.Errorf("agent on gpu-a writing another label on its node: %v, want forbidden", err)

	}
	if err := patchOwn(`{"spec":{"unschedulable":true}}`); !apierrors.IsForbidden(err) {
		t.Errorf("agent on gpu-a cordoning its node: %v, want forbidden", err)

	}
	if err := label(agent(""), "gpu-a"); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "token names no node") {
		t.Errorf("agent with no node claim labelling gpu-a: %v", err)
	}
	// Its own node's status (the readiness condition) too.
	status := []byte(`{"status":{"conditions":[{"type":"gpu-fractioning.nvidia.com/Ready","status":"True","reason":"Test"}]}}`)
	if _, err := agent("gpu-a").CoreV1().Nodes().Patch(ctx, "gpu-b", types.StrategicMergePatchType, status, metav1.PatchOptions{}, "status"); !apierrors.IsForbidden(err) {
		t.Errorf("agent on gpu-a setting gpu-b's condition: %v", err)
	}
	if _, err := agent("gpu-a").CoreV1().Nodes().Patch(ctx, "gpu-a", types.StrategicMergePatchType, status, metav1.PatchOptions{}, "status"); err != nil {
		t.Errorf("agent on gpu-a setting its condition: %v", err)
	}
	// Reservation pods: only those bound to its node.
	for _, n := range []string{"gpu-a", "gpu-b"} {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "reservation-" + n, Namespace: "gpufrac-reservations"},
			Spec:       corev1.PodSpec{NodeName: n, Containers: []corev1.Container{{Name: "pause", Image: "pause"}}},
		}
		if _, err := admin.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	uuid := func(pod string) error {
		_, err := agent("gpu-a").CoreV1().Pods("gpufrac-reservations").Patch(ctx, pod, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"gpufrac.io/reserved-gpu-uuid":"GPU-1"}}}`), metav1.PatchOptions{})
		return err
	}
	if err := uuid("reservation-gpu-a"); err != nil {
		t.Errorf("agent on gpu-a annotating its reservation pod: %v", err)
	}
	if err := uuid("reservation-gpu-b"); !apierrors.IsForbidden(err) {
		t.Errorf("agent on gpu-a annotating gpu-b's reservation pod: %v", err)
	}
	// A tenant's pod found running unenforced is deleted (no disruption
	// budget may keep it), by its own node's agent only.
	for _, n := range []string{"gpu-a", "gpu-b"} {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "tenant-" + n, Namespace: namespace},
			Spec:       corev1.PodSpec{NodeName: n, Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
		}
		if _, err := admin.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	del := func(pod string) error {
		return agent("gpu-a").CoreV1().Pods(namespace).Delete(ctx, pod, metav1.DeleteOptions{})
	}
	if err := del("tenant-gpu-b"); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), `may change only its own node and its pods, not pods "tenant-gpu-b"`) {
		t.Errorf("agent on gpu-a deleting gpu-b's pod: %v", err)
	}
	if err := del("tenant-gpu-a"); err != nil {
		t.Errorf("agent on gpu-a deleting its own node's pod: %v", err)
	}
	if err := agent("gpu-a").PolicyV1().Evictions(namespace).Evict(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: "tenant-gpu-b", Namespace: namespace}}); !apierrors.IsForbidden(err) {
		t.Errorf("agent evicting a pod: %v, want forbidden (it has no eviction right left)", err)
	}

	// Tenants cannot mount gpufrac's host directories (or a directory
	// above them, or a spelling the prefix test cannot judge); an admin
	// namespace can, and so can any other path.
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "team-a"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	hostPathPod := func(ns, path string) error {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "mounter-", Namespace: ns},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "busybox"}},
				Volumes: []corev1.Volume{{Name: "host", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path}}}}},
		}
		_, err := admin.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		return err
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return hostPathPod("team-a", "/var/lib/gpufrac") != nil, nil
	})
	if err != nil {
		t.Fatal("a tenant could still mount /var/lib/gpufrac after 30s")
	}
	// Issue 53: a list of gpufrac's directories was walked around through
	// /proc (/proc/1/root/var/lib/gpufrac): only allowed paths pass now.
	for _, path := range []string{"/var/lib/gpufrac", "/var/lib/gpufrac/leases.json", "/run/gpufrac/mps/pipe", "/var/run/gpufrac/mps",
		"/run/nri", "/var/run/cdi/", "/", "/var", "/opt/gpufrac", "/var//lib/gpufrac", "/var/lib/./gpufrac", "/var/lib/kubelet/pod-resources",
		"/var/lib/kubelet/pods", "/proc", "/proc/1/root", "/sys", "/datasets", "/opt/models-other", "/home", "/var/lib/gpufrac-not"} {
		err := hostPathPod("team-a", path)
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "is not allowed outside the namespaces gpufrac exempts") {
			t.Errorf("a tenant mounting %s: %v, want forbidden", path, err)
		}
	}
	for _, path := range []string{"/data", "/data/x", "/opt/models", "/opt/models/llama", "/var/log", "/var/log/pods"} {
		if err := hostPathPod("team-a", path); err != nil {
			t.Errorf("a tenant mounting %s: %v, want allowed", path, err)
		}
	}
	// A namespace Pod Security labels privileged (an admin's
	// infrastructure, a log shipper's) mounts what it needs, but never
	// gpufrac's directories; an upgrade refuses no update of a running pod.
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "logging",
		Labels: map[string]string{"pod-security.kubernetes.io/enforce": "privileged"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := hostPathPod("logging", "/var/lib/docker/containers"); err != nil {
		t.Errorf("a privileged namespace mounting /var/lib/docker/containers: %v", err)
	}
	if err := hostPathPod("logging", "/var/lib/gpufrac"); !apierrors.IsForbidden(err) {
		t.Errorf("a privileged namespace mounting /var/lib/gpufrac: %v, want forbidden", err)
	}
	if err := hostPathPod(namespace, "/var/lib/gpufrac"); err != nil {
		t.Errorf("the release namespace mounting /var/lib/gpufrac: %v", err)
	}

	// Only the scheduler creates pods in the reservation namespace, even
	// for a user RBAC lets create pods there.
	const resNS = "gpufrac-reservations"
	if _, err := admin.RbacV1().Roles(resNS).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "careless", Namespace: resNS},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"create"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().RoleBindings(resNS).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "careless", Namespace: resNS},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "careless"},
		Subjects:   []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: "team-admin"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	as := func(user string) kubernetes.Interface {
		c := rest.CopyConfig(cfg)
		c.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
		return kubernetes.NewForConfigOrDie(c)
	}
	squatter := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "squat-", Namespace: resNS, Labels: map[string]string{api.GPUGroupLabel: "g1"}},
		Spec:       corev1.PodSpec{NodeName: "gpu-a", Containers: []corev1.Container{{Name: "main", Image: "pause"}}},
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := as("team-admin").CoreV1().Pods(resNS).Create(ctx, squatter, metav1.CreateOptions{})
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "only gpufrac's scheduler creates pods in gpufrac-reservations"), nil
	})
	if err != nil {
		_, err := as("team-admin").CoreV1().Pods(resNS).Create(ctx, squatter, metav1.CreateOptions{})
		t.Errorf("a user with pod rights in the reservation namespace could still create a pod there after 30s: %v", err)
	}
	if _, err := as("system:serviceaccount:gpufrac-system:gpufrac-scheduler").CoreV1().Pods(resNS).Create(ctx, squatter, metav1.CreateOptions{}); err != nil {
		t.Errorf("the scheduler creating a reservation pod: %v", err)
	}
}

// The dashboard is off by default; on, it gets exactly deploy/dashboard's
// read-only RBAC, a ClusterIP Service, and a Deployment that runs
// `gpufrac dashboard` unprivileged; the reserve it reads from the nodes.
func TestChartDashboard(t *testing.T) {
	for _, o := range mustRender(t) {
		if strings.Contains(o.GetName(), "dashboard") {
			t.Errorf("the default chart has %s %s", o.GetKind(), o.GetName())
		}
	}
	chart := mustRender(t, "--set", "dashboard.enabled=true", "--set", "nodeAgent.gpuMemoryReserveMiB=1024")
	ref := readManifests(t, "dashboard/dashboard.yaml")
	for _, r := range ref {
		c := find(chart, r.GetKind(), r.GetNamespace(), r.GetName())
		if c == nil {
			t.Fatalf("the chart has no %s %s/%s", r.GetKind(), r.GetNamespace(), r.GetName())
		}
		for _, f := range [][]string{{"rules"}, {"roleRef"}, {"subjects"}} {
			a, _, _ := unstructured.NestedFieldNoCopy(r.Object, f...)
			b, _, _ := unstructured.NestedFieldNoCopy(c.Object, f...)
			if diff := cmp.Diff(a, b); diff != "" {
				t.Errorf("%s %s .%s: the chart differs from deploy/ (-deploy +chart):\n%s", r.GetKind(), r.GetName(), strings.Join(f, "."), diff)
			}
		}
	}
	svc := find(chart, "Service", namespace, "gpufrac-dashboard")
	if svc == nil {
		t.Fatal("no dashboard Service")
	}
	if typ, _, _ := unstructured.NestedString(svc.Object, "spec", "type"); typ != "ClusterIP" {
		t.Errorf("dashboard Service type %q, want ClusterIP", typ)
	}
	d := find(chart, "Deployment", namespace, "gpufrac-dashboard")
	if d == nil {
		t.Fatal("no dashboard Deployment")
	}
	var dep appsv1.Deployment
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(d.Object, &dep); err != nil {
		t.Fatal(err)
	}
	c := dep.Spec.Template.Spec.Containers[0]
	allowed := "--allowed-host=gpufrac-dashboard,gpufrac-dashboard.gpufrac-system,gpufrac-dashboard.gpufrac-system.svc,gpufrac-dashboard.gpufrac-system.svc.cluster.local"
	// What the nodes publish (their reserve, their reservation
	// namespace) is read there, not configured again.
	if c.Args[0] != "dashboard" || slices.ContainsFunc(c.Args, func(a string) bool {
		return strings.Contains(a, "reserve-mib") || strings.Contains(a, "reservation-namespace")
	}) ||
		!slices.Contains(c.Args, allowed) {
		t.Errorf("dashboard args %v", c.Args)
	}
	sc, psc := c.SecurityContext, dep.Spec.Template.Spec.SecurityContext
	if dep.Spec.Template.Spec.ServiceAccountName != "gpufrac-dashboard" || sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault ||
		dep.Spec.Template.Spec.HostNetwork || dep.Spec.Template.Spec.HostPID || !onlyScratch(dep.Spec.Template.Spec.Volumes) {
		t.Errorf("dashboard pod privileges: %+v", dep.Spec.Template.Spec)
	}
	if c.LivenessProbe == nil || c.LivenessProbe.HTTPGet.Path != "/livez" || c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("dashboard probes: liveness %+v, readiness %+v", c.LivenessProbe, c.ReadinessProbe)
	}

	// Issue 53: no pod outside the release namespace (and those listed)
	// reaches the dashboard through its Service; the webhook only from the
	// API server's addresses, where they are given.
	policy := func(objs []*unstructured.Unstructured, name string) *networkingv1.NetworkPolicy {
		o := find(objs, "NetworkPolicy", namespace, name)
		if o == nil {
			return nil
		}
		var np networkingv1.NetworkPolicy
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &np); err != nil {
			t.Fatal(err)
		}
		return np.DeepCopy()
	}
	np := policy(chart, "gpufrac-dashboard")
	if np == nil || len(np.Spec.Ingress) != 1 || len(np.Spec.Ingress[0].From) != 1 || np.Spec.Ingress[0].From[0].NamespaceSelector == nil ||
		!slices.Equal(np.Spec.Ingress[0].From[0].NamespaceSelector.MatchExpressions[0].Values, []string{namespace}) ||
		np.Spec.PodSelector.MatchLabels["app.kubernetes.io/name"] != "gpufrac-dashboard" {
		t.Errorf("dashboard NetworkPolicy: %+v", np)
	}
	if policy(chart, "gpufrac-webhook") != nil {
		t.Error("a webhook NetworkPolicy without the API server's addresses would refuse the API server")
	}
	withCIDRs := mustRender(t, "--set", "networkPolicy.apiServerCIDRs={10.0.0.0/24}")
	if wp := policy(withCIDRs, "gpufrac-webhook"); wp == nil || wp.Spec.Ingress[0].From[0].IPBlock == nil || wp.Spec.Ingress[0].From[0].IPBlock.CIDR != "10.0.0.0/24" {
		t.Errorf("webhook NetworkPolicy: %+v", wp)
	}
}

// The node agent's pod gets exactly what its two containers need, in the
// chart and in deploy/ alike: the host PID namespace (memacct registers MPS
// clients by host PID), root without privilege escalation, read-only root
// file systems, the host's /proc and cgroup file system read only, and no
// capability but the agent's SYS_ADMIN, which setting a GPU's compute mode
// needs (--exclusive-process, on by default), and KILL, which its security
// stops need when no kubelet acts (issue 53). Nothing
// privileged, no host network or IPC.
func TestNodeAgentPrivileges(t *testing.T) {
	rendered := mustRender(t)
	deploy := readManifests(t, "node-agent/node-agent.yaml")
	for _, set := range []struct {
		name, container string
	}{{"gpufrac-node-agent", "agent"}, {"gpufrac-mps", "mps"}} {
		chart := find(rendered, "DaemonSet", "gpufrac-system", set.name)
		ref := find(deploy, "DaemonSet", "gpufrac-system", set.name)
		if chart == nil || ref == nil {
			t.Fatalf("DaemonSet %s: chart %v, deploy/ %v", set.name, chart != nil, ref != nil)
		}
		for name, ds := range map[string]*unstructured.Unstructured{"chart": chart, "deploy/": ref} {
			checkNodePod(t, name, set.container, ds)
		}
	}
	// The MPS daemon is never rolled by an upgrade: every tenant's context
	// lives in it (gpufrac mps-replace replaces it).
	for name, objs := range map[string][]*unstructured.Unstructured{"chart": rendered, "deploy/": deploy} {
		ds := find(objs, "DaemonSet", "gpufrac-system", "gpufrac-mps")
		if s, _, _ := unstructured.NestedString(ds.Object, "spec", "updateStrategy", "type"); s != "OnDelete" {
			t.Errorf("%s: the MPS daemon's DaemonSet updates by %q, want OnDelete", name, s)
		}
		limit, _, _ := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "containers")
		if l, _, _ := unstructured.NestedString(limit[0].(map[string]any), "resources", "limits", "memory"); l != "" {
			t.Errorf("%s: the MPS daemon has a memory limit %s: an OOM kill there ends every tenant", name, l)
		}
	}
	// Off, the agent keeps only KILL (its security stops) and says so.
	off := find(mustRender(t, "--set", "nodeAgent.exclusiveProcess=false"), "DaemonSet", "gpufrac-system", "gpufrac-node-agent")
	agent, _, _ := unstructured.NestedSlice(off.Object, "spec", "template", "spec", "containers")
	c := agent[0].(map[string]any)
	caps, _, _ := unstructured.NestedMap(c, "securityContext", "capabilities")
	if fmt.Sprint(caps["add"]) != "[KILL]" || !slices.Contains(c["args"].([]any), any("--exclusive-process=false")) {
		t.Errorf("exclusiveProcess=false: capabilities %v, args %v", caps, c["args"])
	}
}

// checkNodePod: a node pod shares the host's PID namespace only, and its
// one container (want) runs with no privilege but the agent's KILL and SYS_ADMIN,
// the host's directories read only.
func checkNodePod(t *testing.T, name, want string, ds *unstructured.Unstructured) {
	t.Helper()
	spec, _, _ := unstructured.NestedMap(ds.Object, "spec", "template", "spec")
	if spec["hostPID"] != true || spec["hostNetwork"] != nil || spec["hostIPC"] != nil {
		t.Errorf("%s %s: hostPID %v, hostNetwork %v, hostIPC %v; want host PID only", name, ds.GetName(), spec["hostPID"], spec["hostNetwork"], spec["hostIPC"])
	}
	containers, _, _ := unstructured.NestedSlice(spec, "containers")
	var names []string
	for _, c := range containers {
		c := c.(map[string]any)
		names = append(names, c["name"].(string))
		sc, _ := c["securityContext"].(map[string]any)
		caps, _ := sc["capabilities"].(map[string]any)
		args, _ := c["args"].([]any)
		wantAdd := "<nil>"
		if c["name"] == "agent" {
			wantAdd = "[KILL SYS_ADMIN]"
			if !slices.ContainsFunc(args, func(a any) bool { return a == "--exclusive-process" || a == "--exclusive-process=true" }) {
				t.Errorf("%s: the agent runs without --exclusive-process: %v", name, args)
			}
		}
		if sc["privileged"] == true || sc["allowPrivilegeEscalation"] != false || sc["readOnlyRootFilesystem"] != true ||
			fmt.Sprint(caps["drop"]) != "[ALL]" || fmt.Sprint(caps["add"]) != wantAdd {
			t.Errorf("%s container %s: securityContext %v", name, c["name"], sc)
		}
		if c["name"] == "mps" && (len(args) == 0 || args[0] != "mps-daemon") {
			t.Errorf("%s: the mps container runs %v, want gpufrac mps-daemon", name, args)
		}
		mounts, _ := c["volumeMounts"].([]any)
		for _, m := range mounts {
			m := m.(map[string]any)
			if p := m["mountPath"].(string); strings.HasPrefix(p, "/host/") && m["readOnly"] != true {
				t.Errorf("%s container %s mounts %s writable", name, c["name"], p)
			}
		}
	}
	if !slices.Equal(names, []string{want}) {
		t.Errorf("%s %s: containers %v, want only %s", name, ds.GetName(), names, want)
	}
}

// With nodeAgent.dra.enabled the chart runs the agent's DRA driver: it
// grants exactly deploy/dra's extra RBAC, installs the same DeviceClasses,
// passes --dra and mounts the kubelet's plugin directories and the CDI
// directory; the own-node policy then covers the agent's slices too. Off
// (the default), none of it is rendered.
func TestChartDRA(t *testing.T) {
	chart := mustRender(t, "--set", "nodeAgent.dra.enabled=true", "--set", "nodeAgent.dra.standingGPUs=4")
	ref := readManifests(t, "dra/node-agent-rbac.yaml", "dra/deviceclass.yaml")
	for _, r := range ref {
		c := find(chart, r.GetKind(), r.GetNamespace(), r.GetName())
		if c == nil {
			t.Errorf("the chart with DRA has no %s %s", r.GetKind(), r.GetName())
			continue
		}
		for _, f := range [][]string{{"rules"}, {"roleRef"}, {"subjects"}, {"spec"}} {
			a, _, _ := unstructured.NestedFieldNoCopy(r.Object, f...)
			b, _, _ := unstructured.NestedFieldNoCopy(c.Object, f...)
			if diff := cmp.Diff(a, b); diff != "" {
				t.Errorf("%s %s .%s: the chart differs from deploy/dra (-deploy +chart):\n%s", r.GetKind(), r.GetName(), strings.Join(f, "."), diff)
			}
		}
	}
	ds := find(chart, "DaemonSet", "gpufrac-system", "gpufrac-node-agent")
	if ds == nil {
		t.Fatal("no node agent DaemonSet")
	}
	containers, _, _ := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "containers")
	agent := containers[0].(map[string]any)
	args := fmt.Sprint(agent["args"])
	for _, want := range []string{"--dra ", "--dra-standing-gpus=4", "--dra-plugin-dir=/var/lib/kubelet/plugins/gpu.gpufrac.io", "--dra-cdi-dir=/var/run/cdi"} {
		if !strings.Contains(args, want) {
			t.Errorf("agent args %s lack %s", args, want)
		}
	}
	mounts := fmt.Sprint(agent["volumeMounts"])
	for _, want := range []string{"/var/lib/kubelet/plugins/gpu.gpufrac.io", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} {
		if !strings.Contains(mounts, want) {
			t.Errorf("agent mounts %s lack %s", mounts, want)
		}
	}
	policy := find(chart, "ValidatingAdmissionPolicy", "", "gpufrac-node-agent-own-node")
	if policy == nil {
		t.Error("no own-node policy for the node agent")
	} else if rules := fmt.Sprint(policy.Object["spec"]); !strings.Contains(rules, "resourceslices") {
		t.Errorf("the own-node policy does not cover the agent's ResourceSlices: %s", rules)
	}
	for _, o := range mustRender(t) {
		if o.GetKind() == "DeviceClass" || o.GetName() == "gpufrac-node-agent-dra" {
			t.Errorf("DRA off, the chart still renders %s %s", o.GetKind(), o.GetName())
		}
	}
}

// onlyScratch: the pod's volumes are its memory-backed /tmp and nothing
// else (no host path, no Secret).
func onlyScratch(volumes []corev1.Volume) bool {
	for _, v := range volumes {
		if v.Name != "tmp" || v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumMemory {
			return false
		}
	}
	return len(volumes) == 1
}

// With nodeAgent.yieldToDriverUpgrade (default), both node DaemonSets step
// off a node while the GPU Operator replaces its driver (its upgrade
// controller's state label at pod-restart-required or
// validation-required), so that neither holds the driver; off, they stay.
func TestNodePodsYieldToDriverUpgrades(t *testing.T) {
	for _, tc := range []struct {
		set  []string
		want bool
	}{{nil, true}, {[]string{"--set", "nodeAgent.yieldToDriverUpgrade=false"}, false}} {
		objs := mustRender(t, tc.set...)
		for _, name := range []string{"gpufrac-node-agent", "gpufrac-mps"} {
			ds := find(objs, "DaemonSet", "gpufrac-system", name)
			terms, _, _ := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "affinity", "nodeAffinity",
				"requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms")
			got := fmt.Sprint(terms)
			yields := strings.Contains(got, "key:nvidia.com/gpu-driver-upgrade-state") && strings.Contains(got, "operator:NotIn") &&
				strings.Contains(got, "values:[pod-restart-required validation-required]")
			if yields != tc.want {
				t.Errorf("%v: DaemonSet %s steps aside for a driver upgrade: %v, want %v (node selector terms %s)", tc.set, name, yields, tc.want, got)
			}
		}
	}
}

// The chart ships the agents' Grafana dashboard, labelled for Grafana's
// sidecar, and a PrometheusRule with the alerts docs/metrics.md lists;
// both only when asked, and the rules query only metrics the agent
// exports (a renamed metric would silently never fire).
func TestChartMonitoring(t *testing.T) {
	for _, o := range mustRender(t) {
		if o.GetKind() == "PrometheusRule" || strings.HasSuffix(o.GetName(), "grafana-dashboard") {
			t.Errorf("the default chart has %s %s", o.GetKind(), o.GetName())
		}
	}
	chart := mustRender(t, "--set", "monitoring.grafanaDashboard.enabled=true", "--set", "monitoring.grafanaDashboard.namespace=monitoring",
		"--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.prometheusRule.labels.release=kube-prometheus-stack",
		"--set", "monitoring.podMonitor.enabled=true")
	// The scrape: the agents' pods, their metrics port over TLS with a
	// token of a service account bound to the metrics reader only, the
	// agents' tenant labels kept over the target's.
	pm := find(chart, "PodMonitor", namespace, release+"-node-agent")
	if pm == nil {
		t.Fatalf("no PodMonitor: %v", kinds(chart))
	}
	endpoints, _, _ := unstructured.NestedSlice(pm.Object, "spec", "podMetricsEndpoints")
	if len(endpoints) != 1 {
		t.Fatalf("PodMonitor endpoints %v", endpoints)
	}
	ep := endpoints[0].(map[string]any)
	secret, _, _ := unstructured.NestedString(ep, "authorization", "credentials", "name")
	if ep["port"] != "metrics" || ep["scheme"] != "https" || ep["honorLabels"] != true || secret == "" {
		t.Errorf("PodMonitor endpoint %v: want port metrics, https, honorLabels, a token", ep)
	}
	if tok := find(chart, "Secret", namespace, secret); tok == nil || tok.Object["type"] != "kubernetes.io/service-account-token" {
		t.Errorf("the PodMonitor's token Secret %s: %v", secret, tok)
	}
	scraper := find(chart, "ClusterRoleBinding", "", release+"-metrics-scraper")
	if ref, _, _ := unstructured.NestedString(scraper.Object, "roleRef", "name"); ref != "gpufrac-metrics-reader" {
		t.Errorf("the scraper is bound to %q, want gpufrac-metrics-reader only", ref)
	}
	exported := map[string]bool{}
	for _, name := range metrics.New().Names() {
		exported[name] = true
	}
	metric := regexp.MustCompile(`gpufrac_[a-z_]+`)
	checkExpr := func(where, expr string) {
		names := metric.FindAllString(expr, -1)
		if len(names) == 0 {
			t.Errorf("%s queries no gpufrac metric: %q", where, expr)
		}
		for _, name := range names {
			if !exported[strings.TrimSuffix(name, "_bucket")] {
				t.Errorf("%s queries %s, which the agent does not export", where, name)
			}
		}
	}
	cm := find(chart, "ConfigMap", "monitoring", release+"-grafana-dashboard")
	if cm == nil {
		t.Fatalf("no Grafana dashboard ConfigMap in namespace monitoring: %v", kinds(chart))
	}
	if got := cm.GetLabels()["grafana_dashboard"]; got != "1" {
		t.Errorf("the dashboard's ConfigMap has grafana_dashboard=%q, want \"1\" (kube-prometheus-stack's sidecar default)", got)
	}
	// The ConfigMap carries the chart's dashboard file whole, whose panels
	// pkg/node/metrics holds to the exported metrics
	// (TestDashboardQueriesExportedMetrics).
	raw, _, _ := unstructured.NestedString(cm.Object, "data", "gpufrac-node.json")
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(filepath.Join(root, "deploy", "helm", "gpufrac", "dashboards", "gpufrac-node.json"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(raw) != strings.TrimSpace(string(file)) {
		t.Errorf("the ConfigMap's dashboard (%d bytes) is not the chart's dashboards/gpufrac-node.json (%d bytes)", len(raw), len(file))
	}
	rule := find(chart, "PrometheusRule", namespace, release)
	if rule == nil {
		t.Fatalf("no PrometheusRule: %v", kinds(chart))
	}
	if rule.GetAPIVersion() != "monitoring.coreos.com/v1" || rule.GetLabels()["release"] != "kube-prometheus-stack" {
		t.Errorf("PrometheusRule %s, labels %v", rule.GetAPIVersion(), rule.GetLabels())
	}
	groups, _, _ := unstructured.NestedSlice(rule.Object, "spec", "groups")
	alerts := map[string]bool{}
	for _, g := range groups {
		rules, _, _ := unstructured.NestedSlice(g.(map[string]any), "rules")
		for _, r := range rules {
			r := r.(map[string]any)
			name, _ := r["alert"].(string)
			expr, _ := r["expr"].(string)
			alerts[name] = true
			checkExpr("alert "+name, expr)
			if summary, _, _ := unstructured.NestedString(r, "annotations", "summary"); !strings.Contains(summary, "{{ $labels.") {
				t.Errorf("alert %s: summary %q names no series (Helm ate the template?)", name, summary)
			}
		}
	}
	for _, want := range []string{"GPUFracTenantNearHardLimit", "GPUFracShareIdle", "GPUFracNodeNotReadyForFractions", "GPUFracMPSDaemonReplaced", "GPUFracUsageUnreadable"} {
		if !alerts[want] {
			t.Errorf("the PrometheusRule has no alert %s (it has %v)", want, alerts)
		}
	}
}
