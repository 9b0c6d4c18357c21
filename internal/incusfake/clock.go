package incusfake

import (
	"container/heap"
	"sync"
	"time"
)

// clock runs the fake's timed work (operations that end, writes that
// apply) either in real time or, when manual, only as far as Advance
// moves it: a test then decides exactly which of two due things happens
// first, and nothing depends on the machine's speed.
//
// Timed work always runs with fireMu held, from the firing goroutine or
// from Advance, never from the code that scheduled it: that code usually
// holds the server's lock, which the work takes too.
type clock struct {
	manual bool

	mu     sync.Mutex
	now    time.Time // the manual time; unused in real time
	seq    uint64
	timers timerHeap
	wake   chan struct{} // capacity 1: a nudge to the firing goroutine

	fireMu sync.Mutex // one firer at a time, so that work runs in due order
}

type timer struct {
	due   time.Time
	seq   uint64 // ties in due time fire in scheduling order
	fn    func()
	index int // in the heap; -1 once fired or stopped
}

func newClock(manual bool, start time.Time) *clock {
	return &clock{manual: manual, now: start, wake: make(chan struct{}, 1)}
}

func (c *clock) Now() time.Time {
	if !c.manual {
		return time.Now()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// after schedules fn d from now. A zero or negative d is due at once and
// still runs on the firing goroutine.
func (c *clock) after(d time.Duration, fn func()) *timer {
	c.mu.Lock()
	now := c.now
	if !c.manual {
		now = time.Now()
	}
	c.seq++
	t := &timer{due: now.Add(d), seq: c.seq, fn: fn}
	heap.Push(&c.timers, t)
	c.mu.Unlock()
	c.nudge()
	return t
}

// stop unschedules t; false when it already fired or was stopped.
func (c *clock) stop(t *timer) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t == nil || t.index < 0 {
		return false
	}
	heap.Remove(&c.timers, t.index)
	return true
}

func (c *clock) nudge() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// popDue takes the earliest timer due by limit, moving the manual time to
// its due time; nil when none is due.
func (c *clock) popDue(limit time.Time) *timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.timers) == 0 || c.timers[0].due.After(limit) {
		return nil
	}
	t := heap.Pop(&c.timers).(*timer)
	if c.manual && t.due.After(c.now) {
		c.now = t.due
	}
	return t
}

// fireDue runs every timer due by limit (manual: by the manual time),
// including those the work itself schedules within it.
func (c *clock) fireDue(limit func() time.Time) {
	c.fireMu.Lock()
	defer c.fireMu.Unlock()
	// Bounded by the work due: each pass pops one timer, and work that
	// keeps scheduling more at zero delay would be a bug in the fake.
	for range maxFiresPerPass {
		t := c.popDue(limit())
		if t == nil {
			return
		}
		t.fn()
	}
}

// maxFiresPerPass bounds one firing pass; what is left fires at the next.
const maxFiresPerPass = 100000

// Advance moves the manual time on by d, running in order everything due
// on the way, and returns once that has run. It does nothing in real time.
func (c *clock) Advance(d time.Duration) {
	if !c.manual {
		return
	}
	c.mu.Lock()
	target := c.now.Add(d)
	c.mu.Unlock()
	c.fireDue(func() time.Time { return target })
	c.mu.Lock()
	if target.After(c.now) {
		c.now = target
	}
	c.mu.Unlock()
}

// run fires due timers until done closes: in real time as they fall due,
// in manual time those due at once (zero delays).
func (c *clock) run(done <-chan struct{}) {
	for {
		c.fireDue(c.Now)
		var wait <-chan time.Time
		var t *time.Timer
		c.mu.Lock()
		if !c.manual && len(c.timers) > 0 {
			t = time.NewTimer(time.Until(c.timers[0].due))
			wait = t.C
		}
		c.mu.Unlock()
		select {
		case <-done:
		case <-c.wake:
		case <-wait:
		}
		if t != nil {
			t.Stop()
		}
		select {
		case <-done:
			return
		default:
		}
	}
}

type timerHeap []*timer

func (h timerHeap) Len() int { return len(h) }
func (h timerHeap) Less(i, j int) bool {
	if h[i].due.Equal(h[j].due) {
		return h[i].seq < h[j].seq
	}
	return h[i].due.Before(h[j].due)
}
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *timerHeap) Push(x any) {
	t := x.(*timer)
	t.index = len(*h)
	*h = append(*h, t)
}
func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	t.index = -1
	*h = old[:len(old)-1]
	return t
}
