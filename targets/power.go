package targets

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// drainWait bounds how long one attempt of an explicit power-down waits for
// the target's data connections to close: a relay's going-away close and
// its forced end (the registry's close wait), or a dial's hold (5 s). A
// power-down still waiting then is tried again, not given up.
const drainWait = 8 * time.Second

// act runs one Incus state action and waits for it within most.
// It holds the instance's turn (owner.go) until the operation ends. A busy
// refusal can then only come from outside this process (another
// replica's write, an operator): it is waited out for up to busyPatience
// within ctx, as routine, before it is the caller's to handle.
func (s *Service) act(ctx context.Context, name string, put incus.InstanceStatePut, most time.Duration) error {
	return s.owned(ctx, name, func(ctx context.Context) error {
		op, err := s.incus.UpdateInstanceState(ctx, name, put)
		until := time.Now().Add(busyPatience)
		for delay := 10 * time.Millisecond; errors.Is(err, incus.ErrBusy) && time.Now().Add(delay).Before(until); delay = min(2*delay, 200*time.Millisecond) {
			if !clock.Sleep(ctx, delay) {
				break
			}
			op, err = s.incus.UpdateInstanceState(ctx, name, put)
		}
		if err != nil {
			return err
		}
		_, err = s.wait(ctx, op, most)
		s.listingChanged()
		return err
	})
}

// busyPatience bounds how long a state action waits out another writer's
// hold on the instance before it reports the refusal: a config write
// takes tens of milliseconds, a start or a freeze under a second here.
const busyPatience = 3 * time.Second

// stop stops gracefully within grace, then forcibly: on Incus a graceful
// stop that never ends would otherwise block every later change. Both
// under one hold of the instance's turn: Incus 6.0.4 keeps a graceful
// stop's hold on the instance after the stop failed its timeout, until the
// forced stop takes it over, and a write of this process in between would
// be refused as busy.
func (s *Service) stop(ctx context.Context, name string, grace time.Duration, stateful bool) error {
	return s.owned(ctx, name, func(ctx context.Context) error { return s.stopHeld(ctx, name, grace, stateful) })
}

func (s *Service) stopHeld(ctx context.Context, name string, grace time.Duration, stateful bool) error {
	if stateful {
		return s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionStop, Stateful: true}, 10*time.Minute)
	}
	if grace >= time.Second {
		err := s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionStop, Timeout: int(grace / time.Second)}, grace+10*time.Second)
		if err == nil || isAlreadyStopped(err) {
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		s.log.Info("graceful stop did not finish in time; forcing", zap.String("instance", name), zap.Error(err))
	}
	err := s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionStop, Force: true}, time.Minute)
	if isAlreadyStopped(err) {
		return nil
	}
	return err
}

// Wake is a data-route dial's request for running, made when the dial
// arrived (at). It acts first: a paused target is unfrozen, a stopped or
// suspended one started (Incus restores a stateful stop on start), at
// once, and running is recorded as the target's wanted power right after,
// under the same hold of the instance's turn (owner.go), so no power-down
// of this process can act between the two. Wake answers once both are
// done, so that what a relayed dial asked is on the instance before the
// dial is relayed; a daemon probe may run meanwhile (wake.Waker). A dial
// that needs no action (a running target with a power-down recorded)
// waits for the record, which is then all it asks.
//
// r is the target as the route read it (from the observation cache).
// A newer request recorded on it supersedes the dial (ErrSuperseded: the
// dial loses to a power change asked after it); one the cache has not
// seen yet is found by the record, which then hands the target to the
// reconciler to carry that request out. It answers the power the target
// had. Should the action fail, the record is still made and the
// reconciler carries it out.
//
// relayable, when not nil, is called as soon as the use may be relayed
// before the record lands: right after the action, when the power-down it
// undid is recorded as carried out (powerDone), so that Incus showing the
// target running under it tells any later reader of the use (State.Intent)
// should the process die before the record. Otherwise the use waits for
// Wake to answer.
func (s *Service) Wake(ctx context.Context, r Route, at time.Time, relayable func()) (from controller.Power, err error) {
	inst := r.inst
	if inst == nil {
		return "", fmt.Errorf("wake %s: %w", r.Name, errNotResolved)
	}
	name := inst.Name
	st := StateOf(inst)
	if err := wakeRefused(inst, st, at); err != nil {
		return st.Power, err
	}
	unlock, waited, err := s.own.take(ctx, name, true)
	if err != nil {
		return st.Power, fmt.Errorf("wake %s: %w", name, errHeld)
	}
	held := context.WithValue(ctx, ownHold{name}, true)
	if waited {
		// Another step of this process held the instance (a freeze, a
		// stop, a start): what the route read is older than its end.
		fresh, lerr := s.lookup(held, name)
		if lerr != nil || fresh == nil {
			unlock()
			if lerr == nil {
				lerr = errGone
			}
			return st.Power, fmt.Errorf("wake %s: %w", name, lerr)
		}
		inst, st = fresh, StateOf(fresh)
		if err := wakeRefused(inst, st, at); err != nil {
			unlock()
			return st.Power, err
		}
	}
	clearIdle := recordOf(inst.Config, fIdleSince).has(fIdleSince)
	// From the action until the record, the target runs under an older
	// power-down's record: other uses are told it is being replaced.
	s.waking.putUnless(name, at, nil)
	recorded := func() {
		s.waking.dropIf(name, func(cur time.Time) bool { return cur.Equal(at) })
		unlock()
	}
	defer recorded()
	acted, err := s.wakeAct(held, inst, true)
	if acted && err == nil {
		s.changes.note(name) // a wake is a use: the idle loop counts from it
		if relayable != nil && undidMarkedDown(inst) {
			relayable()
		}
	}
	// Wake answers only once the record is made, and the dial is relayed
	// only after Wake answered (wake.Waker): a relayed dial whose record
	// was still on its way when the process died would leave the older
	// power-down recorded, and the next process would carry it out under
	// the use it had answered (found by the kill matrix under load). The
	// record is bounded: it holds the turn.
	rctx, cancel := context.WithTimeout(held, wakeRecordWithin)
	defer cancel()
	rerr := s.recordWake(rctx, name, at, clearIdle)
	if err != nil {
		return st.Power, err
	}
	return st.Power, rerr
}

// unmarkedDown says inst (whose state is st) rests in the power-down
// recorded on it, which is not marked carried out.
func unmarkedDown(inst *incus.Instance, st State) bool {
	rec := st.Recorded
	if st.Phase != controller.PhaseActive || !st.Resting || rec.Power == "" || rec.Power == controller.PowerRunning || st.Power != rec.Power {
		return false
	}
	return !recordOf(inst.Config, fPowerDone).PowerDone.Equal(rec.At)
}

// undidMarkedDown says a wake's action on inst (as it was read before
// the action) undid the power-down its record says was carried out: the
// intent is that power-down, marked done, and Incus showed it.
func undidMarkedDown(inst *incus.Instance) bool {
	r := recordOf(inst.Config, fIntent|fPowerDone)
	if !wokenUnder(&r) {
		return false
	}
	switch r.Intent.Power {
	case controller.PowerPaused:
		return inst.Status == incus.InstanceFrozen
	case controller.PowerStopped, controller.PowerSuspended:
		return inst.Status == incus.InstanceStopped
	}
	return false
}

// wakeRefused says why a use made at at may not wake inst (st is its
// state): it is no target, or not active, or a newer power change is
// recorded on it (ErrSuperseded). A zero at skips that last check: the
// record's own write refuses a newer request.
func wakeRefused(inst *incus.Instance, st State, at time.Time) error {
	if _, ok := ownerOf(inst); !ok {
		return errors.New("targets: wake of an instance that is not a target")
	}
	if st.Phase != controller.PhaseActive {
		return errors.New("targets: wake of a target that is not active")
	}
	if in := st.Recorded; !at.IsZero() && in.Power != "" && in.Power != controller.PowerRunning && in.At.After(at) {
		return ErrSuperseded
	}
	return nil
}

// wakeRecordWithin bounds the record that follows a wake's action: it
// holds the instance's turn, so it must end, but a loaded Incus may take a
// few seconds to apply a write.
const wakeRecordWithin = 10 * time.Second

// wakeAct unfreezes or starts inst as its status says, under the turn
// ctx carries, and says whether it acted. The status may be a moment old
// (the cache's): when the action fails and Incus shows another status,
// the action is chosen again once from what Incus shows.
func (s *Service) wakeAct(ctx context.Context, inst *incus.Instance, again bool) (acted bool, err error) {
	acted, err = s.toRunning(ctx, inst)
	if err != nil && again && ctx.Err() == nil {
		if fresh, lerr := s.lookup(ctx, inst.Name); lerr == nil && fresh != nil && fresh.Status != inst.Status {
			return s.wakeAct(ctx, fresh, false)
		}
	}
	return acted, err
}

// toRunning unfreezes a frozen instance or starts a stopped one, as inst's
// status says, and says whether it acted (not for any other status).
func (s *Service) toRunning(ctx context.Context, inst *incus.Instance) (acted bool, err error) {
	switch inst.Status {
	case incus.InstanceFrozen:
		return true, s.act(ctx, inst.Name, incus.InstanceStatePut{Action: incus.ActionUnfreeze}, 30*time.Second)
	case incus.InstanceStopped:
		s.dialer.Forget(inst.Name) // a start makes a new init process; an unfreeze does not
		return true, s.act(ctx, inst.Name, incus.InstanceStatePut{Action: incus.ActionStart}, time.Minute)
	}
	return false, nil
}

// recordWake records running, asked at at by a use, as the target's
// wanted power (with the idle-since instant cleared when clearIdle), and
// drops an older request kept until Incus takes it, which must not land
// after this one (as SetPower does). A newer request found recorded
// (ErrSuperseded) is handed to the reconciler, which carries it out.
func (s *Service) recordWake(ctx context.Context, name string, at time.Time, clearIdle bool) error {
	var extra change
	if clearIdle {
		extra.keys = fIdleSince // to none: removed
	}
	_, _, err := s.want(ctx, name, Intent{Power: controller.PowerRunning, At: at, By: ByUse}, extra,
		func(cur *incus.Instance, st State) error { return wakeRefused(cur, st, time.Time{}) })
	switch {
	case err == nil:
		s.pending.drop(name, at)
	case errors.Is(err, ErrSuperseded):
		s.own.kick(name)
	}
	return err
}

// PowerDownPending says whether a use made at at (a dial, an ingress
// request) that finds the target r running must still record its own
// request for running (Wake): a power-down is recorded on it and not yet
// carried out, or one asked before at is kept in memory because Incus has
// not taken it yet (see pendingTable), and would otherwise land after the
// use. r is the target as the use read it (ResolveRoute).
func (s *Service) PowerDownPending(r Route, at time.Time) bool {
	if r.inst != nil {
		// What is recorded, not what it means (State.Intent): Incus may
		// show a target it just stopped running for a moment (seen after a
		// forced stop), which reads as woken under the stop marked
		// carried out. A use that finds a power-down recorded goes through
		// Wake, which reads the target again under the turn and records
		// its request, whatever it finds.
		if st := StateOf(r.inst); st.RecordedPending() && !s.wroteRunningSince(r.Name, st.Recorded) {
			// A wake that acted on the target and records its request for
			// running now replaces the recorded one: the use need not.
			w, waking := s.waking.get(r.Name)
			return !waking || st.Recorded.At.After(w)
		}
	}
	w, ok := s.pending.get(r.Name)
	return ok && w.intent.Power != controller.PowerRunning && !w.intent.At.After(at)
}

// wroteRunningSince says this process has recorded running on name, by a
// request newer than recorded, since the read that found recorded: a use
// that read the target between a wake's action and its record (a dial
// the CPU kept waiting) finds the power-down it read replaced already.
func (s *Service) wroteRunningSince(name string, recorded Intent) bool {
	w, ok := s.written.get(name)
	return ok && w.intent.Power == controller.PowerRunning &&
		w.intent.At.Truncate(time.Millisecond).After(recorded.At)
}

// powerUp brings a target to running and clears the recorded idle-since
// instant, so that the idle clock is the daemon's again. Both under one
// hold of the instance's turn: the clear comes straight after the action,
// before any other write of this process.
func (s *Service) powerUp(ctx context.Context, inst *incus.Instance) error {
	return s.owned(ctx, inst.Name, func(ctx context.Context) error { return s.powerUpHeld(ctx, inst) })
}

func (s *Service) powerUpHeld(ctx context.Context, inst *incus.Instance) error {
	// inst was read before this hold: another step of this process (the
	// reconciler's power-up for a setPower, a wake) may have brought the
	// target up since, and Incus refuses a start of a running instance or
	// an unfreeze of a thawed one. Decide on what the holder sees.
	inst, err := s.lookup(ctx, inst.Name)
	if err != nil {
		return err
	}
	if inst == nil {
		return errGone
	}
	if _, err := s.toRunning(ctx, inst); err != nil {
		return err
	}
	if recordOf(inst.Config, fIdleSince).has(fIdleSince) {
		if perr := s.patch(ctx, inst.Name, change{keys: fIdleSince}.config()); perr != nil {
			s.logRetry("clearing idle-since failed", perr, zap.String("instance", inst.Name))
		}
	}
	return nil
}

// SetPower records the power asked of an active target on its instance and
// lets the reconciler carry it out, answering within AnswerWithin with what
// Incus then shows and, while the move goes on, a message saying what it
// waits for. A target already there, or moving there, is observed without
// action. A retryable error means nothing was recorded.
func (s *Service) SetPower(ctx context.Context, ref controller.TargetRef, power controller.Power) (_ controller.Observation, err error) {
	ctx, cancel := s.budget(ctx)
	defer cancel()
	name, inst, err := s.resolveWith(ctx, ref, s.readFor(ref.Owner))
	if err != nil {
		return controller.Observation{}, err
	}
	if inst == nil {
		return controller.Observation{}, notHeld()
	}
	if !slices.Contains(s.powerStates(inst), power) {
		return controller.Observation{}, jsonrpc.InvalidParams("power", "The target's template does not offer power state %s; template/list names the states it offers.", power)
	}
	unlock, err := s.lockTarget(ctx, name)
	if err != nil {
		return controller.Observation{}, err
	}
	var extra change
	if power != controller.PowerRunning {
		extra = change{keys: fIdleSince, to: record{IdleSince: s.now()}}
	}
	in := Intent{Power: power, At: s.now(), By: BySetPower}
	// Most of the answer bound may go to waiting out an Incus operation
	// that holds the instance; the rest is for observing.
	patience := time.Now().Add(answerWait(ctx, s.cfg.AnswerWithin*2/3))
	acceptable := func(inst *incus.Instance, st State) error {
		if err := checkOwned(inst, ref.Owner); err != nil {
			return err
		}
		if st.Phase != controller.PhaseActive {
			return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "targetNotActive",
				"The target is %s, not active; power can change only once it is active.", st.Phase)
		}
		return nil
	}
	decide := func(inst *incus.Instance, st State) error {
		if err := acceptable(inst, st); err != nil {
			return err
		}
		if w, ok := s.pending.get(name); ok && w.intent.At.After(st.Intent.At) {
			st.Intent = w.intent
		}
		if st.Intent.Power == power || (st.Intent.Power == "" && st.Resting && st.Power == power) {
			if power != controller.PowerRunning && s.wakeInFlight(ctx, inst) {
				// Recorded, then a wake began: a dead process's start
				// that Incus still carries out. Once it lands, the
				// carried-out power-down reads as woken since (State.Intent)
				// and this later request would be lost. Recorded anew,
				// it outranks that wake.
				return nil
			}
			return errAlready
		}
		return nil
	}
	// While an Incus operation holds the instance the request is kept
	// (below), and its copy on the project is what outlives this process.
	// Written after the wait, under a loaded Incus the budget cut it short;
	// the request was answered accepted and lost to a kill (the kill
	// matrix, seed 1796577032197878954). So it is written from the first
	// sign of a hold, beside the wait, with the rest of the budget. A write
	// that lands after all is not held up by it: the copy is then outranked
	// or equal, and a pass clears it. A request answered with an error
	// waits for it and leaves none.
	w := pendingWrite{intent: in, extra: extra}
	var early chan error
	keepEarly := func() {
		if early != nil || acceptable(inst, StateOf(inst)) != nil {
			return // a request refused (a close under way, say) keeps nothing
		}
		ch := make(chan error, 1)
		if s.own.spawn(func(context.Context) { ch <- s.storePending(ctx, name, w) }) {
			early = ch
		}
	}
	_, wrote, err := s.wantPatient(ctx, patience, keepEarly, name, in, extra, decide)
	if errors.Is(err, errAlready) && s.adoptStoredPending(ctx, name, power) {
		// A request the project keeps for the target (one a killed
		// process, or another replica, answered and could not record yet)
		// asks for another power and is not in memory yet: answered
		// "already there" without a write, this request would be outranked
		// by that older one once a pass restores it, and lost. Decided
		// again with it, this one is recorded and outranks it.
		_, wrote, err = s.wantPatient(ctx, patience, keepEarly, name, in, extra, decide)
	}
	if err == nil && s.pending.drop(name, in.At) {
		wrote = true // an older request kept in memory is replaced: converge again
	}
	unlock()
	awaitEarly := sync.OnceValue(func() error { return <-early })
	if early != nil {
		defer func() {
			if err != nil {
				_ = awaitEarly()
				s.clearPending(ctx, name, w)
			}
		}()
	}
	var unknown *WriteUnknownError
	switch {
	case errors.Is(err, incus.ErrBusy) || errors.As(err, &unknown):
		// An Incus operation (a graceful stop, a start) holds the
		// instance, or Incus took the write and never answered: the
		// request is kept, recorded as soon as Incus takes it, and the
		// answer says the move is under way. A retryable error from
		// this method always means nothing was recorded.
		//
		// Kept only for a target that is still active: the turn may have
		// been held by a close this request never saw (the kill matrix
		// met one answered "closing" and kept, never to be reached), so
		// the target is read again, outside the turn, and checked.
		if cur, rerr := s.lookup(ctx, name); rerr == nil && cur != nil {
			inst = cur
		} else if rerr == nil {
			return controller.Observation{}, notHeld()
		}
		if cerr := acceptable(inst, StateOf(inst)); cerr != nil {
			return controller.Observation{}, cerr
		}
		s.pending.put(name, w)
		var serr error
		if early != nil {
			serr = awaitEarly()
		}
		if early == nil || (serr != nil && ctx.Err() == nil) {
			serr = s.storePending(ctx, name, w)
		}
		if serr != nil {
			s.log.Warn("storing a power request on the project failed; it is held in memory only",
				zap.String("instance", name), zap.String("to", string(power)), zap.Error(serr))
		}
		s.own.kick(name)
		if unknown != nil || ctx.Err() != nil {
			s.log.Warn("a power request waits for Incus to take it", zap.String("instance", name),
				zap.String("to", string(power)), zap.Error(err))
			return s.observe(inst, ref.Owner), nil
		}
		wrote = false
	case errors.Is(err, errAlready):
		// Answered without a write, yet accepted: a dead process's older
		// write of another power that Incus applies only now (it checks
		// the ETag before it applies a write) would overtake it unseen.
		// Kept as this process's newest request, it is looked at again
		// once such a write has settled, and recorded should one have
		// landed (written.go).
		s.wrote(name, in)
	case errors.Is(err, errGone):
		return controller.Observation{}, notHeld()
	case err != nil:
		var rpcErr *jsonrpc.Error
		if errors.As(err, &rpcErr) {
			return controller.Observation{}, err
		}
		s.log.Warn("recording a power change failed", zap.String("instance", name), zap.String("to", string(power)), zap.Error(err))
		return controller.Observation{}, s.incusError("recording the power change", err)
	}
	if wrote {
		s.kickAndWait(ctx, name)
	}
	// The converge just read the instance and offered it to the cache,
	// which serves it unless something changed it since.
	after, lerr := s.read(ctx, name)
	if lerr != nil {
		// The request is recorded: the reconciler carries it out whatever
		// this answer says, so say it is under way rather than unavailable.
		s.logRetry("observing a recorded power change failed; answering what was last seen", lerr,
			zap.String("instance", name))
		st := StateOf(inst)
		st.Intent = Intent{Power: power, By: BySetPower}
		return s.withIngress(inst, observation(inst, ref.Owner, st, s.progressOf(name, st), s.now())), nil
	}
	if after == nil {
		return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "The target disappeared while its power changed.")
	}
	return s.observe(after, ref.Owner), nil
}

// progressOf is what the move to st's recorded power waits for: the
// progress this process keeps, with the owner's count of the move's
// failed attempts in a row.
func (s *Service) progressOf(name string, st State) *progress {
	p := s.progress.get(name)
	if f := s.own.failures(name); f.step == stepPower && f.n > 0 && st.PowerPending() {
		if p == nil || p.to != st.Intent.Power {
			p = &progress{to: st.Intent.Power}
		}
		p.failures, p.retryAt = f.n, f.retryAt
	}
	return p
}

// wakeInFlight says inst rests in a power-down marked carried out while
// an Incus task moves it: a start or an unfreeze whose sender (a wake of
// a process killed since, an operator) recorded nothing, and that Incus
// does not show until it ends. A failed read says no: the answer is then
// what it was before the read was made.
func (s *Service) wakeInFlight(ctx context.Context, inst *incus.Instance) bool {
	if r := recordOf(inst.Config, fState); r.PowerDone.IsZero() || !r.PowerDone.Equal(r.Intent.At) {
		return false // not marked: a wake landing is a pending power-down, carried out again
	}
	op, err := s.operationOn(ctx, inst.Name)
	if err != nil {
		s.log.Debug("listing Incus tasks failed", zap.String("instance", inst.Name), zap.Error(err))
		return false
	}
	return op != nil
}

// errAlready: the target has, or is moving to, the power asked.
var errAlready = errors.New("targets: already there or moving there")

// observe is the observation of an instance, with what a move this process
// carries out waits for, and a request it could not record yet.
func (s *Service) observe(inst *incus.Instance, owner controller.Owner) controller.Observation {
	st := StateOf(inst)
	p := s.progressOf(inst.Name, st)
	if w, ok := s.pending.get(inst.Name); ok && st.Phase == controller.PhaseActive && w.intent.At.After(st.Intent.At) {
		st.Intent = w.intent
		if p == nil || p.to != w.intent.Power {
			p = &progress{to: w.intent.Power, unrecorded: true}
		}
	}
	return s.withIngress(inst, observation(inst, owner, st, p, s.now()))
}

// drivePower takes one step toward the target's recorded power and answers
// when to look at it again (0: it is there, or nothing is wanted).
func (s *Service) drivePower(ctx context.Context, inst *incus.Instance) next {
	name := inst.Name
	st := StateOf(inst)
	if !st.PowerPending() {
		s.progress.clear(name)
		if unmarkedDown(inst, st) {
			// At rest in a power-down recorded before marks were made, or
			// asked again of a target that had that power: mark it, so
			// that the next wake relays its use at once.
			_ = s.owned(ctx, name, func(ctx context.Context) error {
				s.powerDone(ctx, name, st.Recorded)
				return nil
			})
		}
		return settled
	}
	to := st.Intent.Power
	if !st.Resting {
		return lookIn(200 * time.Millisecond) // Incus finishes its own transition first
	}
	var err error
	if to == controller.PowerRunning {
		err = s.powerUp(ctx, inst)
	} else {
		err = s.powerDown(ctx, inst, st)
	}
	var open errStillOpen
	switch {
	case err == nil:
		// Incus finished the action; the next pass (or kick) sees it.
		s.progress.clear(name)
		s.changes.note(name)
		return settled
	case errors.As(err, &open):
		return lookIn(250 * time.Millisecond)
	case ctx.Err() != nil:
		return settled
	}
	s.progress.waiting(name, to, 0)
	// A stop that never lets go of the instance is forced elsewhere
	// (strandedLock).
	f := s.own.failures(name)
	attempt := 1
	if f.step == stepPower {
		attempt += f.n
	}
	s.logRetry("power change failed; retrying", err, zap.String("instance", name), zap.String("to", string(to)),
		zap.Int("attempt", attempt))
	// Its kind's backoff: the observation tells the runtime when the
	// next attempt is (observe).
	return failedAt(stepPower)
}

// errStillOpen: an explicit power-down is still waiting for data
// connections to close.
type errStillOpen struct{ n int }

func (e errStillOpen) Error() string {
	return fmt.Sprintf("targets: %d data connections still open", e.n)
}

// powerDown moves a target to the recorded paused, suspended or stopped,
// guarded by the relay registry: an explicit request first closes the
// target's relays and waits for them to end; the idle loop's yields to any
// use and is replaced by running. New dials are held off until it is done.
func (s *Service) powerDown(ctx context.Context, inst *incus.Instance, st State) error {
	name, to := inst.Name, st.Intent.Power
	// A wake acts before it records its request for running, holding the
	// instance's turn from one to the other: the request read here, under
	// the turn, is after any such record, so a dial that woke the target
	// is not drained for a request it outranks.
	if still, err := s.stillWanted(ctx, name, st); err != nil || !still {
		return err
	}
	var release func()
	if st.Intent.By == ByIdle {
		r, ok := s.relays.Quiesce(name)
		if !ok {
			// A dial came after the idle loop decided: the use wins.
			_, _, err := s.want(ctx, name, Intent{Power: controller.PowerRunning, At: s.now(), By: ByUse}, change{}, nil)
			if err != nil && !errors.Is(err, ErrSuperseded) {
				return err
			}
			return nil
		}
		release = r
	} else {
		dctx, cancel := context.WithTimeout(ctx, drainWait)
		r, left, use := s.relays.Drain(dctx, name, "the target is powering down", st.Intent.At, func(n int) { s.progress.waiting(name, to, n) })
		cancel()
		if !use.IsZero() {
			// A dial (or an ingress request) that arrived after the
			// power-down was asked outranks it: its request for running
			// is recorded (its own wake records it too, unless it found
			// the target running with no power-down in sight), and no
			// relay of it is closed.
			r()
			s.progress.clear(name)
			_, _, err := s.want(ctx, name, Intent{Power: controller.PowerRunning, At: use, By: ByUse}, change{}, nil)
			if err != nil && !errors.Is(err, ErrSuperseded) {
				return err
			}
			return nil
		}
		if left > 0 {
			r()
			s.progress.waiting(name, to, left)
			return errStillOpen{left}
		}
		s.progress.waiting(name, to, 0)
		release = r
	}
	// The check and the action hold the turn together, so that no wake of
	// this process comes between them.
	var mark bool
	err := s.owned(ctx, name, func(ctx context.Context) error {
		var err error
		mark, err = s.powerDownHeld(ctx, name, st)
		return err
	})
	// Dials go on once the action is done, not after the mark: it is no
	// part of the power-down, and on a cluster its listing of Incus's tasks
	// can take seconds (found by two replicas' dials after a member
	// restarted: the other replica's dials all waited out their 5 s hold).
	release()
	if mark {
		_ = s.owned(ctx, name, func(ctx context.Context) error {
			s.powerDone(ctx, name, st.Intent)
			return nil
		})
	}
	return err
}

// stillWanted reads, under the instance's turn, whether st's request is
// still the one recorded on an active target.
func (s *Service) stillWanted(ctx context.Context, name string, st State) (bool, error) {
	var cur *incus.Instance
	err := s.owned(ctx, name, func(ctx context.Context) error {
		var err error
		cur, err = s.lookup(ctx, name)
		return err
	})
	if err != nil || cur == nil {
		return false, err
	}
	now := StateOf(cur)
	return now.Intent == st.Intent && now.Phase == controller.PhaseActive, nil
}

// powerDownHeld is powerDown's action, once its guard holds the dials off,
// under the instance's turn. mark says the target rests in the power
// asked, to be marked carried out (powerDone).
func (s *Service) powerDownHeld(ctx context.Context, name string, st State) (mark bool, err error) {
	to := st.Intent.Power
	// The request may have been replaced while the connections closed.
	cur, err := s.lookup(ctx, name)
	if err != nil {
		return false, err
	}
	if cur == nil {
		return false, nil
	}
	now := StateOf(cur)
	if now.Intent != st.Intent || now.Phase != controller.PhaseActive || !now.Resting {
		return false, nil // the next step reads the newer state
	}
	if n := foreignLeases(recordOf(cur.Config, fRelays).Relays, s.cfg.Replica, s.now()); n > 0 {
		// Another replica relays to the target. The idle loop's power-down
		// yields to that use; an explicit one waits while that replica,
		// which reads the request within leaseWatch, closes its relays.
		if st.Intent.By == ByIdle {
			_, _, err := s.want(ctx, name, Intent{Power: controller.PowerRunning, At: s.now(), By: ByUse}, change{}, nil)
			if err != nil && !errors.Is(err, ErrSuperseded) {
				return false, err
			}
			return false, nil
		}
		s.progress.waitingElsewhere(name, to, n)
		return false, errStillOpen{n}
	}
	if now.Power == to {
		return true, nil
	}
	// From one powered-down state to another, through running: a stopped
	// instance cannot be frozen, a frozen one cannot shut itself down.
	if _, err := s.toRunning(ctx, cur); err != nil {
		return false, err
	}
	if to != controller.PowerPaused {
		s.dialer.Forget(name) // a freeze keeps the init process
	}
	switch to {
	case controller.PowerPaused:
		err = s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionFreeze}, 30*time.Second)
	case controller.PowerSuspended:
		err = s.stop(ctx, name, 0, true)
	case controller.PowerStopped:
		err = s.stop(ctx, name, s.cfg.GracefulStop, false)
	default:
		return false, errors.New("targets: power down to " + string(to))
	}
	return err == nil, err
}

// powerStates are the states the target's template offers. A target whose
// template left the catalog keeps the states every instance can reach.
func (s *Service) powerStates(inst *incus.Instance) []controller.Power {
	return s.templateStates(recordOf(inst.Config, fTemplate).Template)
}

// templateStates is powerStates of a target made from the template id.
func (s *Service) templateStates(id string) []controller.Power {
	if t, ok := s.catalog.Load().Get(id); ok {
		return t.Wire.PowerStates
	}
	return []controller.Power{controller.PowerRunning, controller.PowerPaused, controller.PowerStopped}
}
