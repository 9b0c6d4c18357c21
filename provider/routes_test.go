package provider_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/routes"
	"github.com/lightspeed-dev/incus-provider/targets"
)

func TestRoutes(t *testing.T) {
	r := newRig(t, rigOptions{})
	a := r.create("env-a", "t1")
	b := r.create("env-b", "t1")

	t.Run("running target relays initialize", func(t *testing.T) {
		r.mustUpgrade(a).Close()
	})

	t.Run("paused target is woken by a dial", func(t *testing.T) {
		r.power(a, controller.PowerPaused)
		before := r.wakes()
		r.mustUpgrade(a).Close()
		if r.wakes() != before+1 {
			t.Fatal("not woken exactly once")
		}
		if st := r.status(a.TargetID); st != incus.InstanceRunning {
			t.Fatalf("Incus shows %s", st)
		}
	})

	t.Run("stopped target is woken by a dial", func(t *testing.T) {
		r.power(a, controller.PowerStopped)
		r.upgradeAsARuntime(a).Close()
		if st := r.status(a.TargetID); st != incus.InstanceRunning {
			t.Fatalf("Incus shows %s", st)
		}
	})

	t.Run("concurrent dials share one wake", func(t *testing.T) {
		r.power(a, controller.PowerPaused)
		before := r.flights()
		resumed := r.resumes([]string{a.TargetID}, 30*time.Second)
		const n = 8
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := conformance.DialRoute(context.Background(), r.url(a), credential)
				if err != nil {
					errs <- err
					return
				}
				if d.Conn == nil {
					errs <- fmt.Errorf("refused: %+v", d.Refusal)
					return
				}
				d.Conn.Close()
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		// Woken once: Incus resumed it once, and one flight acted. A
		// flight from running may follow (a record of the dials' request
		// for running that Incus let time out is made again by a later
		// dial): it acts on nothing, and is logged.
		fs := flightsSince(before, r.flights())
		t.Logf("wake flights by from/outcome: %s", describeFlights(fs))
		if c := resumed()[a.TargetID]; c != 1 {
			t.Errorf("Incus resumed the target %d times for %d concurrent dials, want once", c, n)
		}
		if w := fromPowerDown(fs); w != 1 {
			t.Fatalf("%d wake flights from a powered-down read for %d concurrent dials, want one (%s)", w, n, describeFlights(fs))
		}
	})

	t.Run("another owner's route is refused and the target untouched", func(t *testing.T) {
		r.power(b, controller.PowerPaused)
		before := r.wakes()
		refusedBefore := r.counter("incus_provider_route_dials_total", map[string]string{"outcome": routes.OutcomeRefusedOwner})
		for _, route := range []routes.Route{
			{Owner: a.Owner, TargetID: b.TargetID}, // a's owner, b's target
			{Owner: controller.Owner{UniverseID: "u-provider", EnvironmentID: "env-c"}, TargetID: b.TargetID},
		} {
			d := r.dial(route)
			if d.Refusal == nil || d.Refusal.State != "gone" {
				t.Fatalf("got %+v", d)
			}
		}
		time.Sleep(200 * time.Millisecond)
		if st := r.status(b.TargetID); st != incus.InstanceFrozen {
			t.Fatalf("the other owner's target is %s, want still Frozen", st)
		}
		if r.wakes() != before {
			t.Fatal("a refused route woke something")
		}
		if got := r.counter("incus_provider_route_dials_total", map[string]string{"outcome": routes.OutcomeRefusedOwner}) - refusedBefore; got != 2 {
			t.Fatalf("refused_owner counted %v times, want 2", got)
		}
	})

	t.Run("no idle power-down under a relay; an explicit one closes it with going-away", func(t *testing.T) {
		ws := r.mustUpgrade(a)
		// What the idle loop would do: refused.
		inv := provider.IdleInventory{Targets: r.p.Targets}
		it, ok, err := inv.IdleTarget(r.ctx(), a.TargetID)
		if err != nil || !ok {
			t.Fatalf("IdleTarget: %v %v", ok, err)
		}
		err = inv.IdleAct(r.ctx(), it, idlepolicy.ActionPause, time.Now(), time.Now())
		if !errors.Is(err, targets.ErrRelayOpen) || !errors.Is(err, idle.ErrRelayOpen) {
			t.Fatalf("an idle pause under a relay: %v", err)
		}
		if st := r.status(a.TargetID); st != incus.InstanceRunning {
			t.Fatalf("Incus shows %s", st)
		}
		// An explicit power change: the client is told going-away, then
		// the target pauses.
		if _, err := r.setPower(a.Owner, controller.PowerPaused); err != nil {
			t.Fatal(err)
		}
		awaitGoingAway(t, ws)
		r.until(a.Owner, "paused", 30*time.Second, func(o controller.Observation) bool {
			return o.Power == controller.PowerPaused && o.Message == ""
		})
		// And a dial wakes it again.
		r.mustUpgrade(a).Close()
	})

	t.Run("a daemon that cannot answer is refused within the hold", func(t *testing.T) {
		w := r.create("env-wrongport", "wrongport")
		d := r.dial(w)
		if d.Refusal == nil || d.Refusal.State != "booting" || d.Refusal.RetryAfter < time.Second {
			t.Fatalf("got %+v", d)
		}
		if d.Elapsed > routes.MaxHold+conformance.RouteHoldGrace {
			t.Fatalf("refused after %s", d.Elapsed)
		}
	})

	t.Run("closing and absent targets are gone", func(t *testing.T) {
		if _, err := r.closeTarget(b.Owner); err != nil {
			t.Fatal(err)
		}
		d := r.dial(b)
		if d.Refusal == nil || d.Refusal.State != "gone" {
			t.Fatalf("closing: got %+v", d)
		}
		deadline := time.Now().Add(90 * time.Second)
		for {
			o, err := r.closeTarget(b.Owner)
			if err == nil && o.Phase == controller.PhaseClosed {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("never closed: %+v %v", o, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
		d = r.dial(b)
		if d.Refusal == nil || d.Refusal.State != "gone" {
			t.Fatalf("closed: got %+v", d)
		}
	})
}
