package ingress

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// The edge against fakes of the targets and the wake, with a loopback
// HTTP server standing in for the guest's app: what the edge decides
// without Incus. tests in provider/ run it on the real Incus.

type fakeTargets struct {
	routes   map[string]targets.IngressRoute
	state    targets.RouteState
	resolves atomic.Int32
}

func (f *fakeTargets) IngressLookup(label string) (targets.IngressRoute, bool) {
	r, ok := f.routes[label]
	return r, ok
}

func (f *fakeTargets) PowerDownPending(targets.Route, time.Time) bool    { return false }
func (f *fakeTargets) RestartDaemonDevice(context.Context, string) error { return nil }

func (f *fakeTargets) ResolveRoute(_ context.Context, owner controller.Owner, id string) (targets.Route, error) {
	f.resolves.Add(1)
	o := controller.Observation{TargetID: id, Owner: owner, Phase: controller.PhaseActive, Power: controller.PowerRunning}
	if f.state == targets.RoutePaused {
		o.Power = controller.PowerPaused
	}
	return targets.Route{Name: id, Owner: owner, State: f.state, Observation: o}, nil
}

type fakeWaker struct {
	refusal *wake.Refusal
	wakes   atomic.Int32
}

func (w *fakeWaker) WakeForUse(context.Context, targets.Route, time.Time) *wake.Refusal {
	w.wakes.Add(1)
	return w.refusal
}

// appDialer reaches the stand-in app whatever the target.
type appDialer struct{ addr string }

func (d appDialer) DialContext(ctx context.Context, _ guest.Target) (net.Conn, error) {
	var nd net.Dialer
	return nd.DialContext(ctx, "tcp", d.addr)
}
func (appDialer) Devices(guest.Target) map[string]map[string]string { return nil }
func (appDialer) Forget(string)                                     {}
func (appDialer) Name() string                                      { return "test" }

type edgeRig struct {
	edge  *Edge
	srv   *httptest.Server
	tg    *fakeTargets
	wk    *fakeWaker
	reg   *relays.Registry
	label string
	base  ingressurl.Base
}

const instance = "ls-0123456789abcdef0123"

func newEdgeRig(t *testing.T, app http.Handler) *edgeRig { return newEdgeRigStall(t, app, 0) }

func newEdgeRigStall(t *testing.T, app http.Handler, stall time.Duration) *edgeRig {
	t.Helper()
	appSrv := httptest.NewServer(app)
	t.Cleanup(appSrv.Close)
	return newEdgeRigTo(t, appSrv.Listener.Addr().String(), stall)
}

// newEdgeRigTo is an edge whose every target is the app at addr.
func newEdgeRigTo(t *testing.T, addr string, stall time.Duration) *edgeRig {
	t.Helper()
	base, err := ingressurl.Parse("https://{label}.env.example.com")
	if err != nil {
		t.Fatal(err)
	}
	label := ingressurl.NewLabel()
	tg := &fakeTargets{state: targets.RouteRunning, routes: map[string]targets.IngressRoute{
		label: {Instance: instance, Owner: controller.Owner{UniverseID: "u", EnvironmentID: "e"}, Port: 8080},
	}}
	wk := &fakeWaker{}
	reg := relays.New(time.Second)
	e, err := New(Options{Targets: tg, Waker: wk, Dialer: appDialer{addr: addr}, Relays: reg, Base: base, Stall: stall})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(e)
	t.Cleanup(func() { srv.Close(); e.Close() })
	return &edgeRig{edge: e, srv: srv, tg: tg, wk: wk, reg: reg, label: label, base: base}
}

func (r *edgeRig) get(t *testing.T, host, path string, h http.Header) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, r.srv.URL+path, nil)
	req.Host = host
	for k, v := range h {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func TestUnknownHostsCostNoLookup(t *testing.T) {
	r := newEdgeRig(t, http.NotFoundHandler())
	for _, host := range []string{"example.com", ingressurl.NewLabel() + ".env.example.com", r.label + ".other.example.com", "127.0.0.1"} {
		if resp, _ := r.get(t, host, "/", nil); resp.StatusCode != http.StatusNotFound {
			t.Fatalf("%s: %d", host, resp.StatusCode)
		}
	}
	if n := r.tg.resolves.Load(); n != 0 {
		t.Fatalf("unknown hosts read %d targets", n)
	}
}

func TestProxySetsForwardingHeadersAndReadsTheTargetOnce(t *testing.T) {
	var seen http.Header
	var seenHost string
	r := newEdgeRig(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		seen, seenHost = req.Header.Clone(), req.Host
		http.Redirect(w, req, "/elsewhere", http.StatusFound)
	}))
	host := strings.ToUpper(r.label) + ".env.example.com"
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for range 2 {
		req, _ := http.NewRequest(http.MethodGet, r.srv.URL+"/x", nil)
		req.Host = host
		req.Header.Set("X-Forwarded-For", "203.0.113.1")
		req.Header.Set("X-Forwarded-Proto", "gopher")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/elsewhere" {
			t.Fatalf("the redirect came back as %d %q", resp.StatusCode, resp.Header.Get("Location"))
		}
	}
	if seenHost != host || seen.Get("X-Forwarded-For") != "127.0.0.1" || seen.Get("X-Forwarded-Proto") != "https" || seen.Get("X-Forwarded-Host") != host {
		t.Fatalf("the app saw host %q, headers %v", seenHost, seen)
	}
	if n := r.tg.resolves.Load(); n != 1 {
		t.Fatalf("two requests read the target %d times, want once", n)
	}
}

func TestAWakeThatRunsOutAnswers503WithRetryAfter(t *testing.T) {
	r := newEdgeRig(t, http.NotFoundHandler())
	r.tg.state = targets.RoutePaused
	r.wk.refusal = &wake.Refusal{State: wake.StateWaking, RetryAfter: 3 * time.Second}
	resp, body := r.get(t, r.label+".env.example.com", "/", nil)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "3" || !strings.Contains(body, "waking") {
		t.Fatalf("got %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	r.wk.refusal = &wake.Refusal{State: wake.StateGone}
	if resp, _ := r.get(t, r.label+".env.example.com", "/", nil); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("a target gone while it woke: %d", resp.StatusCode)
	}
	if r.wk.wakes.Load() != 2 {
		t.Fatalf("%d wakes", r.wk.wakes.Load())
	}
}

func TestAnOpenStreamIsARelayThatAPowerDownCloses(t *testing.T) {
	r := newEdgeRig(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: one\n\n")
		_ = http.NewResponseController(w).Flush()
		<-req.Context().Done()
	}))
	req, _ := http.NewRequest(http.MethodGet, r.srv.URL+"/events", nil)
	req.Host = r.label + ".env.example.com"
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != "data: one\n" {
		t.Fatalf("the first event: %q, %v", line, err)
	}
	if n := r.reg.Open(instance); n != 1 {
		t.Fatalf("the registry counts %d for an open stream, want 1 (a relay, not a dial)", n)
	}
	if _, ok := r.reg.Quiesce(instance); ok {
		t.Fatal("an idle power-down was let through under an open stream")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	release, left, _ := r.reg.Drain(ctx, instance, "powering down", time.Time{}, nil)
	release()
	if left != 0 {
		t.Fatalf("%d connections left after the drain", left)
	}
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Fatal("the stream ended cleanly; want it cut by the power-down")
	}
}

func TestAClientThatStallsItsUploadIsCut(t *testing.T) {
	got := make(chan error, 1)
	r := newEdgeRigStall(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, err := io.ReadAll(req.Body)
		got <- err
	}), 300*time.Millisecond)
	var d net.Dialer
	conn, err := d.DialContext(context.Background(), "tcp", r.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Headers and a tenth of the body, then nothing.
	_, _ = io.WriteString(conn, "POST /echo HTTP/1.1\r\nHost: "+r.label+".env.example.com\r\nContent-Length: 100\r\n\r\n0123456789")
	select {
	case err := <-got:
		if err == nil {
			t.Fatal("the app read a whole body the client never sent")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a stalled upload still holds the guest's connection after 10 s")
	}
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if b, err := io.ReadAll(conn); err != nil && !errors.Is(err, io.EOF) {
		t.Logf("the client read %q", b)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("the edge kept the stalled client's connection open")
		}
	}
}

func TestAnUploadStreamsThroughWhole(t *testing.T) {
	r := newEdgeRig(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		n, err := io.Copy(io.Discard, req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_, _ = io.WriteString(w, strconv.FormatInt(n, 10))
	}))
	for range 3 {
		req, _ := http.NewRequest(http.MethodPost, r.srv.URL+"/count", bytes.NewReader(bytes.Repeat([]byte("u"), 1<<20)))
		req.Host = r.label + ".env.example.com"
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(got) != "1048576" {
			t.Fatalf("the upload: %d %q", resp.StatusCode, got)
		}
	}
}

// TestAccessLogNamesEveryRequest: with an access log, each request the edge
// answers is one line: method, label (none for a host that maps to none),
// status and the body's bytes.
func TestAccessLogNamesEveryRequest(t *testing.T) {
	r := newEdgeRig(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("twelve bytes"))
	}))
	core, logs := observer.New(zap.InfoLevel)
	r.edge.opts.AccessLog = zap.New(core)
	if resp, body := r.get(t, r.label+".env.example.com", "/page", nil); resp.StatusCode != http.StatusOK || body != "twelve bytes" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if resp, _ := r.get(t, "elsewhere.example.com", "/", nil); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("an unknown host: %d", resp.StatusCode)
	}
	lines := logs.FilterMessage("edge request").All()
	if len(lines) != 2 {
		t.Fatalf("%d access lines for 2 requests", len(lines))
	}
	first, second := lines[0].ContextMap(), lines[1].ContextMap()
	if first["method"] != "GET" || first["label"] != r.label || first["status"] != int64(200) || first["bytes"] != int64(12) {
		t.Errorf("the routed request: %v", first)
	}
	if second["label"] != "" || second["status"] != int64(404) {
		t.Errorf("the unknown host: %v", second)
	}
}
