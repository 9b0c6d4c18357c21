package incusfault

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// maxHeldBody is how much of a held request's body the proxy reads ahead.
// Reading a body to its end is what lets net/http notice that the client
// hung up, so a held request can end with its client; a larger body (an
// image upload) is held with only its head read, and then ends only with
// its release or the proxy.
const maxHeldBody = 16 << 20

// action is what decide chose for one request.
type action struct {
	fault   Fault
	rule    *rule
	hit     int             // which of the rule's hits this is
	release <-chan struct{} // ends a BlackHole hold with a forward
}

// serveHTTP applies the first matching rule to the request, then forwards
// it unless the fault says otherwise.
func (p *Proxy) serveHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		hangUp(w)
		return
	}
	p.wg.Add(1)
	p.mu.Unlock()
	defer p.wg.Done()

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(p.ctx, cancel)()
	r = r.WithContext(ctx)

	p.count(p.seen, r)
	act := p.decide(r)
	if act.rule != nil {
		p.logf("incusfault: %s %s: %s (rule %d, hit %d)", r.Method, r.URL.RequestURI(), act.fault, act.rule.id, act.hit)
	}
	switch act.fault {
	case Refuse:
		hangUp(w)
	case Fail:
		writeError(w, act.rule.Status, act.rule.Message, act.rule.Rule)
	case BlackHole:
		if held, ok := p.hold(r, act.release, nil); ok {
			p.forward(w, held, false)
		}
	case Delay:
		t := time.NewTimer(act.rule.Delay)
		defer t.Stop()
		if held, ok := p.hold(r, nil, t.C); ok {
			p.forward(w, held, false)
		}
	case DropResponse:
		p.forward(w, r, true)
	case Linger:
		held, done, ok := p.linger(r, act.rule.Delay)
		if ok {
			p.forward(w, held, false)
		}
		done()
	default:
		p.forward(w, r, false)
	}
}

// decide picks the fault for r and counts it against its rule.
func (p *Proxy) decide(r *http.Request) action {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ru := range p.rules {
		if ru.Times > 0 && ru.hits >= ru.Times {
			continue
		}
		if !ru.matches(r) {
			continue
		}
		if ru.Probability > 0 && ru.Probability < 1 && p.rng.Float64() >= ru.Probability {
			continue
		}
		ru.hits++
		return action{fault: ru.Fault, rule: ru, hit: ru.hits, release: ru.cleared}
	}
	return action{}
}

// holding counts a held request (Held) until the func it answers is called.
func (p *Proxy) holding() (done func()) {
	p.mu.Lock()
	p.held++
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		p.held--
		p.mu.Unlock()
	}
}

// hold keeps r from going on until release is closed or timer fires (then
// it returns r, its body read ahead, and true), or until r's client hangs
// up or the proxy closes (false).
func (p *Proxy) hold(r *http.Request, release <-chan struct{}, timer <-chan time.Time) (*http.Request, bool) {
	defer p.holding()()

	if r.Body != nil && r.Body != http.NoBody {
		head, err := io.ReadAll(io.LimitReader(r.Body, maxHeldBody+1))
		if err != nil {
			return r, false // the client is gone, or sent a broken body
		}
		r = r.Clone(r.Context())
		if len(head) > maxHeldBody {
			r.Body = readCloser{io.MultiReader(bytes.NewReader(head), r.Body), r.Body}
		} else {
			r.Body = io.NopCloser(bytes.NewReader(head))
		}
	}
	select {
	case <-release:
		return r, true
	case <-timer:
		return r, true
	case <-r.Context().Done():
		return r, false
	}
}

// linger reads r's body ahead, waits d, and returns r detached from its
// client's hang-up (still ended by the proxy's close), so that it reaches
// Incus whether or not the client waited; false if the proxy closed first.
// done releases the detached request's context once it is served.
func (p *Proxy) linger(r *http.Request, d time.Duration) (held *http.Request, done func(), ok bool) {
	defer p.holding()()
	ctx, cancel := context.WithCancel(context.WithoutCancel(r.Context()))
	stop := context.AfterFunc(p.ctx, cancel)
	done = func() { stop(); cancel() }
	r = r.Clone(ctx)
	if r.Body != nil && r.Body != http.NoBody {
		body, err := io.ReadAll(io.LimitReader(r.Body, maxHeldBody))
		if err != nil {
			return r, done, false // the client left before sending all of it
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return r, done, true
	case <-ctx.Done():
		return r, done, false // the proxy closed
	}
}

type readCloser struct {
	io.Reader
	io.Closer
}

type dropKey struct{}

var errDropped = errors.New("incusfault: answer dropped after forwarding")

// dropIfMarked turns Incus's answer to a DropResponse request into an error,
// so that ReverseProxy hands it to ErrorHandler (which hangs up) and never
// writes it to the client.
func dropIfMarked(resp *http.Response) error {
	if resp.Request != nil && resp.Request.Context().Value(dropKey{}) != nil {
		return errDropped
	}
	return nil
}

// forward sends r on to Incus and its answer back, unless HangAll holds it
// first; with drop, the answer is thrown away and the client hung up on.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, drop bool) {
	p.mu.Lock()
	hang := p.hang
	p.mu.Unlock()
	if hang != nil {
		var ok bool
		if r, ok = p.hold(r, hang, nil); !ok {
			return
		}
	}
	if isUpgrade(r) {
		p.relayUpgrade(w, r, drop)
		return
	}
	if drop {
		r = r.WithContext(context.WithValue(r.Context(), dropKey{}, true))
	}
	p.rp.ServeHTTP(headerFlusher{w}, r)
}

// headerFlusher sends the status line and headers as soon as Incus does:
// Incus starts an operation wait's 200 before it waits, and a client may
// act on the header alone.
type headerFlusher struct{ http.ResponseWriter }

func (h headerFlusher) WriteHeader(code int) {
	h.ResponseWriter.WriteHeader(code)
	if code >= 200 {
		_ = http.NewResponseController(h.ResponseWriter).Flush()
	}
}

func (h headerFlusher) Unwrap() http.ResponseWriter { return h.ResponseWriter }

func isUpgrade(r *http.Request) bool {
	return r.Header.Get("Upgrade") != "" && headerHasToken(r.Header, "Connection", "upgrade")
}

func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// relay is one upgraded connection: the client's and Incus's, copied both ways.
type relay struct {
	path             string
	client, upstream net.Conn
	once             sync.Once
}

func (r *relay) close() {
	r.once.Do(func() {
		_ = r.client.Close()
		_ = r.upstream.Close()
	})
}

// relayUpgrade forwards an Upgrade request (the events WebSocket, an exec
// or console stream) on a connection of its own and, after Incus's 101,
// copies bytes both ways until either side or the proxy ends it. It is done
// here rather than by ReverseProxy so that the proxy owns both copiers and
// CutEvents can find the stream.
func (p *Proxy) relayUpgrade(w http.ResponseWriter, r *http.Request, drop bool) {
	ctx := r.Context()
	up, err := p.dialer.DialContext(ctx, "unix", p.upstream)
	if err != nil {
		p.logf("incusfault: %s %s: upstream: %v", r.Method, r.URL.Path, err)
		hangUp(w)
		return
	}
	// Until the relay owns it, ctx (the client, the proxy) bounds the
	// handshake with Incus.
	stopHandshake := context.AfterFunc(ctx, func() { _ = up.Close() })
	out := r.Clone(ctx)
	out.URL = &url.URL{Path: r.URL.Path, RawPath: r.URL.RawPath, RawQuery: r.URL.RawQuery}
	out.RequestURI = ""
	p.count(p.forwarded, r)
	br := bufio.NewReader(up)
	var resp *http.Response
	if err = out.Write(up); err == nil {
		resp, err = http.ReadResponse(br, out)
	}
	if err != nil || drop {
		stopHandshake()
		_ = up.Close()
		if err != nil && ctx.Err() == nil {
			p.logf("incusfault: %s %s: upstream: %v", r.Method, r.URL.Path, err)
		}
		hangUp(w)
		return
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer stopHandshake()
		defer func() { _ = up.Close() }()
		defer func() { _ = resp.Body.Close() }()
		for k, vs := range resp.Header {
			for _, v := range vs {
				w.Header().Add(k, v)
			}
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if !stopHandshake() || err != nil {
		// The client or the proxy went away during the handshake.
		_ = up.Close()
		if conn != nil {
			_ = conn.Close()
		}
		return
	}
	// The server may have left a read deadline from the header read.
	_ = conn.SetDeadline(time.Time{})
	rl := &relay{path: r.URL.Path, client: conn, upstream: up}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		rl.close()
		return
	}
	p.relays[rl] = struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.relays, rl)
		p.mu.Unlock()
	}()
	defer rl.close()
	defer context.AfterFunc(p.ctx, rl.close)()

	// A failed write shows in the Flush below.
	_, _ = fmt.Fprintf(brw, "HTTP/1.1 %s\r\n", resp.Status)
	_ = resp.Header.Write(brw)
	_, _ = brw.WriteString("\r\n")
	if err := brw.Flush(); err != nil {
		return
	}
	done := make(chan struct{})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(done)
		// brw.Reader first yields whatever the client sent after its
		// request, then reads the connection itself.
		_, _ = io.Copy(up, brw.Reader)
		rl.close()
	}()
	// br may already hold the first frames Incus sent after its 101.
	_, _ = io.Copy(conn, br)
	rl.close()
	<-done
}

// hangUp closes the client's connection without an answer.
func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = conn.Close()
		return
	}
	// No hijack (HTTP/2, or already hijacked): net/http closes the
	// connection, silently, when a handler aborts.
	panic(http.ErrAbortHandler)
}

// incusError is the body of an Incus error answer.
type incusError struct {
	Type       string `json:"type"`
	Status     string `json:"status"`
	StatusCode int    `json:"status_code"`
	Operation  string `json:"operation"`
	ErrorCode  int    `json:"error_code"`
	Error      string `json:"error"`
	Metadata   any    `json:"metadata"`
}

func writeError(w http.ResponseWriter, status int, msg string, r Rule) {
	if status == 0 {
		status = http.StatusInternalServerError
	}
	if msg == "" {
		msg = fmt.Sprintf("incusfault: injected %d (%v)", status, r)
	}
	body, _ := json.Marshal(incusError{Type: "error", ErrorCode: status, Error: msg})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
