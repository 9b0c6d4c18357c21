package targets

import (
	"context"
	"sync"
	"time"
)

// owners is this process's one owner of every instance (see owner.go): by
// name, the instance's turn, its converge and its request, under one lock.
// It owns every goroutine and timer it starts.
type owners struct {
	// fn is one converge step of a name; it answers when to run again.
	fn func(ctx context.Context, name string) next
	// max bounds the converges running at once: a reconcile pass over
	// thousands of instances, or a night's idle power-downs, must not
	// send Incus one request per instance at once.
	max    int
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	keys    map[string]*ownedKey
	queue   []string // names whose converge waits for a goroutine, first kicked first
	running int      // goroutines running converges
	// failFirst and failMost bound a name's backoff (failBackoff); tests
	// shorten them.
	failFirst, failMost time.Duration
}

// ownedKey is one instance's entry. It lives while anything in it is in
// use, and is dropped once nothing is (idleLocked).
type ownedKey struct {
	turn    slot // acting on the instance in Incus
	request slot // a controller request deciding about it

	job   *job        // its converge, running or queued; nil: none
	timer *retryTimer // its converge's next run, when one is due later
	fail  failure     // its converge's failed steps in a row
}

func (k *ownedKey) idleLocked() bool {
	return !k.turn.held && len(k.turn.waiting) == 0 && !k.request.held && len(k.request.waiting) == 0 &&
		k.job == nil && k.timer == nil && k.fail.n == 0
}

// slot is a right held by one at a time and handed on in order: urgent
// waiters first, in the order they came, then the others.
type slot struct {
	held    bool
	waiting []*slotWait
	// yield ends the holder's optional work (see owners.yielding) when an
	// urgent waiter comes; nil: the holder's work is not optional.
	yield context.CancelFunc
}

type slotWait struct {
	handed chan struct{} // closed when the slot is handed to this waiter
	urgent bool
}

// convergeWorkers bounds the converges under way at once. A converge is a
// few Incus calls, or one state change and its wait (a graceful stop: up
// to GracefulStop); wakes and the controller's methods act holding the
// turn themselves and never wait for a free goroutine, except a method's
// bounded wait for the step it kicked.
const convergeWorkers = 32

func newOwner(fn func(ctx context.Context, name string) next) *owners {
	return newOwnerOf(convergeWorkers, fn)
}

func newOwnerOf(max int, fn func(ctx context.Context, name string) next) *owners {
	ctx, cancel := context.WithCancel(context.Background())
	return &owners{fn: fn, max: max, ctx: ctx, cancel: cancel, keys: map[string]*ownedKey{},
		failFirst: failFirst, failMost: failMost}
}

func (o *owners) keyLocked(name string) *ownedKey {
	k := o.keys[name]
	if k == nil {
		k = &ownedKey{}
		o.keys[name] = k
	}
	return k
}

// forgetLocked drops name's entry once nothing in it is in use.
func (o *owners) forgetLocked(name string) {
	if k := o.keys[name]; k != nil && k.idleLocked() {
		delete(o.keys, name)
	}
}

// take takes name's turn, waiting for it within ctx; urgent waiters (a
// wake) go before the others. waited says another held it when asked:
// what the caller read before may be older than that holder's work.
func (o *owners) take(ctx context.Context, name string, urgent bool) (release func(), waited bool, err error) {
	return o.acquire(ctx, name, func(k *ownedKey) *slot { return &k.turn }, urgent)
}

// yielding is ctx for work the holder of name's turn may skip (marking a
// power-down carried out, which lists every Incus task: on a cluster with
// a member slow to answer, seconds): it ends as soon as an urgent waiter
// (a wake) asks for the turn, or at once when one already waits, so that
// no dial waits on work nobody needs. The caller holds the turn; done
// ends the section, which must end before the hold does. A section within
// another is given the outer one's context, or one made from it.
func (o *owners) yielding(ctx context.Context, name string) (yctx context.Context, done func()) {
	yctx, cancel := context.WithCancel(ctx)
	o.mu.Lock()
	defer o.mu.Unlock()
	k := o.keys[name]
	if k == nil || !k.turn.held {
		return yctx, cancel // not held: nothing to yield to
	}
	if len(k.turn.waiting) > 0 && k.turn.waiting[0].urgent {
		cancel()
		return yctx, cancel
	}
	if k.turn.yield != nil {
		// Within an outer section, whose end ctx carries.
		return yctx, cancel
	}
	k.turn.yield = cancel
	return yctx, func() {
		o.mu.Lock()
		if k := o.keys[name]; k != nil && k.turn.held {
			k.turn.yield = nil
		}
		o.mu.Unlock()
		cancel()
	}
}

// heldNow says name's turn is held at this moment: a caller about to wait
// for it may start, meanwhile, what it does should the wait fail.
func (o *owners) heldNow(name string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	k := o.keys[name]
	return k != nil && k.turn.held
}

// request takes name's request slot within ctx.
func (o *owners) request(ctx context.Context, name string) (release func(), err error) {
	release, _, err = o.acquire(ctx, name, func(k *ownedKey) *slot { return &k.request }, false)
	return release, err
}

func (o *owners) acquire(ctx context.Context, name string, which func(*ownedKey) *slot, urgent bool) (release func(), waited bool, err error) {
	o.mu.Lock()
	k := o.keyLocked(name)
	sl := which(k)
	if !sl.held {
		sl.held = true
		o.mu.Unlock()
		return o.releaser(name, which), false, nil
	}
	w := &slotWait{handed: make(chan struct{}), urgent: urgent}
	at := len(sl.waiting)
	if urgent {
		if sl.yield != nil {
			sl.yield()
		}
		at = 0
		for at < len(sl.waiting) && sl.waiting[at].urgent {
			at++
		}
	}
	sl.waiting = append(sl.waiting, nil)
	copy(sl.waiting[at+1:], sl.waiting[at:])
	sl.waiting[at] = w
	o.mu.Unlock()
	select {
	case <-w.handed:
		return o.releaser(name, which), true, nil
	case <-ctx.Done():
	}
	o.mu.Lock()
	for i, x := range sl.waiting {
		if x == w {
			sl.waiting = append(sl.waiting[:i], sl.waiting[i+1:]...)
			o.forgetLocked(name)
			o.mu.Unlock()
			return nil, true, ctx.Err()
		}
	}
	o.mu.Unlock()
	// Handed to this waiter as its wait ended: hand it on.
	o.releaser(name, which)()
	return nil, true, ctx.Err()
}

// releaser is the release of a slot its caller holds; a second call does
// nothing.
func (o *owners) releaser(name string, which func(*ownedKey) *slot) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			o.mu.Lock()
			defer o.mu.Unlock()
			sl := which(o.keys[name])
			sl.yield = nil // the holder's optional work ends with its hold
			if len(sl.waiting) > 0 {
				w := sl.waiting[0]
				sl.waiting[0] = nil
				sl.waiting = sl.waiting[1:]
				close(w.handed) // held still, by w now
				return
			}
			sl.held = false
			o.forgetLocked(name)
		})
	}
}

// The converge: one run per name at a time, on at most max goroutines, in
// the manner of client-go's workqueue. A kick of a name that is not
// running queues it behind the names already waiting (first kicked, first
// run), a kick during a run asks for one more run after it, and a run may
// ask for another after a delay (a retry). A name run again while others
// wait goes to the back of the queue, so that one busy name cannot starve
// the rest.

// failBackoff is how long the n-th failure in a row of a step of kind k
// waits before the next attempt.
func (o *owners) failBackoff(k stepKind, n int) time.Duration {
	switch k {
	case stepPower:
		return min(250*time.Millisecond<<min(n-1, 7), 30*time.Second)
	case stepStart:
		return startRetry
	}
	return min(o.failFirst<<min(n-1, 16), o.failMost)
}

// failure is a name's count of failed steps of one kind in a row, and
// when its converge runs again.
type failure struct {
	step    stepKind
	n       int
	retryAt time.Time
}

// failures answers name's count of failed steps in a row (zero: the last
// step did not fail), their kind and when the next attempt is due.
func (o *owners) failures(name string) failure {
	o.mu.Lock()
	defer o.mu.Unlock()
	if k := o.keys[name]; k != nil {
		return k.fail
	}
	return failure{}
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

// kick schedules a converge of name and returns a channel closed once a run
// that started after this kick has finished.
func (o *owners) kick(name string) <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.kickLocked(name)
}

func (o *owners) kickLocked(name string) <-chan struct{} {
	k := o.keyLocked(name)
	if k.timer != nil {
		k.timer.t.Stop() // this run covers the retry
		k.timer = nil
	}
	if j := k.job; j != nil {
		if j.queued {
			return j.done // its run starts after this kick
		}
		j.again = true
		if j.next == nil {
			j.next = make(chan struct{})
		}
		return j.next
	}
	if o.ctx.Err() != nil {
		o.forgetLocked(name)
		closed := make(chan struct{})
		close(closed)
		return closed
	}
	j := &job{done: make(chan struct{})}
	k.job = j
	if o.running < o.max {
		o.running++
		o.wg.Add(1)
		go o.run(name, j)
	} else {
		j.queued = true
		o.queue = append(o.queue, name)
	}
	return j.done
}

// run is one of the pool's goroutines: it converges name, then the names
// queued meanwhile, until none waits.
func (o *owners) run(name string, j *job) {
	defer o.wg.Done()
	for {
		n := o.fn(o.ctx, name)
		o.mu.Lock()
		k := o.keys[name] // held by j until the run lets go of it
		again := n.in
		if n.failed && o.ctx.Err() == nil {
			f := k.fail
			if f.step != n.step {
				f = failure{step: n.step}
			}
			f.n++
			again = o.failBackoff(f.step, f.n)
			k.fail = f
		} else {
			k.fail = failure{}
		}
		if j.nudged {
			j.nudged = false
			if !n.failed && !j.again {
				j.again = true
				j.next = make(chan struct{})
			}
		}
		close(j.done)
		if j.again && o.ctx.Err() == nil {
			o.retryingLocked(k, 0) // a kick during the run: it runs again now
			j.again, j.done, j.next = false, j.next, nil
			if !j.lookAt.After(time.Now()) {
				j.lookAt = time.Time{} // the run starting next is that look
			}
			if len(o.queue) == 0 {
				o.mu.Unlock()
				continue
			}
			j.queued = true
			o.queue = append(o.queue, name)
		} else {
			if j.next != nil {
				close(j.next)
			}
			k.job = nil
			if !j.lookAt.IsZero() {
				// The run may have said when to look again before the
				// look was asked for: the sooner of the two.
				if in := max(time.Until(j.lookAt), time.Millisecond); again <= 0 || in < again {
					again = in
				}
			}
			if again > 0 && o.ctx.Err() == nil {
				o.retryingLocked(k, again)
				o.retryLocked(name, again)
			}
			o.forgetLocked(name)
		}
		if name, j = o.nextLocked(); j == nil {
			o.running--
			o.mu.Unlock()
			return
		}
		o.mu.Unlock()
	}
}

// retryingLocked records when a failing name runs next, as scheduled
// (a kick or a look asked for may bring the backoff forward), for the
// observation that states it.
func (o *owners) retryingLocked(k *ownedKey, in time.Duration) {
	if k.fail.n > 0 {
		k.fail.retryAt = time.Now().Add(in)
	}
}

// nextLocked takes the first queued name off the queue; nil once none
// waits, or the pool is stopping.
func (o *owners) nextLocked() (string, *job) {
	for len(o.queue) > 0 && o.ctx.Err() == nil {
		name := o.queue[0]
		o.queue[0] = ""
		o.queue = o.queue[1:]
		if k := o.keys[name]; k != nil && k.job != nil && k.job.queued {
			k.job.queued = false
			return name, k.job
		}
	}
	return "", nil
}

// nudge kicks name unless a run of it is due already: a reconcile pass's
// look, which must not cut short a name's backoff after a failure (a
// method's kick does: a caller is waiting).
func (o *owners) nudge(name string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if k := o.keys[name]; k != nil {
		if k.timer != nil {
			return
		}
		if j := k.job; j != nil && !j.queued {
			// Running: another run after it, unless this one fails and
			// its backoff decides when the next is.
			j.nudged = true
			return
		}
	}
	o.kickLocked(name)
}

// soon kicks name after d, unless a kick or a retry is already due by
// then: a run then returns when to look again itself. A retry due later
// (a backoff of minutes) is brought forward, or the look a write asked for
// would wait for it.
func (o *owners) soon(name string, d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ctx.Err() != nil {
		return
	}
	k := o.keyLocked(name)
	if k.timer != nil && !k.timer.at.After(time.Now().Add(d)) {
		return
	}
	if j := k.job; j != nil {
		// The run may have said when to look again before this write:
		// its end takes the sooner of the two. Kicking another run now
		// would read the instance once more for nothing.
		if at := time.Now().Add(d); j.lookAt.IsZero() || at.Before(j.lookAt) {
			j.lookAt = at
		}
		return
	}
	o.retryLocked(name, d)
}

// retryLocked kicks name again after d, unless a kick comes first.
func (o *owners) retryLocked(name string, d time.Duration) {
	k := o.keyLocked(name)
	if k.timer != nil {
		k.timer.t.Stop()
	}
	r := &retryTimer{at: time.Now().Add(d)}
	r.t = time.AfterFunc(d, func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		k := o.keys[name]
		if k == nil || k.timer != r || o.ctx.Err() != nil {
			return
		}
		k.timer = nil
		o.kickLocked(name)
	})
	k.timer = r
}

// spawn runs fn on a goroutine the owner keeps track of; false when it is
// stopping.
func (o *owners) spawn(fn func(ctx context.Context)) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ctx.Err() != nil {
		return false
	}
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		fn(o.ctx)
	}()
	return true
}

// stop ends the converges and the goroutines spawned, and waits for them.
// The turn and the request go on serving whoever still takes them.
func (o *owners) stop() {
	o.mu.Lock()
	o.cancel()
	for name, k := range o.keys {
		if k.timer != nil {
			k.timer.t.Stop()
			k.timer = nil
		}
		// Queued names will not run: whoever waits for them hears so now.
		if j := k.job; j != nil && j.queued {
			close(j.done)
			k.job = nil
		}
		o.forgetLocked(name)
	}
	o.queue = nil
	o.mu.Unlock()
	o.wg.Wait()
}
