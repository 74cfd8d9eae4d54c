package admission

import (
	"context"
	"errors"
	"fmt"
	"net"

	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/gpufrac/gpufrac/internal/health"
)

// ServerOptions configure the admission webhook server.
type ServerOptions struct {
	// Host and Port are where the TLS webhook endpoint listens.
	Host string
	Port int
	// CertDir holds tls.crt and tls.key; the server reloads them when they
	// change, so a rotated certificate needs no restart.
	CertDir string
	// HealthAddr serves /healthz and /readyz over plain HTTP; "" disables it.
	HealthAddr string
	// Identity is who counts as the scheduler.
	Identity Identity
	// SchedulerName, when set, is given to fractional pods that chose no scheduler.
	SchedulerName string
	// Charger sizes the GPU memory each pod is charged to its namespace's
	// quota (NewCharger builds one on the API server).
	Charger Charger
}

// Server serves the validating and mutating webhooks and the health probes.
type Server struct {
	opts    ServerOptions
	webhook webhook.Server
}

// NewServer builds the server; Start runs it.
func NewServer(opts ServerOptions) *Server {
	ws := webhook.NewServer(webhook.Options{Host: opts.Host, Port: opts.Port, CertDir: opts.CertDir})
	identity := opts.Identity
	identity.DefaultScheduler = opts.SchedulerName
	validator := &Validator{Identity: identity}
	if pods, ok := opts.Charger.Claims.(PodSource); ok && !opts.Charger.Off {
		validator.Guard = &ClaimGuard{Claims: opts.Charger.Claims, Pods: pods}
	}
	ws.Register(ValidatePath, &webhook.Admission{Handler: validator})
	ws.Register(MutatePath, &webhook.Admission{Handler: &Mutator{SchedulerName: opts.SchedulerName, Charger: opts.Charger, AllowRootMPSClients: identity.AllowRootMPSClients}})
	return &Server{opts: opts, webhook: ws}
}

// Start serves until ctx is cancelled, then shuts down gracefully.
func (s *Server) Start(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, 2)
	servers := 1
	go func() { errs <- s.webhook.Start(ctx) }()
	if s.opts.HealthAddr != "" {
		servers++
		go func() {
			errs <- health.Serve(ctx, s.opts.HealthAddr, func() error { return s.StartedChecker()(nil) }, nil)
		}()
	}
	logger.Info("Serving admission webhooks", "address", net.JoinHostPort(s.opts.Host, fmt.Sprint(s.opts.Port)),
		"certDir", s.opts.CertDir, "health", s.opts.HealthAddr, "schedulerUsers", s.opts.Identity.Users)
	// The first to end ends the other; both are waited for: a webhook
	// server still answering the API server's requests (its graceful
	// shutdown) must not be cut off by the process's exit, which the API
	// server sees as EOF and, failing closed, refuses the pod.
	err := <-errs
	cancel()
	for range servers - 1 {
		err = errors.Join(err, <-errs)
	}
	return err
}

// StartedChecker reports ready once the TLS endpoint accepts connections.
func (s *Server) StartedChecker() healthz.Checker { return s.webhook.StartedChecker() }
