package targets

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/testrig"
)

// BenchmarkWarmCreate measures create → active (as the runtime sees it:
// target/create, then get every 20 ms until active) for new owners, from a
// template with a warm pool; from a template without one in the same
// catalog, whose creates are staged (built under a staging name, then
// renamed: see staged.go); and, as the baseline in the same run, from a
// catalog without any pool in a project of its own, whose creates go to
// the owner's name: b.N owners one after the other (before each
// warm one the pool is refilled, untimed), then b.N owners at once (the
// warm pool holds b.N first, at most 32). A phase without hand-outs starts
// with the pool full, so that no refill runs beside it. Every target is
// closed after its phase, untimed.
//
//	INCUS_PROVIDER_REQUIRE_INCUS=1 go test -run '^$' -bench WarmCreate -benchtime 20x ./targets/
//
// INCUS_PROVIDER_BENCH_IMAGE names another image alias, such as the one
// with 40,000 small files:
//
//	GUEST_IMAGE_ALIAS=lightspeed-dev-guest-40k GUEST_EXTRA_FILES=40000 deploy/guest/build-image.sh
//	INCUS_PROVIDER_BENCH_IMAGE=lightspeed-dev-guest-40k INCUS_PROVIDER_REQUIRE_INCUS=1 go test -run '^$' -bench WarmCreate -benchtime 20x ./targets/
func BenchmarkWarmCreate(b *testing.B) {
	client := incustest.Client(b)
	image := incustest.Image(b)
	if alias := os.Getenv("INCUS_PROVIDER_BENCH_IMAGE"); alias != "" {
		image = alias
	}
	n := b.N
	pool := min(n, 32)
	catalog := testrig.Catalog(b, client, image, `templates:
  - templateId: cold
    displayName: no pool
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
  - templateId: warm
    displayName: a warm pool
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    warm: `+strconv.Itoa(pool)+`
`)
	h := &harness{t: b, client: client, catalog: catalog, dialer: testrig.GuestDialer(b, client)}
	reg := prometheus.NewRegistry()
	svc, _ := h.startWarm(catalog, reg, nil)
	// The plain baseline: a project of its own whose catalog keeps no pool,
	// so its creates are sent to the owner's name; in the project above
	// every create without a warm instance is staged (see staged.go).
	plainClient := incustest.Client(b)
	plainCatalog := testrig.Catalog(b, plainClient, image, `templates:
  - templateId: cold
    displayName: no pool anywhere
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
`)
	ph := &harness{t: b, client: plainClient, catalog: plainCatalog, dialer: testrig.GuestDialer(b, plainClient)}
	plain, _ := ph.startWarm(plainCatalog, nil, nil)
	hits := func() float64 { return testutil.ToFloat64(svc.cfg.WarmMetrics.handouts.WithLabelValues("warm", "hit")) }
	ctx := context.Background()
	run := 0
	toActive := func(svc *Service, template string) time.Duration {
		run++
		o := owner(fmt.Sprintf("bench-%s-%d-%d", template, time.Now().UnixNano(), run))
		start := time.Now()
		obs, err := svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: template})
		for !isActive(obs, err) {
			if time.Since(start) > 3*time.Minute {
				b.Errorf("%s: never active: %+v, %v", template, obs, err)
				return 0
			}
			time.Sleep(20 * time.Millisecond)
			obs, err = svc.GetTarget(ctx, controller.TargetRef{Owner: o})
		}
		return time.Since(start)
	}
	awaitPool := func(want int) {
		deadline := time.Now().Add(10 * time.Minute)
		for len(h.warmReady()) < want {
			if time.Now().After(deadline) {
				b.Fatalf("the pool never held %d ready instances", want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	closeAll := func(h *harness, svc *Service) {
		for _, inst := range h.instances() {
			if !looksLikeTargetID(inst.Name) {
				continue
			}
			o, ok := ownerOf(&inst)
			if !ok {
				continue
			}
			for {
				obs, err := svc.CloseTarget(ctx, controller.TargetRef{Owner: o})
				if err == nil && obs.Phase == controller.PhaseClosed {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	sequential := func(h *harness, svc *Service, template string) []time.Duration {
		var out []time.Duration
		for range n {
			if template == "warm" {
				awaitPool(1)
			}
			out = append(out, toActive(svc, template))
		}
		closeAll(h, svc)
		return out
	}
	concurrent := func(h *harness, svc *Service, template string) []time.Duration {
		if template == "warm" {
			awaitPool(pool)
		}
		out := make([]time.Duration, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { out[i] = toActive(svc, template) })
		}
		wg.Wait()
		closeAll(h, svc)
		return out
	}
	report := func(name string, ds []time.Duration) {
		b.ReportMetric(ms(median(ds)), name+"-p50-ms")
		b.ReportMetric(ms(pct(ds, 95)), name+"-p95-ms")
	}
	// One untimed create on each first: whichever phase ran first was
	// about 0.18 s slower at p50 (measured in both orders), a cost of the
	// first creates of a run, not of either path.
	toActive(plain, "cold")
	toActive(svc, "cold")
	closeAll(ph, plain)
	closeAll(h, svc)
	// Every phase without a hand-out starts with the pool full, so that
	// no refill runs beside it: with 40,000 files a refill is seconds of
	// disk work per instance.
	awaitPool(pool)
	b.ResetTimer()
	plainSeq := sequential(ph, plain, "cold")
	coldSeq := sequential(h, svc, "cold")
	before := hits()
	warmSeq := sequential(h, svc, "warm")
	seqHits := hits() - before
	awaitPool(pool)
	plainAll := concurrent(ph, plain, "cold")
	coldAll := concurrent(h, svc, "cold")
	before = hits()
	warmAll := concurrent(h, svc, "warm")
	allHits := hits() - before
	b.StopTimer()
	report("plain-one", plainSeq)
	report("staged-one", coldSeq)
	report("warm-one", warmSeq)
	report("plain-at-once", plainAll)
	report("staged-at-once", coldAll)
	report("warm-at-once", warmAll)
	b.ReportMetric(seqHits, "warm-one-hits")
	b.ReportMetric(allHits, "warm-at-once-hits")
	b.ReportMetric(0, "ns/op")
	b.Logf("image %s, %d owners per phase, pool of %d", image, n, pool)
}

// BenchmarkWarmStoppedVersusStarted measures what handing out a warm
// instance costs through the Incus API, for the two ways a pool could keep
// it: created and never started (rename, then start), or started ahead
// (Incus renames only a stopped instance: a forced stop, rename, start).
// b.N rounds of each, p50 and p95.
//
//	INCUS_PROVIDER_REQUIRE_INCUS=1 go test -run '^$' -bench WarmStoppedVersusStarted -benchtime 10x ./targets/
func BenchmarkWarmStoppedVersusStarted(b *testing.B) {
	client := incustest.Client(b)
	image := incustest.Image(b)
	if alias := os.Getenv("INCUS_PROVIDER_BENCH_IMAGE"); alias != "" {
		image = alias
	}
	ctx := context.Background()
	fp, err := client.GetImageAlias(ctx, image)
	if err != nil {
		b.Fatal(err)
	}
	do := func(op *incus.Operation, err error) {
		b.Helper()
		if err == nil {
			_, err = client.Wait(ctx, op)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	state := func(name, action string) {
		do(client.UpdateInstanceState(ctx, name, incus.InstanceStatePut{Action: incus.StateAction(action), Force: action == "stop"}))
	}
	var stopped, started []time.Duration
	for i := range b.N {
		for _, ahead := range []bool{false, true} {
			name := fmt.Sprintf("warm-bench-%d-%v", i, ahead)
			do(client.CreateInstance(ctx, incus.InstancesPost{Name: name, Source: incus.InstanceSource{Type: "image", Fingerprint: fp}}))
			if ahead {
				state(name, "start")
			}
			start := time.Now()
			if ahead {
				state(name, "stop")
			}
			do(client.RenameInstance(ctx, name, name+"-owner"))
			state(name+"-owner", "start")
			if ahead {
				started = append(started, time.Since(start))
			} else {
				stopped = append(stopped, time.Since(start))
			}
			state(name+"-owner", "stop")
			do(client.DeleteInstance(ctx, name+"-owner"))
		}
	}
	b.ReportMetric(ms(median(stopped)), "stopped-rename-start-p50-ms")
	b.ReportMetric(ms(pct(stopped, 95)), "stopped-rename-start-p95-ms")
	b.ReportMetric(ms(median(started)), "started-stop-rename-start-p50-ms")
	b.ReportMetric(ms(pct(started, 95)), "started-stop-rename-start-p95-ms")
	b.ReportMetric(0, "ns/op")
}
