package idle

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle/idletest"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
)

func ms(v uint64) *uint64 { return &v }

// fakeInventory stands for the targets package: what the real one does on
// Incus is covered by the integration tests in targets/.
type fakeInventory struct {
	fleet *idletest.Fleet

	mu      sync.Mutex
	targets map[string]*Target
	relays  map[string]int
	// staleReads answers RelayEndedSince true this many more times, as if
	// a relay ended during each of that many probes; staleAsked keeps the
	// instants it answered true for.
	staleReads int
	staleAsked []time.Time
	acts       []act
	stale      int // answer ErrStale this many more times
	lists      int
}

type act struct {
	name   string
	action idlepolicy.Action
	since  time.Time
	readAt time.Time
	at     time.Time
}

func newInventory(fleet *idletest.Fleet) *fakeInventory {
	return &fakeInventory{fleet: fleet, targets: map[string]*Target{}, relays: map[string]int{}}
}

func (f *fakeInventory) add(t Target) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t.Phase == "" {
		t.Phase, t.Settled = "active", true
	}
	if t.Port == 0 {
		t.Port = 19091
	}
	f.targets[t.Name] = &t
}

func (f *fakeInventory) set(name string, change func(*Target)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	change(f.targets[name])
}

func (f *fakeInventory) setRelays(name string, n int) {
	f.mu.Lock()
	f.relays[name] = n
	f.mu.Unlock()
}

func (f *fakeInventory) actions() []act {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]act(nil), f.acts...)
}

func (f *fakeInventory) IdleTargets(context.Context) ([]Target, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lists++
	out := make([]Target, 0, len(f.targets))
	for _, t := range f.targets {
		out = append(out, *t)
	}
	return out, nil
}

func (f *fakeInventory) RelaysOpen(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.relays[name]
}

func (f *fakeInventory) RelayEndedSince(_ string, since time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.staleReads > 0 && !since.IsZero() {
		f.staleReads--
		f.staleAsked = append(f.staleAsked, since)
		return true
	}
	return false
}

func (f *fakeInventory) IdleAct(_ context.Context, t Target, a idlepolicy.Action, since, readAt time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	cur := f.targets[t.Name]
	if f.stale > 0 {
		f.stale--
		return ErrStale
	}
	if cur == nil || cur.Phase != "active" || !cur.Settled || cur.Power != t.Power ||
		(cur.Power != controller.PowerRunning && !cur.IdleSince.Equal(t.IdleSince)) {
		return ErrStale
	}
	if f.relays[t.Name] > 0 {
		return ErrRelayOpen
	}
	f.acts = append(f.acts, act{name: t.Name, action: a, since: since, readAt: readAt, at: time.Now()})
	if a == idlepolicy.ActionClose {
		cur.Phase, cur.Power = "closing", ""
		return nil
	}
	cur.Power, cur.IdleSince = PowerOf(a), since
	if d := f.fleet.Get(t.Name); d != nil {
		d.SetMode(idletest.Silent) // a frozen or stopped guest answers nothing
	}
	return nil
}

type harness struct {
	t     *testing.T
	fleet *idletest.Fleet
	inv   *fakeInventory
	reg   *prometheus.Registry
	loop  *Loop
}

func newHarness(t *testing.T) *harness {
	fleet := idletest.NewFleet(idletest.Options{})
	t.Cleanup(fleet.Close)
	return &harness{t: t, fleet: fleet, inv: newInventory(fleet), reg: prometheus.NewRegistry()}
}

// run starts a loop with short bounds; the returned stop waits for Run.
func (h *harness) run(tune func(*Config)) (*Loop, func()) {
	cfg := Config{
		Inventory:       h.inv,
		Dialer:          h.fleet,
		Metrics:         NewMetrics(h.reg),
		Log:             zaptest.NewLogger(h.t),
		ProbeTimeout:    300 * time.Millisecond,
		MaxInterval:     200 * time.Millisecond,
		RefreshInterval: 50 * time.Millisecond,
		StartSpread:     -1,
		RelayRecheck:    50 * time.Millisecond,
	}
	if tune != nil {
		tune(&cfg)
	}
	h.reg = prometheus.NewRegistry()
	cfg.Metrics = NewMetrics(h.reg)
	l := New(cfg)
	h.loop = l
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				h.t.Errorf("Run: %v", err)
			}
		})
	}
	h.t.Cleanup(stop)
	return l, stop
}

func (h *harness) counter(name string, labels map[string]string) float64 {
	h.t.Helper()
	families, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if matches(m, labels) {
				if m.GetCounter() != nil {
					sum += m.GetCounter().GetValue()
				} else if m.GetGauge() != nil {
					sum += m.GetGauge().GetValue()
				}
			}
		}
	}
	return sum
}

func matches(m *dto.Metric, labels map[string]string) bool {
	for k, v := range labels {
		found := false
		for _, lp := range m.GetLabel() {
			if lp.GetName() == k && lp.GetValue() == v {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: never happened", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func policy(pause, stop, closeMs uint64) *idlepolicy.Policy {
	p := &idlepolicy.Policy{}
	if pause > 0 {
		p.PauseAfterMs = ms(pause)
	}
	if stop > 0 {
		p.StopAfterMs = ms(stop)
	}
	if closeMs > 0 {
		p.CloseAfterMs = ms(closeMs)
	}
	return p
}

const containerStages = idlepolicy.StagePause | idlepolicy.StageStop

func TestLoopPausesStopsThenClosesOnSchedule(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("a")
	origin := time.Now()
	d.SetIdleSince(origin)
	h.inv.add(Target{Name: "a", Power: controller.PowerRunning, Policy: policy(300, 600, 900), Stages: containerStages})
	h.run(nil)

	eventually(t, "close", func() bool { return len(h.inv.actions()) == 3 })
	acts := h.inv.actions()
	want := []struct {
		a         idlepolicy.Action
		threshold time.Duration
	}{{idlepolicy.ActionPause, 300 * time.Millisecond}, {idlepolicy.ActionStop, 600 * time.Millisecond}, {idlepolicy.ActionClose, 900 * time.Millisecond}}
	for i, w := range want {
		got := acts[i]
		if got.action != w.a {
			t.Fatalf("action %d: %s, want %s (all: %+v)", i, got.action, w.a, acts)
		}
		// One origin for every stage: the instant idleness began.
		if d := got.since.Sub(origin); d < -time.Millisecond || d > 50*time.Millisecond {
			t.Fatalf("action %s recorded idle since %v after the daemon's idleness began", got.action, d)
		}
		if early := got.at.Sub(got.since); early < w.threshold {
			t.Fatalf("action %s came %v after the recorded idle-since, before its threshold %v", got.action, early, w.threshold)
		}
		t.Logf("%s at %v idle (threshold %v)", got.action, got.at.Sub(origin).Round(time.Millisecond), w.threshold)
	}
	// Counted when the loop takes in the result, which comes after the
	// inventory recorded the action.
	eventually(t, "3 actions counted ok", func() bool {
		return h.counter("incus_provider_idle_actions_total", map[string]string{"result": "ok"}) == 3
	})
}

func TestLoopLeavesBusyTargetsAwake(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("busy")
	d.SetBusy(true) // a running process holds idleForMs at zero
	// Stop and close an hour away: the first reading after the work ends
	// may come late on a loaded machine (CI: later than a stop 50 ms
	// after the pause, which it then took first), and the pause must be
	// the first stage due whatever the gap.
	h.inv.add(Target{Name: "busy", Power: controller.PowerRunning, Policy: policy(50, 3_600_000, 7_200_000), Stages: containerStages})
	l, _ := h.run(nil)
	eventually(t, "several probes", func() bool { return l.Stats().ProbesOK >= 10 })
	if acts := h.inv.actions(); len(acts) != 0 {
		t.Fatalf("a busy target was acted on: %+v", acts)
	}
	d.SetBusy(false)
	eventually(t, "pause after the work ended", func() bool { return len(h.inv.actions()) >= 1 })
	if a := h.inv.actions()[0]; a.action != idlepolicy.ActionPause {
		t.Fatalf("first action after work ended: %s", a.action)
	}
}

func TestLoopTreatsASilentDaemonAsNotIdle(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("mute")
	d.SetIdleSince(time.Now().Add(-time.Hour))
	d.SetMode(idletest.Silent)
	h.inv.add(Target{Name: "mute", Power: controller.PowerRunning, Policy: policy(1, 2, 3), Stages: containerStages})
	h.run(func(c *Config) { c.ProbeTimeout = 50 * time.Millisecond })
	eventually(t, "timeouts counted", func() bool {
		return h.counter("incus_provider_idle_probes_total", map[string]string{"outcome": OutcomeTimeout}) >= 2
	})
	if acts := h.inv.actions(); len(acts) != 0 {
		t.Fatalf("a daemon that does not answer is not idle, yet: %+v", acts)
	}
}

func TestLoopTreatsAMalformedAnswerAsNotIdle(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("odd")
	d.SetIdleSince(time.Now().Add(-time.Hour))
	d.SetMode(idletest.Malformed)
	h.inv.add(Target{Name: "odd", Power: controller.PowerRunning, Policy: policy(1, 2, 3), Stages: containerStages})
	h.run(nil)
	eventually(t, "malformed answers counted", func() bool {
		return h.counter("incus_provider_idle_probes_total", map[string]string{"outcome": OutcomeMalformed}) >= 2
	})
	if acts := h.inv.actions(); len(acts) != 0 {
		t.Fatalf("a malformed getIdle is not idleness, yet: %+v", acts)
	}
}

// The readiness probe relays a daemon of another version (the runtime fails
// the environment); the idle loop cannot ask it env/getIdle, so it still
// counts it as not idle, a failed handshake.
func TestLoopTreatsADaemonOfAnotherVersionAsNotIdle(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("v6")
	d.SetIdleSince(time.Now().Add(-time.Hour))
	d.SetMode(idletest.OtherVersion)
	h.inv.add(Target{Name: "v6", Power: controller.PowerRunning, Policy: policy(1, 2, 3), Stages: containerStages})
	h.run(nil)
	eventually(t, "failed handshakes counted", func() bool {
		return h.counter("incus_provider_idle_probes_total", map[string]string{"outcome": OutcomeHandshake}) >= 2
	})
	if acts := h.inv.actions(); len(acts) != 0 {
		t.Fatalf("a daemon of another version is not idle, yet: %+v", acts)
	}
}

func TestLoopAcceptsDiagnosticCountMembers(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("chatty")
	d.SetIdleSince(time.Now().Add(-time.Second))
	d.SetExtra(map[string]uint64{"runningProcessCount": 0, "leftoverProcessGroupCount": 0, "someFutureCount": 7})
	h.inv.add(Target{Name: "chatty", Power: controller.PowerRunning, Policy: policy(100, 0, 0), Stages: containerStages})
	h.run(nil)
	eventually(t, "pause", func() bool { return len(h.inv.actions()) == 1 })
}

func TestLoopNeverPowersDownATargetWithAnOpenRelay(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("relayed")
	d.SetIdleSince(time.Now().Add(-time.Hour))
	h.inv.add(Target{Name: "relayed", Power: controller.PowerRunning, Policy: policy(1, 2, 3), Stages: containerStages})
	h.inv.setRelays("relayed", 1)
	h.run(nil)
	eventually(t, "relay hold-offs counted", func() bool {
		return h.counter("incus_provider_idle_actions_total", map[string]string{"result": ResultRelayOpen}) >= 3
	})
	if acts := h.inv.actions(); len(acts) != 0 {
		t.Fatalf("acted with a relay open: %+v", acts)
	}
	h.inv.setRelays("relayed", 0)
	eventually(t, "the due action once the relay closed", func() bool { return len(h.inv.actions()) >= 1 })
	if a := h.inv.actions()[0]; a.action != idlepolicy.ActionClose {
		t.Fatalf("the most escalated stage is due: got %s", a.action)
	}
}

// A relay that ended while a probe ran may have carried a use the answer
// predates (a process started, then the relay closed): the loop acts on no
// such reading, and asks again a timer gap later rather than after
// RelayRecheck.
func TestLoopActsOnNoReadingARelayOvertook(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("overtaken")
	d.SetIdleSince(time.Now().Add(-time.Hour))
	h.inv.add(Target{Name: "overtaken", Power: controller.PowerRunning, Policy: policy(100, 0, 0), Stages: containerStages})
	h.inv.mu.Lock()
	h.inv.staleReads = 2
	h.inv.mu.Unlock()
	h.run(func(c *Config) { c.MaxInterval, c.RelayRecheck = time.Hour, time.Hour })
	eventually(t, "the pause, on a reading no relay overtook", func() bool { return len(h.inv.actions()) == 1 })
	h.inv.mu.Lock()
	defer h.inv.mu.Unlock()
	if len(h.inv.staleAsked) != 2 {
		t.Fatalf("%d overtaken readings, want 2", len(h.inv.staleAsked))
	}
	a := h.inv.acts[0]
	for _, asked := range h.inv.staleAsked {
		if !a.readAt.After(asked) {
			t.Fatalf("acted on the reading asked for at %v, which a relay overtook (overtaken: %v)", a.readAt, h.inv.staleAsked)
		}
	}
}

func TestLoopKeepsOneSessionAcrossProbes(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("steady")
	h.inv.add(Target{Name: "steady", Power: controller.PowerRunning, Policy: policy(0, 0, 3_600_000), Stages: containerStages})
	l, stop := h.run(func(c *Config) { c.MaxInterval = 20 * time.Millisecond })
	eventually(t, "many probes", func() bool { return d.GetIdles.Load() >= 10 })
	if n := d.Handshakes.Load(); n != 1 {
		t.Fatalf("%d handshakes for %d probes: the session must be reused", n, d.GetIdles.Load())
	}
	if s := l.Stats(); s.Sessions != 1 || s.Passes == 0 {
		t.Fatalf("stats %+v: want one session and completed passes", s)
	}
	stop()
	eventually(t, "sessions closed after Run returned", func() bool { return h.fleet.OpenConns() == 0 })
	if s := l.Stats(); s.Sessions != 0 {
		t.Fatalf("%d sessions left open after Run returned", s.Sessions)
	}
}

func TestLoopReplacesAnEndedSessionWithinOneProbe(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("blink")
	h.inv.add(Target{Name: "blink", Power: controller.PowerRunning, Policy: policy(0, 0, 3_600_000), Stages: containerStages})
	l, _ := h.run(func(c *Config) { c.MaxInterval = 30 * time.Millisecond })
	// Two probes asked over it: the first one has then been answered (a
	// target is probed once at a time), so the first drop cannot cut a probe
	// over a session it has only just opened, which no redial would save.
	eventually(t, "first session", func() bool { return d.Handshakes.Load() == 1 && d.GetIdles.Load() >= 2 })
	for i := 0; i < 3; i++ {
		before := d.Handshakes.Load()
		d.Restart() // a guest stopped and started again: new daemon, connections gone
		h.fleet.DropConns()
		// Wait for a whole probe over the new session before the next drop,
		// which would otherwise cut that probe short.
		eventually(t, "a new session", func() bool { return d.Handshakes.Load() > before })
		probes := d.GetIdles.Load()
		eventually(t, "a probe over it", func() bool { return d.GetIdles.Load() > probes+1 })
	}
	if failed := l.Stats().ProbesFailed; failed != 0 {
		t.Fatalf("%d probes failed: an ended session is replaced within the probe", failed)
	}
}

func TestLoopContinuesAPausedTargetsEscalationAfterARestart(t *testing.T) {
	h := newHarness(t)
	h.fleet.Add("sleeper").SetMode(idletest.Silent) // frozen
	since := truncMs(time.Now().Add(-200 * time.Millisecond))
	h.inv.add(Target{Name: "sleeper", Power: controller.PowerPaused, IdleSince: since, Policy: policy(100, 400, 600), Stages: containerStages})
	// A new loop, as after a provider restart: it knows only what the
	// inventory records.
	h.run(nil)
	eventually(t, "stop then close", func() bool { return len(h.inv.actions()) == 2 })
	acts := h.inv.actions()
	if acts[0].action != idlepolicy.ActionStop || acts[1].action != idlepolicy.ActionClose {
		t.Fatalf("want stop then close, got %+v", acts)
	}
	for _, a := range acts {
		if !a.since.Equal(since) {
			t.Fatalf("%s recorded idle since %v, want the recorded %v", a.action, a.since, since)
		}
	}
	if acts[0].at.Sub(since) < 400*time.Millisecond || acts[1].at.Sub(since) < 600*time.Millisecond {
		t.Fatalf("escalated before its thresholds: %+v", acts)
	}
	if n := h.counter("incus_provider_idle_probes_total", nil); n != 0 {
		t.Fatalf("a paused guest cannot answer, yet it was probed %v times", n)
	}
}

func TestLoopCountsAWakeAsUse(t *testing.T) {
	h := newHarness(t)
	d := h.fleet.Add("woken")
	d.SetMode(idletest.Silent)
	h.inv.add(Target{Name: "woken", Power: controller.PowerPaused, IdleSince: truncMs(time.Now()), Policy: policy(150, 60_000, 0), Stages: containerStages})
	h.run(nil)
	time.Sleep(100 * time.Millisecond) // the loop knows it paused
	// A data route wakes it: the guest's clock ran on while it was frozen,
	// so the daemon reports a long idleness.
	d.SetIdleSince(time.Now().Add(-10 * time.Minute))
	d.SetMode(idletest.Normal)
	woke := time.Now()
	h.inv.set("woken", func(t *Target) { t.Power, t.IdleSince = controller.PowerRunning, time.Time{} })
	eventually(t, "paused again", func() bool { return len(h.inv.actions()) == 1 })
	a := h.inv.actions()[0]
	if a.action != idlepolicy.ActionPause || a.since.Before(truncMs(woke).Add(-60*time.Millisecond)) || a.at.Sub(woke) < 150*time.Millisecond {
		t.Fatalf("after a wake, idleness counts from the wake: %+v (woke %v)", a, woke)
	}
}

func TestLoopRetriesAfterAStaleAction(t *testing.T) {
	h := newHarness(t)
	h.fleet.Add("moving").SetIdleSince(time.Now().Add(-time.Hour))
	h.inv.add(Target{Name: "moving", Power: controller.PowerRunning, Policy: policy(1, 0, 0), Stages: containerStages})
	h.inv.stale = 2
	h.run(nil)
	eventually(t, "pause after two stale answers", func() bool { return len(h.inv.actions()) == 1 })
	if n := h.counter("incus_provider_idle_actions_total", map[string]string{"result": ResultStale}); n != 2 {
		t.Fatalf("stale = %v, want 2", n)
	}
}

func TestLoopIgnoresTargetsWithoutPolicyOrNotActive(t *testing.T) {
	h := newHarness(t)
	for _, n := range []string{"nopolicy", "provisioning", "closing"} {
		h.fleet.Add(n).SetIdleSince(time.Now().Add(-time.Hour))
	}
	h.inv.add(Target{Name: "nopolicy", Power: controller.PowerRunning, Stages: containerStages})
	h.inv.add(Target{Name: "provisioning", Phase: "provisioning", Policy: policy(1, 0, 0), Stages: containerStages})
	h.inv.add(Target{Name: "closing", Phase: "closing", Policy: policy(1, 0, 0), Stages: containerStages})
	l, _ := h.run(nil)
	eventually(t, "a few listings", func() bool {
		h.inv.mu.Lock()
		defer h.inv.mu.Unlock()
		return h.inv.lists >= 3
	})
	if acts := h.inv.actions(); len(acts) != 0 || l.Stats().ProbesOK+l.Stats().ProbesFailed != 0 {
		t.Fatalf("acted on or probed targets the policy does not apply to: %+v %+v", acts, l.Stats())
	}
	if g := h.counter("incus_provider_targets", map[string]string{"phase": "active", "power": "running"}); g != 1 {
		t.Fatalf("targets{active,running} = %v, want 1", g)
	}
	if g := h.counter("incus_provider_targets", map[string]string{"phase": "closing", "power": "none"}); g != 1 {
		t.Fatalf("targets{closing,none} = %v, want 1", g)
	}
}

func TestLoopBoundsConcurrentProbes(t *testing.T) {
	h := newHarness(t)
	for i := range 40 {
		n := fmt.Sprintf("t%d", i)
		h.fleet.Add(n).SetMode(idletest.Silent)
		h.inv.add(Target{Name: n, Power: controller.PowerRunning, Policy: policy(0, 0, 3_600_000), Stages: containerStages})
	}
	h.run(func(c *Config) { c.MaxProbes = 4; c.ProbeTimeout = 2 * time.Second })
	// Silent daemons hold each probe for its whole deadline, so the
	// number in flight is the bound.
	eventually(t, "probes running", func() bool { return h.fleet.Dials.Load() >= 4 })
	time.Sleep(200 * time.Millisecond)
	if n := h.fleet.Dials.Load(); n != 4 {
		t.Fatalf("%d dials within one probe deadline, bound 4", n)
	}
}

// watchingInventory also tells the loop which targets it changed.
type watchingInventory struct {
	*fakeInventory
	changes chan string
}

func (w *watchingInventory) Changes() <-chan string { return w.changes }

func (w *watchingInventory) IdleTarget(_ context.Context, name string) (Target, bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	t, ok := w.targets[name]
	if !ok {
		return Target{}, false, nil
	}
	return *t, true, nil
}

func TestLoopLooksAtChangedTargetsAtOnce(t *testing.T) {
	h := newHarness(t)
	w := &watchingInventory{fakeInventory: h.inv, changes: make(chan string, 8)}
	var _ Watcher = w
	cfg := func(c *Config) {
		c.Inventory = w
		c.RefreshInterval = time.Hour // only the change notes can reveal anything
	}
	h.run(cfg)
	time.Sleep(50 * time.Millisecond) // the first (empty) listing is done
	d := h.fleet.Add("new")
	origin := time.Now()
	d.SetIdleSince(origin)
	h.inv.add(Target{Name: "new", Power: controller.PowerRunning, Policy: policy(300, 0, 0), Stages: containerStages})
	w.changes <- "new"
	eventually(t, "the new target paused", func() bool { return len(h.inv.actions()) == 1 })
	if a := h.inv.actions()[0]; a.action != idlepolicy.ActionPause || a.at.Sub(a.since) < 300*time.Millisecond {
		t.Fatalf("pause of a target seen through a change note: %+v", a)
	}

	// A wake by someone else, noted: idleness counts from the wake although
	// the daemon's clock ran on while it was frozen.
	d.SetMode(idletest.Normal)
	d.SetIdleSince(time.Now().Add(-time.Hour))
	woke := time.Now()
	h.inv.set("new", func(t *Target) { t.Power, t.IdleSince = controller.PowerRunning, time.Time{} })
	w.changes <- "new"
	eventually(t, "paused again", func() bool { return len(h.inv.actions()) == 2 })
	if a := h.inv.actions()[1]; a.at.Sub(woke) < 300*time.Millisecond {
		t.Fatalf("re-paused %v after the wake, before the threshold", a.at.Sub(woke))
	}

	// A target that went away, noted: forgotten.
	h.inv.mu.Lock()
	delete(h.inv.targets, "new")
	h.inv.mu.Unlock()
	w.changes <- "new"
	l := h.loop
	eventually(t, "forgotten", func() bool { return l != nil && l.Stats().Tracked == 0 })
}

// actHookInventory runs afterAct inside IdleAct, once the action is taken
// and before its result reaches the loop: the window in which a change
// note's reading is set aside.
type actHookInventory struct {
	*watchingInventory
	afterAct func()
	looked   chan string
}

func (a *actHookInventory) IdleAct(ctx context.Context, t Target, act idlepolicy.Action, since, readAt time.Time) error {
	err := a.watchingInventory.IdleAct(ctx, t, act, since, readAt)
	if err == nil && a.afterAct != nil {
		a.afterAct()
	}
	return err
}

func (a *actHookInventory) IdleTarget(ctx context.Context, name string) (Target, bool, error) {
	t, ok, err := a.watchingInventory.IdleTarget(ctx, name)
	select {
	case a.looked <- name:
	default:
	}
	return t, ok, err
}

// A target woken by someone else while the loop's own pause of it was
// still being answered: the change note's reading comes before the pause's
// result and is set aside, and no other note follows. The loop reads the
// target again once the pause is in, sees it running and pauses it again;
// before, it took the target for paused until the next full listing.
func TestAWakeNotedWhileTheLoopActsIsNotLost(t *testing.T) {
	h := newHarness(t)
	w := &actHookInventory{
		watchingInventory: &watchingInventory{fakeInventory: h.inv, changes: make(chan string, 8)},
		looked:            make(chan string, 8),
	}
	d := h.fleet.Add("t")
	d.SetIdleSince(time.Now())
	h.inv.add(Target{Name: "t", Power: controller.PowerRunning, Policy: policy(300, 0, 0), Stages: containerStages})
	var woke time.Time
	var once sync.Once
	w.afterAct = func() {
		once.Do(func() {
			d.SetMode(idletest.Normal)
			d.SetIdleSince(time.Now())
			woke = time.Now()
			h.inv.set("t", func(t *Target) { t.Power, t.IdleSince = controller.PowerRunning, time.Time{} })
			w.changes <- "t"
			select {
			case <-w.looked: // read while the loop still acts
			case <-time.After(5 * time.Second):
				t.Error("the change note was not read within 5 s")
			}
		})
	}
	h.run(func(c *Config) {
		c.Inventory = w
		c.RefreshInterval = time.Hour // only the change notes can reveal anything
	})
	eventually(t, "paused again after the wake", func() bool { return len(h.inv.actions()) == 2 })
	if a := h.inv.actions()[1]; a.action != idlepolicy.ActionPause || a.at.Sub(woke) < 300*time.Millisecond {
		t.Fatalf("second action %s %v after the wake", a.action, a.at.Sub(woke))
	}
}

// The ceiling is from answer to answer: after an answer the next probe is
// due two gaps before the ceiling at the latest, since the loop may start
// it a gap after it is due (its timer) and the answer needs the other gap.
// A probe timed to a threshold is due at the threshold, never before.
func TestAProbeAtTheCeilingIsDueTwoGapsBeforeIt(t *testing.T) {
	const ceiling = 10 * time.Second
	l := New(Config{MaxInterval: ceiling})
	if l.gap != timerGap {
		t.Fatalf("gap %v at a %v ceiling, want %v", l.gap, ceiling, timerGap)
	}
	answer := func(idleMs uint64, p *idlepolicy.Policy) (*entry, time.Time) {
		e := &entry{index: -1, t: Target{Name: "t", Power: controller.PowerRunning, Settled: true, Policy: p, Stages: containerStages}}
		l.entries["t"] = e
		e.probing, l.probing = true, 1
		at := time.Now()
		l.onProbe(probeResult{e: e, at: at, outcome: OutcomeOK, idle: envd.Idle{IdleForMs: idleMs}})
		return e, at
	}
	for range 200 {
		e, at := answer(0, policy(0, 0, 3_600_000))
		if latest := at.Add(ceiling - 2*l.gap); e.due.After(latest) {
			t.Fatalf("due %v after the answer: past the ceiling less two gaps (%v)", e.due.Sub(at), ceiling-2*l.gap)
		}
		if earliest := at.Add(ceiling*9/10 - 2*l.gap); e.due.Before(earliest) {
			t.Fatalf("due %v after the answer: before the ceiling's last tenth", e.due.Sub(at))
		}
		l.unschedule(e)
	}
	// Idle for 1 s of a 2 s pause: the threshold comes before the ceiling.
	e, at := answer(1000, policy(2000, 0, 0))
	if want := at.Add(time.Second + thresholdSlack); !e.due.Equal(want) {
		t.Fatalf("threshold probe due %v after the answer, want %v: earlier would find the target not yet idle enough", e.due.Sub(at), want.Sub(at))
	}
	l.unschedule(e)

	// fire takes a probe that is due, not one due a moment later.
	now := time.Now()
	due := &entry{index: -1, t: Target{Name: "due", Power: controller.PowerRunning, Settled: true}}
	later := &entry{index: -1, t: Target{Name: "later", Power: controller.PowerRunning, Settled: true}}
	l.scheduleAt(due, now.Add(minDelay))
	l.scheduleAt(later, now.Add(minDelay+time.Millisecond))
	l.fire(now.Add(minDelay + time.Millisecond/2))
	if len(l.ready) != 1 || l.ready[0] != due {
		t.Fatalf("fired %d, want only the probe that is due", len(l.ready))
	}
}

// A short ceiling gets a gap to match, so that probes are not due at once.
func TestAShortCeilingHasAShortGap(t *testing.T) {
	if l := New(Config{MaxInterval: 200 * time.Millisecond}); l.gap != 10*time.Millisecond {
		t.Fatalf("gap %v at a 200 ms ceiling, want 10 ms", l.gap)
	}
}
