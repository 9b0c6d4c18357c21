package targets

import (
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// A notFound, an ownerMismatch or a data route's 410 is final for the
// runtime, so none of them may come from the observation cache alone: a
// lost event, or another replica's create the cache has not seen yet,
// leaves exactly such a stale absence. The test makes the cache wrong on
// purpose and checks every such answer against Incus.
func TestFinalAnswersAreConfirmedWithIncus(t *testing.T) {
	h := newHarness(t)
	svc := h.startWith(Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Hour})
	if svc.cache == nil {
		t.Fatal("the service runs without its observation cache")
	}
	ref := activeTarget(t, svc, owner("env-final"))
	name := ref.TargetID
	deadline := time.Now().Add(30 * time.Second)
	for {
		if inst, hit := svc.cache.get(name); hit && inst != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the cache never held the target")
		}
		time.Sleep(50 * time.Millisecond)
	}
	real := h.instance(name)

	// The cache says the target is gone, as after a lost event.
	svc.cache.offer(name, svc.cache.mark(name), nil)
	if inst, hit := svc.cache.get(name); !hit || inst != nil {
		t.Fatalf("the staged absence did not take: %v %v", inst, hit)
	}
	if o, err := svc.GetTarget(ctxT(t), ref); err != nil || o.Phase != controller.PhaseActive {
		t.Fatalf("target/get over a stale absence answered %+v, %v; Incus holds the target", o, err)
	}
	svc.cache.offer(name, svc.cache.mark(name), nil)
	if r, err := svc.ResolveRoute(ctxT(t), ref.Owner, name); err != nil || r.Observation.Phase != controller.PhaseActive {
		t.Fatalf("a data route over a stale absence answered %+v, %v (gone: %v)", r.Observation, err, errors.Is(err, ErrRouteGone))
	}
	svc.cache.offer(name, svc.cache.mark(name), nil)
	if o, err := svc.SetPower(ctxT(t), ref, controller.PowerRunning); err != nil || o.Phase != controller.PhaseActive {
		t.Fatalf("target/setPower over a stale absence answered %+v, %v", o, err)
	}

	// The cache says the target is closing, or another owner's.
	for what, edit := range map[string]func(map[string]string){
		"closing":         func(c map[string]string) { c[keyClosing] = msString(time.Now()) },
		"another owner's": func(c map[string]string) { c[keyEnvironment] = "env-someone-else" },
	} {
		stale := *real
		stale.Config = maps.Clone(real.Config)
		edit(stale.Config)
		svc.cache.offer(name, svc.cache.mark(name), &stale)
		if inst, hit := svc.cache.get(name); !hit || inst == nil {
			t.Fatalf("the staged %s instance did not take", what)
		}
		if r, err := svc.ResolveRoute(ctxT(t), ref.Owner, name); err != nil || r.Observation.Phase != controller.PhaseActive {
			t.Fatalf("a data route over a stale %s instance answered %+v, %v", what, r.Observation, err)
		}
		svc.cache.offer(name, svc.cache.mark(name), &stale)
		if o, err := svc.GetTarget(ctxT(t), ref); err != nil || o.Phase != controller.PhaseActive {
			t.Fatalf("target/get over a stale %s instance answered %+v, %v", what, o, err)
		}
	}

	// And a true absence is still notFound and 410, confirmed.
	if _, err := svc.CloseTarget(ctxT(t), ref); err != nil {
		t.Fatal(err)
	}
	until(t, "closed", func() (controller.Observation, error) { return svc.GetTarget(ctxT(t), ref) },
		func(_ controller.Observation, err error) bool { return kindOf(err) == "notFound" })
	if _, err := svc.ResolveRoute(ctxT(t), ref.Owner, name); !errors.Is(err, ErrRouteGone) {
		t.Fatalf("a data route of a closed target answered %v, want gone", err)
	}
}
