package idle

import (
	"context"
	"math/rand/v2"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

type listResult struct {
	started time.Time
	targets []Target
	err     error
}

type lookResult struct {
	name    string
	started time.Time
	target  Target
	ok      bool
	err     error
}

func (l *Loop) startList(ctx context.Context) {
	l.listing = true
	l.soon = false
	started := time.Now()
	l.lastList = started
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		lctx, cancel := context.WithTimeout(ctx, max(l.cfg.RefreshInterval, 30*time.Second))
		targets, err := l.inv.IdleTargets(lctx)
		cancel()
		select {
		case l.listDone <- listResult{started: started, targets: targets, err: err}:
		case <-ctx.Done():
		}
	}()
}

// onList brings the loop's picture in line with the inventory: new targets
// are scheduled, departed ones dropped, and power changes the loop did not
// make (a wake by a data route, target/setPower) are taken in.
func (l *Loop) onList(r listResult) {
	l.listing = false
	if r.err != nil {
		l.log.Warn("listing targets for the idle loop failed; retrying at the next refresh", zap.Error(r.err))
		return
	}
	first := !l.listedAny
	l.listedAny = true
	now := time.Now()
	l.recount(r)
	seen := make(map[string]struct{}, len(r.targets))
	for _, t := range r.targets {
		if l.apply(t, r.started, now, first) {
			seen[t.Name] = struct{}{}
		}
	}
	for name, e := range l.entries {
		if _, ok := seen[name]; !ok && !e.newerThan(r.started) {
			l.remove(e)
		}
	}
	l.stats.tracked.Store(int64(len(l.entries)))
	l.passMaybeStart(now)
}

// apply takes in what the inventory says of one target, as read at
// `started`. It reports whether the policy applies to the target (active,
// with a policy); a target it no longer applies to is forgotten.
func (l *Loop) apply(t Target, started, now time.Time, first bool) bool {
	e := l.entries[t.Name]
	level, known := LevelOf(t.Power)
	if t.Phase != controller.PhaseActive || !known || t.Policy == nil {
		if e != nil && !e.newerThan(started) {
			l.remove(e)
		}
		return false
	}
	if e == nil {
		e = &entry{t: t, level: level, index: -1}
		l.entries[t.Name] = e
		if !t.Settled {
			return true
		}
		switch {
		case level != idlepolicy.ActionNone:
			l.scheduleIn(e, 0)
		case first:
			l.scheduleIn(e, time.Duration(rand.Int64N(int64(l.cfg.StartSpread)+1)))
		default:
			l.scheduleIn(e, time.Duration(rand.Int64N(int64(100*time.Millisecond))))
		}
		return true
	}
	if e.newerThan(started) {
		return true // the loop's own knowledge is newer than this reading
	}
	was := e.t
	wasLevel := e.level
	e.t, e.level = t, level
	if wasLevel != idlepolicy.ActionNone && level == idlepolicy.ActionNone {
		e.wokeAt = now // woken by someone else: a wake is a use
	}
	if level == idlepolicy.ActionNone {
		e.downSince = time.Time{}
	}
	if wasLevel == idlepolicy.ActionNone && level != idlepolicy.ActionNone {
		l.dropSession(e)
		l.passLeft(e)
	}
	switch {
	case !t.Settled:
		l.unschedule(e)
		l.dropSession(e)
	case e.probing:
		// onProbe looks at the new state.
	case !was.Settled || wasLevel != level || !was.IdleSince.Equal(t.IdleSince) || e.index < 0:
		if level == idlepolicy.ActionNone {
			l.scheduleIn(e, time.Duration(rand.Int64N(int64(100*time.Millisecond))))
		} else {
			l.scheduleIn(e, 0)
		}
	}
	return true
}

// maxLooks bounds the single-target reads in flight after change notes.
const maxLooks = 8

// onChange asks for a fresh reading of a target the inventory says it
// changed.
func (l *Loop) onChange(name string) {
	if _, queued := l.lookWant[name]; queued {
		return
	}
	l.lookWant[name] = struct{}{}
	l.lookQueue = append(l.lookQueue, name)
}

func (l *Loop) dispatchLooks(ctx context.Context) {
	for l.looking < maxLooks && len(l.lookQueue) > 0 {
		name := l.lookQueue[0]
		l.lookQueue = l.lookQueue[1:]
		delete(l.lookWant, name)
		l.looking++
		started := time.Now()
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			t, ok, err := l.watch.IdleTarget(lctx, name)
			cancel()
			select {
			case l.lookDone <- lookResult{name: name, started: started, target: t, ok: ok, err: err}:
			case <-ctx.Done():
			}
		}()
	}
	if len(l.lookQueue) == 0 {
		l.lookQueue = nil
	}
}

func (l *Loop) onLook(r lookResult) {
	l.looking--
	if e := l.entries[r.name]; e != nil && r.err == nil && e.newerThan(r.started) {
		// The loop's own action is newer than this reading, so the reading
		// is set aside; but the change it was asked for may have come after
		// the action (someone woke the target it just paused), and no other
		// note will say so: read it again once the action's result is in.
		l.relook(e)
	}
	switch {
	case r.err != nil:
		l.log.Debug("reading a changed target failed; the next listing sees it", zap.String("instance", r.name), zap.Error(r.err))
	case !r.ok:
		if e := l.entries[r.name]; e != nil && !e.newerThan(r.started) {
			l.remove(e)
		}
	default:
		l.apply(r.target, r.started, time.Now(), false)
	}
	if r.err == nil {
		l.countOne(r)
	}
	l.stats.tracked.Store(int64(len(l.entries)))
	if l.pass.remaining == 0 {
		l.passMaybeStart(time.Now())
	}
}

// relook reads e again after a change note whose reading was set aside:
// at once, or when the action under way has ended.
func (l *Loop) relook(e *entry) {
	if e.acting {
		e.relook = true
		return
	}
	l.onChange(e.t.Name)
}

// countedTarget is one target as the gauge counts it, and the instant the
// reading began; gone marks one a read found removed, so that a listing
// begun before that read does not count it again.
type countedTarget struct {
	t    Target
	at   time.Time
	gone bool
}

// recount takes a listing as the gauge's whole picture, except for the
// targets read alone since the listing began, which are newer.
func (l *Loop) recount(r listResult) {
	next := make(map[string]countedTarget, len(r.targets))
	for _, t := range r.targets {
		next[t.Name] = countedTarget{t: t, at: r.started}
	}
	for name, c := range l.counted {
		if c.at.After(r.started) {
			next[name] = c
		}
	}
	l.counted = next
	ts := make([]Target, 0, len(next))
	for _, c := range next {
		if !c.gone {
			ts = append(ts, c.t)
		}
	}
	l.m.inventory(ts)
	l.m.setOldest(ts)
}

// countOne moves one target's count after a single-target read: created,
// closed (gone) or changed in phase or power.
func (l *Loop) countOne(r lookResult) {
	was, known := l.counted[r.name]
	if known && was.at.After(r.started) {
		return
	}
	now := countedTarget{t: r.target, at: r.started, gone: !r.ok}
	var from, to *Target
	if known && !was.gone {
		from = &was.t
	}
	if !now.gone {
		to = &now.t
	}
	l.m.move(from, to)
	l.counted[r.name] = now
	if from != nil && (to == nil || to.Phase != from.Phase || !to.PhaseSince.Equal(from.PhaseSince)) && l.m.isOldest(from) {
		// The oldest left its phase: find the next oldest.
		ts := make([]Target, 0, len(l.counted))
		for _, c := range l.counted {
			if !c.gone {
				ts = append(ts, c.t)
			}
		}
		l.m.setOldest(ts)
	}
}
