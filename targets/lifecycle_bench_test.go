package targets

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// BenchmarkLifecycle measures, on the real Incus with the development
// guest, how long a new owner's target takes from target/create to an
// active observation, and from target/close to a closed one, as the
// runtime sees them (polling get and close every 20 ms).
//
//	INCUS_PROVIDER_REQUIRE_INCUS=1 go test -run '^$' -bench Lifecycle -benchtime 20x ./targets/
func BenchmarkLifecycle(b *testing.B) {
	h := newHarnessB(b)
	svc, _ := h.start(h.catalog)
	ctx := context.Background()
	var toActive, toClosed []time.Duration
	for i := 0; b.Loop(); i++ {
		o := owner(fmt.Sprintf("bench-%d-%d", time.Now().UnixNano(), i))
		ref := controller.TargetRef{Owner: o}
		start := time.Now()
		if _, err := svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "t1"}); err != nil {
			b.Fatal(err)
		}
		for {
			obs, err := svc.GetTarget(ctx, ref)
			if isActive(obs, err) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		toActive = append(toActive, time.Since(start))
		start = time.Now()
		for {
			obs, err := svc.CloseTarget(ctx, ref)
			if err != nil {
				b.Fatal(err)
			}
			if obs.Phase == controller.PhaseClosed {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		toClosed = append(toClosed, time.Since(start))
	}
	b.ReportMetric(ms(median(toActive)), "create→active-p50-ms")
	b.ReportMetric(ms(median(toClosed)), "close→closed-p50-ms")
	b.ReportMetric(ms(pct(toActive, 95)), "create→active-p95-ms")
	b.ReportMetric(ms(pct(toClosed, 95)), "close→closed-p95-ms")
	b.ReportMetric(0, "ns/op")
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func median(ds []time.Duration) time.Duration { return pct(ds, 50) }

func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}
