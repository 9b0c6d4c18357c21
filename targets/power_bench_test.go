package targets

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// BenchmarkIncusCallsPerPowerChange counts what a power change costs
// Incus, on the real Incus with the development guest: -owners targets
// are paused and resumed at once through target/setPower, each waited for
// by gets, then the process is left alone for as long as its intent
// writes are looked at again afterwards (written.go). The same window is
// counted before any change, as the baseline of what the process asks
// anyway (reconcile passes, the cache's correcting lists).
//
//	INCUS_PROVIDER_REQUIRE_INCUS=1 go test -run '^$' -bench IncusCallsPerPowerChange -benchtime 1x ./targets/
func BenchmarkIncusCallsPerPowerChange(b *testing.B) {
	const owners = 20
	h := newHarnessB(b)
	var mu sync.Mutex
	calls := map[string]int{}
	client, err := incus.New(incus.Config{Socket: incustest.Socket(), Project: h.client.Project(),
		Observe: func(op, _ string, _ time.Duration) { mu.Lock(); calls[op]++; mu.Unlock() }})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(client.Close)
	svc := mustNew(b, client, h.catalog, h.dialer, zap.NewNop(), Config{GracefulStop: 2 * time.Second, ReconcileInterval: 10 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = svc.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-done })
	take := func() map[string]int {
		mu.Lock()
		defer mu.Unlock()
		out := maps.Clone(calls)
		clear(calls)
		return out
	}
	refs := make([]controller.TargetRef, owners)
	each := func(fn func(controller.TargetRef) error) {
		var wg sync.WaitGroup
		errs := make(chan error, owners)
		for _, ref := range refs {
			wg.Go(func() {
				if err := fn(ref); err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
	}
	reach := func(ref controller.TargetRef, p controller.Power) error {
		deadline := time.Now().Add(2 * time.Minute)
		for time.Now().Before(deadline) {
			o, err := svc.GetTarget(ctx, ref)
			if err == nil && o.Phase == controller.PhaseActive && o.Power == p {
				return nil
			}
			time.Sleep(50 * time.Millisecond)
		}
		return fmt.Errorf("%s never reached %s", ref.Owner.EnvironmentID, p)
	}
	for i := range refs {
		refs[i] = controller.TargetRef{Owner: owner(fmt.Sprintf("calls-%d", i))}
	}
	each(func(ref controller.TargetRef) error {
		if _, err := svc.CreateTarget(ctx, controller.CreateParams{Owner: ref.Owner, TemplateID: "t1"}); err != nil {
			return err
		}
		return reach(ref, controller.PowerRunning)
	})
	tail := writtenLastLook + time.Second
	time.Sleep(tail) // the creates' own looks
	take()
	time.Sleep(tail)
	quiet := take()
	var change, after map[string]int
	for b.Loop() {
		take()
		each(func(ref controller.TargetRef) error {
			for _, p := range []controller.Power{controller.PowerPaused, controller.PowerRunning} {
				if _, err := svc.SetPower(ctx, ref, p); err != nil {
					return err
				}
				if err := reach(ref, p); err != nil {
					return err
				}
			}
			return nil
		})
		change = take()
		time.Sleep(tail)
		after = take()
	}
	changes := float64(2 * owners)
	sum := func(m map[string]int) (n int) {
		for _, v := range m {
			n += v
		}
		return n
	}
	b.Logf("calls by kind, quiet %s: %s", tail, kinds(quiet))
	b.Logf("calls by kind, %d changes: %s", 2*owners, kinds(change))
	b.Logf("calls by kind, the %s after: %s", tail, kinds(after))
	b.ReportMetric(float64(sum(change))/changes, "calls/change")
	b.ReportMetric(float64(sum(after)-sum(quiet))/changes, "calls-after/change")
	b.ReportMetric(float64(after["instance.get"]-quiet["instance.get"])/changes, "gets-after/change")
	b.ReportMetric(float64(sum(quiet)), "calls-quiet-window")
	b.ReportMetric(0, "ns/op")
}

func kinds(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
