package routes

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// readiness remembers the running instances whose daemon answered a
// data-plane initialize, so that their dials cost no extra round trip. It
// is forgotten on every power change the provider makes or sees, and when a
// dial finds the daemon silent.
type readiness struct {
	mu      sync.Mutex
	ready   map[string]struct{}
	unready map[string]time.Time // since when a probe of the instance has gone unanswered
	// down holds the instances last seen powered down, so that a dial
	// Incus cannot answer for is told the likelier truth (waking).
	down map[string]struct{}
	// odd holds, per instance, the last answer to initialize that was not
	// a compatible success, as already logged: it outlives power changes so
	// that a daemon of another version is logged once, not once per wake.
	odd map[string]string
}

func newReadiness() *readiness {
	return &readiness{ready: map[string]struct{}{}, unready: map[string]time.Time{}, down: map[string]struct{}{}, odd: map[string]string{}}
}

// oddAnswer records an incompatible answer of the instance's daemon and
// says whether it differs from the one recorded last (and so is news).
func (r *readiness) oddAnswer(instance, answer string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.odd[instance] == answer {
		return false
	}
	r.odd[instance] = answer
	return true
}

// compatible records that the instance's daemon answered a compatible
// success, so that a later incompatible answer is news again.
func (r *readiness) compatible(instance string) {
	r.mu.Lock()
	delete(r.odd, instance)
	r.mu.Unlock()
}

// seen records whether the instance was last seen powered down.
func (r *readiness) seen(instance string, poweredDown bool) {
	r.mu.Lock()
	if poweredDown {
		r.down[instance] = struct{}{}
	} else {
		delete(r.down, instance)
	}
	r.mu.Unlock()
}

func (r *readiness) lastDown(instance string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.down[instance]
	return ok
}

func (r *readiness) ok(instance string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.ready[instance]
	return ok
}

func (r *readiness) mark(instance string) {
	r.mu.Lock()
	r.ready[instance] = struct{}{}
	delete(r.unready, instance)
	r.mu.Unlock()
}

func (r *readiness) forget(instance string) {
	r.mu.Lock()
	delete(r.ready, instance)
	r.mu.Unlock()
}

// silent records a probe that found no answer and says for how long the
// daemon has been silent.
func (r *readiness) silent(instance string, now time.Time) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	since, ok := r.unready[instance]
	if !ok {
		r.unready[instance] = now
		return 0
	}
	return now.Sub(since)
}

func (r *readiness) silentSince(instance string) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	since, ok := r.unready[instance]
	return since, ok
}

// drop forgets everything about an instance that is gone.
func (r *readiness) drop(instance string) {
	r.mu.Lock()
	delete(r.ready, instance)
	delete(r.unready, instance)
	delete(r.down, instance)
	delete(r.odd, instance)
	r.mu.Unlock()
}

// flight is the one wake (and readiness probe) of a target that every
// concurrent dial of it waits on.
type flight struct {
	name string
	tk   *relays.Ticket // the flight counts as a dial in progress until it settles
	// requested is when the dial that started the flight arrived: its
	// request for running is that old, whatever dials join it later.
	requested time.Time
	// superseded: a power change asked after the dial replaced its wake.
	superseded bool
	settled    chan struct{} // closed once result is set
	result     *Refusal      // nil: the daemon answered

	// trace is the flight's wake trace, nil without Options.WakeTrace:
	// fly writes it until the flight settles, then one reporter has it.
	trace *WakeTrace

	mu    sync.Mutex
	state State         // what a dial refused now is told
	retry time.Duration // and when to come back
	// traceByDial: the dial that started the flight reports the trace,
	// with its relay's times; the flight does when no dial waits for it.
	traceByDial bool
	over        bool // settled
}

func (f *flight) stage(s State, retry time.Duration) {
	f.mu.Lock()
	f.state, f.retry = s, retry
	f.mu.Unlock()
}

// refusalNow is the answer for a dial whose hold ran out while the flight
// goes on.
func (f *flight) refusalNow() *Refusal {
	f.mu.Lock()
	defer f.mu.Unlock()
	return &Refusal{State: f.state, RetryAfter: f.retry}
}

// giveUpTrace is called by the dial that started the flight when it stops
// waiting for it: the flight reports its own trace from now on, unless it
// settled meanwhile with the daemon answering, when the trace is the
// caller's to report (returned).
func (f *flight) giveUpTrace() *WakeTrace {
	if f.trace == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.traceByDial {
		return nil
	}
	f.traceByDial = false
	if f.over && f.result == nil {
		return f.trace
	}
	return nil
}

// flightFor joins the target's flight, or starts it (started). byDial: the
// caller is a dial that reports the trace of a flight it starts (see
// giveUpTrace).
func (h *Handler) flightFor(r targets.Route, arrived time.Time, byDial bool) (f *flight, started bool) {
	h.fmu.Lock()
	defer h.fmu.Unlock()
	if f := h.flights[r.Name]; f != nil {
		return f, false
	}
	f = &flight{name: r.Name, settled: make(chan struct{}), state: StateWaking, retry: time.Second, requested: arrived}
	if running(r) {
		f.state = StateBooting
	}
	if h.opts.WakeTrace != nil {
		f.trace = &WakeTrace{Instance: r.Name, From: powerLabel(r), Arrived: arrived}
		f.traceByDial = byDial
	}
	h.flights[r.Name] = f
	go h.fly(f, r)
	return f, true
}

// settle publishes the flight's result and lets later dials start afresh.
func (h *Handler) settle(f *flight, result *Refusal) {
	h.fmu.Lock()
	if h.flights[f.name] == f {
		delete(h.flights, f.name)
	}
	h.fmu.Unlock()
	if f.tk != nil {
		f.tk.Leave()
	}
	f.result = result
	var report *WakeTrace
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
	h.reportTrace(report)
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
func (h *Handler) fly(f *flight, r targets.Route) {
	ctx, cancel := context.WithTimeout(h.ctx, h.opts.WakeBudget)
	defer cancel()
	started := time.Now()
	var tk *relays.Ticket
	for tk == nil {
		var quiet <-chan struct{}
		if tk, quiet = h.reg.Enter(r.Name, f.requested); tk == nil {
			select {
			case <-quiet:
			case <-ctx.Done():
				h.settle(f, refuse(StateWaking, 2*time.Second))
				return
			}
			var ok bool
			if r, ok = h.reread(ctx, f, r); !ok {
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
	outcome := wakeOutcomeGaveUp
	// The wake is observed before the flight settles, so whoever the
	// settling lets through (a held dial, a test) finds it counted.
	observed := false
	observe := func() {
		if !observed {
			observed = true
			h.metrics.wake(from, outcome, time.Since(started))
		}
	}
	defer observe()
	settle := func(ref *Refusal) {
		observe()
		h.settle(f, ref)
	}

	wakes := 0
	for {
		if ctx.Err() != nil {
			if h.ctx.Err() != nil {
				outcome = wakeOutcomeCancelled
			}
			settle(f.refusalNow())
			return
		}
		if ref, _ := terminal(r.Observation); ref != nil {
			h.ready.drop(r.Name)
			outcome = wakeOutcomeFailed
			settle(ref)
			return
		}
		wakeable := r.Observation.Phase == controller.PhaseActive &&
			(r.State == targets.RoutePaused || r.State == targets.RouteStopped)
		switch {
		case running(r) && h.opts.Targets.PowerDownPending(r, f.requested):
			// Running, with a power-down asked and not yet carried out
			// (recorded on the instance, or kept until Incus takes it): the
			// dial's request for running replaces it, unless it came later.
			var wakeStart time.Time
			if tr != nil {
				wakeStart = time.Now()
			}
			_, err := h.opts.Targets.Wake(ctx, r, f.requested)
			if tr != nil {
				tr.wakeCall(wakeStart, time.Now())
			}
			if err != nil {
				if errors.Is(err, targets.ErrSuperseded) {
					outcome = wakeOutcomeSuperseded
					settle(refuse(StateWaking, time.Second))
					return
				}
				if ctx.Err() == nil {
					h.wakeFailed("recording a dial's request for running failed", r.Name, err)
				}
				clock.Sleep(ctx, 50*time.Millisecond)
			}

		case running(r):
			f.stage(StateBooting, h.bootingRetry(r.Name))
			if a := h.probeUntil(ctx, r, tr); a != probeSilent {
				outcome = a.wakeOutcome()
				h.ready.mark(r.Name)
				settle(nil)
				return
			}
			f.stage(StateBooting, h.bootingRetry(r.Name))
			continue // the budget ran out; the top of the loop settles

		case wakeable && wakes < 3:
			wakes++
			f.stage(StateWaking, time.Second)
			if a := h.wakeAndProbe(ctx, f, r); a != probeSilent {
				outcome = a.wakeOutcome()
				h.ready.mark(r.Name)
				settle(nil)
				return
			}
			if f.superseded {
				outcome = wakeOutcomeSuperseded
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
		if r, ok = h.reread(ctx, f, r); !ok {
			if ctx.Err() == nil {
				outcome = wakeOutcomeFailed
			}
			return
		}
	}
}

// reread reads the target of r again; false once the flight has been
// settled (the target is gone or another owner's) or its budget ran out.
func (h *Handler) reread(ctx context.Context, f *flight, r targets.Route) (targets.Route, bool) {
	for {
		fresh, err := h.opts.Targets.ResolveRoute(ctx, r.Owner, r.Name)
		if err == nil {
			return fresh, true
		}
		if errors.Is(err, targets.ErrRouteGone) || errors.Is(err, targets.ErrRouteOwner) {
			h.ready.drop(r.Name)
			h.settle(f, refuse(StateGone, 0))
			return targets.Route{}, false
		}
		if !clock.Sleep(ctx, 100*time.Millisecond) {
			h.settle(f, f.refusalNow())
			return targets.Route{}, false
		}
	}
}

// wakeAndProbe asks Incus to wake the instance and probes its daemon at
// the same time: a frozen guest answers the probe the moment it thaws,
// before Incus has reported the unfreeze, and a started one as soon as its
// daemon listens. It reports what the daemon answered, if anything.
func (h *Handler) wakeAndProbe(ctx context.Context, f *flight, r targets.Route) probeAnswer {
	// The wake has its own bound: Incus carries it out whatever happens to
	// the dials.
	wakeDone := make(chan struct{})
	var wakeErr error
	// The wake counts as a dial in progress until Incus is done with its
	// action, so that no power-down interleaves with it; the record of
	// the dial's request that follows holds the instance's gate, which
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
	go func() {
		defer close(wakeDone)
		defer wtk.Leave()
		wctx, cancel := context.WithTimeout(h.ctx, 2*time.Minute)
		defer cancel()
		_, wakeErr = h.opts.Targets.Wake(wctx, r, f.requested)
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
		probed <- h.probeUntil(pctx, r, tr)
	}()
	done := wakeDone
	for {
		select {
		case a := <-probed:
			return a
		case <-done:
			done = nil
			if wakeErr != nil {
				if errors.Is(wakeErr, targets.ErrSuperseded) {
					f.superseded = true
				} else if ctx.Err() == nil {
					h.wakeFailed("waking a target failed", r.Name, wakeErr)
				}
				cancelProbe()
				<-probed
				return probeSilent
			}
			f.stage(StateBooting, time.Second) // the probe goes on
		}
	}
}

// probeAnswer is what the readiness probe found of a daemon.
type probeAnswer int

const (
	// probeSilent: no answer to initialize yet (see probeUntil).
	probeSilent probeAnswer = iota
	// probeReady: a data-plane initialize success of this version.
	probeReady
	// probeIncompatible: an answer all the same, such as versionMismatch
	// or a result of another plane (an *envd.AnsweredError). The daemon is
	// there; the runtime's own handshake meets the answer and fails the
	// environment if it must, which a refusal as booting would keep it
	// from ever doing.
	probeIncompatible
)

func (a probeAnswer) wakeOutcome() string {
	if a == probeIncompatible {
		return wakeOutcomeIncompatible
	}
	return wakeOutcomeReady
}

// wakeFailed logs a wake's failure, which the flight retries. A busy
// refusal can only come from outside this process (another replica, an
// operator: targets holds one writer per instance) and is routine.
func (h *Handler) wakeFailed(msg, instance string, err error) {
	log := h.log.Warn
	if errors.Is(err, incus.ErrBusy) {
		log = h.log.Info
	}
	log(msg, zap.String("instance", instance), zap.Error(err))
}

// probeUntil proves the daemon answers: a data-plane initialize through the
// GuestDialer, repeated with a short backoff until it is answered or ctx
// ends. A TCP connect alone proves nothing (a frozen guest's kernel accepts
// it), nor does a WebSocket upgrade (a daemon's listener may be up before
// it serves), nor a frame that is no JSON-RPC response to the request
// (something other than a daemon of any version holds the port): these
// keep the target booting, so the runtime is told to come back. An answer
// that is not a compatible success ends the probe like a success.
//
// A trace, when given, gets every attempt; the caller owns it meanwhile.
func (h *Handler) probeUntil(ctx context.Context, r targets.Route, tr *WakeTrace) probeAnswer {
	delay := 5 * time.Millisecond
	for {
		var start time.Time
		if tr != nil {
			start = time.Now()
		}
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := h.probeOnce(actx, r.Daemon)
		cancel()
		var answered *envd.AnsweredError
		isAnswer := err == nil || errors.As(err, &answered)
		if tr != nil {
			tr.probe(start, time.Now(), isAnswer)
		}
		if err == nil {
			h.ready.compatible(r.Name)
			return probeReady
		}
		if answered != nil {
			h.noteIncompatible(r.Name, answered)
			return probeIncompatible
		}
		h.ready.silent(r.Name, time.Now())
		if !clock.Sleep(ctx, delay) {
			if h.ctx.Err() == nil {
				h.log.Debug("the daemon has not answered the readiness probe", zap.String("instance", r.Name), zap.Error(err))
			}
			return probeSilent
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// noteIncompatible logs a daemon's incompatible answer once per instance
// and answer: every wake of the target probes it again, and an operator
// needs to hear of a daemon of another version once, naming both versions.
func (h *Handler) noteIncompatible(instance string, answered *envd.AnsweredError) {
	field, daemon, provider, mismatch := answered.Mismatch()
	var key string
	var rpc *jsonrpc.Error
	switch {
	case mismatch:
		key = field + " " + daemon + " " + provider
	case errors.As(answered, &rpc):
		key = "error " + string(rpc.Kind)
	default:
		key = "result"
	}
	if !h.ready.oddAnswer(instance, key) {
		return
	}
	if mismatch {
		h.log.Warn("the guest daemon answered initialize with another "+field+"; its dials are relayed so that the runtime's handshake fails the environment",
			zap.String("instance", instance), zap.String("daemon", daemon), zap.String("provider", provider), zap.Error(answered))
		return
	}
	h.log.Warn("the guest daemon answered initialize, but not with a data-plane success of this version; its dials are relayed so that the runtime sees the answer",
		zap.String("instance", instance), zap.Error(answered))
}

func (h *Handler) probeOnce(ctx context.Context, t guest.Target) error {
	conn, err := h.opts.Dialer.DialContext(ctx, t)
	if err != nil {
		return err
	}
	sess, err := envd.Handshake(ctx, conn, h.opts.ClientInfo)
	if err != nil {
		return err
	}
	// Closed on this flight's goroutine, which owns it: nothing outlives the probe.
	_ = sess.Close()
	return nil
}

// bootingRetry grows with how long the daemon has been silent: 1 s at
// first, up to 10 s for a daemon that has not answered for minutes.
func (h *Handler) bootingRetry(instance string) time.Duration {
	since, ok := h.ready.silentSince(instance)
	if !ok {
		return time.Second
	}
	return max(time.Second, min(10*time.Second, time.Since(since)/10))
}

// WakeForUse is a use of the target that is not a data-route dial (a public
// ingress request): it joins the target's one wake, the same flight the
// dials wait on, starting it when none is under way, and waits for it
// within ctx. nil means the daemon answers; otherwise what a dial refused
// now would be told.
func (h *Handler) WakeForUse(ctx context.Context, r targets.Route, arrived time.Time) *Refusal {
	f, _ := h.flightFor(r, arrived, false)
	select {
	case <-f.settled:
		return f.result
	case <-ctx.Done():
		return f.refusalNow()
	}
}
