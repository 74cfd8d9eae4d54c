// Package health serves the /healthz and /readyz probes of gpufrac's
// long-running components.
package health

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Serve answers /healthz while the process runs and /readyz while ready
// returns nil (with its error otherwise), plus any extra handlers (such as
// /metrics), on addr, until ctx ends.
func Serve(ctx context.Context, addr string, ready func() error, extra map[string]http.Handler) error {
	mux := http.NewServeMux()
	for path, h := range extra {
		mux.Handle(path, h)
	}
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok"))
	})
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("health endpoint %s: %w", addr, err)
	}
	return nil
}
