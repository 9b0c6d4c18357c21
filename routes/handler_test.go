package routes

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/devguest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// The unit tests below run the handler against a fake of the targets and a
// simulated guest: a loopback listener in front of a real development
// daemon (internal/devguest), which can be "frozen" (it accepts connections
// and leaves them unanswered, as a frozen guest's kernel does, until it is
// thawed), "stopped" (dials fail as for an instance without init),
// "silent" (a listening socket with nothing behind it, for ever), "closing"
// (each connection closed as soon as it is accepted) or "refusing" (dials
// reach a port nothing listens on). useDaemon puts another daemon behind it.

const testInstance = "ls-00000000000000000001"

var testOwner = controller.Owner{UniverseID: "u1", EnvironmentID: "env1"}

type fakeTargets struct {
	mu        sync.Mutex
	exists    bool
	state     targets.RouteState
	phase     controller.Phase
	message   string
	fenceErr  error
	wakeDelay time.Duration
	// recordDelay is the record's wait after the action (and its onWake).
	recordDelay time.Duration
	wakeErr     error
	onWake      func(from string)

	resolves atomic.Int32
	wakes    atomic.Int32
	keptDown atomic.Bool // a power-down kept until Incus takes it; a wake replaces it
}

func (f *fakeTargets) set(state targets.RouteState) {
	f.mu.Lock()
	f.exists, f.state, f.phase = true, state, controller.PhaseActive
	f.mu.Unlock()
}

func (f *fakeTargets) observation() controller.Observation {
	o := controller.Observation{TargetID: testInstance, Owner: testOwner, Phase: f.phase, Message: f.message}
	if f.phase == controller.PhaseActive {
		switch f.state {
		case targets.RoutePaused:
			o.Power = controller.PowerPaused
		case targets.RouteStopped:
			o.Power = controller.PowerStopped
		default:
			o.Power = controller.PowerRunning
		}
	}
	return o
}

func (f *fakeTargets) ResolveRoute(_ context.Context, owner controller.Owner, targetID string) (targets.Route, error) {
	f.resolves.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fenceErr != nil {
		return targets.Route{}, f.fenceErr
	}
	if targetID != testInstance || owner != testOwner {
		if strings.HasPrefix(targetID, "ls-") {
			return targets.Route{}, targets.ErrRouteOwner
		}
		return targets.Route{}, targets.ErrRouteGone
	}
	if !f.exists {
		return targets.Route{}, targets.ErrRouteGone
	}
	return targets.Route{Name: testInstance, Owner: owner, State: f.state, Observation: f.observation(),
		Daemon: guest.Target{Instance: testInstance, Port: 1}}, nil
}

func (f *fakeTargets) PowerDownPending(targets.Route, time.Time) bool    { return f.keptDown.Load() }
func (f *fakeTargets) RestartDaemonDevice(context.Context, string) error { return nil }

func (f *fakeTargets) Wake(ctx context.Context, _ targets.Route, _ time.Time, _ func()) (controller.Power, error) {
	f.wakes.Add(1)
	f.mu.Lock()
	from := f.observation().Power
	delay, werr := f.wakeDelay, f.wakeErr
	f.mu.Unlock()
	select {
	case <-time.After(delay):
	case <-ctx.Done():
		return from, ctx.Err()
	}
	if werr != nil {
		return from, werr
	}
	f.keptDown.Store(false) // recorded over it, as Wake drops an older kept request
	f.mu.Lock()
	f.state = targets.RouteRunning
	on := f.onWake
	f.mu.Unlock()
	if on != nil {
		on(string(from))
	}
	f.mu.Lock()
	record := f.recordDelay
	f.mu.Unlock()
	time.Sleep(record)
	return from, nil
}

// guestSim is the simulated guest behind the dialer.
type guestSim struct {
	t      testing.TB
	daemon string // the development daemon's address
	ln     net.Listener

	mu       sync.Mutex
	frozen   bool
	stopped  bool
	silent   bool
	closing  bool
	refusing bool
	closed   string // an address nothing listens on, for refusing
	held     []net.Conn
	dials    atomic.Int32
}

func newGuestSim(t testing.TB) *guestSim {
	t.Helper()
	d, err := devguest.New(t.Context(), devguest.Config{Cwd: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone.Close()
	g := &guestSim{t: t, daemon: srv.Listener.Addr().String(), ln: ln, closed: gone.Addr().String()}
	t.Cleanup(func() {
		ln.Close()
		g.mu.Lock()
		for _, c := range g.held {
			c.Close()
		}
		g.mu.Unlock()
	})
	go g.serve()
	return g
}

func (g *guestSim) serve() {
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		g.mu.Lock()
		if g.frozen || g.silent {
			g.held = append(g.held, c)
			g.mu.Unlock()
			continue
		}
		closing := g.closing
		g.mu.Unlock()
		if closing {
			c.Close()
			continue
		}
		g.pipe(c)
	}
}

// useDaemon puts the daemon at addr behind the guest, for the connections
// accepted from now on.
func (g *guestSim) useDaemon(addr string) {
	g.mu.Lock()
	g.daemon = addr
	g.mu.Unlock()
}

func (g *guestSim) pipe(c net.Conn) {
	g.mu.Lock()
	daemon := g.daemon
	g.mu.Unlock()
	d, err := net.Dial("tcp", daemon)
	if err != nil {
		c.Close()
		return
	}
	go func() { _, _ = io.Copy(d, c); d.Close() }()
	go func() { _, _ = io.Copy(c, d); c.Close() }()
}

func (g *guestSim) freeze() {
	g.mu.Lock()
	g.frozen = true
	g.mu.Unlock()
}

// thaw answers every connection held while frozen, as a thawed guest does.
func (g *guestSim) thaw() {
	g.mu.Lock()
	g.frozen, g.stopped = false, false
	held := g.held
	g.held = nil
	g.mu.Unlock()
	for _, c := range held {
		g.pipe(c)
	}
}

func (g *guestSim) DialContext(ctx context.Context, t guest.Target) (net.Conn, error) {
	g.dials.Add(1)
	g.mu.Lock()
	stopped, addr := g.stopped, g.ln.Addr().String()
	if g.refusing {
		addr = g.closed
	}
	g.mu.Unlock()
	if stopped {
		return nil, fmt.Errorf("sim: %w", guest.ErrNotRunning)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}
func (g *guestSim) Devices(guest.Target) map[string]map[string]string { return nil }
func (g *guestSim) Forget(string)                                     {}
func (g *guestSim) Name() string                                      { return "sim" }

// loopDialer is a Dialer that is never used (option checks).
type loopDialer struct{ guestSim }

type rig struct {
	t       *testing.T
	targets *fakeTargets
	guest   *guestSim
	h       *Handler
	wake    *wake.Waker
	srv     *httptest.Server
	metrics *Metrics
	wakes   *prometheus.Registry // the wake's collectors
	cancel  context.CancelFunc
}

func newHandlerRig(t *testing.T, mutate func(*Options)) *rig { return newWakeRig(t, nil, mutate) }

// newWakeRig is a handler rig whose wake hands its traces to trace (nil:
// none), built as the provider builds the two: on the same targets,
// dialer and relay registry.
func newWakeRig(t *testing.T, trace func(wake.Trace), mutate func(*Options)) *rig {
	t.Helper()
	ft := &fakeTargets{}
	ft.set(targets.RouteRunning)
	g := newGuestSim(t)
	ft.onWake = func(string) { g.thaw() }
	m := newMetrics()
	ctx, cancel := context.WithCancel(context.Background())
	opts := Options{Targets: ft, Dialer: g, Relays: relays.New(4 * time.Second), Metrics: m}
	if mutate != nil {
		mutate(&opts)
	}
	wakes := prometheus.NewRegistry()
	wk, err := wake.New(ctx, wake.Options{Targets: ft, Dialer: g, Relays: opts.Relays, Metrics: wake.NewMetrics(wakes),
		Log: opts.Log, Trace: trace})
	if err != nil {
		t.Fatal(err)
	}
	opts.Wake = wk
	h, err := New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() { cancel(); srv.Close() })
	return &rig{t: t, targets: ft, guest: g, h: h, wake: wk, srv: srv, metrics: m, wakes: wakes, cancel: cancel}
}

func (r *rig) url(route Route) string {
	scheme := "ws://"
	if r.srv.TLS != nil {
		scheme = "wss://"
	}
	return scheme + r.srv.Listener.Addr().String() + Path("/routes", route)
}

var ownRoute = Route{Owner: testOwner, TargetID: testInstance}

// dial opens the route; on a refusal it returns the response.
func (r *rig) dial(route Route, header http.Header) (*websocket.Conn, *http.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	d := websocket.Dialer{HandshakeTimeout: 15 * time.Second}
	if r.srv.TLS != nil {
		d.TLSClientConfig = r.srv.Client().Transport.(*http.Transport).TLSClientConfig
	}
	return d.DialContext(ctx, r.url(route), header)
}

// initialize runs the data-plane handshake through the relay, leaving the
// connection to the test.
func initialize(t testing.TB, ws *websocket.Conn) map[string]json.RawMessage {
	t.Helper()
	_ = ws.SetWriteDeadline(time.Now().Add(10 * time.Second))
	req := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":"routes-test"}}}`
	if err := ws.WriteMessage(websocket.TextMessage, []byte(req)); err != nil {
		t.Fatalf("initialize through the relay: %v", err)
	}
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, data, err := ws.ReadMessage()
	if err != nil {
		t.Fatalf("initialize through the relay: %v", err)
	}
	_ = ws.SetReadDeadline(time.Time{})
	var resp struct {
		Result map[string]json.RawMessage `json:"result"`
		Error  *jsonrpc.Error             `json:"error"`
	}
	if err := json.Unmarshal(data, &resp); err != nil || resp.Error != nil {
		t.Fatalf("initialize answered %s", data)
	}
	if string(resp.Result["plane"]) != `"data"` {
		t.Fatalf("initialize answered plane %s", resp.Result["plane"])
	}
	return resp.Result
}

// value reads a counter or gauge (the sum over its series).
func value(c prometheus.Collector) float64 {
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// wakeSamples counts the wakes observed with outcome ("": any), from any
// power.
func (r *rig) wakeSamples(t testing.TB, outcome string) uint64 {
	t.Helper()
	mfs, err := r.wakes.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "outcome" && (outcome == "" || l.GetValue() == outcome) {
					n += s.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return n
}

// refusal checks a refused dial's answer with the conformance package's
// data-route helper and returns its state and Retry-After in seconds.
func refusal(t testing.TB, resp *http.Response, err error) (wake.State, int) {
	t.Helper()
	if err == nil {
		t.Fatal("the dial was upgraded, want a refusal")
	}
	ref, cerr := conformance.ReadRefusal(resp)
	if cerr != nil {
		t.Fatalf("not a typed refusal: %v (dial: %v)", cerr, err)
	}
	return wake.State(ref.State), int(ref.RetryAfter / time.Second)
}

// dialRoute dials with the conformance package's DialRoute, which checks
// the hold bound and, on a refusal, the typed answer.
func (r *rig) dialRoute(route Route, credential string) conformance.RouteDial {
	r.t.Helper()
	d, err := conformance.DialRoute(context.Background(), r.url(route), credential)
	if err != nil {
		r.t.Fatalf("DialRoute: %v", err)
	}
	if d.Conn != nil {
		r.t.Cleanup(func() { d.Conn.Close() })
	}
	return d
}

func dialCount(m *Metrics, outcome string) float64 {
	return value(m.dials.WithLabelValues(outcome))
}

func TestRouteToRunningTarget(t *testing.T) {
	r := newHandlerRig(t, nil)
	ws, _, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatal(err)
	}
	initialize(t, ws)
	// First dial: a readiness probe and the relay's own connection.
	if n := r.guest.dials.Load(); n != 2 {
		t.Fatalf("%d guest dials for the first route dial, want 2 (probe and relay)", n)
	}
	if r.h.reg.Open(testInstance) != 1 {
		t.Fatalf("Open = %d", r.h.reg.Open(testInstance))
	}
	// A proved-ready running target costs no probe.
	ws2, _, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatal(err)
	}
	initialize(t, ws2)
	if n := r.guest.dials.Load(); n != 3 {
		t.Fatalf("%d guest dials after the second route dial, want 3", n)
	}
	if r.targets.wakes.Load() != 0 {
		t.Fatal("a running target was woken")
	}
	if got := dialCount(r.metrics, OutcomeUpgraded); got != 2 {
		t.Fatalf("upgraded dials %v", got)
	}
	if got := value(r.metrics.open); got != 2 {
		t.Fatalf("open relays gauge %v", got)
	}
	ws.Close()
	ws2.Close()
	deadline := time.Now().Add(10 * time.Second)
	for r.h.reg.Open(testInstance) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("relays never left the registry")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRouteCredentialAndPath(t *testing.T) {
	r := newHandlerRig(t, func(o *Options) { o.Credential = bearer.New("s3cret") })
	// No credential, wrong credential: 401 before anything is read.
	for _, h := range []http.Header{nil, {"Authorization": {"Bearer nope"}}} {
		_, resp, err := r.dial(ownRoute, h)
		if err == nil || resp == nil || resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("want 401, got %v %v", resp, err)
		}
	}
	good := http.Header{"Authorization": {"Bearer s3cret"}}
	// Malformed paths are refused without touching the targets.
	for _, p := range []string{"/routes/u1/env1", "/routes/u1/env1/t/x", "/routes/u%2F1/env1/t", "/routes/u1/env1/t%00"} {
		d := websocket.Dialer{}
		_, resp, err := d.Dial("ws://"+r.srv.Listener.Addr().String()+p, good)
		if err == nil || resp == nil || (resp.StatusCode != 404 && resp.StatusCode != 400) {
			t.Fatalf("%s: want 400/404, got %v %v", p, resp, err)
		}
	}
	// Not a WebSocket handshake.
	req, _ := http.NewRequest(http.MethodGet, r.srv.URL+Path("/routes", ownRoute), nil)
	req.Header = good
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("plain GET: %d", resp.StatusCode)
	}
	if n := r.targets.resolves.Load(); n != 0 {
		t.Fatalf("the targets were asked %d times before the credential and path passed", n)
	}
	if dialCount(r.metrics, OutcomeUnauthorized) != 2 || dialCount(r.metrics, OutcomeMalformed) != 5 {
		t.Fatalf("unauthorized %v, malformed %v", dialCount(r.metrics, OutcomeUnauthorized), dialCount(r.metrics, OutcomeMalformed))
	}
	ws, _, err := r.dial(ownRoute, good)
	if err != nil {
		t.Fatal(err)
	}
	initialize(t, ws)
}

func TestRouteRefusals(t *testing.T) {
	t.Run("another owner's target reaches nothing", func(t *testing.T) {
		r := newHandlerRig(t, nil)
		r.targets.set(targets.RoutePaused)
		r.guest.freeze()
		for _, route := range []Route{
			{Owner: controller.Owner{UniverseID: "u1", EnvironmentID: "other"}, TargetID: testInstance},
			{Owner: testOwner, TargetID: "ls-99999999999999999999"},
		} {
			_, resp, err := r.dial(route, nil)
			if st, _ := refusal(t, resp, err); st != wake.StateGone {
				t.Fatalf("state %s", st)
			}
		}
		if r.targets.wakes.Load() != 0 || r.guest.dials.Load() != 0 {
			t.Fatal("a refused route woke or dialed the target")
		}
		if dialCount(r.metrics, OutcomeRefusedOwner) != 2 {
			t.Fatal("refused_owner not counted")
		}
	})
	t.Run("absent target is gone", func(t *testing.T) {
		r := newHandlerRig(t, nil)
		r.targets.exists = false
		_, resp, err := r.dial(ownRoute, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateGone {
			t.Fatalf("state %s", st)
		}
		_, resp, err = r.dial(Route{Owner: testOwner, TargetID: "not-ours"}, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateGone {
			t.Fatalf("state %s", st)
		}
	})
	t.Run("closing target is gone", func(t *testing.T) {
		r := newHandlerRig(t, nil)
		r.targets.phase = controller.PhaseClosing
		_, resp, err := r.dial(ownRoute, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateGone {
			t.Fatalf("state %s", st)
		}
	})
	t.Run("failed target", func(t *testing.T) {
		r := newHandlerRig(t, nil)
		r.targets.phase, r.targets.message = controller.PhaseFailed, "The instance could not be started."
		_, resp, err := r.dial(ownRoute, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateFailed {
			t.Fatalf("state %s", st)
		}
	})
	t.Run("Incus does not answer", func(t *testing.T) {
		r := newHandlerRig(t, nil)
		r.targets.fenceErr = fmt.Errorf("incus: %w", incus.ErrNotFound) // any error that is not a fence answer
		_, resp, err := r.dial(ownRoute, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateBooting {
			t.Fatalf("state %s", st)
		}
	})
	t.Run("Incus does not answer for a target last seen paused", func(t *testing.T) {
		r := newHandlerRig(t, nil)
		r.targets.set(targets.RoutePaused)
		r.targets.wakeErr = errors.New("incus: injected wake failure")
		r.guest.freeze()
		_, resp, err := r.dial(ownRoute, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateWaking {
			t.Fatalf("state %s", st)
		}
		r.targets.mu.Lock()
		r.targets.fenceErr = fmt.Errorf("incus: %w", incus.ErrNotFound)
		r.targets.mu.Unlock()
		_, resp, err = r.dial(ownRoute, nil)
		if st, _ := refusal(t, resp, err); st != wake.StateWaking {
			t.Fatalf("a paused target's dial while Incus does not answer: state %s, want waking", st)
		}
	})
}

func TestRouteWakesPausedTarget(t *testing.T) {
	r := newHandlerRig(t, nil)
	r.targets.set(targets.RoutePaused)
	r.targets.wakeDelay = 50 * time.Millisecond
	r.guest.freeze()
	// Concurrent dials share one wake.
	const n = 12
	var wg sync.WaitGroup
	errs := make(chan error, n)
	conns := make(chan *websocket.Conn, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ws, resp, err := r.dial(ownRoute, nil)
			if err != nil {
				errs <- fmt.Errorf("%w (%v)", err, resp)
				return
			}
			conns <- ws
		}()
	}
	wg.Wait()
	close(errs)
	close(conns)
	for err := range errs {
		t.Fatal(err)
	}
	for ws := range conns {
		initialize(t, ws)
	}
	if w := r.targets.wakes.Load(); w != 1 {
		t.Fatalf("%d wakes for %d concurrent dials, want 1", w, n)
	}
	if got := r.wakeSamples(t, ""); got != 1 {
		t.Fatalf("wake histogram counted %d wakes, want 1", got)
	}
}

func TestRouteWakesStoppedTarget(t *testing.T) {
	r := newHandlerRig(t, nil)
	r.targets.set(targets.RouteStopped)
	r.targets.wakeDelay = 80 * time.Millisecond
	r.guest.mu.Lock()
	r.guest.stopped = true
	r.guest.mu.Unlock()
	ws, resp, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatalf("%v %v", err, resp)
	}
	initialize(t, ws)
	if r.targets.wakes.Load() != 1 {
		t.Fatal("not woken once")
	}
}

func TestRouteHoldBound(t *testing.T) {
	const hold = time.Second
	t.Run("booting: the daemon never answers", func(t *testing.T) {
		r := newHandlerRig(t, func(o *Options) { o.Hold = hold })
		r.guest.silent = true // a listening socket with nothing behind it
		d := r.dialRoute(ownRoute, "")
		if d.Refusal == nil || d.Refusal.State != "booting" {
			t.Fatalf("got %+v", d)
		}
		if d.Elapsed > hold {
			t.Fatalf("refused after %s, later than the hold %s", d.Elapsed, hold)
		}
	})
	t.Run("waking: the wake outlasts the hold", func(t *testing.T) {
		r := newHandlerRig(t, func(o *Options) { o.Hold = hold })
		r.targets.set(targets.RoutePaused)
		r.targets.wakeDelay = 3 * time.Second
		r.guest.freeze()
		d := r.dialRoute(ownRoute, "")
		if d.Refusal == nil || d.Refusal.State != "waking" {
			t.Fatalf("got %+v", d)
		}
		if d.Elapsed > hold {
			t.Fatalf("refused after %s, later than the hold %s", d.Elapsed, hold)
		}
		// The wake goes on; a later dial finds the target running and ready.
		time.Sleep(3 * time.Second)
		ws, resp, err := r.dial(ownRoute, nil)
		if err != nil {
			t.Fatalf("after the wake: %v %v", err, resp)
		}
		initialize(t, ws)
		if w := r.targets.wakes.Load(); w != 1 {
			t.Fatalf("%d wakes", w)
		}
	})
}

func TestRouteShedsPastTheCap(t *testing.T) {
	r := newHandlerRig(t, func(o *Options) { o.MaxHeld = 2; o.Hold = 2 * time.Second })
	r.targets.set(targets.RoutePaused)
	r.targets.wakeDelay = time.Hour
	r.guest.freeze()
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, _ = r.dial(ownRoute, nil)
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for r.h.held.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("dials not held")
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	_, resp, err := r.dial(ownRoute, nil)
	if st, _ := refusal(t, resp, err); st != wake.StateWaking {
		t.Fatalf("state %s", st)
	}
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Fatalf("a shed dial took %s", took)
	}
	if dialCount(r.metrics, OutcomeShed) != 1 {
		t.Fatal("shed not counted")
	}
	if value(r.metrics.held) != 2 {
		t.Fatalf("held gauge %v", value(r.metrics.held))
	}
	wg.Wait()
}

func TestRegistryGuardsPowerChanges(t *testing.T) {
	r := newHandlerRig(t, nil)
	reg := r.h.reg
	ws, _, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatal(err)
	}
	initialize(t, ws)
	// Nothing powers a target down under a relay.
	if _, ok := reg.Quiesce(testInstance); ok {
		t.Fatal("Quiesce succeeded with a relay open")
	}
	// An explicit power-down first closes the relays with going-away.
	done := make(chan int, 1)
	go func() {
		release, left, _ := reg.Drain(t.Context(), testInstance, "the target is powering down", time.Time{}, nil)
		release()
		done <- left
	}()
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		_, _, err := ws.ReadMessage()
		if err == nil {
			continue
		}
		if !websocket.IsCloseError(err, websocket.CloseGoingAway) {
			t.Fatalf("the client got %v, want a going-away close", err)
		}
		break
	}
	ws.Close()
	if left := <-done; left != 0 || reg.Open(testInstance) != 0 {
		t.Fatalf("Drain left %d, Open = %d", left, reg.Open(testInstance))
	}
	release, ok := reg.Quiesce(testInstance)
	if !ok {
		t.Fatal("Quiesce failed with nothing open")
	}
	// While the power-down holds the target, a dial waits...
	dialed := make(chan error, 1)
	go func() {
		ws, resp, err := r.dial(ownRoute, nil)
		if err == nil {
			ws.Close()
		} else {
			err = fmt.Errorf("%w %v", err, resp)
		}
		dialed <- err
	}()
	select {
	case err := <-dialed:
		t.Fatalf("the dial went through a quiesced target: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	// ...and, the power having changed, proves readiness again.
	before := r.guest.dials.Load()
	release()
	if err := <-dialed; err != nil {
		t.Fatal(err)
	}
	if n := r.guest.dials.Load() - before; n != 2 {
		t.Fatalf("%d guest dials after a power change, want 2 (probe and relay)", n)
	}
}

func TestShutdownClosesRelays(t *testing.T) {
	r := newHandlerRig(t, nil)
	ws, _, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatal(err)
	}
	initialize(t, ws)
	r.cancel()
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		_, _, err := ws.ReadMessage()
		if err == nil {
			continue
		}
		if !websocket.IsCloseError(err, websocket.CloseGoingAway) {
			t.Fatalf("got %v, want going-away", err)
		}
		return
	}
}

func TestRouteOverTLSCarriesLargeMessages(t *testing.T) {
	r := newHandlerRig(t, nil)
	// The same handler behind TLS: frames cannot be spliced there and are
	// copied through the pooled buffer.
	r.srv.Close()
	r.srv = httptest.NewTLSServer(r.h)
	t.Cleanup(r.srv.Close)
	ws, resp, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatalf("%v %v", err, resp)
	}
	defer ws.Close()
	ws.SetReadLimit(16 << 20)
	initialize(t, ws)
	path := filepath.Join(t.TempDir(), "big")
	data := make([]byte, 3<<20)
	_, _ = rand.Read(data)
	enc := base64.StdEncoding.EncodeToString(data)
	write := fmt.Sprintf(`{"jsonrpc":"2.0","id":2,"method":"fs/writeFile","params":{"path":%q,"data":%q}}`, path, enc)
	// Each 4 MiB exchange gets its own deadlines: initialize's 10 s ran out
	// under the second one beside stress-ng (write: i/o timeout), which
	// timed the machine, not the relay.
	step := func() {
		_ = ws.SetWriteDeadline(time.Now().Add(30 * time.Second))
		_ = ws.SetReadDeadline(time.Now().Add(30 * time.Second))
	}
	step()
	if err := ws.WriteMessage(websocket.TextMessage, []byte(write)); err != nil {
		t.Fatal(err)
	}
	if _, msg, err := ws.ReadMessage(); err != nil || !strings.Contains(string(msg), `"result"`) {
		t.Fatalf("fs/writeFile: %v %.200s", err, msg)
	}
	read := fmt.Sprintf(`{"jsonrpc":"2.0","id":3,"method":"fs/readFile","params":{"path":%q,"maxBytes":%d}}`, path, len(data))
	step()
	if err := ws.WriteMessage(websocket.TextMessage, []byte(read)); err != nil {
		t.Fatal(err)
	}
	_, msg, err := ws.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		Result struct {
			Data string `json:"data"`
		} `json:"result"`
	}
	if err := json.Unmarshal(msg, &answer); err != nil || answer.Result.Data != enc {
		t.Fatalf("fs/readFile did not return what was written (%v)", err)
	}
}

// A running target with a power-down asked before the dial but not yet
// taken by Incus (kept in memory): the dial records its own request for
// running, or the older power-down would land after it. Found by the kill
// matrix: an accepted dial ended stopped.
func TestADialOutranksAKeptPowerDown(t *testing.T) {
	r := newHandlerRig(t, nil)
	for _, ready := range []bool{false, true} {
		r.targets.keptDown.Store(true)
		before := r.targets.wakes.Load()
		ws, _, err := r.dial(ownRoute, nil)
		if err != nil {
			t.Fatalf("dial (daemon proved ready before: %v): %v", ready, err)
		}
		initialize(t, ws)
		_ = ws.Close()
		if got := r.targets.wakes.Load() - before; got != 1 {
			t.Fatalf("%d wakes for a dial over a kept power-down (daemon proved ready before: %v), want 1", got, ready)
		}
		if r.targets.keptDown.Load() {
			t.Fatal("the kept power-down outlived the dial's request")
		}
	}
}
