package targets

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sync/errgroup"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// cacheRig is a Service whose Incus client goes through a fault proxy
// (so its event stream can be cut) and counts its calls, with only the
// observation cache running (no reconciler: nothing but the test changes
// the instances), and another client, direct to Incus, that plays every
// other process changing them.
type cacheRig struct {
	t       *testing.T
	h       *harness
	other   *incus.Client
	proxy   *incusfault.Proxy
	svc     *Service
	mu      sync.Mutex
	calls   map[string]int
	metrics *CacheMetrics
}

func newCacheRig(t *testing.T) *cacheRig {
	t.Helper()
	h := newHarness(t)
	r := &cacheRig{t: t, h: h, other: h.client, calls: map[string]int{}}
	p := incustest.FaultProxy(t)
	r.proxy = p
	client, err := incus.New(incus.Config{Socket: p.Socket(), Project: h.client.Project(),
		Observe: func(op, _ string, _ time.Duration) { r.mu.Lock(); r.calls[op]++; r.mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	// The periodic list is far off, so that whatever the cache learns
	// within a test comes from the event stream.
	r.metrics = NewCacheMetrics(prometheus.NewRegistry())
	r.svc = mustNew(t, client, h.catalog, h.dialer, zaptest.NewLogger(t),
		Config{ReconcileInterval: 10 * time.Minute, CacheMetrics: r.metrics})
	t.Cleanup(func() {
		if n := testutil.ToFloat64(r.metrics.fixes); n != 0 {
			t.Errorf("the full lists corrected %v cached instances: events were missed", n)
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.svc.cache.run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

func (r *cacheRig) count(op string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[op]
}

func (r *cacheRig) confirmed() bool {
	c := r.svc.cache
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.confirmed
}

func (r *cacheRig) awaitConfirmed(want bool) {
	r.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for r.confirmed() != want {
		if time.Now().After(deadline) {
			r.t.Fatalf("the cache never became confirmed=%v", want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// create makes, through the other client, an instance carrying a
// target's metadata for o (booted, so that its statuses read as powers).
func (r *cacheRig) create(ctx context.Context, o controller.Owner, image bool) {
	r.t.Helper()
	tmpl, _ := r.h.catalog.Get("t1")
	req, err := r.svc.instanceRequest(Name(o), controller.CreateParams{Owner: o, TemplateID: "t1"}, tmpl)
	if err != nil {
		r.t.Fatal(err)
	}
	req.Config[keyBooted] = msString(time.Now())
	if !image {
		req.Source, req.Start = incus.InstanceSource{Type: "none"}, false
	}
	op, err := r.other.CreateInstance(ctx, req)
	if err == nil {
		_, err = r.other.Wait(ctx, op)
	}
	if err != nil {
		r.t.Fatalf("create %s: %v", Name(o), err)
	}
	if image {
		// LXD 5.0 does not start on create (the provider's reconciler
		// does), and a start holds the instance in an operation of its
		// own: wait for it, so that the next change is not refused.
		if inst, _, err := r.other.GetInstance(ctx, Name(o)); err == nil && inst.Status == incus.InstanceStopped {
			r.state(ctx, Name(o), "start")
		}
		r.settled(ctx, Name(o), incus.InstanceRunning)
	}
}

// settled waits until the instance has the status and no operation on it
// is under way.
func (r *cacheRig) settled(ctx context.Context, name string, want incus.InstanceStatus) {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		inst, _, err := r.other.GetInstance(ctx, name)
		if err == nil && inst.Status == want {
			if op, err := r.svc.operationOn(ctx, name); err == nil && op == nil {
				return
			}
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s never settled at %s: %+v, %v", name, want, inst, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *cacheRig) state(ctx context.Context, name, action string) {
	r.t.Helper()
	op, err := r.other.UpdateInstanceState(ctx, name, incus.InstanceStatePut{Action: incus.StateAction(action), Force: true})
	if err == nil {
		_, err = r.other.Wait(ctx, op)
	}
	if err != nil {
		r.t.Fatalf("%s %s: %v", action, name, err)
	}
}

// agrees waits until the cache holds what Incus holds (polling the cache
// alone, which never fills it: only events can), then checks that
// target/get, answered from the cache, tells what a direct read tells.
func (r *cacheRig) agrees(ctx context.Context, o controller.Owner, what string) {
	r.t.Helper()
	name := Name(o)
	deadline := time.Now().Add(30 * time.Second)
	for {
		direct, _, err := r.other.GetInstance(ctx, name)
		if err != nil && !isNotFound(err) {
			r.t.Fatal(err)
		}
		cached, hit := r.svc.cache.get(name)
		var got controller.Observation
		var gerr error
		switch {
		case !hit:
		case direct == nil && cached == nil:
			// notFound is final for the runtime: it costs one read of
			// Incus to confirm, never more.
			// The cache re-reads an instance on each event of it (LXD
			// sends some after the delete's): the count is the get's
			// only over a window in which no re-read began or ran.
			for try := 1; ; try++ {
				begun, ended := r.svc.cache.rereadsBegun.Load(), r.svc.cache.rereadsEnded.Load()
				before := r.count("instance.get")
				_, gerr = r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: name})
				gets := r.count("instance.get") - before
				quiet := begun == ended && r.svc.cache.rereadsEnded.Load() == ended && r.svc.cache.rereadsBegun.Load() == begun
				if kindOf(gerr) != "notFound" || (quiet && gets != 1) {
					r.t.Fatalf("%s: target/get of a deleted target answered %v, with %d Incus GETs (try %d)", what, gerr, gets, try)
				}
				if quiet {
					break
				}
				if try == 20 {
					r.t.Fatalf("%s: the cache re-read the instance during each of 20 gets: no get's own Incus GETs to count", what)
				}
				time.Sleep(50 * time.Millisecond)
			}
			return
		case direct != nil && cached != nil && sameInstance(cached, slim(direct)):
			got, gerr = r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: name})
			if want := Observe(direct, o); gerr == nil && got.Phase == want.Phase && got.Power == want.Power {
				return
			}
		}
		if time.Now().After(deadline) {
			r.svc.cache.mu.Lock()
			if e := r.svc.cache.entries[name]; e != nil {
				r.t.Logf("entry: stale %v, ops %v, gen %d", e.stale, e.ops, e.gen)
			}
			r.svc.cache.mu.Unlock()
			r.t.Fatalf("%s: the cache never agreed with Incus: get %+v (%v), hit %v, cached %+v, direct %+v", what, got, gerr, hit, cached, direct)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func isNotFound(err error) bool { return err != nil && errors.Is(err, incus.ErrNotFound) }

func TestCacheFollowsEveryTransition(t *testing.T) {
	r := newCacheRig(t)
	ctx := ctxT(t)
	r.awaitConfirmed(true)
	o := owner("cache-transitions")
	name := Name(o)
	r.agrees(ctx, o, "before the create")
	r.create(ctx, o, true)
	r.agrees(ctx, o, "created and started")
	for _, step := range []struct{ what, action string }{
		{"paused", "freeze"}, {"resumed", "unfreeze"}, {"stopped", "stop"}, {"started", "start"},
	} {
		drain(r.svc.Changes())
		r.state(ctx, name, step.action)
		r.agrees(ctx, o, step.what)
		// The idle loop (and the targets gauge with it) hears of a change
		// another client made as soon as the cache has read it.
		awaitChange(t, r.svc.Changes(), name, step.what)
	}
	if err := r.other.PatchInstanceConfig(ctx, name, map[string]string{"user.cache-test": "1"}); err != nil {
		t.Fatal(err)
	}
	r.agrees(ctx, o, "config patched by another client")
	if inst, hit := r.svc.cache.get(name); !hit || inst.Config["user.cache-test"] != "1" {
		t.Fatalf("the cache does not hold the other client's patch: hit %v, %+v", hit, inst)
	}
	// A patch this process makes is seen by its very next read, event or not.
	if err := r.svc.patch(ctx, name, map[string]string{"user.cache-own": "2"}); err != nil {
		t.Fatal(err)
	}
	if inst, err := r.svc.read(ctx, name); err != nil || inst.Config["user.cache-own"] != "2" {
		t.Fatalf("the read right after this process's own patch is older than it: %+v, %v", inst, err)
	}

	// Confirmed and at rest: target/get costs Incus nothing.
	r.agrees(ctx, o, "at rest")
	before := r.count("instance.get")
	for range 100 {
		if _, err := r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: name}); err != nil {
			t.Fatal(err)
		}
	}
	if n := r.count("instance.get") - before; n > 5 {
		t.Fatalf("100 gets of a confirmed cache made %d instance GETs to Incus", n)
	} else {
		t.Logf("100 gets, confirmed: %d instance GETs to Incus", n)
	}

	r.state(ctx, name, "stop")
	r.agrees(ctx, o, "stopped before the delete")
	op, err := r.other.DeleteInstance(ctx, name)
	if err == nil {
		_, err = r.other.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	r.agrees(ctx, o, "deleted")
}

func TestCacheStreamCutGoesToIncus(t *testing.T) {
	r := newCacheRig(t)
	ctx := ctxT(t)
	o := owner("cache-cut")
	name := Name(o)
	r.create(ctx, o, false)
	r.awaitConfirmed(true)
	r.agrees(ctx, o, "created")

	// Cut the stream and refuse it back: the cache must notice and send
	// every read to Incus.
	refuse := r.proxy.Add(incusfault.Rule{Method: "GET", Path: "/1.0/events", Fault: incusfault.Refuse})
	if n := r.proxy.CutEvents(); n != 1 {
		t.Fatalf("cut %d event streams, want the cache's one", n)
	}
	r.awaitConfirmed(false)
	if err := r.other.PatchInstanceConfig(ctx, name, map[string]string{"user.while-cut": "1"}); err != nil {
		t.Fatal(err)
	}
	before := r.count("instance.get")
	inst, err := r.svc.read(ctx, name)
	if err != nil || inst.Config["user.while-cut"] != "1" {
		t.Fatalf("while cut, a read does not see a change made meanwhile: %+v, %v", inst, err)
	}
	if _, hit := r.svc.cache.get(name); hit {
		t.Fatal("the cache answers while its stream is cut")
	}
	if r.count("instance.get") == before {
		t.Fatal("while cut, the read was not sent to Incus")
	}
	// A change while cut, then the stream back: the confirming list
	// brings it in.
	if err := r.other.PatchInstanceConfig(ctx, name, map[string]string{"user.while-cut": "2"}); err != nil {
		t.Fatal(err)
	}
	r.proxy.Remove(refuse)
	r.awaitConfirmed(true)
	if inst, hit := r.svc.cache.get(name); !hit || inst == nil || inst.Config["user.while-cut"] != "2" {
		t.Fatalf("once confirmed again, the cache misses the change made while cut: hit %v, %+v", hit, inst)
	}
	r.agrees(ctx, o, "after the cut")
}

func TestCacheManyOwners(t *testing.T) {
	r := newCacheRig(t)
	ctx := ctxT(t)
	r.awaitConfirmed(true)
	const n = 30
	owners := make([]controller.Owner, n)
	for i := range owners {
		owners[i] = owner(fmt.Sprintf("cache-many-%02d", i))
	}
	var g errgroup.Group
	g.SetLimit(8)
	for _, o := range owners {
		g.Go(func() error { r.create(ctx, o, false); return nil })
	}
	_ = g.Wait()
	for _, o := range owners {
		g.Go(func() error {
			return r.other.PatchInstanceConfig(ctx, Name(o), map[string]string{"user.many": Name(o)})
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	var agreed atomic.Int32
	for _, o := range owners {
		r.agrees(ctx, o, "patched")
		agreed.Add(1)
	}
	before := r.count("instance.get")
	var wg sync.WaitGroup
	for _, o := range owners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				if _, err := r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: Name(o)}); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if got := r.count("instance.get") - before; got > 5 {
		t.Fatalf("%d gets across %d owners made %d instance GETs to Incus", 10*n, n, got)
	} else {
		t.Logf("%d gets across %d owners: %d instance GETs to Incus", 10*n, agreed.Load(), got)
	}
	if list, _, ok := r.svc.cache.listing(); !ok || len(list) != n {
		t.Fatalf("the cache lists %d instances (confirmed %v), want %d", len(list), ok, n)
	}
}

func drain(ch <-chan string) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

func awaitChange(t *testing.T, ch <-chan string, name, what string) {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case got := <-ch:
			if got == name {
				return
			}
		case <-timeout:
			t.Fatalf("%s: the change feed never named %s", what, name)
		}
	}
}

func TestSlimKeepsWhatReadersUse(t *testing.T) {
	at := time.Unix(1_800_000_000, 0)
	full := &incus.Instance{Name: "ls-1", Type: "container", Status: incus.InstanceFrozen, StatusCode: 110,
		Stateful: true, Location: "m2", Project: "p", CreatedAt: at, LastUsedAt: at.Add(time.Hour),
		Architecture: "x86_64", Description: "d", Profiles: []string{"default"},
		Devices: map[string]map[string]string{"root": {"type": "disk"}},
		Config: map[string]string{keySchema: "1", keyEnvironment: "e", "user.other": "x",
			"volatile.idmap.current": `[{"Isuid":true}]`, "image.os": "busybox"}}
	got := slim(full)
	want := &incus.Instance{Name: "ls-1", Type: "container", Status: incus.InstanceFrozen, StatusCode: 110,
		Stateful: true, Location: "m2", Project: "p", CreatedAt: at, LastUsedAt: at.Add(time.Hour),
		Config: map[string]string{keySchema: "1", keyEnvironment: "e", "user.other": "x"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("slim:\n got %+v\nwant %+v", got, want)
	}
	if StateOf(got) != StateOf(full) || DaemonPort(got) != DaemonPort(full) {
		t.Fatal("a slim instance reads as another state than the full one")
	}
	if slim(nil) != nil {
		t.Fatal("slim(nil) is not nil")
	}
}

// A method that changes a target reads it through the cache only when the
// cache holds it: an absence is asked of Incus, since another replica's
// create may not have reached this one's cache yet (here the entry is
// taken out by hand, as an event still on its way would leave it), and
// notFound would be answered at once.
func TestAChangeAsksIncusWhatTheCacheLacks(t *testing.T) {
	h := newHarness(t)
	a, _ := h.start(h.catalog)
	b, _ := h.start(h.catalog)
	ctx := ctxT(t)
	o := owner("cache-lacks")
	ref := controller.TargetRef{Owner: o}
	if _, err := a.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "t1"}); err != nil {
		t.Fatal(err)
	}
	until(t, "active", func() (controller.Observation, error) { return a.GetTarget(ctx, ref) }, isActive)
	forget := func() bool {
		c := b.cache
		c.mu.Lock()
		defer c.mu.Unlock()
		if !c.confirmed {
			return false
		}
		delete(c.entries, Name(o))
		c.view = nil
		return true
	}
	deadline := time.Now().Add(30 * time.Second)
	for !forget() {
		if time.Now().After(deadline) {
			t.Fatal("the second replica's cache never became confirmed")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if inst, hit := b.cache.get(Name(o)); !hit || inst != nil {
		t.Fatalf("the cache answers %v, hit %v; want a hit with no instance: the test tested nothing", inst, hit)
	}
	if _, err := b.SetPower(ctx, ref, controller.PowerPaused); err != nil {
		t.Fatalf("setPower through a replica whose cache lacks the target: %v", err)
	}
	until(t, "paused", func() (controller.Observation, error) { return a.GetTarget(ctx, ref) },
		func(o controller.Observation, err error) bool { return err == nil && o.Power == controller.PowerPaused })
}
