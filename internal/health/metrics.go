package health

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
)

// Authorizer wraps a handler so that only authorized callers reach it.
type Authorizer func(http.Handler) (http.Handler, error)

// KubernetesAuthorizer lets through the callers the API server vouches
// for: a bearer token it accepts (TokenReview) of a user allowed to get
// the non-resource URL /metrics (SubjectAccessReview), as kube-scheduler
// and the kubelet guard theirs. The metrics name every tenant's pods and
// their GPU memory, which is no tenant's business.
func KubernetesAuthorizer(cfg *rest.Config) (Authorizer, error) {
	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	filter, err := filters.WithAuthenticationAndAuthorization(cfg, httpClient)
	if err != nil {
		return nil, err
	}
	return func(h http.Handler) (http.Handler, error) { return filter(logr.Discard(), h) }, nil
}

// ServeMetrics serves handler at /metrics over TLS with a self-signed
// certificate made at start (scrapers skip verification or pin nothing,
// as for every component's secure metrics port), through authorize, on
// addr until ctx ends. Without an authorizer it refuses to serve: metrics
// are not served in the open.
func ServeMetrics(ctx context.Context, addr string, handler http.Handler, authorize Authorizer) error {
	if authorize == nil {
		return errors.New("metrics endpoint: no authorizer: refusing to serve the metrics unguarded")
	}
	guarded, err := authorize(handler)
	if err != nil {
		return fmt.Errorf("metrics endpoint %s: %w", addr, err)
	}
	host, _ := os.Hostname()
	certPEM, keyPEM, err := certutil.GenerateSelfSignedCertKey(host, []net.IP{net.ParseIP("127.0.0.1")}, nil)
	if err != nil {
		return fmt.Errorf("metrics endpoint %s: self-signed certificate: %w", addr, err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("metrics endpoint %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", guarded)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics endpoint %s: %w", addr, err)
	}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.ServeTLS(l, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics endpoint %s: %w", addr, err)
	}
	return nil
}
