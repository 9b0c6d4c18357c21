package routes

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// The tests below put daemons that answer initialize without a data-plane
// success of this version behind the simulated guest, and others that do
// not answer it at all. The first kind is relayed, so that the runtime's own
// handshake meets the answer; the second is refused as booting.

// daemonServer serves the data plane's envelope with the given plane and
// version, answering a matching initialize with result.
func daemonServer(t *testing.T, plane string, version uint64, result map[string]any) string {
	t.Helper()
	return serveDaemon(t, func(ws *websocket.Conn) {
		s := &jsonrpc.Server{
			Plane: plane, ProtocolVersion: version,
			Initialize: func(context.Context, json.RawMessage) (any, error) { return result, nil },
		}
		_ = s.ServeConn(context.Background(), ws)
	})
}

// serveDaemon runs serve on every upgraded connection and returns the
// server's address.
func serveDaemon(t *testing.T, serve func(ws *websocket.Conn)) string {
	t.Helper()
	up := websocket.Upgrader{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer ws.Close()
		serve(ws)
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

func initializeResult(plane string, version int) map[string]any {
	return map[string]any{
		"protocolVersion": version, "plane": plane, "daemonInstanceId": "d1",
		"serverInfo": map[string]any{"name": "lightspeed-envd", "version": "0.0.1"},
	}
}

// initializeRaw sends the runtime's initialize through the relay and
// returns the daemon's answer as it arrived.
func initializeRaw(t *testing.T, ws *websocket.Conn) (map[string]json.RawMessage, *jsonrpc.Error) {
	t.Helper()
	_ = ws.SetWriteDeadline(time.Now().Add(10 * time.Second))
	req := `{"jsonrpc":"2.0","id":7,"method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":"routes-test"}}}`
	if err := ws.WriteMessage(websocket.TextMessage, []byte(req)); err != nil {
		t.Fatalf("initialize through the relay: %v", err)
	}
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, data, err := ws.ReadMessage()
	if err != nil {
		t.Fatalf("initialize through the relay: %v", err)
	}
	var resp struct {
		ID     json.RawMessage            `json:"id"`
		Result map[string]json.RawMessage `json:"result"`
		Error  *jsonrpc.Error             `json:"error"`
	}
	if err := json.Unmarshal(data, &resp); err != nil || string(resp.ID) != "7" {
		t.Fatalf("initialize answered %s (%v)", data, err)
	}
	return resp.Result, resp.Error
}

func TestRouteRelaysADaemonOfAnotherVersion(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	r := newHandlerRig(t, func(o *Options) { o.Log = zap.New(core) })
	r.guest.useDaemon(daemonServer(t, "data", 6, initializeResult("data", 6)))

	for dial := 1; dial <= 2; dial++ {
		ws, resp, err := r.dial(ownRoute, nil)
		if err != nil {
			st, retry := refusal(t, resp, err)
			t.Fatalf("dial %d refused %s (retry %d s), want it relayed to the daemon", dial, st, retry)
		}
		_, rpcErr := initializeRaw(t, ws)
		if rpcErr == nil || rpcErr.Kind != jsonrpc.KindVersionMismatch || rpcErr.Expected == nil || *rpcErr.Expected != 6 ||
			rpcErr.Received == nil || *rpcErr.Received != 5 {
			t.Fatalf("dial %d: the runtime saw %+v, want the daemon's versionMismatch (expected 6, received 5)", dial, rpcErr)
		}
		ws.Close()
		// A power change forgets readiness: the next dial probes again.
		r.wake.Unready(testInstance)
	}
	if got := dialCount(r.metrics, OutcomeUpgraded); got != 2 {
		t.Fatalf("upgraded dials %v, want 2", got)
	}
	if got := r.wakeSamples(t, "incompatible"); got != 2 {
		t.Fatalf("wakes counted incompatible %d, want 2", got)
	}
	if got := r.wakeSamples(t, "ready"); got != 0 {
		t.Fatalf("wakes counted ready %d, want 0: the daemon is of another version", got)
	}
	// One line for the operator, naming both versions, however many probes.
	lines := logs.FilterLevelExact(zapcore.WarnLevel).All()
	if len(lines) != 1 {
		t.Fatalf("%d warnings, want 1: %v", len(lines), lines)
	}
	fields := lines[0].ContextMap()
	if fields["daemon"] != "6" || fields["provider"] != "5" || fields["instance"] != testInstance {
		t.Fatalf("the warning says %q with %v, want both versions", lines[0].Message, fields)
	}
}

func TestRouteRelaysOtherAnswersToInitialize(t *testing.T) {
	for _, tc := range []struct {
		name   string
		daemon func(t *testing.T) string
		check  func(t *testing.T, result map[string]json.RawMessage, rpcErr *jsonrpc.Error)
	}{
		{"another plane", func(t *testing.T) string {
			return daemonServer(t, "controller", 5, initializeResult("controller", 5))
		}, func(t *testing.T, result map[string]json.RawMessage, rpcErr *jsonrpc.Error) {
			if rpcErr != nil || string(result["plane"]) != `"controller"` {
				t.Fatalf("the runtime saw %v %v, want the daemon's controller-plane result", result, rpcErr)
			}
		}},
		{"another version in the result", func(t *testing.T) string {
			return daemonServer(t, "data", 5, initializeResult("data", 4))
		}, func(t *testing.T, result map[string]json.RawMessage, rpcErr *jsonrpc.Error) {
			if rpcErr != nil || string(result["protocolVersion"]) != "4" {
				t.Fatalf("the runtime saw %v %v, want the daemon's version-4 result", result, rpcErr)
			}
		}},
		{"another typed error", func(t *testing.T) string {
			return serveDaemon(t, func(ws *websocket.Conn) {
				s := &jsonrpc.Server{Plane: "data", ProtocolVersion: 5, Initialize: func(context.Context, json.RawMessage) (any, error) {
					return nil, jsonrpc.Errorf(jsonrpc.KindFailedPrecondition, "The daemon's state directory is locked.")
				}}
				_ = s.ServeConn(context.Background(), ws)
			})
		}, func(t *testing.T, _ map[string]json.RawMessage, rpcErr *jsonrpc.Error) {
			if rpcErr == nil || rpcErr.Kind != jsonrpc.KindFailedPrecondition {
				t.Fatalf("the runtime saw %v, want the daemon's failedPrecondition", rpcErr)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newHandlerRig(t, nil)
			r.guest.useDaemon(tc.daemon(t))
			ws, resp, err := r.dial(ownRoute, nil)
			if err != nil {
				st, retry := refusal(t, resp, err)
				t.Fatalf("refused %s (retry %d s), want it relayed to the daemon", st, retry)
			}
			defer ws.Close()
			result, rpcErr := initializeRaw(t, ws)
			tc.check(t, result, rpcErr)
			if got := r.wakeSamples(t, "incompatible"); got != 1 {
				t.Fatalf("wakes counted incompatible %d, want 1", got)
			}
		})
	}
}

func TestRouteKeepsADaemonThatDoesNotAnswerBooting(t *testing.T) {
	const hold = time.Second
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, g *guestSim)
	}{
		{"accepts and says nothing", func(_ *testing.T, g *guestSim) { g.silent = true }},
		{"refuses the connection", func(_ *testing.T, g *guestSim) { g.refusing = true }},
		{"closes at once", func(_ *testing.T, g *guestSim) { g.closing = true }},
		{"refuses the WebSocket upgrade", func(t *testing.T, g *guestSim) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "starting", http.StatusServiceUnavailable)
			}))
			t.Cleanup(srv.Close)
			g.daemon = srv.Listener.Addr().String()
		}},
		{"upgrades and says nothing", func(t *testing.T, g *guestSim) {
			g.daemon = serveDaemon(t, func(ws *websocket.Conn) {
				for {
					if _, _, err := ws.ReadMessage(); err != nil {
						return
					}
				}
			})
		}},
		{"answers no JSON-RPC", func(t *testing.T, g *guestSim) {
			g.daemon = serveDaemon(t, func(ws *websocket.Conn) {
				if _, _, err := ws.ReadMessage(); err != nil {
					return
				}
				_ = ws.WriteMessage(websocket.TextMessage, []byte("<html>503 Service Unavailable</html>"))
				_, _, _ = ws.ReadMessage()
			})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newHandlerRig(t, func(o *Options) { o.Hold = hold })
			r.guest.mu.Lock()
			tc.setup(t, r.guest)
			r.guest.mu.Unlock()
			d := r.dialRoute(ownRoute, "")
			if d.Refusal == nil || d.Refusal.State != string(wake.StateBooting) || d.Refusal.RetryAfter != time.Second {
				t.Fatalf("got %+v, want booting with Retry-After 1 s", d)
			}
			if d.Elapsed > hold {
				t.Fatalf("refused after %s, later than the hold %s", d.Elapsed, hold)
			}
			if r.wake.Ready(testInstance) {
				t.Fatal("a daemon that did not answer was marked ready")
			}
			if n := r.guest.dials.Load(); n < 1 {
				t.Fatal("the daemon was never probed")
			}
			for _, o := range []string{"ready", "incompatible"} {
				if got := r.wakeSamples(t, o); got != 0 {
					t.Fatalf("wakes counted %s %d, want 0", o, got)
				}
			}
		})
	}
}
