// Package testenv starts the real Kubernetes control plane for integration
// tests: kube-apiserver and etcd built from source by `make kube-binaries`
// (tools of gpufrac's own module, go.mod), driven by controller-runtime's
// envtest.
package testenv

import (
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// RepoRoot finds the repository root (the directory holding go.mod) from
// the working directory of a test.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			if _, err := os.Stat(filepath.Join(dir, "cmd", "gpufrac")); err == nil {
				return dir, nil
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no gpufrac repository root above the working directory")
		}
		dir = parent
	}
}

// AssetsDir is where kube-apiserver and etcd are (and, from `make
// kube-binaries`, kube-controller-manager): $KUBEBUILDER_ASSETS, or
// bin/kube in the repository. A missing binary is an error that says how
// to build it, never a skipped test.
func AssetsDir() (string, error) {
	dir := os.Getenv("KUBEBUILDER_ASSETS")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, "bin", "kube")
	}
	for _, bin := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(dir, bin)); err != nil {
			return "", fmt.Errorf("%s not found in %s: run `make kube-binaries` (or `make test`, which builds them)", bin, dir)
		}
	}
	return dir, nil
}

// New returns an envtest environment over the real binaries, configured as
// gpufrac's tests need: the admission plugins that wait on controllers
// gpufrac's clusters do not run (the service-account token controller, the
// node lifecycle controller's not-ready taint) are off.
func New() (*envtest.Environment, error) {
	dir, err := AssetsDir()
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
