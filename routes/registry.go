package routes

import (
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/targets"
)

// Registry knows, per Incus instance, the relays open to it and the dials
// of its data route in progress. It is the targets.Relays (and
// targets.PowerGuard) that power changes consult: the provider never powers
// a target down while it relays a data connection.
type Registry struct {
	metrics *Metrics
	// closeWait bounds how long CloseAll waits for relays to end.
	closeWait time.Duration
	// powerChanged is told of every power change of an instance the
	// registry hears about (readiness proved before it is void).
	powerChanged func(instance string)

	mu      sync.Mutex
	entries map[string]*entry
	total   int
}

type entry struct {
	relays  map[*Relay]struct{}
	pending int           // dials in progress, and wakes under way
	quiet   chan struct{} // non-nil while a power-down holds new dials off
}

var (
	_ targets.Relays     = (*Registry)(nil)
	_ targets.PowerGuard = (*Registry)(nil)
)

func newRegistry(m *Metrics, closeWait time.Duration, powerChanged func(string)) *Registry {
	if powerChanged == nil {
		powerChanged = func(string) {}
	}
	return &Registry{metrics: m, closeWait: closeWait, powerChanged: powerChanged, entries: map[string]*entry{}}
}

func (g *Registry) entryLocked(instance string) *entry {
	e := g.entries[instance]
	if e == nil {
		e = &entry{relays: map[*Relay]struct{}{}}
		g.entries[instance] = e
	}
	return e
}

func (g *Registry) dropIfEmptyLocked(instance string, e *entry) {
	if len(e.relays) == 0 && e.pending == 0 && e.quiet == nil {
		delete(g.entries, instance)
	}
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
	return len(e.relays) + e.pending
}

// Relays counts every relay open now.
func (g *Registry) Relays() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.total
}

// CloseAll sends every relay of the instance a going-away close (to the
// runtime and to the daemon) and waits, within its bound, for them to end;
// what is left is closed hard. Called before an explicit power-down.
func (g *Registry) CloseAll(instance string) {
	g.powerChanged(instance)
	g.mu.Lock()
	var rs []*Relay
	if e := g.entries[instance]; e != nil {
		for r := range e.relays {
			rs = append(rs, r)
		}
	}
	g.mu.Unlock()
	closeRelays(rs, CloseGoingAway, "the target is powering down", "power_down", g.closeWait)
}

// closeAllRelays closes every relay (provider shutdown).
func (g *Registry) closeAllRelays(code int, reason, why string) {
	g.mu.Lock()
	var rs []*Relay
	for _, e := range g.entries {
		for r := range e.relays {
			rs = append(rs, r)
		}
	}
	g.mu.Unlock()
	closeRelays(rs, code, reason, why, g.closeWait)
}

func closeRelays(rs []*Relay, code int, reason, why string, wait time.Duration) {
	if len(rs) == 0 {
		return
	}
	var wg sync.WaitGroup
	for _, r := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.GoAway(code, reason, why)
			t := time.NewTimer(wait)
			defer t.Stop()
			select {
			case <-r.Done():
			case <-t.C:
				r.finish(why)
				<-r.Done()
			}
		}()
	}
	wg.Wait()
}

// Quiesce holds off new dials of the instance's data route until release,
// when nothing relays to it and no dial of it is in progress; otherwise it
// fails. Dials that arrive meanwhile wait (within their hold) and then find
// the target in its new power state. Readiness proved before is forgotten.
func (g *Registry) Quiesce(instance string) (release func(), ok bool) {
	g.mu.Lock()
	e := g.entryLocked(instance)
	if len(e.relays) > 0 || e.pending > 0 || e.quiet != nil {
		g.dropIfEmptyLocked(instance, e)
		g.mu.Unlock()
		return func() {}, false
	}
	quiet := make(chan struct{})
	e.quiet = quiet
	g.mu.Unlock()
	g.powerChanged(instance)
	var once sync.Once
	return func() {
		once.Do(func() {
			g.powerChanged(instance)
			g.mu.Lock()
			close(quiet)
			if cur := g.entries[instance]; cur != nil {
				cur.quiet = nil
				g.dropIfEmptyLocked(instance, cur)
			}
			g.mu.Unlock()
		})
	}, true
}

// ticket is one dial (or wake) counted as in progress.
type ticket struct {
	g        *Registry
	instance string
	once     sync.Once
}

// enter counts a dial of the instance as in progress. While a power-down
// holds the instance it returns no ticket but the channel to wait on.
func (g *Registry) enter(instance string) (*ticket, <-chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.entryLocked(instance)
	if e.quiet != nil {
		return nil, e.quiet
	}
	e.pending++
	return &ticket{g: g, instance: instance}, nil
}

// leave ends the dial without a relay.
func (t *ticket) leave() {
	t.once.Do(func() {
		g := t.g
		g.mu.Lock()
		if e := g.entries[t.instance]; e != nil {
			e.pending--
			g.dropIfEmptyLocked(t.instance, e)
		}
		g.mu.Unlock()
	})
}

// adopt turns the dial into the relay r, in one step, so the instance is
// never seen without either.
func (t *ticket) adopt(r *Relay) {
	t.once.Do(func() {
		g := t.g
		g.mu.Lock()
		e := g.entryLocked(t.instance)
		e.pending--
		e.relays[r] = struct{}{}
		g.total++
		g.mu.Unlock()
		g.metrics.relayOpened()
	})
}

// removeRelay forgets an ended relay.
func (g *Registry) removeRelay(r *Relay) {
	g.mu.Lock()
	if e := g.entries[r.instance]; e != nil {
		if _, ok := e.relays[r]; ok {
			delete(e.relays, r)
			g.total--
			g.dropIfEmptyLocked(r.instance, e)
		}
	}
	g.mu.Unlock()
	g.metrics.relayClosed(r.Reason())
}
