// Package testenv starts the real Kubernetes control plane for integration
// tests (never the product: gpufrac up runs its own, package controlplane): kube-apiserver and etcd built from source by `make kube-binaries`
// (tools of gpufrac's own module, go.mod), driven by controller-runtime's
// envtest.
package testenv

import (
	"fmt"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/gpufrac/gpufrac/internal/checkout"
)

// New returns an envtest environment over the real binaries, configured as
// gpufrac's tests need: the admission plugins that wait on controllers
// gpufrac's clusters do not run (the service-account token controller, the
// node lifecycle controller's not-ready taint) are off.
func New() (*envtest.Environment, error) {
	dir, err := checkout.KubeBinaries()
	if err != nil {
		return nil, err
	}
	env := &envtest.Environment{BinaryAssetsDirectory: dir, ErrorIfCRDPathMissing: true}
	env.ControlPlane.GetAPIServer().Configure().
		Set("disable-admission-plugins", "ServiceAccount,TaintNodesByCondition")
	return env, nil
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
