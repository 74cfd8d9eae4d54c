// Package controlplane says how to run a local cluster's etcd and
// kube-apiserver (the binaries `make kube-binaries` builds) as components
// like the others: their files (a CA, the API server's serving
// certificate, the service-account key), their arguments, their health
// endpoints, and a client identity for anyone (a client certificate the
// CA signs). The caller runs the processes with its own runner and waits
// on the health endpoints, as kwokctl's binary runtime does; nothing here
// starts a process, and nothing of controller-runtime's envtest is linked
// into the product.
package controlplane

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Options shape a control plane for a cluster with real nodes (the
// real-node tests): their zero value is gpufrac up's, where no kubelet
// joins and no pod reaches the API server.
type Options struct {
	// Nodes: kubelets join (their identity system:node:<name> in
	// system:nodes: Node authorization and NodeRestriction), and pods
	// reach the API server through the kubernetes Service, with their
	// service-account tokens (the ServiceAccount admission plugin).
	Nodes bool
	// AdvertiseAddress is the kubernetes Service's endpoint, where kube-
	// apiserver then listens besides the loopback; ServiceCIDR is the
	// Services' range (default 10.0.0.0/24) and ServiceIP its first
	// address, the kubernetes Service's. Both go into its certificate.
	AdvertiseAddress, ServiceIP net.IP
	ServiceCIDR                 string
}

// ControlPlane is one local cluster's etcd and kube-apiserver.
type ControlPlane struct {
	Options
	// Dir holds the certificates, the service-account key and etcd's data.
	Dir string
	// CA signs every certificate of the cluster.
	CA *CA
	// Ports: etcd's clients and peers, kube-apiserver's secure port.
	EtcdPort, EtcdPeerPort, APIPort int
}

// New makes a control plane's files under dir, on ports free now (port
// returns one).
func New(dir string, port func() (int, error), opts Options) (*ControlPlane, error) {
	cp := &ControlPlane{Dir: dir, Options: opts}
	if cp.ServiceCIDR == "" {
		cp.ServiceCIDR = "10.0.0.0/24"
	}
	for _, p := range []*int{&cp.EtcdPort, &cp.EtcdPeerPort, &cp.APIPort} {
		n, err := port()
		if err != nil {
			return nil, err
		}
		*p = n
	}
	if err := os.MkdirAll(filepath.Join(dir, "pki"), 0o700); err != nil {
		return nil, err
	}
	ca, err := NewCA("gpufrac-local-ca")
	if err != nil {
		return nil, err
	}
	cp.CA = ca
	var ips []net.IP
	for _, ip := range []net.IP{opts.AdvertiseAddress, opts.ServiceIP} {
		if ip != nil {
			ips = append(ips, ip)
		}
	}
	cert, key, err := ca.Serving("kube-apiserver", ips, "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
	if err != nil {
		return nil, err
	}
	sa, err := NewKeyPEM()
	if err != nil {
		return nil, err
	}
	for name, data := range map[string][]byte{"ca.crt": ca.PEM, "apiserver.crt": cert, "apiserver.key": key, "sa.key": sa} {
		if err := os.WriteFile(cp.pki(name), data, 0o600); err != nil {
			return nil, err
		}
	}
	return cp, nil
}

func (cp *ControlPlane) pki(name string) string { return filepath.Join(cp.Dir, "pki", name) }

func (cp *ControlPlane) etcdURL() string { return "http://127.0.0.1:" + strconv.Itoa(cp.EtcdPort) }

// URL is kube-apiserver's.
func (cp *ControlPlane) URL() string { return "https://127.0.0.1:" + strconv.Itoa(cp.APIPort) }

// EtcdArgs are etcd's arguments: one member on the loopback, no fsync
// (a local cluster's data does not outlive it).
func (cp *ControlPlane) EtcdArgs() []string {
	peer := "http://127.0.0.1:" + strconv.Itoa(cp.EtcdPeerPort)
	return []string{"--name", "default", "--data-dir", filepath.Join(cp.Dir, "etcd"),
		"--listen-client-urls", cp.etcdURL(), "--advertise-client-urls", cp.etcdURL(),
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "default=" + peer,
		"--unsafe-no-fsync"}
}

// EtcdHealthURL answers 200 with {"health":"true"} once etcd serves.
func (cp *ControlPlane) EtcdHealthURL() string { return cp.etcdURL() + "/health" }

// APIServerArgs are kube-apiserver's arguments: the loopback only, client
// certificates of the CA as the identities, RBAC, and without the
// admission plugins that wait on controllers a local cluster does not run
// (the service-account token controller, the node lifecycle controller's
// not-ready taint).
func (cp *ControlPlane) APIServerArgs() []string {
	args := []string{"--etcd-servers", cp.etcdURL(), "--secure-port", strconv.Itoa(cp.APIPort),
		"--cert-dir", filepath.Join(cp.Dir, "pki"), "--tls-cert-file", cp.pki("apiserver.crt"), "--tls-private-key-file", cp.pki("apiserver.key"),
		"--client-ca-file", cp.pki("ca.crt"),
		"--service-account-key-file", cp.pki("sa.key"), "--service-account-signing-key-file", cp.pki("sa.key"),
		"--service-cluster-ip-range", cp.ServiceCIDR, "--allow-privileged=true", "--profiling=false"}
	if !cp.Nodes {
		return append(args, "--bind-address", "127.0.0.1", "--authorization-mode", "RBAC", "--service-account-issuer", cp.URL()+"/",
			"--disable-admission-plugins", "ServiceAccount,TaintNodesByCondition")
	}
	args = append(args, "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--service-account-issuer", "https://kubernetes.default.svc")
	if cp.AdvertiseAddress != nil {
		// Pods reach it at the node's address, through the bridge.
		args = append(args, "--bind-address", "0.0.0.0", "--advertise-address", cp.AdvertiseAddress.String())
	} else {
		args = append(args, "--bind-address", "127.0.0.1")
	}
	return args
}

// CAFile is the CA's certificate of the control plane made under dir
// (for --root-ca-file, say).
func CAFile(dir string) string { return filepath.Join(dir, "pki", "ca.crt") }

// ReadyURL answers 200 "ok" once kube-apiserver serves (asked with a
// client of Config).
func (cp *ControlPlane) ReadyURL() string { return cp.URL() + "/readyz" }

// Config is a client configuration for user in groups (system:masters for
// everything): a client certificate the CA signs.
func (cp *ControlPlane) Config(user string, groups ...string) (*rest.Config, error) {
	cert, key, err := cp.CA.Client(user, groups...)
	if err != nil {
		return nil, err
	}
	return &rest.Config{Host: cp.URL(), QPS: 500, Burst: 1000,
		TLSClientConfig: rest.TLSClientConfig{CAData: cp.CA.PEM, CertData: cert, KeyData: key}}, nil
}

// KubeConfig is a kubeconfig file's contents for user in groups, for the
// processes the caller starts and for people.
func (cp *ControlPlane) KubeConfig(user string, groups ...string) ([]byte, error) {
	cfg, err := cp.Config(user, groups...)
	if err != nil {
		return nil, err
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["local"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData}
	kc.Contexts["local"] = &clientcmdapi.Context{Cluster: "local", AuthInfo: user}
	kc.CurrentContext = "local"
	out, err := clientcmd.Write(*kc)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig for %s: %w", user, err)
	}
	return out, nil
}
