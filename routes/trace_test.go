package routes

import (
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// traceRig is a handler rig whose wake's trace hook collects every trace.
type traceRig struct {
	*rig
	traces chan wake.Trace
}

func newTraceRig(t *testing.T, mutate func(*Options)) *traceRig {
	t.Helper()
	traces := make(chan wake.Trace, 16)
	r := newWakeRig(t, func(tr wake.Trace) { traces <- tr }, mutate)
	return &traceRig{rig: r, traces: traces}
}

// one waits for the next trace and checks that no second one follows.
func (r *traceRig) one(t *testing.T) wake.Trace {
	t.Helper()
	var tr wake.Trace
	select {
	case tr = <-r.traces:
	case <-time.After(10 * time.Second):
		t.Fatal("no wake trace")
	}
	select {
	case again := <-r.traces:
		t.Fatalf("a second trace for one flight: %+v", again)
	case <-time.After(100 * time.Millisecond):
	}
	return tr
}

// checkOrder checks that the trace's times follow the wake's course.
func checkOrder(t *testing.T, tr wake.Trace) {
	t.Helper()
	steps := []struct {
		name string
		at   time.Time
	}{
		{"arrived", tr.Arrived}, {"flying", tr.Flying}, {"incus start", tr.IncusStart}, {"answered", tr.Answered},
		{"settled", tr.Settled}, {"guest dial", tr.GuestDialStart}, {"guest dialled", tr.GuestDialed},
		{"guest upgraded", tr.GuestUpgraded}, {"upgraded", tr.Upgraded},
	}
	for i := 1; i < len(steps); i++ {
		if steps[i].at.Before(steps[i-1].at) {
			t.Fatalf("%s (%s) before %s (%s)", steps[i].name, steps[i].at, steps[i-1].name, steps[i-1].at)
		}
	}
	if len(tr.Probes) == 0 || !tr.Probes[len(tr.Probes)-1].Answered || !tr.Probes[len(tr.Probes)-1].End.Equal(tr.Answered) {
		t.Fatalf("probes %+v, answered %s", tr.Probes, tr.Answered)
	}
	for _, p := range tr.Probes[:len(tr.Probes)-1] {
		if p.Answered {
			t.Fatalf("an answered probe before the last: %+v", tr.Probes)
		}
	}
}

// checkSum checks that the breakdown adds up, with no negative share.
// How small the provider's share is, is wakebench's to measure: a bound
// here would be one on this machine's load.
func checkSum(t *testing.T, tr wake.Trace, dial dialTimes) wake.Breakdown {
	t.Helper()
	b, ok := tr.Breakdown()
	if !ok {
		t.Fatalf("no breakdown of %+v", tr)
	}
	if b.Incus+b.Daemon+b.Provider != b.Total || b.Total != tr.Upgraded.Sub(tr.Arrived) {
		t.Fatalf("the breakdown does not add up: %+v", b)
	}
	// The trace lies inside the dial seen from outside: it cannot begin
	// before the client dialled, and it ends (the upgrade written, stamped
	// before the relay starts) before the daemon's answer came back through
	// the relay. (Not before the client read the 101: the server stamps
	// after its write, and a starved machine has shown the client reading
	// first.)
	if tr.Arrived.Before(dial.sent) || tr.Upgraded.After(dial.relayed) {
		t.Fatalf("the trace (%s to %s) is not inside the dial seen from outside (%s to %s)", tr.Arrived, tr.Upgraded, dial.sent, dial.relayed)
	}
	if b.Incus < 0 || b.Daemon < 0 || b.Provider < 0 {
		t.Fatalf("breakdown %+v", b)
	}
	return b
}

// dialTimes are the client's instants of one dial: sent as it began, and
// relayed once the daemon's answer to initialize came back through the
// relay.
type dialTimes struct{ sent, relayed time.Time }

func dialTimed(t *testing.T, r *rig) dialTimes {
	t.Helper()
	sent := time.Now()
	ws, resp, err := r.dial(ownRoute, nil)
	if err != nil {
		t.Fatalf("%v %v", err, resp)
	}
	initialize(t, ws)
	relayed := time.Now()
	_ = ws.Close()
	return dialTimes{sent: sent, relayed: relayed}
}

func TestWakeTraceFromPaused(t *testing.T) {
	r := newTraceRig(t, nil)
	const unfreeze = 60 * time.Millisecond
	r.targets.set(targets.RoutePaused)
	r.targets.wakeDelay = unfreeze
	r.guest.freeze()
	took := dialTimed(t, r.rig)
	tr := r.one(t)
	checkOrder(t, tr)
	b := checkSum(t, tr, took)
	if tr.From != "paused" || tr.Wakes != 1 || tr.Instance != testInstance {
		t.Fatalf("trace %+v", tr)
	}
	// The thawed guest answers the probe that waited on it while the wake
	// ran: that wait is Incus's time, and the daemon is left what came
	// after the call (on a loaded machine, the answer's way back) and its
	// relay dial. Checked on the trace's own times, not on bounds of the
	// machine's load.
	if b.Incus < unfreeze || b.Incus != tr.IncusEnd.Sub(tr.IncusStart) {
		t.Fatalf("incus %s (call %s to %s) for an unfreeze of %s", b.Incus, tr.IncusStart, tr.IncusEnd, unfreeze)
	}
	answered := tr.Probes[len(tr.Probes)-1]
	if !answered.Start.Before(tr.IncusEnd) {
		t.Fatalf("the answered probe started at %s, after the wake's call ended (%s): it did not wait on the frozen guest", answered.Start, tr.IncusEnd)
	}
	relay := tr.GuestUpgraded.Sub(tr.GuestDialStart)
	if want := max(0, tr.Answered.Sub(tr.IncusEnd)) + relay; b.Daemon != want {
		t.Fatalf("daemon %s, want the time from the call's end to the answer and the relay dial, %s", b.Daemon, want)
	}
}

// The relay waits for the wake's record of the use's request, made after
// the action, even when the thawed daemon answered first: that wait is
// Incus's (Record), not the provider's.
func TestWakeTraceCountsTheRecordAsIncus(t *testing.T) {
	r := newTraceRig(t, nil)
	const unfreeze, record = 20 * time.Millisecond, 60 * time.Millisecond
	r.targets.set(targets.RoutePaused)
	r.targets.wakeDelay = unfreeze
	r.targets.recordDelay = record
	r.guest.freeze()
	took := dialTimed(t, r.rig)
	tr := r.one(t)
	checkOrder(t, tr)
	b := checkSum(t, tr, took)
	// The whole call is Incus's, however late the daemon answered; the
	// part after its answer is the record's wait (wake's own test divides
	// traces of every shape).
	if tr.IncusEnd.IsZero() || b.Incus != tr.IncusEnd.Sub(tr.IncusStart) || b.Incus < unfreeze+record {
		t.Fatalf("incus %s (call %s to %s) for an unfreeze of %s and a record of %s", b.Incus, tr.IncusStart, tr.IncusEnd, unfreeze, record)
	}
	if b.Record != max(0, tr.IncusEnd.Sub(tr.Answered)) {
		t.Fatalf("record %s, the call ended %s after the answer", b.Record, tr.IncusEnd.Sub(tr.Answered))
	}
}

func TestWakeTraceFromStopped(t *testing.T) {
	r := newTraceRig(t, nil)
	const start, boot = 50 * time.Millisecond, 120 * time.Millisecond
	r.targets.set(targets.RouteStopped)
	r.targets.wakeDelay = start
	r.guest.mu.Lock()
	r.guest.stopped = true
	r.guest.mu.Unlock()
	// The daemon listens only some time after Incus has started the guest.
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	r.targets.onWake = func(string) {
		wg.Go(func() {
			time.Sleep(boot)
			r.guest.thaw()
		})
	}
	took := dialTimed(t, r.rig)
	tr := r.one(t)
	checkOrder(t, tr)
	b := checkSum(t, tr, took)
	if tr.From != "stopped" || tr.IncusEnd.IsZero() || len(tr.Probes) < 2 {
		t.Fatalf("trace %+v", tr)
	}
	if !tr.Probes[0].Start.After(tr.IncusEnd) {
		t.Fatal("a stopped target was probed before Incus had started it")
	}
	if b.Incus < start || b.Incus != tr.IncusEnd.Sub(tr.IncusStart) {
		t.Fatalf("incus %s (call %s to %s) for a start of %s", b.Incus, tr.IncusStart, tr.IncusEnd, start)
	}
	// The boot is the daemon's, polling included: from the first probe
	// (after the start, above) to the answer, and the relay dial.
	relay := tr.GuestUpgraded.Sub(tr.GuestDialStart)
	if want := tr.Answered.Sub(tr.Probes[0].Start) + relay; b.Daemon < boot || b.Daemon != want {
		t.Fatalf("daemon %s for a boot of %s, want %s", b.Daemon, boot, want)
	}
	if gap := tr.PollGap(); gap <= 0 {
		t.Fatalf("poll gap %s", gap)
	}
}

// A dial that stops waiting leaves the trace to the flight, which reports
// it without the relay's part once the daemon answers; concurrent dials
// that joined the flight report nothing of their own.
func TestWakeTraceOfAFlightOutlivingItsDial(t *testing.T) {
	r := newTraceRig(t, func(o *Options) { o.Hold = 4 * holdMargin })
	r.targets.set(targets.RoutePaused)
	r.targets.wakeDelay = 800 * time.Millisecond
	r.guest.freeze()
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if _, _, err := r.dial(ownRoute, nil); err == nil {
				t.Error("a dial was upgraded within a hold shorter than the wake")
			}
		})
	}
	wg.Wait()
	tr := r.one(t)
	if _, ok := tr.Breakdown(); ok || !tr.Upgraded.IsZero() || !tr.GuestDialStart.IsZero() {
		t.Fatalf("a trace with a relay for a refused dial: %+v", tr)
	}
	if tr.Answered.IsZero() || tr.Settled.Before(tr.Answered) {
		t.Fatalf("trace %+v", tr)
	}
}

// A target already running and proved ready makes no flight, so no trace.
func TestWakeTraceNoneWithoutAFlight(t *testing.T) {
	r := newTraceRig(t, nil)
	dialTimed(t, r.rig) // proves the daemon: this one flies (a probe only)
	tr := r.one(t)
	if !tr.IncusStart.IsZero() || tr.From != "running" {
		t.Fatalf("a probe-only flight: %+v", tr)
	}
	if b, ok := tr.Breakdown(); !ok || b.Incus != 0 || b.Incus+b.Daemon+b.Provider != b.Total {
		t.Fatalf("breakdown %+v", b)
	}
	dialTimed(t, r.rig)
	select {
	case tr := <-r.traces:
		t.Fatalf("a trace without a flight: %+v", tr)
	case <-time.After(100 * time.Millisecond):
	}
}
