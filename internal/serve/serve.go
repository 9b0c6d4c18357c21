// Package serve hardens the provider's controller listener against clients
// that hold connections without using them (issue 12, item 5): a ceiling on
// open connections, HTTP timeouts that end every stalled read and write but
// not a WebSocket (the HTTP server clears a connection's deadlines when a
// handler hijacks it), and the refusal, unread, of a request body, which no
// endpoint on this listener takes.
package serve

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// The bounds of one HTTP exchange on the listener. A WebSocket, once
// upgraded, has none of them: its plane's own rules bound it.
const (
	// ReadHeaderTimeout bounds a request's headers, from the first byte.
	ReadHeaderTimeout = 10 * time.Second
	// ReadTimeout bounds a whole request, headers and body.
	ReadTimeout = 15 * time.Second
	// WriteTimeout bounds an answer, from the end of its request's
	// headers; a data-route dial is held at most 5 s before it.
	WriteTimeout = 15 * time.Second
	// IdleTimeout closes a kept-alive connection that sends no next
	// request.
	IdleTimeout = 15 * time.Second
)

// DefaultMaxConnections is the default ceiling on open connections.
const DefaultMaxConnections = 4096

// Reasons label refusals; the set is fixed.
const (
	ReasonConnectionLimit = "connectionLimit"
	ReasonRequestBody     = "requestBody"
)

// Metrics are the listener's collectors.
type Metrics struct {
	open    prometheus.Gauge
	refused *prometheus.CounterVec
}

// NewMetrics registers the listener's collectors on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_listener_connections",
			Help: "Open connections on the controller listener: HTTP requests, controller connections and data-route relays.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_listener_refused_total",
			Help: "Connections and requests the controller listener refused before any handler: connectionLimit (over PROVIDER_MAX_CONNECTIONS: answered 503 with Retry-After at once on plain HTTP, and after a handshake below TLS), requestBody (a request that carries a body, answered 400 unread).",
		}, []string{"reason"}),
	}
	reg.MustRegister(m.open, m.refused)
	for _, r := range []string{ReasonConnectionLimit, ReasonRequestBody} {
		m.refused.WithLabelValues(r)
	}
	return m
}

func (m *Metrics) refuse(reason string) {
	if m != nil {
		m.refused.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) opened(delta float64) {
	if m != nil {
		m.open.Add(delta)
	}
}

// Options configure Listener and Server. Zero values take the defaults.
type Options struct {
	// MaxConnections is the ceiling on open connections (DefaultMaxConnections).
	MaxConnections int
	Metrics        *Metrics
	Log            *zap.Logger
	// PlainHTTP says the listener carries HTTP itself, not TLS: a
	// connection over the ceiling is then answered 503 with Retry-After
	// (see Listener) rather than closed bare.
	PlainHTTP bool
	// TLS, for a listener that carries TLS, is its configuration: a
	// connection over the ceiling is then answered the same 503 once a
	// handshake is made (bounded as the plain answers are), rather than
	// closed bare. Nil below TLS: closed bare.
	TLS *tls.Config
	// The HTTP bounds (zero: the constants above).
	ReadHeaderTimeout, ReadTimeout, WriteTimeout, IdleTimeout time.Duration
}

func (o Options) withDefaults() Options {
	if o.MaxConnections <= 0 {
		o.MaxConnections = DefaultMaxConnections
	}
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{{&o.ReadHeaderTimeout, ReadHeaderTimeout}, {&o.ReadTimeout, ReadTimeout}, {&o.WriteTimeout, WriteTimeout}, {&o.IdleTimeout, IdleTimeout}} {
		if *d.v <= 0 {
			*d.v = d.def
		}
	}
	return o
}

// Listener counts the connections ln accepts, until each is closed
// (hijacked ones included), and holds them to opts.MaxConnections. A
// connection over the ceiling is refused at once: holding it in the
// kernel's backlog instead would let whoever holds the ceiling's
// connections keep every other client waiting in connect. On plain HTTP
// (opts.PlainHTTP) the refusal is an answer, 503 with Retry-After, which a
// runtime's data-route dial retries after it, as the contract has every
// 503 do. Below TLS the answer needs a handshake first: it is made with
// opts.TLS, and without one the connection is closed without a byte. The
// answers in progress are bounded (refusingMost), handshakes included;
// past them a connection is closed bare too.
func Listener(ln net.Listener, opts Options) net.Listener {
	opts = opts.withDefaults()
	return &listener{Listener: ln, opts: opts, logEvery: NewEvery(opts.Log, 10*time.Second), refusing: make(chan struct{}, refusingMost)}
}

// refusingMost bounds the over-ceiling connections being answered at once:
// each holds a goroutine and a socket for at most lingerBound.
const refusingMost = 64

type listener struct {
	net.Listener
	opts     Options
	open     atomic.Int64
	logEvery *Every
	refusing chan struct{}
}

func (l *listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) > int64(l.opts.MaxConnections) {
			l.open.Add(-1)
			// Counted before the close, so a client that sees the close
			// also sees the refusal in the metrics.
			l.opts.Metrics.refuse(ReasonConnectionLimit)
			l.refuse(c)
			l.logEvery.Warn("the controller listener is at its connection ceiling; refusing new connections at once",
				zap.Int("maxConnections", l.opts.MaxConnections))
			continue
		}
		l.opts.Metrics.opened(1)
		return &conn{Conn: c, l: l}, nil
	}
}

// refuse answers a connection over the ceiling, or closes it.
func (l *listener) refuse(c net.Conn) {
	if !l.opts.PlainHTTP && l.opts.TLS == nil {
		_ = c.Close()
		return
	}
	select {
	case l.refusing <- struct{}{}:
	default:
		_ = c.Close()
		return
	}
	go func() {
		defer func() { <-l.refusing }()
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(lingerBound))
		if l.opts.TLS != nil {
			cfg := l.opts.TLS.Clone()
			cfg.NextProtos = []string{"http/1.1"} // the answer is HTTP/1.1 whatever the client offers
			tc := tls.Server(c, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), lingerBound)
			err := tc.HandshakeContext(ctx)
			cancel()
			if err != nil {
				return
			}
			c = tc
		}
		const msg = "The provider is at its connection ceiling; retry after the Retry-After seconds.\n"
		if _, err := io.WriteString(c, "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain; charset=utf-8\r\n"+
			"Cache-Control: no-store\r\nConnection: close\r\nContent-Length: "+strconv.Itoa(len(msg))+"\r\n\r\n"+msg); err != nil {
			return
		}
		// As NoBody does: a FIN, so that the request the client is still
		// sending does not turn the close into a reset that loses the
		// answer, then what it sends is dropped until it closes too.
		if cw, ok := c.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
			_, _ = io.CopyN(io.Discard, c, 64<<10)
		}
	}()
}

type conn struct {
	net.Conn
	l    *listener
	once sync.Once
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.l.open.Add(-1)
		c.l.opts.Metrics.opened(-1)
	})
	return err
}

// Server is the HTTP server for handler on the controller listener: the
// timeouts above, and requests that carry a body refused unread.
func Server(handler http.Handler, opts Options, errorLog *zap.Logger) *http.Server {
	opts = opts.withDefaults()
	srv := &http.Server{
		Handler:           NoBody(handler, opts),
		ReadHeaderTimeout: opts.ReadHeaderTimeout,
		ReadTimeout:       opts.ReadTimeout,
		WriteTimeout:      opts.WriteTimeout,
		IdleTimeout:       opts.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
	}
	if errorLog != nil {
		srv.ErrorLog = zap.NewStdLog(errorLog)
	}
	return srv
}

// NoBody answers 400 and closes the connection, without reading it, a
// request that announces a body (a Content-Length other than 0, or a
// chunked one). Every endpoint here is a GET handshake. Answered by a
// handler as usual, such a request makes the HTTP server read the body,
// before the answer to keep the connection or after it to close the body,
// which a client that never sends it holds for as long as a read may last.
// So the connection is taken from the server, answered and closed: its
// write side at once, the whole of it once the client has closed its own
// or after lingerBound.
func NoBody(next http.Handler, opts Options) http.Handler {
	opts = opts.withDefaults()
	every := NewEvery(opts.Log, 10*time.Second)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength == 0 {
			next.ServeHTTP(w, r)
			return
		}
		opts.Metrics.refuse(ReasonRequestBody)
		every.Info("refused a request that carries a body", zap.String("method", r.Method), zap.Int64("contentLength", r.ContentLength))
		const msg = "This endpoint takes no request body: open it with a GET WebSocket handshake.\n"
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			w.Header().Set("Connection", "close")
			http.Error(w, msg, http.StatusBadRequest)
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(lingerBound))
		_, _ = brw.WriteString("HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nCache-Control: no-store\r\n" +
			"Connection: close\r\nContent-Length: " + strconv.Itoa(len(msg)) + "\r\n\r\n" + msg)
		if brw.Flush() != nil {
			return
		}
		// A FIN rather than a reset, so that the answer is not lost to
		// body bytes still unread; then what the client still sends is
		// dropped, boundedly, until it closes too.
		if cw, ok := c.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
			_, _ = io.CopyN(io.Discard, c, 64<<10)
		}
	})
}

// lingerBound bounds a refused request's connection after its answer.
const lingerBound = time.Second

// Every logs a message at most once per interval, with the count of those
// it held back since the last one it wrote.
type Every struct {
	log      *zap.Logger
	interval time.Duration
	mu       sync.Mutex
	last     time.Time
	held     int
}

// NewEvery makes a limiter writing to log at most once per interval.
func NewEvery(log *zap.Logger, interval time.Duration) *Every {
	if log == nil {
		log = zap.NewNop()
	}
	return &Every{log: log, interval: interval}
}

func (e *Every) allow() (bool, int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	now := time.Now()
	if !e.last.IsZero() && now.Sub(e.last) < e.interval {
		e.held++
		return false, 0
	}
	e.last = now
	held := e.held
	e.held = 0
	return true, held
}

// Warn logs at warn level, unless a message went out within the interval.
func (e *Every) Warn(msg string, fields ...zap.Field) {
	if ok, held := e.allow(); ok {
		e.log.Warn(msg, append(fields, zap.Int("heldBack", held))...)
	}
}

// Info logs at info level, unless a message went out within the interval.
func (e *Every) Info(msg string, fields ...zap.Field) {
	if ok, held := e.allow(); ok {
		e.log.Info(msg, append(fields, zap.Int("heldBack", held))...)
	}
}

// Refused is the refusals counter of one reason (for tests).
func (m *Metrics) Refused(reason string) prometheus.Counter { return m.refused.WithLabelValues(reason) }
