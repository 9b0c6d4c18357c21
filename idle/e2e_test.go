package idle_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/testrig"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// The short policy of the end-to-end tests.
const (
	pauseAfter = 2 * time.Second
	stopAfter  = 4 * time.Second
	closeAfter = 6 * time.Second
)

func shortPolicy() *idlepolicy.Policy {
	ms := func(d time.Duration) *uint64 { v := uint64(d.Milliseconds()); return &v }
	return &idlepolicy.Policy{PauseAfterMs: ms(pauseAfter), StopAfterMs: ms(stopAfter), CloseAfterMs: ms(closeAfter)}
}

// e2e is one provider's worth of targets service and idle loop on the real
// Incus, in a throwaway project, with the development guest image.
type e2e struct {
	t       *testing.T
	client  *incus.Client
	catalog *templates.Catalog
	dialer  guest.Dialer
}

func newE2E(t *testing.T) *e2e {
	t.Helper()
	client := incustest.Client(t)
	image := incustest.Image(t)
	// The template's default policy is long; the tests' targets name the
	// short one at create, as target/create's idle lets them.
	catalog := testrig.Catalog(t, client, image, `templates:
  - templateId: dev
    displayName: development guest
    powerStates: [running, paused, stopped]
    idle: {pauseAfterMs: 600000, stopAfterMs: 3600000, closeAfterMs: 86400000}
    imageAlias: {{image}}
`)
	dialer := testrig.GuestDialer(t, client)
	return &e2e{t: t, client: client, catalog: catalog, dialer: dialer}
}

// process runs a targets service and an idle loop, as one provider
// process does (wired as provider.New wires them); stop ends both.
type process struct {
	svc  *targets.Service
	loop *idle.Loop
	reg  *prometheus.Registry
	stop func()
}

func (e *e2e) start() *process {
	log := zaptest.NewLogger(e.t)
	svc, err := targets.New(e.client, e.catalog, e.dialer, relays.New(time.Second), log.Named("targets"),
		targets.Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Second})
	if err != nil {
		e.t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	loop := idle.New(idle.Config{
		Inventory:       provider.IdleInventory{Targets: svc},
		Dialer:          e.dialer,
		Metrics:         idle.NewMetrics(reg),
		Log:             log.Named("idle"),
		RefreshInterval: 500 * time.Millisecond,
		StartSpread:     -1,
		ProbeTimeout:    2 * time.Second,
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = svc.Run(ctx) }()
	go func() { defer wg.Done(); _ = loop.Run(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); wg.Wait() }) }
	e.t.Cleanup(stop)
	return &process{svc: svc, loop: loop, reg: reg, stop: stop}
}

func owner(env string) controller.Owner {
	return controller.Owner{UniverseID: "u-idle", EnvironmentID: env}
}

// timeline polls target/get and records when each observation first shows.
type timeline struct {
	mu    sync.Mutex
	first map[string]time.Time
	last  string
}

func (tl *timeline) at(state string) (time.Time, bool) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	at, ok := tl.first[state]
	return at, ok
}

func (tl *timeline) seen() []string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	out := []string{}
	for s := range tl.first {
		out = append(out, s)
	}
	return out
}

func watch(t *testing.T, get func(ctx context.Context) (controller.Observation, error)) *timeline {
	tl := &timeline{first: map[string]time.Time{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			o, err := get(ctx)
			state := string(o.Phase) + "/" + string(o.Power)
			var e *jsonrpc.Error
			if errors.As(err, &e) && e.Kind == jsonrpc.KindNotFound {
				state = "notFound"
			} else if err != nil {
				state = "error"
			}
			tl.mu.Lock()
			if _, ok := tl.first[state]; !ok {
				tl.first[state] = time.Now()
			}
			tl.last = state
			tl.mu.Unlock()
			select {
			case <-ctx.Done():
			case <-time.After(25 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return tl
}

func eventually(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startProcess runs a long process in the guest through its daemon, over a
// connection of the test's own: process/start counts as use, and a running
// process holds idleForMs at zero.
func (e *e2e) startProcess(name string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var last error
	for ctx.Err() == nil {
		last = func() error {
			d := websocket.Dialer{NetDialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return e.dialer.DialContext(ctx, guest.Target{Instance: name, Port: guest.DefaultPort})
			}}
			dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			ws, _, err := d.DialContext(dctx, "ws://guest/", nil)
			if err != nil {
				return err
			}
			rpc := jsonrpc.NewClient(ws)
			defer rpc.Close()
			if err := rpc.Call(ctx, "initialize", map[string]any{"protocolVersion": 5, "clientInfo": map[string]any{"name": "idle-e2e"}}, nil); err != nil {
				return err
			}
			var started struct {
				Pid uint32 `json:"pid"`
			}
			return rpc.Call(ctx, "process/start", map[string]any{"processId": "sleeper", "argv": []string{"/bin/busybox", "sleep", "3600"}}, &started)
		}()
		if last == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.t.Fatalf("process/start in %s: %v", name, last)
}

func (e *e2e) idleSince(name string) time.Time {
	e.t.Helper()
	inst, _, err := e.client.GetInstance(context.Background(), name)
	if err != nil {
		e.t.Fatal(err)
	}
	var ms int64
	if _, err := fmt.Sscan(inst.Config[targets.KeyIdleSince], &ms); err != nil {
		e.t.Fatalf("no idle-since recorded on %s: %q", name, inst.Config[targets.KeyIdleSince])
	}
	return time.UnixMilli(ms)
}

// TestIdleEndToEnd: an idle target is paused, stopped and closed on its
// policy's schedule, and a target running a process stays awake.
func TestIdleEndToEnd(t *testing.T) {
	e := newE2E(t)
	p := e.start()
	ctx := context.Background()
	idleOwner, busyOwner := owner("env-idle"), owner("env-busy")
	for _, o := range []controller.Owner{idleOwner, busyOwner} {
		if _, err := p.svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "dev", Idle: shortPolicy()}); err != nil {
			t.Fatal(err)
		}
	}
	// The busy target's process must start before its idle clock reaches
	// the pause threshold, so start it first.
	e.startProcess(targets.Name(busyOwner))
	// Its daemon may answer before the reconciler has recorded the boot:
	// watched from when it is active, it must stay active and running.
	eventually(t, "the busy target active", 30*time.Second, func() bool {
		o, err := p.svc.GetTarget(ctx, controller.TargetRef{Owner: busyOwner})
		return err == nil && o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning
	})
	idleTL := watch(t, func(ctx context.Context) (controller.Observation, error) {
		return p.svc.GetTarget(ctx, controller.TargetRef{Owner: idleOwner})
	})
	busyTL := watch(t, func(ctx context.Context) (controller.Observation, error) {
		return p.svc.GetTarget(ctx, controller.TargetRef{Owner: busyOwner})
	})

	eventually(t, "the idle target paused", 30*time.Second, func() bool {
		_, ok := idleTL.at("active/paused")
		return ok
	})
	origin := e.idleSince(targets.Name(idleOwner))
	eventually(t, "the idle target closed (target/get notFound)", 30*time.Second, func() bool {
		_, ok := idleTL.at("notFound")
		return ok
	})
	report(t, "idle target", origin, idleTL)
	for _, st := range []struct {
		state string
		after time.Duration
		// closing can last less than one poll (deleting a stopped container
		// takes milliseconds), so the close is judged by notFound.
	}{{"active/paused", pauseAfter}, {"active/stopped", stopAfter}, {"notFound", closeAfter}} {
		at, ok := idleTL.at(st.state)
		if !ok {
			t.Fatalf("the idle target never showed %s (saw %v)", st.state, idleTL.seen())
		}
		if at.Sub(origin) < st.after {
			t.Fatalf("%s showed %v after idleness began, before its threshold %v", st.state, at.Sub(origin), st.after)
		}
	}
	if obs, err := p.svc.CloseTarget(ctx, controller.TargetRef{Owner: idleOwner}); err != nil || obs.Phase != controller.PhaseClosed {
		t.Fatalf("close after an idle close answers closed: %+v %v", obs, err)
	}

	// A target created without a policy gets the template's default.
	defaultOwner := owner("env-default")
	if _, err := p.svc.CreateTarget(ctx, controller.CreateParams{Owner: defaultOwner, TemplateID: "dev"}); err != nil {
		t.Fatal(err)
	}
	listed, err := p.svc.IdleTargets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tg := range listed {
		var want uint64
		switch tg.Name {
		case targets.Name(defaultOwner):
			want = 600000
		case targets.Name(busyOwner):
			want = uint64(pauseAfter.Milliseconds())
		default:
			continue
		}
		if tg.Policy == nil || tg.Policy.PauseAfterMs == nil || *tg.Policy.PauseAfterMs != want {
			t.Fatalf("%s: policy %+v, want pauseAfterMs %d", tg.Name, tg.Policy, want)
		}
	}

	// The busy target ran through the whole schedule and beyond.
	time.Sleep(time.Second)
	for _, s := range busyTL.seen() {
		if s != "active/running" {
			t.Fatalf("the target running a process showed %s (saw %v)", s, busyTL.seen())
		}
	}
	if n := counter(t, p.reg, "incus_provider_idle_actions_total", map[string]string{"result": "ok"}); n != 3 {
		t.Fatalf("idle actions ok = %v, want 3 (pause, stop, close of the idle target)", n)
	}
	if n := counter(t, p.reg, "incus_provider_idle_probes_total", map[string]string{"outcome": "ok"}); n < 2 {
		t.Fatalf("idle probes ok = %v", n)
	}
	t.Logf("probes: %v ok, %v failed; passes %d, last %v", p.loop.Stats().ProbesOK, p.loop.Stats().ProbesFailed,
		p.loop.Stats().Passes, p.loop.Stats().LastPass)
}

// TestIdleEscalationSurvivesARestart: a target paused by one provider
// process is stopped and closed on schedule by the next one, which knows
// only what Incus recorded.
func TestIdleEscalationSurvivesARestart(t *testing.T) {
	e := newE2E(t)
	first := e.start()
	ctx := context.Background()
	o := owner("env-restart")
	if _, err := first.svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "dev", Idle: shortPolicy()}); err != nil {
		t.Fatal(err)
	}
	get := func(svc *targets.Service) func(context.Context) (controller.Observation, error) {
		return func(ctx context.Context) (controller.Observation, error) {
			return svc.GetTarget(ctx, controller.TargetRef{Owner: o})
		}
	}
	tl := watch(t, get(first.svc))
	eventually(t, "paused by the first process", 30*time.Second, func() bool {
		_, ok := tl.at("active/paused")
		return ok
	})
	origin := e.idleSince(targets.Name(o))
	first.stop()
	restarted := time.Now()
	second := e.start()
	eventually(t, "closed by the second process", 30*time.Second, func() bool {
		_, ok := tl.at("notFound")
		return ok
	})
	report(t, "restarted provider", origin, tl)
	t.Logf("the first process stopped %v after idleness began", restarted.Sub(origin).Round(time.Millisecond))
	stopped, ok := tl.at("active/stopped")
	if !ok || stopped.Sub(origin) < stopAfter || stopped.Before(restarted) {
		t.Fatalf("the second process must stop it at its threshold: stopped %v, %v", stopped.Sub(origin), ok)
	}
	if n := counter(t, second.reg, "incus_provider_idle_actions_total", map[string]string{"action": "stop", "result": "ok"}); n != 1 {
		t.Fatalf("the second process's stop actions = %v", n)
	}
	// The close's count is made when the loop takes in its result, which
	// may come after the target is already gone: wait for it.
	eventually(t, "the second process's close counted", 5*time.Second, func() bool {
		return counter(t, second.reg, "incus_provider_idle_actions_total", map[string]string{"action": "close", "result": "ok"}) == 1
	})
}

func report(t *testing.T, what string, origin time.Time, tl *timeline) {
	t.Helper()
	for _, state := range []string{"active/running", "active/paused", "active/stopped", "closing/", "notFound"} {
		if at, ok := tl.at(state); ok {
			t.Logf("%s: %-15s first seen %6.3fs after idleness began", what, state, at.Sub(origin).Seconds())
		}
	}
}

func counter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for k, v := range labels {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || (lp.GetName() == k && lp.GetValue() == v)
				}
				if !found {
					continue metrics
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}
