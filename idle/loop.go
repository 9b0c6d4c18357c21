package idle

import (
	"container/heap"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// Config configures a Loop; zero durations and counts take the defaults.
type Config struct {
	Inventory Inventory
	// Dialer reaches the guest daemons: the provider's own connection, never
	// a data route, so probing neither wakes a target nor counts as a relay.
	Dialer guest.Dialer
	// ClientInfo is sent in each data-plane initialize (default: this build,
	// named "incus-provider-idle").
	ClientInfo envd.ClientInfo
	Metrics    *Metrics
	Log        *zap.Logger

	// MaxProbes bounds the probes in flight at once (default 64).
	MaxProbes int
	// MaxActions bounds the power changes and closes in flight (default 8).
	MaxActions int
	// ProbeTimeout bounds one probe: dial, handshake when the target has
	// no open session, and env/getIdle (default 5 s).
	ProbeTimeout time.Duration
	// MaxInterval is the longest a running target goes unprobed (default
	// 25 s); a target is probed sooner when its next threshold falls sooner.
	MaxInterval time.Duration
	// RefreshInterval is how often the target inventory is listed, which is
	// how the loop learns of new targets and of power changes it did not
	// make (default 10 s).
	RefreshInterval time.Duration
	// StartSpread spreads the first probes of the targets found at start-up
	// (default 10 s, at most MaxInterval), so that a restart with thousands
	// of targets does not dial them all at once.
	StartSpread time.Duration
	// RelayRecheck is when a target that is due an action but has a relay
	// open is looked at again (default 10 s, at most MaxInterval).
	RelayRecheck time.Duration
	// ActionTimeout bounds one action (default 2 min: a graceful stop
	// within the provider's bound, then a forced one).
	ActionTimeout time.Duration
}

func (c *Config) defaults() {
	if c.MaxProbes <= 0 {
		c.MaxProbes = 64
	}
	if c.MaxActions <= 0 {
		c.MaxActions = 8
	}
	if c.ProbeTimeout <= 0 {
		c.ProbeTimeout = 5 * time.Second
	}
	if c.MaxInterval <= 0 {
		c.MaxInterval = 25 * time.Second
	}
	if c.RefreshInterval <= 0 {
		c.RefreshInterval = 10 * time.Second
	}
	if c.StartSpread < 0 {
		c.StartSpread = 0
	} else if c.StartSpread == 0 {
		c.StartSpread = 10 * time.Second
	}
	c.StartSpread = min(c.StartSpread, c.MaxInterval)
	if c.RelayRecheck <= 0 {
		c.RelayRecheck = 10 * time.Second
	}
	c.RelayRecheck = min(c.RelayRecheck, c.MaxInterval)
	if c.ActionTimeout <= 0 {
		c.ActionTimeout = 2 * time.Minute
	}
	if c.ClientInfo.Name == "" {
		c.ClientInfo = buildinfo.Describe("incus-provider-idle")
	}
	if c.Log == nil {
		c.Log = zap.NewNop()
	}
}

// Probe outcomes, the values of the probes metric's outcome label.
const (
	OutcomeOK          = "ok"
	OutcomeUnreachable = "unreachable"      // the dial failed
	OutcomeHandshake   = "handshake_failed" // the daemon answered initialize wrongly, or refused it
	OutcomeTimeout     = "timeout"          // no answer within ProbeTimeout (a frozen or hung guest)
	OutcomeMalformed   = "malformed"        // env/getIdle answered something that does not decode
	OutcomeError       = "error"            // env/getIdle answered an error, or the connection ended
)

// Action results, the values of the actions metric's result label.
const (
	ResultOK        = "ok"
	ResultFailed    = "failed"
	ResultStale     = "stale"      // the target changed before the action; nothing was done
	ResultRelayOpen = "relay_open" // a relay was open; nothing was done
)

// minDelay keeps a target that is due again at once from spinning the loop.
const minDelay = 10 * time.Millisecond

// thresholdSlack is added when a probe is timed to a threshold, so that the
// daemon's clock has passed it when the probe arrives.
const thresholdSlack = 20 * time.Millisecond

// minRefreshGap bounds how often a refresh asked for early may run.
const minRefreshGap = time.Second

// Loop applies the idle policy to the provider's targets. Each target runs
// on its own clock: a running target is probed with env/getIdle when its
// next threshold could be reached, and at least every MaxInterval; a
// powered-down target, whose guest cannot answer, is judged from the
// idle-since instant recorded when it was powered down. One goroutine (Run)
// owns every target's state; probes and actions run on goroutines it
// starts, bounded, and it stops them all before Run returns.
type Loop struct {
	cfg Config
	inv Inventory
	m   *Metrics
	log *zap.Logger

	// Owned by Run's goroutine.
	entries   map[string]*entry
	queue     dueQueue
	ready     []*entry // running targets due a probe, waiting for a slot
	acts      []*actRequest
	probing   int
	acting    int
	listing   bool
	listedAny bool
	lastList  time.Time
	soon      bool // a refresh was asked for early
	pass      passState

	// Single-target reads after the inventory's change notes (Watcher).
	watch     Watcher
	lookWant  map[string]struct{}
	lookQueue []string
	looking   int

	probeDone chan probeResult
	actDone   chan actResult
	listDone  chan listResult
	lookDone  chan lookResult
	wg        sync.WaitGroup

	stats stats
}

// entry is the loop's state of one target.
type entry struct {
	t     Target
	level idlepolicy.Action // where t.Power stands on the ladder

	due   time.Time
	index int // in queue; -1 when not scheduled

	probing bool
	acting  bool
	queued  bool // in ready
	gone    bool // left the inventory while busy

	sess      *envd.Session // the open data-plane session, when idle
	fails     int           // probe failures in a row
	actFails  int           // action failures in a row
	wokeAt    time.Time     // seen running again after a power-down the loop knew of
	downSince time.Time     // first seen powered down without a recorded idle-since
	changedAt time.Time     // the loop's own last power change
	passGen   uint64        // the pass that still waits for this target's probe
}

type actRequest struct {
	e      *entry
	t      Target
	action idlepolicy.Action
	since  time.Time
}

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

type actResult struct {
	actRequest
	err  error
	took time.Duration
}

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

// New builds a loop; Run starts it.
func New(cfg Config) *Loop {
	cfg.defaults()
	return &Loop{
		cfg:       cfg,
		inv:       cfg.Inventory,
		m:         cfg.Metrics,
		log:       cfg.Log,
		entries:   map[string]*entry{},
		lookWant:  map[string]struct{}{},
		probeDone: make(chan probeResult),
		actDone:   make(chan actResult),
		listDone:  make(chan listResult),
		lookDone:  make(chan lookResult),
	}
}

// Run runs the loop until ctx ends, then stops every probe and action it
// started, closes every session and returns.
func (l *Loop) Run(ctx context.Context) error {
	if l.inv == nil || l.cfg.Dialer == nil {
		return errors.New("idle: the loop needs an Inventory and a Dialer")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer func() {
		cancel()
		l.wg.Wait()
		for _, e := range l.entries {
			l.dropSession(e)
		}
		l.wg.Wait()
	}()
	// The timer is re-armed only once it has fired, or to wake earlier than
	// it is armed for: re-arming a pending timer marks it modified, and the
	// runtime then rescans every timer of the process (thousands, with a
	// session per target) when it comes due.
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	armed := time.Now().Add(time.Hour)
	var changes <-chan string
	if w, ok := l.inv.(Watcher); ok {
		l.watch, changes = w, w.Changes()
	}
	l.startList(ctx)
	for {
		now := time.Now()
		l.fire(now)
		l.dispatch(ctx)
		l.dispatchLooks(ctx)
		if !l.listing && (now.Sub(l.lastList) >= l.cfg.RefreshInterval || (l.soon && now.Sub(l.lastList) >= minRefreshGap)) {
			l.startList(ctx)
		}
		if wake := now.Add(l.nextWake(now)); armed.IsZero() || wake.Before(armed) {
			timer.Reset(wake.Sub(now))
			armed = wake
		}
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
			armed = time.Time{}
		case r := <-l.probeDone:
			l.onProbe(r)
		case r := <-l.actDone:
			l.onAct(r)
		case r := <-l.listDone:
			l.onList(r)
		case name := <-changes:
			l.onChange(name)
		case r := <-l.lookDone:
			l.onLook(r)
		}
	}
}

// nextWake is how long the loop may sleep: until the earliest due target or
// the next refresh.
func (l *Loop) nextWake(now time.Time) time.Duration {
	wake := l.lastList.Add(l.cfg.RefreshInterval)
	if l.soon {
		wake = l.lastList.Add(minRefreshGap)
	}
	if l.listing {
		wake = now.Add(time.Hour)
	}
	if len(l.queue) > 0 && l.queue[0].due.Before(wake) {
		wake = l.queue[0].due
	}
	return max(wake.Sub(now), time.Millisecond)
}

// fire evaluates every target whose time has come.
func (l *Loop) fire(now time.Time) {
	for len(l.queue) > 0 && !l.queue[0].due.After(now) {
		e := heap.Pop(&l.queue).(*entry)
		l.evaluate(e, now)
	}
}

func (l *Loop) evaluate(e *entry, now time.Time) {
	if e.gone || e.probing || e.acting || !e.t.Settled {
		return // rescheduled when the work ends, or by the next listing
	}
	if e.level == idlepolicy.ActionNone {
		if !e.queued {
			e.queued = true
			l.ready = append(l.ready, e)
		}
		return
	}
	l.evaluateDown(e, now)
}

// evaluateDown judges a powered-down target from the instant its idleness
// began: the recorded idle-since, or when the loop first saw it down.
func (l *Loop) evaluateDown(e *entry, now time.Time) {
	since := e.t.IdleSince
	if since.IsZero() {
		if e.downSince.IsZero() {
			e.downSince = truncMs(now)
		}
		since = e.downSince
	}
	idleMs := msSince(since, now)
	if a := e.t.Policy.DueAction(idleMs, e.t.Stages, e.level); a != idlepolicy.ActionNone {
		l.startAct(e, a, since)
		return
	}
	if th, ok := e.t.Policy.NextThreshold(idleMs, e.t.Stages, e.level); ok {
		l.scheduleAt(e, since.Add(msDuration(th)))
		return
	}
	l.unschedule(e)
}

// dispatch starts queued probes and actions while slots are free.
func (l *Loop) dispatch(ctx context.Context) {
	for l.probing < l.cfg.MaxProbes && len(l.ready) > 0 {
		e := l.ready[0]
		l.ready[0] = nil
		l.ready = l.ready[1:]
		e.queued = false
		if e.gone || e.probing || e.acting || e.level != idlepolicy.ActionNone || !e.t.Settled {
			continue
		}
		l.startProbe(ctx, e)
	}
	if len(l.ready) == 0 {
		l.ready = nil // let the backing array go
	}
	for l.acting < l.cfg.MaxActions && len(l.acts) > 0 {
		req := l.acts[0]
		l.acts[0] = nil
		l.acts = l.acts[1:]
		l.launchAct(ctx, req)
	}
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
			conn, err := l.cfg.Dialer.DialContext(ctx, guest.Target{Instance: t.Name, Port: t.Port})
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
		l.startAct(e, a, truncMs(r.at.Add(-msDuration(idleMs))))
		return
	}
	d := jitter(l.cfg.MaxInterval)
	if th, ok := e.t.Policy.NextThreshold(idleMs, e.t.Stages, idlepolicy.ActionNone); ok {
		d = min(d, msDuration(th-idleMs)+thresholdSlack)
	}
	l.scheduleAt(e, r.at.Add(d))
}

// startAct queues an action. The target's session is dropped once the
// action is done (its guest then no longer answers, or is gone), not
// before: closing it makes the daemon busy just as Incus freezes it.
func (l *Loop) startAct(e *entry, a idlepolicy.Action, since time.Time) {
	l.unschedule(e)
	e.acting = true
	l.acts = append(l.acts, &actRequest{e: e, t: e.t, action: a, since: since})
}

func (l *Loop) launchAct(ctx context.Context, req *actRequest) {
	l.acting++
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		start := time.Now()
		actx, cancel := context.WithTimeout(ctx, l.cfg.ActionTimeout)
		err := l.inv.IdleAct(actx, req.t, req.action, req.since)
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
	l.m.inventory(r.targets)
	seen := make(map[string]struct{}, len(r.targets))
	for _, t := range r.targets {
		if l.apply(t, r.started, now, first) {
			seen[t.Name] = struct{}{}
		}
	}
	for name, e := range l.entries {
		if _, ok := seen[name]; !ok && !e.acting && !e.changedAt.After(r.started) {
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
		if e != nil && !e.acting && !e.changedAt.After(started) {
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
	if e.acting || e.changedAt.After(started) {
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
	switch {
	case r.err != nil:
		l.log.Debug("reading a changed target failed; the next listing sees it", zap.String("instance", r.name), zap.Error(r.err))
	case !r.ok:
		if e := l.entries[r.name]; e != nil && !e.acting && !e.changedAt.After(r.started) {
			l.remove(e)
		}
	default:
		l.apply(r.target, r.started, time.Now(), false)
	}
	l.stats.tracked.Store(int64(len(l.entries)))
	if l.pass.remaining == 0 {
		l.passMaybeStart(time.Now())
	}
}

// remove forgets a target (closed, or no longer one the policy applies to).
func (l *Loop) remove(e *entry) {
	if cur := l.entries[e.t.Name]; cur == e {
		delete(l.entries, e.t.Name)
	}
	e.gone = true
	l.unschedule(e)
	l.dropSession(e)
	l.passLeft(e)
	l.stats.tracked.Store(int64(len(l.entries)))
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

func (l *Loop) scheduleIn(e *entry, d time.Duration) { l.scheduleAt(e, time.Now().Add(max(d, 0))) }

func (l *Loop) scheduleAt(e *entry, at time.Time) {
	if floor := time.Now().Add(minDelay); at.Before(floor) {
		at = floor
	}
	e.due = at
	if e.index >= 0 {
		heap.Fix(&l.queue, e.index)
		return
	}
	heap.Push(&l.queue, e)
}

func (l *Loop) unschedule(e *entry) {
	if e.index >= 0 {
		heap.Remove(&l.queue, e.index)
	}
}

// backoff is the wait after n failures in a row: half a second doubling,
// at most most. The first retries come soon, since a daemon that has just
// been started may not listen yet.
func backoff(n int, most time.Duration) time.Duration {
	d := 500 * time.Millisecond
	for i := 1; i < n && d < most; i++ {
		d *= 2
	}
	return jitter(min(d, most))
}

// jitter spreads a wait over its last tenth, never beyond it, so that
// targets found together drift apart and a ceiling stays a ceiling.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d - time.Duration(rand.Int64N(int64(d)/10+1))
}

func msSince(since, now time.Time) uint64 {
	d := now.Sub(since)
	if d <= 0 {
		return 0
	}
	return uint64(d / time.Millisecond)
}

func truncMs(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

// maxMs is the longest span a time.Duration holds, in milliseconds.
const maxMs = uint64(math.MaxInt64 / int64(time.Millisecond))

// msDuration converts milliseconds (below 2^53, so possibly beyond what a
// Duration holds) to a Duration, saturating at about 292 years.
func msDuration(ms uint64) time.Duration {
	if ms > maxMs {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(ms) * time.Millisecond
}

// dueQueue is a min-heap of scheduled entries by due time.
type dueQueue []*entry

func (q dueQueue) Len() int           { return len(q) }
func (q dueQueue) Less(i, j int) bool { return q[i].due.Before(q[j].due) }
func (q dueQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *dueQueue) Push(x any) {
	e := x.(*entry)
	e.index = len(*q)
	*q = append(*q, e)
}
func (q *dueQueue) Pop() any {
	old := *q
	n := len(old)
	e := old[n-1]
	old[n-1] = nil
	e.index = -1
	*q = old[:n-1]
	return e
}

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
