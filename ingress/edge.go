package ingress

import (
	"context"
	"errors"
	"fmt"
	"html"
	"io"
	stdlog "log"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// Targets is what the edge asks of the targets: *targets.Service.
type Targets interface {
	// IngressLookup maps a label to its route, from memory.
	IngressLookup(label string) (targets.IngressRoute, bool)
	// ResolveRoute fences and reads the target (one Incus call); the edge
	// asks only for a target it has not seen serve since its last power
	// change.
	ResolveRoute(ctx context.Context, owner controller.Owner, targetID string) (targets.Route, error)
	// PowerDownPending: a request arriving at at that finds the target
	// running goes through the shared wake (see targets.Service).
	PowerDownPending(r targets.Route, at time.Time) bool
}

// Waker is the one wake of each target, which the data routes' dials
// share too: *wake.Waker.
type Waker interface {
	WakeForUse(ctx context.Context, r targets.Route, arrived time.Time) *wake.Refusal
}

var (
	_ Targets = (*targets.Service)(nil)
	_ Waker   = (*wake.Waker)(nil)
)

// MaxHold is the longest a request is held while its target wakes: the
// bound the contract sets a data-route dial, kept by a browser's request
// too, so that neither waits on a wake longer than the other.
const MaxHold = 5 * time.Second

// Options configure the edge.
type Options struct {
	Targets Targets
	Waker   Waker
	Dialer  guest.Dialer
	Relays  *relays.Registry
	Base    ingressurl.Base
	Metrics *Metrics
	Log     *zap.Logger
	// Hold bounds how long a request waits for its target to wake (default
	// and most: MaxHold).
	Hold time.Duration
	// Stall bounds a client's silence while it sends its body or reads
	// its answer (default DefaultStall).
	Stall time.Duration
	// AccessLog, when set, gets a line for every request the edge
	// answers: method, host label, status, bytes written, time taken. Nil
	// keeps none.
	AccessLog *zap.Logger
}

// Edge serves public ingress.
type Edge struct {
	opts  Options
	log   *zap.Logger
	proxy *httputil.ReverseProxy
	tr    *http.Transport // requests with a body
	rt    *inline         // every request, inline when it has none
	proto string

	mu    sync.Mutex
	ready map[string]time.Time // instances seen serving since their last power change, and when
}

// readyFor bounds how long a target seen serving is taken to serve without
// reading it again. This process forgets it at every power change it makes;
// the bound is for the changes it does not see (another replica's, an
// operator's), so that a request never waits on a guest frozen behind its
// back for longer than this: one Incus read per target in use per period.
const readyFor = 5 * time.Second

// keptPerTarget bounds the kept upstream connections to one target's app
// for requests without a body. With 8, a thousand clients at once made
// the edge dial the guest for most requests and close the connection
// after (0.29x nginx's requests a second, nginx keeping 1,024): a kept
// connection waits without buffers (see inline), so a pool this deep
// costs its sockets.
const keptPerTarget = 1024

// New builds the edge.
func New(opts Options) (*Edge, error) {
	if opts.Targets == nil || opts.Waker == nil || opts.Dialer == nil || opts.Relays == nil || opts.Base.String() == "" {
		return nil, errors.New("ingress: Targets, Waker, Dialer, Relays and Base are required")
	}
	if opts.Hold <= 0 || opts.Hold > MaxHold {
		opts.Hold = MaxHold
	}
	if opts.Log == nil {
		opts.Log = zap.NewNop()
	}
	if opts.Stall <= 0 {
		opts.Stall = DefaultStall
	}
	e := &Edge{opts: opts, log: opts.Log, proto: opts.Base.Scheme(), ready: map[string]time.Time{}}
	e.tr = &http.Transport{
		DialContext:         e.dial,
		MaxIdleConnsPerHost: 8,
		// A kept-alive upstream connection counts as use of its target:
		// it must not keep an idle target awake for long.
		IdleConnTimeout:        15 * time.Second,
		ResponseHeaderTimeout:  60 * time.Second,
		ExpectContinueTimeout:  time.Second,
		MaxResponseHeaderBytes: 64 << 10,
		DisableCompression:     true,
		// The default 4 KiB buffers cost an upload a write call every 4 KiB
		// (measured: a third of a direct connection's throughput).
		WriteBufferSize: 64 << 10,
		ReadBufferSize:  64 << 10,
	}
	e.rt = &inline{
		fallback:       e.tr,
		dial:           e.dial,
		maxIdlePerHost: keptPerTarget,
		idleTimeout:    e.tr.IdleConnTimeout,
		headerTimeout:  e.tr.ResponseHeaderTimeout,
		maxHeaderBytes: e.tr.MaxResponseHeaderBytes,
		// Answers' heads are read through it; a body read with a larger
		// buffer than this bypasses it (bufio), so a large one does not
		// need it large, and a thousand answers at once hold 16 MiB.
		bufferSize: 16 << 10,
	}
	e.proxy = &httputil.ReverseProxy{
		Rewrite:        e.rewrite,
		Transport:      e.rt,
		FlushInterval:  -1, // server-sent events and other streams go out as they come
		ModifyResponse: e.sizeCopy,
		ErrorHandler:   e.upstreamError,
		// A stream cut by a power-down or a client that left is routine.
		ErrorLog: mustStdLog(opts.Log.Named("proxy")),
	}
	opts.Relays.OnPowerChange(e.forget)
	return e, nil
}

// Close drops the idle upstream connections.
func (e *Edge) Close() { e.rt.CloseIdleConnections() }

// Server is the edge's HTTP server: bounded headers and timeouts, so a slow
// client holds nothing for long; bodies are streamed, so there is no read
// or write deadline on a whole exchange.
func (e *Edge) Server(errorLog *zap.Logger) *http.Server {
	srv := &http.Server{
		Handler:           e,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
	if errorLog != nil {
		srv.ErrorLog = zap.NewStdLog(errorLog)
	}
	return srv
}

func (e *Edge) isReady(name string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	at, ok := e.ready[name]
	return ok && time.Since(at) < readyFor
}

func (e *Edge) markReady(name string) {
	e.mu.Lock()
	e.ready[name] = time.Now()
	if len(e.ready) > 4096 {
		// Forget what has expired, so that the map holds the targets in
		// use, not every one ever served.
		for n, at := range e.ready {
			if time.Since(at) >= readyFor {
				delete(e.ready, n)
			}
		}
	}
	e.mu.Unlock()
}

func (e *Edge) forget(name string) {
	e.mu.Lock()
	delete(e.ready, name)
	e.mu.Unlock()
}

type ctxKey struct{}

// admission is a request's dial in progress, handed to the transport's
// dial through the request's context.
type admission struct {
	route targets.IngressRoute
	tk    *relays.Ticket
	// proxy is the edge's, lending this request's body copy a buffer
	// sized by the answer (see Get).
	proxy httputil.ReverseProxy
	// bodyLen is the answer's Content-Length, -1 when unknown (a stream),
	// once the guest has answered.
	bodyLen int64
}

// Get lends the answer's body copy a buffer: 256 KiB for a body known to
// be larger than a small one's (a 1 MiB answer then takes 4 read and
// write calls each way instead of 32), and 32 KiB for the rest. A stream
// of unknown length (server-sent events) may last hours with little in
// it, and a small answer needs little: a thousand of either at once hold
// 32 MiB of buffers, not 256.
func (a *admission) Get() []byte {
	if a.bodyLen > smallCopy {
		return *largeCopyPool.Get().(*[]byte)
	}
	return *smallCopyPool.Get().(*[]byte)
}

// Put takes a buffer Get lent back.
func (a *admission) Put(b []byte) {
	if cap(b) >= largeCopy {
		largeCopyPool.Put(&b)
		return
	}
	smallCopyPool.Put(&b)
}

// sizeCopy records the answer's length for Get.
func (e *Edge) sizeCopy(res *http.Response) error {
	if a := admissionOf(res.Request.Context()); a != nil {
		a.bodyLen = res.ContentLength
	}
	return nil
}

// connected is told by the transport once the request has an upstream
// connection: from then on that connection, registered as a relay, speaks
// for the request. An SSE stream that lasts an hour must not count as a
// dial in progress (which a power-down waits for) but as a relay (which it
// closes).
func (a *admission) connected() { a.tk.Leave() }

// admissionOf is the request's admission, nil for none.
func admissionOf(ctx context.Context) *admission {
	a, _ := ctx.Value(ctxKey{}).(*admission)
	return a
}

// ServeHTTP maps the host, admits the request (waking its target) and
// proxies it.
func (e *Edge) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	// A proxy answers while it may still be sending the request body on
	// (the transport's last read of it comes after the guest answered):
	// without full duplex the server would drain and close that body the
	// moment the answer starts, the transport's read would fail, and the
	// upstream connection, and the answer with it, would be cut. (HTTP/2
	// is full duplex already and says so with an error.)
	_ = rc.EnableFullDuplex()
	// A kept-alive connection may carry the last request's write deadline:
	// none until this answer writes, and a fresh one for the server's own
	// last flush after it.
	_ = rc.SetWriteDeadline(time.Time{})
	stall := e.opts.Stall
	defer func() { _ = rc.SetWriteDeadline(time.Now().Add(stall)) }()
	sw := &statusWriter{ResponseWriter: w, rc: rc, stall: stall}
	label, ok := e.opts.Base.Label(r.Host)
	start := time.Now()
	defer func() {
		status := sw.class(r)
		e.opts.Metrics.request(status)
		if al := e.opts.AccessLog; al != nil {
			// The label, not the host: a host that maps to no label is
			// the client's text, and unbounded.
			al.Info("edge request", zap.String("method", r.Method), zap.String("label", label), zap.Int("status", status),
				zap.Int64("bytes", sw.written), zap.Duration("took", time.Since(start)), zap.String("remote", r.RemoteAddr))
		}
	}()
	var route targets.IngressRoute
	if ok {
		route, ok = e.opts.Targets.IngressLookup(label)
	}
	if !ok {
		notFound(sw)
		return
	}
	tk, status, retry := e.admit(r.Context(), route)
	if tk == nil {
		switch status {
		case http.StatusNotFound:
			notFound(sw)
		case http.StatusServiceUnavailable:
			waking(sw, retry)
		default:
			page(sw, status, "This environment cannot serve", "The environment behind this address has failed.")
		}
		return
	}
	a := &admission{route: route, tk: tk, proxy: *e.proxy, bodyLen: -1}
	a.proxy.BufferPool = a
	defer tk.Leave() // unless the transport took a connection first (see dial)
	// The transport leaves the ticket once it has a connection (see
	// admission.connected).
	out := r.WithContext(context.WithValue(r.Context(), ctxKey{}, a))
	if out.Body != nil && out.Body != http.NoBody {
		// On the proxied copy only: the server judges whether the
		// connection can carry another request by its own body.
		sw.body = &stallBody{ReadCloser: r.Body, rc: rc, stall: stall}
		out.Body = sw.body
	}
	a.proxy.ServeHTTP(sw, out)
	if sw.body != nil && sw.body.cut.Load() && sw.status == 0 {
		// The stalled read cancelled the request before any answer: say
		// so, and close (the rest of the body will never come).
		sw.Header().Set("Connection", "close")
		page(sw, http.StatusRequestTimeout, "Request timeout", "The request body stopped arriving.")
	}
}

// admit makes sure the target serves: a target the edge has seen serving
// since its last power change costs nothing; any other is read and, when
// powered down, woken within the hold. It answers the request's ticket in
// the relay registry, or the status to answer and when to retry.
func (e *Edge) admit(ctx context.Context, route targets.IngressRoute) (*relays.Ticket, int, time.Duration) {
	arrived := time.Now()
	if e.isReady(route.Instance) {
		// The common case costs no hold: no deadline, no timer.
		if tk, _ := e.opts.Relays.Enter(route.Instance, arrived); tk != nil {
			return tk, 0, 0
		}
	}
	hctx, cancel := context.WithDeadline(ctx, arrived.Add(e.opts.Hold-100*time.Millisecond))
	defer cancel()
	for {
		if !e.isReady(route.Instance) {
			if status, retry := e.wake(hctx, route, arrived); status != 0 {
				return nil, status, retry
			}
		}
		tk, quiet := e.opts.Relays.Enter(route.Instance, arrived)
		if tk != nil {
			return tk, 0, 0
		}
		// A power-down holds the target: wait for it, then look again
		// (its end forgot the readiness).
		select {
		case <-quiet:
		case <-hctx.Done():
			return nil, http.StatusServiceUnavailable, 2 * time.Second
		}
	}
}

// wake reads the target and wakes it when it is powered down; 0 when it serves.
func (e *Edge) wake(ctx context.Context, route targets.IngressRoute, arrived time.Time) (int, time.Duration) {
	rt, err := e.opts.Targets.ResolveRoute(ctx, route.Owner, route.Instance)
	switch {
	case errors.Is(err, targets.ErrRouteGone) || errors.Is(err, targets.ErrRouteOwner):
		return http.StatusNotFound, 0
	case err != nil:
		if ctx.Err() == nil {
			e.log.Warn("ingress: Incus did not answer a read of the target", zap.Error(err))
		}
		return http.StatusServiceUnavailable, 2 * time.Second
	}
	switch rt.Observation.Phase {
	case controller.PhaseClosing, controller.PhaseClosed:
		return http.StatusNotFound, 0
	case controller.PhaseFailed:
		return http.StatusBadGateway, 0
	case controller.PhaseUnknown:
		return http.StatusServiceUnavailable, 5 * time.Second
	}
	if rt.State == targets.RouteRunning && !e.opts.Targets.PowerDownPending(rt, arrived) {
		e.markReady(rt.Name)
		return 0, 0
	}
	ref := e.opts.Waker.WakeForUse(ctx, rt, arrived)
	took := time.Since(arrived)
	switch {
	case ref == nil:
		e.opts.Metrics.wake(wakeReady, took)
		e.markReady(rt.Name)
		return 0, 0
	case ref.State == wake.StateGone:
		e.opts.Metrics.wake(wakeGone, took)
		return http.StatusNotFound, 0
	case ref.State == wake.StateFailed:
		e.opts.Metrics.wake(wakeFailed, took)
		return http.StatusBadGateway, 0
	}
	outcome := wakeWaking
	if errors.Is(ctx.Err(), context.Canceled) {
		outcome = wakeAborted
	}
	e.opts.Metrics.wake(outcome, took)
	return http.StatusServiceUnavailable, max(ref.RetryAfter, time.Second)
}

// rewrite addresses the guest and sets the forwarding headers afresh:
// Rewrite has already removed any the client sent, and the hop-by-hop ones.
func (e *Edge) rewrite(pr *httputil.ProxyRequest) {
	a := admissionOf(pr.In.Context())
	pr.Out.URL.Scheme = "http"
	if a != nil {
		pr.Out.URL.Host = net.JoinHostPort(a.route.Instance, strconv.Itoa(a.route.Port))
	}
	pr.Out.Host = pr.In.Host // the guest's app writes its own absolute URLs
	pr.SetXForwarded()
	pr.Out.Header.Set("X-Forwarded-Proto", e.proto)
}

// dial opens a connection to the guest's ingress port through the
// GuestDialer and registers it as a relay of the target. An app the
// daemon's readiness proved running may still be binding its port: a
// refused connection is tried again within the request.
func (e *Edge) dial(ctx context.Context, _, addr string) (net.Conn, error) {
	a := admissionOf(ctx)
	if a == nil {
		return nil, errors.New("ingress: a dial without its admission")
	}
	if want := net.JoinHostPort(a.route.Instance, strconv.Itoa(a.route.Port)); addr != want {
		return nil, fmt.Errorf("ingress: dial of %s for a request admitted to %s", addr, want)
	}
	tk := a.tk.Join() // held by this dial until its connection is a relay
	dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	// The member too: a guest on another member is reached as a data
	// route's is (through its member's replica, or exec).
	t := guest.Target{Instance: a.route.Instance, Port: a.route.Port, Location: a.route.Location}
	for delay := 10 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		conn, err := e.opts.Dialer.DialContext(dctx, t)
		if err == nil {
			u := &upstream{Conn: conn, instance: a.route.Instance, reg: e.opts.Relays, metrics: e.opts.Metrics, done: make(chan struct{})}
			tk.Adopt(u)
			e.opts.Metrics.opened(1)
			return u, nil
		}
		if !errors.Is(err, syscall.ECONNREFUSED) || !clock.Sleep(dctx, delay) {
			tk.Leave()
			e.forget(a.route.Instance)
			return nil, fmt.Errorf("ingress: dial %s port %d: %w", a.route.Instance, a.route.Port, err)
		}
	}
}

func (e *Edge) upstreamError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		return // the client went away
	}
	e.log.Debug("ingress: the guest's app did not answer", zap.Error(err))
	page(w, http.StatusBadGateway, "The environment's app does not answer",
		"The environment is running, but nothing answers on its public port yet.")
}

func notFound(w http.ResponseWriter) {
	page(w, http.StatusNotFound, "Not found", "No environment is served at this address.")
}

// waking is the 503 of a request whose target is still waking up.
func waking(w http.ResponseWriter, retry time.Duration) {
	secs := int(min(max(retry, time.Second), 60*time.Second) / time.Second)
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	w.Header().Set("Refresh", strconv.Itoa(secs))
	page(w, http.StatusServiceUnavailable, "Waking up", "This environment is waking up; the page reloads in a moment.")
}

func page(w http.ResponseWriter, status int, title, text string) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = fmt.Fprintf(w, "<!doctype html><html><head><meta charset=\"utf-8\"><title>%s</title></head><body><h1>%s</h1><p>%s</p></body></html>\n",
		html.EscapeString(title), html.EscapeString(title), html.EscapeString(text))
}

// DefaultStall is how long a client may leave its request body or its
// answer without a byte moving before its connection is closed: bodies are
// streamed, so the whole exchange has no bound, but a client that stops
// reading or sending must not hold a guest's connection.
const DefaultStall = time.Minute

// stallBody puts a fresh read deadline on the client's connection before
// each read of the request body, and clears it at the body's end (the
// server then reads the next request under its own deadlines); a body cut
// short leaves the connection unreadable, so the server closes it.
type stallBody struct {
	io.ReadCloser
	rc    *http.ResponseController
	stall time.Duration
	ended bool        // read to its end
	cut   atomic.Bool // a read timed out (read on the transport's goroutine)
}

// Close of a body read to its end leaves the deadline cleared (the
// server's own read of the connection must not time out later on a
// stream's answer); of one cut short, it puts a fresh deadline on the
// read of the rest that the server does before it reuses the connection,
// so a client that stopped sending is let go.
func (b *stallBody) Close() error {
	if !b.ended && !b.cut.Load() {
		_ = b.rc.SetReadDeadline(time.Now().Add(b.stall))
	}
	return b.ReadCloser.Close()
}

func (b *stallBody) Read(p []byte) (int, error) {
	_ = b.rc.SetReadDeadline(time.Now().Add(b.stall))
	n, err := b.ReadCloser.Read(p)
	switch {
	case errors.Is(err, io.EOF):
		b.ended = true
		_ = b.rc.SetReadDeadline(time.Time{})
	case isTimeout(err):
		// The client stalled: nothing more is read from this connection,
		// so the server closes it. (Other errors are left alone: a read
		// after the transport closed the body is not the client's fault,
		// and an unreadable connection would cancel the request.)
		b.cut.Store(true)
		_ = b.rc.SetReadDeadline(time.Now())
	}
	return n, err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// statusWriter remembers the status written, for the requests metric, and
// puts a fresh write deadline on every write. Unwrap lets the reverse
// proxy reach the flusher and the hijacker.
type statusWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	stall   time.Duration
	body    *stallBody // nil without a request body
	status  int
	written int64 // body bytes written through it (a hijacked upgrade's are not)
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.stall))
	if s.body != nil && s.body.cut.Load() {
		// What is left of the body will never come: this connection
		// carries no other request.
		s.Header().Set("Connection", "close")
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(p []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.stall))
	n, err := s.ResponseWriter.Write(p)
	s.written += int64(n)
	return n, err
}

// Flush carries the write deadline too: an event stream's flush is where
// a client that stopped reading blocks.
func (s *statusWriter) Flush() {
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.stall))
	_ = s.rc.Flush()
}

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

func (s *statusWriter) class(r *http.Request) int {
	if s.status == 0 && r.Header.Get("Upgrade") != "" {
		return http.StatusSwitchingProtocols // a hijacked upgrade writes no header through us
	}
	if s.status == 0 {
		return http.StatusOK
	}
	return s.status
}

// mustStdLog is log at debug level as a standard logger.
func mustStdLog(log *zap.Logger) *stdlog.Logger {
	l, err := zap.NewStdLogAt(log, zap.DebugLevel)
	if err != nil {
		return zap.NewStdLog(zap.NewNop()) // only an invalid level fails
	}
	return l
}

// The body copies' buffers (admission.Get): a large one for a body known
// to be large, and the proxy's default size for any other.
const (
	largeCopy = 256 << 10
	smallCopy = 32 << 10
)

var (
	largeCopyPool = sync.Pool{New: func() any { b := make([]byte, largeCopy); return &b }}
	smallCopyPool = sync.Pool{New: func() any { b := make([]byte, smallCopy); return &b }}
)
