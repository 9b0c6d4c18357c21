package targets

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
)

// Power intent: the power last asked of a target, recorded on its instance
// so that it outlives the request, a failed attempt and the provider
// process. The reconciler drives every target to its recorded power and
// retries until it gets there, the target leaves active, or a newer request
// replaces the record. Its keys are in record.go.

// Requester is who asked for a power: it decides what a power-down may do
// to the target's open data connections.
type Requester string

// The requesters of a power.
const (
	// ByCreate: a new target is wanted running.
	ByCreate Requester = "create"
	// BySetPower: target/setPower. A power-down first closes the target's
	// relays with going-away frames and waits for them to end.
	BySetPower Requester = "setPower"
	// ByIdle: the idle loop. A power-down yields to any use of the target:
	// a relay or a dial that comes first replaces it with running.
	ByIdle Requester = "idle"
	// ByUse: a data-route dial (a wake), or a use that overtook an idle
	// power-down.
	ByUse Requester = "use"
)

// Intent is a recorded power request.
type Intent struct {
	Power controller.Power
	At    time.Time
	By    Requester
}

func intentOf(inst *incus.Instance) Intent { return recordOf(inst.Config, fIntent).Intent }

// ErrSuperseded: a newer power request than the one being recorded is on
// the instance already; the older one is dropped.
var ErrSuperseded = errors.New("targets: a newer power request is recorded")

// errGone: the instance disappeared while its intent was recorded.
var errGone = errors.New("targets: the instance is gone")

// want records in as the instance's wanted power, with extra written in
// the same PATCH, unless a newer request is recorded (ErrSuperseded).
// check, when not nil, is applied to the instance as read just before the
// write and may refuse.
// The write is conditional on the instance's ETag, so a request recorded
// by another process in between is never overwritten unseen. It answers
// the instance as read, and whether it wrote.
func (s *Service) want(ctx context.Context, name string, in Intent, extra change, check func(*incus.Instance, State) error) (*incus.Instance, bool, error) {
	return s.wantPatient(ctx, time.Time{}, nil, name, in, extra, check)
}

// wantPatient is want with a bound on waiting only: its reads and writes
// keep ctx's whole deadline (a loaded Incus may take a while to answer
// one), but once patience has passed it stops waiting out an operation
// that holds the instance or the ETag churn of one that moves it, and says
// ErrBusy: nothing was recorded, and the caller may keep the request.
// refused, when not nil, is called once, at Incus's first busy refusal of
// the write or on finding the turn held, before any waiting: a caller that
// keeps the request should the wait fail starts keeping it there, while
// its budget is whole.
func (s *Service) wantPatient(ctx context.Context, patience time.Time, refused func(), name string, in Intent, extra change, check func(*incus.Instance, State) error) (*incus.Instance, bool, error) {
	// The read and the write hold the instance's turn (owner.go). Incus
	// checks a PATCH's ETag before it applies the write, not with it, so
	// two writes read at one ETag can both pass, and the one applied last
	// wins whatever its time (the kill matrix met it: a kept paused
	// request, flushed by the reconciler, landing over a newer dial's
	// running). Waiting for the turn stops at patience, as waiting out
	// Incus's own operations does.
	var (
		inst  *incus.Instance
		wrote bool
	)
	if refused != nil && !holds(ctx, name) && s.own.heldNow(name) {
		// Another step of this process (the reconciler's graceful stop,
		// say) holds the turn: as good as Incus's refusal.
		refused()
		refused = nil
	}
	err := s.ownedBy(ctx, patience, name, func(ctx context.Context) error {
		var err error
		inst, wrote, err = s.wantHeld(ctx, patience, refused, name, in, extra, check)
		return err
	})
	if isHeld(err) {
		err = fmt.Errorf("record power %s: %w", in.Power, err)
	}
	return inst, wrote, err
}

// wantHeld is wantPatient's read and write, under the instance's turn.
func (s *Service) wantHeld(ctx context.Context, patience time.Time, refused func(), name string, in Intent, extra change, check func(*incus.Instance, State) error) (*incus.Instance, bool, error) {
	wait := func(d time.Duration) bool {
		if !patience.IsZero() {
			d = min(d, time.Until(patience))
			if d <= 0 {
				return false
			}
		}
		return clock.Sleep(ctx, d)
	}
	for attempt := 0; ; attempt++ {
		inst, etag, err := s.incus.GetInstance(ctx, name)
		if errors.Is(err, incus.ErrNotFound) {
			return nil, false, errGone
		}
		if err != nil {
			return nil, false, err
		}
		st := StateOf(inst)
		if check != nil {
			if err := check(inst, st); err != nil {
				return inst, false, err
			}
		}
		// The record as it is, not what it means (State.Intent): a use's
		// request for running is written even where Incus shows the use.
		if rec := st.Recorded; rec.Power != "" && rec.At.After(in.At) {
			if rec.Power == in.Power {
				// A newer request for the same power (another replica's
				// dial, say) stands for this one too: nothing to write, and
				// nothing to give up.
				return inst, false, nil
			}
			return inst, false, ErrSuperseded
		}
		if _, kept := s.pending.get(name); st.Recorded.Power == in.Power && st.Recorded.By == in.By && st.Intent.Power == st.Recorded.Power && extra.empty() && !kept {
			// Already recorded. Not so while an older request is kept in
			// memory: its flush may be writing it now, and only a write of
			// this newer one (ETag-guarded) is sure to outrank it. Nor
			// when the record reads as woken since (a carried-out
			// power-down the instance no longer shows, State.Intent): it
			// stands for nothing now, and this request must be written.
			return inst, false, nil
		}
		set := extra
		set.keys |= fIntent
		set.to.Intent = in
		if in.Power != controller.PowerRunning && st.Phase == controller.PhaseActive && st.Resting && st.Power == in.Power && s.restsUntouched(ctx, name, in.Power, etag) {
			// Nothing to carry out: the power-down is done as it is
			// recorded (see powerDone).
			set.keys |= fPowerDone
			set.to.PowerDone = in.At
		}
		err = s.incus.PatchInstanceConfigIf(ctx, name, set.config(), etag)
		s.listingChanged()
		if err == nil {
			s.wrote(name, in)
			return inst, true, nil
		}
		if errors.Is(err, incus.ErrBusy) {
			// Incus changes no config while an operation holds the
			// instance (a start, a graceful stop): wait within ctx.
			if refused != nil {
				refused()
				refused = nil
			}
			if !wait(min(10*time.Millisecond<<min(attempt, 4), 200*time.Millisecond)) {
				return nil, false, fmt.Errorf("record power %s: %w", in.Power, err)
			}
			continue
		}
		if !errors.Is(err, incus.ErrPreconditionFailed) || attempt >= 12 {
			if landed := s.landed(ctx, name, in); landed {
				// The answer was lost, not the write.
				s.wrote(name, in)
				return inst, true, nil
			}
			err = fmt.Errorf("record power %s: %w", in.Power, err)
			if writeMayHaveLanded(err) {
				return inst, false, &WriteUnknownError{Err: err}
			}
			return nil, false, err
		}
		// Incus itself rewrites volatile keys while an instance starts or
		// stops, which changes the ETag: read again shortly.
		if !wait(min(5*time.Millisecond<<attempt, 100*time.Millisecond)) {
			if ctx.Err() != nil {
				return nil, false, ctx.Err()
			}
			return nil, false, fmt.Errorf("record power %s: Incus kept rewriting the instance as it moved: %w", in.Power, incus.ErrBusy)
		}
	}
}

// noTaskOn says no Incus task is on the instance, so that a power-down
// a read made after it shows at rest may be marked carried out
// (restsUntouched, powerDone). Incus shows a stopped
// instance Stopped until a start sent to it ends, and takes a config write
// while that start is queued (met beside stress-ng): a mark written then
// makes the start, once it lands, read as a use since the power-down
// (State.Intent), and the power-down is lost. A failed listing counts as
// a task: an unmarked power-down is only slower to wake.
//
// The caller holds the instance's turn, and the listing yields it to a
// wake (owners.yielding): on a cluster it asks every member, and one slow
// to answer would hold the wake, and its dials, for as long.
func (s *Service) noTaskOn(ctx context.Context, name string) bool {
	yctx, done := s.own.yielding(ctx, name)
	defer done()
	op, err := s.operationOn(yctx, name)
	return err == nil && op == nil && yctx.Err() == nil
}

// restsUntouched says no Incus task is on the instance and, read after
// that listing, it still rests in power at etag (the caller's read): only
// then may a power-down be marked carried out on that read. The order
// matters: Incus rewrites an instance's volatile keys (its ETag) as a
// start begins and shows it Stopped until the start ends (measured: the
// new ETag 160 ms before Running), so a read made before the listing may
// show Stopped at the ETag the start leaves, and a start that ended
// between the two is in neither; a mark written on that read passes its
// ETag check and makes the start read as a use since the power-down (a
// clean fresh-clone run met it: an accepted stopped lost). Yields as
// noTaskOn does.
func (s *Service) restsUntouched(ctx context.Context, name string, power controller.Power, etag string) bool {
	yctx, done := s.own.yielding(ctx, name)
	defer done()
	if !s.noTaskOn(yctx, name) {
		return false
	}
	inst, now, err := s.incus.GetInstance(yctx, name)
	if err != nil || inst == nil || now != etag || yctx.Err() != nil {
		return false
	}
	st := StateOf(inst)
	return st.Phase == controller.PhaseActive && st.Resting && st.Power == power
}

// powerDone records that Incus carried out the power-down in (the
// request on name when the action began), unless another request was
// recorded since: a wake that then finds the target powered down may
// relay its use before its own record lands, since a crash in between
// leaves Incus showing the use (State.Intent). The caller holds the
// instance's turn. A failure is no failure of the power-down: wakes then
// wait for their record, as they did before there was a mark. So the mark
// gives way to a wake that asks for the turn: its reads end, and nothing
// is written.
func (s *Service) powerDone(ctx context.Context, name string, in Intent) {
	yctx, done := s.own.yielding(ctx, name)
	defer done()
	for attempt := 0; attempt < 3; attempt++ {
		// Tasks first, then the read the mark is written on (see
		// restsUntouched for why not the other way round).
		if !s.noTaskOn(yctx, name) {
			// An Incus task may still move it, or a wake asked for the
			// turn: a reconcile pass marks it once it rests.
			return
		}
		inst, etag, err := s.incus.GetInstance(yctx, name)
		if err != nil || inst == nil {
			return
		}
		r := recordOf(inst.Config, fState)
		if r.Intent != in || r.PowerDone.Equal(in.At) {
			return
		}
		if st := stateOf(inst, &r); st.Phase != controller.PhaseActive || !st.Resting || st.Power != in.Power {
			return // not shown at rest in that power (yet)
		}
		// A write cut short by a wake may still land: a mark under a
		// target the wake then runs reads as that use (State.Intent).
		err = s.incus.PatchInstanceConfigIf(yctx, name, change{keys: fPowerDone, to: record{PowerDone: in.At}}.config(), etag)
		s.listingChanged()
		if retry := errors.Is(err, incus.ErrPreconditionFailed) || errors.Is(err, incus.ErrBusy); !retry {
			if err != nil && yctx.Err() == nil {
				s.log.Debug("recording a power-down as carried out failed", zap.String("instance", name), zap.Error(err))
			}
			return
		}
		if !clock.Sleep(yctx, 20*time.Millisecond) {
			return
		}
	}
}

// WriteUnknownError: a power request was sent to Incus and no answer came
// back, nor could it be read whether it took effect.
type WriteUnknownError struct{ Err error }

func (e *WriteUnknownError) Error() string {
	return "targets: Incus may or may not have recorded the request: " + e.Err.Error()
}

func (e *WriteUnknownError) Unwrap() error { return e.Err }

// writeMayHaveLanded says whether a failed write may still have reached
// Incus: a transport failure after the request could be sent (no answer,
// a cut connection, a deadline), as opposed to an answer refusing it or a
// connection that was never made. The client says which when it knows:
// with several endpoints a write that reached none of them (each refused,
// timed out connecting, or said it could not serve it yet) is
// ErrUnreachable, and that one is "unavailable", not "under way".
func writeMayHaveLanded(err error) bool {
	if errors.Is(err, incus.ErrUnreachable) {
		return false
	}
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return false
	}
	var ie *incus.Error
	if errors.As(err, &ie) {
		return ie.Status == 0
	}
	return errors.Is(err, context.DeadlineExceeded)
}

// landed checks whether a write whose answer failed took effect after all.
func (s *Service) landed(ctx context.Context, name string, in Intent) bool {
	inst, err := s.lookup(ctx, name)
	if err != nil || inst == nil {
		return false
	}
	got := intentOf(inst)
	return got.Power == in.Power && got.By == in.By && got.At.UnixMilli() == in.At.UnixMilli()
}

// pendingTable holds power requests this process answered but could not
// yet record, because an Incus operation held the instance. The next step
// of the reconciler for the instance records each before anything else;
// until then observations show it. The project's config keeps a copy (see
// pendingstore.go), from which a process started after a kill takes it.
type pendingTable struct{ byName[pendingWrite] }

type pendingWrite struct {
	intent Intent
	extra  change
}

// put keeps w unless a newer request is kept already.
func (t *pendingTable) put(name string, w pendingWrite) {
	t.putUnless(name, w, func(cur pendingWrite) bool { return cur.intent.At.After(w.intent.At) })
}

// done drops w once it is recorded, unless a newer one came meanwhile.
func (t *pendingTable) done(name string, w pendingWrite) {
	t.dropIf(name, func(cur pendingWrite) bool { return cur.intent == w.intent })
}

// drop forgets a kept request older than at (a newer one was recorded),
// and says whether there was one.
func (t *pendingTable) drop(name string, at time.Time) bool {
	return t.dropIf(name, func(cur pendingWrite) bool { return !cur.intent.At.After(at) })
}

// flushPending records the instance's pending request, if any; false when
// Incus still holds the instance (try again shortly).
func (s *Service) flushPending(ctx context.Context, name string) bool {
	w, ok := s.pending.get(name)
	if !ok {
		return true
	}
	wctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, _, err := s.want(wctx, name, w.intent, w.extra, nil)
	switch {
	case err == nil, errors.Is(err, ErrSuperseded), errors.Is(err, errGone):
		s.pending.done(name, w)
		s.failMu.Lock()
		delete(s.lockedSince, name) // a later refusal is timed afresh
		s.failMu.Unlock()
		s.clearPending(ctx, name, w)
		return true
	case ctx.Err() != nil:
		s.log.Info("shutting down with a power request not yet recorded; the project keeps it",
			zap.String("instance", name), zap.String("to", string(w.intent.Power)))
		return false
	}
	s.log.Debug("a kept power request is not recorded yet; retrying", zap.String("instance", name), zap.Error(err))
	if errors.Is(err, incus.ErrBusyStopping) {
		s.strandedLock(ctx, name)
	}
	return false
}
