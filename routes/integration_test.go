package routes

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/testrig"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// These tests run the data routes against the real Incus on this machine,
// with the development guest image, in a throwaway project; they skip
// without one (fail with INCUS_PROVIDER_REQUIRE_INCUS=1).

const credential = "route-test-credential"

// countingTargets counts the wakes the routes ask for.
type countingTargets struct {
	*targets.Service
	wakes atomic.Int32
}

func (c *countingTargets) Wake(ctx context.Context, inst *incus.Instance) (controller.Power, error) {
	c.wakes.Add(1)
	return c.Service.Wake(ctx, inst)
}

type incusRig struct {
	t       *testing.T
	client  *incus.Client
	svc     *targets.Service
	counted *countingTargets
	h       *Handler
	srv     *httptest.Server
	metrics *Metrics
}

func newIncusRig(t *testing.T) *incusRig {
	t.Helper()
	client := incustest.Client(t)
	image := incustest.Image(t)
	catalog := testrig.Catalog(t, client, image, `templates:
  - templateId: t1
    displayName: test guest
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
  - templateId: wrongport
    displayName: a guest whose daemon is not where the template says
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    daemonPort: 19999
`)
	dialer := testrig.NetnsDialer(t, client)
	svc := targets.New(client, catalog, dialer, zaptest.NewLogger(t).Named("targets"),
		targets.Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Second})
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = svc.Run(runCtx) }()
	counted := &countingTargets{Service: svc}
	m := newMetrics()
	h, err := New(runCtx, Options{Targets: counted, Dialer: dialer, Credential: bearer.New(credential), Metrics: m,
		Log: zaptest.NewLogger(t).Named("routes")})
	if err != nil {
		t.Fatal(err)
	}
	svc.UseRelays(h.Registry())
	srv := httptest.NewServer(h)
	t.Cleanup(func() { srv.Close(); stop(); <-done })
	return &incusRig{t: t, client: client, svc: svc, counted: counted, h: h, srv: srv, metrics: m}
}

func (ir *incusRig) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	ir.t.Cleanup(cancel)
	return ctx
}

// create makes a target and waits until it runs.
func (ir *incusRig) create(env, template string) Route {
	ir.t.Helper()
	owner := controller.Owner{UniverseID: "u-routes", EnvironmentID: env}
	if _, err := ir.svc.CreateTarget(ir.ctx(), controller.CreateParams{Owner: owner, TemplateID: template}); err != nil {
		ir.t.Fatal(err)
	}
	o := ir.until(owner, "active and running", func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
	})
	return Route{Owner: owner, TargetID: o.TargetID}
}

func (ir *incusRig) until(owner controller.Owner, what string, cond func(controller.Observation) bool) controller.Observation {
	ir.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		o, err := ir.svc.GetTarget(ir.ctx(), controller.TargetRef{Owner: owner})
		if err == nil && cond(o) {
			return o
		}
		if time.Now().After(deadline) {
			ir.t.Fatalf("target never %s: last %+v, %v", what, o, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// power moves the target and waits until Incus shows it there.
func (ir *incusRig) power(route Route, p controller.Power) {
	ir.t.Helper()
	if _, err := ir.svc.SetPower(ir.ctx(), controller.TargetRef{Owner: route.Owner}, p); err != nil {
		ir.t.Fatal(err)
	}
	ir.until(route.Owner, "at "+string(p), func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == p && o.Message == ""
	})
}

func (ir *incusRig) status(route Route) string {
	ir.t.Helper()
	inst, _, err := ir.client.GetInstance(ir.ctx(), route.TargetID)
	if err != nil {
		ir.t.Fatal(err)
	}
	return inst.Status
}

func (ir *incusRig) url(route Route) string {
	return "ws://" + ir.srv.Listener.Addr().String() + Path("/routes", route)
}

// dial dials the route with the conformance package's helper, which checks
// the hold bound and the typed refusal.
func (ir *incusRig) dial(route Route) conformance.RouteDial {
	ir.t.Helper()
	d, err := conformance.DialRoute(context.Background(), ir.url(route), credential)
	if err != nil {
		ir.t.Fatalf("DialRoute: %v", err)
	}
	if d.Conn != nil {
		ir.t.Cleanup(func() { d.Conn.Close() })
	}
	return d
}

func (ir *incusRig) mustUpgrade(route Route) *websocket.Conn {
	ir.t.Helper()
	d := ir.dial(route)
	if d.Conn == nil {
		ir.t.Fatalf("route refused: %+v after %s", d.Refusal, d.Elapsed)
	}
	initialize(ir.t, d.Conn)
	return d.Conn
}

func TestIncusRoutes(t *testing.T) {
	ir := newIncusRig(t)
	a := ir.create("env-a", "t1")
	b := ir.create("env-b", "t1")

	t.Run("running target relays initialize", func(t *testing.T) {
		ws := ir.mustUpgrade(a)
		ws.Close()
	})

	t.Run("paused target is woken by a dial", func(t *testing.T) {
		ir.power(a, controller.PowerPaused)
		before := ir.counted.wakes.Load()
		ws := ir.mustUpgrade(a)
		ws.Close()
		if ir.counted.wakes.Load() != before+1 {
			t.Fatal("not woken exactly once")
		}
		if st := ir.status(a); st != "Running" {
			t.Fatalf("Incus shows %s", st)
		}
	})

	t.Run("stopped target is woken by a dial", func(t *testing.T) {
		ir.power(a, controller.PowerStopped)
		ws := ir.mustUpgrade(a)
		ws.Close()
		if st := ir.status(a); st != "Running" {
			t.Fatalf("Incus shows %s", st)
		}
	})

	t.Run("concurrent dials share one wake", func(t *testing.T) {
		ir.power(a, controller.PowerPaused)
		before := ir.counted.wakes.Load()
		const n = 8
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := conformance.DialRoute(context.Background(), ir.url(a), credential)
				if err != nil {
					errs <- err
					return
				}
				if d.Conn == nil {
					errs <- fmt.Errorf("refused: %+v", d.Refusal)
					return
				}
				d.Conn.Close()
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if w := ir.counted.wakes.Load() - before; w != 1 {
			t.Fatalf("%d wakes for %d concurrent dials", w, n)
		}
	})

	t.Run("another owner's route is refused and the target untouched", func(t *testing.T) {
		ir.power(b, controller.PowerPaused)
		before := ir.counted.wakes.Load()
		for _, route := range []Route{
			{Owner: a.Owner, TargetID: b.TargetID}, // a's owner, b's target
			{Owner: controller.Owner{UniverseID: "u-routes", EnvironmentID: "env-c"}, TargetID: b.TargetID},
		} {
			d := ir.dial(route)
			if d.Refusal == nil || d.Refusal.State != "gone" {
				t.Fatalf("got %+v", d)
			}
		}
		time.Sleep(200 * time.Millisecond)
		if st := ir.status(b); st != "Frozen" {
			t.Fatalf("the other owner's target is %s, want still Frozen", st)
		}
		if ir.counted.wakes.Load() != before {
			t.Fatal("a refused route woke something")
		}
		if value(ir.metrics.dials.WithLabelValues(OutcomeRefusedOwner)) != 2 {
			t.Fatal("refused_owner not counted")
		}
	})

	t.Run("no power-down under a relay; an explicit one closes it with going-away", func(t *testing.T) {
		ws := ir.mustUpgrade(a)
		// What the idle loop would do: refused.
		err := ir.svc.PowerDown(ir.ctx(), a.TargetID, controller.PowerPaused, time.Now())
		if !errors.Is(err, targets.ErrRelayOpen) || !errors.Is(err, idle.ErrRelayOpen) {
			t.Fatalf("PowerDown under a relay: %v", err)
		}
		if st := ir.status(a); st != "Running" {
			t.Fatalf("Incus shows %s", st)
		}
		// An explicit power change: the client is told going-away, then
		// the target pauses.
		if _, err := ir.svc.SetPower(ir.ctx(), controller.TargetRef{Owner: a.Owner}, controller.PowerPaused); err != nil {
			t.Fatal(err)
		}
		_ = ws.SetReadDeadline(time.Now().Add(15 * time.Second))
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
		ir.until(a.Owner, "paused", func(o controller.Observation) bool {
			return o.Power == controller.PowerPaused && o.Message == ""
		})
		// And a dial wakes it again.
		ir.mustUpgrade(a).Close()
	})

	t.Run("a daemon that cannot answer is refused within the hold", func(t *testing.T) {
		w := ir.create("env-wrongport", "wrongport")
		d := ir.dial(w)
		if d.Refusal == nil || d.Refusal.State != "booting" || d.Refusal.RetryAfter < time.Second {
			t.Fatalf("got %+v", d)
		}
		if d.Elapsed > MaxHold {
			t.Fatalf("refused after %s", d.Elapsed)
		}
	})

	t.Run("closing and absent targets are gone", func(t *testing.T) {
		if _, err := ir.svc.CloseTarget(ir.ctx(), controller.TargetRef{Owner: b.Owner}); err != nil {
			t.Fatal(err)
		}
		d := ir.dial(b)
		if d.Refusal == nil || d.Refusal.State != "gone" {
			t.Fatalf("closing: got %+v", d)
		}
		deadline := time.Now().Add(90 * time.Second)
		for {
			o, err := ir.svc.CloseTarget(ir.ctx(), controller.TargetRef{Owner: b.Owner})
			if err == nil && o.Phase == controller.PhaseClosed {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("never closed: %+v %v", o, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
		d = ir.dial(b)
		if d.Refusal == nil || d.Refusal.State != "gone" {
			t.Fatalf("closed: got %+v", d)
		}
	})
}
