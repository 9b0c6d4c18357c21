package provider_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// The races of issue 25, staged by name on the real Incus. The same races
// run in seconds against the Incus fake (targets/fake_test.go); here they
// meet Incus's own busy refusals, operation timing and events.

// Fifty dials at once on twenty paused targets: every dial is answered
// with an upgrade, after 503s with a Retry-After at most (as the runtime
// retries: twenty unfreezes, their records and leases at once can keep
// this machine's Incus busy past the 5 s hold, its reads past a second),
// each target is woken exactly once however many dials share the wake
// (Incus resumes it once, and the provider flies one wake from its
// paused read), and afterwards Incus shows every target running, one
// instance per owner and nothing else. How many dials were refused first,
// and every flight (those from running included: a record of the use's
// request that a loaded Incus let time out is made again by the next
// use), are logged.
func TestFiftyDialsOnTwentyPausedTargets(t *testing.T) {
	const targets, dials = 20, 50
	seed := testSeed(t)
	t.Logf("seed %d (PROVIDER_TEST_SEED replays it)", seed)
	rng := rand.New(rand.NewPCG(uint64(seed), 25))
	r := newRig(t, rigOptions{})
	all := make([]routes.Route, targets)
	var wg sync.WaitGroup
	for i := range all {
		wg.Go(func() { all[i] = createAndPause(r, fmt.Sprintf("env-storm-%02d", i)) })
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	// Every target is dialed at least once; the other thirty dials go to
	// targets the seed picks, so some share a wake with several others.
	to := make([]int, dials)
	for i := range to {
		if i < targets {
			to[i] = i
		} else {
			to[i] = rng.IntN(targets)
		}
	}
	names := make([]string, len(all))
	for i, rt := range all {
		names[i] = rt.TargetID
	}
	before := r.flights()
	resumed := r.resumes(names, time.Minute)
	start := make(chan struct{})
	errs := make(chan error, dials)
	var refusedFirst atomic.Int32
	for i := range dials {
		route := all[to[i]]
		wg.Go(func() {
			<-start
			conn, redials, err := r.dialAsTheRuntime(route)
			if redials > 0 {
				refusedFirst.Add(1)
			}
			if err != nil {
				errs <- fmt.Errorf("dial %d to %s: %w", i, route.TargetID, err)
				return
			}
			defer conn.Close()
			if err := conformance.InitializeData(conn, "storm", 10*time.Second); err != nil {
				errs <- fmt.Errorf("dial %d to %s: initialize through the relay: %w", i, route.TargetID, err)
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	fs := flightsSince(before, r.flights())
	t.Logf("%d of %d dials were refused 503 on their first try; wake flights by from/outcome: %s", refusedFirst.Load(), dials, describeFlights(fs))
	counts := resumed()
	for _, name := range names {
		if n := counts[name]; n != 1 {
			t.Errorf("Incus resumed %s %d times for the dials, want once", name, n)
		}
	}
	if w := fromPowerDown(fs); w != targets {
		t.Errorf("%d wake flights from a powered-down read for %d dials on %d paused targets, want one per target (%s)", w, dials, targets, describeFlights(fs))
	}
	checkOneRunningInstanceEach(r, all)
}

// A dial that arrives while the target is being powered down (asked by
// setPower a moment before: in the drain, in the graceful stop, or just
// after Incus froze or stopped it) is a newer use than the power-down and
// outranks it: the dial is answered (after a Retry-After at most, when a
// stop under way leaves too little of the hold to start again), the
// target ends up running with running recorded, and stays so. The moment
// of the dial is drawn from the seed, across the power-down's window.
func TestADialDuringAPowerDownOutranksIt(t *testing.T) {
	seed := testSeed(t)
	t.Logf("seed %d (PROVIDER_TEST_SEED replays it)", seed)
	for pi, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		t.Run(string(p), func(t *testing.T) {
			t.Parallel()
			r := newRig(t, rigOptions{})
			rng := rand.New(rand.NewPCG(uint64(seed), uint64(pi)))
			route := r.create("env-outrank-"+string(p), "t1")
			const cycles = 6
			for c := range cycles {
				// Up to 1.5 s after the request: past the drain, into the
				// graceful stop, and past a freeze.
				after := time.Duration(rng.IntN(1500)) * time.Millisecond
				if _, err := r.setPower(route.Owner, p); err != nil {
					t.Fatalf("cycle %d: setPower %s: %v", c+1, p, err)
				}
				time.Sleep(after)
				conn, _, err := r.dialAsTheRuntime(route)
				if err != nil {
					t.Fatalf("cycle %d: the dial %s after setPower %s: %v", c+1, after, p, err)
				}
				initialize(t, conn)
				o := r.until(route.Owner, "running after the dial", 30*time.Second, func(o controller.Observation) bool {
					return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
				})
				if o.Power != controller.PowerRunning {
					t.Fatalf("cycle %d: %+v", c+1, o)
				}
				// The power-down it outranked must not act later: the
				// connection stays open (no going-away) and Incus keeps the
				// target running.
				_ = conn.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
				for {
					_, _, err := conn.ReadMessage()
					if err == nil {
						continue // the daemon's own messages are the connection working
					}
					if !isTimeout(err) {
						t.Fatalf("cycle %d (dial %s after setPower %s): the answered connection got %v, want it left open", c+1, after, p, err)
					}
					break
				}
				if st := r.status(route.TargetID); st != incus.InstanceRunning {
					t.Fatalf("cycle %d (dial %s after setPower %s): Incus shows %s after the dial was answered", c+1, after, p, st)
				}
				conn.Close()
				t.Logf("cycle %d: dial %s after setPower %s answered and kept", c+1, after.Round(time.Millisecond), p)
			}
			checkOneRunningInstanceEach(r, []routes.Route{route})
		})
	}
}

// createAndPause makes a target and pauses it; failures are the test's.
func createAndPause(r *rig, env string) routes.Route {
	owner := controller.Owner{UniverseID: "u-provider", EnvironmentID: env}
	ctl := r.connect()
	defer func() { _ = ctl.Close() }()
	var o controller.Observation
	var err error
	for attempt := 0; attempt < 30; attempt++ {
		o, err = callOn(ctl, "target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"})
		if err == nil && o.TargetID != "" {
			break
		}
		if err != nil && !retryable(err) {
			break
		}
		time.Sleep(time.Second)
	}
	if err != nil || o.TargetID == "" {
		r.t.Errorf("%s: create: %+v %v", env, o, err)
		return routes.Route{}
	}
	ref := controller.TargetParams{Target: controller.TargetRef{Owner: owner, TargetID: o.TargetID}}
	deadline := time.Now().Add(2 * time.Minute)
	asked := false
	for time.Now().Before(deadline) {
		o, err = callOn(ctl, "target/get", ref)
		switch {
		case err == nil && o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == "" && !asked:
			if _, err := callOn(ctl, "target/setPower", controller.SetPowerParams{Target: ref.Target, Power: controller.PowerPaused}); err == nil {
				asked = true
			}
		case err == nil && o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == "":
			return routes.Route{Owner: owner, TargetID: o.TargetID}
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.t.Errorf("%s: never paused: last %+v %v", env, o, err)
	return routes.Route{}
}

// checkOneRunningInstanceEach: Incus holds exactly the given targets'
// instances in the rig's project, each running.
func checkOneRunningInstanceEach(r *rig, want []routes.Route) {
	r.t.Helper()
	list, err := r.client.ListInstances(r.ctx())
	if err != nil {
		r.t.Fatal(err)
	}
	names := map[string]bool{}
	for _, w := range want {
		names[w.TargetID] = true
	}
	for _, inst := range list {
		if !names[inst.Name] {
			r.t.Errorf("Incus holds %s, which no owner of this test has", inst.Name)
			continue
		}
		delete(names, inst.Name)
		if inst.Status != incus.InstanceRunning {
			r.t.Errorf("%s: Incus shows %s, want Running", inst.Name, inst.Status)
		}
	}
	for n := range names {
		r.t.Errorf("%s: no such instance in Incus", n)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
