package controlplane

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"time"
)

// CA is the local cluster's one certificate authority: it signs the API
// server's serving certificate, the webhook's, and every identity's client
// certificate (kube-apiserver's --client-ca-file takes a certificate's
// common name as the user and its organizations as the groups).
type CA struct {
	cert *x509.Certificate
	key  crypto.Signer
	// PEM is the CA's certificate, for the clients' trust and the API
	// server's client authentication.
	PEM []byte
}

// certLife is how long the local cluster's certificates are valid: far
// longer than any local cluster runs, short enough to mean nothing later.
const certLife = 7 * 24 * time.Hour

// NewCA makes a CA with a fresh key.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(certLife),
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Serving issues a serving certificate for the loopback host, ips and
// dnsNames.
func (ca *CA) Serving(name string, ips []net.IP, dnsNames ...string) (certPEM, keyPEM []byte, err error) {
	return ca.issue(&x509.Certificate{Subject: pkix.Name{CommonName: name}, DNSNames: append([]string{"localhost"}, dnsNames...),
		IPAddresses: append([]net.IP{net.IPv4(127, 0, 0, 1)}, ips...), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
}

// Client issues a client certificate for user in groups.
func (ca *CA) Client(user string, groups ...string) (certPEM, keyPEM []byte, err error) {
	return ca.issue(&x509.Certificate{Subject: pkix.Name{CommonName: user, Organization: groups},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
}

func (ca *CA) issue(tmpl *x509.Certificate) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl.SerialNumber, tmpl.NotBefore, tmpl.NotAfter = serial(), now.Add(-time.Minute), now.Add(certLife)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("certificate for %s: %w", tmpl.Subject.CommonName, err)
	}
	keyPEM, err = privateKeyPEM(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM, err
}

// NewKeyPEM is a fresh private key, PEM-encoded (the service-account
// signing key).
func NewKeyPEM() ([]byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	return privateKeyPEM(key)
}

func privateKeyPEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return big.NewInt(time.Now().UnixNano())
	}
	return n
}
