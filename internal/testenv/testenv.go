// Package testenv starts the real Kubernetes control plane for integration
// tests (never the product: gpufrac up runs its own, package controlplane): kube-apiserver and etcd built from source by `make kube-binaries`
// (tools of gpufrac's own module, go.mod), driven by controller-runtime's
// envtest.
package testenv

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/gpufrac/gpufrac/internal/checkout"
)

// New returns an envtest environment over the real binaries, configured as
// gpufrac's tests need: the admission plugins that wait on controllers
// gpufrac's clusters do not run (the service-account token controller, the
// node lifecycle controller's not-ready taint) are off.
//
// The API server also keeps an audit log of every write made by a user in
// the group AuditedGroup (and of nothing else, so that it costs the other
// tests nothing): Writes reads it back, for a test that proves who wrote
// and who did not.
func New() (*envtest.Environment, error) {
	dir, err := checkout.KubeBinaries()
	if err != nil {
		return nil, err
	}
	auditDir, err := os.MkdirTemp("", "gpufrac-audit-")
	if err != nil {
		return nil, err
	}
	policy := filepath.Join(auditDir, "policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
		return nil, err
	}
	env := &envtest.Environment{BinaryAssetsDirectory: dir, ErrorIfCRDPathMissing: true}
	env.ControlPlane.GetAPIServer().Configure().
		Set("disable-admission-plugins", "ServiceAccount,TaintNodesByCondition").
		Set("audit-policy-file", policy).
		Set("audit-log-path", filepath.Join(auditDir, AuditLogName)).
		Set("audit-log-format", "json").
		Set("audit-log-mode", "blocking")
	auditLogs[env] = filepath.Join(auditDir, AuditLogName)
	return env, nil
}

// AuditedGroup is the group whose users' writes the API server audits.
const AuditedGroup = "gpufrac:audited"

// AuditLogName is the audit log's file name.
const AuditLogName = "audit.log"

// auditPolicy logs, once its request is complete, each write of a user in
// AuditedGroup: who, what verb, on what.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
    userGroups: ["` + AuditedGroup + `"]
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
`

var auditLogs = map[*envtest.Environment]string{}

// Write is one audited write: the user, its groups, the verb and the
// object (resource, subresource, namespace, name), and the answer's code.
type Write struct {
	User, Verb, Object string
	Groups             []string
	Code               int
}

// Writes reads back every write the API server of env audited, in order.
func Writes(env *envtest.Environment) ([]Write, error) {
	path, ok := auditLogs[env]
	if !ok {
		return nil, fmt.Errorf("not an environment of testenv.New")
	}
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil // nothing audited yet
	}
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	var out []Write
	lines := bufio.NewScanner(f)
	lines.Buffer(make([]byte, 1<<20), 16<<20)
	for lines.Scan() {
		var ev struct {
			Verb string `json:"verb"`
			User struct {
				Username string   `json:"username"`
				Groups   []string `json:"groups"`
			} `json:"user"`
			ObjectRef struct {
				Resource, Subresource, Namespace, Name string
			} `json:"objectRef"`
			ResponseStatus struct {
				Code int `json:"code"`
			} `json:"responseStatus"`
		}
		if err := json.Unmarshal(lines.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("audit log %s: %w", path, err)
		}
		obj := ev.ObjectRef.Resource
		if ev.ObjectRef.Subresource != "" {
			obj += "/" + ev.ObjectRef.Subresource
		}
		obj += " " + ev.ObjectRef.Namespace + "/" + ev.ObjectRef.Name
		out = append(out, Write{User: ev.User.Username, Groups: ev.User.Groups, Verb: ev.Verb, Object: obj, Code: ev.ResponseStatus.Code})
	}
	return out, lines.Err()
}

// User adds an authenticated user with a client certificate (a real
// identity the API server passes on to webhooks) and returns a clientset
// acting as that user, and its config. groups may include system:masters
// for full access.
func User(env *envtest.Environment, name string, groups ...string) (*kubernetes.Clientset, *rest.Config, error) {
	u, err := env.AddUser(envtest.User{Name: name, Groups: groups}, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("add user %s: %w", name, err)
	}
	cfg := rest.CopyConfig(u.Config())
	cfg.QPS, cfg.Burst = 500, 1000
	client, err := kubernetes.NewForConfig(cfg)
	return client, cfg, err
}

// KubeConfig adds an authenticated user, as User does, and returns a
// kubeconfig file's contents for it, for the processes a test starts.
func KubeConfig(env *envtest.Environment, name string, groups ...string) ([]byte, error) {
	u, err := env.AddUser(envtest.User{Name: name, Groups: groups}, nil)
	if err != nil {
		return nil, fmt.Errorf("add user %s: %w", name, err)
	}
	return u.KubeConfig()
}
