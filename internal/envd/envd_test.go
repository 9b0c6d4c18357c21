package envd

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/devguest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

func TestDecodeIdle(t *testing.T) {
	for _, tc := range []struct {
		name   string
		raw    string
		idle   uint64
		counts map[string]uint64
		path   string // the member an error must name; "" for success
	}{
		{"minimal", `{"idleForMs":0}`, 0, map[string]uint64{}, ""},
		{"counts", `{"idleForMs":1500,"runningProcessCount":2,"openJobCount":0}`, 1500, map[string]uint64{"runningProcessCount": 2, "openJobCount": 0}, ""},
		{"largest idle", `{"idleForMs":9007199254740991}`, 9007199254740991, map[string]uint64{}, ""},
		{"largest count", `{"idleForMs":1,"xCount":4294967295}`, 1, map[string]uint64{"xCount": 4294967295}, ""},
		{"missing idle", `{"runningProcessCount":1}`, 0, nil, "idleForMs"},
		{"null idle", `{"idleForMs":null}`, 0, nil, "idleForMs"},
		{"negative idle", `{"idleForMs":-1}`, 0, nil, "idleForMs"},
		{"fraction idle", `{"idleForMs":1.5}`, 0, nil, "idleForMs"},
		{"exponent idle", `{"idleForMs":1e3}`, 0, nil, "idleForMs"},
		{"string idle", `{"idleForMs":"5"}`, 0, nil, "idleForMs"},
		{"idle at 2^53", `{"idleForMs":9007199254740992}`, 0, nil, "idleForMs"},
		// Diagnostics the contract does not name are set aside, never refused.
		{"unknown member", `{"idleForMs":1,"busy":true}`, 1, map[string]uint64{}, ""},
		{"bare Count", `{"idleForMs":1,"Count":1}`, 1, map[string]uint64{}, ""},
		{"null count", `{"idleForMs":1,"jobCount":null}`, 1, map[string]uint64{}, ""},
		{"negative count", `{"idleForMs":1,"jobCount":-2}`, 1, map[string]uint64{}, ""},
		{"fraction count", `{"idleForMs":1,"jobCount":0.5}`, 1, map[string]uint64{}, ""},
		{"count at 2^32", `{"idleForMs":1,"jobCount":4294967296}`, 1, map[string]uint64{}, ""},
		{"object count", `{"idleForMs":1,"jobCount":{},"runningProcessCount":3}`, 1, map[string]uint64{"runningProcessCount": 3}, ""},
		{"not an object", `[1]`, 0, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			idle, err := DecodeIdle([]byte(tc.raw))
			if tc.counts == nil {
				var fe *wire.FieldError
				if !errors.As(err, &fe) {
					t.Fatalf("want a field error, got %v", err)
				}
				if fe.Path != tc.path {
					t.Fatalf("error names %q, want %q (%v)", fe.Path, tc.path, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if idle.IdleForMs != tc.idle || idle.IdleFor != time.Duration(tc.idle)*time.Millisecond || len(idle.Counts) != len(tc.counts) {
				t.Fatalf("got %+v", idle)
			}
			var members map[string]json.RawMessage
			if err := json.Unmarshal([]byte(tc.raw), &members); err != nil {
				t.Fatal(err)
			}
			if want := len(members) - 1 - len(tc.counts); len(idle.Ignored) != want {
				t.Fatalf("ignored %v, want %d members set aside", idle.Ignored, want)
			}
			for k, v := range tc.counts {
				if idle.Counts[k] != v {
					t.Fatalf("count %s = %d, want %d", k, idle.Counts[k], v)
				}
			}
		})
	}
}

func dialTCP(t *testing.T, srv *httptest.Server) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestHandshakeAndGetIdleAgainstDevGuest(t *testing.T) {
	d, err := devguest.New(context.Background(), devguest.Config{Cwd: t.TempDir(), Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	defer srv.Close()
	defer d.Shutdown(context.Background())

	s, err := Handshake(testCtx(t), dialTCP(t, srv), ClientInfo{Name: "incus-provider", Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	init := s.Initialized()
	if init.Plane != "data" || init.ProtocolVersion != 5 || init.DaemonInstanceID != d.InstanceID() ||
		init.ServerInfo.Name != "lsenvd-dev" || init.ServerInfo.Version != "test" {
		t.Fatalf("initialized %+v", init)
	}
	if _, ok := init.Members["capabilities"]; !ok {
		t.Fatalf("members %v", init.Members)
	}
	idle, err := s.GetIdle(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"runningProcessCount", "retainedProcessCount", "connectionCount"} {
		if _, ok := idle.Counts[name]; !ok {
			t.Errorf("count %s missing from %v", name, idle.Counts)
		}
	}
	if idle.Counts["connectionCount"] != 1 {
		t.Errorf("connectionCount %d", idle.Counts["connectionCount"])
	}
	// A second probe gets its own connection and the same daemon.
	s2, err := Handshake(testCtx(t), dialTCP(t, srv), ClientInfo{Name: "incus-provider"})
	if err != nil {
		t.Fatal(err)
	}
	if s2.Initialized().DaemonInstanceID != init.DaemonInstanceID {
		t.Fatal("instance id differs")
	}
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
}

// fakeDaemon serves initialize with a chosen server version and answer.
func fakeDaemon(t *testing.T, version uint64, answer map[string]any) *httptest.Server {
	t.Helper()
	up := websocket.Upgrader{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		s := &jsonrpc.Server{
			Plane: "data", ProtocolVersion: version,
			Initialize: func(context.Context, json.RawMessage) (any, error) { return answer, nil },
			Methods: map[string]jsonrpc.Method{
				"env/getIdle": func(context.Context, json.RawMessage) (any, error) {
					return map[string]any{"idleForMs": 42, "runningProcessCount": 0, "diagnostic": "x"}, nil
				},
			},
		}
		_ = s.ServeConn(context.Background(), ws)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func goodAnswer() map[string]any {
	return map[string]any{
		"protocolVersion": 5, "plane": "data", "daemonInstanceId": "abc",
		"serverInfo":   map[string]any{"name": "lightspeed-envd", "version": "9.9.9"},
		"capabilities": map[string]any{"futureFamily": map[string]any{"x": true}},
		"futureMember": []any{1, 2},
	}
}

func TestHandshakeVersionMismatch(t *testing.T) {
	srv := fakeDaemon(t, 6, goodAnswer())
	_, err := Handshake(testCtx(t), dialTCP(t, srv), ClientInfo{Name: "incus-provider"})
	var rpc *jsonrpc.Error
	if !errors.As(err, &rpc) || rpc.Kind != jsonrpc.KindVersionMismatch || *rpc.Expected != 6 || *rpc.Received != 5 {
		t.Fatalf("got %v", err)
	}
	if !IsVersionMismatch(err) {
		t.Fatal("IsVersionMismatch is false")
	}
}

func TestHandshakeChecksAnswer(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change map[string]any
		field  string // HandshakeError field, or "" for another error naming want
		want   string
	}{
		{"controller plane", map[string]any{"plane": "controller"}, "plane", ""},
		{"other version", map[string]any{"protocolVersion": 4}, "protocolVersion", ""},
		{"no plane", map[string]any{"plane": nil}, "", "without plane"},
		{"bad instance id", map[string]any{"daemonInstanceId": ""}, "", "daemonInstanceId"},
		{"strict serverInfo", map[string]any{"serverInfo": map[string]any{"name": "x", "colour": "red"}}, "", "serverInfo.colour"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			answer := goodAnswer()
			for k, v := range tc.change {
				if v == nil {
					delete(answer, k)
				} else {
					answer[k] = v
				}
			}
			srv := fakeDaemon(t, 5, answer)
			_, err := Handshake(testCtx(t), dialTCP(t, srv), ClientInfo{Name: "incus-provider"})
			if err == nil {
				t.Fatal("handshake succeeded")
			}
			var he *HandshakeError
			if tc.field != "" {
				if !errors.As(err, &he) || he.Field != tc.field {
					t.Fatalf("got %v", err)
				}
				if (tc.field == "protocolVersion") != IsVersionMismatch(err) {
					t.Fatalf("IsVersionMismatch wrong for %v", err)
				}
				return
			}
			if errors.As(err, &he) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

// The handshake keeps members it does not model, and env/getIdle sets an
// unknown diagnostic aside and reads idleForMs (issue 26: refused, it kept
// the target awake forever).
func TestHandshakeAndGetIdleTolerateUnknownMembers(t *testing.T) {
	srv := fakeDaemon(t, 5, goodAnswer())
	s, err := Handshake(testCtx(t), dialTCP(t, srv), ClientInfo{Name: "incus-provider"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Initialized().ServerInfo.Version != "9.9.9" || string(s.Initialized().Members["futureMember"]) != "[1,2]" {
		t.Fatalf("%+v", s.Initialized())
	}
	idle, err := s.GetIdle(testCtx(t))
	if err != nil || !slices.Equal(idle.Ignored, []string{"diagnostic"}) {
		t.Fatalf("got %+v, %v", idle, err)
	}
}

func TestHandshakeBoundedByContext(t *testing.T) {
	client, server := net.Pipe() // the far end never answers
	defer server.Close()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	done := make(chan error, 1)
	go func() {
		_, err := Handshake(ctx, client, ClientInfo{Name: "incus-provider"})
		done <- err
	}()
	go func() { // drain the upgrade request so the stall is on the answer
		buf := make([]byte, 4096)
		for {
			if _, err := server.Read(buf); err != nil {
				return
			}
		}
	}()
	select {
	case err := <-done:
		if err == nil || !errors.Is(err, context.Canceled) {
			t.Fatalf("got %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Handshake ignored its context")
	}
}

// scriptedDaemon upgrades every connection and answers the first frame it
// reads with reply(id), id being that request's id as sent; a nil reply
// stays silent. Frames are text unless binary is set.
func scriptedDaemon(t *testing.T, binary bool, reply func(id string) string) *httptest.Server {
	t.Helper()
	up := websocket.Upgrader{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer ws.Close()
		_, data, err := ws.ReadMessage()
		if err != nil {
			return
		}
		var req struct {
			ID json.RawMessage `json:"id"`
		}
		if err := json.Unmarshal(data, &req); err != nil {
			t.Errorf("the client sent %s", data)
			return
		}
		if reply != nil {
			kind := websocket.TextMessage
			if binary {
				kind = websocket.BinaryMessage
			}
			if err := ws.WriteMessage(kind, []byte(reply(string(req.ID)))); err != nil {
				return
			}
		}
		// Hold the connection until the client ends it.
		for {
			if _, _, err := ws.ReadMessage(); err != nil {
				return
			}
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func response(member string) func(id string) string {
	return func(id string) string { return `{"jsonrpc":"2.0","id":` + id + `,` + member + `}` }
}

// TestHandshakeTellsAnAnswerFromNone: a daemon that answered initialize in
// any well-formed way is an AnsweredError (the readiness probe lets the
// runtime meet that answer); a daemon that did not answer is not.
func TestHandshakeTellsAnAnswerFromNone(t *testing.T) {
	withAnswer := func(change map[string]any) map[string]any {
		a := goodAnswer()
		for k, v := range change {
			if v == nil {
				delete(a, k)
			} else {
				a[k] = v
			}
		}
		return a
	}
	for _, tc := range []struct {
		name string
		srv  func(t *testing.T) *httptest.Server
		// mismatch is "field daemon client" for an answer that disagrees on
		// the version or plane, "" for another answer.
		mismatch string
		kind     jsonrpc.Kind // the error kind answered, if any
	}{
		{"versionMismatch", func(t *testing.T) *httptest.Server { return fakeDaemon(t, 6, goodAnswer()) }, "protocolVersion 6 5", jsonrpc.KindVersionMismatch},
		{"another plane", func(t *testing.T) *httptest.Server {
			return fakeDaemon(t, 5, withAnswer(map[string]any{"plane": "controller"}))
		}, `plane "controller" "data"`, ""},
		{"another version in the result", func(t *testing.T) *httptest.Server {
			return fakeDaemon(t, 5, withAnswer(map[string]any{"protocolVersion": 4}))
		}, "protocolVersion 4 5", ""},
		{"another typed error", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, response(`"error":{"code":-32019,"message":"starting","data":{"kind":"unavailable","retryAfterMs":100}}`))
		}, "", jsonrpc.KindUnavailable},
		{"an error of a kind this version does not know", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, response(`"error":{"code":-32099,"message":"x","data":{"kind":"futureKind"}}`))
		}, "", jsonrpc.KindInternal},
		{"a result that is not an object", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, response(`"result":[5]`))
		}, "", ""},
		{"a result without daemonInstanceId", func(t *testing.T) *httptest.Server {
			return fakeDaemon(t, 5, withAnswer(map[string]any{"daemonInstanceId": nil}))
		}, "", ""},
	} {
		t.Run("answered/"+tc.name, func(t *testing.T) {
			_, err := Handshake(testCtx(t), dialTCP(t, tc.srv(t)), ClientInfo{Name: "incus-provider"})
			var ae *AnsweredError
			if !errors.As(err, &ae) || !Answered(err) {
				t.Fatalf("got %v, want an AnsweredError", err)
			}
			field, daemon, client, ok := ae.Mismatch()
			if got := strings.TrimSpace(field + " " + daemon + " " + client); got != tc.mismatch || ok != (tc.mismatch != "") {
				t.Fatalf("Mismatch() = %q %v, want %q (%v)", got, ok, tc.mismatch, err)
			}
			var rpc *jsonrpc.Error
			if errors.As(err, &rpc) != (tc.kind != "") || (rpc != nil && rpc.Kind != tc.kind) {
				t.Fatalf("got %v, want error kind %q", err, tc.kind)
			}
		})
	}

	for _, tc := range []struct {
		name     string
		srv      func(t *testing.T) *httptest.Server
		deadline bool // the answer never comes: the context ends it
	}{
		{"the connection closes at once", func(t *testing.T) *httptest.Server {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				conn, _, err := http.NewResponseController(w).Hijack()
				if err == nil {
					conn.Close()
				}
			}))
			t.Cleanup(srv.Close)
			return srv
		}, false},
		{"the WebSocket upgrade is refused", func(t *testing.T) *httptest.Server {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "not yet", http.StatusServiceUnavailable)
			}))
			t.Cleanup(srv.Close)
			return srv
		}, false},
		{"nothing after the upgrade", func(t *testing.T) *httptest.Server { return scriptedDaemon(t, false, nil) }, true},
		{"an answer to another id", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, func(string) string { return `{"jsonrpc":"2.0","id":"other","result":{}}` })
		}, true},
		{"not JSON", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, func(string) string { return "HELLO" })
		}, false},
		{"not JSON-RPC 2.0", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, func(id string) string { return `{"jsonrpc":"1.0","id":` + id + `,"result":{}}` })
		}, false},
		{"a binary frame", func(t *testing.T) *httptest.Server { return scriptedDaemon(t, true, response(`"result":{}`)) }, false},
		{"a refusal of the frame with a null id", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, func(string) string {
				return `{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x","data":{"kind":"parseError"}}}`
			})
		}, false},
		{"a request of the server's", func(t *testing.T) *httptest.Server {
			return scriptedDaemon(t, false, func(string) string { return `{"jsonrpc":"2.0","id":1,"method":"ping"}` })
		}, false},
	} {
		t.Run("not answered/"+tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			_, err := Handshake(ctx, dialTCP(t, tc.srv(t)), ClientInfo{Name: "incus-provider"})
			if err == nil || Answered(err) {
				t.Fatalf("got %v, want a failure that is not an answer", err)
			}
			if errors.Is(err, context.DeadlineExceeded) != tc.deadline {
				t.Fatalf("got %v; want the deadline to have ended it: %v", err, tc.deadline)
			}
		})
	}

	t.Run("not answered/a listener that says nothing", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				t.Cleanup(func() { c.Close() })
			}
		}()
		conn, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		// The upgrade reads under the context's deadline set on the
		// connection, which may fire a moment before the context says so:
		// only "no answer" is certain.
		_, err = Handshake(ctx, conn, ClientInfo{Name: "incus-provider"})
		if err == nil || Answered(err) {
			t.Fatalf("got %v", err)
		}
	})
}
