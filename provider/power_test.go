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
	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// cyclesPerVariant is how many wake-close-power-down cycles each variant
// runs; PROVIDER_TEST_POWER_CYCLES overrides it. Ten: a cycle from stopped
// costs a guest's start and stop (about five seconds here), and the same
// race runs forty cycles a variant on the Incus fake in seconds
// (targets' TestFakePowerDownRightAfterAWake); here it is Incus's own
// timing that the cycles meet.
func cyclesPerVariant(t *testing.T) int {
	if v := os.Getenv("PROVIDER_TEST_POWER_CYCLES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("PROVIDER_TEST_POWER_CYCLES=%q is not a positive number", v)
		}
		return n
	}
	return 10
}

// A client wakes a powered-down target by dialing its data route, runs the
// data-plane handshake, closes, and asks for the power-down again at once:
// the request must never be lost (issue 7's reproduction). Each variant
// runs on its own owner, all at once, so that the power-downs also race
// each other's wakes on the same Incus: the setPower comes before the
// close, or 0, 1, 5 or 20 ms after it.
func TestPowerDownRightAfterAWakingConnection(t *testing.T) {
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	for _, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		t.Run(string(p), func(t *testing.T) {
			t.Parallel()
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
	// A starved machine can take longer than the 5 s hold to start a
	// guest: a 503 is retried after its Retry-After, as the runtime does.
	conn, _, err := r.dialAsTheRuntime(route)
	if err != nil {
		return fmt.Errorf("the waking dial: %w", err)
	}
	defer conn.Close()
	initialize(r.t, conn)
	if delay < 0 {
		// Asked while the connection is open: it is closed with going-away
		// first (awaitGoingAway), and the power-down follows.
		if _, err := r.setPower(route.Owner, p); err != nil {
			return fmt.Errorf("setPower: %w", err)
		}
		awaitGoingAway(r.t, conn)
	} else {
		conn.Close()
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
			if err := incusAgrees(r, route.TargetID, want); err != nil {
				return fmt.Errorf("observed %s but %w", p, err)
			}
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the target never reached %s: last %+v, %w", p, o, err)
		}
		time.Sleep(time.Duration(10+rng.IntN(20)) * time.Millisecond)
	}
}

// incusAgrees checks that Incus shows the instance at want, once the
// provider has observed it there. Incus can report "Running" for a moment
// after a container has exited: while it cleans up after one that stopped
// outside a stop operation (a graceful stop that timed out, a forced stop
// that found it already exiting, a guest that shut itself down), its
// status answers from the operation it holds, not from the container.
// Measured here with a guest that stopped itself: Running, Stopped for a
// few ms, Running again for 0.6 s with no init process, then Stopped. So
// a status other than want is a failure only while the instance's init
// process runs (a start that came after the power-down); otherwise Incus
// is waited for, within a bound.
func incusAgrees(r *rig, name string, want incus.InstanceStatus) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := r.status(name)
		if st == want {
			return nil
		}
		pid, err := r.client.InitPID(r.ctx(), name)
		if err == nil && pid > 0 {
			return fmt.Errorf("Incus shows %s and runs its init process (pid %d)", st, pid)
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("Incus still shows %s 30 s later, and its state does not read: %w", st, err)
			}
			return fmt.Errorf("Incus still shows %s 30 s later, with no init process", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A power change is an intent: Incus refusing the move a few times, or the
// provider stopping between its answer and the move, delays it but never
// loses it.
func TestPowerSurvivesIncusFaultsAndRestart(t *testing.T) {
	proxy := incustest.FaultProxy(t)
	viaProxy := func(project string) *incus.Client {
		c, err := incus.New(incus.Config{Socket: proxy.Socket(), Project: project, CallTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	a := newRig(t, rigOptions{providerIncus: viaProxy})
	route := a.create("env-faults", "t1")

	// Incus answers the state change with 503, three times: the answer
	// still says the move is under way, and the reconciler gets there.
	failing := proxy.Add(incusfault.Rule{Method: "PUT", Path: "/1.0/instances/*/state", Fault: incusfault.Fail,
		Status: 503, Message: "injected: Incus is overloaded", Times: 3})
	o, err := a.setPower(route.Owner, controller.PowerPaused)
	if err != nil {
		t.Fatalf("setPower answered %v; the request is recorded, so it must say the move is under way", err)
	}
	t.Logf("answered %s %q", o.Power, o.Message)
	a.until(route.Owner, "paused despite the refusals", 30*time.Second, func(o controller.Observation) bool {
		return o.Power == controller.PowerPaused && o.Message == ""
	})
	if n := proxy.Hits(failing); n != 3 {
		t.Fatalf("the fault hit %d state changes, want 3", n)
	}
	if st := a.status(route.TargetID); st != incus.InstanceFrozen {
		t.Fatalf("Incus shows %s", st)
	}

	// Incus takes the next move and never answers; the provider stops
	// before it could carry it out. The request is on the instance.
	hung := proxy.Add(incusfault.Rule{Method: "PUT", Path: "/1.0/instances/*/state", Fault: incusfault.BlackHole})
	if _, err := a.setPower(route.Owner, controller.PowerStopped); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for proxy.Hits(hung) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the provider never tried the move")
		}
		time.Sleep(10 * time.Millisecond)
	}
	a.stop()
	for proxy.Held() > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the stopped provider's request is still held")
		}
		time.Sleep(10 * time.Millisecond)
	}
	proxy.Remove(hung)
	if st := a.status(route.TargetID); st != incus.InstanceFrozen {
		t.Fatalf("the stopped provider moved the target after all: Incus shows %s", st)
	}
	// The next process finishes the move from what the instance records.
	b := newRig(t, rigOptions{after: a})
	b.until(route.Owner, "stopped by the restarted provider", 30*time.Second, func(o controller.Observation) bool {
		return o.Power == controller.PowerStopped && o.Message == ""
	})
	if st := b.status(route.TargetID); st != incus.InstanceStopped {
		t.Fatalf("Incus shows %s", st)
	}
}
