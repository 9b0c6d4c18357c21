package wake

import (
	"context"
	"fmt"
	"net"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/devguest"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// The wake on its own, against a fake of the targets and a real
// development daemon behind the dialer: what every use of a target shares.
// The data routes' tests drive it through dials, holds and relays.

const testInstance = "ls-00000000000000000001"

var testOwner = controller.Owner{UniverseID: "u1", EnvironmentID: "env1"}

type fakeTargets struct {
	mu        sync.Mutex
	state     targets.RouteState
	phase     controller.Phase
	gone      bool
	wakeDelay time.Duration
	// wakeHeld, when set, holds Wake until it is closed, and wakeErr is
	// what Wake then answers.
	wakeHeld chan struct{}
	wakeErr  error
	// relayEarly: Wake says the use is relayable once it acted, before
	// the record it is held on (a power-down marked carried out).
	relayEarly bool
	wakes      atomic.Int32
	restarts   atomic.Int32
	onRestart  func() // set before the rig's first use
}

func (f *fakeTargets) route() targets.Route {
	o := controller.Observation{TargetID: testInstance, Owner: testOwner, Phase: f.phase}
	if f.phase == controller.PhaseActive {
		o.Power = map[targets.RouteState]controller.Power{targets.RoutePaused: controller.PowerPaused,
			targets.RouteStopped: controller.PowerStopped}[f.state]
		if o.Power == "" {
			o.Power = controller.PowerRunning
		}
	}
	return targets.Route{Name: testInstance, Owner: testOwner, State: f.state, Observation: o,
		Daemon: guest.Target{Instance: testInstance, Port: guest.DefaultPort}}
}

func (f *fakeTargets) set(state targets.RouteState, phase controller.Phase) {
	f.mu.Lock()
	f.state, f.phase = state, phase
	f.mu.Unlock()
}

func (f *fakeTargets) ResolveRoute(_ context.Context, owner controller.Owner, targetID string) (targets.Route, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gone || owner != testOwner || targetID != testInstance {
		return targets.Route{}, targets.ErrRouteGone
	}
	return f.route(), nil
}

func (f *fakeTargets) Wake(ctx context.Context, _ targets.Route, _ time.Time, relayable func()) (controller.Power, error) {
	f.wakes.Add(1)
	f.mu.Lock()
	from, delay, held, werr, early := f.route().Observation.Power, f.wakeDelay, f.wakeHeld, f.wakeErr, f.relayEarly
	f.mu.Unlock()
	select {
	case <-time.After(delay):
	case <-ctx.Done():
		return from, ctx.Err()
	}
	f.set(targets.RouteRunning, controller.PhaseActive)
	if early && relayable != nil {
		relayable()
	}
	if held != nil {
		select {
		case <-held:
		case <-ctx.Done():
			return from, ctx.Err()
		}
	}
	return from, werr
}

func (f *fakeTargets) PowerDownPending(targets.Route, time.Time) bool { return false }
func (f *fakeTargets) RestartDaemonDevice(context.Context, string) error {
	f.restarts.Add(1)
	if f.onRestart != nil {
		f.onRestart()
	}
	return nil
}

// daemonDialer reaches a development daemon whatever the target.
type daemonDialer struct {
	addr  string
	dials atomic.Int32
	dead  atomic.Bool // the device to the daemon does not listen
}

func newDaemonDialer(t *testing.T) *daemonDialer {
	t.Helper()
	d, err := devguest.New(t.Context(), devguest.Config{Cwd: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	return &daemonDialer{addr: srv.Listener.Addr().String()}
}

func (d *daemonDialer) DialContext(ctx context.Context, _ guest.Target) (net.Conn, error) {
	d.dials.Add(1)
	if d.dead.Load() {
		return nil, fmt.Errorf("test dial: %w", guest.ErrDeviceDown)
	}
	var nd net.Dialer
	return nd.DialContext(ctx, "tcp", d.addr)
}
func (*daemonDialer) Devices(guest.Target) map[string]map[string]string { return nil }
func (*daemonDialer) Forget(string)                                     {}
func (*daemonDialer) Name() string                                      { return "test" }

type wakeRig struct {
	targets *fakeTargets
	dialer  *daemonDialer
	reg     *relays.Registry
	metrics *prometheus.Registry
	w       *Waker
}

func newWakeRig(t *testing.T, state targets.RouteState) *wakeRig {
	t.Helper()
	r := &wakeRig{targets: &fakeTargets{}, dialer: newDaemonDialer(t), reg: relays.New(time.Second), metrics: prometheus.NewRegistry()}
	r.targets.set(state, controller.PhaseActive)
	w, err := New(t.Context(), Options{Targets: r.targets, Dialer: r.dialer, Relays: r.reg, Metrics: NewMetrics(r.metrics), Budget: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	r.w = w
	return r
}

func (r *wakeRig) route(t *testing.T) targets.Route {
	t.Helper()
	rt, err := r.targets.ResolveRoute(t.Context(), testOwner, testInstance)
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

// wakesCounted counts the wakes observed from with outcome.
func (r *wakeRig) wakesCounted(t *testing.T, from, outcome string) uint64 {
	t.Helper()
	mfs, err := r.metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["from"] == from && labels["outcome"] == outcome {
				n += m.GetHistogram().GetSampleCount()
			}
		}
	}
	return n
}

// A dial and ingress requests that come together for a paused target
// share one wake, and its proof of the daemon outlives it.
func TestUsesOfATargetShareOneWake(t *testing.T) {
	r := newWakeRig(t, targets.RoutePaused)
	r.targets.wakeDelay = 50 * time.Millisecond
	rt := r.route(t)
	f, started := r.w.Join(rt, time.Now(), true)
	if !started {
		t.Fatal("the first use did not start the flight")
	}
	const n = 8
	var wg sync.WaitGroup
	results := make(chan *Refusal, n)
	for range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			results <- r.w.WakeForUse(ctx, rt, time.Now())
		})
	}
	if again, started := r.w.Join(rt, time.Now(), true); started || again != f {
		t.Fatal("a use that came during the flight started another")
	}
	wg.Wait()
	close(results)
	for ref := range results {
		if ref != nil {
			t.Fatalf("a use was refused %+v, want the daemon answering", ref)
		}
	}
	<-f.Settled()
	if f.Result() != nil {
		t.Fatalf("the flight settled on %+v", f.Result())
	}
	if got := r.targets.wakes.Load(); got != 1 {
		t.Fatalf("%d wakes for %d uses, want 1", got, n+1)
	}
	if got := r.wakesCounted(t, "paused", outcomeReady); got != 1 {
		t.Fatalf("wake histogram counted %d ready wakes from paused, want 1", got)
	}
	if !r.w.Ready(testInstance) {
		t.Fatal("the daemon the flight proved is not ready")
	}
	// A power change forgets the proof. (The wake's own ticket holds the
	// target until Incus is done, which may be after the daemon answered.)
	deadline := time.Now().Add(5 * time.Second)
	for {
		release, ok := r.reg.Quiesce(testInstance)
		if ok {
			release()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the flight never let the target be quiesced")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if r.w.Ready(testInstance) {
		t.Fatal("the proof outlived a power change")
	}
}

// A use that arrived before a flight settled, and read its target powered
// down (a read older than that flight's wake), joins after the flight has
// settled: it shares that flight's answer and starts no second wake (CI:
// 21 wakes for 50 dials on 20 paused targets). A use that arrives after
// the landing, or any use after a power change, flies again.
func TestAUseThatReadBeforeAWakeLandedSharesIt(t *testing.T) {
	r := newWakeRig(t, targets.RoutePaused)
	stale := r.route(t) // read while paused
	early := time.Now()
	f, started := r.w.Join(stale, early, true)
	if !started {
		t.Fatal("the first use did not start the flight")
	}
	<-f.Settled()
	if f.Result() != nil {
		t.Fatalf("the flight settled on %+v", f.Result())
	}
	again, started := r.w.Join(stale, early.Add(time.Millisecond), true)
	if started || again != f {
		t.Fatal("a use that arrived before the flight settled, its read older than the wake, flew a second wake")
	}
	if got := r.targets.wakes.Load(); got != 1 {
		t.Fatalf("%d wakes, want 1", got)
	}
	if got := r.wakesCounted(t, "paused", outcomeReady); got != 1 {
		t.Fatalf("wake histogram counted %d ready wakes from paused, want 1", got)
	}
	// A use that arrived after the landing and reads the target powered
	// down is told so by a read made since: it flies.
	late, started := r.w.Join(stale, time.Now(), true)
	if !started || late == f {
		t.Fatal("a use that arrived after the landing, reading the target powered down, did not fly")
	}
	<-late.Settled()
	// After a power change, even a use that arrived before the landing
	// flies: the landing proves nothing of the target any more.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if release, ok := r.reg.Quiesce(testInstance); ok {
			release()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the flight never let the target be quiesced")
		}
	}
	after, started := r.w.Join(stale, early, true)
	if !started || after == late {
		t.Fatal("a use after a power change shared a landing from before it")
	}
	<-after.Settled()
}

// A thawed daemon answers before Wake does (Wake answers once the use's
// request for running is recorded): the use is not relayed until then,
// so that a process that dies between the two never leaves a relayed
// use's target to the older power-down recorded on it. A record that
// finds a newer request refuses the use.
func TestAUseWaitsForItsWakeToBeRecorded(t *testing.T) {
	for _, superseded := range []bool{false, true} {
		r := newWakeRig(t, targets.RoutePaused)
		held := make(chan struct{})
		r.targets.wakeHeld = held
		if superseded {
			r.targets.wakeErr = targets.ErrSuperseded
		}
		rt := r.route(t)
		answered := make(chan *Refusal, 1)
		go func() {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			answered <- r.w.WakeForUse(ctx, rt, time.Now())
		}()
		for deadline := time.Now().Add(5 * time.Second); r.dialer.dials.Load() == 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the daemon was never probed during the wake")
			}
		}
		select {
		case ref := <-answered:
			t.Fatalf("the use was answered (%+v) before its wake was recorded", ref)
		case <-time.After(200 * time.Millisecond):
		}
		close(held)
		ref := <-answered
		switch {
		case !superseded && ref != nil:
			t.Fatalf("after the record the use was refused %+v", ref)
		case superseded && (ref == nil || ref.State != StateWaking):
			t.Fatalf("a wake superseded by a newer request answered %+v, want a refusal", ref)
		}
	}
}

// A wake that undid a power-down marked carried out says so at once
// (Targets.Wake's relayable): Incus showing the target running under that
// power-down tells of the use should the process die before the record,
// so the use is answered when the daemon is, while the record goes on.
// The flight's ticket stays with the record: no power-down starts under
// it.
func TestAUseOfAMarkedPowerDownGoesBeforeTheRecord(t *testing.T) {
	r := newWakeRig(t, targets.RoutePaused)
	held := make(chan struct{})
	defer close(held)
	r.targets.wakeHeld = held
	r.targets.relayEarly = true
	rt := r.route(t)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if ref := r.w.WakeForUse(ctx, rt, time.Now()); ref != nil {
		t.Fatalf("the use was refused %+v", ref)
	}
	if _, ok := r.reg.Quiesce(rt.Name); ok {
		t.Fatal("a power-down could start while the wake's record is still under way")
	}
}

// A use whose hold runs out is told what the flight waits for; the flight
// goes on, and a later use finds it done.
func TestAFlightOutlivesAUseWhoseHoldRanOut(t *testing.T) {
	r := newWakeRig(t, targets.RouteStopped)
	r.targets.wakeDelay = 300 * time.Millisecond
	rt := r.route(t)
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if ref := r.w.WakeForUse(ctx, rt, time.Now()); ref == nil || ref.State != StateWaking || ref.RetryAfter != time.Second {
		t.Fatalf("a use whose hold ran out during a start was told %+v, want waking in 1 s", ref)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !r.w.Ready(testInstance) {
		if time.Now().After(deadline) {
			t.Fatal("the flight did not go on to prove the daemon")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel = context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if ref := r.w.WakeForUse(ctx, r.route(t), time.Now()); ref != nil {
		t.Fatalf("a later use was refused %+v", ref)
	}
	if got := r.targets.wakes.Load(); got != 1 {
		t.Fatalf("%d wakes, want 1", got)
	}
}

// A target that goes while its flight waits on a transition settles the
// flight as gone, and what was known of it is forgotten.
func TestAFlightOfATargetGoneMeanwhileIsGone(t *testing.T) {
	r := newWakeRig(t, targets.RouteOther) // freezing, say: Incus finishes it on its own
	r.w.Seen(testInstance, true)
	rt := r.route(t)
	f, _ := r.w.Join(rt, time.Now(), false)
	time.Sleep(100 * time.Millisecond)
	r.targets.mu.Lock()
	r.targets.gone = true
	r.targets.mu.Unlock()
	select {
	case <-f.Settled():
	case <-time.After(5 * time.Second):
		t.Fatal("the flight did not settle")
	}
	if ref := f.Result(); ref == nil || ref.State != StateGone {
		t.Fatalf("settled on %+v, want gone", ref)
	}
	if r.w.LastDown(testInstance) || r.targets.wakes.Load() != 0 {
		t.Fatal("a gone target is still remembered, or was woken")
	}
}

// A running target whose device to the daemon does not listen (LXD 5.0's
// proxy after a failed graceful stop raced by a start) has the device
// restarted once the probe has found it dead for deviceDeadAfter, and the
// use goes through; nothing restarts it twice in one flight.
func TestADeadDeviceIsRestartedOnce(t *testing.T) {
	r := newWakeRig(t, targets.RouteRunning)
	r.dialer.dead.Store(true)
	r.targets.onRestart = func() { r.dialer.dead.Store(false) }
	ctx, cancel := context.WithTimeout(t.Context(), 2*deviceDeadAfter+time.Second)
	defer cancel()
	start := time.Now()
	if ref := r.w.WakeForUse(ctx, r.route(t), time.Now()); ref != nil {
		t.Fatalf("refused %+v after %s, want the daemon answering once its device was restarted", ref, time.Since(start))
	}
	if took := time.Since(start); took < deviceDeadAfter {
		t.Errorf("answered after %s: the device was restarted before it had been dead for %s", took, deviceDeadAfter)
	}
	if got := r.targets.restarts.Load(); got != 1 {
		t.Fatalf("%d restarts, want 1", got)
	}

	// Dead again, and a restart that does not help: still one per flight.
	r.w.Unready(testInstance)
	r.dialer.dead.Store(true)
	r.targets.onRestart = nil
	ctx, cancel = context.WithTimeout(t.Context(), 2*deviceDeadAfter+time.Second)
	defer cancel()
	if ref := r.w.WakeForUse(ctx, r.route(t), time.Now()); ref == nil || ref.State != StateBooting {
		t.Fatalf("a device that stays dead answered %+v, want booting", ref)
	}
	if got := r.targets.restarts.Load(); got != 2 {
		t.Fatalf("%d restarts in all, want one per flight (2)", got)
	}
}

func TestTerminal(t *testing.T) {
	for _, c := range []struct {
		o    controller.Observation
		want *Refusal
	}{
		{controller.Observation{Phase: controller.PhaseActive, Power: controller.PowerPaused}, nil},
		{controller.Observation{Phase: controller.PhaseProvisioning}, nil},
		{controller.Observation{Phase: controller.PhaseClosing}, &Refusal{State: StateGone}},
		{controller.Observation{Phase: controller.PhaseClosed}, &Refusal{State: StateGone}},
		{controller.Observation{Phase: controller.PhaseFailed, Message: "disk broken"}, &Refusal{State: StateFailed, Message: "disk broken"}},
		{controller.Observation{Phase: controller.PhaseFailed}, &Refusal{State: StateFailed, Message: DefaultFailedMessage}},
		{controller.Observation{Phase: controller.PhaseUnknown}, &Refusal{State: StateBooting, RetryAfter: 5 * time.Second}},
	} {
		got := Terminal(c.o)
		if (got == nil) != (c.want == nil) || (got != nil && *got != *c.want) {
			t.Errorf("%s: %+v, want %+v", c.o.Phase, got, c.want)
		}
	}
}

// handTo is the Elsewhere of a replica whose targets another replica's
// waker wakes: the peer hop without its wire (guest's tests have that).
type handTo struct {
	w      *Waker
	asked  atomic.Int32
	answer *Refusal // answered instead of asking w, when set
	down   bool     // the other replica gives no answer
}

func (h *handTo) Wake(ctx context.Context, r targets.Route, arrived time.Time) (*Refusal, bool) {
	h.asked.Add(1)
	switch {
	case h.down:
		return nil, false
	case h.answer != nil:
		return h.answer, true
	}
	return h.w.WakeForUse(ctx, r, arrived), true
}

// Uses of one paused target arriving at two replicas at once: the one
// that does not wake it hands its flight to the one that does, whose
// flight every use shares, so the target is woken once.
func TestUsesAtTwoReplicasShareOneWake(t *testing.T) {
	waker := newWakeRig(t, targets.RoutePaused)
	waker.targets.wakeDelay = 50 * time.Millisecond
	hand := &handTo{w: waker.w}
	other, err := New(t.Context(), Options{Targets: waker.targets, Dialer: waker.dialer, Relays: relays.New(time.Second),
		Metrics: NewMetrics(prometheus.NewRegistry()), Budget: 5 * time.Second, Elsewhere: hand})
	if err != nil {
		t.Fatal(err)
	}
	rt := waker.route(t)
	const n = 12
	var wg sync.WaitGroup
	results := make(chan *Refusal, n)
	for i := range n {
		w := waker.w
		if i%2 == 1 {
			w = other
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			results <- w.WakeForUse(ctx, rt, time.Now())
		})
	}
	wg.Wait()
	close(results)
	for ref := range results {
		if ref != nil {
			t.Fatalf("a use was refused %+v, want the daemon answering", ref)
		}
	}
	if got := waker.targets.wakes.Load(); got != 1 {
		t.Fatalf("%d wakes for %d uses at two replicas, want 1", got, n)
	}
	if got := hand.asked.Load(); got != 1 {
		t.Fatalf("the replica that does not wake the target asked %d times for its %d uses, want its flight to ask once", got, n/2)
	}
	if !other.Ready(testInstance) {
		t.Fatal("the daemon the waking replica proved is not ready on the other")
	}
}

// What the waking replica answers is the other's flight's answer; no
// answer from it, and the other wakes the target itself.
func TestAHandedWakeSettlesOnTheWakersAnswer(t *testing.T) {
	for _, c := range []struct {
		name   string
		hand   *handTo
		want   *Refusal
		wakes  int32
		metric string
	}{
		{"gone", &handTo{answer: refuse(StateGone, 0)}, refuse(StateGone, 0), 0, outcomeFailed},
		{"still waking", &handTo{answer: refuse(StateWaking, time.Second)}, refuse(StateWaking, time.Second), 0, outcomeGaveUp},
		{"no answer", &handTo{down: true}, nil, 1, outcomeReady},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newWakeRig(t, targets.RoutePaused)
			mx := prometheus.NewRegistry()
			w, err := New(t.Context(), Options{Targets: r.targets, Dialer: r.dialer, Relays: r.reg,
				Metrics: NewMetrics(mx), Budget: 5 * time.Second, Elsewhere: c.hand})
			if err != nil {
				t.Fatal(err)
			}
			r.w, r.metrics = w, mx
			got := w.WakeForUse(t.Context(), r.route(t), time.Now())
			if (got == nil) != (c.want == nil) || got != nil && (got.State != c.want.State || got.RetryAfter != c.want.RetryAfter) {
				t.Fatalf("the use was answered %+v, want %+v", got, c.want)
			}
			if n := r.targets.wakes.Load(); n != c.wakes {
				t.Fatalf("this replica woke the target %d times, want %d", n, c.wakes)
			}
			if n := r.wakesCounted(t, "paused", c.metric); n != 1 {
				t.Fatalf("%d wakes from paused counted %s, want 1", n, c.metric)
			}
		})
	}
}
