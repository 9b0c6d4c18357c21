package envd

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
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
		{"unknown member", `{"idleForMs":1,"busy":true}`, 0, nil, "busy"},
		{"bare Count", `{"idleForMs":1,"Count":1}`, 0, nil, "Count"},
		{"null count", `{"idleForMs":1,"jobCount":null}`, 0, nil, "jobCount"},
		{"negative count", `{"idleForMs":1,"jobCount":-2}`, 0, nil, "jobCount"},
		{"fraction count", `{"idleForMs":1,"jobCount":0.5}`, 0, nil, "jobCount"},
		{"count at 2^32", `{"idleForMs":1,"jobCount":4294967296}`, 0, nil, "jobCount"},
		{"object count", `{"idleForMs":1,"jobCount":{}}`, 0, nil, "jobCount"},
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

func TestHandshakeToleratesUnknownMembersAndGetIdleRefusesThem(t *testing.T) {
	srv := fakeDaemon(t, 5, goodAnswer())
	s, err := Handshake(testCtx(t), dialTCP(t, srv), ClientInfo{Name: "incus-provider"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Initialized().ServerInfo.Version != "9.9.9" || string(s.Initialized().Members["futureMember"]) != "[1,2]" {
		t.Fatalf("%+v", s.Initialized())
	}
	_, err = s.GetIdle(testCtx(t))
	var fe *wire.FieldError
	if !errors.As(err, &fe) || fe.Path != "diagnostic" {
		t.Fatalf("got %v", err)
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
