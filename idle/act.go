package idle

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

// Action results, the values of the actions metric's result label.
const (
	ResultOK        = "ok"
	ResultFailed    = "failed"
	ResultStale     = "stale"      // the target changed before the action; nothing was done
	ResultRelayOpen = "relay_open" // a relay was open; nothing was done
)

type actRequest struct {
	e      *entry
	t      Target
	action idlepolicy.Action
	since  time.Time
	readAt time.Time // when the idle reading it rests on was asked for
}

type actResult struct {
	actRequest
	err  error
	took time.Duration
}

// startAct queues an action. The target's session is dropped once the
// action is done (its guest then no longer answers, or is gone), not
// before: closing it makes the daemon busy just as Incus freezes it.
func (l *Loop) startAct(e *entry, a idlepolicy.Action, since, readAt time.Time) {
	l.unschedule(e)
	e.acting = true
	l.acts = append(l.acts, &actRequest{e: e, t: e.t, action: a, since: since, readAt: readAt})
}

func (l *Loop) launchAct(ctx context.Context, req *actRequest) {
	l.acting++
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		start := time.Now()
		actx, cancel := context.WithTimeout(ctx, l.cfg.ActionTimeout)
		err := l.inv.IdleAct(actx, req.t, req.action, req.since, req.readAt)
		cancel()
		select {
		case l.actDone <- actResult{actRequest: *req, err: err, took: time.Since(start)}:
		case <-ctx.Done():
		}
	}()
}

func (l *Loop) onAct(r actResult) {
	e := r.e
	e.acting = false
	l.acting--
	name := e.t.Name
	if e.relook {
		e.relook = false
		defer func() {
			if !e.gone {
				l.onChange(name)
			}
		}()
	}
	switch {
	case r.err == nil:
		l.m.acted(r.action, ResultOK)
		l.stats.actions.Add(1)
		l.log.Info("idle action taken", zap.String("instance", name), zap.Stringer("action", r.action),
			zap.Time("idleSince", r.since), zap.Duration("took", r.took))
		e.actFails = 0
		e.changedAt = time.Now()
		l.dropSession(e)
		if r.action == idlepolicy.ActionClose {
			l.remove(e)
			return
		}
		e.t.Power, e.level, e.t.IdleSince, e.t.Settled = PowerOf(r.action), r.action, r.since, true
		e.wokeAt, e.downSince = time.Time{}, time.Time{}
		l.passLeft(e)
		if !e.gone {
			l.evaluateDown(e, time.Now())
		}
	case errors.Is(r.err, ErrStale):
		l.m.acted(r.action, ResultStale)
		l.log.Debug("idle action skipped: the target changed", zap.String("instance", name), zap.Stringer("action", r.action))
		// Wait for the listing to say where it is now.
		e.t.Settled = false
		l.soon = true
	case errors.Is(r.err, ErrRelayOpen):
		l.m.acted(r.action, ResultRelayOpen)
		l.scheduleIn(e, l.cfg.RelayRecheck)
	default:
		l.m.acted(r.action, ResultFailed)
		e.actFails++
		l.log.Warn("idle action failed; retrying later", zap.String("instance", name), zap.Stringer("action", r.action),
			zap.Int("inARow", e.actFails), zap.Error(r.err))
		l.soon = true // see where the failure left it
		l.scheduleIn(e, backoff(e.actFails, l.cfg.MaxInterval))
	}
}
