package targets

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
)

// The tests here run targets' power and read paths against the in-process
// Incus fake (fakerig_test.go): no incusd, seconds under -race. Run them
// alone with -run TestFake.

// Many owners, each woken, leased and set running at once from this one
// process, against an Incus that refuses a change while another operation
// or config write holds the instance: the gate (owner.go) must keep the
// process from ever meeting its own writes as busy. The tap sees refusals
// that the service would otherwise retry or keep quietly.
func TestFakeOwnWritesNeverMeetBusy(t *testing.T) {
	rng := seeded(t)
	r := newFakeRig(t, fakeDurations(rng), Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond})
	const owners = 24
	const leases = 4
	type plan struct {
		name   string
		ref    controller.TargetRef
		jitter [2 + leases]time.Duration // before the wake, the setPower and each lease write
	}
	plans := make([]plan, owners)
	for i := range plans {
		o := fakeOwner(fmt.Sprintf("env-busy-%02d", i))
		status, power := incus.InstanceStopped, controller.PowerStopped
		switch i % 3 {
		case 1:
			status, power = incus.InstanceFrozen, controller.PowerPaused
		case 2:
			status, power = incus.InstanceRunning, controller.PowerRunning
		}
		plans[i] = plan{name: r.seedTarget(o, status, power), ref: controller.TargetRef{Owner: o, TargetID: Name(o)}}
		for j := range plans[i].jitter {
			plans[i].jitter[j] = time.Duration(rng.IntN(40)) * time.Millisecond
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var (
		mu   sync.Mutex
		errs []string
		wg   sync.WaitGroup
	)
	fail := func(what string, err error) {
		mu.Lock()
		defer mu.Unlock()
		busy := ""
		if errors.Is(err, incus.ErrBusy) {
			busy = " [busy]"
		}
		errs = append(errs, fmt.Sprintf("%s%s: %v", what, busy, err))
	}
	after := func(d time.Duration) bool {
		select {
		case <-time.After(d):
			return true
		case <-ctx.Done():
			return false
		}
	}
	for _, p := range plans {
		wg.Add(2 + leases)
		go func() {
			defer wg.Done()
			if !after(p.jitter[0]) {
				return
			}
			inst, _, err := r.client.GetInstance(ctx, p.name)
			if err == nil {
				_, err = r.svc.Wake(ctx, inst, time.Now())
			}
			if err != nil {
				fail("wake "+p.name, err)
				t.Logf("what the fake applied to %s so far:\n%s", p.name, r.history(p.name))
			}
		}()
		go func() {
			defer wg.Done()
			if !after(p.jitter[1]) {
				return
			}
			obs, err := r.svc.SetPower(ctx, p.ref, controller.PowerRunning)
			if err != nil {
				fail("setPower "+p.name, err)
			} else if obs.Phase != controller.PhaseActive {
				fail("setPower "+p.name, fmt.Errorf("answered %+v", obs))
			}
		}()
		for k := range leases {
			go func() {
				defer wg.Done()
				if !after(p.jitter[2+k]) {
					return
				}
				// What leaseOne writes for a relay this replica holds.
				key := keyRelayPrefix + r.svc.cfg.Replica
				if err := r.svc.patch(ctx, p.name, map[string]string{key: msString(time.Now().Add(leaseTTL))}); err != nil {
					fail(fmt.Sprintf("lease %d %s", k, p.name), err)
				}
			}()
		}
	}
	wg.Wait()
	for _, e := range errs {
		t.Error(e)
	}

	r.awaitFake("every target running at rest", 10*time.Second, func() bool {
		for _, p := range plans {
			if v, ok := r.fake.Instance(fakeProject, p.name); !ok || !restsAt(v, incus.InstanceRunning, controller.PowerRunning) {
				return false
			}
		}
		return true
	})
	if busy := r.tap.refusals(); len(busy) > 0 {
		t.Errorf("this process met its own writes as busy %d times:\n%s", len(busy), strings.Join(busy, "\n"))
	}
	starts := 0
	for _, w := range r.fake.Writes() {
		if w.Kind == incusfake.WriteStart || w.Kind == incusfake.WriteUnfreeze {
			starts++
		}
	}
	if want := owners * 2 / 3; starts != want {
		t.Errorf("%d starts and unfreezes applied, want one per stopped or paused target (%d)", starts, want)
	}
}
