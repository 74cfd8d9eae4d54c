package localcluster

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"
)

// ApplyRBAC creates the namespaces, service accounts and RBAC objects of a
// manifest (other kinds are left to the caller), tolerating ones that
// already exist: the identities a component runs with, exactly as deploy/
// grants them.
func ApplyRBAC(ctx context.Context, c kubernetes.Interface, path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	return applyRBACDocs(ctx, c, path, raw)
}

// applyRBACDocs is ApplyRBAC on a manifest's contents; path names it in
// errors.
func applyRBACDocs(ctx context.Context, c kubernetes.Interface, path string, raw []byte) error {
	return eachDocument(path, raw, func(kind string, doc []byte) error { return applyOne(ctx, c, kind, doc) })
}

// eachDocument calls f with each YAML document of a manifest (path names
// it in errors) and its kind.
func eachDocument(path string, raw []byte, f func(kind string, doc []byte) error) error {
	dec := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	for {
		doc, err := dec.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if err := f(meta.Kind, doc); err != nil {
			return fmt.Errorf("%s: %s: %w", path, meta.Kind, err)
		}
	}
}

func applyOne(ctx context.Context, c kubernetes.Interface, kind string, doc []byte) error {
	create := func(obj any, do func() error) error {
		if err := yaml.Unmarshal(doc, obj); err != nil {
			return err
		}
		if err := do(); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
		return nil
	}
	opts := metav1.CreateOptions{}
	switch kind {
	case "Namespace":
		o := &corev1.Namespace{}
		return create(o, func() error { _, err := c.CoreV1().Namespaces().Create(ctx, o, opts); return err })
	case "ServiceAccount":
		o := &corev1.ServiceAccount{}
		return create(o, func() error { _, err := c.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, opts); return err })
	case "ClusterRole":
		o := &rbacv1.ClusterRole{}
		return create(o, func() error { _, err := c.RbacV1().ClusterRoles().Create(ctx, o, opts); return err })
	case "ClusterRoleBinding":
		o := &rbacv1.ClusterRoleBinding{}
		return create(o, func() error { _, err := c.RbacV1().ClusterRoleBindings().Create(ctx, o, opts); return err })
	case "Role":
		o := &rbacv1.Role{}
		return create(o, func() error { _, err := c.RbacV1().Roles(o.Namespace).Create(ctx, o, opts); return err })
	case "RoleBinding":
		o := &rbacv1.RoleBinding{}
		return create(o, func() error { _, err := c.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, opts); return err })
	case "DeviceClass":
		// deploy/dra's classes, for a cluster whose agents run the DRA driver.
		o := &resourceapi.DeviceClass{}
		return create(o, func() error { _, err := c.ResourceV1().DeviceClasses().Create(ctx, o, opts); return err })
	}
	return nil
}
