package idle

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
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
	// MaxInterval is the longest a running target goes unprobed, from
	// answer to answer (default 10 s: at 10,000 targets that is about a
	// thousand probes a second, 0.08–0.09 of a core here); a target is
	// probed sooner when its next threshold falls sooner.
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
		c.MaxInterval = 10 * time.Second
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

// minRefreshGap bounds how often a refresh asked for early may run.
const minRefreshGap = time.Second

// timerGap is the least time between two wakes of the loop by its own
// timer, so a target is looked at up to a gap after it is due, with the
// others due by then. At 10,000 targets and a 10 s ceiling a running
// target comes due every millisecond, and a wake per target cost more in
// the scheduler (an idle thread woken, the poller entered) than the probe
// itself: a 20 ms gap gave 0.105 of a core, 100 ms 0.077 (BENCHMARKS.md),
// since a hundred probes then start together and their answers come back
// together.
const timerGap = 100 * time.Millisecond

// Loop applies the idle policy to the provider's targets. Each target runs
// on its own clock: a running target is probed with env/getIdle when its
// next threshold could be reached, and at least every MaxInterval; a
// powered-down target, whose guest cannot answer, is judged from the
// idle-since instant recorded when it was powered down. One goroutine (Run)
// owns every target's state; probes and actions run on goroutines it
// starts, bounded, and it stops them all before Run returns.
type Loop struct {
	cfg Config
	gap time.Duration // timerGap, or a twentieth of a shorter MaxInterval
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
	// counted is what the targets gauge counts: every target of the last
	// listing, brought up to date by each single-target read since, so that
	// a create, close or power change shows within a read, not a listing.
	counted map[string]countedTarget

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
	relook    bool          // a change note came while acting: read the target again once the action ends
	passGen   uint64        // the pass that still waits for this target's probe
}

// newerThan says whether the loop's own knowledge of e is newer than a
// reading begun at started: an action of its own is under way, or ended
// after the reading began. Such a reading is set aside.
func (e *entry) newerThan(started time.Time) bool {
	return e.acting || e.changedAt.After(started)
}

// New builds a loop; Run starts it.
func New(cfg Config) *Loop {
	cfg.defaults()
	return &Loop{
		cfg:       cfg,
		gap:       min(timerGap, cfg.MaxInterval/20),
		inv:       cfg.Inventory,
		m:         cfg.Metrics,
		log:       cfg.Log,
		entries:   map[string]*entry{},
		lookWant:  map[string]struct{}{},
		counted:   map[string]countedTarget{},
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
	var lastFired time.Time
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
		wake := now.Add(l.nextWake(now))
		if floor := lastFired.Add(l.gap); wake.Before(floor) {
			wake = floor
		}
		if armed.IsZero() || wake.Before(armed) {
			timer.Reset(wake.Sub(now))
			armed = wake
		}
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
			armed, lastFired = time.Time{}, time.Now()
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
