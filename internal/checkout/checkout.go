// Package checkout finds the parts of a gpufrac checkout that the local
// cluster and the tests use: the repository root (deploy/, examples/) and
// the Kubernetes binaries `make kube-binaries` builds.
package checkout

import (
	"fmt"
	"os"
	"path/filepath"
)

// Root finds the repository root (the directory holding go.mod and
// cmd/gpufrac) from the working directory.
func Root() (string, error) {
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

// KubeBinaries is where kube-apiserver and etcd are (and, from `make
// kube-binaries`, kube-controller-manager): $KUBEBUILDER_ASSETS, or
// bin/kube in the repository. A missing binary is an error that says how
// to build it, never a skipped test.
func KubeBinaries() (string, error) {
	dir := os.Getenv("KUBEBUILDER_ASSETS")
	if dir == "" {
		root, err := Root()
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
