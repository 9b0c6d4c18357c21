package targets

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Run drives every instance to where its metadata says it should be: at
// start-up, every ReconcileInterval, and whenever a method kicks one. It
// returns when ctx ends, after the background work it started has stopped.
func (s *Service) Run(ctx context.Context) error {
	defer s.own.stop()
	s.kept.started.Store(true)
	leasesDone := make(chan struct{})
	go func() { defer close(leasesDone); s.runLeases(ctx) }()
	defer func() { <-leasesDone }()
	warmDone := make(chan struct{})
	go func() { defer close(warmDone); s.runWarm(ctx) }()
	defer func() { <-warmDone }()
	if s.cache != nil {
		cacheDone := make(chan struct{})
		go func() { defer close(cacheDone); s.cache.run(ctx) }()
		defer func() { <-cacheDone }()
		if s.IngressEnabled() {
			ingressDone := make(chan struct{})
			go func() { defer close(ingressDone); s.followIngress(ctx) }()
			defer func() { <-ingressDone }()
		}
	}
	t := time.NewTicker(s.cfg.ReconcileInterval)
	defer t.Stop()
	for {
		if err := s.pass(ctx); err != nil && ctx.Err() == nil {
			s.log.Warn("reconcile pass failed; retrying on the next tick", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// pass lists the project's instances once and kicks every one of ours that
// still has work to do.
func (s *Service) pass(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// The kept requests first: until they are read once, a use that
	// finds its target running waits for them (keptKnown).
	s.restorePending(ctx)
	since := s.ingress.mark()
	list, stale, err := s.instancesNoting(ctx)
	if err != nil {
		return err
	}
	s.refreshIngress(list, since, stale)
	for i := range list {
		inst := &list[i]
		if _, ok := ownerOf(inst); !ok {
			continue
		}
		if needsWork(inst) || s.landedAfterClosed(inst) {
			s.own.nudge(inst.Name)
		}
		s.forgetStaleLease(ctx, inst)
	}
	return nil
}

// landedAfterClosed says inst stands under a name this process answered
// closed, with no close recorded on it: it arrived after that answer.
func (s *Service) landedAfterClosed(inst *incus.Instance) bool {
	r := recordOf(inst.Config, fClosing|fWarmClaim)
	name := inst.Name
	if isReadyName(name) {
		name = r.WarmClaim // a ready spare handed out: its owner's name
	}
	return !r.has(fClosing) && name != "" && s.closed.has(name, s.now())
}

func needsWork(inst *incus.Instance) bool {
	st := StateOf(inst)
	switch {
	case st.Phase == controller.PhaseClosing:
		return true
	case st.Failure != "":
		return false
	case !st.Booted:
		return true
	}
	return st.PowerPending() || unmarkedDown(inst, st)
}

// converge takes one idempotent step towards the instance's intent and
// answers when to look at it again (see next), no later than an intent
// this process wrote is due to be checked (see written.go), unless the
// step failed. It is never run twice at once for one name (see owners).
func (s *Service) converge(ctx context.Context, name string) next {
	n := s.convergeStep(ctx, name)
	if look := s.written.lookIn(name, time.Now()); look > 0 && !n.failed && (n.in <= 0 || look < n.in) {
		n.in = look
	}
	return n
}

func (s *Service) convergeStep(ctx context.Context, name string) next {
	inst, err := s.lookup(ctx, name)
	if err != nil {
		if ctx.Err() == nil {
			s.logRetry("converge: read failed; retrying after a backoff", err, zap.String("instance", name))
		}
		return failedStep
	}
	if inst == nil {
		s.dialer.Forget(name)
		s.written.forget(name)
		s.progress.clear(name)
		s.ingress.drop(name)
		if w, ok := s.pending.get(name); ok {
			s.pending.done(name, w)
			s.clearPending(ctx, name, w)
		}
		return settled
	}
	if _, ok := ownerOf(inst); !ok {
		return settled
	}
	if _, ok := s.pending.get(name); ok {
		if !s.flushPending(ctx, name) {
			return lookIn(100 * time.Millisecond)
		}
		if inst, err = s.lookup(ctx, name); err != nil || inst == nil {
			return lookIn(100 * time.Millisecond)
		}
	}
	if s.rewriteOvertaken(ctx, inst) {
		if inst, err = s.lookup(ctx, name); err != nil || inst == nil {
			return lookIn(100 * time.Millisecond)
		}
	}
	if s.landedAfterClosed(inst) {
		// See closed.go: no one will close it but us.
		s.log.Warn("an instance appeared under a name this process answered closed; closing it",
			zap.String("instance", name))
		if err := s.patch(ctx, name, change{keys: fClosing, to: record{Closing: s.now()}}.config()); err != nil {
			if ctx.Err() == nil {
				s.logRetry("recording the close failed; retrying", err, zap.String("instance", name))
			}
			return failedStep
		}
		if inst, err = s.lookup(ctx, name); err != nil || inst == nil {
			return lookIn(100 * time.Millisecond)
		}
	}
	st := StateOf(inst)
	switch {
	case st.Phase == controller.PhaseClosing:
		s.progress.clear(name)
		if err := s.closeInstance(ctx, inst); err != nil && ctx.Err() == nil {
			if errors.Is(err, incus.ErrBusy) {
				// Another operation (a wake's start, a config write)
				// holds the instance for a moment: routine, not trouble.
				s.log.Debug("close step waits for another operation on the instance", zap.String("instance", name), zap.Error(err))
				return lookIn(250 * time.Millisecond)
			}
			s.log.Warn("close step failed; the reconciler retries", zap.String("instance", name), zap.Error(err))
			return failedStep
		}
		return settled
	case st.Failure != "":
		return settled
	case !st.Booted:
		return s.bringUp(ctx, inst)
	}
	return s.drivePower(ctx, inst)
}

// bringUp starts a created instance that never ran and marks it booted.
// bringUpRecheck is how soon a new instance that could not be brought up
// yet (an operation holds it, or it is in transition) is looked at again.
// The reconciler's pass would too, but the pass reads the observation
// cache, which may not have the new instance yet: a create must not depend
// on it (found in CI: a target left provisioning for 90 s).
const bringUpRecheck = 500 * time.Millisecond

// startRetry is how soon a new instance whose start failed is started again.
const startRetry = 2 * time.Second

// settleBeforeDelete bounds how long a close waits for the instance's own
// tasks (a create still unpacking its image) before deleting it anyway:
// beyond the slowest unpack measured here (seconds for the Debian image
// under CI's load), short of holding a close for good on a task Incus
// never ends.
const settleBeforeDelete = 2 * time.Minute

// bringUp starts a new instance and marks it booted, and answers when to
// look again (0: done, or failed for good).
func (s *Service) bringUp(ctx context.Context, inst *incus.Instance) next {
	name := inst.Name
	switch inst.Status {
	case incus.InstanceRunning, incus.InstanceReady, incus.InstanceFrozen, incus.InstanceFreezing, incus.InstanceThawed:
		// Running is not yet started: LXD shows a container Running while
		// its start operation still brings its devices up (a proxy device:
		// about a second), and refuses every change to it until then. A
		// target is active only once no operation holds it.
		if pending, err := s.createPending(ctx, name); err != nil || pending {
			return lookIn(bringUpRecheck)
		}
		if !s.markBooted(ctx, name) {
			return lookIn(bringUpRecheck)
		}
		return settled
	case incus.InstanceStopped:
	default:
		return lookIn(bringUpRecheck) // in transition
	}
	if pending, err := s.createPending(ctx, name); err != nil || pending {
		return lookIn(bringUpRecheck) // Incus is still creating (and starting) it
	}
	if err := s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionStart}, time.Minute); err != nil {
		if ctx.Err() != nil {
			return settled
		}
		if errors.Is(err, incus.ErrAlreadyRunning) {
			// The status read was older than a start that ended since (the
			// create's own, on a loaded Incus): no failure, and the next
			// look goes the running way.
			return lookIn(bringUpRecheck)
		}
		n := 1 // this attempt, and the starts that failed before it in a row
		if f := s.own.failures(name); f.step == stepStart {
			n += f.n
		}
		s.logRetry("starting a new instance failed", err, zap.String("instance", name), zap.Int("attempt", n))
		if n >= s.cfg.StartAttempts {
			msg := "The instance could not be started after several attempts; the provider's log has the details."
			if perr := s.patch(ctx, name, change{keys: fFailure, to: record{Failure: msg}}.config()); perr != nil {
				s.logRetry("recording the failure failed", perr, zap.String("instance", name))
				return failedStep
			}
			return settled
		}
		return failedAt(stepStart)
	}
	if !s.markBooted(ctx, name) {
		return lookIn(bringUpRecheck)
	}
	return settled
}

// markBooted records the first boot; false when Incus did not take it.
func (s *Service) markBooted(ctx context.Context, name string) bool {
	if err := s.patch(ctx, name, change{keys: fBooted, to: record{Booted: s.now()}}.config()); err != nil {
		s.logRetry("marking the instance booted failed; the reconciler retries", err, zap.String("instance", name))
		return false
	}
	s.changes.note(name)
	return true
}

// closeInstance stops the instance gracefully within what is left of the
// grace period since the close was recorded, then forcibly, then deletes it.
func (s *Service) closeInstance(ctx context.Context, inst *incus.Instance) error {
	name := inst.Name
	s.dialer.Forget(name)
	// A close can be recorded while Incus still unpacks the instance's
	// image (the record is written first). Incus takes a delete then, and
	// its storage driver races the unpack: the create fails, and the dir
	// driver leaves a half-removed root filesystem behind that fails every
	// later call on the name. So the delete waits for the instance's tasks.
	sctx, cancel := context.WithTimeout(ctx, settleBeforeDelete)
	waited, err := s.settled(sctx, name)
	cancel()
	if err != nil && ctx.Err() != nil {
		return err
	}
	if waited {
		// The task may have started it, or taken it away.
		now, err := s.lookup(ctx, name)
		if err != nil {
			return err
		}
		if now == nil {
			guest.Removed(s.dialer, name)
			return nil
		}
		inst = now
	}
	if inst.Status == incus.InstanceFrozen || inst.Status == incus.InstanceFreezing {
		// A frozen guest cannot shut itself down.
		_ = s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionUnfreeze}, 30*time.Second)
	}
	if inst.Status != incus.InstanceStopped {
		since := recordOf(inst.Config, fClosing).Closing
		if since.IsZero() {
			since = s.now()
		}
		// What is left of the grace since the close was recorded, so a
		// restarted provider does not grant a second full grace.
		if err := s.stop(ctx, name, s.cfg.GracefulStop-s.now().Sub(since), false); err != nil {
			return err
		}
	}
	// The socket goes before the instance does: a close is observed
	// closed the moment Incus no longer lists the instance (through the
	// cache's event, before this delete's wait returns), and whoever saw
	// that must not find the socket still there. A stopped instance does
	// not listen on it; a start would make it again.
	guest.Removed(s.dialer, name)
	err = s.owned(ctx, name, func(ctx context.Context) error {
		op, err := s.incus.DeleteInstance(ctx, name)
		s.listingChanged()
		if err != nil {
			return err
		}
		_, err = s.wait(ctx, op, time.Minute)
		return err
	})
	if err == nil {
		s.log.Info("deleted a closed target", zap.String("instance", name))
	}
	if lock := claimOf(inst); isReadyName(name) && isOwnerName(lock) && (err == nil || errors.Is(err, incus.ErrNotFound)) {
		// A ready spare's stand-in goes last (see ready.go).
		s.dropStandin(ctx, lock, name)
	}
	// Gone (or not): the idle loop reads it again, and the targets gauge
	// with it, instead of waiting for the next listing.
	s.changes.note(name)
	if err == nil || errors.Is(err, incus.ErrNotFound) {
		return nil
	}
	return err
}

func isAlreadyStopped(err error) bool { return errors.Is(err, incus.ErrAlreadyStopped) }

func (s *Service) wait(ctx context.Context, op *incus.Operation, most time.Duration) (*incus.Operation, error) {
	ctx, cancel := context.WithTimeout(ctx, most)
	defer cancel()
	return s.incus.Wait(ctx, op)
}

// listing is the last inventory of the project, shared by the reconciler
// and the idle loop: at 10,000 targets decoding it is most of their CPU.
type listing struct {
	mu   sync.Mutex
	at   time.Time
	list []incus.Instance
}

// instances lists the project's instances, reusing a listing younger than
// the reconcile interval. Callers only read it: every step that acts reads
// its instance again first, so a listing this old is never acted on blindly.
func (s *Service) instances(ctx context.Context) ([]incus.Instance, error) {
	list, _, err := s.instancesNoting(ctx)
	return list, err
}

// instancesNoting is instances, with the names whose item may predate a
// write this process made before the call (nil when none). Only the
// cache's listing has any: it is as new as the events it has heard, and
// the event of a write just made may still be on its way. Incus's own
// listing is asked for after every such write (listingChanged).
func (s *Service) instancesNoting(ctx context.Context) ([]incus.Instance, map[string]bool, error) {
	if s.cache != nil {
		if list, stale, ok := s.cache.listing(); ok {
			// The listing is not needed while the cache answers: at
			// 10,000 targets it is 40 MiB of decoded instances.
			s.listingChanged()
			return list, stale, nil
		}
	}
	s.listing.mu.Lock()
	defer s.listing.mu.Unlock()
	if s.listing.list != nil && s.now().Sub(s.listing.at) < s.cfg.ReconcileInterval {
		return s.listing.list, nil, nil
	}
	list, err := s.incus.ListInstances(ctx)
	if err != nil {
		return nil, nil, err
	}
	if list == nil {
		list = []incus.Instance{}
	}
	s.listing.at, s.listing.list = s.now(), list
	return list, nil, nil
}

// listingChanged drops the shared listing after a change this process made,
// so neither loop acts a period late on what it just did.
func (s *Service) listingChanged() {
	s.listing.mu.Lock()
	s.listing.list = nil
	s.listing.mu.Unlock()
}

// patch sets instance config keys (an empty value removes one).
// It holds the instance's turn (owner.go).
func (s *Service) patch(ctx context.Context, name string, set map[string]string) error {
	return s.owned(ctx, name, func(ctx context.Context) error {
		err := s.incus.PatchInstanceConfig(ctx, name, set)
		s.listingChanged()
		return err
	})
}

// next is what one converge answers its owner: when to look at the name
// again, or that the step failed.
type next struct {
	// in is how soon to look again; 0: when kicked, or at the next pass.
	in time.Duration
	// failed: the step could not be taken (Incus did not answer, or
	// refused); step says which kind of step it was. The owner counts the
	// name's failures of one kind in a row (a step of another kind, or one
	// that does not fail, starts the count over) and looks again after
	// that kind's backoff for the count, so that an Incus outage does not
	// meet every target's retry every two seconds.
	failed bool
	step   stepKind
}

// stepKind is the kind of a converge's step, for its failures' count and
// backoff: the name's one count lives in its owner entry.
type stepKind uint8

const (
	// stepOther: a read, a record, a close step. Backoff failFirst,
	// doubling, at most failMost.
	stepOther stepKind = iota
	// stepPower: a move to the recorded power. A runtime waits on it, and
	// the observation tells it when the next attempt is: from 250 ms,
	// doubling, at most 30 s.
	stepPower
	// stepStart: a new instance's first start. Counted, at a steady pace
	// (startRetry), so that StartAttempts failures fail the target in a
	// time a create's caller can know.
	stepStart
)

var (
	settled    = next{}
	failedStep = failedAt(stepOther)
)

func lookIn(d time.Duration) next { return next{in: d} }

// failedAt is a failed step of kind k.
func failedAt(k stepKind) next { return next{failed: true, step: k} }

// A name's backoff after its n-th failed step of stepOther in a row:
// failFirst, doubling, at most failMost.
const (
	failFirst = 2 * time.Second
	failMost  = time.Minute
)
