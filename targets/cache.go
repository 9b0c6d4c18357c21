package targets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// The observation cache holds the project's instances as Incus's event
// stream says they are, so that target/get, route resolution and the idle
// loop's inventory read memory instead of asking Incus each time.
//
// It answers only while it is confirmed: its event stream is connected,
// and a full list that began after the stream was (see settleAfterConnect)
// has been merged. Anything that may have cost it an event unconfirms it
// until the next such list: the stream ending or going silent, a frame that
// does not decode, an event about instances that does not say which. While
// unconfirmed every read goes to Incus, as without a cache.
//
// Confirmed, an instance's entry is served only while nothing is known to
// have changed it since it was read. An event naming the instance, or a
// write this process made to it (incus.Client.WatchWrites, which also
// reports the end of every operation Wait followed), marks the entry stale
// and queues a re-read: until that re-read lands, reads of that instance
// go to Incus. So a read never answers older than a change this process
// made, and older than a change elsewhere only by the time its event takes
// to arrive. An instance with status Error (a cluster member that does not
// answer) is always read from Incus, whose own fallbacks apply.
//
// Periodic full lists (every refresh) correct what the stream could not
// tell; a correction is counted, since it means an event was missed.
type obsCache struct {
	client  *incus.Client
	project string
	log     *zap.Logger
	m       *CacheMetrics
	refresh time.Duration
	// settle is how long after connecting the confirming list waits, so
	// that Incus has registered the stream before the list is read.
	settle time.Duration
	// rereadsBegun and rereadsEnded count the cache's own re-reads of an
	// instance, so that a count of the client's calls can tell a window
	// in which only its readers called Incus.
	rereadsBegun, rereadsEnded atomic.Int64

	mu        sync.Mutex
	connected bool
	confirmed bool
	// epoch changes whenever the cache is unconfirmed: a list begun in an
	// earlier epoch confirms nothing.
	epoch uint64
	// seq is bumped by every touch; an entry's gen is the seq of its last
	// touch, so a read begun before a touch is never stored over it.
	seq     uint64
	entries map[string]*cacheEntry
	// view is the listing built from entries, reused until one changes.
	view []incus.Instance
	// suspects are the instances the last full list found different from
	// the confirmed cache, by their entry's gen then. A change's event may
	// still be on its way when the list shows the change; one that never
	// came by the next list was missed, and is counted as a correction.
	suspects map[string]uint64
	// finished are operations whose end was heard of, by when: Incus may
	// deliver an operation's events out of order (Running after Success),
	// and this process's own write may tell of its operation after its
	// end's event, neither of which must mark the instance busy again.
	finished map[string]time.Time

	queue   chan string
	pending map[string]bool // names queued for a re-read
	relist  chan struct{}
	changed func(name string) // told of every instance whose entry changed
	// onConfirm is called when the cache becomes confirmed: the
	// reconciler's own listing is then no longer read, and is dropped.
	onConfirm func()
}

type cacheEntry struct {
	inst  *incus.Instance // nil: touched, not yet read (a create under way)
	gen   uint64
	stale bool
	// readAt is when the read that stored inst began: it shows every
	// write Incus had answered by then.
	readAt time.Time
	// ops are the Incus operations on the instance still under way, as its
	// events and this process's own writes tell, by when they were first
	// heard of: while one is, the instance is in transition and its reads
	// go to Incus.
	ops map[string]time.Time
}

// busy says an operation on the instance is under way. One heard of longer
// than opBound ago is taken for ended (its end was missed), so that a lost
// event cannot send an instance's reads to Incus for ever.
func (e *cacheEntry) busy(now time.Time) bool {
	for _, at := range e.ops {
		if now.Sub(at) < opBound {
			return true
		}
	}
	return false
}

// read is lookup through the cache: answered from it when it can, else
// from Incus, and what Incus answered is offered to the cache.
func (s *Service) read(ctx context.Context, name string) (*incus.Instance, error) {
	if s.cache == nil {
		return s.lookup(ctx, name)
	}
	if inst, hit := s.cache.get(name); hit {
		return inst, nil
	}
	return s.lookup(ctx, name)
}

// readSure is read for an answer that is final for the runtime (notFound,
// ownerMismatch, a data route's 410 or 409): the cache answers only an
// instance it holds that would not make such an answer (final false), and
// anything else is asked of Incus. A lost event, or another replica's
// create not seen yet, is exactly such an absence in the cache; these
// answers are rare, so the read costs nothing at steady state. A method
// that changes the target reads it this way too: the change itself reads
// the instance from Incus with its ETag (want, patchIf), so a cached
// instance gone by then is found there.
func (s *Service) readSure(ctx context.Context, name string, final func(*incus.Instance) bool) (*incus.Instance, error) {
	if s.cache != nil {
		if inst, hit := s.cache.get(name); hit && inst != nil && !final(inst) {
			return inst, nil
		}
	}
	return s.lookup(ctx, name)
}

// readFor is the read of a method of owner's: an absence, another owner's
// instance, or a target closing or failed (what a runtime takes as final)
// is confirmed with Incus (readSure).
func (s *Service) readFor(owner controller.Owner) func(context.Context, string) (*incus.Instance, error) {
	return func(ctx context.Context, name string) (*incus.Instance, error) {
		return s.readSure(ctx, name, func(inst *incus.Instance) bool { return finalFor(inst, owner) })
	}
}

// finalFor says whether inst, as owner's target, makes an answer that no
// later request of the owner can undo.
func finalFor(inst *incus.Instance, owner controller.Owner) bool {
	if standinOf(inst) != "" {
		// The owner's stand-in leads on to the target (see ready.go).
		return recordOf(inst.Config, fOwner).Owner != owner
	}
	if checkOwned(inst, owner) != nil {
		return true
	}
	switch StateOf(inst).Phase {
	case controller.PhaseClosing, controller.PhaseClosed, controller.PhaseFailed:
		return true
	}
	return false
}

// Bounds of the cache's own work.
const (
	settleAfterConnect = 500 * time.Millisecond
	rereadWorkers      = 4
	rereadQueue        = 4096
	reconnectMin       = 100 * time.Millisecond
	reconnectMax       = 30 * time.Second
	cacheCallTimeout   = 10 * time.Second
	opBound            = 10 * time.Minute
	// memberWatch is how often a cache on a cluster reads its members'
	// states (one small call): see watchMembers.
	memberWatch = 5 * time.Second
)

func newObsCache(client *incus.Client, log *zap.Logger, m *CacheMetrics, refresh time.Duration, changed func(string)) *obsCache {
	return &obsCache{client: client, project: client.Project(), log: log, m: m, refresh: refresh,
		settle: settleAfterConnect, entries: map[string]*cacheEntry{}, pending: map[string]bool{},
		queue: make(chan string, rereadQueue), relist: make(chan struct{}, 1), changed: changed}
}

// get answers from the cache: hit says it could (inst nil: there is no
// such instance). A miss is to be read from Incus.
func (c *obsCache) get(name string) (inst *incus.Instance, hit bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.confirmed {
		c.m.read(false)
		return nil, false
	}
	e, ok := c.entries[name]
	switch {
	case !ok:
		c.m.read(true)
		return nil, true
	case e.stale || e.inst == nil || e.inst.Status == incus.InstanceError || e.busy(time.Now()):
		c.m.read(false)
		return nil, false
	}
	c.m.read(true)
	return e.inst, true
}

// peek answers the instance's record as the cache last read it, an
// operation on it or not, and when that read began: for what an operation
// does not change (its config), where get would send a read to Incus.
// known is false while the cache is unconfirmed or the entry waits for a
// re-read; inst is nil for an instance that is gone.
func (c *obsCache) peek(name string) (inst *incus.Instance, readAt time.Time, known bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.confirmed {
		return nil, time.Time{}, false
	}
	e, ok := c.entries[name]
	switch {
	case !ok:
		return nil, time.Time{}, true
	case e.stale:
		return nil, time.Time{}, false
	}
	return e.inst, e.readAt, true
}

// mark is taken before a read of name from Incus; offer stores what that
// read found unless the instance was touched (or the cache unconfirmed)
// meanwhile.
// A read begun while the stream was down may be older than a change no
// event will tell of, so only a mark taken while connected can store.
type readMark struct {
	gen, epoch uint64
	connected  bool
	began      time.Time
}

func (c *obsCache) mark(name string) readMark {
	if c == nil {
		return readMark{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	m := readMark{epoch: c.epoch, connected: c.connected, began: time.Now()}
	if e, ok := c.entries[name]; ok {
		m.gen = e.gen
	}
	return m
}

// offer stores a read of name (inst nil: not found) taken after mark. An
// instance in status Error is stored too, and get then sends its reads to
// Incus.
func (c *obsCache) offer(name string, at readMark, inst *incus.Instance) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[name]
	gen := uint64(0)
	if ok {
		gen = e.gen
	}
	if gen != at.gen || c.epoch != at.epoch || !at.connected || !c.connected {
		return
	}
	c.store(name, e, slim(inst), at.began)
}

// store sets name's entry from a fresh read; the lock is held.
func (c *obsCache) store(name string, e *cacheEntry, inst *incus.Instance, readAt time.Time) {
	if inst == nil {
		if e != nil && len(e.ops) > 0 {
			// Absent for now, with an operation under way (a create).
			if e.inst != nil {
				c.view = nil
				c.tellChanged(name)
			}
			e.inst, e.stale, e.readAt = nil, false, readAt
			return
		}
		if e != nil {
			delete(c.entries, name)
			c.view = nil
			c.tellChanged(name)
		}
		return
	}
	if e == nil {
		e = &cacheEntry{}
		c.entries[name] = e
	}
	if e.inst == nil || !sameInstance(e.inst, inst) {
		c.tellChanged(name)
	}
	e.inst, e.stale, e.readAt = inst, false, readAt
	c.view = nil
}

// tellChanged is called with the lock held; changed must not block. Only
// a confirmed cache tells: the first list is no news.
func (c *obsCache) tellChanged(name string) {
	if c.changed != nil && c.confirmed {
		c.changed(name)
	}
}

// touch marks name as changed, so reads of it go to Incus until a re-read
// begun after now lands, and queues that re-read. op, when set, is an
// operation on the instance that began (done false) or ended.
func (c *obsCache) touch(name, op string, done bool) {
	c.mu.Lock()
	c.seq++
	e, ok := c.entries[name]
	if !ok {
		e = &cacheEntry{}
		c.entries[name] = e
	}
	e.gen, e.stale = c.seq, true
	switch {
	case op != "" && done:
		delete(e.ops, op)
		if c.finished == nil {
			c.finished = map[string]time.Time{}
		}
		c.finished[op] = time.Now()
	case op != "":
		if _, ended := c.finished[op]; ended {
			break
		}
		if e.ops == nil {
			e.ops = map[string]time.Time{}
		}
		if _, seen := e.ops[op]; !seen {
			e.ops[op] = time.Now()
		}
	}
	queued := c.pending[name]
	c.pending[name] = true
	c.mu.Unlock()
	if queued {
		return
	}
	select {
	case c.queue <- name:
	default:
		// Too many at once: the entry stays stale (read from Incus) and a
		// full list settles every one of them.
		c.mu.Lock()
		delete(c.pending, name)
		c.mu.Unlock()
		c.askRelist()
	}
}

// unconfirm sends every read to Incus until the next confirming list.
func (c *obsCache) unconfirm(reason string) {
	c.mu.Lock()
	was := c.confirmed
	c.confirmed = false
	c.epoch++
	c.mu.Unlock()
	c.m.gap(reason)
	c.m.setConfirmed(false)
	if was {
		c.log.Info("observation cache unconfirmed; reads go to Incus until it is listed again", zap.String("reason", reason))
	}
}

func (c *obsCache) askRelist() {
	select {
	case c.relist <- struct{}{}:
	default:
	}
}

// list reads every instance and merges them; it confirms the cache when
// confirm is set and nothing unconfirmed it while the list was read.
func (c *obsCache) list(ctx context.Context, confirm bool) error {
	c.mu.Lock()
	epoch, seq := c.epoch, c.seq
	c.mu.Unlock()
	began := time.Now()
	lctx, cancel := context.WithTimeout(ctx, 3*cacheCallTimeout)
	defer cancel()
	// The operations first: one heard of before they were listed and not
	// among them has ended, and its end may have been missed.
	ops, err := c.client.ListOperations(lctx)
	if err != nil {
		return err
	}
	running := make(map[string]bool, len(ops))
	for _, op := range ops {
		running[op.ID] = true
	}
	// Decoded one instance at a time and slimmed at once: the whole
	// listing, 36 MiB at 10,000 instances and several times that decoded,
	// is never held.
	list, err := c.client.ListInstancesKept(lctx, slim)
	if err != nil {
		return err
	}
	c.mu.Lock()
	if c.epoch != epoch || !c.connected {
		c.mu.Unlock()
		return nil
	}
	for _, e := range c.entries {
		for id, at := range e.ops {
			if !running[id] && at.Before(began) {
				delete(e.ops, id)
			}
		}
	}
	for id, at := range c.finished {
		if began.Sub(at) > opBound {
			delete(c.finished, id)
		}
	}
	corrections := 0
	for name, gen := range c.suspects {
		if e, ok := c.entries[name]; (ok && e.gen == gen) || (!ok && gen == 0) {
			corrections++
		}
	}
	suspects := map[string]uint64{}
	seen := make(map[string]bool, len(list))
	for _, inst := range list {
		seen[inst.Name] = true
		e, ok := c.entries[inst.Name]
		if ok && e.gen > seq {
			continue // touched since the list began: its re-read decides
		}
		if ok && c.confirmed && !e.stale && e.inst != nil && !sameInstance(e.inst, inst) {
			suspects[inst.Name] = e.gen
			c.log.Debug("observation cache: the full list differs from the cache", zap.String("instance", inst.Name),
				zap.String("cached", describe(e.inst)), zap.String("listed", describe(inst)))
		}
		if !ok && c.confirmed {
			suspects[inst.Name] = 0
		}
		c.store(inst.Name, e, inst, began)
	}
	for name, e := range c.entries {
		if !seen[name] && e.gen <= seq {
			if c.confirmed && !e.stale && e.inst != nil {
				suspects[name] = 0
			}
			c.store(name, e, nil, began)
		}
	}
	c.suspects = suspects
	was := c.confirmed
	if confirm {
		c.confirmed = true
	}
	n := len(c.entries)
	c.mu.Unlock()
	c.m.corrected(corrections)
	c.m.setSize(n)
	if confirm {
		c.m.setConfirmed(true)
		if !was {
			c.log.Info("observation cache confirmed", zap.Int("instances", n))
			if c.onConfirm != nil {
				c.onConfirm()
			}
		}
	}
	if corrections > 0 {
		c.log.Warn("the full list corrected the observation cache: an event was missed", zap.Int("instances", corrections))
	}
	return nil
}

// find answers copies of the cached instances that match, or ok false
// while unconfirmed; match runs under the cache's lock and must not block.
func (c *obsCache) find(match func(*incus.Instance) bool) (out []incus.Instance, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.confirmed {
		return nil, false
	}
	for _, e := range c.entries {
		if e.inst != nil && match(e.inst) {
			out = append(out, *e.inst)
		}
	}
	return out, true
}

// listing is every cached instance, or ok false while unconfirmed. The
// slice is shared: callers only read it. stale names the entries touched
// since they were read (nil when none): their item in the list, or its
// absence, may predate a write this process has already made, so a
// caller that would undo a newer change of its own by the list must not
// go by them.
func (c *obsCache) listing() (list []incus.Instance, stale map[string]bool, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.confirmed {
		return nil, nil, false
	}
	for name, e := range c.entries {
		if e.stale {
			if stale == nil {
				stale = map[string]bool{}
			}
			stale[name] = true
		}
	}
	if c.view == nil {
		c.view = make([]incus.Instance, 0, len(c.entries))
		for _, e := range c.entries {
			if e.inst != nil {
				c.view = append(c.view, *e.inst)
			}
		}
		slices.SortFunc(c.view, func(a, b incus.Instance) int {
			switch {
			case a.Name < b.Name:
				return -1
			case a.Name > b.Name:
				return 1
			}
			return 0
		})
	}
	return c.view, stale, true
}

// run keeps the stream connected and the cache current until ctx ends.
func (c *obsCache) run(ctx context.Context) {
	stopWrites := c.client.WatchWrites(func(w incus.Write) {
		if w.Project == c.project {
			c.touch(w.Instance, w.Op, w.Done)
		}
	})
	defer stopWrites()
	var workers sync.WaitGroup
	for range rereadWorkers {
		workers.Add(1)
		go func() { defer workers.Done(); c.rereads(ctx) }()
	}
	defer workers.Wait()
	c.m.setConfirmed(false)
	backoff := reconnectMin
	for ctx.Err() == nil {
		lived := c.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if lived {
			backoff = reconnectMin
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(backoff*2, reconnectMax)
	}
}

// session runs one connection of the stream: connect, confirm with a
// list, follow events and relist periodically, until the stream ends.
// confirmed says the session got as far as a confirming list.
func (c *obsCache) session(ctx context.Context) (confirmed bool) {
	stream, err := c.client.ListenEvents(ctx, incus.EventLifecycle, incus.EventOperation)
	if err != nil {
		c.m.connect(false)
		c.log.Debug("observation cache: the event stream does not connect; reads go to Incus", zap.Error(err))
		return false
	}
	c.m.connect(true)
	sctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(sctx, func() { _ = stream.Close() })
	defer func() {
		stop()
		_ = stream.Close()
		cancel()
	}()
	c.mu.Lock()
	// A new epoch: nothing read before the stream was up may be stored.
	c.connected = true
	c.epoch++
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.connected = false
		c.mu.Unlock()
		if ctx.Err() == nil {
			c.unconfirm("stream_ended")
		} else {
			c.unconfirm("stopped")
		}
	}()

	membersDone := make(chan struct{})
	go func() { defer close(membersDone); c.watchMembers(sctx) }()
	defer func() {
		cancel()
		<-membersDone
	}()

	ended := make(chan error, 1)
	go func() { ended <- c.follow(stream) }()
	// retry lists again soon after a list that left the cache unconfirmed
	// (it failed, or something unconfirmed the cache while it ran), rather
	// than a whole period later.
	retry := time.NewTimer(c.settle)
	defer retry.Stop()
	pause := time.Second
	tick := time.NewTicker(c.refresh)
	defer tick.Stop()
	for {
		select {
		case err := <-ended:
			if ctx.Err() == nil {
				c.log.Info("observation cache: the event stream ended; reconnecting", zap.Error(err))
			}
			return confirmed
		case <-retry.C:
		case <-c.relist:
		case <-tick.C:
		}
		if c.relistLogged(sctx, true) {
			confirmed, pause = true, time.Second
			continue
		}
		retry.Reset(pause)
		pause = min(pause*2, reconnectMax)
	}
}

// watchMembers lists the cache again whenever a cluster member's state
// changes. A member whose daemon died sends no event, and Incus shows its
// instances in status Error only once it marks the member offline (about
// 20 s later): without a list then, the cache answered their last state
// until the next correcting list, up to CacheCorrection later (met at 55
// s of a 60 s bound). A member back online is listed again the same way.
// On a single host it returns at once.
func (c *obsCache) watchMembers(ctx context.Context) {
	t := time.NewTicker(memberWatch)
	defer t.Stop()
	clustered, known := false, false
	last := ""
	for {
		cctx, cancel := context.WithTimeout(ctx, cacheCallTimeout)
		if !known {
			if srv, err := c.client.GetServer(cctx); err == nil {
				clustered, known = srv.Environment.ServerClustered, true
			}
		}
		if known && !clustered {
			cancel()
			return
		}
		if known {
			if members, err := c.client.ListClusterMembers(cctx); err == nil {
				now := memberStates(members)
				if last != "" && now != last {
					c.log.Info("observation cache: a cluster member changed state; listing again",
						zap.String("members", now), zap.String("before", last))
					c.askRelist()
				}
				last = now
			}
		}
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// memberStates is the members' states in one comparable line.
func memberStates(members []incus.ClusterMember) string {
	states := make([]string, 0, len(members))
	for _, m := range members {
		states = append(states, m.ServerName+"="+m.Status)
	}
	slices.Sort(states)
	return strings.Join(states, " ")
}

func (c *obsCache) relistLogged(ctx context.Context, confirm bool) bool {
	if err := c.list(ctx, confirm); err != nil {
		if ctx.Err() == nil {
			c.log.Warn("observation cache: the full list failed; retrying at the next period", zap.Error(err))
		}
		return false
	}
	c.mu.Lock()
	ok := c.confirmed
	c.mu.Unlock()
	return ok
}

// follow applies the stream's events until it ends.
func (c *obsCache) follow(stream *incus.EventStream) error {
	for {
		ev, err := stream.Next()
		if errors.Is(err, incus.ErrMalformedEvent) {
			c.m.event("malformed")
			c.log.Warn("observation cache: a malformed event; relisting", zap.Error(err))
			c.unconfirm("malformed")
			c.askRelist()
			continue
		}
		if err != nil {
			return err
		}
		c.m.event(ev.Type)
		if ev.Operation != nil && ev.Operation.Class != "" && ev.Operation.Class != "task" {
			// An exec or a console (class websocket) runs for as long as
			// its streams, and changes nothing of the instance record: the
			// exec dialer holds one per relayed connection.
			continue
		}
		names, ok := ev.Instances(c.project)
		if !ok {
			c.unconfirm("unnamed")
			c.askRelist()
			continue
		}
		op, done := "", false
		if ev.Operation != nil {
			op, done = ev.Operation.ID, ev.Operation.Final()
		}
		for _, n := range names {
			c.touch(n, op, done)
		}
	}
}

// rereads reads the touched instances again, one at a time per worker.
func (c *obsCache) rereads(ctx context.Context) {
	for {
		var name string
		select {
		case <-ctx.Done():
			return
		case name = <-c.queue:
		}
		c.mu.Lock()
		delete(c.pending, name)
		c.mu.Unlock()
		at := c.mark(name)
		c.rereadsBegun.Add(1)
		rctx, cancel := context.WithTimeout(ctx, cacheCallTimeout)
		inst, _, err := c.client.GetInstance(rctx, name)
		cancel()
		c.rereadsEnded.Add(1)
		switch {
		case errors.Is(err, incus.ErrNotFound):
			c.offer(name, at, nil)
		case err != nil:
			// The entry stays stale, so reads of it go to Incus, until a
			// later event or the next full list reads it.
			c.m.gap("reread_failed")
			if ctx.Err() == nil {
				c.log.Debug("observation cache: a re-read failed", zap.String("instance", name), zap.Error(err))
			}
		default:
			c.offer(name, at, inst)
		}
	}
}

// sameInstance compares what StateOf, Observe and the inventory read.
// slim is the part of an instance the cache's readers use: its name,
// type, status, placement, times and the user.* config keys, where the
// provider keeps its metadata. Incus's image.* and volatile.* keys (the
// idmaps are JSON arrays), the devices and the profiles are not kept: no
// reader looks at them, a write never starts from a cached instance (it
// reads its instance again first), and at 10,000 instances they were most of
// what the cache held. A slim copy also lets a listing's whole decode go
// once the cache has taken what it keeps.
func slim(inst *incus.Instance) *incus.Instance {
	if inst == nil {
		return nil
	}
	out := &incus.Instance{Name: inst.Name, Type: inst.Type, Status: inst.Status, StatusCode: inst.StatusCode,
		Stateful: inst.Stateful, Ephemeral: inst.Ephemeral, Location: inst.Location, Project: inst.Project,
		CreatedAt: inst.CreatedAt, LastUsedAt: inst.LastUsedAt}
	n := 0
	for k := range inst.Config {
		if strings.HasPrefix(k, "user.") {
			n++
		}
	}
	out.Config = make(map[string]string, n)
	for k, v := range inst.Config {
		if strings.HasPrefix(k, "user.") {
			out.Config[k] = v
		}
	}
	return out
}

func sameInstance(a, b *incus.Instance) bool {
	return a.Status == b.Status && a.StatusCode == b.StatusCode && a.Stateful == b.Stateful &&
		a.Location == b.Location && maps.Equal(a.Config, b.Config)
}

// CacheMetrics are the observation cache's collectors; a nil *CacheMetrics
// records nothing.
type CacheMetrics struct {
	confirmed prometheus.Gauge
	size      prometheus.Gauge
	events    *prometheus.CounterVec
	connects  *prometheus.CounterVec
	reads     *prometheus.CounterVec
	gaps      *prometheus.CounterVec
	fixes     prometheus.Counter
}

// CacheEventTypes, CacheReadSources and CacheGapReasons are the label
// values of the cache's counters, each series started at zero.
var (
	CacheEventTypes  = []string{incus.EventLifecycle, incus.EventOperation, "malformed"}
	CacheReadSources = []string{"cache", "incus"}
	CacheGapReasons  = []string{"stream_ended", "malformed", "unnamed", "reread_failed", "stopped"}
)

// NewCacheMetrics registers the cache's collectors on reg.
func NewCacheMetrics(reg prometheus.Registerer) *CacheMetrics {
	m := &CacheMetrics{
		confirmed: prometheus.NewGauge(prometheus.GaugeOpts{Name: "incus_provider_cache_confirmed",
			Help: "1 while the observation cache is confirmed (event stream connected and listed since) and serves reads; 0 while reads go to Incus."}),
		size: prometheus.NewGauge(prometheus.GaugeOpts{Name: "incus_provider_cache_instances",
			Help: "Instances the observation cache holds, as of its latest full list."}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "incus_provider_cache_events_total",
			Help: "Incus events the observation cache received, by type (lifecycle, operation, malformed)."}, []string{"type"}),
		connects: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "incus_provider_cache_stream_connects_total",
			Help: "Connections of the observation cache's event stream, by outcome (ok, error)."}, []string{"outcome"}),
		reads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "incus_provider_cache_reads_total",
			Help: "Instance reads through the observation cache, by where they were answered from (cache, incus)."}, []string{"source"}),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "incus_provider_cache_gaps_total",
			Help: "Times the observation cache lost track, by reason (stream_ended, malformed, unnamed, reread_failed, stopped)."}, []string{"reason"}),
		fixes: prometheus.NewCounter(prometheus.CounterOpts{Name: "incus_provider_cache_corrections_total",
			Help: "Instances a periodic full list found different from the confirmed cache: events missed."}),
	}
	reg.MustRegister(m.confirmed, m.size, m.events, m.connects, m.reads, m.gaps, m.fixes)
	for _, t := range CacheEventTypes {
		m.events.WithLabelValues(t)
	}
	for _, o := range []string{"ok", "error"} {
		m.connects.WithLabelValues(o)
	}
	for _, s := range CacheReadSources {
		m.reads.WithLabelValues(s)
	}
	for _, r := range CacheGapReasons {
		m.gaps.WithLabelValues(r)
	}
	return m
}

func (m *CacheMetrics) setConfirmed(ok bool) {
	if m == nil {
		return
	}
	if ok {
		m.confirmed.Set(1)
	} else {
		m.confirmed.Set(0)
	}
}

func (m *CacheMetrics) setSize(n int) {
	if m != nil {
		m.size.Set(float64(n))
	}
}

func (m *CacheMetrics) event(t string) {
	if m == nil {
		return
	}
	if t != incus.EventLifecycle && t != incus.EventOperation {
		t = "malformed"
	}
	m.events.WithLabelValues(t).Inc()
}

func (m *CacheMetrics) connect(ok bool) {
	if m == nil {
		return
	}
	if ok {
		m.connects.WithLabelValues("ok").Inc()
	} else {
		m.connects.WithLabelValues("error").Inc()
	}
}

func (m *CacheMetrics) read(hit bool) {
	if m == nil {
		return
	}
	if hit {
		m.reads.WithLabelValues("cache").Inc()
	} else {
		m.reads.WithLabelValues("incus").Inc()
	}
}

func (m *CacheMetrics) gap(reason string) {
	if m != nil {
		m.gaps.WithLabelValues(reason).Inc()
	}
}

func (m *CacheMetrics) corrected(n int) {
	if m != nil && n > 0 {
		m.fixes.Add(float64(n))
	}
}

// CacheConfirmed says the observation cache is confirmed and answers
// reads (false when it is turned off).
func (s *Service) CacheConfirmed() bool {
	if s.cache == nil {
		return false
	}
	s.cache.mu.Lock()
	defer s.cache.mu.Unlock()
	return s.cache.confirmed
}

// describe is what sameInstance compares, for a log line.
func describe(i *incus.Instance) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s/%d stateful=%v location=%s", i.Status, i.StatusCode, i.Stateful, i.Location)
	// Every key, sorted: the keys' meaning is record.go's, not this dump's.
	pairs := make([][2]string, 0, len(i.Config))
	for k, v := range i.Config {
		pairs = append(pairs, [2]string{k, v})
	}
	slices.SortFunc(pairs, func(x, y [2]string) int { return strings.Compare(x[0], y[0]) })
	for _, kv := range pairs {
		fmt.Fprintf(&b, " %s=%q", kv[0], kv[1])
	}
	return b.String()
}
