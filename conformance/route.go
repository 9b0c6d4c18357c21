package conformance

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// The data-route bounds the contract names (x-lightspeed-data-route).
const (
	// MaxDataRouteHold is MAX_DATA_ROUTE_HOLD_MS: the longest a provider
	// may hold a data-route dial before it upgrades or refuses.
	MaxDataRouteHold = 5 * time.Second
	// RetryAfterMaxSeconds is RETRY_AFTER_MAX_SECS: a 503's Retry-After is
	// 1 to this many whole seconds.
	RetryAfterMaxSeconds = 60
	// RouteHoldGrace is what DialRoute allows on top of the hold bound for
	// the client's side of a dial: connecting, TLS and one round trip.
	RouteHoldGrace = time.Second
)

// maxRefusalBody bounds how much of a refusal's body is read: the largest
// valid body (a 1024-byte message, every byte escaped) is far below it.
const maxRefusalBody = 64 << 10

// The refusal states of a provider's data route, and the status each goes with.
var refusalStatus = map[string]int{
	"waking":  http.StatusServiceUnavailable,
	"booting": http.StatusServiceUnavailable,
	"gone":    http.StatusGone,
	"failed":  http.StatusConflict,
}

// Refusal is a data route's typed refusal, as read from its HTTP answer.
type Refusal struct {
	Status  int
	State   string
	Message string
	// RetryAfter is the 503's Retry-After (zero for other statuses).
	RetryAfter time.Duration
}

type refusalBody struct {
	State   string `json:"state" wire:"enum=waking|booting|gone|failed"`
	Message string `json:"message,omitempty" wire:"text"`
}

// CheckRefusal checks that resp is a data route's typed refusal: a JSON
// body (Content-Type application/json) whose state is waking, booting,
// gone or failed (failed with a message), decoded strictly; the status that
// goes with the state (503, 503, 410, 409); and on a 503 a Retry-After of
// 1 to 60 whole seconds. It reads and closes the body. The error lists
// every problem found.
func CheckRefusal(resp *http.Response) error {
	_, err := ReadRefusal(resp)
	return err
}

// ReadRefusal is CheckRefusal that also returns what the refusal says (as
// far as it could be read when there is an error).
func ReadRefusal(resp *http.Response) (Refusal, error) {
	if resp == nil {
		return Refusal{}, errors.New("there is no HTTP response")
	}
	ref := Refusal{Status: resp.StatusCode}
	var body []byte
	if resp.Body != nil {
		var err error
		body, err = io.ReadAll(io.LimitReader(resp.Body, maxRefusalBody+1))
		_ = resp.Body.Close()
		if err != nil {
			return ref, fmt.Errorf("the refusal's body could not be read: %w", err)
		}
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return ref, errors.New("the route upgraded (HTTP 101); that is not a refusal")
	}
	var problems []error
	fail := func(format string, args ...any) { problems = append(problems, fmt.Errorf(format, args...)) }

	ct := resp.Header.Get("Content-Type")
	if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
		fail("Content-Type is %q, want application/json", ct)
	}
	var b refusalBody
	switch {
	case len(body) > maxRefusalBody:
		fail("the body is over %d bytes", maxRefusalBody)
	default:
		if err := wire.Decode(body, &b); err != nil {
			fail("the body is not a data-route refusal ({\"state\": …}): %v (body: %s)", err, clip(string(body), 200))
			break
		}
		ref.State, ref.Message = b.State, b.Message
		if b.State == "failed" && b.Message == "" {
			fail("a failed refusal carries no message")
		}
		if want := refusalStatus[b.State]; resp.StatusCode != want {
			fail("state %s goes with HTTP %d, not %d", b.State, want, resp.StatusCode)
		}
	}
	if resp.StatusCode == http.StatusServiceUnavailable {
		secs, err := retryAfterSeconds(resp.Header.Values("Retry-After"))
		if err != nil {
			fail("%v", err)
		} else {
			ref.RetryAfter = time.Duration(secs) * time.Second
		}
	}
	return ref, errors.Join(problems...)
}

func retryAfterSeconds(values []string) (int, error) {
	if len(values) != 1 {
		return 0, fmt.Errorf("a 503 carries %d Retry-After headers, want exactly one", len(values))
	}
	v := values[0]
	for _, ch := range v {
		if ch < '0' || ch > '9' {
			return 0, fmt.Errorf("Retry-After %q is not a whole number of seconds", v)
		}
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > RetryAfterMaxSeconds {
		return 0, fmt.Errorf("Retry-After %q is outside 1 to %d seconds", v, RetryAfterMaxSeconds)
	}
	return n, nil
}

// RouteDial is the outcome of one data-route dial.
type RouteDial struct {
	// Status is the HTTP status of the answer (101 when it upgraded).
	Status int
	// Conn is the upgraded data-plane connection; the caller closes it.
	// Nil when the route refused.
	Conn *websocket.Conn
	// Refusal is the typed refusal; nil when the route upgraded.
	Refusal *Refusal
	// Elapsed runs from the start of the dial to the answer's headers.
	Elapsed time.Duration
}

// RouteDialer dials data routes; its zero value uses the system's TLS roots.
type RouteDialer struct {
	TLSConfig *tls.Config
	// AsARuntime dials as a runtime does, not as a checker of the hold
	// bound: it waits up to RuntimeDialWait for the answer and does not
	// call a late one an error. The answer itself is checked all the same.
	// A test whose subject is not the hold (a wake racing a power change,
	// on a machine loaded past what a hold can promise) dials this way;
	// the bound is the subject of checks that dial without it.
	AsARuntime bool
}

// RuntimeDialWait bounds a dial made AsARuntime.
const RuntimeDialWait = 30 * time.Second

// DialRoute dials a data route (ws:// or wss://) with the bearer
// credential (none when empty) and checks the answer: an upgrade, or a
// refusal that passes CheckRefusal; either within the 5 s hold bound (plus
// RouteHoldGrace for the client's own connect). The RouteDial is filled as
// far as the dial got, also when there is an error.
func DialRoute(ctx context.Context, routeURL, credential string) (RouteDial, error) {
	return RouteDialer{}.Dial(ctx, routeURL, credential)
}

// timeNow is replaced by tests that need a slow answer without waiting for one.
var timeNow = time.Now

// Dial is DialRoute with d's TLS configuration.
func (d RouteDialer) Dial(ctx context.Context, routeURL, credential string) (RouteDial, error) {
	u, err := url.Parse(routeURL)
	if err != nil || (u.Scheme != "ws" && u.Scheme != "wss") || u.Host == "" {
		return RouteDial{}, fmt.Errorf("the route %q is not a ws:// or wss:// URL", routeURL)
	}
	bound := MaxDataRouteHold + RouteHoldGrace
	wait := bound
	if d.AsARuntime {
		wait = RuntimeDialWait
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()

	var rec *recordingConn
	var dialer net.Dialer
	wd := websocket.Dialer{ReadBufferSize: 64 << 10, WriteBufferSize: 64 << 10, HandshakeTimeout: wait}
	wd.NetDialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		rec = newRecordingConn(c)
		return rec, nil
	}
	if u.Scheme == "wss" {
		wd.NetDialTLSContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := dialer.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			cfg := &tls.Config{}
			if d.TLSConfig != nil {
				cfg = d.TLSConfig.Clone()
			}
			if cfg.ServerName == "" {
				cfg.ServerName = u.Hostname()
			}
			tc := tls.Client(c, cfg)
			if err := tc.HandshakeContext(ctx); err != nil {
				_ = c.Close()
				return nil, err
			}
			rec = newRecordingConn(tc)
			return rec, nil
		}
	}
	header := http.Header{}
	if credential != "" {
		header.Set("Authorization", "Bearer "+credential)
	}
	start := timeNow()
	ws, resp, err := wd.DialContext(ctx, routeURL, header)
	out := RouteDial{Elapsed: timeNow().Sub(start)}
	if resp != nil {
		// Only the status and the request are read from resp: the library
		// keeps at most 1024 bytes of a refusal's body, so the refusal is
		// read again whole from the connection (see reread).
		_ = resp.Body.Close()
	}
	late := func() error {
		if out.Elapsed > bound && !d.AsARuntime {
			return fmt.Errorf("the route answered HTTP %d after %s, over the %s hold bound (allowing %s for the dial itself)",
				out.Status, out.Elapsed.Round(time.Millisecond), MaxDataRouteHold, RouteHoldGrace)
		}
		return nil
	}
	if err == nil {
		rec.stopRecording()
		ws.SetReadLimit(jsonrpc.MaxMessageBytes)
		out.Status, out.Conn = http.StatusSwitchingProtocols, ws
		return out, late()
	}
	if resp == nil || rec == nil || !errors.Is(err, websocket.ErrBadHandshake) {
		if rec != nil {
			rec.release()
		}
		if ctx.Err() != nil {
			return out, fmt.Errorf("the route gave no answer within %s (the hold bound is %s): %w", wait, MaxDataRouteHold, err)
		}
		return out, fmt.Errorf("dial %s: %w", routeURL, err)
	}
	out.Status = resp.StatusCode
	// The WebSocket library keeps only the first 1024 bytes of a refused
	// answer's body; read the whole answer again from what the connection
	// delivered, and on from the connection for the rest.
	full, rerr := rec.reread(resp.Request)
	defer rec.release()
	if rerr != nil {
		return out, fmt.Errorf("the refusal (HTTP %d) could not be read again: %w", resp.StatusCode, rerr)
	}
	refusal, cerr := ReadRefusal(full)
	out.Refusal = &refusal
	return out, errors.Join(cerr, late())
}

// recordingConn keeps the bytes a handshake read, and defers the library's
// Close, so that a refused answer can be read again in full.
type recordingConn struct {
	net.Conn
	mu        sync.Mutex
	recorded  bytes.Buffer
	recording atomic.Bool
	holdClose atomic.Bool
}

func newRecordingConn(c net.Conn) *recordingConn {
	r := &recordingConn{Conn: c}
	r.recording.Store(true)
	r.holdClose.Store(true)
	return r
}

func (r *recordingConn) Read(p []byte) (int, error) {
	n, err := r.Conn.Read(p)
	if n > 0 && r.recording.Load() {
		r.mu.Lock()
		if r.recorded.Len() < maxRefusalBody+(64<<10) {
			r.recorded.Write(p[:n])
		}
		r.mu.Unlock()
	}
	return n, err
}

func (r *recordingConn) Close() error {
	if r.holdClose.Load() {
		return nil
	}
	return r.Conn.Close()
}

// stopRecording hands the connection over after a successful upgrade.
func (r *recordingConn) stopRecording() {
	r.recording.Store(false)
	r.holdClose.Store(false)
	r.mu.Lock()
	r.recorded = bytes.Buffer{}
	r.mu.Unlock()
}

// release closes the connection for good.
func (r *recordingConn) release() {
	r.holdClose.Store(false)
	_ = r.Conn.Close()
}

// reread parses the HTTP answer from its first byte: the recorded bytes,
// then whatever the connection still delivers.
func (r *recordingConn) reread(req *http.Request) (*http.Response, error) {
	r.recording.Store(false)
	_ = r.SetReadDeadline(time.Now().Add(MaxDataRouteHold))
	r.mu.Lock()
	head := bytes.NewReader(bytes.Clone(r.recorded.Bytes()))
	r.mu.Unlock()
	resp, err := http.ReadResponse(bufio.NewReader(io.MultiReader(head, r.Conn)), req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxRefusalBody+1))
	if err != nil {
		return nil, fmt.Errorf("read the body: %w", err)
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	return resp, nil
}

// InitializeData runs the data plane's initialize (protocol version 5) on
// an upgraded data-route connection, within timeout, and checks that a
// data-plane daemon answered. The connection is left open for the caller.
func InitializeData(ws *websocket.Conn, client string, timeout time.Duration) error {
	req := `{"jsonrpc":"2.0","id":"initialize","method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":` +
		strconv.Quote(client) + `}}}`
	_ = ws.SetWriteDeadline(time.Now().Add(timeout))
	if err := ws.WriteMessage(websocket.TextMessage, []byte(req)); err != nil {
		return fmt.Errorf("data initialize: %w", err)
	}
	_ = ws.SetReadDeadline(time.Now().Add(timeout))
	_, data, err := ws.ReadMessage()
	_ = ws.SetReadDeadline(time.Time{})
	_ = ws.SetWriteDeadline(time.Time{})
	if err != nil {
		return fmt.Errorf("data initialize: %w", err)
	}
	if !bytes.Contains(data, []byte(`"plane":"data"`)) {
		return fmt.Errorf("data initialize answered %s", clip(string(data), 200))
	}
	return nil
}
