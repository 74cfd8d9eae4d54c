package localcluster

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy forwards TCP connections on a loopback port to one of its
// backends, as a Service's virtual IP does: each new connection goes to
// the next backend that accepts it, so a replica that died is passed over.
// It carries TLS untouched (the backends' certificates name the loopback
// address, not a port). A soak uses its faults: Cut closes every
// connection open through it (watches included, as a network partition or
// a load balancer's restart would) and SetDelay holds every chunk the
// backends send back for a while (a slow API server).
type Proxy struct {
	l        net.Listener
	backends []string
	next     atomic.Uint64
	delay    atomic.Int64 // nanoseconds
	mu       sync.Mutex
	conns    map[net.Conn]bool
	closed   bool
	wg       sync.WaitGroup
}

// NewProxy listens on a free loopback port and forwards to backends
// (host:port each).
func NewProxy(backends ...string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{l: l, backends: backends, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr is where it listens, host:port.
func (p *Proxy) Addr() string { return p.l.Addr().String() }

// Cut closes every connection open now; new ones are served.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.conns)
	for c := range p.conns {
		_ = c.Close()
	}
	return n
}

// SetDelay holds each chunk a backend sends for d (0: none).
func (p *Proxy) SetDelay(d time.Duration) { p.delay.Store(int64(d)) }

// Close stops listening and closes every connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	err := p.l.Close()
	p.Cut()
	p.wg.Wait()
	return err
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return // closed
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.forward(c)
		}()
	}
}

// dial connects to the next backend that answers, trying each once.
func (p *Proxy) dial() (net.Conn, error) {
	start := p.next.Add(1)
	var errs []error
	for i := range p.backends {
		b := p.backends[(int(start)+i)%len(p.backends)]
		c, err := net.DialTimeout("tcp", b, 2*time.Second)
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

// track adds or removes open connections; false: the proxy is closed.
func (p *Proxy) track(add bool, cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		if add {
			p.conns[c] = true
		} else {
			delete(p.conns, c)
		}
	}
	return !p.closed
}

func (p *Proxy) forward(client net.Conn) {
	backend, err := p.dial()
	if err != nil {
		_ = client.Close()
		return
	}
	if !p.track(true, client, backend) {
		_ = client.Close()
		_ = backend.Close()
		return
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(backend, client); done <- struct{}{} }()
	go func() { _, _ = io.Copy(client, delayedReader{backend, &p.delay}); done <- struct{}{} }()
	<-done
	_ = client.Close()
	_ = backend.Close()
	<-done
	p.track(false, client, backend)
}

// delayedReader holds each chunk read for the proxy's delay.
type delayedReader struct {
	r     io.Reader
	delay *atomic.Int64
}

func (d delayedReader) Read(b []byte) (int, error) {
	n, err := d.r.Read(b)
	if wait := time.Duration(d.delay.Load()); wait > 0 && n > 0 {
		time.Sleep(wait)
	}
	return n, err
}
