package targets

import (
	"context"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
)

// A new target whose first start Incus keeps refusing fails after
// StartAttempts starts, at the start's steady pace, with the failure
// recorded on the instance; the failed reads in between (another kind of
// step) do not count toward it.
func TestFakeAStartThatKeepsFailingFailsTheTarget(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{StartAttempts: 3, ReconcileInterval: 100 * time.Millisecond})
	o := fakeOwner("env-nostart")
	name := r.expect(o)
	refused := r.fake.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: http.MethodPut, Path: "/1.0/instances/" + name + "/state",
		Status: http.StatusInternalServerError, Message: "Failed to start: injected"})
	defer refused.Release()
	began := time.Now()
	r.seedUnbooted(o)
	r.svc.own.kick(name)
	r.awaitFake("the failure recorded", 20*time.Second, func() bool { return r.instance(name).Config[keyFailure] != "" })
	took := time.Since(began)
	starts := 0
	for _, w := range r.fake.Writes() {
		if w.Instance == name && w.Kind == incusfake.WriteStart {
			starts++
		}
	}
	if starts != 0 {
		t.Errorf("%d starts applied; every one was refused", starts)
	}
	if n := refused.Hits(); n != 3 {
		t.Errorf("%d starts asked before the target failed, want StartAttempts (3)\n%s", n, r.history(name))
	}
	// Two waits of startRetry between the three attempts.
	if took < 2*startRetry {
		t.Errorf("the target failed %s after its first attempt, before two waits of %s", took, startRetry)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The observation follows once this process has read its own write.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		obs, err := r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: name})
		if err == nil && obs.Phase == controller.PhaseFailed {
			if !strings.Contains(obs.Message, "could not be started") {
				t.Fatalf("observed failed with %q; want it to say it could not be started", obs.Message)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("observed %+v, %v; want failed", obs, err)
		}
	}
}

// A first start that Incus answers "already running" (the status read
// was older than a start that ended since) is no failed attempt: with a
// single attempt allowed, the target still boots.
func TestFakeAStartFoundRunningIsNoFailure(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{StartAttempts: 1, ReconcileInterval: 100 * time.Millisecond})
	o := fakeOwner("env-running-already")
	name := r.expect(o)
	refused := r.fake.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: http.MethodPut, Path: "/1.0/instances/" + name + "/state",
		Status: http.StatusBadRequest, Message: "The instance is already running", Times: 1})
	defer refused.Release()
	r.seedUnbooted(o)
	r.svc.own.kick(name)
	r.awaitFake("booted", 10*time.Second, func() bool {
		v := r.instance(name)
		return v.Config[keyBooted] != "" || v.Config[keyFailure] != ""
	})
	if v := r.instance(name); v.Config[keyFailure] != "" || v.Status != incus.InstanceRunning {
		t.Fatalf("the target failed (%q) or is not running (%s)\n%s", v.Config[keyFailure], v.Status, r.history(name))
	}
	if n := refused.Hits(); n != 1 {
		t.Errorf("the refusal met %d starts, want 1", n)
	}
}

// A power move Incus refuses is retried after its own backoff, which the
// observation states; once Incus takes it, the target rests there and the
// count is gone.
func TestFakeAFailedPowerMoveSaysWhenItRetries(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
	o := fakeOwner("env-nofreeze")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ref := controller.TargetRef{Owner: o, TargetID: name}
	refused := r.fake.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: http.MethodPut, Path: "/1.0/instances/" + name + "/state",
		Status: http.StatusInternalServerError, Message: "Failed to freeze: injected", Times: 4})
	defer refused.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := r.svc.SetPower(ctx, ref, controller.PowerPaused); err != nil {
		t.Fatalf("setPower paused: %v", err)
	}
	said := ""
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		obs, err := r.svc.GetTarget(ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(obs.Message, "the last attempt failed; retrying in") {
			said = obs.Message
			break
		}
	}
	if said == "" {
		t.Fatalf("no observation said when the refused move is retried\n%s", r.history(name))
	}
	t.Logf("observed while refused: %q", said)
	// Four refusals: 250 ms, 500 ms, 1 s and 2 s of backoff.
	r.awaitFake("paused at rest", 15*time.Second, func() bool {
		return restsAt(r.instance(name), incus.InstanceFrozen, controller.PowerPaused)
	})
	if n := refused.Hits(); n != 4 {
		t.Errorf("Incus refused %d moves, want 4", n)
	}
	// The fake rests before the step that moved it returns.
	for deadline := time.Now().Add(5 * time.Second); r.svc.own.failures(name).n != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the name still counts %d failures after the move", r.svc.own.failures(name).n)
		}
	}
	obs, err := r.svc.GetTarget(ctx, ref)
	if err != nil || obs.Power != controller.PowerPaused || obs.Message != "" {
		t.Errorf("observed %+v, %v; want paused with no message", obs, err)
	}
}

// seedUnbooted puts o's target in the fake as a create whose start failed
// leaves it, a minute ago: stopped, never booted, running asked by the
// create.
func (r *fakeRig) seedUnbooted(o controller.Owner) {
	r.t.Helper()
	name := r.expect(o)
	then := time.Now().Add(-time.Minute)
	config := map[string]string{
		keySchema: schemaVersion, keyUniverse: o.UniverseID, keyEnvironment: o.EnvironmentID,
		keyTemplate: "t1", keyImage: fakeFingerprint, keyDaemonPort: "7777", keyCreatedAt: msString(then),
	}
	maps.Copy(config, (Intent{Power: controller.PowerRunning, At: then, By: ByCreate}).config())
	if err := r.fake.Seed(fakeProject, incusfake.Seed{Name: name, Status: incus.InstanceStopped, Config: config}); err != nil {
		r.t.Fatal(err)
	}
}
