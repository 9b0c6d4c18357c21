package wake

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// Targets is what the wake asks of the targets: *targets.Service.
type Targets interface {
	// ResolveRoute reads the target again while a flight waits on it
	// (see targets.Service.ResolveRoute).
	ResolveRoute(ctx context.Context, owner controller.Owner, targetID string) (targets.Route, error)
	// Wake unfreezes a paused target or starts a stopped or suspended one
	// at once, and records the use's request for running, made at its
	// arrival, right after (see targets.Service.Wake). relayable, when
	// not nil, is called once the use may be relayed before that record
	// lands; otherwise it waits for Wake to answer.
	Wake(ctx context.Context, r targets.Route, at time.Time, relayable func()) (controller.Power, error)
	// PowerDownPending says a power-down asked before at, recorded or
	// kept until Incus takes it, is not carried out yet: a use made at
	// at replaces it through Wake.
	PowerDownPending(r targets.Route, at time.Time) bool
	// RestartDaemonDevice has the device the dialer reaches the daemon
	// through stopped and started, on an instance that runs (see
	// targets.Service.RestartDaemonDevice).
	RestartDaemonDevice(ctx context.Context, name string) error
}

var _ Targets = (*targets.Service)(nil)

// Elsewhere hands a target's wake to the replica that wakes it, when that
// is another replica (provider: the replicas of a cluster that forward to
// each other), so that a target is woken once however many replicas its
// uses arrive at.
type Elsewhere interface {
	// Wake has the replica that wakes r wake it, sharing that replica's
	// one flight for r, and returns what the flight settled on, or stood
	// at when ctx ended: nil when the daemon answered. handled is false
	// when this replica wakes r itself: it is the one, or the other gave
	// no answer.
	Wake(ctx context.Context, r targets.Route, arrived time.Time) (ref *Refusal, handled bool)
}

// Options configure the wake. Zero values take the defaults.
type Options struct {
	Targets Targets
	// Dialer reaches the daemons the readiness probe proves.
	Dialer guest.Dialer
	// Relays is the process's relay registry: a flight counts in it as a
	// dial in progress, so no power-down starts under a wake.
	Relays  *relays.Registry
	Metrics *Metrics
	Log     *zap.Logger
	// Budget bounds a wake and its readiness probe, which go on after
	// the uses that asked for them were answered (default 30 s).
	Budget time.Duration
	// ClientInfo is what the readiness probe's initialize says of the
	// provider (default: incus-provider and its build).
	ClientInfo envd.ClientInfo
	// Elsewhere, when set, is asked first to have another replica wake
	// a powered-down target; nil: every wake is this replica's.
	Elsewhere Elsewhere
	// Trace, when set, is given the trace of every flight that ends with
	// the daemon answering (see Trace), on the goroutine of the dial that
	// started it (Report) or of the flight: it must return quickly. The
	// trace is the hook's to keep. Nil records nothing.
	Trace func(Trace)
}

// Waker is the one wake of each target, shared by every use of it.
type Waker struct {
	opts    Options
	ctx     context.Context
	log     *zap.Logger
	metrics *Metrics
	reg     *relays.Registry
	ready   *readiness

	mu      sync.Mutex
	flights map[string]*Flight
	// landed is, per target, the last flight that settled with its daemon
	// answering, and when, until a power change or the target's end.
	landed map[string]landing
}

// landing is a flight that settled with the daemon answering, at at.
type landing struct {
	f  *Flight
	at time.Time
}

// New checks the options and builds the wake. ctx bounds every flight: when
// it ends, the flights under way settle.
func New(ctx context.Context, opts Options) (*Waker, error) {
	if opts.Targets == nil || opts.Dialer == nil || opts.Relays == nil {
		return nil, errors.New("wake: Targets, Dialer and Relays are required")
	}
	if opts.Budget <= 0 {
		opts.Budget = 30 * time.Second
	}
	if opts.ClientInfo.Name == "" {
		opts.ClientInfo = buildinfo.Describe("incus-provider")
	}
	if opts.Log == nil {
		opts.Log = zap.NewNop()
	}
	w := &Waker{opts: opts, ctx: ctx, log: opts.Log, metrics: opts.Metrics, reg: opts.Relays, ready: newReadiness(),
		flights: map[string]*Flight{}, landed: map[string]landing{}}
	w.reg.OnPowerChange(func(name string) {
		w.ready.forget(name)
		w.forgetLanding(name)
	})
	return w, nil
}

// Join joins the target's flight, or starts it (started). byDial: the
// caller is a data-route dial that reports the trace of a flight it starts
// (see Flight.GiveUpTrace).
func (w *Waker) Join(r targets.Route, arrived time.Time, byDial bool) (f *Flight, started bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if f := w.flights[r.Name]; f != nil {
		return f, false
	}
	if l, ok := w.landed[r.Name]; ok && !running(r) && l.at.After(arrived) {
		// The use arrived before the last flight settled, and read the
		// target powered down: a read older than that flight's wake (CI:
		// one of 50 dials read its target paused, joined 66 ms after the
		// flight it came with had settled, and flew a second wake). That
		// flight's answer is this use's too.
		return l.f, false
	}
	f = &Flight{name: r.Name, settled: make(chan struct{}), state: StateWaking, retry: time.Second, requested: arrived}
	if running(r) {
		f.state = StateBooting
	}
	if w.opts.Trace != nil {
		f.trace = &Trace{Instance: r.Name, From: powerLabel(r), Arrived: arrived}
		f.traceByDial = byDial
	}
	w.flights[r.Name] = f
	go w.fly(f, r)
	return f, true
}

// WakeForUse is a use of the target that is not a data-route dial (a public
// ingress request): it joins the target's one wake, the same flight the
// dials wait on, starting it when none is under way, and waits for it
// within ctx. nil means the daemon answers; otherwise what a dial refused
// now would be told.
func (w *Waker) WakeForUse(ctx context.Context, r targets.Route, arrived time.Time) *Refusal {
	f, _ := w.Join(r, arrived, false)
	select {
	case <-f.settled:
		return f.result
	case <-ctx.Done():
		return f.RefusalNow()
	}
}

// Report hands a finished trace to Options.Trace; nil is none to report.
func (w *Waker) Report(tr *Trace) {
	if tr != nil {
		w.opts.Trace(*tr)
	}
}

// Ready says a flight proved the target's daemon answers since the last
// power change this process made or saw: a use may reach it at once.
func (w *Waker) Ready(name string) bool { return w.ready.ok(name) }

// Unready forgets that the daemon was proved ready: a use found it silent,
// and the next one probes it again.
func (w *Waker) Unready(name string) { w.ready.forget(name) }

// Gone forgets everything known of a target that is gone.
func (w *Waker) Gone(name string) {
	w.ready.drop(name)
	w.forgetLanding(name)
}

func (w *Waker) forgetLanding(name string) {
	w.mu.Lock()
	delete(w.landed, name)
	w.mu.Unlock()
}

// Seen records whether a use last found the target powered down.
func (w *Waker) Seen(name string, poweredDown bool) { w.ready.seen(name, poweredDown) }

// LastDown says a use last found the target powered down: what a use that
// cannot read it now is told is likelier waking than booting.
func (w *Waker) LastDown(name string) bool { return w.ready.lastDown(name) }

// running says whether Incus shows the target's processes running (not
// frozen, not in a transition).
func running(r targets.Route) bool { return r.State == targets.RouteRunning }

// settle publishes the flight's result and lets later uses start afresh.
func (w *Waker) settle(f *Flight, result *Refusal) {
	w.mu.Lock()
	if w.flights[f.name] == f {
		delete(w.flights, f.name)
	}
	if result == nil {
		w.landed[f.name] = landing{f: f, at: time.Now()}
	} else {
		delete(w.landed, f.name)
	}
	w.mu.Unlock()
	if f.tk != nil {
		f.tk.Leave()
	}
	f.result = result
	var report *Trace
	if tr := f.trace; tr != nil {
		tr.Settled = time.Now()
		f.mu.Lock()
		f.over = true
		if !f.traceByDial && result == nil {
			report = tr
		}
		f.mu.Unlock()
	}
	close(f.settled)
	w.Report(report)
}

// powerLabel is the wake histogram's "from" label.
func powerLabel(r targets.Route) string {
	if r.Observation.Phase != controller.PhaseActive {
		return string(r.Observation.Phase)
	}
	if running(r) {
		return string(controller.PowerRunning)
	}
	return string(r.Observation.Power)
}

// fly drives one target until its daemon answers, or the wake budget runs
// out, or the target turns out to be gone or failed. It counts as a dial in
// progress all along, so no power-down starts under it.
func (w *Waker) fly(f *Flight, r targets.Route) {
	ctx, cancel := context.WithTimeout(w.ctx, w.opts.Budget)
	defer cancel()
	started := time.Now()
	var tk *relays.Ticket
	for tk == nil {
		var quiet <-chan struct{}
		if tk, quiet = w.reg.Enter(r.Name, f.requested); tk == nil {
			select {
			case <-quiet:
			case <-ctx.Done():
				w.settle(f, refuse(StateWaking, 2*time.Second))
				return
			}
			var ok bool
			if r, ok = w.reread(ctx, f, r); !ok {
				return
			}
		}
	}
	f.tk = tk
	defer tk.Leave()
	tr := f.trace
	if tr != nil {
		tr.Flying = time.Now()
	}
	from := powerLabel(r)
	outcome := outcomeGaveUp
	// The wake is observed before the flight settles, so whoever the
	// settling lets through (a held dial, a test) finds it counted.
	observed := false
	observe := func() {
		if !observed {
			observed = true
			took := time.Since(started)
			w.metrics.wake(from, outcome, took)
			w.log.Debug("a wake settled", zap.String("instance", r.Name), zap.String("from", from),
				zap.String("outcome", outcome), zap.Duration("after", took))
		}
	}
	defer observe()
	settle := func(ref *Refusal) {
		observe()
		w.settle(f, ref)
	}

	wakes := 0
	for {
		if ctx.Err() != nil {
			if w.ctx.Err() != nil {
				outcome = outcomeCancelled
			}
			settle(f.RefusalNow())
			return
		}
		if ref := Terminal(r.Observation); ref != nil {
			w.ready.drop(r.Name)
			outcome = outcomeFailed
			settle(ref)
			return
		}
		wakeable := r.Observation.Phase == controller.PhaseActive &&
			(r.State == targets.RoutePaused || r.State == targets.RouteStopped)
		switch {
		case running(r) && w.opts.Targets.PowerDownPending(r, f.requested):
			// Running, with a power-down asked and not yet carried out
			// (recorded on the instance, or kept until Incus takes it): the
			// use's request for running replaces it, unless it came later.
			var wakeStart time.Time
			if tr != nil {
				wakeStart = time.Now()
			}
			_, err := w.opts.Targets.Wake(ctx, r, f.requested, nil)
			if tr != nil {
				tr.wakeCall(wakeStart, time.Now())
			}
			if err != nil {
				if errors.Is(err, targets.ErrSuperseded) {
					outcome = outcomeSuperseded
					settle(refuse(StateWaking, time.Second))
					return
				}
				if ctx.Err() == nil {
					w.wakeFailed("recording a dial's request for running failed", r.Name, err)
				}
				clock.Sleep(ctx, 50*time.Millisecond)
			}

		case running(r):
			f.stage(StateBooting, w.bootingRetry(r.Name))
			if a := w.probeUntil(ctx, f, r); a != probeSilent {
				outcome = a.outcome()
				w.ready.mark(r.Name)
				settle(nil)
				return
			}
			f.stage(StateBooting, w.bootingRetry(r.Name))
			continue // the budget ran out; the top of the loop settles

		case wakeable && wakes < 3:
			wakes++
			f.stage(StateWaking, time.Second)
			if ref, handled := w.wakeElsewhere(ctx, f, r); handled {
				outcome = outcomeElsewhere
				switch {
				case ref == nil:
					w.ready.mark(r.Name)
				case ref.State == StateGone || ref.State == StateFailed:
					w.ready.drop(r.Name)
					outcome = outcomeFailed
				default:
					outcome = outcomeGaveUp
				}
				settle(ref)
				return
			}
			if a := w.wakeAndProbe(ctx, f, r); a != probeSilent {
				outcome = a.outcome()
				w.ready.mark(r.Name)
				settle(nil)
				return
			}
			if f.superseded {
				outcome = outcomeSuperseded
				settle(refuse(StateWaking, time.Second))
				return
			}

		default:
			// In a transition Incus finishes on its own (freezing,
			// stopping, starting), or still being provisioned: look again
			// shortly.
			if r.Observation.Phase == controller.PhaseActive && !running(r) {
				f.stage(StateWaking, time.Second)
			} else {
				f.stage(StateBooting, 2*time.Second)
			}
			if !clock.Sleep(ctx, 50*time.Millisecond) {
				continue
			}
		}
		var ok bool
		if r, ok = w.reread(ctx, f, r); !ok {
			if ctx.Err() == nil {
				outcome = outcomeFailed
			}
			return
		}
	}
}

// reread reads the target of r again; false once the flight has been
// settled (the target is gone or another owner's) or its budget ran out.
func (w *Waker) reread(ctx context.Context, f *Flight, r targets.Route) (targets.Route, bool) {
	for {
		fresh, err := w.opts.Targets.ResolveRoute(ctx, r.Owner, r.Name)
		if err == nil {
			return fresh, true
		}
		if errors.Is(err, targets.ErrRouteGone) || errors.Is(err, targets.ErrRouteOwner) {
			w.ready.drop(r.Name)
			w.settle(f, refuse(StateGone, 0))
			return targets.Route{}, false
		}
		if !clock.Sleep(ctx, 100*time.Millisecond) {
			w.settle(f, f.RefusalNow())
			return targets.Route{}, false
		}
	}
}

// wakeElsewhere has the replica that wakes r wake it, when that is
// another one (Options.Elsewhere); handled is false when this replica is
// to wake it.
func (w *Waker) wakeElsewhere(ctx context.Context, f *Flight, r targets.Route) (ref *Refusal, handled bool) {
	if w.opts.Elsewhere == nil {
		return nil, false
	}
	tr := f.trace
	var start time.Time
	if tr != nil {
		start = time.Now()
	}
	ref, handled = w.opts.Elsewhere.Wake(ctx, r, f.requested)
	if tr != nil && handled {
		tr.wakeCall(start, time.Now())
	}
	return ref, handled
}

// wakeAndProbe asks Incus to wake the instance and probes its daemon at
// the same time: a frozen guest answers the probe the moment it thaws,
// before Incus has reported the unfreeze, and a started one as soon as its
// daemon listens. It reports what the daemon answered, if anything.
func (w *Waker) wakeAndProbe(ctx context.Context, f *Flight, r targets.Route) probeAnswer {
	// The wake has its own bound: Incus carries it out whatever happens to
	// the uses.
	wakeDone := make(chan struct{})
	var wakeErr error
	// The wake counts as a dial in progress until Incus is done with its
	// action, so that no power-down interleaves with it; the record of
	// the use's request that follows holds the instance's turn, which
	// every power-down waits for (targets.Service.Wake). The flight's own
	// ticket keeps the instance from being quiesced, so this one is
	// granted.
	wtk := f.tk.Join()
	tr := f.trace
	// wakeEnd is the wake goroutine's until wakeDone is closed.
	var wakeStart, wakeEnd time.Time
	if tr != nil {
		wakeStart = time.Now()
	}
	// relayable is closed once the use may be relayed before Wake's
	// record lands (see Targets.Wake); the record goes on, holding wtk, so
	// that no power-down starts before it.
	relayable := make(chan struct{})
	var relayableOnce sync.Once
	go func() {
		defer close(wakeDone)
		defer wtk.Leave()
		wctx, cancel := context.WithTimeout(w.ctx, 2*time.Minute)
		defer cancel()
		_, wakeErr = w.opts.Targets.Wake(wctx, r, f.requested, func() { relayableOnce.Do(func() { close(relayable) }) })
		if tr != nil {
			wakeEnd = time.Now()
		}
	}()
	if tr != nil {
		// Read once this returns: by then the probe's goroutine is done,
		// and the wake's end is known only when the wake is.
		defer func() {
			select {
			case <-wakeDone:
				tr.wakeCall(wakeStart, wakeEnd)
			default:
				tr.wakeCall(wakeStart, time.Time{})
			}
		}()
	}
	pctx, cancelProbe := context.WithCancel(ctx)
	defer cancelProbe()
	probed := make(chan probeAnswer, 1)
	paused := r.State == targets.RoutePaused
	go func() {
		if !paused {
			// A stopped instance has no daemon (nor even an init process)
			// until Incus has started it; start probing when it has.
			select {
			case <-wakeDone:
				if wakeErr != nil {
					probed <- probeSilent
					return
				}
			case <-pctx.Done():
				probed <- probeSilent
				return
			}
		}
		probed <- w.probeUntil(pctx, f, r)
	}()
	// failed settles what a failed Wake means for the flight: superseded
	// by a newer request, or a failure worth a log line.
	failed := func() bool {
		if wakeErr == nil {
			return false
		}
		if errors.Is(wakeErr, targets.ErrSuperseded) {
			f.superseded = true
		} else if ctx.Err() == nil {
			w.wakeFailed("waking a target failed", r.Name, wakeErr)
		}
		return true
	}
	done := wakeDone
	for {
		select {
		case a := <-probed:
			if done == nil || a == probeSilent {
				return a
			}
			// The daemon answered before Wake did (a thawed guest answers
			// at once): the use's request for running is not recorded
			// yet, and a dial relayed now would be lost with it, should
			// the process die before the record lands, unless Incus
			// itself shows the use meanwhile (relayable).
			select {
			case <-done:
			case <-relayable:
				return a
			case <-ctx.Done():
				return probeSilent
			}
			if failed() {
				return probeSilent
			}
			return a
		case <-done:
			done = nil
			if failed() {
				cancelProbe()
				<-probed
				return probeSilent
			}
			f.stage(StateBooting, time.Second) // the probe goes on
		}
	}
}
