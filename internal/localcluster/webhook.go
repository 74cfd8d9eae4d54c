package localcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/internal/controlplane"
)

// writeServingCert writes the webhook's serving certificate for the
// loopback (tls.crt, tls.key: what its server reads) into dir.
func writeServingCert(ca *controlplane.CA, dir string) error {
	cert, key, err := ca.Serving("gpufrac-webhook", nil)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "tls.crt"), cert, 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "tls.key"), key, 0o600)
}

// installWebhooks registers deploy/webhook's configurations (path) as
// they are, but for where they call: the webhook served at url (each
// webhook's path kept), trusted through caBundle, instead of the Service
// of an installed gpufrac. The cluster is new (startControlPlane): none
// exists yet.
func installWebhooks(ctx context.Context, admin kubernetes.Interface, path, url string, caBundle []byte) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	local := func(cc *admissionregistrationv1.WebhookClientConfig) {
		u := url
		if cc.Service != nil && cc.Service.Path != nil {
			u += *cc.Service.Path
		}
		cc.Service, cc.URL, cc.CABundle = nil, &u, caBundle
	}
	return eachDocument(path, raw, func(kind string, doc []byte) error {
		switch kind {
		case "MutatingWebhookConfiguration":
			var cfg admissionregistrationv1.MutatingWebhookConfiguration
			if err := yaml.UnmarshalStrict(doc, &cfg); err != nil {
				return err
			}
			for i := range cfg.Webhooks {
				local(&cfg.Webhooks[i].ClientConfig)
			}
			_, err := admin.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, &cfg, metav1.CreateOptions{})
			return err
		case "ValidatingWebhookConfiguration":
			var cfg admissionregistrationv1.ValidatingWebhookConfiguration
			if err := yaml.UnmarshalStrict(doc, &cfg); err != nil {
				return err
			}
			for i := range cfg.Webhooks {
				local(&cfg.Webhooks[i].ClientConfig)
			}
			_, err := admin.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, &cfg, metav1.CreateOptions{})
			return err
		case "":
			return nil // a document of comments only
		}
		return fmt.Errorf("not a webhook configuration")
	})
}
