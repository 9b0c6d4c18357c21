package jsonrpc_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

func dialClient(t *testing.T, url string) *jsonrpc.Client {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(url, nil)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	c := jsonrpc.NewClient(ws)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func initialize(t *testing.T, c *jsonrpc.Client) {
	t.Helper()
	var res initResult
	err := c.Call(t.Context(), "initialize", map[string]any{"protocolVersion": testVersion, "clientInfo": map[string]any{"name": "client"}}, &res)
	if err != nil || res.Plane != testPlane || res.ProtocolVersion != testVersion {
		t.Fatalf("initialize: %+v %v", res, err)
	}
}

func asRPCError(t *testing.T, err error, kind jsonrpc.Kind) *jsonrpc.Error {
	t.Helper()
	var e *jsonrpc.Error
	if !errors.As(err, &e) || e.Kind != kind {
		t.Fatalf("got %v, want a *jsonrpc.Error of kind %s", err, kind)
	}
	return e
}

func TestClientRoundTrip(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	initialize(t, c)

	type echo struct {
		Name  string   `json:"name"`
		Count uint32   `json:"count,omitempty"`
		Tags  []string `json:"tags,omitempty"`
	}
	var got echo
	if err := c.Call(t.Context(), "test/echo", echo{Name: "n", Count: 3, Tags: []string{"a"}}, &got); err != nil {
		t.Fatal(err)
	}
	if got.Name != "n" || got.Count != 3 || len(got.Tags) != 1 {
		t.Fatalf("echo: %+v", got)
	}
	// nil params go out as {}; a nil result discards the answer.
	var empty map[string]any
	if err := c.Call(t.Context(), "test/echo", nil, &empty); err != nil || len(empty) != 0 || empty == nil {
		t.Fatalf("nil params: %v %v", empty, err)
	}
	if err := c.Call(t.Context(), "test/echo", map[string]int{"a": 1}, nil); err != nil {
		t.Fatal(err)
	}
	// Results decode strictly: a member the caller's type lacks is refused.
	var narrow struct {
		Name string `json:"name"`
	}
	err := c.Call(t.Context(), "test/echo", echo{Name: "n", Count: 3}, &narrow)
	var e *jsonrpc.Error
	if err == nil || errors.As(err, &e) || !strings.Contains(err.Error(), "count") {
		t.Fatalf("strict result: %v", err)
	}
	// Notifications reach their handler, nil params as {}.
	if err := c.Notify(t.Context(), "test/note", map[string]any{"k": "v"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Notify(t.Context(), "test/note", nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`{"k":"v"}`, `{}`} {
		select {
		case n := <-s.notes:
			if n.params != want {
				t.Fatalf("notification params %s, want %s", n.params, want)
			}
		case <-time.After(hangGuard):
			t.Fatal("notification not delivered")
		}
	}
	// The connection is still fine after all that.
	if err := c.Call(t.Context(), "test/echo", nil, nil); err != nil {
		t.Fatal(err)
	}
}

func TestClientErrorAnswers(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	asRPCError(t, c.Call(t.Context(), "test/echo", nil, nil), jsonrpc.KindNotInitialized)
	e := asRPCError(t, c.Call(t.Context(), "initialize", map[string]any{"protocolVersion": 3, "clientInfo": map[string]any{"name": "c"}}, nil), jsonrpc.KindVersionMismatch)
	if e.Expected == nil || *e.Expected != 4 || e.Received == nil || *e.Received != 3 {
		t.Fatalf("versionMismatch: %+v", e)
	}
	e = asRPCError(t, c.Call(t.Context(), "initialize", map[string]any{"clientInfo": map[string]any{"name": "c"}}, nil), jsonrpc.KindInvalidParams)
	if e.Field != "protocolVersion" {
		t.Fatalf("invalidParams: %+v", e)
	}
	initialize(t, c)
	for _, kind := range jsonrpc.Kinds() {
		err := c.Call(t.Context(), "test/typed", map[string]any{"kind": kind, "message": "m"}, nil)
		e := asRPCError(t, err, kind)
		got, _ := json.Marshal(e)
		want, _ := json.Marshal(typedError(kind, "m"))
		if string(got) != string(want) {
			t.Errorf("%s: decoded %s, want %s", kind, got, want)
		}
		if e.Error() != string(kind)+": m" {
			t.Errorf("Error() = %q", e.Error())
		}
	}
	asRPCError(t, c.Call(t.Context(), "test/panic", nil, nil), jsonrpc.KindInternal)
	asRPCError(t, c.Call(t.Context(), "no/such", nil, nil), jsonrpc.KindMethodNotFound)
	asRPCError(t, c.Call(t.Context(), "test/sized", map[string]any{"frameBytes": jsonrpc.MaxMessageBytes + 1}, nil), jsonrpc.KindPayloadTooLarge)
}

func TestClientRefusesOversizedMessagesLocally(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	initialize(t, c)
	huge := map[string]string{"x": strings.Repeat("x", jsonrpc.MaxMessageBytes)}
	e := asRPCError(t, c.Call(t.Context(), "test/echo", huge, nil), jsonrpc.KindPayloadTooLarge)
	if e.LimitBytes == nil || *e.LimitBytes != jsonrpc.MaxMessageBytes {
		t.Fatalf("limitBytes: %+v", e)
	}
	asRPCError(t, c.Notify(t.Context(), "test/note", huge), jsonrpc.KindPayloadTooLarge)
	// Nothing was sent: the connection is untouched.
	if err := c.Call(t.Context(), "test/echo", nil, nil); err != nil {
		t.Fatal(err)
	}
	if len(s.notes) != 0 {
		t.Fatal("the oversized notification was sent")
	}
	// An answer of exactly 16 MiB is read.
	var big string
	if err := c.Call(t.Context(), "test/sized", map[string]any{"frameBytes": jsonrpc.MaxMessageBytes}, &big); err != nil || len(big) < jsonrpc.MaxMessageBytes-64 {
		t.Fatalf("16 MiB answer: %d bytes, %v", len(big), err)
	}
}

func TestClientHonoursTheContext(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	initialize(t, c)

	// A deadline that passes while the server works.
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	err := c.Call(ctx, "test/slow", map[string]any{"key": "late"}, nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Call past its deadline: %v", err)
	}
	// Cancellation while waiting.
	ctx2, cancel2 := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Call(ctx2, "test/slow", map[string]any{"key": "cancelled"}, nil) }()
	for k := range s.started {
		if k == "cancelled" {
			break
		}
	}
	cancel2()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Call: %v", err)
	}
	// The late answers arrive and are dropped; the connection still works.
	s.release("late")
	s.release("cancelled")
	if err := c.Call(t.Context(), "test/echo", nil, nil); err != nil {
		t.Fatal(err)
	}
	// A context that has already ended never reaches the socket, so it
	// cannot leave the connection half-written.
	expired, cancel3 := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel3()
	if err := c.Call(expired, "test/echo", nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("expired Call: %v", err)
	}
	if err := c.Notify(expired, "test/note", nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("expired Notify: %v", err)
	}
	if err := c.Call(t.Context(), "test/echo", nil, nil); err != nil {
		t.Fatalf("after an expired context: %v", err)
	}
	select {
	case <-c.Done():
		t.Fatal("the connection ended")
	default:
	}
}

func TestClientPendingCallsFailWhenTheConnectionCloses(t *testing.T) {
	const n = 5
	seen := 0
	url, _ := rawServer(t, func(ws *websocket.Conn, req map[string]any) {
		// Read every call, answer none, then drop the connection.
		if seen++; seen == n {
			_ = ws.Close()
		}
	})
	c := dialClient(t, url)
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- c.Call(t.Context(), "test/slow", map[string]any{"key": fmt.Sprint(i)}, nil) }()
	}
	for range n {
		if err := <-errs; !errors.Is(err, jsonrpc.ErrClosed) {
			t.Fatalf("pending call: %v", err)
		}
	}
	<-c.Done()
	if err := c.Call(t.Context(), "test/echo", nil, nil); !errors.Is(err, jsonrpc.ErrClosed) {
		t.Fatalf("call after the end: %v", err)
	}
	if err := c.Notify(t.Context(), "test/note", nil); !errors.Is(err, jsonrpc.ErrClosed) {
		t.Fatalf("notify after the end: %v", err)
	}
}

func TestClientCallAfterClose(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	initialize(t, c)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Call(t.Context(), "test/echo", nil, nil); !errors.Is(err, jsonrpc.ErrClosed) {
		t.Fatalf("call after Close: %v", err)
	}
	select {
	case err := <-s.served:
		if err != nil {
			t.Fatalf("a normal close ends ServeConn without an error, got %v", err)
		}
	case <-time.After(hangGuard):
		t.Fatal("ServeConn did not end")
	}
}

// A Close that finds the read loop running waits for it to see the closed
// connection. An answer the loop had already read when Close came, to a
// call that has since given up, must not let it stop as if idle: Close
// would then wait forever (the idle loop's probes hung this way at the
// end of a test, in a clean CI run).
func TestClientCloseWhileALateAnswerIsRead(t *testing.T) {
	read, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	restore := jsonrpc.SetAfterRead(func() {
		once.Do(func() {
			close(read)
			<-release
		})
	})
	defer restore()
	url, _ := rawServer(t, func(ws *websocket.Conn, req map[string]any) {
		_ = ws.WriteJSON(map[string]any{"jsonrpc": "2.0", "id": req["id"], "result": map[string]any{}})
	})
	c := dialClient(t, url)
	ctx, cancel := context.WithCancel(t.Context())
	called := make(chan error, 1)
	go func() { called <- c.Call(ctx, "test/echo", nil, nil) }()
	<-read // the answer is read and not yet delivered
	cancel()
	if err := <-called; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled call: %v", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	for deadline := time.Now().Add(hangGuard); !jsonrpc.Closing(c); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("Close never closed the connection")
		}
	}
	close(release)
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(hangGuard):
		t.Fatal("Close still waits for a read loop that stopped as idle")
	}
	if jsonrpc.Reading(c) {
		select {
		case <-c.Done():
		default:
			t.Fatal("the read loop is said to run, and the connection has not ended")
		}
	}
}

// rawServer answers each request with whatever reply returns for it; it
// reports on closed when its peer has closed the connection.
func rawServer(t *testing.T, reply func(ws *websocket.Conn, request map[string]any)) (url string, closed <-chan struct{}) {
	t.Helper()
	ch := make(chan struct{}, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer ws.Close()
		for {
			_, data, err := ws.ReadMessage()
			if err != nil {
				ch <- struct{}{}
				return
			}
			var req map[string]any
			if err := json.Unmarshal(data, &req); err != nil {
				t.Errorf("the client sent %q", data)
				return
			}
			reply(ws, req)
		}
	}))
	t.Cleanup(srv.Close)
	return "ws" + strings.TrimPrefix(srv.URL, "http"), ch
}

func TestClientClosesOnAProtocolViolation(t *testing.T) {
	cases := map[string]func(id string) (int, string){
		"request": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":1,"method":"client/do","params":{}}`
		},
		"notification": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","method":"client/hear","params":{}}`
		},
		"binary frame": func(id string) (int, string) {
			return websocket.BinaryMessage, `{"jsonrpc":"2.0","id":` + id + `,"result":{}}`
		},
		"not JSON": func(id string) (int, string) { return websocket.TextMessage, `not json` },
		"result and error": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":` + id + `,"result":{},"error":{"code":-32004,"message":"m","data":{"kind":"notFound"}}}`
		},
		"neither": func(id string) (int, string) { return websocket.TextMessage, `{"jsonrpc":"2.0","id":` + id + `}` },
		"null id with a result": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":null,"result":{}}`
		},
		"null id with a broken error": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":null,"error":{"code":1,"message":"m","data":{"kind":"notFound"}}}`
		},
		"wrong version": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"1.0","id":` + id + `,"result":{}}`
		},
		"extra member": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":` + id + `,"result":{},"x":1}`
		},
		"batch of answers": func(id string) (int, string) {
			return websocket.TextMessage, `[{"jsonrpc":"2.0","id":` + id + `,"result":{}}]`
		},
		"two values": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":` + id + `,"result":{}} {}`
		},
		"request echoing the id": func(id string) (int, string) {
			return websocket.TextMessage, `{"jsonrpc":"2.0","id":` + id + `,"method":"x"}`
		},
	}
	for name, frame := range cases {
		t.Run(name, func(t *testing.T) {
			url, closed := rawServer(t, func(ws *websocket.Conn, req map[string]any) {
				id, _ := json.Marshal(req["id"])
				kind, data := frame(string(id))
				_ = ws.WriteMessage(kind, []byte(data))
			})
			c := dialClient(t, url)
			err := c.Call(t.Context(), "test/echo", nil, nil)
			if !errors.Is(err, jsonrpc.ErrClosed) {
				t.Fatalf("Call: %v, want ErrClosed", err)
			}
			select {
			case <-c.Done():
			case <-time.After(hangGuard):
				t.Fatal("Done not closed")
			}
			select {
			case <-closed:
			case <-time.After(hangGuard):
				t.Fatal("the client did not close the connection")
			}
			if err := c.Call(t.Context(), "test/echo", nil, nil); !errors.Is(err, jsonrpc.ErrClosed) {
				t.Fatalf("later Call: %v", err)
			}
		})
	}
}

func TestClientReportsARefusalItCannotAttribute(t *testing.T) {
	url, _ := rawServer(t, func(ws *websocket.Conn, req map[string]any) {
		_ = ws.WriteMessage(websocket.TextMessage, []byte(`{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Batches are not supported.","data":{"kind":"invalidRequest"}}}`))
	})
	c := dialClient(t, url)
	err := c.Call(t.Context(), "test/echo", nil, nil)
	if !errors.Is(err, jsonrpc.ErrClosed) {
		t.Fatalf("Call: %v", err)
	}
	e := asRPCError(t, err, jsonrpc.KindInvalidRequest)
	if e.Message != "Batches are not supported." {
		t.Fatalf("refusal: %+v", e)
	}
}

func TestClientToleratesRepeatedAndUnknownAnswers(t *testing.T) {
	url, _ := rawServer(t, func(ws *websocket.Conn, req map[string]any) {
		id, _ := json.Marshal(req["id"])
		answer := []byte(`{"jsonrpc":"2.0","id":` + string(id) + `,"result":{"ok":true}}`)
		_ = ws.WriteMessage(websocket.TextMessage, []byte(`{"jsonrpc":"2.0","id":"nobody","result":{}}`))
		for range 10 {
			_ = ws.WriteMessage(websocket.TextMessage, answer)
		}
	})
	c := dialClient(t, url)
	for range 5 {
		var got struct {
			OK bool `json:"ok"`
		}
		if err := c.Call(t.Context(), "test/echo", nil, &got); err != nil || !got.OK {
			t.Fatalf("Call: %+v %v", got, err)
		}
	}
}

func TestClientConcurrentCalls(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	initialize(t, c)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			for i := range 30 {
				want := fmt.Sprintf("%d/%d", g, i)
				var got struct {
					V string `json:"v"`
				}
				if err := c.Call(t.Context(), "test/echo", map[string]string{"v": want}, &got); err != nil || got.V != want {
					errs <- fmt.Errorf("call %s: %+v %w", want, got, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// A result as deep as wire lets a value be arrives in an envelope one level
// deeper; the client must not count that level against the result.
func TestClientTakesAResultAtTheDepthLimit(t *testing.T) {
	s := newTestServer(t)
	c := dialClient(t, s.url)
	initialize(t, c)
	inner := strings.Repeat("[", wire.MaxDepth-1) + "1" + strings.Repeat("]", wire.MaxDepth-1)
	var got map[string]any
	if err := c.Call(t.Context(), "test/echo", json.RawMessage(`{"a":`+inner+`}`), &got); err != nil {
		t.Fatalf("a %d-level result: %v", wire.MaxDepth, err)
	}
	if _, ok := got["a"].([]any); !ok {
		t.Fatalf("result: %v", got)
	}
}

// A call that waits long for its answer pings the server (the spec asks
// for one at least every 20 seconds); a client with nothing in flight sends
// none, and several calls waiting together do not each ping.
func TestClientPingsOnlyWhileACallWaits(t *testing.T) {
	defer jsonrpc.SetPingInterval(40 * time.Millisecond)()
	var mu sync.Mutex
	pings := 0
	answer := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer ws.Close()
		var wmu sync.Mutex
		ws.SetPingHandler(func(string) error {
			mu.Lock()
			pings++
			mu.Unlock()
			return nil
		})
		for {
			_, data, err := ws.ReadMessage()
			if err != nil {
				return
			}
			var req struct {
				ID json.RawMessage `json:"id"`
			}
			if err := json.Unmarshal(data, &req); err != nil {
				t.Errorf("the client sent %q", data)
				return
			}
			go func() {
				<-answer
				wmu.Lock()
				defer wmu.Unlock()
				_ = ws.WriteMessage(websocket.TextMessage, []byte(`{"jsonrpc":"2.0","id":`+string(req.ID)+`,"result":{}}`))
			}()
		}
	}))
	defer srv.Close()
	c := dialClient(t, "ws"+strings.TrimPrefix(srv.URL, "http"))
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return pings
	}
	time.Sleep(200 * time.Millisecond)
	if n := count(); n != 0 {
		t.Fatalf("%d pings with no call in flight", n)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- c.Call(t.Context(), "slow", nil, nil)
		}()
	}
	time.Sleep(400 * time.Millisecond)
	close(answer)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// 400 ms at one ping per 20 to 40 ms from eight waiting calls: a
	// handful, not eight per interval.
	n := count()
	t.Logf("%d pings while eight calls waited 400 ms (interval 40 ms)", n)
	if n < 2 || n > 25 {
		t.Fatalf("%d pings while eight calls waited 400 ms with a 40 ms interval; want some, and not one per call", n)
	}
	before := count()
	time.Sleep(200 * time.Millisecond)
	if after := count(); after != before {
		t.Fatalf("%d pings after every call was answered", after-before)
	}
}

// TestClientReadsOnlyWhileACallWaits: a client kept open between calls runs
// no read loop, and a close by the server in between is what the next call
// reports, as ErrClosed (which the idle loop takes as "dial again").
func TestClientReadsOnlyWhileACallWaits(t *testing.T) {
	url, _ := rawServer(t, func(ws *websocket.Conn, req map[string]any) {
		id, _ := json.Marshal(req["id"])
		_ = ws.WriteMessage(websocket.TextMessage, []byte(`{"jsonrpc":"2.0","id":`+string(id)+`,"result":{}}`))
		if req["method"] == "test/bye" {
			_ = ws.Close()
		}
	})
	c := dialClient(t, url)
	if jsonrpc.Reading(c) {
		t.Fatal("a new client reads before any call")
	}
	for range 3 {
		if err := c.Call(t.Context(), "test/echo", nil, nil); err != nil {
			t.Fatal(err)
		}
		if jsonrpc.Reading(c) {
			t.Fatal("the read loop outlived the call it read for")
		}
	}
	if err := c.Call(t.Context(), "test/bye", nil, nil); err != nil {
		t.Fatal(err)
	}
	err := c.Call(t.Context(), "test/echo", nil, nil)
	if !errors.Is(err, jsonrpc.ErrClosed) {
		t.Fatalf("a call after the server closed between calls: %v, want ErrClosed", err)
	}
	select {
	case <-c.Done():
	case <-time.After(hangGuard):
		t.Fatal("Done is not closed after a call saw the end")
	}
}
