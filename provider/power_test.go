package provider_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// cyclesPerVariant is how many wake-close-power-down cycles each variant
// runs; PROVIDER_TEST_POWER_CYCLES overrides it.
func cyclesPerVariant(t *testing.T) int {
	if v := os.Getenv("PROVIDER_TEST_POWER_CYCLES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("PROVIDER_TEST_POWER_CYCLES=%q is not a positive number", v)
		}
		return n
	}
	return 50
}

// A client wakes a powered-down target by dialing its data route, runs the
// data-plane handshake, closes, and asks for the power-down again at once:
// the request must never be lost (issue 7's reproduction). Each variant
// runs on its own owner, all at once, so that the power-downs also race
// each other's wakes on the same Incus: the setPower comes before the
// close, or 0, 1, 5 or 20 ms after it.
func TestPowerDownRightAfterAWakingConnection(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	for _, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		t.Run(string(p), func(t *testing.T) {
			r := newRig(t, rigOptions{})
			cycles := cyclesPerVariant(t)
			variants := []time.Duration{-1, 0, time.Millisecond, 5 * time.Millisecond, 20 * time.Millisecond}
			var wg sync.WaitGroup
			for i, delay := range variants {
				route := r.create(fmt.Sprintf("env-%s-%d", p, i), "t1")
				r.power(route, p)
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(seed), uint64(i)))
					for c := range cycles {
						if err := wakeCloseAndPowerDown(r, route, p, delay, rng); err != nil {
							t.Errorf("%s, setPower %s the close, cycle %d of %d: %v", p, describeDelay(delay), c+1, cycles, err)
							return
						}
					}
				}()
			}
			wg.Wait()
		})
	}
}

func describeDelay(d time.Duration) string {
	if d < 0 {
		return "before"
	}
	return d.String() + " after"
}

// wakeCloseAndPowerDown is one cycle: the target is at p.
func wakeCloseAndPowerDown(r *rig, route routes.Route, p controller.Power, delay time.Duration, rng *rand.Rand) error {
	d := r.dial(route)
	if d.Conn == nil {
		return fmt.Errorf("the waking dial was refused: %+v after %s", d.Refusal, d.Elapsed)
	}
	initialize(r.t, d.Conn)
	if delay < 0 {
		// Asked while the connection is open: it is closed with going-away
		// first (awaitGoingAway), and the power-down follows.
		if _, err := r.setPower(route.Owner, p); err != nil {
			return fmt.Errorf("setPower: %w", err)
		}
		awaitGoingAway(r.t, d.Conn)
		d.Conn.Close()
	} else {
		d.Conn.Close()
		time.Sleep(delay)
		if _, err := r.setPower(route.Owner, p); err != nil {
			return fmt.Errorf("setPower: %w", err)
		}
	}
	// Bounded: a graceful stop of the dev guest takes under a second.
	deadline := time.Now().Add(20 * time.Second)
	for {
		o, err := r.get(route.Owner)
		if err == nil && o.Phase == controller.PhaseActive && o.Power == p && o.Message == "" {
			want := incus.InstanceFrozen
			if p != controller.PowerPaused {
				want = incus.InstanceStopped
			}
			if st := r.status(route.TargetID); st != want {
				return fmt.Errorf("observed %s but Incus shows %s", p, st)
			}
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the target never reached %s: last %+v, %v", p, o, err)
		}
		time.Sleep(time.Duration(10+rng.IntN(20)) * time.Millisecond)
	}
}
