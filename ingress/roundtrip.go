package ingress

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"sync"
	"time"
)

// inline carries a request without a body on the goroutine that asks:
// it writes the request and reads the answer's head itself, and the
// answer's body is read by whoever reads it. http.Transport hands every
// request to a writing and a reading goroutine of the connection, three
// wake-ups a request, which on a small GET was most of what the edge added
// to a direct connection. A request with a body goes to that transport
// still: it writes the body while it reads the answer, which a guest that
// answers before it has read everything needs.
type inline struct {
	fallback *http.Transport
	dial     func(ctx context.Context, network, addr string) (net.Conn, error)

	maxIdlePerHost int
	idleTimeout    time.Duration
	headerTimeout  time.Duration
	maxHeaderBytes int64
	bufferSize     int

	mu   sync.Mutex
	idle map[string][]*inlineConn // by address; the most recent last

	// readers and writers hold the buffers of connections not in use:
	// a kept connection waits with none, so a pool as deep as a busy
	// target needs (a thousand clients at once) costs its sockets, not
	// 68 KiB of buffers each.
	readers, writers sync.Pool
}

// inlineConn is one upstream connection of the inline transport.
type inlineConn struct {
	t    *inline
	addr string
	conn net.Conn
	lim  *headLimit
	br   *bufio.Reader
	bw   *bufio.Writer
	done <-chan struct{} // closed once the connection is (a power-down closes it)
	idle *time.Timer     // closes it after idleTimeout in the pool
}

// RoundTrip carries r: inline when it has no body and may be sent twice,
// else by the fallback. (A kept connection the guest closed while it sat
// idle is found only by sending on it; http.Transport learns of it sooner,
// from the reading goroutine this path does without, so a request that
// must not be sent twice goes there.)
func (t *inline) RoundTrip(r *http.Request) (*http.Response, error) {
	a := admissionOf(r.Context())
	if (r.Body != nil && r.Body != http.NoBody) || !idempotent(r) {
		if a != nil {
			r = r.WithContext(httptrace.WithClientTrace(r.Context(), &httptrace.ClientTrace{
				GotConn: func(httptrace.GotConnInfo) { a.connected() },
			}))
		}
		return t.fallback.RoundTrip(r)
	}
	addr := r.URL.Host
	for attempt := 0; ; attempt++ {
		c, reused, err := t.conn(r.Context(), addr)
		if err != nil {
			return nil, err
		}
		if a != nil {
			a.connected()
		}
		if trace := httptrace.ContextClientTrace(r.Context()); trace != nil && trace.GotConn != nil {
			trace.GotConn(httptrace.GotConnInfo{Conn: c.conn, Reused: reused})
		}
		resp, err := c.roundTrip(r)
		if err == nil {
			return resp, nil
		}
		_ = c.conn.Close()
		// A kept connection the guest closed while it sat idle fails
		// before any answer: the request, idempotent, is sent again once
		// on a new one.
		var na *noAnswer
		if reused && attempt == 0 && errors.As(err, &na) && r.Context().Err() == nil {
			continue
		}
		return nil, err
	}
}

// noAnswer is a connection that failed before the answer's first byte.
type noAnswer struct{ err error }

func (e *noAnswer) Error() string {
	return "ingress: the upstream connection ended before an answer: " + e.err.Error()
}
func (e *noAnswer) Unwrap() error { return e.err }

func idempotent(r *http.Request) bool {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	_, key := r.Header["Idempotency-Key"]
	_, xkey := r.Header["X-Idempotency-Key"]
	return key || xkey
}

// conn takes a kept connection to addr, or dials one.
func (t *inline) conn(ctx context.Context, addr string) (*inlineConn, bool, error) {
	t.mu.Lock()
	for list := t.idle[addr]; len(list) > 0; list = t.idle[addr] {
		c := list[len(list)-1]
		list[len(list)-1] = nil
		t.idle[addr] = list[:len(list)-1]
		c.idle.Stop()
		select {
		case <-c.done:
			continue // closed by a power-down while idle
		default:
		}
		t.mu.Unlock()
		t.buffers(c)
		return c, true, nil
	}
	t.mu.Unlock()
	conn, err := t.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, false, err
	}
	c := &inlineConn{t: t, addr: addr, conn: conn, lim: &headLimit{conn: conn}}
	t.buffers(c)
	c.done = make(chan struct{}) // never closed, unless the connection says otherwise
	if d, ok := conn.(interface{ Done() <-chan struct{} }); ok {
		c.done = d.Done()
	}
	return c, false, nil
}

// buffers gives a connection taken for a request its reader and writer.
func (t *inline) buffers(c *inlineConn) {
	if br, ok := t.readers.Get().(*bufio.Reader); ok {
		br.Reset(c.lim)
		c.br = br
	} else {
		c.br = bufio.NewReaderSize(c.lim, t.bufferSize)
	}
	if bw, ok := t.writers.Get().(*bufio.Writer); ok {
		bw.Reset(c.conn)
		c.bw = bw
	} else {
		c.bw = bufio.NewWriterSize(c.conn, 4<<10)
	}
}

// put keeps c for the next request to its address, or closes it. Its
// buffers go back to the pools: the answer was read to its end, so its
// reader holds nothing of it, and the request was flushed.
func (t *inline) put(c *inlineConn) {
	if c.br.Buffered() > 0 || c.bw.Buffered() > 0 {
		// Bytes past the answer's end: the guest is out of step with the
		// requests, and the connection is not reused.
		_ = c.conn.Close()
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.idle[c.addr]) >= t.maxIdlePerHost {
		_ = c.conn.Close()
		return
	}
	c.br.Reset(nil)
	c.bw.Reset(nil)
	t.readers.Put(c.br)
	t.writers.Put(c.bw)
	c.br, c.bw = nil, nil
	if t.idle == nil {
		t.idle = map[string][]*inlineConn{}
	}
	t.idle[c.addr] = append(t.idle[c.addr], c)
	// A kept connection counts as use of its target: it must not keep an
	// idle target awake for long.
	c.idle = time.AfterFunc(t.idleTimeout, func() { t.expire(c) })
}

// expire closes c if it is still in the pool.
func (t *inline) expire(c *inlineConn) {
	t.mu.Lock()
	list := t.idle[c.addr]
	for i, k := range list {
		if k == c {
			t.idle[c.addr] = append(list[:i:i], list[i+1:]...)
			if len(t.idle[c.addr]) == 0 {
				delete(t.idle, c.addr)
			}
			t.mu.Unlock()
			_ = c.conn.Close()
			return
		}
	}
	t.mu.Unlock()
}

// CloseIdleConnections closes every kept connection, the fallback's too.
func (t *inline) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, list := range idle {
		for _, c := range list {
			c.idle.Stop()
			_ = c.conn.Close()
		}
	}
	t.fallback.CloseIdleConnections()
}

// roundTrip writes r and reads the answer's head. A request cancelled on
// the way ends the connection: its deadline is put in the past.
func (c *inlineConn) roundTrip(r *http.Request) (*http.Response, error) {
	ctx := r.Context()
	stop := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (*http.Response, error) {
		stop()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	err := r.Write(c.bw)
	if err == nil {
		err = c.bw.Flush()
	}
	if err != nil {
		return fail(&noAnswer{err: err})
	}
	_ = c.conn.SetReadDeadline(time.Now().Add(c.t.headerTimeout))
	var resp *http.Response
	for {
		c.lim.on, c.lim.left = true, c.t.maxHeaderBytes
		if _, err := c.br.Peek(1); err != nil {
			c.lim.on = false
			if resp == nil && !isTimeout(err) {
				return fail(&noAnswer{err: err})
			}
			return fail(fmt.Errorf("ingress: read the answer's head: %w", err))
		}
		resp, err = http.ReadResponse(c.br, r)
		c.lim.on = false
		if err != nil {
			return fail(fmt.Errorf("ingress: read the answer's head: %w", err))
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
		// 1xx informational answers are passed on and the real one read.
		if trace := httptrace.ContextClientTrace(ctx); trace != nil && trace.Got1xxResponse != nil {
			if err := trace.Got1xxResponse(resp.StatusCode, textproto.MIMEHeader(resp.Header)); err != nil {
				return fail(err)
			}
		}
	}
	_ = c.conn.SetReadDeadline(time.Time{})
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The connection is the upgraded stream's now; the reverse proxy
		// copies both ways and closes it.
		stop()
		resp.Body = &upgraded{Reader: c.br, conn: c.conn}
		return resp, nil
	}
	keep := !resp.Close && !r.Close
	if resp.Body == http.NoBody {
		if stop() && keep { // not cancelled meanwhile, which spoils the deadline
			c.t.put(c)
		} else {
			_ = c.conn.Close()
		}
		return resp, nil
	}
	resp.Body = &inlineBody{ReadCloser: resp.Body, c: c, keep: keep, stop: stop}
	return resp, nil
}

// headLimit bounds what the connection's reader takes from the guest
// while an answer's head is read, so that a head without end is refused
// at maxHeaderBytes instead of growing a line in memory. The reader reads
// ahead, so a few body bytes may count against the head's limit: the
// bound is on the head and what arrived with it.
type headLimit struct {
	conn net.Conn
	on   bool
	left int64
}

func (l *headLimit) Read(p []byte) (int, error) {
	if !l.on {
		return l.conn.Read(p)
	}
	if l.left <= 0 {
		return 0, errHeadTooLarge
	}
	p = p[:min(int64(len(p)), l.left)]
	n, err := l.conn.Read(p)
	l.left -= int64(n)
	return n, err
}

var errHeadTooLarge = errors.New("the answer's head is over the edge's limit")

// inlineBody is an answer's body: read to its end, it gives its
// connection back for the next request; closed before, it closes it.
type inlineBody struct {
	io.ReadCloser
	c    *inlineConn
	keep bool
	stop func() bool
	once sync.Once
	eof  bool
}

func (b *inlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) {
		b.eof = true
		b.finish()
	}
	return n, err
}

func (b *inlineBody) Close() error {
	err := b.ReadCloser.Close()
	b.finish()
	return err
}

func (b *inlineBody) finish() {
	b.once.Do(func() {
		stopped := b.stop()
		if b.eof && b.keep && stopped {
			b.c.t.put(b.c)
			return
		}
		_ = b.c.conn.Close()
	})
}

// upgraded is a switched connection as the reverse proxy wants it: what
// was read ahead, then the connection; writes and close to the connection.
type upgraded struct {
	io.Reader
	conn net.Conn
}

func (u *upgraded) Write(p []byte) (int, error) { return u.conn.Write(p) }
func (u *upgraded) Close() error                { return u.conn.Close() }
