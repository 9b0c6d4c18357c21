package idle

import (
	"sync/atomic"
	"time"

	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

// passState measures passes: a pass starts with the running targets of the
// moment and ends when each of them has been probed once (or has left, or
// been powered down).
type passState struct {
	gen       uint64
	start     time.Time
	remaining int
}

func (l *Loop) passMaybeStart(now time.Time) {
	if l.pass.remaining > 0 {
		return
	}
	l.pass.gen++
	l.pass.start = now
	for _, e := range l.entries {
		if e.level == idlepolicy.ActionNone && !e.gone {
			e.passGen = l.pass.gen
			l.pass.remaining++
		}
	}
}

func (l *Loop) passProbed(e *entry, at time.Time) {
	if e.passGen != l.pass.gen || e.passGen == 0 {
		return
	}
	e.passGen = 0
	l.pass.remaining--
	if l.pass.remaining == 0 {
		d := at.Sub(l.pass.start)
		l.m.passed(d)
		l.stats.passes.Add(1)
		l.stats.lastPass.Store(int64(d))
		l.passMaybeStart(at)
	}
}

func (l *Loop) passLeft(e *entry) {
	if e.passGen != l.pass.gen || e.passGen == 0 {
		return
	}
	e.passGen = 0
	l.pass.remaining--
	if l.pass.remaining == 0 {
		l.passMaybeStart(time.Now())
	}
}

// stats are counters a benchmark or test can read while the loop runs.
type stats struct {
	probesOK     atomic.Uint64
	probesFailed atomic.Uint64
	actions      atomic.Uint64
	passes       atomic.Uint64
	lastPass     atomic.Int64
	sessions     atomic.Int64
	tracked      atomic.Int64
}

// Stats is a snapshot of the loop's counters.
type Stats struct {
	ProbesOK     uint64
	ProbesFailed uint64
	Actions      uint64
	// Passes counts completed passes; LastPass is the latest one's duration.
	Passes   uint64
	LastPass time.Duration
	// Sessions is the number of open data-plane sessions.
	Sessions int64
	// Tracked is the number of targets the policy applies to.
	Tracked int64
}

// Stats reads the counters; safe to call while Run runs.
func (l *Loop) Stats() Stats {
	return Stats{
		ProbesOK:     l.stats.probesOK.Load(),
		ProbesFailed: l.stats.probesFailed.Load(),
		Actions:      l.stats.actions.Load(),
		Passes:       l.stats.passes.Load(),
		LastPass:     time.Duration(l.stats.lastPass.Load()),
		Sessions:     l.stats.sessions.Load(),
		Tracked:      l.stats.tracked.Load(),
	}
}
