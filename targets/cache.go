package targets

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

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

	queue   chan string
	pending map[string]bool // names queued for a re-read
	relist  chan struct{}
	changed func(name string) // told of every instance whose entry changed
}

type cacheEntry struct {
	inst  *incus.Instance // nil: touched, not yet read (a create under way)
	gen   uint64
	stale bool
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
	at := s.cache.mark(name)
	inst, err := s.lookup(ctx, name)
	if err == nil && (inst == nil || inst.Status != incus.InstanceError) {
		s.cache.offer(name, at, inst)
	}
	return inst, err
}

// Bounds of the cache's own work.
const (
	settleAfterConnect = 500 * time.Millisecond
	rereadWorkers      = 4
	rereadQueue        = 4096
	reconnectMin       = 100 * time.Millisecond
	reconnectMax       = 30 * time.Second
	cacheCallTimeout   = 10 * time.Second
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
	case e.stale || e.inst == nil || e.inst.Status == incus.InstanceError:
		c.m.read(false)
		return nil, false
	}
	c.m.read(true)
	return e.inst, true
}

// mark is taken before a read of name from Incus; offer stores what that
// read found unless the instance was touched (or the cache unconfirmed)
// meanwhile.
// A read begun while the stream was down may be older than a change no
// event will tell of, so only a mark taken while connected can store.
type readMark struct {
	gen, epoch uint64
	connected  bool
}

func (c *obsCache) mark(name string) readMark {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := readMark{epoch: c.epoch, connected: c.connected}
	if e, ok := c.entries[name]; ok {
		m.gen = e.gen
	}
	return m
}

// offer stores a read of name (inst nil: not found) taken after mark.
func (c *obsCache) offer(name string, at readMark, inst *incus.Instance) {
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
	c.store(name, e, inst)
}

// store sets name's entry from a fresh read; the lock is held.
func (c *obsCache) store(name string, e *cacheEntry, inst *incus.Instance) {
	if inst == nil {
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
	e.inst, e.stale = inst, false
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
// begun after now lands, and queues that re-read.
func (c *obsCache) touch(name string) {
	c.mu.Lock()
	c.seq++
	e, ok := c.entries[name]
	if !ok {
		e = &cacheEntry{}
		c.entries[name] = e
	}
	e.gen, e.stale = c.seq, true
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
	lctx, cancel := context.WithTimeout(ctx, 3*cacheCallTimeout)
	list, err := c.client.ListInstances(lctx)
	cancel()
	if err != nil {
		return err
	}
	c.mu.Lock()
	if c.epoch != epoch || !c.connected {
		c.mu.Unlock()
		return nil
	}
	seen := make(map[string]bool, len(list))
	corrections := 0
	for i := range list {
		inst := &list[i]
		seen[inst.Name] = true
		e, ok := c.entries[inst.Name]
		if ok && e.gen > seq {
			continue // touched since the list began: its re-read decides
		}
		if ok && c.confirmed && !e.stale && e.inst != nil && !sameInstance(e.inst, inst) {
			corrections++
		}
		if !ok && c.confirmed {
			corrections++
		}
		c.store(inst.Name, e, inst)
	}
	for name, e := range c.entries {
		if !seen[name] && e.gen <= seq {
			if c.confirmed && !e.stale && e.inst != nil {
				corrections++
			}
			c.store(name, e, nil)
		}
	}
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
		}
	}
	if corrections > 0 {
		c.log.Warn("the full list corrected the observation cache: an event was missed", zap.Int("instances", corrections))
	}
	return nil
}

// listing is every cached instance, or ok false while unconfirmed. The
// slice is shared: callers only read it.
func (c *obsCache) listing() (list []incus.Instance, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.confirmed {
		return nil, false
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
	return c.view, true
}

// run keeps the stream connected and the cache current until ctx ends.
func (c *obsCache) run(ctx context.Context) {
	stopWrites := c.client.WatchWrites(func(project, name string) {
		if project == c.project {
			c.touch(name)
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

	ended := make(chan error, 1)
	go func() { ended <- c.follow(stream) }()
	settle := time.NewTimer(c.settle)
	defer settle.Stop()
	tick := time.NewTicker(c.refresh)
	defer tick.Stop()
	for {
		select {
		case err := <-ended:
			if ctx.Err() == nil {
				c.log.Info("observation cache: the event stream ended; reconnecting", zap.Error(err))
			}
			return confirmed
		case <-settle.C:
			confirmed = c.relistLogged(sctx, true) || confirmed
		case <-c.relist:
			confirmed = c.relistLogged(sctx, true) || confirmed
		case <-tick.C:
			c.relistLogged(sctx, true)
		}
	}
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
		names, ok := ev.Instances(c.project)
		if !ok {
			c.unconfirm("unnamed")
			c.askRelist()
			continue
		}
		for _, n := range names {
			c.touch(n)
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
		rctx, cancel := context.WithTimeout(ctx, cacheCallTimeout)
		inst, _, err := c.client.GetInstance(rctx, name)
		cancel()
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
