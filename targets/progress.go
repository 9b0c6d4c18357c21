package targets

import (
	"fmt"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// progress is what a power move this process carries out waits for. It is
// for people (the observation's message); no decision reads it, since
// another process may carry out the move instead.
type progress struct {
	to controller.Power
	// waiting counts the data connections a power-down waits to see closed.
	waiting int
	// elsewhere counts the other replicas whose relays it waits for.
	elsewhere int
	// failures counts attempts that failed in a row and retryAt is the
	// next: the owner's count (failures), copied in when observed.
	failures int
	retryAt  time.Time
	// unrecorded: the request is kept in memory until Incus takes it.
	unrecorded bool
}

// detail is the message's tail: what the move to `to` waits for, or "".
// Progress of a move to another power (one a newer request replaced) says
// nothing of this one.
func (p *progress) detail(to controller.Power, now time.Time) string {
	switch {
	case p == nil || p.to != to:
		return ""
	case p.waiting == 1:
		return ": waiting for 1 data connection to close"
	case p.waiting > 1:
		return fmt.Sprintf(": waiting for %d data connections to close", p.waiting)
	case p.elsewhere == 1:
		return ": waiting for another provider replica's data connections to close"
	case p.elsewhere > 1:
		return fmt.Sprintf(": waiting for the data connections of %d other provider replicas to close", p.elsewhere)
	case p.unrecorded:
		return ": waiting for Incus to take the request"
	case p.failures > 0:
		in := max(p.retryAt.Sub(now), 0).Round(100 * time.Millisecond)
		return fmt.Sprintf(": the last attempt failed; retrying in %s", in)
	}
	return ""
}

// progressTable holds the progress of every move in flight, by instance.
type progressTable struct {
	mu sync.Mutex
	m  map[string]*progress
}

func (t *progressTable) get(name string) *progress {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p := t.m[name]; p != nil {
		c := *p
		return &c
	}
	return nil
}

func (t *progressTable) update(name string, to controller.Power, fn func(p *progress)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]*progress{}
	}
	p := t.m[name]
	if p == nil || p.to != to {
		p = &progress{to: to}
		t.m[name] = p
	}
	fn(p)
}

// waiting records how many data connections the move to `to` waits for.
func (t *progressTable) waiting(name string, to controller.Power, n int) {
	t.update(name, to, func(p *progress) { p.waiting, p.elsewhere = n, 0 })
}

func (t *progressTable) waitingElsewhere(name string, to controller.Power, n int) {
	t.update(name, to, func(p *progress) { p.waiting, p.elsewhere = 0, n })
}

func (t *progressTable) clear(name string) {
	t.mu.Lock()
	delete(t.m, name)
	t.mu.Unlock()
}
