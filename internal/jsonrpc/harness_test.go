package jsonrpc_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// The test server serves a controller-like plane, version 4, with a few
// methods. Nothing here measures time: a deadline on a read only stops a
// broken test from hanging.
const (
	testPlane   = "controller"
	testVersion = 4
	hangGuard   = 30 * time.Second
)

type observation struct {
	method string
	kind   jsonrpc.Kind
}

type note struct {
	method string
	params string
}

type testServer struct {
	t    testing.TB
	srv  *jsonrpc.Server
	http *httptest.Server
	url  string

	mu      sync.Mutex
	gates   map[string]chan struct{}
	started chan string // "slow" sends its key once it runs
	ended   chan string // "slow" sends its key when its ctx ended
	notes   chan note
	obs     chan observation
	defects chan string
	served  chan error // what each ServeConn returned
	cancel  context.CancelFunc

	// observeHook, when set before the first connection, runs inside Observe.
	observeHook func(method string, kind jsonrpc.Kind)
}

type slowParams struct {
	Key string `json:"key"`
}

type sizedParams struct {
	FrameBytes uint64 `json:"frameBytes"`
}

type typedParams struct {
	Kind    string `json:"kind"`
	Message string `json:"message,omitempty"`
}

type initParams struct {
	ProtocolVersion uint32 `json:"protocolVersion"`
	ClientInfo      struct {
		Name string `json:"name" wire:"info"`
	} `json:"clientInfo"`
}

type initResult struct {
	ProtocolVersion uint32 `json:"protocolVersion"`
	Plane           string `json:"plane" wire:"enum=controller"`
}

func newTestServer(t testing.TB, configure ...func(*testServer)) *testServer {
	t.Helper()
	s := &testServer{
		t:       t,
		gates:   map[string]chan struct{}{},
		started: make(chan string, 256),
		ended:   make(chan string, 256),
		notes:   make(chan note, 256),
		obs:     make(chan observation, 4096),
		defects: make(chan string, 256),
		served:  make(chan error, 64),
	}
	s.srv = &jsonrpc.Server{
		Plane:           testPlane,
		ProtocolVersion: testVersion,
		Initialize: func(ctx context.Context, params json.RawMessage) (any, error) {
			var p initParams
			if err := jsonrpc.DecodeParams(params, &p); err != nil {
				return nil, err
			}
			return initResult{ProtocolVersion: testVersion, Plane: testPlane}, nil
		},
		Methods: map[string]jsonrpc.Method{
			"test/echo": func(ctx context.Context, params json.RawMessage) (any, error) {
				return params, nil
			},
			"test/slow": s.slow,
			"test/sized": func(ctx context.Context, params json.RawMessage) (any, error) {
				var p sizedParams
				if err := jsonrpc.DecodeParams(params, &p); err != nil {
					return nil, err
				}
				id, _ := jsonrpc.RequestID(ctx)
				overhead := len(`{"jsonrpc":"2.0","id":` + string(id) + `,"result":""}`)
				return strings.Repeat("x", int(p.FrameBytes)-overhead), nil
			},
			"test/panic": func(ctx context.Context, params json.RawMessage) (any, error) {
				panic("the method fell over")
			},
			"test/fail": func(ctx context.Context, params json.RawMessage) (any, error) {
				return nil, errors.New("disk on fire at /var/secret")
			},
			"test/typed": func(ctx context.Context, params json.RawMessage) (any, error) {
				var p typedParams
				if err := jsonrpc.DecodeParams(params, &p); err != nil {
					return nil, err
				}
				return nil, typedError(jsonrpc.Kind(p.Kind), p.Message)
			},
			"test/wrapped": func(ctx context.Context, params json.RawMessage) (any, error) {
				return nil, fmt.Errorf("while looking: %w", jsonrpc.WithReason(jsonrpc.KindNotFound, "expired", "gone"))
			},
			"test/badText": func(ctx context.Context, params json.RawMessage) (any, error) {
				// Invalid UTF-8 grows on the wire (each bad byte becomes U+FFFD).
				return nil, jsonrpc.Errorf(jsonrpc.KindNotFound, "%s", strings.Repeat("\xff", 3000))
			},
			"test/nothing": func(ctx context.Context, params json.RawMessage) (any, error) {
				return nil, nil
			},
			"test/nilPointer": func(ctx context.Context, params json.RawMessage) (any, error) {
				var r *initResult
				return r, nil
			},
			"test/unencodable": func(ctx context.Context, params json.RawMessage) (any, error) {
				return map[string]any{"ch": make(chan int)}, nil
			},
			"test/id": func(ctx context.Context, params json.RawMessage) (any, error) {
				id, ok := jsonrpc.RequestID(ctx)
				if !ok {
					return nil, errors.New("no request id in the context")
				}
				return map[string]json.RawMessage{"id": id}, nil
			},
		},
		Notifications: map[string]func(context.Context, json.RawMessage){
			"test/note": func(ctx context.Context, params json.RawMessage) {
				s.notes <- note{"test/note", string(params)}
			},
		},
		Observe: func(method string, kind jsonrpc.Kind, d time.Duration) {
			if s.observeHook != nil {
				s.observeHook(method, kind)
			}
			select {
			case s.obs <- observation{method, kind}:
			default:
			}
		},
		OnInternal: func(method string, err error) {
			s.defects <- method + ": " + err.Error()
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	upgrader := websocket.Upgrader{}
	s.http = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := upgrader.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer ws.Close()
		s.served <- s.srv.ServeConn(ctx, ws)
	}))
	// A configure function may change the Server or replace s.http.Listener.
	for _, c := range configure {
		c(s)
	}
	s.http.Start()
	s.url = "ws" + strings.TrimPrefix(s.http.URL, "http")
	t.Cleanup(func() {
		cancel()
		s.http.Close()
	})
	return s
}

func (s *testServer) gate(key string) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	g, ok := s.gates[key]
	if !ok {
		g = make(chan struct{})
		s.gates[key] = g
	}
	return g
}

func (s *testServer) release(key string) { close(s.gate(key)) }

func (s *testServer) slow(ctx context.Context, params json.RawMessage) (any, error) {
	var p slowParams
	if err := jsonrpc.DecodeParams(params, &p); err != nil {
		return nil, err
	}
	s.started <- p.Key
	select {
	case <-s.gate(p.Key):
		return map[string]string{"key": p.Key}, nil
	case <-ctx.Done():
		s.ended <- p.Key
		return nil, jsonrpc.WithReason(jsonrpc.KindAborted, "cancelled", "the connection ended")
	}
}

func (s *testServer) waitStarted(t testing.TB, n int) map[string]bool {
	t.Helper()
	keys := map[string]bool{}
	for len(keys) < n {
		select {
		case k := <-s.started:
			keys[k] = true
		case <-time.After(hangGuard):
			t.Fatalf("only %d of %d slow calls started", len(keys), n)
		}
	}
	return keys
}

// waitObserved reads observations until one for method arrives.
func (s *testServer) waitObserved(t testing.TB, method string) observation {
	t.Helper()
	for {
		select {
		case o := <-s.obs:
			if o.method == method {
				return o
			}
		case <-time.After(hangGuard):
			t.Fatalf("Observe never saw %s", method)
		}
	}
}

func typedError(kind jsonrpc.Kind, message string) *jsonrpc.Error {
	n := func(v uint64) *uint64 { return &v }
	e := &jsonrpc.Error{Kind: kind, Message: message}
	switch kind {
	case jsonrpc.KindInvalidParams:
		e.Field, e.Ceiling = "jobs[0].dependsOn", n(64)
	case jsonrpc.KindPermissionDenied, jsonrpc.KindNotFound, jsonrpc.KindFailedPrecondition, jsonrpc.KindAborted:
		e.Reason = "someReason"
	case jsonrpc.KindVersionMismatch:
		e.Expected, e.Received = n(4), n(3)
	case jsonrpc.KindCapabilityUnavailable:
		e.Capability = "power"
	case jsonrpc.KindBusy:
		e.Reason, e.RetryAfterMs = "rateLimited", n(250)
	case jsonrpc.KindUnavailable:
		e.RetryAfterMs = n(2000)
	case jsonrpc.KindPayloadTooLarge:
		e.LimitBytes, e.LimitEntries = n(1<<24), n(4096)
	}
	return e
}

// peer is a raw WebSocket client: it sends exactly the frames a test writes.
type peer struct {
	t  testing.TB
	ws *websocket.Conn
}

func (s *testServer) dial(t testing.TB) *peer {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(s.url, nil)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	t.Cleanup(func() { ws.Close() })
	return &peer{t: t, ws: ws}
}

// dialThrough is dial, over the client's connection as wrap makes it (to
// count, record or size it).
func (s *testServer) dialThrough(t testing.TB, wrap func(net.Conn) net.Conn) *peer {
	t.Helper()
	dialer := websocket.Dialer{NetDialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return wrap(c), nil
	}}
	ws, _, err := dialer.Dial(s.url, nil)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	t.Cleanup(func() { ws.Close() })
	return &peer{t: t, ws: ws}
}

func (p *peer) send(frame string) {
	p.t.Helper()
	if err := p.ws.WriteMessage(websocket.TextMessage, []byte(frame)); err != nil {
		p.t.Fatalf("send %s: %v", frame, err)
	}
}

func (p *peer) request(id any, method string, params any) {
	p.t.Helper()
	m := map[string]any{"jsonrpc": "2.0", "id": id, "method": method}
	if params != nil {
		m["params"] = params
	}
	raw, err := json.Marshal(m)
	if err != nil {
		p.t.Fatal(err)
	}
	p.send(string(raw))
}

// response is one answer, checked against the envelope rules on arrival.
type response struct {
	raw     string
	id      string // the id as sent: `null`, `7`, `"a"`
	result  json.RawMessage
	err     *jsonrpc.Error
	code    int
	message string
	data    map[string]any
}

func (p *peer) read() response {
	p.t.Helper()
	_ = p.ws.SetReadDeadline(time.Now().Add(hangGuard))
	kind, data, err := p.ws.ReadMessage()
	if err != nil {
		p.t.Fatalf("read: %v", err)
	}
	if kind != websocket.TextMessage {
		p.t.Fatalf("the server sent frame type %d", kind)
	}
	return checkResponse(p.t, data)
}

// call sends a request and reads the next message, which must answer it.
func (p *peer) call(id any, method string, params any) response {
	p.t.Helper()
	p.request(id, method, params)
	r := p.read()
	want, _ := json.Marshal(id)
	if r.id != string(want) {
		p.t.Fatalf("asked %s with id %s, answered id %s: %s", method, want, r.id, r.raw)
	}
	return r
}

func (p *peer) initialize() {
	p.t.Helper()
	r := p.call("init", "initialize", map[string]any{"protocolVersion": testVersion, "clientInfo": map[string]any{"name": "test"}})
	if r.err != nil {
		p.t.Fatalf("initialize: %v", r.err)
	}
	var res initResult
	if err := jsonrpc.DecodeParams(r.result, &res); err != nil || res.Plane != testPlane || res.ProtocolVersion != testVersion {
		p.t.Fatalf("initialize answered %s (%v)", r.result, err)
	}
}

// sentinel proves that nothing was answered before it: the next message on
// the connection must be the sentinel's own answer.
func (p *peer) sentinel(label string) {
	p.t.Helper()
	id := "sentinel-" + label
	r := p.call(id, "test/echo", map[string]any{"s": label})
	if r.err != nil && r.err.Kind != jsonrpc.KindNotInitialized {
		p.t.Fatalf("sentinel %s: %v", label, r.err)
	}
}

func expectError(t testing.TB, r response, kind jsonrpc.Kind, id string) {
	t.Helper()
	if r.err == nil {
		t.Fatalf("want %s with id %s, got a result: %s", kind, id, r.raw)
	}
	if r.err.Kind != kind || r.id != id {
		t.Fatalf("want %s with id %s, got %s", kind, id, r.raw)
	}
}

// checkResponse applies the envelope rules every answer must meet.
func checkResponse(t testing.TB, data []byte) response {
	t.Helper()
	var generic map[string]any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&generic); err != nil {
		t.Fatalf("the server sent a frame that is not a JSON object: %q: %v", data, err)
	}
	for k := range generic {
		switch k {
		case "jsonrpc", "id", "result", "error":
		default:
			t.Fatalf("response member %q: %s", k, data)
		}
	}
	if generic["jsonrpc"] != "2.0" {
		t.Fatalf("jsonrpc is not \"2.0\": %s", data)
	}
	rawID, present := generic["id"]
	if !present {
		t.Fatalf("response without an id: %s", data)
	}
	_, hasResult := generic["result"]
	_, hasError := generic["error"]
	if hasResult == hasError {
		t.Fatalf("a response has exactly one of result and error: %s", data)
	}
	for k, v := range generic {
		if k == "id" {
			continue
		}
		if path, found := findNull(v, k); found {
			t.Fatalf("null at %s; only the id may be null: %s", path, data)
		}
	}
	idText, _ := json.Marshal(rawID)
	r := response{raw: string(data), id: string(idText)}
	if hasResult {
		r.result, _ = json.Marshal(generic["result"])
		return r
	}
	obj, ok := generic["error"].(map[string]any)
	if !ok {
		t.Fatalf("error is not an object: %s", data)
	}
	for k := range obj {
		if k != "code" && k != "message" && k != "data" {
			t.Fatalf("error member %q: %s", k, data)
		}
	}
	code, err := obj["code"].(json.Number).Int64()
	if err != nil {
		t.Fatalf("error code: %s", data)
	}
	r.code = int(code)
	r.message, _ = obj["message"].(string)
	if r.message == "" || len(r.message) > jsonrpc.MaxMessageLen || !utf8.ValidString(r.message) {
		t.Fatalf("error message must be 1 to %d bytes of UTF-8, got %d: %s", jsonrpc.MaxMessageLen, len(r.message), clip(string(data)))
	}
	r.data, _ = obj["data"].(map[string]any)
	kind, _ := r.data["kind"].(string)
	if jsonrpc.Kind(kind).Code() != r.code || !knownKind(jsonrpc.Kind(kind)) {
		t.Fatalf("error code %d does not match kind %q: %s", r.code, kind, data)
	}
	var e jsonrpc.Error
	raw, _ := json.Marshal(obj)
	if err := json.Unmarshal(raw, &e); err != nil {
		t.Fatalf("the error object does not decode strictly: %v: %s", err, data)
	}
	r.err = &e
	return r
}

func knownKind(k jsonrpc.Kind) bool {
	for _, known := range jsonrpc.Kinds() {
		if k == known {
			return true
		}
	}
	return false
}

func findNull(v any, path string) (string, bool) {
	switch x := v.(type) {
	case nil:
		return path, true
	case map[string]any:
		for k, item := range x {
			if p, found := findNull(item, path+"."+k); found {
				return p, true
			}
		}
	case []any:
		for i, item := range x {
			if p, found := findNull(item, fmt.Sprintf("%s[%d]", path, i)); found {
				return p, true
			}
		}
	}
	return "", false
}

func clip(s string) string {
	if len(s) > 300 {
		return s[:300] + "…"
	}
	return s
}

// countingConn counts the bytes read from and written to a connection.
type countingConn struct {
	net.Conn
	mu      sync.Mutex
	read    int64
	written int64
	change  chan struct{} // signalled (without blocking) on every read
}

func newCountingConn(c net.Conn) *countingConn {
	return &countingConn{Conn: c, change: make(chan struct{}, 1)}
}

func (c *countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.mu.Lock()
	c.read += int64(n)
	c.mu.Unlock()
	select {
	case c.change <- struct{}{}:
	default:
	}
	return n, err
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.mu.Lock()
	c.written += int64(n)
	c.mu.Unlock()
	return n, err
}

func (c *countingConn) counts() (read, written int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.read, c.written
}

// listener hands out accepted connections wrapped, and reports them.
type listener struct {
	net.Listener
	wrap     func(net.Conn) net.Conn
	accepted chan net.Conn
}

func (l *listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	w := l.wrap(c)
	select {
	case l.accepted <- w:
	default:
	}
	return w, nil
}

// recordingConn keeps every byte a client reads, so that a test can see
// the frames themselves, which a WebSocket library hides.
type recordingConn struct {
	net.Conn
	mu   sync.Mutex
	read []byte
}

func (c *recordingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.mu.Lock()
	c.read = append(c.read, b[:n]...)
	c.mu.Unlock()
	return n, err
}

type wireFrame struct {
	fin    bool
	opcode int
	length uint64
}

// frames parses what the server sent after its handshake answer (RFC 6455
// section 5.2; a server's frames are not masked).
func (c *recordingConn) frames(t testing.TB) []wireFrame {
	t.Helper()
	c.mu.Lock()
	data := c.read
	c.mu.Unlock()
	end := bytes.Index(data, []byte("\r\n\r\n"))
	if end < 0 {
		t.Fatal("no handshake answer on the tape")
	}
	data = data[end+4:]
	var out []wireFrame
	for len(data) > 0 {
		if len(data) < 2 {
			t.Fatalf("a frame header cut short: % x", data)
		}
		f := wireFrame{fin: data[0]&0x80 != 0, opcode: int(data[0] & 0x0f), length: uint64(data[1] & 0x7f)}
		if data[1]&0x80 != 0 {
			t.Fatal("the server masked a frame")
		}
		head := 2
		switch f.length {
		case 126:
			f.length, head = uint64(binary.BigEndian.Uint16(data[2:4])), 4
		case 127:
			f.length, head = binary.BigEndian.Uint64(data[2:10]), 10
		}
		if uint64(len(data)-head) < f.length {
			t.Fatalf("a frame of %d bytes with %d on the tape", f.length, len(data)-head)
		}
		out = append(out, f)
		data = data[head+int(f.length):]
	}
	return out
}
