package targets

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// fakeCycles is how many wake, close and power-down cycles each variant of
// TestFakePowerDownRightAfterAWake runs. The real-Incus test of the same
// race (provider's TestPowerDownRightAfterAWakingConnection) runs a few
// per variant, since each costs a guest's start; here the race's own
// windows (the wake's record after its action, the power-down's wait for
// relays, the reconcile pass) come round hundreds of times in seconds.
const fakeCycles = 40

// Issue 7's reproduction on the fake, at the count the real guest cannot
// afford: an owner's target is woken the way a data route wakes it (a
// ticket entered at the dial's arrival, Wake, the relay adopted), and the
// power-down is asked again while the relay is open (it is told to go
// away) or 0, 1, 5 or 20 ms after it closed. Every variant runs on its own
// owner at once, for both powers, so the power-downs also race each
// other's wakes and the reconcile passes. Each request must be carried
// out: the target rests at the power asked for, and the fake agrees.
func TestFakePowerDownRightAfterAWake(t *testing.T) {
	rng := seeded(t)
	r := newFakeRig(t, fakeDurations(rng), Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond,
		AnswerWithin: 5 * time.Second, MethodBudget: 15 * time.Second})
	variants := []time.Duration{-1, 0, time.Millisecond, 5 * time.Millisecond, 20 * time.Millisecond}
	// A bound against a hang, not a speed: beside stress-ng and the other
	// lanes, 40 cycles took 98 s.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for _, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		status := incus.InstanceFrozen
		if p == controller.PowerStopped {
			status = incus.InstanceStopped
		}
		for i, delay := range variants {
			o := fakeOwner(fmt.Sprintf("env-cycle-%s-%d", p, i))
			name := r.seedTarget(o, status, p)
			seed := rng.Uint64()
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(seed, uint64(i)))
				for c := range fakeCycles {
					if err := r.wakeCloseAndPowerDown(ctx, o, name, p, delay, rng); err != nil {
						t.Errorf("%s, setPower %s the close, cycle %d of %d: %v\n%s", p, describeCycleDelay(delay), c+1, fakeCycles, err, r.history(name))
						return
					}
				}
			})
		}
	}
	wg.Wait()
	if busy := r.tap.refusals(); len(busy) > 0 {
		t.Errorf("busy refusals met by this process:\n%s", strings.Join(busy, "\n"))
	}
}

func describeCycleDelay(d time.Duration) string {
	if d < 0 {
		return "before"
	}
	return d.String() + " after"
}

// setPowerAsARuntime asks for p as a runtime does: an unavailable answer
// (Incus did not answer within a read's bound, as this machine's fake did
// beside stress-ng and the other lanes: "Incus did not answer while
// looking up the owner's target") is asked again after its retryAfterMs.
// Any other error, or ctx's end, is the caller's.
func (r *fakeRig) setPowerAsARuntime(ctx context.Context, ref controller.TargetRef, p controller.Power) error {
	for {
		_, err := r.svc.SetPower(ctx, ref, p)
		var e *jsonrpc.Error
		if err == nil || !errors.As(err, &e) || e.Kind != jsonrpc.KindUnavailable {
			return err
		}
		wait := time.Second
		if e.RetryAfterMs != nil {
			wait = time.Duration(*e.RetryAfterMs) * time.Millisecond
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return fmt.Errorf("still answered unavailable at the test's bound: %w", err)
		}
	}
}

// wakeCloseAndPowerDown is one cycle on the fake: the target rests at p.
func (r *fakeRig) wakeCloseAndPowerDown(ctx context.Context, o controller.Owner, name string, p controller.Power, delay time.Duration, rng *rand.Rand) error {
	ref := controller.TargetRef{Owner: o, TargetID: name}
	c, err := r.dial(ctx, o, name)
	if err != nil {
		return fmt.Errorf("the waking dial: %w", err)
	}
	if delay < 0 {
		if err := r.setPowerAsARuntime(ctx, ref, p); err != nil {
			c.Kill("the test failed")
			return fmt.Errorf("setPower with the relay open: %w", err)
		}
		select {
		case <-c.Done():
		case <-ctx.Done():
			return errors.New("the open relay was never told to go away")
		}
		if !c.toldAway() {
			return errors.New("the open relay was killed, not told to go away")
		}
	} else {
		c.Kill("the client closed")
		time.Sleep(delay)
		if err := r.setPowerAsARuntime(ctx, ref, p); err != nil {
			return fmt.Errorf("setPower: %w", err)
		}
	}
	want := incus.InstanceFrozen
	if p == controller.PowerStopped {
		want = incus.InstanceStopped
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		o, err := r.svc.GetTarget(ctx, ref)
		if err == nil && o.Phase == controller.PhaseActive && o.Power == p && o.Message == "" {
			v := r.instance(name)
			if v.Status == want || v.HeldBy != "" {
				// The observation may lead the fake by the operation it
				// reports: wait for that to end, then it must agree.
				if err := r.fake.Await(ctx, func() bool { v = r.instance(name); return v.HeldBy == "" }); err != nil {
					return err
				}
				if v.Status != want {
					return fmt.Errorf("observed %s but the fake rests at %s", p, v.Status)
				}
				return nil
			}
			return fmt.Errorf("observed %s but the fake shows %s with no operation", p, v.Status)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the target never reached %s: last %+v, %w", p, o, err)
		}
		time.Sleep(time.Duration(5+rng.IntN(10)) * time.Millisecond)
	}
}

// dial does what a data route does for a use arriving now: resolve, enter
// a ticket (waiting out a power-down that holds the instance), wake the
// target when it is powered down, and adopt the relay.
func (r *fakeRig) dial(ctx context.Context, o controller.Owner, name string) (*leavingConn, error) {
	arrived := time.Now()
	for {
		rt, err := r.svc.ResolveRoute(ctx, o, name)
		if err != nil {
			return nil, fmt.Errorf("resolve: %w", err)
		}
		tk, quiet := r.svc.relays.Enter(name, arrived)
		if tk == nil {
			select {
			case <-quiet:
				continue
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		if rt.State != RouteRunning {
			if _, err := r.svc.Wake(ctx, rt, arrived, nil); err != nil {
				tk.Leave()
				return nil, fmt.Errorf("wake (route state %d): %w", rt.State, err)
			}
		}
		c := &leavingConn{goneConn: newGoneConn()}
		c.leave = func() { r.svc.relays.Remove(name, c) }
		tk.Adopt(c)
		return c, nil
	}
}

// leavingConn is a relay that ends as soon as it is told to go away and,
// as a route's relay does, leaves the registry when it ends: a power-down
// waits for that, not for the end alone.
type leavingConn struct {
	*goneConn
	leave func()
}

func (c *leavingConn) GoAway(code int, reason, why string) {
	c.goneConn.GoAway(code, reason, why)
	c.leave()
}

func (c *leavingConn) Kill(why string) {
	c.goneConn.Kill(why)
	c.leave()
}
