package devguest

import (
	"sync"
	"time"
)

// idleClock measures how long the environment has gone unused, on the
// monotonic clock. Requests that count as use touch it; running work
// (process roots, leftover groups) holds it at zero, and the clock restarts
// when the last of that work ends.
type idleClock struct {
	mu       sync.Mutex
	now      func() time.Time
	lastUse  time.Time
	roots    int // process roots that have not exited
	leftover int // groups whose root exited but whose members live
}

func newIdleClock(now func() time.Time) *idleClock {
	return &idleClock{now: now, lastUse: now()}
}

// touch records a use.
func (c *idleClock) touch() {
	c.mu.Lock()
	c.lastUse = c.now()
	c.mu.Unlock()
}

func (c *idleClock) rootStarted() {
	c.mu.Lock()
	c.roots++
	c.mu.Unlock()
}

// rootEnded moves a root from running to leftover (when its group lives on) or to nothing.
func (c *idleClock) rootEnded(groupAlive bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.roots--
	if groupAlive {
		c.leftover++
	}
	c.restartIfQuiet()
}

func (c *idleClock) leftoverEnded() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.leftover--
	c.restartIfQuiet()
}

func (c *idleClock) restartIfQuiet() {
	if c.roots == 0 && c.leftover == 0 {
		c.lastUse = c.now()
	}
}

// idleFor is zero while work runs, otherwise the time since the last use.
func (c *idleClock) idleFor() (d time.Duration, roots, leftover int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.roots > 0 || c.leftover > 0 {
		return 0, c.roots, c.leftover
	}
	d = c.now().Sub(c.lastUse)
	if d < 0 {
		d = 0
	}
	return d, 0, 0
}
