package conformance

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// pingEvery is how often the suite pings while it waits for an answer: the
// contract asks a waiting peer for at least one ping every 20 seconds.
const pingEvery = 15 * time.Second

// clientInfo is what the suite says it is in initialize.
var clientInfo = controller.BuildInfo{Name: "lightspeed-conformance"}

// dial opens a WebSocket to the controller with the given headers and no
// initialize. On a refused upgrade the HTTP status of the answer comes back
// with the error; it is 0 when no HTTP answer came.
func (s *suite) dial(ctx context.Context, header http.Header) (*websocket.Conn, int, error) {
	return s.dialVia(ctx, header, nil)
}

// dialVia is dial with every byte the server sends read through wrap
// (nil: as it comes), below TLS: wrap sees the WebSocket frames.
func (s *suite) dialVia(ctx context.Context, header http.Header, wrap func(net.Conn) net.Conn) (*websocket.Conn, int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	d := websocket.Dialer{
		HandshakeTimeout: s.cfg.Timeout,
		TLSClientConfig:  s.cfg.TLSConfig,
		ReadBufferSize:   64 << 10,
		WriteBufferSize:  64 << 10,
	}
	target := s.cfg.URL
	u, _ := url.Parse(s.cfg.URL)
	plain := func(network, addr string) func(ctx context.Context, _, _ string) (net.Conn, error) {
		return func(ctx context.Context, _, _ string) (net.Conn, error) {
			var nd net.Dialer
			c, err := nd.DialContext(ctx, network, addr)
			if err != nil || wrap == nil {
				return c, err
			}
			return wrap(c), nil
		}
	}
	switch {
	case u != nil && u.Scheme == "unix":
		d.NetDialContext = plain("unix", u.Path)
		target = "ws://localhost" + s.cfg.UnixRequestPath
	case wrap != nil && u != nil && u.Scheme == "ws":
		d.NetDialContext = plain("tcp", hostPort(u))
	case wrap != nil && u != nil && u.Scheme == "wss":
		d.NetDialTLSContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var nd net.Dialer
			raw, err := nd.DialContext(ctx, "tcp", hostPort(u))
			if err != nil {
				return nil, err
			}
			cfg := &tls.Config{MinVersion: tls.VersionTLS12}
			if s.cfg.TLSConfig != nil {
				cfg = s.cfg.TLSConfig.Clone()
			}
			if cfg.ServerName == "" {
				cfg.ServerName = u.Hostname()
			}
			cfg.NextProtos = []string{"http/1.1"}
			tc := tls.Client(raw, cfg)
			if err := tc.HandshakeContext(ctx); err != nil {
				_ = raw.Close()
				return nil, err
			}
			return wrap(tc), nil
		}
	}
	ws, resp, err := d.DialContext(ctx, target, header)
	status := 0
	if resp != nil {
		status = resp.StatusCode
		// The status is all the suite reads of the answer; the library has
		// already kept what it wanted of the body.
		_ = resp.Body.Close()
	}
	if err != nil {
		return nil, status, err
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	return ws, status, nil
}

// hostPort is u's host with its scheme's port when it names none.
func hostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	if u.Scheme == "wss" {
		return net.JoinHostPort(u.Hostname(), "443")
	}
	return net.JoinHostPort(u.Hostname(), "80")
}

// authHeader carries the configured credential, or nothing.
func (s *suite) authHeader() http.Header {
	h := http.Header{}
	if s.cfg.Credential != "" {
		h.Set("Authorization", "Bearer "+s.cfg.Credential)
	}
	return h
}

// connect dials with the credential and does not initialize.
func (s *suite) connect(ctx context.Context, check string) (*conn, error) {
	ws, status, err := s.dial(ctx, s.authHeader())
	if err != nil {
		return nil, describeDialError(err, status)
	}
	return &conn{s: s, ws: ws, check: check}, nil
}

// open dials and initializes.
func (s *suite) open(ctx context.Context, check string) (*conn, controller.InitializeResult, error) {
	c, err := s.connect(ctx, check)
	if err != nil {
		return nil, controller.InitializeResult{}, err
	}
	var init controller.InitializeResult
	if err := c.call(ctx, controller.MethodInitialize, initializeParams(controller.ProtocolVersion), &init); err != nil {
		c.close()
		return nil, init, fmt.Errorf("initialize: %w", err)
	}
	return c, init, nil
}

func initializeParams(version uint32) controller.InitializeParams {
	return controller.InitializeParams{ProtocolVersion: version, ClientInfo: clientInfo}
}

func describeDialError(err error, status int) error {
	if status != 0 {
		return fmt.Errorf("the upgrade was refused with HTTP %d: %w", status, err)
	}
	return fmt.Errorf("cannot connect: %w", err)
}

// conn is one controller connection, read synchronously: the suite sends
// a frame and reads the next one, so it sees exactly what the server
// answered and in which order.
type conn struct {
	s      *suite
	ws     *websocket.Conn
	check  string
	nextID int64
}

func (c *conn) close() {
	_ = c.ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
	_ = c.ws.Close()
}

func (c *conn) newID() int64 {
	c.nextID++
	return c.nextID
}

func (c *conn) send(ctx context.Context, messageType int, data []byte) error {
	deadline := time.Now().Add(c.s.cfg.Timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = c.ws.SetWriteDeadline(deadline)
	if err := c.ws.WriteMessage(messageType, data); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	return nil
}

// sendText sends one frame of raw text, exactly as given.
func (c *conn) sendText(ctx context.Context, data string) error {
	return c.send(ctx, websocket.TextMessage, []byte(data))
}

// request sends a well-formed request; id is an int64 or a string, and a
// nil params is left out of the envelope.
func (c *conn) request(ctx context.Context, id any, method string, params any) error {
	env := map[string]any{"jsonrpc": "2.0", "id": id, "method": method}
	if params != nil {
		env["params"] = params
	}
	data, err := json.Marshal(env)
	if err != nil {
		return fmt.Errorf("encode %s: %w", method, err)
	}
	return c.send(ctx, websocket.TextMessage, data)
}

// notify sends a well-formed notification.
func (c *conn) notify(ctx context.Context, method string, params any) error {
	data, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "method": method, "params": params})
	if err != nil {
		return fmt.Errorf("encode %s: %w", method, err)
	}
	return c.send(ctx, websocket.TextMessage, data)
}

// frame is one answer from the server, its envelope already checked.
type frame struct {
	raw    []byte // the error object of an error answer, else the whole frame
	id     string // the id's JSON text: "null", "7", `"probe"`
	result json.RawMessage
	rpcErr *jsonrpc.Error // the error answer; its kind is the wire's even when it did not decode strictly
}

func (f *frame) String() string {
	if f.rpcErr != nil {
		return "error " + string(f.rpcErr.Kind) + " (" + f.rpcErr.Message + ")"
	}
	return "result " + clip(string(f.result), 200)
}

// next reads the next frame, pinging while it waits. Anything that is not
// a response envelope is a protocol violation and an error here.
func (c *conn) next(ctx context.Context, method string) (*frame, error) {
	deadline := time.Now().Add(c.s.cfg.Timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = c.ws.SetReadDeadline(deadline)
	start := time.Now()
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		t := time.NewTicker(pingEvery)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				_ = c.ws.WriteControl(websocket.PingMessage, nil, time.Now().Add(5*time.Second))
			}
		}
	}()
	kind, data, err := c.ws.ReadMessage()
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, fmt.Errorf("no answer to %s within %s", method, time.Since(start).Round(time.Millisecond))
		}
		return nil, fmt.Errorf("the connection ended while waiting for the answer to %s: %w", method, err)
	}
	if kind != websocket.TextMessage {
		return nil, fmt.Errorf("the server sent a binary frame while %s was pending; every message is one text frame", method)
	}
	f, problem := parseFrame(data)
	if problem != "" {
		return nil, fmt.Errorf("the answer to %s is not a valid response envelope: %s (frame: %s)", method, problem, clip(string(data), 300))
	}
	if f.rpcErr != nil {
		c.s.errs.add(c.check, method, errorProblem(f.raw))
	}
	return f, nil
}

// roundTrip sends a request with a fresh integer id and reads its answer,
// which must be the very next frame.
func (c *conn) roundTrip(ctx context.Context, method string, params any) (*frame, error) {
	id := c.newID()
	start := time.Now()
	if err := c.request(ctx, id, method, params); err != nil {
		return nil, err
	}
	f, err := c.expectID(ctx, method, strconv.FormatInt(id, 10))
	if err == nil {
		c.s.slow.add(c.check, method, time.Since(start))
	}
	return f, err
}

// expectID reads the next frame and requires the given id.
func (c *conn) expectID(ctx context.Context, method, id string) (*frame, error) {
	f, err := c.next(ctx, method)
	if err != nil {
		return nil, err
	}
	if f.id != id {
		return nil, fmt.Errorf("the next frame after %s (id %s) answered id %s instead: %s", method, id, f.id, f)
	}
	return f, nil
}

// call is a round trip whose result is decoded strictly into result (nil
// discards it). An error answer comes back as *jsonrpc.Error.
func (c *conn) call(ctx context.Context, method string, params any, result any) error {
	f, err := c.roundTrip(ctx, method, params)
	if err != nil {
		return err
	}
	if f.rpcErr != nil {
		return f.rpcErr
	}
	if result == nil {
		return nil
	}
	if err := wire.Decode(f.result, result); err != nil {
		return fmt.Errorf("the %s result does not decode strictly: %w (result: %s)", method, err, clip(string(f.result), 300))
	}
	return nil
}

// pipeline sends every request before reading any answer, then collects
// the answers in whatever order they come, in the order of params.
func (c *conn) pipeline(ctx context.Context, method string, params []any) ([]*frame, error) {
	ids := make(map[string]int, len(params))
	for i, p := range params {
		id := c.newID()
		ids[strconv.FormatInt(id, 10)] = i
		if err := c.request(ctx, id, method, p); err != nil {
			return nil, err
		}
	}
	out := make([]*frame, len(params))
	for range params {
		f, err := c.next(ctx, method)
		if err != nil {
			return nil, err
		}
		i, ok := ids[f.id]
		if !ok || out[i] != nil {
			return nil, fmt.Errorf("a pipelined %s was answered with id %s, which is not pending: %s", method, f.id, f)
		}
		out[i] = f
	}
	return out, nil
}

// parseFrame checks a server frame's envelope: jsonrpc "2.0", an id (null,
// integer or string), and exactly one of result and error; nothing else.
func parseFrame(data []byte) (*frame, string) {
	var members map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&members); err != nil || dec.More() {
		return nil, "it is not one JSON object"
	}
	if members == nil {
		return nil, "it is null, not an object"
	}
	for k := range members {
		switch k {
		case "jsonrpc", "id", "result", "error":
		case "method":
			return nil, "it names a method: the controller plane's server never sends requests or notifications"
		default:
			return nil, fmt.Sprintf("it has the unknown envelope member %q", k)
		}
	}
	if string(members["jsonrpc"]) != `"2.0"` {
		return nil, `its jsonrpc member is not "2.0"`
	}
	rawID, ok := members["id"]
	if !ok {
		return nil, "it has no id"
	}
	id, problem := canonicalID(rawID)
	if problem != "" {
		return nil, problem
	}
	result, hasResult := members["result"]
	errRaw, hasError := members["error"]
	f := &frame{raw: data, id: id}
	switch {
	case hasResult == hasError:
		return nil, "it must carry exactly one of result and error"
	case hasResult:
		if string(result) == "null" {
			return nil, "its result is null (the protocol has no null except the id)"
		}
		f.result = result
	default:
		f.raw = errRaw
		f.rpcErr = looseError(errRaw)
		if f.rpcErr == nil {
			return nil, "its error is not an object with a data.kind"
		}
	}
	return f, ""
}

// canonicalID renders an id as compact JSON text.
func canonicalID(raw json.RawMessage) (string, string) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return "", "its id does not parse"
	}
	switch id := v.(type) {
	case nil:
		return "null", ""
	case string:
		b, _ := json.Marshal(id)
		return string(b), ""
	case json.Number:
		n, err := id.Int64()
		if err != nil {
			return "", fmt.Sprintf("its id %s is not an integer", id)
		}
		return strconv.FormatInt(n, 10), ""
	default:
		return "", "its id is neither null, an integer nor a string"
	}
}

// looseError reads what an error answer says, strictly when it can and
// loosely otherwise, so that a malformed error still shows its kind. The
// strict verdict is errorProblem's.
func looseError(raw json.RawMessage) *jsonrpc.Error {
	var e jsonrpc.Error
	if err := json.Unmarshal(raw, &e); err == nil {
		return &e
	}
	var loose struct {
		Message string `json:"message"`
		Data    struct {
			Kind       string `json:"kind"`
			Field      string `json:"field"`
			Reason     string `json:"reason"`
			Capability string `json:"capability"`
		} `json:"data"`
	}
	if err := json.Unmarshal(raw, &loose); err == nil && loose.Data.Kind != "" {
		return &jsonrpc.Error{Kind: jsonrpc.Kind(loose.Data.Kind), Message: loose.Message,
			Field: loose.Data.Field, Reason: loose.Data.Reason, Capability: loose.Data.Capability}
	}
	// Not even loosely an error object with a kind: there is nothing to
	// show, and errorProblem reports what is wrong with it.
	return nil
}

// errorProblem checks one error object against the contract's "Errors"
// section: it decodes strictly (a known kind, the code that kind fixes, no
// unknown member), its message is at most 4096 bytes, and the kind's
// required typed fields are there. "" when it conforms.
func errorProblem(raw json.RawMessage) string {
	var e jsonrpc.Error
	if err := json.Unmarshal(raw, &e); err != nil {
		return fmt.Sprintf("the error object does not decode strictly: %v (error: %s)", err, clip(string(raw), 300))
	}
	var shape struct {
		Message json.RawMessage `json:"message"`
	}
	_ = json.Unmarshal(raw, &shape)
	var msg string
	if err := json.Unmarshal(shape.Message, &msg); err != nil {
		return "the error's message is not a string"
	}
	if len(msg) > jsonrpc.MaxMessageLen {
		return fmt.Sprintf("the %s error's message is %d bytes, over the %d-byte limit", e.Kind, len(msg), jsonrpc.MaxMessageLen)
	}
	switch e.Kind {
	case jsonrpc.KindFailedPrecondition:
		if e.Reason == "" {
			return "a failedPrecondition error has no data.reason (it is required)"
		}
	case jsonrpc.KindVersionMismatch:
		if e.Expected == nil || e.Received == nil {
			return "a versionMismatch error lacks data.expected or data.received"
		}
	case jsonrpc.KindCapabilityUnavailable:
		if e.Capability == "" {
			return "a capabilityUnavailable error has no data.capability"
		}
	}
	return ""
}

func clip(s string, most int) string {
	if len(s) <= most {
		return s
	}
	cut := most
	for cut > 0 && s[cut]&0xC0 == 0x80 {
		cut--
	}
	return s[:cut] + "…"
}

// describeErr renders an error for a failure sentence.
func describeErr(err error) string {
	var e *jsonrpc.Error
	if errors.As(err, &e) {
		s := string(e.Kind)
		var typed []string
		if e.Field != "" {
			typed = append(typed, "field "+e.Field)
		}
		if e.Reason != "" {
			typed = append(typed, "reason "+e.Reason)
		}
		if e.Capability != "" {
			typed = append(typed, "capability "+e.Capability)
		}
		if len(typed) > 0 {
			s += " (" + strings.Join(typed, ", ") + ")"
		}
		return s + ": " + clip(e.Message, 200)
	}
	return err.Error()
}
