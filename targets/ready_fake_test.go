package targets

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// fakeReadyCatalog is a catalog whose template r keeps ready spares.
func fakeReadyCatalog(t *testing.T, warm, warmMax int, state string) *templates.Catalog {
	t.Helper()
	return loadFakeCatalog(t, fmt.Sprintf(`templates:
  - templateId: r
    displayName: ready guest
    powerStates: [running, paused, stopped]
    imageFingerprint: %s
    warm: %d
    warmMax: %d
    warmState: %s
`, fakeFingerprint, warm, warmMax, state))
}

// pipeDialer reaches a daemon that listens at once: a spare's wait for
// its daemon ends on the first dial.
type pipeDialer struct{ nopDialer }

func (pipeDialer) DialContext(context.Context, guest.Target) (net.Conn, error) {
	a, b := net.Pipe()
	_ = b.Close()
	return a, nil
}

// newReadyRig is a fake rig whose template r keeps warm frozen spares.
func newReadyRig(t *testing.T, warm, warmMax int, cfg Config) *fakeRig {
	t.Helper()
	if cfg.ReconcileInterval == 0 {
		cfg.ReconcileInterval = 300 * time.Millisecond
	}
	return newFakeRigOf(t, fakeDurations(seeded(t)), cfg, fakeReadyCatalog(t, warm, warmMax, templates.WarmFrozen), pipeDialer{})
}

// secondReplica starts another replica, named id, on the rig's project;
// the test's cleanup stops it, and so may stop.
func (r *fakeRig) secondReplica(id string) (*Service, func()) {
	r.t.Helper()
	cfg := r.cfg
	cfg.Replica = id
	svc, stop := r.process(cfg, nil)
	r.t.Cleanup(stop)
	return svc, stop
}

// readyCount is how many ready spares svc holds for its hand-outs.
func readyCount(svc *Service) int {
	svc.ready.mu.Lock()
	defer svc.ready.mu.Unlock()
	return len(svc.ready.spares)
}

// awaitReady waits until svc holds n ready spares.
func (r *fakeRig) awaitReady(svc *Service, n int) {
	r.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for readyCount(svc) < n {
		if time.Now().After(deadline) {
			r.t.Fatalf("the replica never held %d ready spares (holds %d)", n, readyCount(svc))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// awaitRunningAs waits until a get of the owner answers id, active and
// running.
func (r *fakeRig) awaitRunningAs(o controller.Owner, id string) {
	r.t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		got, err := r.svc.GetTarget(context.Background(), controller.TargetRef{Owner: o})
		if err == nil && got.TargetID == id && got.Phase == controller.PhaseActive && got.Power == controller.PowerRunning {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("the owner's target never ran as %s: %+v, %v", id, got, err)
		}
	}
}

// readyParams is the owner's create of template r.
func readyParams(o controller.Owner) controller.CreateParams {
	return controller.CreateParams{Owner: o, TemplateID: "r"}
}

// closeUntilClosed sends the owner's close until it answers closed.
func closeUntilClosed(t *testing.T, svc *Service, o controller.Owner, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		obs, err := svc.CloseTarget(context.Background(), controller.TargetRef{Owner: o})
		if err == nil && obs.Phase == controller.PhaseClosed {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("close of %s never answered closed (last %+v, %v)", o.EnvironmentID, obs, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestFakeReadyHandOutIsActiveAtOnce: a create from a pool of frozen
// spares answers active and running, with a spare's name as its id, and
// Incus starts and renames nothing for it: one stand-in, one claim, one
// unfreeze. The owner reaches it by owner and by id; another owner is
// refused it; a close leaves nothing, stand-in included.
func TestFakeReadyHandOutIsActiveAtOnce(t *testing.T) {
	r := newReadyRig(t, 3, 3, Config{})
	r.awaitReady(r.svc, 3)
	for i := range 3 {
		o := fakeOwner(fmt.Sprintf("ready-%d", i))
		r.expect(o)
		from := len(r.fake.Writes())
		obs, err := r.svc.CreateTarget(context.Background(), controller.CreateParams{Owner: o, TemplateID: "r"})
		if err != nil {
			t.Fatal(err)
		}
		if obs.Phase != controller.PhaseActive || obs.Power != controller.PowerRunning || !isReadyName(obs.TargetID) {
			t.Fatalf("a hand-out from the pool answered %+v, want active and running under a spare's name", obs)
		}
		kinds := map[incusfake.WriteKind]int{}
		for _, w := range r.fake.Writes()[from:] {
			if w.Instance == obs.TargetID || w.Instance == Name(o) {
				kinds[w.Kind]++
			}
		}
		if kinds[incusfake.WriteStart] != 0 || kinds[incusfake.WriteRename] != 0 || kinds[incusfake.WriteCreate] != 1 ||
			kinds[incusfake.WriteUnfreeze] != 1 {
			t.Fatalf("the hand-out wrote %v: want one create (the stand-in), one unfreeze, no start, no rename", kinds)
		}
		for _, ref := range []controller.TargetRef{{Owner: o}, {Owner: o, TargetID: obs.TargetID}} {
			got, err := r.svc.GetTarget(context.Background(), ref)
			if err != nil || got.TargetID != obs.TargetID || got.Phase != controller.PhaseActive {
				t.Fatalf("get %+v answered %+v, %v; want the handed-out spare, active", ref, got, err)
			}
		}
		again, err := r.svc.CreateTarget(context.Background(), controller.CreateParams{Owner: o, TemplateID: "r"})
		if err != nil || again.TargetID != obs.TargetID {
			t.Fatalf("a second create answered %+v, %v; want the same target", again, err)
		}
		_, err = r.svc.GetTarget(context.Background(), controller.TargetRef{Owner: fakeOwner("someone-else"), TargetID: obs.TargetID})
		var rpc *jsonrpc.Error
		if !errors.As(err, &rpc) || rpc.Reason != "ownerMismatch" {
			t.Fatalf("another owner's get of the spare answered %v, want ownerMismatch", err)
		}
		if _, err := r.svc.SetPower(context.Background(), controller.TargetRef{Owner: o, TargetID: obs.TargetID}, controller.PowerPaused); err != nil {
			t.Fatal(err)
		}
		r.awaitFake("the handed-out spare paused", 10*time.Second, func() bool {
			v, _ := r.fake.Instance(fakeProject, obs.TargetID)
			return restsAt(v, "Frozen", controller.PowerPaused)
		})
	}
	for i := range 3 {
		o := fakeOwner(fmt.Sprintf("ready-%d", i))
		closeUntilClosed(t, r.svc, o, 20*time.Second)
		r.closed(Name(o))
		if got, err := r.svc.GetTarget(context.Background(), controller.TargetRef{Owner: o}); err == nil {
			t.Fatalf("a get after closed answered %+v", got)
		}
	}
}

// TestFakeReadyManyOwnersAtOnce: thirty owners create at once against a
// pool of eight, each as the runtime does: every owner ends with exactly
// one target (some handed out, the rest created cold), and asking again
// answers the same one.
func TestFakeReadyManyOwnersAtOnce(t *testing.T) {
	r := newReadyRig(t, 8, 8, Config{})
	r.awaitReady(r.svc, 8)
	const owners = 30
	ids := make([]string, owners)
	var wg sync.WaitGroup
	for i := range owners {
		o := fakeOwner(fmt.Sprintf("many-%d", i))
		r.expect(o)
		wg.Go(func() { ids[i] = createUntilID(t, r.svc, readyParams(o)).TargetID })
	}
	wg.Wait()
	handed := 0
	for i := range owners {
		if isReadyName(ids[i]) {
			handed++
		}
		again := createUntilID(t, r.svc, readyParams(fakeOwner(fmt.Sprintf("many-%d", i))))
		if again.TargetID != ids[i] {
			t.Fatalf("owner %d: a create answered %s, then %s", i, ids[i], again.TargetID)
		}
	}
	t.Logf("%d of %d owners were handed a ready spare", handed, owners)
	if handed == 0 {
		t.Fatal("no owner was handed a spare from a pool of eight")
	}
}

// TestFakeReadyHandOutKilledAtEachStep: a process stopped between the
// hand-out's steps (after the stand-in's create was sent, after it
// landed, after the claim) leaves a state the owner's next create, by the
// next process of the same replica, turns into exactly one target.
func TestFakeReadyHandOutKilledAtEachStep(t *testing.T) {
	for _, step := range []string{"standin-sent", "standin", "claimed"} {
		t.Run(step, func(t *testing.T) {
			r := newReadyRig(t, 2, 2, Config{})
			r.awaitReady(r.svc, 2)
			o := fakeOwner("killed-" + step)
			r.expect(o)
			r.svc.warmHook = func(s string) bool { return s == step }
			if _, err := r.svc.CreateTarget(context.Background(), controller.CreateParams{Owner: o, TemplateID: "r"}); err == nil {
				t.Fatalf("the hand-out was not stopped at %s", step)
			}
			r.restart(nil)
			obs := createUntilID(t, r.svc, readyParams(o))
			if !isReadyName(obs.TargetID) && obs.TargetID != Name(o) {
				t.Fatalf("the next create answered %+v", obs)
			}
			r.awaitRunningAs(o, obs.TargetID)
		})
	}
}

// TestFakeReadyTwoReplicas: two replicas share a project and a pool of
// four, two spares each, and each hands out only its own. Sixteen owners
// each send their create to both replicas at once: each owner ends with
// one target, and no spare is ever claimed for two owners.
func TestFakeReadyTwoReplicas(t *testing.T) {
	r := newReadyRig(t, 4, 4, Config{Replica: "ra", Replicas: 2})
	b, stopB := r.secondReplica("rb")
	r.awaitReady(r.svc, 2)
	r.awaitReady(b, 2)
	const owners = 16
	var wg sync.WaitGroup
	ids := make([][2]string, owners)
	for i := range owners {
		o := fakeOwner(fmt.Sprintf("two-%d", i))
		r.expect(o)
		for j, svc := range []*Service{r.svc, b} {
			wg.Go(func() { ids[i][j] = createUntilID(t, svc, readyParams(o)).TargetID })
		}
	}
	wg.Wait()
	for i := range owners {
		if ids[i][0] != ids[i][1] {
			t.Errorf("owner %d was answered %s by one replica and %s by the other", i, ids[i][0], ids[i][1])
		}
	}
	claims := map[string]map[string]bool{}
	for _, w := range r.fake.Writes() {
		if c := w.Config[keyWarmClaim]; isReadyName(w.Instance) && c != "" {
			if claims[w.Instance] == nil {
				claims[w.Instance] = map[string]bool{}
			}
			claims[w.Instance][c] = true
		}
	}
	for sn, by := range claims {
		if len(by) > 1 {
			t.Errorf("spare %s was claimed for %d owners: %v", sn, len(by), by)
		}
	}
	stopB()
}

// TestFakeReadyLeftoversAreRepaired: what stopped hand-outs leave is
// settled. A stand-in whose spare is gone is deleted by the survey; a
// spare claimed under no stand-in is closed by it; a stand-in naming an
// unclaimed spare of this replica's is finished by the owner's next
// create, which answers that spare.
func TestFakeReadyLeftoversAreRepaired(t *testing.T) {
	r := newReadyRig(t, 1, 1, Config{})
	r.awaitReady(r.svc, 1)
	then := time.Now().Add(-time.Hour)
	lockOf := func(o controller.Owner, spare string, at time.Time) incusfake.Seed {
		return incusfake.Seed{Name: Name(o), Config: map[string]string{keySchema: schemaVersion, keyUniverse: o.UniverseID,
			keyEnvironment: o.EnvironmentID, keyStandin: spare, keyTemplate: "r", keyWarmClaimAt: msString(at)}}
	}
	recipe := r.svc.readyRecipe(r.svc.catalog.Load().All()[0])
	gone, unlocked, resumed := fakeOwner("gone"), fakeOwner("unlocked"), fakeOwner("resumed")
	spare := "lsr-00000000000000000001"
	claimed := "lsr-00000000000000000002"
	if err := r.fake.Seed(fakeProject,
		lockOf(gone, "lsr-000000000000000000ff", then),
		incusfake.Seed{Name: claimed, Status: "Frozen", Config: map[string]string{keySchema: schemaVersion,
			keyUniverse: unlocked.UniverseID, keyEnvironment: unlocked.EnvironmentID, keyTemplate: "r",
			keyWarmClaim: Name(unlocked), keyWarmClaimAt: msString(then), keyBooted: msString(then)}},
		incusfake.Seed{Name: spare, Status: "Frozen", Config: map[string]string{keyWarm: "r", keyWarmRecipe: recipe,
			keyWarmReady: msString(then), keyWarmMaker: r.cfg.Replica}},
		lockOf(resumed, spare, time.Now()),
	); err != nil {
		t.Fatal(err)
	}
	r.expect(resumed)
	r.awaitFake("the stale stand-in deleted and the unlocked spare closed", 20*time.Second, func() bool {
		_, lock := r.fake.Instance(fakeProject, Name(gone))
		_, orphan := r.fake.Instance(fakeProject, claimed)
		return !lock && !orphan
	})
	obs, err := r.svc.CreateTarget(context.Background(), readyParams(resumed))
	if err != nil || obs.TargetID != spare || obs.Phase != controller.PhaseActive {
		t.Fatalf("the owner's create answered %+v, %v; want the spare its stand-in names, active", obs, err)
	}
}

// holdHandOut starts the owner's create on the rig's process and holds
// its hand-out at step until release is called; created gets its answer.
func (r *fakeRig) holdHandOut(o controller.Owner, step string) (release func(), created <-chan controller.Observation) {
	r.t.Helper()
	at, held := make(chan struct{}), make(chan struct{})
	r.svc.warmHook = func(s string) bool {
		if s == step {
			close(at)
			<-held
		}
		return false
	}
	answered := make(chan controller.Observation, 1)
	go func() {
		obs, err := r.svc.CreateTarget(context.Background(), readyParams(o))
		if err != nil {
			r.t.Error(err)
		}
		answered <- obs
	}()
	<-at
	return func() { close(held) }, answered
}

// TestFakeReadyCloseRacesAClaim: a close on another replica arrives while
// a hand-out has its stand-in and not yet its claim. It must not answer
// closed (the claim would then land a target no one closes): it answers
// unavailable until the claim has landed, and then closes the target, its
// stand-in last.
func TestFakeReadyCloseRacesAClaim(t *testing.T) {
	r := newReadyRig(t, 1, 1, Config{Replica: "ra", Replicas: 2})
	b, _ := r.secondReplica("rb")
	r.awaitReady(r.svc, 1)
	o := fakeOwner("raced")
	release, created := r.holdHandOut(o, "standin")
	obs, err := b.CloseTarget(context.Background(), controller.TargetRef{Owner: o})
	var rpc *jsonrpc.Error
	if err == nil || !errors.As(err, &rpc) || rpc.Kind != jsonrpc.KindUnavailable {
		t.Fatalf("a close while the hand-out's claim is under way answered %+v, %v; want unavailable", obs, err)
	}
	release()
	if got := <-created; !isReadyName(got.TargetID) || got.Phase != controller.PhaseActive {
		t.Fatalf("the hand-out answered %+v", got)
	}
	closeUntilClosed(t, b, o, 30*time.Second)
	for _, v := range r.fake.Instances(fakeProject) {
		if v.Config[keyEnvironment] == o.EnvironmentID {
			t.Fatalf("after closed, Incus still holds %s of the owner", v.Name)
		}
	}
}

// TestFakeReadyCloseByIDIsIdempotent: the runtime closes with the id it
// holds, a spare's name, until closed; after closed, the same close
// answers closed again, never notFound.
func TestFakeReadyCloseByIDIsIdempotent(t *testing.T) {
	r := newReadyRig(t, 1, 1, Config{})
	r.awaitReady(r.svc, 1)
	o := fakeOwner("close-by-id")
	obs, err := r.svc.CreateTarget(context.Background(), readyParams(o))
	if err != nil || !isReadyName(obs.TargetID) {
		t.Fatalf("create answered %+v, %v", obs, err)
	}
	ref := controller.TargetRef{Owner: o, TargetID: obs.TargetID}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		got, err := r.svc.CloseTarget(context.Background(), ref)
		if err == nil && got.Phase == controller.PhaseClosed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("close by id never answered closed: %+v, %v", got, err)
		}
	}
	if got, err := r.svc.CloseTarget(context.Background(), ref); err != nil || got.Phase != controller.PhaseClosed {
		t.Fatalf("a close after closed answered %+v, %v; want closed", got, err)
	}
	// Another owner naming the gone spare holds nothing: closed.
	if got, err := r.svc.CloseTarget(context.Background(), controller.TargetRef{Owner: fakeOwner("other"), TargetID: obs.TargetID}); err != nil || got.Phase != controller.PhaseClosed {
		t.Fatalf("another owner's close naming a gone spare answered %+v, %v; want closed", got, err)
	}
}

// TestFakeReadyHandOutLandingAfterClosed: another replica answers a close
// closed while a hand-out has its spare and has not sent its stand-in yet
// (nothing of the owner is in Incus). The hand-out then lands a target
// under an owner answered closed, which no one would ever close: the
// replica that answered closed closes it, stand-in and all.
func TestFakeReadyHandOutLandingAfterClosed(t *testing.T) {
	r := newReadyRig(t, 1, 1, Config{Replica: "ra", Replicas: 2})
	b, _ := r.secondReplica("rb")
	r.awaitReady(r.svc, 1)
	o := fakeOwner("closed-first")
	release, created := r.holdHandOut(o, "taken")
	if got, err := b.CloseTarget(context.Background(), controller.TargetRef{Owner: o}); err != nil || got.Phase != controller.PhaseClosed {
		t.Fatalf("a close with nothing of the owner in Incus answered %+v, %v; want closed", got, err)
	}
	release()
	if got := <-created; !isReadyName(got.TargetID) {
		t.Fatalf("the hand-out answered %+v", got)
	}
	r.awaitFake("the target landed after closed, closed", 20*time.Second, func() bool {
		for _, v := range r.fake.Instances(fakeProject) {
			if v.Config[keyEnvironment] == o.EnvironmentID {
				return false
			}
		}
		return true
	})
}

// deviceDialer is pipeDialer for a dialer that needs a device on each
// guest, as the proxy dialer does.
type deviceDialer struct{ pipeDialer }

func (deviceDialer) Devices(t guest.Target) map[string]map[string]string {
	return map[string]map[string]string{"lsguest": {"type": "proxy", "listen": "unix:/run/ls/" + t.Instance + ".sock"}}
}

// TestFakeReadySparesOfAnotherDialerAreRebuilt: spares made by a process
// whose guest dialer needs no device are never handed out by one whose
// dialer needs one (its owner's routes could not reach the guest): the
// survey deletes them, and the spares handed out carry the device.
func TestFakeReadySparesOfAnotherDialerAreRebuilt(t *testing.T) {
	r := newReadyRig(t, 2, 2, Config{})
	r.awaitReady(r.svc, 2)
	before := map[string]bool{}
	r.svc.ready.mu.Lock()
	for n := range r.svc.ready.spares {
		before[n] = true
	}
	r.svc.ready.mu.Unlock()
	r.dialer = deviceDialer{}
	r.restart(nil)
	r.awaitFake("the spares of the other dialer deleted", 20*time.Second, func() bool {
		for _, v := range r.fake.Instances(fakeProject) {
			if before[v.Name] {
				return false
			}
		}
		return true
	})
	r.awaitReady(r.svc, 2)
	o := fakeOwner("rebuilt")
	r.expect(o)
	obs, err := r.svc.CreateTarget(context.Background(), readyParams(o))
	if err != nil || !isReadyName(obs.TargetID) || before[obs.TargetID] {
		t.Fatalf("create answered %+v, %v; want a spare built for this dialer", obs, err)
	}
	if v := r.instance(obs.TargetID); v.Devices["lsguest"]["type"] != "proxy" {
		t.Fatalf("the handed-out spare has devices %v, want the dialer's", v.Devices)
	}
}

// TestFakeReadyHandOutAgainstAFaultyIncus: Incus refuses, drops the answer
// to, or hangs one call of a hand-out. The owner's create still ends with
// one target: another spare when the first could not be taken, the same
// one when the write landed unseen, and a frozen one the reconciler
// unfreezes when the unfreeze hangs. The rig's inventory check then finds
// no stand-in left over and no spare claimed twice.
func TestFakeReadyHandOutAgainstAFaultyIncus(t *testing.T) {
	for _, c := range []struct {
		name  string
		fault incusfake.Fault
	}{
		{"stand-in refused", incusfake.Fault{Kind: incusfake.Refuse, Method: http.MethodPost, Path: "/1.0/instances", Times: 1}},
		{"stand-in answer dropped", incusfake.Fault{Kind: incusfake.DropResponse, Method: http.MethodPost, Path: "/1.0/instances", Times: 1}},
		{"claim refused", incusfake.Fault{Kind: incusfake.Refuse, Method: http.MethodPatch, Path: "/1.0/instances/*", Times: 1}},
		{"claim answer dropped", incusfake.Fault{Kind: incusfake.DropResponse, Method: http.MethodPatch, Path: "/1.0/instances/*", Times: 1}},
		{"unfreeze hangs", incusfake.Fault{Kind: incusfake.Hang, Method: http.MethodPut, Path: "/1.0/instances/*/state", Times: 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newReadyRig(t, 2, 2, Config{})
			r.awaitReady(r.svc, 2)
			o := fakeOwner("faulty")
			r.expect(o)
			f := r.fake.Inject(c.fault)
			defer f.Release()
			obs, err := r.svc.CreateTarget(context.Background(), readyParams(o))
			if f.Hits() == 0 {
				t.Fatalf("the fault met no call (answer %+v, %v)", obs, err)
			}
			if err != nil || !isReadyName(obs.TargetID) {
				t.Fatalf("the create answered %+v, %v; want a handed-out spare", obs, err)
			}
			f.Release()
			r.awaitRunningAs(o, obs.TargetID)
		})
	}
}
