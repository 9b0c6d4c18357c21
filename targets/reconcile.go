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
	defer s.work.stop()
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
	since := s.ingress.mark()
	list, stale, err := s.instancesNoting(ctx)
	if err != nil {
		return err
	}
	s.refreshIngress(list, since, stale)
	s.restorePending(ctx)
	for i := range list {
		inst := &list[i]
		if _, ok := ownerOf(inst); !ok {
			continue
		}
		if needsWork(inst) || s.landedAfterClosed(inst) {
			s.work.nudge(inst.Name)
		}
		s.forgetStaleLease(ctx, inst)
	}
	return nil
}

// landedAfterClosed says inst stands under a name this process answered
// closed, with no close recorded on it: it arrived after that answer.
func (s *Service) landedAfterClosed(inst *incus.Instance) bool {
	return !recordOf(inst.Config, fClosing).has(fClosing) && s.closed.has(inst.Name, s.now())
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
// step failed. It is never run twice at once for one name (see worker).
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
			s.log.Warn("converge: read failed; retrying after a backoff", zap.String("instance", name), zap.Error(err))
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
		if f := s.work.failures(name); f.step == stepStart {
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
// It holds the instance's gate (owner.go).
func (s *Service) patch(ctx context.Context, name string, set map[string]string) error {
	return s.owned(ctx, name, func(ctx context.Context) error {
		err := s.incus.PatchInstanceConfig(ctx, name, set)
		s.listingChanged()
		return err
	})
}

// keyedMutex serializes work per instance name within this process; across
// processes the instance name itself is the lock. Waiting for it is bounded
// by the caller's context, so a method never outlives its answer bound
// behind another one stuck on a hung Incus.
type keyedMutex struct {
	mu    sync.Mutex
	locks map[string]*keyedEntry
}

type keyedEntry struct {
	slot chan struct{} // holds one token while the key is locked
	refs int
}

// lock takes the key's lock, or fails when ctx ends first.
func (k *keyedMutex) lock(ctx context.Context, key string) (unlock func(), err error) {
	unlock, _, err = k.lockWaited(ctx, key)
	return unlock, err
}

// lockWaited is lock, saying also whether the key was held by another
// when asked (what its holder read may have changed meanwhile).
func (k *keyedMutex) lockWaited(ctx context.Context, key string) (unlock func(), waited bool, err error) {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyedEntry{}
	}
	e := k.locks[key]
	if e == nil {
		e = &keyedEntry{slot: make(chan struct{}, 1)}
		k.locks[key] = e
	}
	e.refs++
	k.mu.Unlock()
	release := func() {
		k.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
	select {
	case e.slot <- struct{}{}:
	default:
		waited = true
		select {
		case e.slot <- struct{}{}:
		case <-ctx.Done():
			release()
			return nil, true, ctx.Err()
		}
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			<-e.slot
			release()
		})
	}, waited, nil
}

// next is what one converge answers its worker: when to look at the name
// again, or that the step failed.
type next struct {
	// in is how soon to look again; 0: when kicked, or at the next pass.
	in time.Duration
	// failed: the step could not be taken (Incus did not answer, or
	// refused); step says which kind of step it was. The worker counts the
	// name's failures of one kind in a row (a step of another kind, or one
	// that does not fail, starts the count over) and looks again after
	// that kind's backoff for the count, so that an Incus outage does not
	// meet every target's retry every two seconds.
	failed bool
	step   stepKind
}

// stepKind is the kind of a converge's step, for its failures' count and
// backoff: the name's one count lives in its worker.
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

// failBackoff is how long the n-th failure in a row of a step of kind k
// waits before the next attempt.
func (w *worker) failBackoff(k stepKind, n int) time.Duration {
	switch k {
	case stepPower:
		return min(250*time.Millisecond<<min(n-1, 7), 30*time.Second)
	case stepStart:
		return startRetry
	}
	return min(w.failFirst<<min(n-1, 16), w.failMost)
}

// failure is a name's count of failed steps of one kind in a row, and
// when the worker tries again.
type failure struct {
	step    stepKind
	n       int
	retryAt time.Time
}

// retryingLocked records when a failing name runs next, as scheduled
// (a kick or a look asked for may bring the backoff forward), for the
// observation that states it.
func (w *worker) retryingLocked(name string, in time.Duration) {
	if f, ok := w.fails[name]; ok {
		f.retryAt = time.Now().Add(in)
		w.fails[name] = f
	}
}

// failures answers name's count of failed steps in a row (zero: the last
// step did not fail), their kind and when the next attempt is due.
func (w *worker) failures(name string) failure {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.fails[name]
}

// worker runs one converge per name at a time, on at most max goroutines,
// in the manner of client-go's workqueue: a kick of a name that is not
// running queues it behind the names already waiting (first kicked, first
// run), a kick during a run asks for one more run after it, and a run may
// ask for another after a delay (a retry). A name run again while others
// wait goes to the back of the queue, so that one busy name cannot starve
// the rest. The bound keeps a reconcile pass over thousands of instances,
// or a night's idle power-downs, from sending Incus one request per
// instance at once. It owns every goroutine and timer it starts.
type worker struct {
	fn     func(ctx context.Context, name string) next
	max    int
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	jobs    map[string]*job // running or queued
	queue   []string        // queued names, in kick order
	running int             // goroutines running converges
	timers  map[string]*retryTimer
	fails   map[string]failure // failed steps in a row, by name
	// failFirst and failMost bound a name's backoff (failBackoff); tests
	// shorten them.
	failFirst, failMost time.Duration
}

// retryTimer is a pending kick and when it fires.
type retryTimer struct {
	t  *time.Timer
	at time.Time
}

type job struct {
	queued bool // waiting for a free goroutine; its run has not started
	again  bool
	nudged bool          // a pass looked while it ran (nudge): again, unless the run fails
	lookAt time.Time     // a look asked for (soon) while it ran; zero: none
	done   chan struct{} // closed when the run that covers the latest kick ends
	next   chan struct{}
}

// convergeWorkers bounds the converges under way at once. A converge is a
// few Incus calls, or one state change and its wait (a graceful stop: up
// to GracefulStop); wakes and the controller's methods act under the
// instance's gate themselves and never wait for a free worker, except a
// method's bounded wait for the step it kicked.
const convergeWorkers = 32

func newWorker(fn func(ctx context.Context, name string) next) *worker {
	return newWorkerOf(convergeWorkers, fn)
}

func newWorkerOf(max int, fn func(ctx context.Context, name string) next) *worker {
	ctx, cancel := context.WithCancel(context.Background())
	return &worker{fn: fn, max: max, ctx: ctx, cancel: cancel, jobs: map[string]*job{},
		timers: map[string]*retryTimer{}, fails: map[string]failure{}, failFirst: failFirst, failMost: failMost}
}

// kick schedules a converge of name and returns a channel closed once a run
// that started after this kick has finished.
func (w *worker) kick(name string) <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.kickLocked(name)
}

func (w *worker) kickLocked(name string) <-chan struct{} {
	if r := w.timers[name]; r != nil {
		r.t.Stop() // this run covers the retry
		delete(w.timers, name)
	}
	if j, ok := w.jobs[name]; ok {
		if j.queued {
			return j.done // its run starts after this kick
		}
		j.again = true
		if j.next == nil {
			j.next = make(chan struct{})
		}
		return j.next
	}
	if w.ctx.Err() != nil {
		closed := make(chan struct{})
		close(closed)
		return closed
	}
	j := &job{done: make(chan struct{})}
	w.jobs[name] = j
	if w.running < w.max {
		w.running++
		w.wg.Add(1)
		go w.run(name, j)
	} else {
		j.queued = true
		w.queue = append(w.queue, name)
	}
	return j.done
}

// run is one of the worker's goroutines: it converges name, then the
// names queued meanwhile, until none waits.
func (w *worker) run(name string, j *job) {
	defer w.wg.Done()
	for {
		n := w.fn(w.ctx, name)
		w.mu.Lock()
		again := n.in
		if n.failed && w.ctx.Err() == nil {
			f := w.fails[name]
			if f.step != n.step {
				f = failure{step: n.step}
			}
			f.n++
			again = w.failBackoff(f.step, f.n)
			w.fails[name] = f
		} else {
			delete(w.fails, name)
		}
		if j.nudged {
			j.nudged = false
			if !n.failed && !j.again {
				j.again = true
				j.next = make(chan struct{})
			}
		}
		close(j.done)
		if j.again && w.ctx.Err() == nil {
			w.retryingLocked(name, 0) // a kick during the run: it runs again now
			j.again, j.done, j.next = false, j.next, nil
			if !j.lookAt.After(time.Now()) {
				j.lookAt = time.Time{} // the run starting next is that look
			}
			if len(w.queue) == 0 {
				w.mu.Unlock()
				continue
			}
			j.queued = true
			w.queue = append(w.queue, name)
		} else {
			if j.next != nil {
				close(j.next)
			}
			delete(w.jobs, name)
			if !j.lookAt.IsZero() {
				// The run may have said when to look again before the
				// look was asked for: the sooner of the two.
				if in := max(time.Until(j.lookAt), time.Millisecond); again <= 0 || in < again {
					again = in
				}
			}
			if again > 0 && w.ctx.Err() == nil {
				w.retryingLocked(name, again)
				w.retryLocked(name, again)
			}
		}
		if name, j = w.nextLocked(); j == nil {
			w.running--
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
	}
}

// nextLocked takes the first queued name off the queue; nil once none
// waits, or the worker is stopping.
func (w *worker) nextLocked() (string, *job) {
	for len(w.queue) > 0 && w.ctx.Err() == nil {
		name := w.queue[0]
		w.queue[0] = ""
		w.queue = w.queue[1:]
		if j := w.jobs[name]; j != nil && j.queued {
			j.queued = false
			return name, j
		}
	}
	return "", nil
}

// nudge kicks name unless a run of it is due already: a reconcile pass's
// look, which must not cut short a name's backoff after a failure (a
// method's kick does: a caller is waiting).
func (w *worker) nudge(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, due := w.timers[name]; due {
		return
	}
	if j, ok := w.jobs[name]; ok && !j.queued {
		// Running: another run after it, unless this one fails and its
		// backoff decides when the next is.
		j.nudged = true
		return
	}
	w.kickLocked(name)
}

// soon kicks name after d, unless a kick or a retry is already due by
// then: a run then returns when to look again itself. A retry due later
// (a backoff of minutes) is brought forward, or the look a write asked for
// would wait for it.
func (w *worker) soon(name string, d time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if r, due := w.timers[name]; (due && !r.at.After(time.Now().Add(d))) || w.ctx.Err() != nil {
		return
	}
	if j, running := w.jobs[name]; running {
		// The run may have said when to look again before this write:
		// its end takes the sooner of the two. Kicking another run now
		// would read the instance once more for nothing.
		if at := time.Now().Add(d); j.lookAt.IsZero() || at.Before(j.lookAt) {
			j.lookAt = at
		}
		return
	}
	w.retryLocked(name, d)
}

// retryLocked kicks name again after d, unless a kick comes first.
func (w *worker) retryLocked(name string, d time.Duration) {
	if r := w.timers[name]; r != nil {
		r.t.Stop()
	}
	r := &retryTimer{at: time.Now().Add(d)}
	r.t = time.AfterFunc(d, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.timers[name] != r || w.ctx.Err() != nil {
			return
		}
		delete(w.timers, name)
		w.kickLocked(name)
	})
	w.timers[name] = r
}

// spawn runs fn on a goroutine the worker owns; false when it is stopping.
func (w *worker) spawn(fn func(ctx context.Context)) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ctx.Err() != nil {
		return false
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		fn(w.ctx)
	}()
	return true
}

func (w *worker) stop() {
	w.mu.Lock()
	w.cancel()
	for name, r := range w.timers {
		r.t.Stop()
		delete(w.timers, name)
	}
	// Queued names will not run: whoever waits for them hears so now.
	for _, name := range w.queue {
		if j := w.jobs[name]; j != nil && j.queued {
			close(j.done)
			delete(w.jobs, name)
		}
	}
	w.queue = nil
	w.mu.Unlock()
	w.wg.Wait()
}
