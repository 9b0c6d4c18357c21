package targets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/relays"
)

// The tests here run targets' power and read paths against the in-process
// Incus fake (fakerig_test.go): no incusd, seconds under -race. Run them
// alone with -run TestFake.

// Many owners, each woken, leased and set running at once from this one
// process, against an Incus that refuses a change while another operation
// or config write holds the instance: the turn (owner.go) must keep the
// process from ever meeting its own writes as busy. The tap sees refusals
// that the service would otherwise retry or keep quietly.
func TestFakeOwnWritesNeverMeetBusy(t *testing.T) {
	rng := seeded(t)
	// Generous answer bounds: this test is about busy refusals, and under
	// -race on a loaded machine a read of the fake can take over a second,
	// which the default budget would answer as unavailable.
	r := newFakeRig(t, fakeDurations(rng), Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond,
		AnswerWithin: 5 * time.Second, MethodBudget: 15 * time.Second})
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

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
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
			// A wake that fails otherwise than busy (a read of the fake
			// slower than its 1.5 s bound, on a loaded machine under -race)
			// is tried again, as a flight does up to three times; a busy
			// one is this test's failure at once.
			var err error
			for try := 0; try < 3; try++ {
				var inst *incus.Instance
				if inst, _, err = r.client.GetInstance(ctx, p.name); err == nil {
					_, err = r.svc.Wake(ctx, routeFor(inst), time.Now(), nil)
				}
				if err == nil || errors.Is(err, incus.ErrBusy) || ctx.Err() != nil {
					break
				}
				t.Logf("wake %s failed (try %d); trying again as a flight does: %v", p.name, try+1, err)
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
			// An unavailable answer (a read of the fake slower than the
			// method's bound, on a loaded machine under -race) is what a
			// runtime retries; it records nothing, and is no busy refusal.
			var (
				obs controller.Observation
				err error
			)
			for try := 0; try < 5; try++ {
				if obs, err = r.svc.SetPower(ctx, p.ref, controller.PowerRunning); kindOf(err) != jsonrpc.KindUnavailable {
					break
				}
				t.Logf("setPower %s answered unavailable (try %d); retrying as a runtime does: %v", p.name, try+1, err)
			}
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

	r.awaitFake("every target running at rest", 30*time.Second, func() bool {
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

// A dial that finds its target in the middle of a graceful stop (a
// setPower stopped that the reconciler carries out). Wake records running
// under the instance's turn, which the stop's action holds until Incus is
// done; with no patience of its own, Wake waits for the turn within the
// caller's bound rather than meeting the stop as Incus's busy refusal.
// Once the stop ends, the dial's later request wins: running, recorded
// as the dial's.
func TestFakeDialDuringGracefulStop(t *testing.T) {
	const stopTakes = 1500 * time.Millisecond
	fcfg := fakeDurations(seeded(t))
	fcfg.Durations.Stop = stopTakes
	r := newFakeRig(t, fcfg, Config{GracefulStop: 5 * time.Second, ReconcileInterval: 100 * time.Millisecond})
	o := fakeOwner("env-graceful")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ref := controller.TargetRef{Owner: o, TargetID: name}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	setDone := make(chan error, 1)
	go func() {
		_, err := r.svc.SetPower(ctx, ref, controller.PowerStopped)
		setDone <- err
	}()
	r.awaitFake("the graceful stop under way", 5*time.Second, func() bool {
		return r.instance(name).HeldBy == "stop"
	})

	// The dial's own bound, as a data route gives its wake: longer than
	// what is left of the stop.
	wctx, wcancel := context.WithTimeout(ctx, 3*stopTakes)
	defer wcancel()
	inst, _, err := r.client.GetInstance(wctx, name)
	if err != nil {
		t.Fatal(err)
	}
	dialAt := time.Now()
	from, err := r.svc.Wake(wctx, routeFor(inst), dialAt, nil)
	took := time.Since(dialAt)
	if err != nil {
		t.Fatalf("a wake during a graceful stop failed after %v (busy: %v): %v\n%s", took, errors.Is(err, incus.ErrBusy), err, r.history(name))
	}
	t.Logf("the wake answered after %v, from %s", took.Round(time.Millisecond), from)
	if from != controller.PowerStopped {
		// Wake reads the instance once it holds the turn, which the stop
		// held to its end: what it woke was a stopped target.
		t.Errorf("the wake answered from %s, want stopped (it waited out the stop)", from)
	}
	if err := <-setDone; err != nil {
		t.Errorf("setPower stopped: %v", err)
	}

	r.awaitFake("running at rest with the dial's request", 5*time.Second, func() bool {
		return restsAt(r.instance(name), incus.InstanceRunning, controller.PowerRunning)
	})
	v := r.instance(name)
	if got := intentOf(&incus.Instance{Config: v.Config}); got.By != ByUse || got.At.UnixMilli() != dialAt.UnixMilli() {
		t.Errorf("recorded intent %+v, want the dial's (running by use at %v)", got, dialAt)
	}
	var stopped, started bool
	for _, w := range r.fake.Writes() {
		switch {
		case w.Instance == name && w.Kind == incusfake.WriteStop:
			stopped = true
		case w.Instance == name && w.Kind == incusfake.WriteStart && stopped:
			started = true
		}
	}
	if !stopped || !started {
		t.Errorf("want the stop to finish and a start after it:\n%s", r.history(name))
	}
	if busy := r.tap.refusals(); len(busy) > 0 {
		t.Errorf("busy refusals met by this process:\n%s", strings.Join(busy, "\n"))
	}
}

// slowStopTarget is a running target of env's on a fake whose stops take
// stop, with a graceful stop longer than that, and a context for the test.
func slowStopTarget(t *testing.T, env string, stop time.Duration) (*fakeRig, string, controller.TargetRef, context.Context) {
	fcfg := fakeDurations(seeded(t))
	fcfg.Durations.Stop = stop
	r := newFakeRig(t, fcfg, Config{GracefulStop: 10 * time.Second, ReconcileInterval: 100 * time.Millisecond})
	o := fakeOwner(env)
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return r, name, controller.TargetRef{Owner: o, TargetID: name}, ctx
}

// A setPower asked while a close's graceful stop holds the instance's turn
// finds the turn held to the end of its patience. It must not keep the
// request and answer the close's observation as if the move were under
// way (the kill matrix met that: "running" accepted on a closing target,
// never to be reached): the target is not active, and the answer says so.
func TestFakeSetPowerDuringACloseIsRefused(t *testing.T) {
	r, name, ref, ctx := slowStopTarget(t, "env-close-power", 4*time.Second)
	obs, err := r.svc.CloseTarget(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	if obs.Phase != controller.PhaseClosing {
		t.Fatalf("close answered %s, want closing", obs.Phase)
	}
	r.awaitFake("the close's graceful stop under way", 5*time.Second, func() bool {
		return r.instance(name).HeldBy == "stop"
	})
	for _, p := range []controller.Power{controller.PowerRunning, controller.PowerStopped} {
		got, err := r.svc.SetPower(ctx, ref, p)
		var rpcErr *jsonrpc.Error
		if !errors.As(err, &rpcErr) || rpcErr.Kind != jsonrpc.KindFailedPrecondition || rpcErr.Reason != "targetNotActive" {
			t.Fatalf("setPower %s during a close answered %+v, %v; want failedPrecondition targetNotActive\n%s", p, got, err, r.history(name))
		}
		if cfg, _, _ := r.fake.Project(fakeProject); cfg[keyPendingPrefix+name] != "" {
			t.Fatalf("setPower %s was refused, and the project keeps a copy of it: %s", p, cfg[keyPendingPrefix+name])
		}
	}
	r.awaitFake("the closed target gone", 20*time.Second, func() bool {
		_, _, err := r.client.GetInstance(ctx, name)
		return errors.Is(err, incus.ErrNotFound)
	})
	r.closed(name)
}

// A setPower running asked while the reconciler's graceful stop holds the
// instance is kept, and answered accepted: its copy on the project must be
// written by the time it is answered, or a kill then loses it to the
// older stop (the kill matrix, seed 1796577032197878954: the copy was
// begun after the request's patience and the budget cut it short). Here
// every project write takes most of a budget, as on a loaded Incus.
func TestFakeAKeptRequestIsStoredBeforeItIsAnswered(t *testing.T) {
	r, name, ref, ctx := slowStopTarget(t, "env-kept-stored", 6*time.Second)
	if _, err := r.svc.SetPower(ctx, ref, controller.PowerStopped); err != nil {
		t.Fatal(err)
	}
	r.awaitFake("the graceful stop under way", 5*time.Second, func() bool {
		return r.instance(name).HeldBy == "stop"
	})
	budget := r.svc.cfg.MethodBudget
	slow := r.fake.Inject(incusfake.Fault{Kind: incusfake.Latency, Method: http.MethodPut, Path: "/1.0/projects/*", Latency: budget * 3 / 5})
	start := time.Now()
	obs, err := r.svc.SetPower(ctx, ref, controller.PowerRunning)
	took := time.Since(start)
	cfg, _, _ := r.fake.Project(fakeProject)
	slow.Remove()
	if err != nil {
		t.Fatalf("setPower running during the stop: %v", err)
	}
	if slow.Hits() == 0 {
		t.Fatal("no project write met the latency: the test tested nothing")
	}
	w, _, ok := pendingIn(cfg, name)
	if !ok || w.intent.Power != controller.PowerRunning {
		t.Fatalf("setPower running answered %s after %v, and the project keeps %+v (stored %v): a kill now loses it\n%s",
			obs.Phase, took.Round(time.Millisecond), w.intent, ok, r.history(name))
	}
	r.awaitFake("running at rest with the kept request", 20*time.Second, func() bool {
		return restsAt(r.instance(name), incus.InstanceRunning, controller.PowerRunning)
	})
	r.awaitKeptCleared(name)
}

// A setPower paused asked while a dial's wake is under way (its unfreeze
// held at Incus's door, the turn with it) is the later request and wins:
// setPower cannot record it while the wake holds the turn, so it keeps it
// and the reconciler records it once the wake is done, then pauses.
func TestFakePowerDownInsideAWakesWindow(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond})
	o := fakeOwner("env-window")
	name := r.seedTarget(o, incus.InstanceFrozen, controller.PowerPaused)
	ref := controller.TargetRef{Owner: o, TargetID: name}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	wakeAt := time.Now()
	hang, wakeDone := r.wakeHeld(ctx, name, http.MethodPut, "/state", wakeAt, nil) // the unfreeze
	if got := r.instance(name).Config[keyPower]; got != string(controller.PowerPaused) {
		t.Fatalf("the wake acts first and records its request after its action; recorded %q while the unfreeze is under way", got)
	}

	obs, err := r.svc.SetPower(ctx, ref, controller.PowerPaused)
	if err != nil {
		t.Fatalf("setPower paused during a wake: %v", err)
	}
	if obs.Phase != controller.PhaseActive {
		t.Fatalf("setPower paused answered %+v", obs)
	}
	hang.Release()
	if err := <-wakeDone; err != nil {
		t.Fatalf("the wake failed: %v\n%s", err, r.history(name))
	}

	r.awaitFake("paused at rest with setPower's request", 5*time.Second, func() bool {
		return restsAt(r.instance(name), incus.InstanceFrozen, controller.PowerPaused)
	})
	v := r.instance(name)
	// The record keeps milliseconds: a setPower in the wake's own
	// millisecond records that millisecond.
	if got := intentOf(&incus.Instance{Config: v.Config}); got.By != BySetPower || got.At.Before(wakeAt.Truncate(time.Millisecond)) {
		t.Errorf("recorded intent %+v, want setPower's, asked after the wake at %v\n%s", got, wakeAt, r.history(name))
	}
	if v.Config[KeyIdleSince] == "" {
		t.Errorf("a setPower pause records when idleness began\n%s", r.history(name))
	}
	if busy := r.tap.refusals(); len(busy) > 0 {
		t.Errorf("busy refusals met by this process:\n%s", strings.Join(busy, "\n"))
	}
}

// The reverse order: a dial that comes while a setPower's pause is being
// carried out (a long freeze holding the turn) is the later request and
// wins: it waits the freeze out, records running, and unfreezes.
func TestFakeDialAfterAPowerDownWins(t *testing.T) {
	const freezeTakes = 800 * time.Millisecond
	fcfg := fakeDurations(seeded(t))
	fcfg.Durations.Freeze = freezeTakes
	r := newFakeRig(t, fcfg, Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond})
	o := fakeOwner("env-window-rev")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ref := controller.TargetRef{Owner: o, TargetID: name}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	setDone := make(chan error, 1)
	go func() {
		_, err := r.svc.SetPower(ctx, ref, controller.PowerPaused)
		setDone <- err
	}()
	r.awaitFake("the pause under way", 5*time.Second, func() bool { return r.instance(name).HeldBy == "freeze" })

	inst, _, err := r.client.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	dialAt := time.Now()
	// The bound is the wake's caller's, not a figure under test: the
	// freeze, its mark and the wake's own read must fit in it however
	// loaded the machine (2.3 s for the 800 ms freeze once, niced beside
	// a full make test and stress-ng).
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	from, err := r.svc.Wake(wctx, routeFor(inst), dialAt, nil)
	if err != nil {
		t.Fatalf("a dial during a pause failed (busy: %v): %v\n%s", errors.Is(err, incus.ErrBusy), err, r.history(name))
	}
	if from != controller.PowerPaused {
		t.Errorf("the wake answered from %s, want paused (it waited the freeze out)", from)
	}
	if err := <-setDone; err != nil {
		t.Errorf("setPower paused: %v", err)
	}
	r.awaitFake("running at rest with the dial's request", 5*time.Second, func() bool {
		return restsAt(r.instance(name), incus.InstanceRunning, controller.PowerRunning)
	})
	v := r.instance(name)
	if got := intentOf(&incus.Instance{Config: v.Config}); got.By != ByUse || got.At.UnixMilli() != dialAt.UnixMilli() {
		t.Errorf("recorded intent %+v, want the dial's (running by use at %v)\n%s", got, dialAt, r.history(name))
	}
	if v.Config[KeyIdleSince] != "" {
		t.Errorf("a wake clears the idle-since instant, still %q", v.Config[KeyIdleSince])
	}
	if busy := r.tap.refusals(); len(busy) > 0 {
		t.Errorf("busy refusals met by this process:\n%s", strings.Join(busy, "\n"))
	}
}

// Another replica creates an owner's target while this process's event
// stream loses every event: this process's cache, confirmed and sure the
// name is free, is wrong. GetTarget must not answer notFound from it (the
// runtime fails the environment on notFound): an absence is confirmed
// with Incus before it is answered.
func TestFakeLostEventsNeverAnswerNotFound(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{ReconcileInterval: time.Minute})
	r.fake.DropEvents(true)
	o := fakeOwner("env-lost-events")
	name := Name(o)
	ref := controller.TargetRef{Owner: o}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	r.awaitCache("a confirmed answer (the test needs it answering)", name, 10*time.Second, func(_ *incus.Instance, hit, confirmed bool) bool {
		return confirmed && hit
	})
	if _, err := r.svc.GetTarget(ctx, ref); kindOf(err) != jsonrpc.KindNotFound {
		t.Fatalf("before any create: want notFound, got %v", err)
	}

	// The other replica: its own client, straight to Incus, building the
	// request as targets does.
	other, err := r.fake.Client(fakeProject)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	tmpl, _ := r.svc.catalog.Load().Get("t1")
	req, err := r.svc.instanceRequest(name, controller.CreateParams{Owner: o, TemplateID: "t1"}, tmpl)
	if err != nil {
		t.Fatal(err)
	}
	r.expect(o)
	op, err := other.CreateInstance(ctx, req)
	if err == nil {
		_, err = other.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	if r.fake.EventsDropped() == 0 {
		t.Fatal("the create's events reached the stream; the test means them lost")
	}
	if inst, hit, confirmed := r.cacheView(name); !confirmed || !hit || inst != nil {
		t.Fatalf("the cache was meant to answer the name free (confirmed %v, hit %v, inst %v)", confirmed, hit, inst != nil)
	}

	obs, err := r.svc.GetTarget(ctx, ref)
	if err != nil {
		t.Fatalf("get of a target another replica created, its events lost: %v", err)
	}
	if obs.TargetID != name || (obs.Phase != controller.PhaseProvisioning && obs.Phase != controller.PhaseActive) {
		t.Fatalf("get answered %+v, want the new target provisioning or active", obs)
	}
	// The same with the target's id, as a runtime that has it asks.
	if obs, err := r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: name}); err != nil || obs.TargetID != name {
		t.Fatalf("get by id answered %+v, %v", obs, err)
	}
}

// A use that arrived after a power-down was asked outranks it: the
// power-down closes none of its relays, and the use's request for running
// is recorded instead. One from before the request loses to it, as ever:
// its relay is told to go away and the target powers down.
func TestFakeAUseAfterThePowerDownOutranksIt(t *testing.T) {
	for _, after := range []bool{true, false} {
		t.Run(fmt.Sprintf("use after the request %v", after), func(t *testing.T) {
			r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
			o := fakeOwner("env-outrank")
			name := Name(o)
			asked := time.Now().Add(-time.Hour) // seedTarget records its request then
			arrived := asked.Add(-time.Minute)
			if after {
				arrived = time.Now()
			}
			// The relay is there before the target is seen, so no pass can
			// act on the request without it.
			c := newGoneConn()
			tk, _ := r.svc.relays.Enter(name, arrived)
			tk.Adopt(c)
			defer r.svc.relays.Remove(name, c)
			r.seedTarget(o, incus.InstanceRunning, controller.PowerPaused)
			r.svc.own.kick(name)
			if after {
				r.awaitFake("the use's request recorded", 5*time.Second, func() bool {
					return restsAt(r.instance(name), incus.InstanceRunning, controller.PowerRunning)
				})
				got := intentOf(&incus.Instance{Config: r.instance(name).Config})
				if got.By != ByUse || got.At.UnixMilli() != arrived.UnixMilli() {
					t.Errorf("recorded %+v, want running by use at the use's arrival %v\n%s", got, arrived, r.history(name))
				}
				if c.toldAway() {
					t.Error("the relay of a use that outranks the power-down was told to go away")
				}
				return
			}
			select {
			case <-c.Done():
			case <-time.After(5 * time.Second):
				t.Fatalf("the older use's relay was never told to go away\n%s", r.history(name))
			}
			if !c.toldAway() {
				t.Fatal("the older use's relay was killed, not told to go away")
			}
			r.svc.relays.Remove(name, c)
			r.awaitFake("paused at the request", 5*time.Second, func() bool {
				return restsAt(r.instance(name), incus.InstanceFrozen, controller.PowerPaused)
			})
		})
	}
}

// goneConn is a relay that ends as soon as it is told to go away.
type goneConn struct {
	once sync.Once
	done chan struct{}
	away atomic.Bool
}

func newGoneConn() *goneConn { return &goneConn{done: make(chan struct{})} }

func (c *goneConn) GoAway(int, string, string) { c.away.Store(true); c.end() }
func (c *goneConn) Kill(string)                { c.end() }
func (c *goneConn) Done() <-chan struct{}      { return c.done }
func (c *goneConn) end()                       { c.once.Do(func() { close(c.done) }) }
func (c *goneConn) toldAway() bool             { return c.away.Load() }

// A reconcile pass that lists from the observation cache while the entry
// of a target just routed still shows it from before the write (the
// write's re-read not landed yet) must not take the route away: the edge
// would answer 404 for the new route until the next pass. The re-read is
// held at Incus's door: the ensure's own read passes, every later read of
// the instance waits.
func TestFakeAPassKeepsARouteTheCacheHasNotReadYet(t *testing.T) {
	base, err := ingressurl.Parse("http://{label}.localhost:1")
	if err != nil {
		t.Fatal(err)
	}
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{IngressBase: &base, ReconcileInterval: time.Hour})
	o := fakeOwner("env-route-pass")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ref := controller.TargetRef{Owner: o, TargetID: name}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.awaitCache("the target served", name, 10*time.Second, func(inst *incus.Instance, hit, confirmed bool) bool {
		return confirmed && hit && inst != nil
	})

	held := r.fake.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: http.MethodGet, Path: "/1.0/instances/" + name, Skip: 1})
	defer held.Release()
	obs, err := r.svc.EnsureIngress(ctx, ref)
	if err != nil || obs.Ingress == nil {
		t.Fatalf("ensure answered %+v, %v", obs, err)
	}
	label, ok := base.Label(strings.TrimPrefix(obs.Ingress.Endpoint, "http://"))
	if !ok {
		t.Fatalf("endpoint %s has no label", obs.Ingress.Endpoint)
	}
	select {
	case <-held.Hit():
	case <-ctx.Done():
		t.Fatal("the cache never read the written instance again")
	}
	if err := r.svc.pass(ctx); err != nil {
		t.Fatal(err)
	}
	if _, routed := r.svc.IngressLookup(label); !routed {
		t.Fatal("a pass on a listing older than the ensure took the route away")
	}

	held.Remove()
	held.Release()
	r.awaitCache("the routed target served", name, 10*time.Second, func(inst *incus.Instance, hit, _ bool) bool {
		return hit && inst != nil && inst.Config[keyIngressRouted] == "true"
	})
	if err := r.svc.pass(ctx); err != nil {
		t.Fatal(err)
	}
	if _, routed := r.svc.IngressLookup(label); !routed {
		t.Fatal("a pass on a listing that shows the route took it away")
	}
}

// A use that read the target between a wake's action and its record (on
// a loaded machine, a dial kept waiting for the CPU) and looks at it again
// after the record finds no power-down pending: the record it missed
// replaced it. Otherwise every such dial wakes the target once more
// (found by the fifty-dial storm beside a CPU hog). A setPower asked after
// the wake makes one pending again.
func TestFakeAReadFromInsideAWakeFindsItsRecord(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
	o := fakeOwner("env-inside")
	name := r.seedTarget(o, incus.InstanceFrozen, controller.PowerPaused)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	record, wakeDone := r.wakeHeld(ctx, name, http.MethodPatch, "", time.Now(), nil)
	between, _, err := r.client.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if between.Status != incus.InstanceRunning || StateOf(between).Recorded.Power != controller.PowerPaused {
		t.Fatalf("between the action and the record Incus shows %s with %+v, want Running with the paused request", between.Status, StateOf(between).Recorded)
	}
	read := routeFor(between)
	// The same read without the pause's mark of carried out (a record
	// an older build made, or a mark that failed): Incus's state alone
	// says a power-down is pending.
	unmarked := *between
	unmarked.Config = maps.Clone(between.Config)
	delete(unmarked.Config, keyPowerDone)
	if !StateOf(&unmarked).PowerPending() {
		t.Fatal("an unmarked pause on a running target is not pending")
	}
	record.Release()
	if err := <-wakeDone; err != nil {
		t.Fatalf("the wake: %v\n%s", err, r.history(name))
	}
	for _, rd := range []Route{read, routeFor(&unmarked)} {
		if r.svc.PowerDownPending(rd, time.Now()) {
			t.Fatalf("a read from inside the wake's window finds a power-down pending after the wake recorded running\n%s", r.history(name))
		}
	}

	ref := controller.TargetRef{Owner: o, TargetID: name}
	if _, err := r.svc.SetPower(ctx, ref, controller.PowerPaused); err != nil {
		t.Fatalf("setPower paused after the wake: %v", err)
	}
	after, _, err := r.client.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if after.Status == incus.InstanceRunning && !r.svc.PowerDownPending(routeFor(after), time.Now().Add(-time.Hour)) {
		t.Fatalf("setPower paused asked after the wake is not pending for a use older than it\n%s", r.history(name))
	}
}

// An idle close takes the target's public ingress away at once, as
// target/close does, not at the next reconcile pass: the edge answers the
// host 404 from the close on, and the closing record carries no route.
func TestFakeAnIdleCloseTakesIngressAtOnce(t *testing.T) {
	base, err := ingressurl.Parse("http://{label}.localhost:1")
	if err != nil {
		t.Fatal(err)
	}
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{IngressBase: &base, ReconcileInterval: time.Hour})
	o := fakeOwner("env-idle-ingress")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	obs, err := r.svc.EnsureIngress(ctx, controller.TargetRef{Owner: o, TargetID: name})
	if err != nil || obs.Ingress == nil {
		t.Fatalf("ensure answered %+v, %v", obs, err)
	}
	label, ok := base.Label(strings.TrimPrefix(obs.Ingress.Endpoint, "http://"))
	if !ok {
		t.Fatalf("endpoint %s has no label", obs.Ingress.Endpoint)
	}
	views, err := r.svc.IdleTargets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var view IdleView
	for _, v := range views {
		if v.Name == name {
			view = v
		}
	}
	if view.Name == "" {
		t.Fatal("the idle inventory does not hold the target")
	}
	if err := r.svc.IdleClose(ctx, view, time.Time{}); err != nil {
		t.Fatal(err)
	}
	if _, routed := r.svc.IngressLookup(label); routed {
		t.Fatal("the edge still routes the host of a target the idle loop closed")
	}
	inst, _, err := r.client.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if inst.Config[keyClosing] == "" || inst.Config[keyIngressRouted] != "" {
		t.Fatalf("the closing record: closing %q, routed %q; want closing and no route", inst.Config[keyClosing], inst.Config[keyIngressRouted])
	}
}

// A setPower that finds its target already there, while the project keeps
// an older request of a killed process for another power, not yet taken
// into memory by a pass, must outrank that request: the kill matrix with a
// warm pool found one answered "stopped" (already stopped), after which a
// pass restored the dead process's "running" and started the target.
func TestFakeAlreadyThereOutranksAStoredRequest(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
	o := fakeOwner("env-already")
	name := r.seedTarget(o, incus.InstanceStopped, controller.PowerStopped)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stored := pendingWrite{intent: Intent{Power: controller.PowerRunning, At: time.Now().Add(-30 * time.Minute), By: BySetPower}}
	if err := r.svc.storePending(ctx, name, stored); err != nil {
		t.Fatal(err)
	}
	if _, held := r.svc.pending.get(name); held {
		t.Fatal("the stored request is in memory already: the test tests nothing")
	}
	obs, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerStopped)
	if err != nil || obs.Power != controller.PowerStopped {
		t.Fatalf("setPower stopped answered %+v, %v", obs, err)
	}
	// The pass that would have restored the stored request, then its flush.
	r.svc.restorePending(ctx)
	r.svc.own.kick(name)
	r.awaitKeptCleared(name)
	inst := r.instance(name)
	if inst.Status != incus.InstanceStopped || inst.Config[keyPower] != string(controller.PowerStopped) {
		t.Fatalf("after the stored request's flush the target is %s with power %q recorded; want stopped", inst.Status, inst.Config[keyPower])
	}
}

// startInFlight seeds env's target stopped, its stop marked carried out,
// and sends it a dead process's wake: a start, not waited for, with
// nothing recorded.
func (r *fakeRig) startInFlight(ctx context.Context, env string) (controller.Owner, string, *incus.Operation) {
	r.t.Helper()
	o := fakeOwner(env)
	name := r.seedTarget(o, incus.InstanceStopped, controller.PowerStopped)
	op, err := r.client.UpdateInstanceState(ctx, name, incus.InstanceStatePut{Action: incus.ActionStart})
	if err != nil {
		r.t.Fatal(err)
	}
	return o, name, op
}

// A setPower that finds its target stopped as recorded while a start sent
// before it (a dead process's wake) is still under way in Incus must
// outrank that start: the kill matrix with a warm pool found one answered
// "stopped" (already there), after which the start landed, read as a use
// since the power-down, and the target ended running.
func TestFakeAPowerDownOutranksAWakeInFlight(t *testing.T) {
	fcfg := fakeDurations(seeded(t))
	fcfg.Durations.Start = 700 * time.Millisecond
	r := newFakeRig(t, fcfg, Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	o, name, op := r.startInFlight(ctx, "env-wake-in-flight")
	if cur, err := r.client.GetOperation(ctx, op.ID); err != nil || cur.Final() {
		t.Fatalf("the start ended before setPower was asked (%v): the test staged nothing", err)
	}
	obs, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerStopped)
	if err != nil {
		t.Fatalf("setPower stopped: %v", err)
	}
	// Either is the transitional observation: stopped while the start is
	// still under way, or running once it has landed and the recorded stop
	// is being carried out (a loaded machine's answer came after the start
	// ended). What must hold is where the target ends, below.
	if obs.Phase != controller.PhaseActive || (obs.Power != controller.PowerStopped && obs.Power != controller.PowerRunning) {
		t.Fatalf("setPower stopped answered %+v", obs)
	}
	if _, err := r.client.Wait(ctx, op); err != nil {
		t.Fatalf("the staged start: %v", err)
	}
	r.svc.own.kick(name)
	r.awaitFake("the target stopped again", 10*time.Second, func() bool {
		v, ok := r.fake.Instance(fakeProject, name)
		return ok && v.Status == incus.InstanceStopped && v.HeldBy == ""
	})
	inst := r.instance(name)
	if inst.Config[keyPower] != string(controller.PowerStopped) {
		t.Fatalf("the target is stopped with power %q recorded; want stopped", inst.Config[keyPower])
	}
}

// A setPower stopped answered "already there" (the stopped it asks is
// recorded and marked carried out, and no Incus task showed) is kept as
// this process's newest request. A dead process's start that its look at
// Incus's tasks missed lands afterwards (beside stress-ng, the start ended
// between setPower's read of the instance and that look): the record now
// reads as woken since, so the kept request must be written when looked
// at again, not taken for recorded already, and the target stopped.
func TestFakeAnAlreadyThereStopOutranksAStartItMissed(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
	o := fakeOwner("env-missed-start")
	name := r.seedTarget(o, incus.InstanceStopped, controller.PowerStopped)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	obs, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerStopped)
	if err != nil || obs.Power != controller.PowerStopped {
		t.Fatalf("setPower stopped of a stopped target: %+v, %v", obs, err)
	}
	if w := r.fake.Writes(); len(w) != 0 {
		t.Fatalf("answered with %d writes; the staging wants \"already there\", none", len(w))
	}
	// The dead process's start, landing only now.
	op, err := r.client.UpdateInstanceState(ctx, name, incus.InstanceStatePut{Action: incus.ActionStart})
	if err != nil {
		t.Fatal(err)
	}
	r.stoppedAnewAfter(ctx, op, name)
}

// A stop recorded anew over a dead process's start still in flight is not
// marked carried out on a read older than the start's end. Incus rewrites
// the instance's volatile keys as the start begins (its ETag changes) and
// shows it Stopped until the start ends: a read then, a start that ends
// before the tasks are listed, and a mark written on that read passes its
// ETag check and makes the start read as a use since the stop. A clean
// fresh-clone run met it on the real Incus
// (TestAPowerDownOutranksAWakeInFlight). Here the second listing of
// Incus's tasks (the mark's; the first is setPower's look for a wake in
// flight) is held until the start has ended.
func TestFakeAStopIsNotMarkedOnAReadOlderThanAStartsEnd(t *testing.T) {
	fcfg := fakeDurations(seeded(t))
	fcfg.Durations.Start = 600 * time.Millisecond
	r := newFakeRig(t, fcfg, Config{GracefulStop: time.Second, ReconcileInterval: time.Hour, NoCache: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	o, name, op := r.startInFlight(ctx, "env-start-ends-between")
	late := r.fake.Inject(incusfake.Fault{Kind: incusfake.Latency, Method: http.MethodGet, Path: "/1.0/operations",
		Skip: 1, Times: 1, Latency: 1200 * time.Millisecond})
	defer late.Remove()
	obs, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerStopped)
	if err != nil {
		t.Fatalf("setPower stopped: %v", err)
	}
	if late.Hits() == 0 {
		t.Fatalf("setPower listed Incus's tasks fewer than twice (answered %+v): the test staged nothing", obs)
	}
	t.Logf("answered %s %q while the start ran", obs.Power, obs.Message)
	r.stoppedAnewAfter(ctx, op, name)
}

// stoppedAnewAfter waits for a staged start (op) to end, then for name to
// be stopped again at rest with stopped recorded by a request of the last
// minute: the accepted stop outranked the start.
func (r *fakeRig) stoppedAnewAfter(ctx context.Context, op *incus.Operation, name string) {
	r.t.Helper()
	if _, err := r.client.Wait(ctx, op); err != nil {
		r.t.Fatalf("the staged start: %v", err)
	}
	r.awaitFake("stopped again, with the request recorded", 10*time.Second, func() bool {
		v, ok := r.fake.Instance(fakeProject, name)
		return ok && v.Status == incus.InstanceStopped && v.HeldBy == "" && v.Config[keyPower] == string(controller.PowerStopped) &&
			intentOf(&incus.Instance{Config: v.Config}).At.After(time.Now().Add(-time.Minute))
	})
}

// A create answered provisioning, then the provider restarted with the
// template deprecated: the owner's create asked again must observe its
// target, not meet the creation policy, although Incus has not recorded
// the instance yet (a loaded Incus records it only once its create task
// runs; here the record's read is refused once as not found while the
// create task is listed). A fresh clone's run beside stress-ng met it.
func TestFakeARepeatedCreateOutranksADeprecationWhileIncusCreates(t *testing.T) {
	fcfg := fakeDurations(seeded(t))
	fcfg.Durations.Create = 800 * time.Millisecond
	r := newFakeRig(t, fcfg, Config{})
	o := fakeOwner("env-deprecated-meanwhile")
	name := r.expect(o)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := r.svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "t1"}); err != nil {
		t.Fatal(err)
	}
	next, err := New(r.client, fakeCatalogOf(t, true), nopDialer{}, relays.New(0), zaptest.NewLogger(t), Config{Replica: "r-fake-2"})
	if err != nil {
		t.Fatal(err)
	}
	unrecorded := r.fake.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: "GET", Path: "/1.0/instances/" + name, Times: 1,
		Status: 404, Message: "Instance not found"})
	defer unrecorded.Remove()
	obs, err := next.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "t1"})
	if unrecorded.Hits() == 0 {
		t.Fatal("the new process never read the instance: the test staged nothing")
	}
	if err != nil || obs.Phase != controller.PhaseProvisioning && obs.Phase != controller.PhaseActive {
		t.Fatalf("the repeated create after deprecation answered %+v, %v; want the owner's target observed", obs, err)
	}
}

// A setPower answered "already there" while a dead process's older write
// of another power is still on its way into Incus (which checks a write's
// ETag before it applies it): once that write lands, this accepted request
// must win. The kill matrix with a warm pool met one: a paused answered
// "already paused", then a cut running of the killed process landed, and
// the target ended running.
func TestFakeAlreadyThereOutranksAnOlderWriteLandingLater(t *testing.T) {
	fcfg := fakeDurations(seeded(t))
	fcfg.ApplyDelay = 400 * time.Millisecond
	r := newFakeRig(t, fcfg, Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
	o := fakeOwner("env-late-write")
	name := r.seedTarget(o, incus.InstanceFrozen, controller.PowerPaused)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, etag, err := r.client.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	// The dead process's request for running, older than the setPower.
	late := make(chan error, 1)
	older := Intent{Power: controller.PowerRunning, At: time.Now().Add(-time.Second), By: BySetPower}
	go func() { late <- r.client.PatchInstanceConfigIf(ctx, name, older.config(), etag) }()
	time.Sleep(50 * time.Millisecond) // past its ETag check, not yet applied
	obs, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerPaused)
	if err != nil || obs.Power != controller.PowerPaused {
		t.Fatalf("setPower paused answered %+v, %v", obs, err)
	}
	if err := <-late; err != nil {
		t.Fatalf("the older write: %v", err)
	}
	if got := r.instance(name).Config[keyPower]; got != string(controller.PowerRunning) {
		t.Fatalf("the older write did not land after the answer (power %q recorded): the test staged nothing", got)
	}
	r.awaitFake("the target paused with paused recorded", 15*time.Second, func() bool {
		v, ok := r.fake.Instance(fakeProject, name)
		return ok && v.Status == incus.InstanceFrozen && v.HeldBy == "" && v.Config[keyPower] == string(controller.PowerPaused)
	})
}

// A process started after a kill does not relay a use of a running target
// before it has read the power requests the dead process kept on the
// project: such a request is older than the use, and once restored it would
// be carried out over it (the kill matrix: a dial relayed 1.4 s into a
// fresh process with nothing recorded, its target paused afterwards by the
// kept request). Staged: a paused request kept on the project, the new
// process's first read of the project held; the use's read of its running
// target waits for it, then finds the request in sight, and its wake's
// record outranks it.
func TestFakeAUseWaitsForTheKeptRequestsOfADeadProcess(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{ReconcileInterval: time.Hour})
	o := fakeOwner("env-kept-unread")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kept := pendingWrite{intent: Intent{Power: controller.PowerPaused, At: time.Now().Add(-time.Second), By: BySetPower}}
	if err := r.svc.storePending(ctx, name, kept); err != nil {
		t.Fatal(err)
	}
	held := r.fake.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: http.MethodGet, Path: "/1.0/projects/*", Times: 1})
	defer held.Release()
	next, err := New(r.client, fakeCatalog(t), nopDialer{}, relays.New(0), zaptest.NewLogger(t), Config{Replica: "r-fake-2", ReconcileInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	nctx, ncancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = next.Run(nctx) }()
	defer func() { ncancel(); <-ran }()
	select {
	case <-held.Hit():
	case <-ctx.Done():
		t.Fatal("the new process never read the project: the test staged nothing")
	}

	early, ecancel := context.WithTimeout(ctx, 300*time.Millisecond)
	rt, err := next.ResolveRoute(early, o, name)
	ecancel()
	if err == nil {
		t.Fatalf("a use resolved its running target (pending power-down %v) before the kept requests were read: relayed now, it is lost to the kept paused request",
			next.PowerDownPending(rt, time.Now()))
	}
	held.Release()
	arrived := time.Now()
	rt, err = next.ResolveRoute(ctx, o, name)
	if err != nil {
		t.Fatalf("once the project was read: %v", err)
	}
	if !next.PowerDownPending(rt, arrived) {
		t.Fatal("the kept paused request, older than the use, is not in sight: the use would be relayed with nothing recorded")
	}
	if _, err := next.Wake(ctx, rt, arrived, nil); err != nil {
		t.Fatalf("the use's wake: %v", err)
	}
	next.own.kick(name)
	r.awaitKeptCleared(name)
	if inst := r.instance(name); inst.Status != incus.InstanceRunning || inst.Config[keyPower] != string(controller.PowerRunning) {
		t.Fatalf("after the kept request's flush the target is %s with power %q recorded; want running\n%s", inst.Status, inst.Config[keyPower], r.history(name))
	}
}

// awaitKeptCleared waits until the project no longer keeps a power request
// for name (see pendingstore.go).
func (r *fakeRig) awaitKeptCleared(name string) {
	r.t.Helper()
	r.awaitFake("the project's kept request cleared", 10*time.Second, func() bool {
		cfg, _, ok := r.fake.Project(fakeProject)
		if !ok {
			return false
		}
		_, present, _ := pendingIn(cfg, name)
		return !present
	})
}
