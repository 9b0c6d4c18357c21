package idle

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// Probe outcomes, the values of the probes metric's outcome label.
const (
	OutcomeOK          = "ok"
	OutcomeUnreachable = "unreachable"      // the dial failed
	OutcomeHandshake   = "handshake_failed" // the daemon answered initialize wrongly, or refused it
	OutcomeTimeout     = "timeout"          // no answer within ProbeTimeout (a frozen or hung guest)
	OutcomeMalformed   = "malformed"        // env/getIdle answered something that does not decode
	OutcomeError       = "error"            // env/getIdle answered an error, or the connection ended
)

// thresholdSlack is added when a probe is timed to a threshold, so that the
// daemon's clock has passed it when the probe arrives.
const thresholdSlack = 20 * time.Millisecond

type probeResult struct {
	e        *entry
	sess     *envd.Session
	idle     envd.Idle
	at       time.Time
	outcome  string
	took     time.Duration
	err      error
	redialed bool
}

func (l *Loop) startProbe(ctx context.Context, e *entry) {
	e.probing = true
	l.probing++
	sess := e.sess
	e.sess = nil // the probe owns it now
	t := e.t
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		r := l.probe(ctx, t, sess)
		r.e = e
		select {
		case l.probeDone <- r:
		case <-ctx.Done():
			if r.sess != nil {
				l.closeSession(r.sess)
			}
		}
	}()
}

// probe asks one daemon how long it has been idle, over the session kept
// from earlier probes, or a new one. A kept session that turns out to have
// ended is replaced once within the same deadline.
func (l *Loop) probe(ctx context.Context, t Target, sess *envd.Session) probeResult {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, l.cfg.ProbeTimeout)
	defer cancel()
	var r probeResult
	if sess != nil && ended(sess) {
		l.closeSession(sess)
		sess = nil
	}
	for reused := sess != nil; ; reused = false {
		if sess == nil {
			r.redialed = true
			conn, err := l.cfg.Dialer.DialContext(ctx, guest.Target{Instance: t.Name, Port: t.Port, Location: t.Location})
			if err != nil {
				r.outcome, r.err = OutcomeUnreachable, err
				if ctx.Err() != nil {
					r.outcome = OutcomeTimeout
				}
				break
			}
			s, err := envd.Handshake(ctx, conn, l.cfg.ClientInfo)
			if err != nil {
				r.outcome, r.err = classify(err, true), err
				break
			}
			sess = s
			l.stats.sessions.Add(1)
		}
		idle, err := sess.GetIdle(ctx)
		if err == nil {
			r.sess, r.idle, r.outcome = sess, idle, OutcomeOK
			break
		}
		l.closeSession(sess)
		sess = nil
		if reused && transportFailure(err) && ctx.Err() == nil {
			continue // the daemon restarted or the kept connection broke: dial again once
		}
		r.outcome, r.err = classify(err, false), err
		break
	}
	r.at = time.Now()
	r.took = r.at.Sub(start)
	return r
}

func (l *Loop) closeSession(s *envd.Session) {
	_ = s.Close()
	l.stats.sessions.Add(-1)
}

func ended(s *envd.Session) bool {
	select {
	case <-s.Done():
		return true
	default:
		return false
	}
}

// transportFailure says the connection failed, rather than the daemon
// answering something this client refuses.
func transportFailure(err error) bool {
	var fe *wire.FieldError
	var rpc *jsonrpc.Error
	return !errors.As(err, &fe) && !errors.As(err, &rpc)
}

func classify(err error, handshake bool) string {
	var fe *wire.FieldError
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return OutcomeTimeout
	case handshake:
		return OutcomeHandshake
	case errors.As(err, &fe):
		return OutcomeMalformed
	default:
		return OutcomeError // an error answer, or the connection ended
	}
}

func (l *Loop) onProbe(r probeResult) {
	e := r.e
	e.probing = false
	l.probing--
	l.m.probed(r.outcome, r.took)
	if r.outcome == OutcomeOK {
		l.stats.probesOK.Add(1)
	} else {
		l.stats.probesFailed.Add(1)
	}
	l.passProbed(e, r.at)
	if e.gone || e.level != idlepolicy.ActionNone || !e.t.Settled {
		// Removed or powered down while the probe ran: its answer is moot.
		if r.sess != nil {
			l.closeLater(r.sess)
		}
		if !e.gone && e.t.Settled {
			l.scheduleIn(e, 0)
		}
		return
	}
	if r.err != nil {
		e.fails++
		l.log.Debug("idle probe failed; the target counts as not idle", zap.String("instance", e.t.Name),
			zap.String("outcome", r.outcome), zap.Int("inARow", e.fails), zap.Error(r.err))
		l.scheduleIn(e, backoff(e.fails, l.cfg.MaxInterval))
		return
	}
	e.sess, e.fails = r.sess, 0
	if r.redialed {
		// A new daemon connection: the daemon may have restarted.
		l.log.Debug("idle session opened", zap.String("instance", e.t.Name),
			zap.String("daemonInstanceId", r.sess.Initialized().DaemonInstanceID))
	}
	idleMs := r.idle.IdleForMs
	if !e.wokeAt.IsZero() {
		// The daemon's clock ran on while the guest was frozen: a wake is
		// a use, so idleness counts at most from it.
		if sinceWake := msSince(e.wokeAt, r.at); sinceWake < idleMs {
			idleMs = sinceWake
		} else {
			e.wokeAt = time.Time{}
		}
	}
	if a := e.t.Policy.DueAction(idleMs, e.t.Stages, idlepolicy.ActionNone); a != idlepolicy.ActionNone {
		if l.inv.RelaysOpen(e.t.Name) > 0 {
			l.m.acted(a, ResultRelayOpen)
			l.scheduleIn(e, l.cfg.RelayRecheck)
			return
		}
		asked := r.at.Add(-r.took)
		if l.inv.RelayEndedSince(e.t.Name, asked) {
			// A relay that ended while the probe ran may have carried a use
			// (a process started) the answer predates: ask again, a timer
			// gap later, not at once: short requests that keep ending
			// during probes (public ingress) must not make a hot loop.
			l.m.acted(a, ResultRelayOpen)
			l.scheduleIn(e, l.gap)
			return
		}
		l.startAct(e, a, truncMs(r.at.Add(-msDuration(idleMs))), asked)
		return
	}
	// The ceiling is from answer to answer: due two gaps before it, the
	// probe starts at most a gap later (the loop's timer), which leaves a
	// gap for a free slot and the answer.
	d := jitter(l.cfg.MaxInterval) - 2*l.gap
	if th, ok := e.t.Policy.NextThreshold(idleMs, e.t.Stages, idlepolicy.ActionNone); ok {
		d = min(d, msDuration(th-idleMs)+thresholdSlack)
	}
	l.scheduleAt(e, r.at.Add(d))
}

func (l *Loop) dropSession(e *entry) {
	if e.sess != nil {
		l.closeLater(e.sess)
		e.sess = nil
	}
}

// closeLater closes a session off the owner's goroutine.
func (l *Loop) closeLater(s *envd.Session) {
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		l.closeSession(s)
	}()
}
