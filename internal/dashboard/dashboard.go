// Package dashboard serves a read-only web view of the cluster's GPUs: the
// view `gpufrac top` prints (package clusterview, over the same ledgers as
// the scheduler), with the scheduler's reasons for pending pods, pushed to
// the page as it changes. It watches pods, nodes and FailedScheduling
// events through informers and rebuilds the view a moment after a change;
// the page receives each new view over one Server-Sent Events stream. The
// page, its script and style are embedded: nothing is fetched from
// elsewhere at run time.
package dashboard

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/clusterview"
)

//go:embed static
var static embed.FS

// Options say what to watch and how to count.
type Options struct {
	Client kubernetes.Interface
	// Settle is how long a change waits for more before the view is
	// rebuilt (a burst of pod updates becomes one push); default 200 ms.
	Settle time.Duration
	// AllowedHosts are the host names (no port) the dashboard answers
	// besides the loopback ones (localhost, loopback IPs: what kubectl
	// port-forward sends): its Service's DNS names, an Ingress's host.
	AllowedHosts []string
}

// Server is the dashboard.
type Server struct {
	opts   Options
	pods   func() ([]*corev1.Pod, error)
	nodes  func() ([]*corev1.Node, error)
	events func() ([]*corev1.Event, error)
	// claims are the DRA claims, whose shares of gpufrac's driver sit on
	// the same GPUs; nil on a cluster that serves no resource.k8s.io/v1.
	claims  func() ([]*resourceapi.ResourceClaim, error)
	changed chan struct{}
	synced  chan struct{}

	// history is the last hour of use per GPU and tenant (rebuild only).
	history *clusterview.History

	mu      sync.Mutex
	current []byte                   // the latest view, as JSON
	subs    map[chan []byte]struct{} // open event streams
	closed  bool                     // shutting down: no new streams
}

// New returns a dashboard over opts.Client; Run starts it.
func New(opts Options) *Server {
	if opts.Settle <= 0 {
		opts.Settle = 200 * time.Millisecond
	}
	return &Server{opts: opts, changed: make(chan struct{}, 1), synced: make(chan struct{}), subs: map[chan []byte]struct{}{},
		history: clusterview.NewHistory(HistorySpan)}
}

// Run watches the cluster and serves the dashboard on l until ctx ends.
func (s *Server) Run(ctx context.Context, l net.Listener) error {
	logger := klog.FromContext(ctx)
	factory := informers.NewSharedInformerFactory(s.opts.Client, 0)
	// Only the scheduler's FailedScheduling events: the pending pods' reasons.
	eventFactory := informers.NewSharedInformerFactoryWithOptions(s.opts.Client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("reason", clusterview.ReasonFailedScheduling).String()
	}))
	podInformer, nodeInformer := factory.Core().V1().Pods(), factory.Core().V1().Nodes()
	eventInformer := eventFactory.Core().V1().Events()
	poke := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.poke() },
		UpdateFunc: func(any, any) { s.poke() },
		DeleteFunc: func(any) { s.poke() },
	}
	watched := []cache.SharedIndexInformer{podInformer.Informer(), nodeInformer.Informer(), eventInformer.Informer()}
	if servesClaims(s.opts.Client) {
		claimInformer := factory.Resource().V1().ResourceClaims()
		watched = append(watched, claimInformer.Informer())
		s.claims = func() ([]*resourceapi.ResourceClaim, error) { return claimInformer.Lister().List(labels.Everything()) }
	}
	for _, inf := range watched {
		if _, err := inf.AddEventHandler(poke); err != nil {
			return err
		}
	}
	s.pods = func() ([]*corev1.Pod, error) { return podInformer.Lister().List(labels.Everything()) }
	s.nodes = func() ([]*corev1.Node, error) { return nodeInformer.Lister().List(labels.Everything()) }
	s.events = func() ([]*corev1.Event, error) { return eventInformer.Lister().List(labels.Everything()) }

	// Requests end with ctx (BaseContext): no stream outlives Run.
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, BaseContext: func(net.Listener) context.Context { return ctx }}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	factory.Start(ctx.Done())
	eventFactory.Start(ctx.Done())
	defer factory.Shutdown()
	defer eventFactory.Shutdown()
	for _, f := range []interface {
		WaitForCacheSync(<-chan struct{}) map[reflect.Type]bool
	}{factory, eventFactory} {
		for _, ok := range f.WaitForCacheSync(ctx.Done()) {
			if !ok {
				// Stopped before the first sync: a stop, not a failure.
				s.closeStreams()
				return srv.Close()
			}
		}
	}
	if err := s.rebuild(); err != nil {
		return errors.Join(err, srv.Close())
	}
	close(s.synced)
	logger.Info("Serving the dashboard", "url", "http://"+l.Addr().String()+"/")
	// Rebuilt now and then with no change too: a node whose agent died
	// stops sending readings, and its last one must go once stale
	// (clusterview.StaleUsage), as must a silent agent's readiness.
	tick := time.NewTicker(staleCheck)
	defer tick.Stop()
	var last time.Time // the latest rebuild
	for {
		select {
		case <-tick.C:
			s.poke()
		case <-ctx.Done():
			shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			s.closeStreams()
			return srv.Shutdown(shutdown)
		case err := <-served:
			return err
		case <-s.changed:
			// Let a burst of changes settle into one rebuild, and push
			// at most one view a MinPush: every node's agent rewrites its
			// tenants' use each minute, and a thousand nodes would
			// otherwise redraw every open page many times a second.
			wait := max(s.opts.Settle, time.Until(last.Add(MinPush)))
			select {
			case <-ctx.Done():
			case <-time.After(wait):
			}
			last = time.Now()
			if err := s.rebuild(); err != nil {
				logger.Error(err, "Could not rebuild the view; keeping the last one")
			}
		}
	}
}

func (s *Server) poke() {
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// view builds the view from what the informers hold.
func (s *Server) view() (clusterview.View, error) {
	pods, err := s.pods()
	if err != nil {
		return clusterview.View{}, err
	}
	nodes, err := s.nodes()
	if err != nil {
		return clusterview.View{}, err
	}
	events, err := s.events()
	if err != nil {
		return clusterview.View{}, err
	}
	// `gpufrac top`'s view, with reasons from events where a pending pod
	// has no condition that says why.
	var claims []resourceapi.ResourceClaim
	if s.claims != nil {
		list, err := s.claims()
		if err != nil {
			return clusterview.View{}, err
		}
		claims = deref(list)
	}
	return clusterview.WithReasons(clusterview.Build(deref(nodes), deref(pods), claims), deref(events)), nil
}

// servesClaims says whether the cluster serves ResourceClaims
// (resource.k8s.io/v1, Kubernetes 1.34 and later): an informer for a
// resource the API server does not have would never sync.
func servesClaims(client kubernetes.Interface) bool {
	list, err := client.Discovery().ServerResourcesForGroupVersion(resourceapi.SchemeGroupVersion.String())
	if err != nil {
		return false
	}
	for _, r := range list.APIResources {
		if r.Name == "resourceclaims" {
			return true
		}
	}
	return false
}

func deref[T any](in []*T) []T {
	out := make([]T, len(in))
	for i, p := range in {
		out[i] = *p
	}
	return out
}

// HistorySpan is how much of each GPU's and tenant's use the page shows.
const HistorySpan = time.Hour

// staleCheck is how often the view is rebuilt with nothing changed.
const staleCheck = 30 * time.Second

// MinPush is the least time between two rebuilds of the view.
const MinPush = time.Second

// rebuild makes the view again, with the history of use, and, when it
// changed, pushes it to every open stream.
func (s *Server) rebuild() error {
	v, err := s.view()
	if err != nil {
		return err
	}
	s.history.Record(v)
	s.history.Attach(&v)
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if bytes.Equal(raw, s.current) {
		return nil
	}
	s.current = raw
	for sub := range s.subs {
		send(sub, raw)
	}
	return nil
}

// send gives a stream the latest view, replacing one it has not taken yet:
// a slow page skips views, never falls behind.
func send(sub chan []byte, raw []byte) {
	for {
		select {
		case sub <- raw:
			return
		default:
		}
		select {
		case <-sub:
		default:
		}
	}
}

// subscribe opens a stream: its channel gets each new view, and is
// closed at shutdown (nil once shutting down).
func (s *Server) subscribe() (chan []byte, []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil
	}
	sub := make(chan []byte, 1)
	s.subs[sub] = struct{}{}
	return sub, s.current
}

func (s *Server) unsubscribe(sub chan []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.subs, sub)
}

// closeStreams ends every open stream, so that shutdown need not wait
// for the pages to leave.
func (s *Server) closeStreams() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for sub := range s.subs {
		close(sub)
		delete(s.subs, sub)
	}
}

// Handler serves the page (/), the view as JSON (/api/view, as `gpufrac
// top -o json` prints it, with reasons), the stream of views
// (/api/stream), /healthz (ok once the informers have synced: readiness)
// and /livez (ok while it serves). Only GET and HEAD: the dashboard
// changes nothing.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	files, err := fs.Sub(static, "static")
	if err != nil {
		panic(err) // the embedded tree is part of the binary
	}
	mux.Handle("GET /", http.FileServerFS(files))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		select {
		case <-s.synced:
			_, _ = w.Write([]byte("ok\n"))
		default:
			http.Error(w, "informers not synced yet", http.StatusServiceUnavailable)
		}
	})
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /api/view", func(w http.ResponseWriter, _ *http.Request) {
		raw := s.snapshot()
		if raw == nil {
			http.Error(w, "informers not synced yet", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(raw)
	})
	mux.HandleFunc("GET /api/stream", s.stream)
	return s.secure(mux)
}

// snapshot is the latest view as JSON; nil before the first sync.
func (s *Server) snapshot() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.current
}

// stream sends the current view, then each new one, as Server-Sent Events
// ("view" events, one JSON view each), with a comment every 20 s to keep
// proxies from closing an idle stream.
func (s *Server) stream(w http.ResponseWriter, r *http.Request) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	sub, current := s.subscribe()
	if sub == nil {
		http.Error(w, "shutting down", http.StatusServiceUnavailable)
		return
	}
	defer s.unsubscribe(sub)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	write := func(raw []byte) bool {
		_, err := fmt.Fprintf(w, "event: view\ndata: %s\n\n", raw)
		flusher.Flush()
		return err == nil
	}
	if current != nil && !write(current) {
		return
	}
	flusher.Flush()
	keepalive := time.NewTicker(20 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case <-r.Context().Done():
			return
		case raw, open := <-sub:
			if !open || !write(raw) {
				return
			}
		case <-keepalive.C:
			if _, err := fmt.Fprint(w, ": keepalive\n\n"); err != nil {
				return
			}
			flusher.Flush()
		}
	}
}

// secure sets the headers of a read-only page that loads nothing from
// elsewhere: only its own script and style, no framing, no sniffing. It
// answers only requests for a loopback host or one of AllowedHosts,
// wherever it listens: a page on the web that rebinds its own name to
// 127.0.0.1 (or to the address kubectl port-forward serves on) gets
// nothing. The probes, which say nothing of the cluster, are answered for
// any host: the kubelet names the pod's IP.
func (s *Server) secure(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		probe := r.URL.Path == "/livez" || r.URL.Path == "/healthz"
		if !probe && !loopbackHost(r.Host) && !s.allowedHost(r.Host) {
			http.Error(w, fmt.Sprintf("host %q: this dashboard answers only localhost, a loopback IP or its --allowed-host names (%s)", r.Host, strings.Join(s.opts.AllowedHosts, ", ")), http.StatusMisdirectedRequest)
			return
		}
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		next.ServeHTTP(w, r)
	})
}

// allowedHost reports whether a Host header names one of AllowedHosts.
func (s *Server) allowedHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	return slices.ContainsFunc(s.opts.AllowedHosts, func(a string) bool { return strings.EqualFold(a, host) })
}

// loopbackHost reports whether a Host header names this machine's loopback:
// localhost or a loopback IP, with or without a port.
func loopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
