package wake

import (
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/relays"
)

// Flight is the one wake (and readiness probe) of a target that every
// concurrent use of it waits on.
type Flight struct {
	name string
	tk   *relays.Ticket // the flight counts as a dial in progress until it settles
	// requested is when the use that started the flight arrived: its
	// request for running is that old, whatever uses join it later.
	requested time.Time
	// superseded: a power change asked after the use replaced its wake.
	superseded bool
	// deviceRestarted: the flight's probe found the daemon's device dead
	// on a running instance and had it restarted, which it does once.
	// Only the flight's probe, one at a time, reads and writes it.
	deviceRestarted bool
	settled         chan struct{} // closed once result is set
	result          *Refusal      // nil: the daemon answered

	// trace is the flight's wake trace, nil without Options.Trace:
	// fly writes it until the flight settles, then one reporter has it.
	trace *Trace

	mu    sync.Mutex
	state State         // what a use refused now is told
	retry time.Duration // and when to come back
	// traceByDial: the dial that started the flight reports the trace,
	// with its relay's times; the flight does when no dial waits for it.
	traceByDial bool
	over        bool // settled
}

// Settled is closed once the flight has settled (Result).
func (f *Flight) Settled() <-chan struct{} { return f.settled }

// Result is what the flight settled on, once Settled is closed: nil when
// the daemon answered, otherwise what every use waiting on it is told.
func (f *Flight) Result() *Refusal { return f.result }

// Trace is the flight's trace, once Settled is closed, for the dial that
// started it (Join's started) to complete with its relay's times and
// report (Waker.Report); nil without Options.Trace.
func (f *Flight) Trace() *Trace { return f.trace }

func (f *Flight) stage(s State, retry time.Duration) {
	f.mu.Lock()
	f.state, f.retry = s, retry
	f.mu.Unlock()
}

// RefusalNow is the answer for a use whose hold ran out while the flight
// goes on.
func (f *Flight) RefusalNow() *Refusal {
	f.mu.Lock()
	defer f.mu.Unlock()
	return &Refusal{State: f.state, RetryAfter: f.retry}
}

// GiveUpTrace is called by the dial that started the flight when it stops
// waiting for it: the flight reports its own trace from now on, unless it
// settled meanwhile with the daemon answering, when the trace is the
// caller's to report (returned).
func (f *Flight) GiveUpTrace() *Trace {
	if f.trace == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.traceByDial {
		return nil
	}
	f.traceByDial = false
	if f.over && f.result == nil {
		return f.trace
	}
	return nil
}
