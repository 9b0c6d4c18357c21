package incusfault_test

// Tests against the real incusd through the proxy, with our own incus
// client, each in its own throwaway project (internal/incustest: skipped
// without Incus, failed with INCUS_PROVIDER_REQUIRE_INCUS=1). Every fault
// test also checks that the fault fired, so a fault that does nothing fails.

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/url"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

type rig struct {
	p      *incusfault.Proxy
	c      *incus.Client // through the proxy
	direct *incus.Client // straight to Incus, same project
}

// newRig starts a proxy in front of Incus and a client through it, in a
// fresh project, with calls bounded by callTimeout.
func newRig(t *testing.T, callTimeout time.Duration) *rig {
	t.Helper()
	direct := incustest.Client(t)
	p := start(t, 0, t.Logf)
	return &rig{p: p, c: clientVia(t, p, direct.Project(), callTimeout), direct: direct}
}

func start(t *testing.T, seed uint64, logf func(string, ...any)) *incusfault.Proxy {
	t.Helper()
	p, err := incusfault.Start(t.Context(), incusfault.Config{Upstream: incustest.Socket(), Seed: seed, Logf: logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}

func clientVia(t *testing.T, p *incusfault.Proxy, project string, callTimeout time.Duration) *incus.Client {
	t.Helper()
	c, err := incus.New(incus.Config{Socket: p.Socket(), Project: project, CallTimeout: callTimeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// createEmpty creates a stopped container with no root filesystem: an
// async operation that Incus finishes in milliseconds, with no image.
func createEmpty(ctx context.Context, c *incus.Client, name string) (*incus.Operation, error) {
	return c.CreateInstance(ctx, incus.InstancesPost{Name: name, Source: incus.InstanceSource{Type: "none"}})
}

// settle waits out the project's running operations, for checks made
// straight to Incus after a call whose answer the client never saw.
func settle(t *testing.T, ctx context.Context, c *incus.Client) {
	t.Helper()
	ops, err := c.ListOperations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range ops {
		_, _ = c.Wait(ctx, &ops[i])
	}
}

// transportError checks that err is a call that got no answer: an
// *incus.Error with no status, which the client counts as retryable.
func transportError(t *testing.T, what string, err error) {
	t.Helper()
	var e *incus.Error
	if err == nil || !errors.As(err, &e) || e.Status != 0 || e.Err == nil {
		t.Fatalf("%s: want a transport *incus.Error, got %v", what, err)
	}
	if !incus.IsRetryable(err) {
		t.Errorf("%s: IsRetryable(%v) = false, want true", what, err)
	}
	t.Logf("%s: %v", what, err)
}

func TestPassThrough(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)

	srv, err := r.c.GetServer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if srv.Auth != "trusted" || srv.Environment.Server != "incus" {
		t.Fatalf("GET /1.0 through the proxy: auth %q server %q", srv.Auth, srv.Environment.Server)
	}
	if list, err := r.c.ListInstances(ctx); err != nil || len(list) != 0 {
		t.Fatalf("list of a fresh project: %v %v", list, err)
	}
	op, err := createEmpty(ctx, r.c, "through")
	if err != nil {
		t.Fatal(err)
	}
	if op.ID == "" {
		t.Fatalf("create answered no operation: %+v", op)
	}
	if _, err := r.c.Wait(ctx, op); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.direct.GetInstance(ctx, "through"); err != nil {
		t.Fatalf("created through the proxy, not in Incus: %v", err)
	}
	for _, c := range []struct{ method, pattern string }{
		{"GET", "/1.0"}, {"GET", "/1.0/instances"}, {"POST", "/1.0/instances"}, {"GET", "/1.0/operations/*/wait"},
	} {
		seen, fwd := r.p.Seen(c.method, c.pattern), r.p.Forwarded(c.method, c.pattern)
		if seen == 0 || seen != fwd {
			t.Errorf("%s %s: seen %d, forwarded %d; want equal and non-zero", c.method, c.pattern, seen, fwd)
		}
	}
	if n := r.p.Seen("DELETE", "/1.0/**"); n != 0 {
		t.Errorf("Seen(DELETE) = %d, want 0", n)
	}
}

// A long poll stays open at Incus for its whole server-side timeout and
// comes back through the proxy; an operation's own WebSockets (not the
// event stream) are relayed too. The operation is an instance create that
// waits for a migration source to push to it: it runs until its WebSockets
// are connected and closed, which ends it at once, failed.
func TestOperationWaitLongPollAndWebSockets(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)
	project := url.QueryEscape(r.c.Project())
	srv, err := r.c.GetServer(ctx)
	if err != nil || len(srv.Environment.Architectures) == 0 {
		t.Fatalf("server architectures: %v %v", srv, err)
	}

	var created struct {
		Metadata struct {
			ID       string            `json:"id"`
			Metadata map[string]string `json:"metadata"`
		} `json:"metadata"`
	}
	status := raw(t, ctx, r.p.Socket(), http.MethodPost, "/1.0/instances?project="+project,
		`{"name":"sink","architecture":"`+srv.Environment.Architectures[0]+`","source":{"type":"migration","mode":"push"}}`, &created)
	id := created.Metadata.ID
	if status != http.StatusAccepted || id == "" || created.Metadata.Metadata["control"] == "" {
		t.Fatalf("migration sink create: HTTP %d %+v", status, created)
	}

	start := time.Now()
	var waited struct {
		Type  string `json:"type"`
		Error string `json:"error"`
	}
	status = raw(t, ctx, r.p.Socket(), http.MethodGet, "/1.0/operations/"+id+"/wait?timeout=1&project="+project, "", &waited)
	took := time.Since(start)
	if took < 900*time.Millisecond || took > 5*time.Second {
		t.Errorf("wait?timeout=1 came back after %s: the long poll did not wait at Incus", took)
	}
	t.Logf("wait?timeout=1 on a running operation: HTTP %d %+v after %s", status, waited, took)
	if op, err := r.c.GetOperation(ctx, id); err != nil || op.Final() {
		t.Fatalf("the operation should still run: %+v %v", op, err)
	}

	d := websocket.Dialer{NetDialContext: unixDial(r.p.Socket()), HandshakeTimeout: 5 * time.Second}
	var streams []*websocket.Conn
	defer func() {
		for _, ws := range streams {
			ws.Close()
		}
	}()
	for _, k := range []string{"control", "fs"} {
		ws, resp, err := d.DialContext(ctx, "ws://unix.socket/1.0/operations/"+id+"/websocket?project="+project+
			"&secret="+created.Metadata.Metadata[k], nil)
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		if err != nil {
			t.Fatalf("operation websocket %s through the proxy: %v", k, err)
		}
		streams = append(streams, ws)
	}
	if n := r.p.CutEvents(); n != 0 {
		t.Errorf("CutEvents cut %d operation websockets; it is for /1.0/events only", n)
	}
	if n := r.p.Seen("GET", "/1.0/operations/*/websocket"); n != 2 {
		t.Errorf("Seen websocket = %d, want 2", n)
	}
	for _, ws := range streams {
		ws.Close()
	}
	// The sink reads its offer from the control stream: the closes reach
	// it through the relay and fail the operation, which Wait reports.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = r.c.Wait(wctx, &incus.Operation{ID: id, StatusCode: incus.StatusRunning})
	var opErr *incus.OperationError
	if !errors.As(err, &opErr) {
		t.Fatalf("wait after the streams closed: want the operation failed, got %v", err)
	}
	t.Logf("operation ended: %v", err)
}

// raw makes one plain request through socket, decodes the Incus envelope
// into out and returns the HTTP status.
func raw(t *testing.T, ctx context.Context, socket, method, target, body string, out any) int {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: unixDial(socket)}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, method, "http://unix.socket"+target, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatalf("%s %s: not an Incus envelope: %v", method, target, err)
	}
	return resp.StatusCode
}

func unixDial(socket string) func(ctx context.Context, _, _ string) (net.Conn, error) {
	return func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}
}

func dialEvents(ctx context.Context, socket, project string) (*websocket.Conn, error) {
	d := websocket.Dialer{NetDialContext: unixDial(socket), HandshakeTimeout: 5 * time.Second}
	ws, resp, err := d.DialContext(ctx, "ws://unix.socket/1.0/events?type=lifecycle&project="+url.QueryEscape(project), nil)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	return ws, err
}

// awaitEvent reads lifecycle events until one for instance name arrives.
func awaitEvent(t *testing.T, ws *websocket.Conn, action, name string) {
	t.Helper()
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		_, data, err := ws.ReadMessage()
		if err != nil {
			t.Fatalf("waiting for %s of %s: %v", action, name, err)
		}
		var ev struct {
			Type     string `json:"type"`
			Metadata struct {
				Action string `json:"action"`
				Source string `json:"source"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			t.Fatalf("event %s: %v", data, err)
		}
		src, err := url.Parse(ev.Metadata.Source)
		if err == nil && ev.Metadata.Action == action && src.Path == "/1.0/instances/"+name {
			return
		}
		t.Logf("event %s %s", ev.Metadata.Action, ev.Metadata.Source)
	}
}

func TestEventsStreamAndCut(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)

	ws, err := dialEvents(ctx, r.p.Socket(), r.c.Project())
	if err != nil {
		t.Fatalf("events through the proxy: %v", err)
	}
	defer ws.Close()
	op, err := createEmpty(ctx, r.direct, "ev")
	if err == nil {
		_, err = r.direct.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	awaitEvent(t, ws, "instance-created", "ev")

	if n := r.p.CutEvents(); n != 1 {
		t.Fatalf("CutEvents = %d, want 1", n)
	}
	_ = ws.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _, err = ws.ReadMessage()
	var ne net.Error
	if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("read after CutEvents: want the stream closed, got %v", err)
	}
	t.Logf("read after CutEvents: %v", err)

	id := r.p.Add(incusfault.Rule{Method: "GET", Path: "/1.0/events", Fault: incusfault.Refuse})
	if ws2, err := dialEvents(ctx, r.p.Socket(), r.c.Project()); err == nil {
		ws2.Close()
		t.Fatal("events dial with a Refuse rule: want an error")
	} else {
		t.Logf("events dial refused: %v", err)
	}
	if r.p.Hits(id) != 1 || r.p.Forwarded("GET", "/1.0/events") != 1 {
		t.Errorf("hits %d, forwarded %d; want 1 and 1", r.p.Hits(id), r.p.Forwarded("GET", "/1.0/events"))
	}
	r.p.Remove(id)
	ws3, err := dialEvents(ctx, r.p.Socket(), r.c.Project())
	if err != nil {
		t.Fatalf("events after the rule is removed: %v", err)
	}
	ws3.Close()
}

func TestRefuse(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)

	// The client's first call opens a fresh connection, which net/http
	// never replays: the refusal reaches the caller.
	id := r.p.Add(incusfault.Rule{Method: "GET", Path: "/1.0", Fault: incusfault.Refuse, Times: 1})
	_, err := r.c.GetServer(ctx)
	transportError(t, "refused GET /1.0", err)
	if r.p.Hits(id) != 1 || r.p.Forwarded("", "/1.0") != 0 {
		t.Fatalf("hits %d, forwarded %d; want 1 and 0", r.p.Hits(id), r.p.Forwarded("", "/1.0"))
	}
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatalf("after the one refusal: %v", err)
	}

	// On a pooled connection, net/http replays an idempotent request that
	// got no answer once, on a new connection: one refusal of a GET is
	// absorbed below our client, and only a second one reaches it.
	before := r.p.Seen("GET", "/1.0")
	id = r.p.Add(incusfault.Rule{Method: "GET", Path: "/1.0", Fault: incusfault.Refuse, Times: 1})
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatalf("one refusal on a pooled connection: want it replayed, got %v", err)
	}
	if got := r.p.Seen("GET", "/1.0") - before; r.p.Hits(id) != 1 || got != 2 {
		t.Fatalf("hits %d, requests %d; want 1 refusal and its replay", r.p.Hits(id), got)
	}

	// A write is never replayed: one refusal fails the call.
	op, err := createEmpty(ctx, r.direct, "x")
	if err == nil {
		_, err = r.direct.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	id = r.p.Add(incusfault.Rule{Method: "PATCH", Path: "/1.0/instances/*", Fault: incusfault.Refuse, Times: 1})
	err = r.c.PatchInstanceConfig(ctx, "x", map[string]string{"user.refused": "1"})
	transportError(t, "refused PATCH", err)
	inst, _, err := r.direct.GetInstance(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, set := inst.Config["user.refused"]; set || r.p.Hits(id) != 1 {
		t.Fatalf("a refused PATCH reached Incus (config %v, hits %d)", inst.Config, r.p.Hits(id))
	}
}

func TestBlackHole(t *testing.T) {
	r := newRig(t, 700*time.Millisecond)
	ctx := ctxFor(t, 30*time.Second)

	id := r.p.Add(incusfault.Rule{Method: "GET", Path: "/1.0/instances", Fault: incusfault.BlackHole})
	start := time.Now()
	_, err := r.c.ListInstances(ctx)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) || !incus.IsRetryable(err) {
		t.Fatalf("black-holed list: want the call's deadline (retryable), got %v", err)
	}
	if took < 700*time.Millisecond || took > 5*time.Second {
		t.Errorf("black-holed list gave up after %s, want about the 700ms call timeout", took)
	}
	t.Logf("black-holed list: %v after %s", err, took)
	if r.p.Hits(id) == 0 || r.p.Forwarded("GET", "/1.0/instances") != 0 {
		t.Fatalf("hits %d, forwarded %d", r.p.Hits(id), r.p.Forwarded("GET", "/1.0/instances"))
	}
	// The client hung up; its held request must end with it.
	waitFor(t, "the held request to end with its client", func() bool { return r.p.Held() == 0 })

	// A request held with its body, released by removing the rule, goes
	// on to Incus and its answer comes back.
	op, err := createEmpty(ctx, r.direct, "held")
	if err == nil {
		_, err = r.direct.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	slow := clientVia(t, r.p, r.c.Project(), 20*time.Second)
	id = r.p.Add(incusfault.Rule{Method: "PATCH", Fault: incusfault.BlackHole})
	done := make(chan error, 1)
	go func() { done <- slow.PatchInstanceConfig(ctx, "held", map[string]string{"user.held": "1"}) }()
	waitFor(t, "the PATCH to be held", func() bool { return r.p.Held() == 1 })
	if r.p.Forwarded("PATCH", "") != 0 {
		t.Fatal("a held PATCH was forwarded")
	}
	r.p.Remove(id)
	if err := <-done; err != nil {
		t.Fatalf("released PATCH: %v", err)
	}
	inst, _, err := r.direct.GetInstance(ctx, "held")
	if err != nil || inst.Config["user.held"] != "1" {
		t.Fatalf("released PATCH not applied: %v %v", inst, err)
	}
}

func TestDelay(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)
	id := r.p.Add(incusfault.Rule{Method: "GET", Path: "/1.0", Fault: incusfault.Delay, Delay: 400 * time.Millisecond})
	start := time.Now()
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 400*time.Millisecond {
		t.Fatalf("delayed GET answered after %s, want at least 400ms", took)
	}
	if r.p.Hits(id) != 1 || r.p.Forwarded("GET", "/1.0") != 1 {
		t.Fatalf("hits %d forwarded %d", r.p.Hits(id), r.p.Forwarded("GET", "/1.0"))
	}
}

func TestFail(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)

	id := r.p.Add(incusfault.Rule{Method: "GET", Path: "/1.0/instances", Query: "recursion=1",
		Fault: incusfault.Fail, Status: 503, Message: "injected: database is busy", Times: 1})
	_, err := r.c.ListInstances(ctx)
	var e *incus.Error
	if !errors.As(err, &e) || e.Status != 503 || e.Message != "injected: database is busy" || e.Err != nil {
		t.Fatalf("failed list: want *incus.Error 503 with the message, got %#v", err)
	}
	if !incus.IsRetryable(err) {
		t.Errorf("a 503 should be retryable: %v", err)
	}
	if r.p.Hits(id) != 1 || r.p.Forwarded("", "/1.0/instances") != 0 {
		t.Fatalf("hits %d forwarded %d", r.p.Hits(id), r.p.Forwarded("", "/1.0/instances"))
	}
	if _, err := r.c.ListInstances(ctx); err != nil {
		t.Fatalf("after the one failure: %v", err)
	}

	// The status maps onto the client's sentinels like a real answer's.
	r.p.Add(incusfault.Rule{Path: "/1.0/instances/*", Fault: incusfault.Fail, Status: 404})
	if _, _, err := r.c.GetInstance(ctx, "any"); !errors.Is(err, incus.ErrNotFound) || incus.IsRetryable(err) {
		t.Fatalf("injected 404: want ErrNotFound, not retryable; got %v", err)
	}
}

// The ambiguous fault: Incus did what was asked, the client saw an error.
func TestDropResponse(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)

	id := r.p.Add(incusfault.Rule{Method: "POST", Path: "/1.0/instances", Fault: incusfault.DropResponse, Times: 1})
	_, err := createEmpty(ctx, r.c, "ambiguous")
	transportError(t, "create with its answer dropped", err)
	if r.p.Hits(id) != 1 || r.p.Forwarded("POST", "/1.0/instances") != 1 {
		t.Fatalf("hits %d forwarded %d", r.p.Hits(id), r.p.Forwarded("POST", "/1.0/instances"))
	}
	settle(t, ctx, r.direct)
	if _, _, err := r.direct.GetInstance(ctx, "ambiguous"); err != nil {
		t.Fatalf("the dropped create should have taken effect: %v", err)
	}

	// A synchronous write alike.
	r.p.Add(incusfault.Rule{Method: "PATCH", Path: "/1.0/instances/ambiguous", Fault: incusfault.DropResponse, Times: 1})
	err = r.c.PatchInstanceConfig(ctx, "ambiguous", map[string]string{"user.dropped": "1"})
	transportError(t, "PATCH with its answer dropped", err)
	inst, _, err := r.direct.GetInstance(ctx, "ambiguous")
	if err != nil || inst.Config["user.dropped"] != "1" {
		t.Fatalf("the dropped PATCH should have taken effect: %v %v", inst, err)
	}
}

func TestHangAll(t *testing.T) {
	r := newRig(t, 600*time.Millisecond)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	r.p.HangAll(true)
	_, err := r.c.GetServer(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hung Incus: want the call's deadline, got %v", err)
	}
	if seen, fwd := r.p.Seen("GET", "/1.0"), r.p.Forwarded("GET", "/1.0"); seen < 2 || fwd != 1 {
		t.Fatalf("seen %d forwarded %d; want the hung call seen, not forwarded", seen, fwd)
	}
	waitFor(t, "the hung request to end with its client", func() bool { return r.p.Held() == 0 })
	r.p.HangAll(false)
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatalf("after the hang: %v", err)
	}
}

// The proxy ends with the context Start was given.
func TestStartContextEndsProxy(t *testing.T) {
	incustest.Server(t)
	ctx, cancel := context.WithCancel(t.Context())
	p, err := incusfault.Start(ctx, incusfault.Config{Upstream: incustest.Socket()})
	if err != nil {
		t.Fatal(err)
	}
	c := clientVia(t, p, "", 5*time.Second)
	if _, err := c.GetServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := p.Close(); err != nil { // waits for the shutdown ctx started
		t.Fatal(err)
	}
	c.Close()
	if _, err := c.GetServer(t.Context()); err == nil {
		t.Fatal("the proxy still answers after its context ended")
	}
	waitFor(t, "the proxy's goroutines to end", func() bool { return proxyGoroutines() == "" })
}

func TestRefuseAll(t *testing.T) {
	r := newRig(t, 5*time.Second)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	ws, err := dialEvents(ctx, r.p.Socket(), r.c.Project())
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()

	if err := r.p.RefuseAll(true); err != nil {
		t.Fatal(err)
	}
	seen := r.p.Seen("", "")
	_, err = r.c.GetServer(ctx)
	transportError(t, "socket down", err)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("socket down: want ECONNREFUSED, got %v", err)
	}
	if r.p.Seen("", "") != seen {
		t.Errorf("a request reached the proxy while it refused connections")
	}
	_ = ws.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := ws.ReadMessage(); err == nil {
		t.Error("the events stream survived the socket going down")
	}

	if err := r.p.RefuseAll(false); err != nil {
		t.Fatal(err)
	}
	if _, err := r.c.GetServer(ctx); err != nil {
		t.Fatalf("socket up again: %v", err)
	}
}

// The same seed gives the same faults in the same order of requests.
func TestProbabilityIsSeeded(t *testing.T) {
	incustest.Server(t)
	ctx := ctxFor(t, 30*time.Second)
	outcomes := func(seed uint64) string {
		p := start(t, seed, nil)
		c := clientVia(t, p, "", 5*time.Second)
		p.Add(incusfault.Rule{Path: "/1.0", Fault: incusfault.Fail, Status: 500, Probability: 0.5})
		var b strings.Builder
		for range 32 {
			if _, err := c.GetServer(ctx); err != nil {
				b.WriteByte('x')
			} else {
				b.WriteByte('.')
			}
		}
		return b.String()
	}
	a, b, other := outcomes(7), outcomes(7), outcomes(8)
	t.Logf("seed 7: %s, seed 8: %s", a, other)
	if a != b {
		t.Fatalf("same seed, different faults: %s vs %s", a, b)
	}
	if n := strings.Count(a, "x"); n < 6 || n > 26 {
		t.Fatalf("probability 0.5 failed %d of 32", n)
	}
	if a == other {
		t.Errorf("seeds 7 and 8 gave the same faults: %s", a)
	}
}

// After Close, nothing of the proxy runs: not its accept loop, not a held
// request, not an events relay, not its connections to Incus.
func TestCloseStopsEverything(t *testing.T) {
	incustest.Server(t)
	ctx := ctxFor(t, 30*time.Second)
	p, err := incusfault.Start(ctx, incusfault.Config{Upstream: incustest.Socket()})
	if err != nil {
		t.Fatal(err)
	}
	c, err := incus.New(incus.Config{Socket: p.Socket(), CallTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	ws, err := dialEvents(ctx, p.Socket(), incus.DefaultProject)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	p.Add(incusfault.Rule{Path: "/1.0/instances", Fault: incusfault.BlackHole})
	held := make(chan error, 1)
	go func() {
		_, err := c.ListInstances(ctx)
		held <- err
	}()
	waitFor(t, "the list to be held", func() bool { return p.Held() == 1 })
	if proxyGoroutines() == "" {
		t.Fatal("no goroutine of the proxy found while it runs: the check below would prove nothing")
	}

	start := time.Now()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-held; err == nil {
		t.Error("a request held at Close was answered")
	}
	_ = ws.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := ws.ReadMessage(); err == nil {
		t.Error("the events stream survived Close")
	}
	t.Logf("Close took %s", time.Since(start))
	c.Close()
	waitFor(t, "the proxy's goroutines to end", func() bool { return proxyGoroutines() == "" })
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// proxyGoroutines returns the stacks of goroutines that belong to a proxy:
// its own code, or an HTTP server connection (no other server runs here).
func proxyGoroutines() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "internal/incusfault.(") || strings.Contains(g, "net/http.(*conn).serve") ||
			strings.Contains(g, "internal/incusfault.Start") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A lingering request reaches Incus after its client gave up on it, as a
// create still in a loaded daemon's handler does after its sender died.
func TestLinger(t *testing.T) {
	r := newRig(t, 10*time.Second)
	ctx := ctxFor(t, 30*time.Second)
	op, err := createEmpty(ctx, r.direct, "lingered")
	if err == nil {
		_, err = r.direct.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	id := r.p.Add(incusfault.Rule{Method: "PATCH", Fault: incusfault.Linger, Delay: 500 * time.Millisecond, Times: 1})
	gone, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	err = r.c.PatchInstanceConfig(gone, "lingered", map[string]string{"user.lingered": "1"})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a lingering PATCH whose client gave up: want its deadline, got %v", err)
	}
	if r.p.Forwarded("PATCH", "") != 0 {
		t.Fatal("a lingering PATCH was forwarded before its delay")
	}
	waitFor(t, "the lingering PATCH to reach Incus", func() bool {
		inst, _, err := r.direct.GetInstance(ctx, "lingered")
		return err == nil && inst.Config["user.lingered"] == "1"
	})
	if r.p.Hits(id) != 1 || r.p.Forwarded("PATCH", "") != 1 || r.p.Held() != 0 {
		t.Fatalf("hits %d forwarded %d held %d", r.p.Hits(id), r.p.Forwarded("PATCH", ""), r.p.Held())
	}
}
