// Package incusfault puts a fault-injecting proxy between a test's Incus
// client and the real Incus daemon, for the failures a healthy daemon never
// shows on demand: a refused or reset connection, a request that is never
// answered, a slow answer, a 5xx, an answer lost after the request took
// effect (the ambiguous case every retry must survive), a cut event stream,
// a socket that is down and a daemon that hangs.
//
// The proxy listens on a unix socket of its own (the incus package reaches a
// local daemon through Config.Socket; a TCP listener would need Incus's
// client-certificate TLS, which this proxy does not terminate) and forwards
// every request to the Incus socket as it arrives, streaming both ways: long
// polls such as GET /1.0/operations/{id}/wait and WebSocket upgrades such as
// GET /1.0/events pass through untouched until a fault says otherwise.
//
// Faults are rules (method, path pattern, query substring, fault, how many
// times, how likely), added and removed while the test runs; counters tell a
// test which calls the client made and which of them reached Incus.
//
//	p, err := incusfault.Start(t.Context(), incusfault.Config{Upstream: incustest.Socket()})
//	if err != nil { t.Fatal(err) }
//	t.Cleanup(func() { _ = p.Close() })
//	c, _ := incus.New(incus.Config{Socket: p.Socket(), Project: project})
//	p.Add(incusfault.Rule{Method: "PUT", Path: "/1.0/instances/*/state", Fault: incusfault.DropResponse, Times: 1})
//
// Every goroutine the proxy starts is stopped by Close, which waits for them
// (boundedly) and reports any that did not end.
package incusfault

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/lazyconn"
)

// DefaultUpstream is the Incus socket requests go to when Config.Upstream is empty.
const DefaultUpstream = "/var/lib/incus/unix.socket"

// closeTimeout bounds how long Close waits for the proxy's goroutines.
// Everything they block on is released by Close itself, so only a defect
// makes this run out.
const closeTimeout = 10 * time.Second

// Config says where the proxy listens and where it forwards.
type Config struct {
	// Upstream is the Incus unix socket; default DefaultUpstream.
	Upstream string

	// Socket is where the proxy listens. By default it is a socket in a
	// fresh directory under os.TempDir, removed by Close: unix socket
	// paths are limited to 107 bytes, which t.TempDir paths often exceed.
	Socket string

	// Seed seeds the generator that Rule.Probability draws from, so that a
	// test run with the same seed and the same order of requests injects
	// the same faults.
	Seed uint64

	// Logf, when set, is told about every fault applied and every failure
	// to reach Incus (t.Logf fits: Close returns before the test ends).
	Logf func(format string, args ...any)
}

// ID names a rule added with Add.
type ID uint64

// Proxy is a running fault-injecting proxy. Its methods are safe for
// concurrent use, also while requests are in flight.
type Proxy struct {
	upstream string
	socket   string
	tmpDir   string // made by Start, removed by Close
	logf     func(format string, args ...any)

	// ctx ends when the proxy closes; every hold, forward and relay is
	// bounded by it.
	ctx        context.Context
	cancel     context.CancelFunc
	stopParent func() bool

	srv    *http.Server
	rp     *httputil.ReverseProxy
	tr     *http.Transport
	dialer net.Dialer

	// wg counts every goroutine of the proxy: accept loops, connections
	// (from StateNew until closed or hijacked), handlers and relay copiers.
	// Each Add happens inside something already counted, or under mu with
	// closed false, so Close's Wait never races an Add from zero.
	wg sync.WaitGroup

	mu        sync.Mutex
	closed    bool
	ln        *net.UnixListener // nil while RefuseAll is on
	conns     map[*trackedConn]struct{}
	relays    map[*relay]struct{}
	rules     []*rule
	nextID    ID
	rng       *rand.Rand
	hang      chan struct{} // non-nil while HangAll is on; closed when it goes off
	held      int
	seen      map[reqKey]int
	forwarded map[reqKey]int

	closeOnce sync.Once
	closeErr  error
}

type rule struct {
	Rule
	id      ID
	hits    int
	cleared chan struct{} // closed by Remove or Clear: releases held requests
}

type reqKey struct{ method, path string }

// Start listens and begins forwarding. The proxy closes when ctx ends, as
// by Close; call Close anyway, to wait for it and to see its error.
func Start(ctx context.Context, cfg Config) (*Proxy, error) {
	p := &Proxy{
		upstream:  cfg.Upstream,
		socket:    cfg.Socket,
		logf:      cfg.Logf,
		conns:     map[*trackedConn]struct{}{},
		relays:    map[*relay]struct{}{},
		rng:       rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)),
		seen:      map[reqKey]int{},
		forwarded: map[reqKey]int{},
		dialer:    net.Dialer{Timeout: 5 * time.Second},
	}
	if p.upstream == "" {
		p.upstream = DefaultUpstream
	}
	if p.logf == nil {
		p.logf = func(string, ...any) {}
	}
	if p.socket == "" {
		dir, err := os.MkdirTemp("", "incusfault-")
		if err != nil {
			return nil, fmt.Errorf("incusfault: %w", err)
		}
		p.tmpDir = dir
		p.socket = filepath.Join(dir, "unix.socket")
	}
	ln, err := p.listen(false)
	if err != nil {
		if p.tmpDir != "" {
			_ = os.RemoveAll(p.tmpDir)
		}
		return nil, err
	}

	p.tr = &http.Transport{
		// Lazily, as the incus client does (internal/lazyconn): a dial
		// the transport parks unused would otherwise stall every other
		// client of the real socket, tests running beside this one too.
		DialContext: func(context.Context, string, string) (net.Conn, error) {
			return lazyconn.New(&net.UnixAddr{Name: p.upstream, Net: "unix"}, func() (net.Conn, error) {
				// The dialer's own timeout bounds it.
				return p.dialer.DialContext(context.Background(), "unix", p.upstream)
			}), nil
		},
		MaxIdleConns:        32,
		MaxIdleConnsPerHost: 32,
		IdleConnTimeout:     90 * time.Second,
		// The client's own Accept-Encoding goes through as it is; the
		// proxy must not add compression the client did not ask for.
		DisableCompression: true,
	}
	errorLog := log.New(io.Discard, "", 0)
	if cfg.Logf != nil {
		errorLog = log.New(logWriter(cfg.Logf), "incusfault: ", 0)
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = "unix.socket"
			pr.Out.Host = pr.In.Host
			p.count(p.forwarded, pr.In)
		},
		Transport: p.tr,
		// Streamed answers (long polls, chunked bodies) reach the client
		// as Incus writes them.
		FlushInterval:  -1,
		ErrorLog:       errorLog,
		ModifyResponse: dropIfMarked,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if !errors.Is(err, errDropped) && r.Context().Err() == nil {
				p.logf("incusfault: %s %s: upstream: %v", r.Method, r.URL.Path, err)
			}
			// The client sees what it would see of a daemon that failed
			// mid-call: a closed connection, not an answer the proxy made up.
			hangUp(w)
		},
	}
	p.srv = &http.Server{
		// Not p itself: a Proxy is no handler for anyone else to mount.
		Handler:           http.HandlerFunc(p.serveHTTP),
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          errorLog,
		ConnState:         p.connState,
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.mu.Lock()
	p.serve(ln)
	p.mu.Unlock()
	// Not Close: that reads stopParent, which this may run before.
	p.stopParent = context.AfterFunc(ctx, p.closeAndWait)
	return p, nil
}

// Socket is the path of the proxy's unix socket, for incus.Config.Socket.
func (p *Proxy) Socket() string { return p.socket }

// Add installs a rule and returns its ID. Rules are tried in the order they
// were added; the first that matches a request (and is not spent, and wins
// its draw) applies. A malformed rule is a defect in the test: Add panics.
func (p *Proxy) Add(r Rule) ID {
	if why := r.check(); why != "" {
		panic(fmt.Sprintf("incusfault: Add(%v): %s", r, why))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.nextID++
	p.rules = append(p.rules, &rule{Rule: r, id: p.nextID, cleared: make(chan struct{})})
	return p.nextID
}

// Remove takes a rule out; requests it holds (BlackHole) go on to Incus.
// It reports whether the rule was there.
func (p *Proxy) Remove(id ID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, r := range p.rules {
		if r.id == id {
			close(r.cleared)
			p.rules = append(p.rules[:i], p.rules[i+1:]...)
			return true
		}
	}
	return false
}

// Clear removes every rule, as Remove does. HangAll and RefuseAll are
// switched off only by their own calls.
func (p *Proxy) Clear() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.rules {
		close(r.cleared)
	}
	p.rules = nil
}

// Hits is how many requests a rule has applied its fault to (0 for an
// unknown or removed rule).
func (p *Proxy) Hits(id ID) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.rules {
		if r.id == id {
			return r.hits
		}
	}
	return 0
}

// HangAll on makes the proxy a hung daemon: every request that would go on
// to Incus from now on is held unanswered instead. Off lets the held
// requests whose clients still wait go on, as a daemon that recovers
// serves its backlog. Requests already at Incus are not affected.
func (p *Proxy) HangAll(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case on && p.hang == nil:
		p.hang = make(chan struct{})
	case !on && p.hang != nil:
		close(p.hang)
		p.hang = nil
	}
}

// RefuseAll on takes the socket down as a stopped daemon does: the proxy
// stops listening, so a new connection is refused (ECONNREFUSED, the
// socket file stays), and every connection open now is closed, in flight or
// idle, so that no client keeps working on a pooled connection. Off listens
// again on the same path; its error is that of listening.
func (p *Proxy) RefuseAll(on bool) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	if !on {
		defer p.mu.Unlock()
		if p.ln != nil {
			return nil
		}
		ln, err := p.listen(true)
		if err != nil {
			return err
		}
		p.serve(ln)
		return nil
	}
	ln := p.ln
	p.ln = nil
	conns := p.connList()
	p.mu.Unlock()
	if ln != nil {
		_ = ln.Close()
	}
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
}

// CutEvents closes every /1.0/events stream open now, both ways, as a
// daemon restart or a network cut would, and returns how many it closed.
// To refuse new streams as well, add a rule:
//
//	p.Add(incusfault.Rule{Method: "GET", Path: "/1.0/events", Fault: incusfault.Refuse})
func (p *Proxy) CutEvents() int {
	p.mu.Lock()
	var cut []*relay
	for r := range p.relays {
		if r.path == "/1.0/events" {
			cut = append(cut, r)
		}
	}
	p.mu.Unlock()
	for _, r := range cut {
		r.close()
	}
	return len(cut)
}

// Seen counts the requests the proxy has read whose method (empty: any)
// and path (a pattern, see Match) match, whether or not they were forwarded.
func (p *Proxy) Seen(method, pattern string) int { return p.sum(p.seen, method, pattern) }

// Forwarded counts the matching requests the proxy passed on to Incus: with
// no request forwarded, Incus was not called.
func (p *Proxy) Forwarded(method, pattern string) int {
	return p.sum(p.forwarded, method, pattern)
}

// Held is how many requests are being held right now (BlackHole, Delay,
// HangAll), so that a test can wait for its request to be in the trap.
func (p *Proxy) Held() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held
}

// Close stops listening, closes every connection (held, relayed or idle),
// stops every goroutine of the proxy and removes the socket. It returns an
// error if some goroutine did not end in time (a defect of the proxy).
// Calling it again returns the same result.
func (p *Proxy) Close() error {
	p.stopParent()
	p.closeAndWait()
	return p.closeErr
}

func (p *Proxy) closeAndWait() {
	p.closeOnce.Do(func() { p.closeErr = p.shutdown() })
}

func (p *Proxy) shutdown() error {
	p.mu.Lock()
	p.closed = true
	ln := p.ln
	p.ln = nil
	conns := p.connList()
	p.mu.Unlock()

	p.cancel()
	if ln != nil {
		_ = ln.Close()
	}
	_ = p.srv.Close()
	for _, c := range conns {
		_ = c.Close()
	}

	done := make(chan struct{})
	go func() {
		p.wg.Wait()
		close(done)
	}()
	var err error
	t := time.NewTimer(closeTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		err = fmt.Errorf("incusfault: close: goroutines still running after %s", closeTimeout)
	}
	p.tr.CloseIdleConnections()
	_ = os.Remove(p.socket)
	if p.tmpDir != "" {
		_ = os.RemoveAll(p.tmpDir)
	}
	return err
}

// listen opens the proxy's socket. With ours, the socket file there is the
// one RefuseAll left and is replaced; Start never replaces a file, which
// might be another daemon's socket. The caller holds mu or is Start.
func (p *Proxy) listen(ours bool) (*net.UnixListener, error) {
	if fi, err := os.Lstat(p.socket); ours && err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(p.socket)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: p.socket, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("incusfault: listen on %s: %w", p.socket, err)
	}
	// RefuseAll closes the listener but keeps the file, so that a dial is
	// refused, as at a socket whose daemon stopped, rather than not found.
	ln.SetUnlinkOnClose(false)
	return ln, nil
}

// serve runs an accept loop on ln; the caller holds mu.
func (p *Proxy) serve(ln *net.UnixListener) {
	p.ln = ln
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		// Serve ends with the listener's close (RefuseAll, Close); that
		// error says nothing the caller did not ask for.
		_ = p.srv.Serve(&trackingListener{UnixListener: ln, p: p})
	}()
}

func (p *Proxy) connState(_ net.Conn, s http.ConnState) {
	switch s {
	case http.StateNew:
		p.wg.Add(1)
	case http.StateClosed, http.StateHijacked:
		// A hijacked connection belongs to its handler from here on,
		// and the handler is counted on its own.
		p.wg.Done()
	}
}

func (p *Proxy) connList() []*trackedConn {
	out := make([]*trackedConn, 0, len(p.conns))
	for c := range p.conns {
		out = append(out, c)
	}
	return out
}

func (p *Proxy) count(m map[reqKey]int, r *http.Request) {
	p.mu.Lock()
	defer p.mu.Unlock()
	m[reqKey{r.Method, r.URL.Path}]++
}

func (p *Proxy) sum(m map[reqKey]int, method, pattern string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for k, v := range m {
		if (method == "" || strings.EqualFold(method, k.method)) && Match(pattern, k.path) {
			n += v
		}
	}
	return n
}

// trackingListener records every connection it accepts, so that RefuseAll
// and Close can close them, hijacked ones included (http.Server forgets a
// connection once it is hijacked).
type trackingListener struct {
	*net.UnixListener
	p *Proxy
}

func (l *trackingListener) Accept() (net.Conn, error) {
	c, err := l.UnixListener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, p: l.p}
	l.p.mu.Lock()
	closed := l.p.closed
	if !closed {
		l.p.conns[tc] = struct{}{}
	}
	l.p.mu.Unlock()
	if closed {
		_ = c.Close()
	}
	return tc, nil
}

type trackedConn struct {
	net.Conn
	p    *Proxy
	once sync.Once
}

func (c *trackedConn) Close() error {
	var err error
	c.once.Do(func() {
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
		err = c.Conn.Close()
	})
	return err
}

type logWriter func(format string, args ...any)

func (l logWriter) Write(b []byte) (int, error) {
	l("%s", strings.TrimRight(string(b), "\n"))
	return len(b), nil
}
