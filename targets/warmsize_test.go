package targets

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/testrig"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// TestWarmSizeFollowsBursts: the size wanted is the largest burst within
// the window during the shrink period and a quarter more, between the
// pool's minimum and maximum; it falls back to the minimum once the burst
// is older than the shrink period.
func TestWarmSizeFollowsBursts(t *testing.T) {
	tm := &templates.Template{Wire: controller.Template{TemplateID: "w"}, Warm: 2, WarmMax: 12}
	const window, keep = 30 * time.Second, 10 * time.Minute
	t0 := time.UnixMilli(1_790_000_000_000)
	var d demand
	if n := d.size(tm, t0, window, keep); n != 2 {
		t.Fatalf("no creates: size %d, want the minimum 2", n)
	}
	// Three creates a minute apart are no burst: one at a time.
	for i := range 3 {
		d.note("w", t0.Add(time.Duration(i)*time.Minute), keep)
	}
	if n := d.size(tm, t0.Add(3*time.Minute), window, keep); n != 2 {
		t.Fatalf("creates a minute apart: size %d, want 2", n)
	}
	// Six within ten seconds: 6 and a quarter more, 8 (rounded up).
	burst := t0.Add(4 * time.Minute)
	for i := range 6 {
		d.note("w", burst.Add(time.Duration(i)*2*time.Second), keep)
	}
	if n := d.size(tm, burst.Add(time.Minute), window, keep); n != 8 {
		t.Fatalf("a burst of 6: size %d, want 8", n)
	}
	// A bigger burst: up to the maximum and no further.
	big := burst.Add(2 * time.Minute)
	for i := range 40 {
		d.note("w", big.Add(time.Duration(i)*100*time.Millisecond), keep)
	}
	if n := d.size(tm, big.Add(5*time.Second), window, keep); n != 12 {
		t.Fatalf("a burst of 40: size %d, want the maximum 12", n)
	}
	// Once the bursts are older than the shrink period: the minimum.
	if n := d.size(tm, big.Add(keep+time.Minute), window, keep); n != 2 {
		t.Fatalf("after the shrink period: size %d, want 2", n)
	}
	// A fixed pool (no warmMax) ignores demand; no pool wants nothing.
	fixed := &templates.Template{Wire: controller.Template{TemplateID: "w"}, Warm: 3, WarmMax: 3}
	d.note("w", big.Add(keep+2*time.Minute), keep)
	if n := d.size(fixed, big.Add(keep+2*time.Minute), window, keep); n != 3 {
		t.Fatalf("a fixed pool: size %d, want 3", n)
	}
	if n := d.size(&templates.Template{Wire: controller.Template{TemplateID: "x"}}, t0, window, keep); n != 0 {
		t.Fatalf("no pool: size %d", n)
	}
}

func TestLargestBurst(t *testing.T) {
	at := func(ms ...int) []time.Time {
		var out []time.Time
		for _, m := range ms {
			out = append(out, time.UnixMilli(int64(m)))
		}
		return out
	}
	for _, c := range []struct {
		a    []time.Time
		want int
	}{
		{nil, 0},
		{at(0), 1},
		{at(0, 999, 1000, 1001), 3}, // a window of 1 s holds [0, 1000) or [999, 1999)
		{at(0, 5000, 5001, 5002, 9000), 3},
	} {
		if got := largestBurst(c.a, time.Second); got != c.want {
			t.Errorf("largestBurst(%v) = %d, want %d", c.a, got, c.want)
		}
	}
}

// offsetClock is the wall clock moved forward by what a test adds: the
// service goes on at the machine's pace, and a test skips a shrink period.
type offsetClock struct{ by atomic.Int64 }

func (c *offsetClock) now() time.Time       { return time.Now().Add(time.Duration(c.by.Load())) }
func (c *offsetClock) skip(d time.Duration) { c.by.Add(int64(d)) }

// TestWarmPoolFollowsDemand, on the real Incus: a pool of 1 to 6 meets a
// burst of 4 creates, grows to 5 (4 and a quarter, rounded up) with the
// metrics saying so, hands the new spares out to a second burst and grows
// to its maximum (8 creates in the window), and once a shrink period has
// passed without a burst (the service's clock moved forward), goes back
// to 1. The window is the shrink period, so that both bursts fall in it
// however slow the machine. Every owner holds one instance throughout.
// demandHarness is a harness whose template w keeps a pool sized by
// demand, from warm to warmMax.
func demandHarness(t *testing.T, warm, warmMax int) *harness {
	t.Helper()
	client := incustest.Client(t)
	image := incustest.Image(t)
	return &harness{t: t, client: client, dialer: testrig.GuestDialer(t, client), catalog: testrig.Catalog(t, client, image, fmt.Sprintf(`templates:
  - templateId: w
    displayName: a pool sized by demand
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    warm: %d
    warmMax: %d
`, warm, warmMax))}
}

func TestWarmPoolFollowsDemand(t *testing.T) {
	h := demandHarness(t, 1, 6)
	client := h.client
	reg := prometheus.NewRegistry()
	clk := &offsetClock{}
	cfg := Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Second, WarmStale: 3 * time.Second, WarmMetrics: NewWarmMetrics(reg),
		WarmBurstWindow: DefaultWarmShrinkAfter}
	svc := mustNew(t, client, h.catalog, h.dialer, zaptest.NewLogger(t), cfg)
	svc.now = clk.now
	runUntilCleanup(t, svc)
	began := time.Now()
	timeline := func(what string) {
		t.Logf("%6.1fs  %-44s ready %d, wanted %v", time.Since(began).Seconds(), what, len(h.warmReady()),
			testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")))
	}
	h.awaitPool(t, 1)
	timeline("the minimum")

	var owners []controller.Owner
	burst := func(n int) {
		var wg sync.WaitGroup
		for i := range n {
			o := owner(fmt.Sprintf("demand-%d-%d", len(owners), i))
			owners = append(owners, o)
			wg.Go(func() { createUntilID(t, svc, controller.CreateParams{Owner: o, TemplateID: "w"}) })
		}
		wg.Wait()
	}
	burst(4)
	timeline("a burst of 4 answered")
	if w := testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")); w != 5 {
		t.Errorf("the size wanted after a burst of 4: %v, want 5", w)
	}
	h.awaitPool(t, 5)
	timeline("grown")
	hits := testutil.ToFloat64(svc.cfg.WarmMetrics.handouts.WithLabelValues("w", "hit"))
	burst(4)
	timeline("a second burst of 4 answered")
	if got := testutil.ToFloat64(svc.cfg.WarmMetrics.handouts.WithLabelValues("w", "hit")) - hits; got != 4 {
		t.Errorf("the second burst was handed %v warm instances, want all 4", got)
	}
	if w := testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")); w != 6 {
		t.Errorf("the size wanted after 8 creates in the window: %v, want the maximum 6", w)
	}
	h.awaitPool(t, 6)
	timeline("grown to the maximum")
	if n := testutil.CollectAndCount(svc.cfg.WarmMetrics.handoutT); n != 1 {
		t.Errorf("hand-out time series: %d, want 1", n)
	}

	clk.skip(DefaultWarmShrinkAfter + time.Minute)
	h.awaitPool(t, 1)
	timeline("shrunk after a shrink period without a burst")
	if w := testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")); w != 1 {
		t.Errorf("the size wanted after the shrink period: %v, want 1", w)
	}
	h.checkOnePerOwner(t, owners)
}

// TestWarmPoolStopsAtTheMemoryCeiling, on the real Incus: a pool of 1 to 6
// of 64 MiB spares under a 192 MiB ceiling meets a burst of 4 creates and
// wants 5, but holds 3; the gauge says 2 are held back.
func TestWarmPoolStopsAtTheMemoryCeiling(t *testing.T) {
	client := incustest.Client(t)
	image := incustest.Image(t)
	h := &harness{t: t, client: client, dialer: testrig.GuestDialer(t, client), catalog: testrig.Catalog(t, client, image, `templates:
  - templateId: w
    displayName: a pool under a memory ceiling
    powerStates: [running, paused, stopped]
    resources: {memoryBytes: 67108864}
    imageAlias: {{image}}
    warm: 1
    warmMax: 6
`)}
	reg := prometheus.NewRegistry()
	cfg := Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Second, WarmStale: 3 * time.Second, WarmMetrics: NewWarmMetrics(reg),
		WarmBurstWindow: DefaultWarmShrinkAfter, WarmMemoryMax: 3 * 64 << 20}
	svc := mustNew(t, client, h.catalog, h.dialer, zaptest.NewLogger(t), cfg)
	runUntilCleanup(t, svc)
	h.awaitPool(t, 1)
	var owners []controller.Owner
	var wg sync.WaitGroup
	for i := range 4 {
		o := owner(fmt.Sprintf("ceiling-%d", i))
		owners = append(owners, o)
		wg.Go(func() { createUntilID(t, svc, controller.CreateParams{Owner: o, TemplateID: "w"}) })
	}
	wg.Wait()
	h.awaitPool(t, 3)
	for deadline := time.Now().Add(30 * time.Second); testutil.ToFloat64(svc.cfg.WarmMetrics.held.WithLabelValues("w")) != 2; {
		if time.Now().After(deadline) {
			t.Fatalf("held back: %v, want 2 (wanted %v)", testutil.ToFloat64(svc.cfg.WarmMetrics.held.WithLabelValues("w")),
				testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")))
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Rounds of refill go by (one a second, and on every kick): never more.
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		n := 0
		for _, inst := range h.instances() {
			if isWarmName(inst.Name) {
				n++
			}
		}
		if n > 3 {
			t.Fatalf("%d warm instances under a ceiling of 3", n)
		}
	}
	if w := testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")); w != 5 {
		t.Errorf("wanted %v, want 5", w)
	}
	h.checkOnePerOwner(t, owners)
}

// runUntilCleanup runs the service until the test's cleanup.
func runUntilCleanup(t *testing.T, svc *Service) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = svc.Run(ctx)
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// TestWarmDemandWithDozensOfOwners, on the real Incus: two replicas with
// one pool sized by demand (2 to 48) and one clock meet 36 owners at once,
// split between them at random (the seed is logged), and a third of the
// owners closed as soon as their create answers, racing the hand-outs and
// refills. Each replica's size grows with the creates it answered; once a
// shrink period has passed the pool goes back to 2. Every owner still
// open holds exactly one instance, every closed one none, and nothing is
// orphaned or left claimed.
func TestWarmDemandWithDozensOfOwners(t *testing.T) {
	h := demandHarness(t, 2, 48)
	client := h.client
	clk := &offsetClock{}
	var svcs [2]*Service
	for i := range svcs {
		cfg := Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Second, WarmStale: 10 * time.Second,
			WarmMetrics: NewWarmMetrics(prometheus.NewRegistry()), WarmBurstWindow: DefaultWarmShrinkAfter,
			Replica: fmt.Sprintf("dozens-%d", i)}
		svcs[i] = mustNew(t, client, h.catalog, h.dialer, zaptest.NewLogger(t), cfg)
		svcs[i].now = clk.now
		runUntilCleanup(t, svcs[i])
	}
	h.awaitPool(t, 2)
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	const n = 36
	owners := make([]controller.Owner, n)
	via := make([]int, n)
	closes := map[int]bool{}
	for _, i := range rng.Perm(n)[:n/3] {
		closes[i] = true
	}
	var answered [2]int
	for i := range owners {
		owners[i] = owner(fmt.Sprintf("dozens-%d", i))
		via[i] = rng.IntN(2)
		answered[via[i]]++
	}
	var wg sync.WaitGroup
	for i, o := range owners {
		svc := svcs[via[i]]
		wg.Go(func() {
			p := controller.CreateParams{Owner: o, TemplateID: "w"}
			got := createUntilID(t, svc, p)
			if got.TargetID != Name(o) {
				return // createUntilID reported it
			}
			if !closes[i] {
				return
			}
			// Closed at once, by the other replica half of the time.
			closer := svcs[(via[i]+i)%2]
			for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				obs, err := closer.CloseTarget(context.Background(), controller.TargetRef{Owner: o})
				if err == nil && obs.Phase == controller.PhaseClosed {
					return
				}
				if time.Now().After(deadline) {
					t.Errorf("owner %d never closed: %+v, %v", i, obs, err)
					return
				}
			}
		})
	}
	wg.Wait()
	grown := 0
	for i, svc := range svcs {
		// Every owner's create counted, a quarter more, within the
		// minimum and the maximum. A create retried after it failed
		// (unavailable, its budget spent on a loaded Incus) counts again,
		// so the size may be larger, never smaller.
		least := min(max((answered[i]*5+3)/4, 2), 48)
		w := int(testutil.ToFloat64(svc.cfg.WarmMetrics.wanted.WithLabelValues("w")))
		if w < least || w > 48 {
			t.Errorf("replica %d answered %d creates and wants %d spares, want %d to 48", i, answered[i], w, least)
		}
		t.Logf("replica %d answered %d creates and wants %d spares", i, answered[i], w)
		grown = max(grown, w)
	}
	var open []controller.Owner
	for i, o := range owners {
		if !closes[i] {
			open = append(open, o)
		}
	}
	// Grown to the larger replica's size (slots are shared names).
	h.awaitPool(t, grown)
	h.checkOnePerOwner(t, open)
	clk.skip(DefaultWarmShrinkAfter + time.Minute)
	h.awaitPool(t, 2)
	h.checkOnePerOwner(t, open)
}
