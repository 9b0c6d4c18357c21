package idle

import (
	"container/heap"
	"context"
	"math"
	"math/rand/v2"
	"time"

	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

// minDelay keeps a target that is due again at once from spinning the loop.
const minDelay = 10 * time.Millisecond

// fire evaluates every target whose time has come.
func (l *Loop) fire(now time.Time) {
	for len(l.queue) > 0 && !l.queue[0].due.After(now) {
		e := heap.Pop(&l.queue).(*entry)
		l.evaluate(e, now)
	}
}

func (l *Loop) evaluate(e *entry, now time.Time) {
	if e.gone || e.probing || e.acting || !e.t.Settled {
		return // rescheduled when the work ends, or by the next listing
	}
	if e.level == idlepolicy.ActionNone {
		if !e.queued {
			e.queued = true
			l.ready = append(l.ready, e)
		}
		return
	}
	l.evaluateDown(e, now)
}

// evaluateDown judges a powered-down target from the instant its idleness
// began: the recorded idle-since, or when the loop first saw it down.
func (l *Loop) evaluateDown(e *entry, now time.Time) {
	since := e.t.IdleSince
	if since.IsZero() {
		if e.downSince.IsZero() {
			e.downSince = truncMs(now)
		}
		since = e.downSince
	}
	idleMs := msSince(since, now)
	if a := e.t.Policy.DueAction(idleMs, e.t.Stages, e.level); a != idlepolicy.ActionNone {
		// A powered-down target's guest cannot answer: nothing was read,
		// and a relay would have woken it (the act then finds it stale).
		l.startAct(e, a, since, time.Time{})
		return
	}
	if th, ok := e.t.Policy.NextThreshold(idleMs, e.t.Stages, e.level); ok {
		l.scheduleAt(e, since.Add(msDuration(th)))
		return
	}
	l.unschedule(e)
}

// dispatch starts queued probes and actions while slots are free.
func (l *Loop) dispatch(ctx context.Context) {
	for l.probing < l.cfg.MaxProbes && len(l.ready) > 0 {
		e := l.ready[0]
		l.ready[0] = nil
		l.ready = l.ready[1:]
		e.queued = false
		if e.gone || e.probing || e.acting || e.level != idlepolicy.ActionNone || !e.t.Settled {
			continue
		}
		l.startProbe(ctx, e)
	}
	if len(l.ready) == 0 {
		l.ready = nil // let the backing array go
	}
	for l.acting < l.cfg.MaxActions && len(l.acts) > 0 {
		req := l.acts[0]
		l.acts[0] = nil
		l.acts = l.acts[1:]
		l.launchAct(ctx, req)
	}
}

func (l *Loop) scheduleIn(e *entry, d time.Duration) { l.scheduleAt(e, time.Now().Add(max(d, 0))) }

func (l *Loop) scheduleAt(e *entry, at time.Time) {
	if floor := time.Now().Add(minDelay); at.Before(floor) {
		at = floor
	}
	e.due = at
	if e.index >= 0 {
		heap.Fix(&l.queue, e.index)
		return
	}
	heap.Push(&l.queue, e)
}

func (l *Loop) unschedule(e *entry) {
	if e.index >= 0 {
		heap.Remove(&l.queue, e.index)
	}
}

// backoff is the wait after n failures in a row: half a second doubling,
// at most most. The first retries come soon, since a daemon that has just
// been started may not listen yet.
func backoff(n int, most time.Duration) time.Duration {
	d := 500 * time.Millisecond
	for i := 1; i < n && d < most; i++ {
		d *= 2
	}
	return jitter(min(d, most))
}

// jitter spreads a wait over its last tenth, never beyond it, so that
// targets found together drift apart and a ceiling stays a ceiling.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d - time.Duration(rand.Int64N(int64(d)/10+1))
}

func msSince(since, now time.Time) uint64 {
	d := now.Sub(since)
	if d <= 0 {
		return 0
	}
	return uint64(d / time.Millisecond)
}

func truncMs(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

// maxMs is the longest span a time.Duration holds, in milliseconds.
const maxMs = uint64(math.MaxInt64 / int64(time.Millisecond))

// msDuration converts milliseconds (below 2^53, so possibly beyond what a
// Duration holds) to a Duration, saturating at about 292 years.
func msDuration(ms uint64) time.Duration {
	if ms > maxMs {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(ms) * time.Millisecond
}

// dueQueue is a min-heap of scheduled entries by due time.
type dueQueue []*entry

func (q dueQueue) Len() int           { return len(q) }
func (q dueQueue) Less(i, j int) bool { return q[i].due.Before(q[j].due) }
func (q dueQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *dueQueue) Push(x any) {
	e := x.(*entry)
	e.index = len(*q)
	*q = append(*q, e)
}
func (q *dueQueue) Pop() any {
	old := *q
	n := len(old)
	e := old[n-1]
	old[n-1] = nil
	e.index = -1
	*q = old[:n-1]
	return e
}
