package admission

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// writeCert writes a self-signed serving certificate with the given serial
// into dir as tls.crt/tls.key, replacing the files atomically as a Secret
// volume update does.
func writeCert(t *testing.T, dir string, serial int64) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "gpufrac-webhook"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	for name, block := range map[string]*pem.Block{"tls.key": {Type: "EC PRIVATE KEY", Bytes: keyDER}, "tls.crt": {Type: "CERTIFICATE", Bytes: der}} {
		tmp := filepath.Join(dir, name+".tmp")
		if err := os.WriteFile(tmp, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port
}

func servedSerial(addr string) (int64, error) {
	conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // reading the served certificate is the test
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.Int64(), nil
}

func TestServerReloadsCertificatesAndReportsHealth(t *testing.T) {
	dir := t.TempDir()
	writeCert(t, dir, 1)
	port, healthPort := freePort(t), freePort(t)
	srv := NewServer(ServerOptions{Host: "127.0.0.1", Port: port, CertDir: dir, HealthAddr: net.JoinHostPort("127.0.0.1", itoa(healthPort)), Identity: identity})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Start(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("server stopped with error: %v", err)
		}
	}()

	addr := net.JoinHostPort("127.0.0.1", itoa(port))
	health := "http://" + net.JoinHostPort("127.0.0.1", itoa(healthPort))
	poll := func(what string, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return cond(), nil
		}); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	status := func(path string) int {
		resp, err := http.Get(health + path) //nolint:noctx // test helper against a local server
		if err != nil {
			return 0
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	poll("ready", func() bool { return status("/readyz") == http.StatusOK })
	if got := status("/healthz"); got != http.StatusOK {
		t.Errorf("/healthz = %d", got)
	}
	if serial, err := servedSerial(addr); err != nil || serial != 1 {
		t.Fatalf("served serial %d, %v; want 1", serial, err)
	}
	writeCert(t, dir, 2)
	poll("rotated certificate served", func() bool { serial, err := servedSerial(addr); return err == nil && serial == 2 })
}

func itoa(n int) string { return strconv.Itoa(n) }
