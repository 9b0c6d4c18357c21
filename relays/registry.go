// Package relays is the registry of the data connections the provider
// relays to its targets and of the dials of their data routes in progress.
// It is built once per process and given to both sides that need it: the
// data routes, which enter every dial and relay in it, and the targets,
// which consult it before any power-down, because the provider never powers
// a target down while it relays a data connection to it.
package relays

import (
	"context"
	"sync"
	"time"
)

// GoingAway is the WebSocket close code a relay is sent before a power-down
// or a shutdown (RFC 6455: the endpoint is going away).
const GoingAway = 1001

// Conn is one relayed data connection, as the registry holds it.
type Conn interface {
	// GoAway sends both ends a close frame with code and reason; the
	// connection ends once both have answered it, or after its own wait.
	GoAway(code int, reason, why string)
	// Kill ends the connection at once, without waiting for any answer.
	Kill(why string)
	// Done is closed once the connection has ended.
	Done() <-chan struct{}
}

// Registry knows, per Incus instance, the relays open to it and the dials
// of its data route in progress.
type Registry struct {
	// closeWait bounds how long a relay told to go away may take to end
	// before it is killed.
	closeWait time.Duration

	mu      sync.Mutex
	entries map[string]*entry
	total   int
	hooks   []func(instance string)

	// opened gets a token whenever an instance's first relay opens, so that
	// whoever announces this process's relays to other replicas does so at
	// once (Opened).
	opened chan struct{}

	// ended is when each instance's latest relay or dial ended, for
	// EndedSince; entries older than endedMemory are swept once the map
	// has doubled since the last sweep.
	ended     map[string]time.Time
	sweptSize int
}

// endedMemory is how far back EndedSince can tell: an idle reading is
// acted on seconds after it is taken, and one older than this counts as
// overtaken by a relay.
const endedMemory = 10 * time.Minute

type entry struct {
	// conns are the relays, each with its dial's arrival (a power-down
	// asked before it does not outrank it, see Drain).
	conns map[Conn]time.Time
	// tickets are the dials in progress, and wakes under way.
	tickets map[*Ticket]struct{}
	quiet   chan struct{} // non-nil while a power-down holds new dials off
	// changed is closed (and replaced) whenever conns or tickets shrink,
	// so a drain waits on events rather than polling.
	changed chan struct{}
}

// New builds a registry; closeWait bounds the wait for a relay to end after
// its going-away close (default 3 s).
func New(closeWait time.Duration) *Registry {
	if closeWait <= 0 {
		closeWait = 3 * time.Second
	}
	return &Registry{closeWait: closeWait, entries: map[string]*entry{}, opened: make(chan struct{}, 1), ended: map[string]time.Time{}}
}

// EndedSince says whether a relay or a dial of the instance ended at or
// after since: a use the daemon may have seen after an idle reading taken
// then, though nothing relays now. A zero since asks nothing.
func (g *Registry) EndedSince(instance string, since time.Time) bool {
	if since.IsZero() {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if time.Since(since) > endedMemory {
		return true // older than what is kept: it cannot be told apart
	}
	at, ok := g.ended[instance]
	return ok && !at.Before(since)
}

// endLocked notes that a relay or a dial of the instance ended now.
func (g *Registry) endLocked(instance string) {
	now := time.Now()
	g.ended[instance] = now
	if len(g.ended) < 2*max(g.sweptSize, 64) {
		return
	}
	for name, at := range g.ended {
		if now.Sub(at) > endedMemory {
			delete(g.ended, name)
		}
	}
	g.sweptSize = len(g.ended)
}

// Opened is signalled (coalesced) whenever some instance's first relay
// opens.
func (g *Registry) Opened() <-chan struct{} { return g.opened }

// Instances lists the instances with a relay open, in no order. A dial
// still in progress does not count: until it relays, its own wake speaks
// for it (it records its request for running).
func (g *Registry) Instances() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]string, 0, len(g.entries))
	for name, e := range g.entries {
		if len(e.conns) > 0 {
			out = append(out, name)
		}
	}
	return out
}

// OnPowerChange adds fn to what is told of every power-down the registry
// guards (an idle one at its start and its end, an explicit one at its
// end), not of one a newer use outranked: the data routes forget the
// readiness they had proved of that instance. Add hooks before serving.
func (g *Registry) OnPowerChange(fn func(instance string)) {
	g.mu.Lock()
	g.hooks = append(g.hooks, fn)
	g.mu.Unlock()
}

func (g *Registry) powerChanged(instance string) {
	g.mu.Lock()
	hooks := g.hooks
	g.mu.Unlock()
	for _, fn := range hooks {
		fn(instance)
	}
}

func (g *Registry) entryLocked(instance string) *entry {
	e := g.entries[instance]
	if e == nil {
		e = &entry{conns: map[Conn]time.Time{}, tickets: map[*Ticket]struct{}{}, changed: make(chan struct{})}
		g.entries[instance] = e
	}
	return e
}

func (g *Registry) dropIfEmptyLocked(instance string, e *entry) {
	if len(e.conns) == 0 && len(e.tickets) == 0 && e.quiet == nil {
		delete(g.entries, instance)
	}
}

func (e *entry) signalLocked() {
	close(e.changed)
	e.changed = make(chan struct{})
}

// Open counts the relays open to the instance and the dials of its data
// route in progress (a dial about to relay is as good as a relay).
func (g *Registry) Open(instance string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.entries[instance]
	if e == nil {
		return 0
	}
	return len(e.conns) + len(e.tickets)
}

// Relays counts every relay open now.
func (g *Registry) Relays() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.total
}

// Quiesce holds off new dials of the instance's data route until release,
// when nothing relays to it and no dial of it is in progress; otherwise it
// fails and holds nothing. Dials that arrive meanwhile wait (within their
// hold) and then find the target in its new power state. This is the guard
// of a power-down nobody asked for explicitly (the idle loop's): it yields
// to any use of the target.
func (g *Registry) Quiesce(instance string) (release func(), ok bool) {
	g.mu.Lock()
	e := g.entryLocked(instance)
	if len(e.conns) > 0 || len(e.tickets) > 0 || e.quiet != nil {
		g.dropIfEmptyLocked(instance, e)
		g.mu.Unlock()
		return func() {}, false
	}
	quiet := make(chan struct{})
	e.quiet = quiet
	g.mu.Unlock()
	g.powerChanged(instance)
	return g.releaser(instance, quiet, nil), true
}

// releaser ends a guard of instance. The hooks are told first, so that no
// dial let through by the release trusts a readiness proved before the
// power-down, unless yielded says the guard yielded to a newer use, which
// leaves the power as it was: forgetting then would only make every dial
// after the use probe the daemon again.
func (g *Registry) releaser(instance string, quiet chan struct{}, yielded *bool) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			if yielded == nil || !*yielded {
				g.powerChanged(instance)
			}
			g.mu.Lock()
			close(quiet)
			if cur := g.entries[instance]; cur != nil && cur.quiet == quiet {
				cur.quiet = nil
				g.dropIfEmptyLocked(instance, cur)
			}
			g.mu.Unlock()
		})
	}
}

// Drain is the guard of an explicit power-down (target/setPower) asked at
// asked: it holds every new dial of the instance off, sends each relay of
// it a going-away close, kills one that has not ended closeWait later, and
// waits until no relay and no dial of the instance remains, or ctx ends.
// onWait, when not nil, is told the count still open each time it changes.
// The caller must call release, which lets the held dials go on; left is
// what still relayed or dialled when ctx ended (0: drained, safe to power
// down).
//
// A use that arrived after asked (a dial, an ingress request) outranks the
// power-down: Drain then closes nothing more and answers that use's
// arrival (outranked), and the caller records the use's request for
// running instead of powering down. A zero asked lets every use lose.
func (g *Registry) Drain(ctx context.Context, instance, reason string, asked time.Time, onWait func(open int)) (release func(), left int, outranked time.Time) {
	// Wait for another guard of the instance (an idle power-down) to end.
	var e *entry
	var quiet chan struct{}
	for {
		g.mu.Lock()
		e = g.entryLocked(instance)
		if e.quiet == nil {
			quiet = make(chan struct{})
			e.quiet = quiet
			g.mu.Unlock()
			break
		}
		other := e.quiet
		g.mu.Unlock()
		select {
		case <-other:
		case <-ctx.Done():
			return func() {}, g.Open(instance), time.Time{}
		}
	}
	// The hooks are told at the release only: until then every dial is
	// held off, and an outranked drain changes no power.
	yielded := false
	release = g.releaser(instance, quiet, &yielded)
	// Arrivals are this process's clock to the nanosecond, a request's
	// time Incus's record of it to the millisecond: a use in the request's
	// own millisecond does not outrank it.
	if !asked.IsZero() {
		asked = asked.Truncate(time.Millisecond).Add(time.Millisecond - 1)
	}

	told := map[Conn]struct{}{}
	var wg sync.WaitGroup
	defer wg.Wait()
	last := -1
	for {
		g.mu.Lock()
		if newest := e.newestLocked(); !asked.IsZero() && newest.After(asked) {
			open := len(e.conns) + len(e.tickets)
			g.mu.Unlock()
			yielded = true
			return release, open, newest
		}
		var fresh []Conn
		for c := range e.conns {
			if _, ok := told[c]; !ok {
				told[c] = struct{}{}
				fresh = append(fresh, c)
			}
		}
		open := len(e.conns) + len(e.tickets)
		changed := e.changed
		g.mu.Unlock()
		for _, c := range fresh {
			wg.Add(1)
			go func() {
				defer wg.Done()
				g.goAway(c, reason, "power_down")
			}()
		}
		if open != last && onWait != nil {
			onWait(open)
		}
		last = open
		if open == 0 {
			return release, 0, time.Time{}
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return release, g.Open(instance), time.Time{}
		}
	}
}

// goAway tells c to go away and kills it if it has not ended in time.
func (g *Registry) goAway(c Conn, reason, why string) {
	c.GoAway(GoingAway, reason, why)
	t := time.NewTimer(g.closeWait)
	defer t.Stop()
	select {
	case <-c.Done():
	case <-t.C:
		c.Kill(why)
		<-c.Done()
	}
}

// CloseEvery sends every relay a going-away close and waits, within the
// close wait, for each to end (provider shutdown).
func (g *Registry) CloseEvery(reason, why string) {
	g.mu.Lock()
	var cs []Conn
	for _, e := range g.entries {
		for c := range e.conns {
			cs = append(cs, c)
		}
	}
	g.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g.goAway(c, reason, why)
		}()
	}
	wg.Wait()
}

// Ticket is one dial (or wake) counted as in progress.
type Ticket struct {
	g        *Registry
	instance string
	at       time.Time // when the use it counts arrived
	once     sync.Once
}

// Enter counts a dial of the instance, arrived at at, as in progress.
// While a power-down holds the instance it returns no ticket but the
// channel to wait on.
func (g *Registry) Enter(instance string, at time.Time) (*Ticket, <-chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.entryLocked(instance)
	if e.quiet != nil {
		return nil, e.quiet
	}
	t := &Ticket{g: g, instance: instance, at: at}
	e.tickets[t] = struct{}{}
	return t, nil
}

// Join counts one more dial of the instance as in progress, even while a
// power-down holds it: for work a dial already admitted starts (its wake),
// which must not be told to wait for the power-down that waits for it. It
// arrived when t's did.
func (t *Ticket) Join() *Ticket {
	g := t.g
	g.mu.Lock()
	j := &Ticket{g: g, instance: t.instance, at: t.at}
	g.entryLocked(t.instance).tickets[j] = struct{}{}
	g.mu.Unlock()
	return j
}

// newestLocked is the latest arrival among the instance's relays and
// dials in progress (zero: none).
func (e *entry) newestLocked() time.Time {
	var newest time.Time
	for _, at := range e.conns {
		if at.After(newest) {
			newest = at
		}
	}
	for t := range e.tickets {
		if t.at.After(newest) {
			newest = t.at
		}
	}
	return newest
}

// Leave ends the dial without a relay.
func (t *Ticket) Leave() {
	t.once.Do(func() {
		g := t.g
		g.mu.Lock()
		if e := g.entries[t.instance]; e != nil {
			delete(e.tickets, t)
			g.endLocked(t.instance)
			e.signalLocked()
			g.dropIfEmptyLocked(t.instance, e)
		}
		g.mu.Unlock()
	})
}

// Adopt turns the dial into the relay c, in one step, so the instance is
// never seen without either.
func (t *Ticket) Adopt(c Conn) {
	t.once.Do(func() {
		g := t.g
		g.mu.Lock()
		e := g.entryLocked(t.instance)
		delete(e.tickets, t)
		e.conns[c] = t.at
		g.total++
		e.signalLocked()
		first := len(e.conns) == 1
		g.mu.Unlock()
		if first {
			select {
			case g.opened <- struct{}{}:
			default:
			}
		}
	})
}

// Remove forgets an ended relay of the instance; false when it was not
// registered.
func (g *Registry) Remove(instance string, c Conn) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.entries[instance]
	if e == nil {
		return false
	}
	if _, ok := e.conns[c]; !ok {
		return false
	}
	delete(e.conns, c)
	g.total--
	g.endLocked(instance)
	e.signalLocked()
	g.dropIfEmptyLocked(instance, e)
	return true
}
