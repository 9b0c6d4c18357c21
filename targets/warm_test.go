package targets

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/testrig"
	"github.com/lightspeed-dev/incus-provider/templates"
)

func TestWarmNamesAreNoOwnersName(t *testing.T) {
	for _, id := range []string{"t1", "dev-small", strings.Repeat("x", 255), ""} {
		for slot := range templates.MaxWarm {
			n := warmName(id, slot)
			if looksLikeTargetID(n) || strings.HasPrefix(n, namePrefix) || !isWarmName(n) || len(n) > 63 {
				t.Fatalf("warm name %q could be taken for a target's, or is no valid Incus name", n)
			}
		}
	}
	// Name always answers the ls- pattern, so it never starts with warm-.
	for i := range 1000 {
		if n := Name(owner(fmt.Sprint(i))); isWarmName(n) || !looksLikeTargetID(n) {
			t.Fatalf("Name gave %q", n)
		}
	}
}

func TestUnfinishedHandoutBelongsToItsNamesOwner(t *testing.T) {
	o := owner("a")
	inst := &incus.Instance{Name: Name(o), Config: map[string]string{keyWarm: "t1"}}
	if !unfinishedHandout(inst) || checkOwned(inst, o) != nil {
		t.Fatal("a hand-out at the owner's name without metadata is not the owner's")
	}
	if checkOwned(inst, owner("b")) == nil {
		t.Fatal("another owner may reach an unfinished hand-out")
	}
	// Another owner's metadata (two claims that both landed) does not make
	// it that owner's target.
	other := owner("b")
	inst.Config[keySchema], inst.Config[keyUniverse], inst.Config[keyEnvironment] = schemaVersion, other.UniverseID, other.EnvironmentID
	if _, ok := ownerOf(inst); ok || !unfinishedHandout(inst) || checkOwned(inst, other) == nil || checkOwned(inst, o) != nil {
		t.Fatal("an instance at a's name carrying b's metadata is not a's unfinished hand-out")
	}
	if unfinishedHandout(&incus.Instance{Name: warmName("t1", 0), Config: map[string]string{keyWarm: "t1"}}) {
		t.Fatal("a warm instance is taken for a hand-out")
	}
}

// warmHarness is a harness whose catalog's template w keeps a pool.
func warmHarness(t *testing.T, warm int) *harness {
	t.Helper()
	client := incustest.Client(t)
	image := incustest.Image(t)
	return &harness{t: t, client: client, catalog: warmCatalog(t, client, image, warm), dialer: testrig.GuestDialer(t, client)}
}

func warmCatalog(t testing.TB, client *incus.Client, image string, warm int) *templates.Catalog {
	return testrig.Catalog(t, client, image, fmt.Sprintf(`templates:
  - templateId: w
    displayName: warm guest
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    warm: %d
`, warm))
}

// startWarm runs a service with warm metrics on reg and the given hook.
func (h *harness) startWarm(catalog *templates.Catalog, reg *prometheus.Registry, hook func(string) bool) (*Service, func()) {
	return h.startWarmWith(catalog, reg, hook, 3*time.Second)
}

// startWarmWith is startWarm with the age at which a claim is stale.
func (h *harness) startWarmWith(catalog *templates.Catalog, reg *prometheus.Registry, hook func(string) bool, stale time.Duration) (*Service, func()) {
	cfg := Config{GracefulStop: 2 * time.Second, ReconcileInterval: time.Second, WarmStale: stale}
	if reg != nil {
		cfg.WarmMetrics = NewWarmMetrics(reg)
	}
	svc := mustNew(h.t, h.client, catalog, h.dialer, zaptest.NewLogger(h.t), cfg)
	svc.warmHook = hook
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = svc.Run(ctx)
	}()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	h.t.Cleanup(stop)
	return svc, stop
}

// warmReady lists the ready, unclaimed warm instances.
func (h *harness) warmReady() []incus.Instance {
	var out []incus.Instance
	for _, inst := range h.instances() {
		if isWarmName(inst.Name) && inst.Config[keyWarmReady] != "" && inst.Config[keyWarmClaim] == "" {
			out = append(out, inst)
		}
	}
	return out
}

// awaitPool waits until the pool holds n ready instances and nothing
// claimed.
func (h *harness) awaitPool(t *testing.T, n int) []incus.Instance {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ready := h.warmReady()
		claimed := 0
		for _, inst := range h.instances() {
			if isWarmName(inst.Name) && inst.Config[keyWarmClaim] != "" {
				claimed++
			}
		}
		if len(ready) == n && claimed == 0 {
			return ready
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool never held %d ready warm instances (ready %d, claimed %d)", n, len(ready), claimed)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// createUntilID sends target/create until it answers an id, as the
// runtime does.
func createUntilID(t *testing.T, svc *Service, p controller.CreateParams) controller.Observation {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		o, err := svc.CreateTarget(context.Background(), p)
		if err == nil && o.TargetID != "" {
			return o
		}
		if time.Now().After(deadline) {
			t.Errorf("create of %v never answered an id: %+v, %v", p.Owner, o, err)
			return o
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// checkOnePerOwner fails unless every owner's name holds one instance with
// that owner's metadata and no warm keys, and every other instance is a
// warm one: no orphan, no claimed leftover.
func (h *harness) checkOnePerOwner(t *testing.T, owners []controller.Owner) {
	t.Helper()
	want := map[string]controller.Owner{}
	for _, o := range owners {
		want[Name(o)] = o
	}
	seen := map[string]int{}
	for _, inst := range h.instances() {
		if isWarmName(inst.Name) {
			if inst.Config[keyWarmClaim] != "" || inst.Config[keySchema] != "" {
				t.Errorf("warm instance %s carries a claim or owner metadata: %v", inst.Name, inst.Config)
			}
			continue
		}
		o, ok := want[inst.Name]
		if !ok {
			t.Errorf("instance %s is no owner's (orphan)", inst.Name)
			continue
		}
		seen[inst.Name]++
		if got, ok := ownerOf(&inst); !ok || got != o || poolKeysOn(&inst) || !oneOf(inst.Config[keyWarmClaim], "", inst.Name) {
			t.Errorf("instance %s: owner %v (%v), config %v; want %v, no pool keys, no other's claim", inst.Name, got, ok, inst.Config, o)
		}
	}
	for n, o := range want {
		if seen[n] != 1 {
			t.Errorf("owner %v has %d instances, want 1", o, seen[n])
		}
	}
}

func TestWarmHandoutBecomesActiveAndThePoolRefills(t *testing.T) {
	h := warmHarness(t, 2)
	reg := prometheus.NewRegistry()
	svc, _ := h.startWarm(h.catalog, reg, nil)
	ready := h.awaitPool(t, 2)
	uuids := map[string]bool{}
	for _, w := range ready {
		uuids[w.Config["volatile.uuid"]] = true
	}
	ctx := ctxT(t)
	o := owner("warm-hit")
	obs, err := svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "w", DisplayName: "warm one"})
	if err != nil || obs.TargetID != Name(o) {
		t.Fatalf("create: %+v, %v", obs, err)
	}
	t.Logf("the create answered %s/%s", obs.Phase, obs.Power)
	until(t, "active", func() (controller.Observation, error) { return svc.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	inst, _, err := h.client.GetInstance(ctx, Name(o))
	if err != nil {
		t.Fatal(err)
	}
	if !uuids[inst.Config["volatile.uuid"]] {
		t.Fatal("the target is not one of the warm instances")
	}
	if got, ok := ownerOf(inst); !ok || got != o || poolKeysOn(inst) || inst.Config[keyWarmClaim] != Name(o) || inst.Config[keyDisplayName] != "warm one" || inst.Config[keyTemplate] != "w" {
		t.Fatalf("the handed-out target's config: %v", inst.Config)
	}
	if hits := testutil.ToFloat64(svc.cfg.WarmMetrics.handouts.WithLabelValues("w", "hit")); hits != 1 {
		t.Fatalf("warm hits: %v, want 1", hits)
	}
	h.awaitPool(t, 2)
	h.checkOnePerOwner(t, []controller.Owner{o})
	// The gauge follows the ready mark awaitPool saw, in the refill's
	// own goroutine: wait a bounded time for it.
	for deadline := time.Now().Add(5 * time.Second); testutil.ToFloat64(svc.cfg.WarmMetrics.size.WithLabelValues("w")) != 2 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if n := testutil.ToFloat64(svc.cfg.WarmMetrics.size.WithLabelValues("w")); n != 2 {
		t.Errorf("the pool size gauge says %v after the refill, want 2", n)
	}
	// Two owners at once, a pool of two: each is handed one.
	pair := []controller.Owner{owner("warm-pair-0"), owner("warm-pair-1")}
	var wg sync.WaitGroup
	for _, po := range pair {
		wg.Go(func() { createUntilID(t, svc, controller.CreateParams{Owner: po, TemplateID: "w"}) })
	}
	wg.Wait()
	if hits := testutil.ToFloat64(svc.cfg.WarmMetrics.handouts.WithLabelValues("w", "hit")); hits != 3 {
		t.Errorf("warm hits after two owners at once: %v, want 3", hits)
	}
	h.awaitPool(t, 2)
	h.checkOnePerOwner(t, append(pair, o))
	// The pool is not counted as targets.
	list, err := svc.IdleTargets(ctx)
	if err != nil || len(list) != 3 {
		t.Fatalf("idle inventory: %d targets (%v), want the three owners' alone", len(list), err)
	}
}

// Many owners race, through two replicas, for a pool of one: exactly one
// instance per owner, every create answered, nothing orphaned; and a
// hand-out racing a plain create of the same owner on another replica
// leaves one instance too.
func TestWarmRacesLeaveOneInstancePerOwner(t *testing.T) {
	h := warmHarness(t, 1)
	a, _ := h.startWarm(h.catalog, prometheus.NewRegistry(), nil)
	b, _ := h.startWarm(h.catalog, prometheus.NewRegistry(), nil)
	h.awaitPool(t, 1)
	hits := func() float64 {
		return testutil.ToFloat64(a.cfg.WarmMetrics.handouts.WithLabelValues("w", "hit")) +
			testutil.ToFloat64(b.cfg.WarmMetrics.handouts.WithLabelValues("w", "hit"))
	}
	var owners []controller.Owner
	for i := range 2 {
		owners = append(owners, owner(fmt.Sprintf("race2-%d", i)))
	}
	for i := range 24 {
		owners = append(owners, owner(fmt.Sprintf("race24-%d", i)))
	}
	run := func(list []controller.Owner) {
		var wg sync.WaitGroup
		for i, o := range list {
			svc := a
			if i%2 == 1 {
				svc = b
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				createUntilID(t, svc, controller.CreateParams{Owner: o, TemplateID: "w"})
			}()
		}
		wg.Wait()
	}
	// A create hands out what its process knows is ready, which its pool
	// survey learns after Incus shows it: the races begin once one of the
	// two knows, or under load they could all miss for no fault of the
	// hand-out.
	known := func() {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
			if testutil.ToFloat64(a.cfg.WarmMetrics.size.WithLabelValues("w"))+
				testutil.ToFloat64(b.cfg.WarmMetrics.size.WithLabelValues("w")) >= 1 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("neither replica learnt of the ready warm instance in 2 minutes")
			}
		}
	}
	known()
	run(owners[:2])
	if n := hits(); n != 1 {
		t.Errorf("two creates for a pool of one: %v hits, want 1", n)
	}
	h.awaitPool(t, 1)
	known()
	before := hits()
	run(owners[2:])
	if n := hits() - before; n < 1 {
		t.Errorf("24 creates for a pool of one: %v hits, want at least 1", n)
	}
	t.Logf("24 creates for a pool of one (refilled as they ran): %v hits", hits()-before)
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, owners)

	// The same owner, a plain create on a replica whose catalog keeps no
	// pool (so it stages nothing), then a hand-out on another while the
	// create's operation is on the name: the hand-out must hold its rename
	// back (renameClaimed) and answer the created target. Started at
	// once instead, a rename and a create of one name can both be inside
	// Incus 6.0.4 before either shows, which wrecks the name there (a
	// volume and no instance, every later create refused) in about a
	// third of such pairs: Incus's defect, which no ordering from outside
	// closes; issue 27's hand-out without a rename removes the pair.
	plain := mustNew(t, h.client, warmCatalog(t, h.client, incustest.Image(t), 0), h.dialer, zaptest.NewLogger(t), Config{})
	same := owner("same-owner")
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		createUntilID(t, plain, controller.CreateParams{Owner: same, TemplateID: "w"})
	}()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		op, err := plain.operationOn(ctx, Name(same))
		inst, _, gerr := h.client.GetInstance(ctx, Name(same))
		cancel()
		if err == nil && op != nil || gerr == nil && inst != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the plain create never showed in Incus")
		}
	}
	createUntilID(t, a, controller.CreateParams{Owner: same, TemplateID: "w"})
	wg.Wait()
	owners = append(owners, same)
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, owners)
	ctx := ctxT(t)
	for _, o := range owners {
		until(t, "active", func() (controller.Observation, error) { return a.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	}
}

// awaitNoTasks waits, within d, until Incus runs no operation in the
// harness's project.
func (h *harness) awaitNoTasks(d time.Duration) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		ops, err := h.client.ListOperations(ctx)
		running := 0
		for _, op := range ops {
			if !op.Final() {
				running++
			}
		}
		if err == nil && running == 0 {
			return
		}
		select {
		case <-ctx.Done():
			h.t.Fatalf("Incus still runs %d operations after %s (%v)", running, d, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// A provider that stops mid-hand-out, then a fresh one on the project: the
// owner ends with exactly one instance, whichever step the first stopped at.
func TestWarmCrashMidHandout(t *testing.T) {
	// rename-sent: the process stops once Incus took the rename, before it
	// waited for it, so no follower of this process starts the target.
	for _, stage := range []string{"claimed", "rename-sent", "renamed"} {
		t.Run(stage, func(t *testing.T) {
			h := warmHarness(t, 1)
			svc, stop := h.startWarm(h.catalog, nil, func(s string) bool { return s == stage })
			h.awaitPool(t, 1)
			o := owner("crash-" + stage)
			p := controller.CreateParams{Owner: o, TemplateID: "w"}
			if _, err := svc.CreateTarget(context.Background(), p); err == nil {
				t.Fatal("the hook did not stop the hand-out")
			}
			stop()
			// Read once the rename the crash left (if any) has ended: a
			// listing taken while Incus (LXD under CI's load) renames the
			// instance can show it without its config, and the claim with it.
			h.awaitNoTasks(30 * time.Second)
			warm, at := 0, 0
			for _, inst := range h.instances() {
				switch {
				case isWarmName(inst.Name):
					warm++
				case inst.Name == Name(o):
					at++
				}
			}
			if warm+at != 1 {
				t.Fatalf("after the crash: %d warm instances and %d at the owner's name, want exactly one of the two", warm, at)
			}
			// The instance the crash left claimed: the next process
			// finishes its hand-out on its own, since the runtime follows
			// a create's answer with gets only, and the owner's retried
			// create finds it (never sending a create of its own, nor
			// handing out another, to a name a claimed instance may
			// still be renamed to).
			var claimedUUID string
			for _, inst := range h.instances() {
				// Claimed, or renamed already (the claim stays on it).
				if (isWarmName(inst.Name) || inst.Name == Name(o)) && inst.Config[keyWarmClaim] == Name(o) {
					claimedUUID = inst.Config["volatile.uuid"]
				}
			}
			if claimedUUID == "" {
				t.Fatal("the crash left no claimed instance: the test tested nothing")
			}
			// Claims stay young for the test: under load the rename the
			// crash left can still be running seconds later, and the
			// harness's 3 s would sweep its claim first.
			fresh, _ := h.startWarmWith(h.catalog, nil, nil, 30*time.Second)
			ctx := ctxT(t)
			// Gets alone: provisioning (never notFound) until active.
			until(t, "active on gets alone", func() (controller.Observation, error) {
				o, err := fresh.GetTarget(ctx, controller.TargetRef{Owner: o})
				if err != nil && kindOf(err) == jsonrpc.KindNotFound {
					t.Fatalf("a get after the crash answered %v: the hand-out's create was answered, so the target is owed", err)
				}
				return o, err
			}, isActive)
			createUntilID(t, fresh, p)
			inst, _, err := h.client.GetInstance(ctxT(t), Name(o))
			if err != nil {
				t.Fatal(err)
			}
			if got := inst.Config["volatile.uuid"]; got != claimedUUID {
				t.Fatalf("the owner's target (uuid %q) is not the instance its crashed hand-out claimed (uuid %q)", got, claimedUUID)
			}
			h.awaitPool(t, 1)
			h.checkOnePerOwner(t, []controller.Owner{o})
		})
	}
}

// A hand-out that stopped between its rename and the owner's metadata (as
// two claims landing at once can leave it): the owner's get sees it, the
// owner's create finishes it, and another owner never reaches it.
func TestWarmUnfinishedHandoutIsFinishedByTheOwner(t *testing.T) {
	h := warmHarness(t, 1)
	svc, _ := h.startWarm(h.catalog, nil, nil)
	ready := h.awaitPool(t, 1)
	ctx := ctxT(t)
	o := owner("unfinished")
	// Another owner's claim, then a rename to o's name: what a lost race
	// of two claims leaves.
	other := owner("someone-else")
	if err := h.client.PatchInstanceConfig(ctx, ready[0].Name, map[string]string{keySchema: schemaVersion,
		keyUniverse: other.UniverseID, keyEnvironment: other.EnvironmentID, keyWarmClaim: Name(other)}); err != nil {
		t.Fatal(err)
	}
	op, err := h.client.RenameInstance(ctx, ready[0].Name, Name(o))
	if err == nil {
		_, err = h.client.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.GetTarget(ctx, controller.TargetRef{Owner: other}); kindOf(err) != "notFound" {
		t.Fatalf("the other owner's get: %v, want notFound", err)
	}
	if got, err := svc.GetTarget(ctx, controller.TargetRef{Owner: o}); err != nil || got.Phase != controller.PhaseProvisioning {
		t.Fatalf("the owner's get of its unfinished hand-out: %+v, %v; want provisioning", got, err)
	}
	time.Sleep(3 * time.Second) // reconcile passes: never taken for an orphan, never started
	if inst, _, err := h.client.GetInstance(ctx, Name(o)); err != nil || inst.Status != incus.InstanceStopped {
		t.Fatalf("the unfinished hand-out was touched: %v", err)
	}
	createUntilID(t, svc, controller.CreateParams{Owner: o, TemplateID: "w"})
	until(t, "active", func() (controller.Observation, error) { return svc.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, []controller.Owner{o})
	// And a close of an unfinished hand-out deletes it.
	ready = h.awaitPool(t, 1)
	c := owner("unfinished-closed")
	op, err = h.client.RenameInstance(ctx, ready[0].Name, Name(c))
	if err == nil {
		_, err = h.client.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	until(t, "closed", func() (controller.Observation, error) { return svc.CloseTarget(ctx, controller.TargetRef{Owner: c}) },
		func(o controller.Observation, err error) bool { return err == nil && o.Phase == controller.PhaseClosed })
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, []controller.Owner{o})
}

// What an owner wrote in its target is on no warm instance after its
// close: warm instances are fresh creates, never recycled targets.
func TestWarmInstancesNeverCarryAnOwnersData(t *testing.T) {
	h := warmHarness(t, 2)
	svc, _ := h.startWarm(h.catalog, nil, nil)
	h.awaitPool(t, 2)
	ctx := ctxT(t)
	o := owner("writer")
	ref := controller.TargetRef{Owner: o}
	createUntilID(t, svc, controller.CreateParams{Owner: o, TemplateID: "w"})
	until(t, "active", func() (controller.Observation, error) { return svc.GetTarget(ctx, ref) }, isActive)
	target, _, err := h.client.GetInstance(ctx, Name(o))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := h.client.ExecStream(ctx, Name(o), []string{"sh", "-c", "echo owner-secret > /root/owner-file && echo written"})
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(conn)
	_ = conn.Close()
	if !strings.Contains(string(out), "written") {
		t.Fatalf("writing the owner's file: %q", out)
	}
	until(t, "closed", func() (controller.Observation, error) { return svc.CloseTarget(ctx, ref) },
		func(o controller.Observation, err error) bool { return err == nil && o.Phase == controller.PhaseClosed })
	for _, w := range h.awaitPool(t, 2) {
		if w.Config["volatile.uuid"] == target.Config["volatile.uuid"] {
			t.Fatalf("warm instance %s is the closed target", w.Name)
		}
		// The dir pool "default" of the server whose socket the tests use
		// (/var/lib/incus or /var/lib/lxd).
		root := filepath.Join(filepath.Dir(incustest.Socket()), "storage-pools/default/containers", h.client.Project()+"_"+w.Name, "rootfs")
		if _, err := os.Stat(root); err != nil {
			t.Fatalf("cannot read warm instance %s's root filesystem on the dir pool: %v", w.Name, err)
		}
		if _, err := os.Stat(filepath.Join(root, "root/owner-file")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("warm instance %s holds the owner's file (%v)", w.Name, err)
		}
		// Never started: no daemon has run in it, so none can have made
		// an identity there (README, "What a guest image must not carry").
		// Incus drops the first start's template mark at that start.
		if w.Config["volatile.apply_template"] != "create" || w.Status != incus.InstanceStopped {
			t.Fatalf("warm instance %s has been started: %s, volatile.apply_template %q", w.Name, w.Status, w.Config["volatile.apply_template"])
		}
	}
	if target.Config["volatile.apply_template"] != "" {
		t.Fatalf("the handed-out target was never started: volatile.apply_template %q", target.Config["volatile.apply_template"])
	}
}

func poolKeysOn(inst *incus.Instance) bool {
	return recordOf(inst.Config, fPool).has(fPool)
}

func oneOf(s string, among ...string) bool {
	for _, a := range among {
		if s == a {
			return true
		}
	}
	return false
}

// A reload that changes the template's recipe rebuilds its pool; one that
// drops the pool empties it.
func TestWarmPoolFollowsTheCatalog(t *testing.T) {
	h := warmHarness(t, 1)
	svc, _ := h.startWarm(h.catalog, nil, nil)
	old := h.awaitPool(t, 1)[0]
	changed := testrig.Catalog(t, h.client, incustest.Image(t), `templates:
  - templateId: w
    displayName: warm guest
    powerStates: [running, paused, stopped]
    resources: {vcpus: 1}
    imageAlias: {{image}}
    warm: 1
`)
	svc.SetCatalog(changed)
	deadline := time.Now().Add(time.Minute)
	for {
		ready := h.warmReady()
		if len(ready) == 1 && ready[0].Config["volatile.uuid"] != old.Config["volatile.uuid"] && ready[0].Config["limits.cpu"] == "1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool was not rebuilt for the new recipe: %d ready", len(ready))
		}
		time.Sleep(200 * time.Millisecond)
	}
	svc.SetCatalog(warmCatalog(t, h.client, incustest.Image(t), 0))
	for deadline = time.Now().Add(time.Minute); len(h.instances()) != 0; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a catalog without a pool left %d instances", len(h.instances()))
		}
	}
}

// A close for an owner whose warm hand-out is still under way (claimed,
// not yet renamed to the owner's name: another replica's, or a process
// that stopped between the two) is not answered closed: the rename would
// then land a target no one closes. It is refused while the claim is
// fresh; once the rename lands, the close is recorded and carried out.
func TestWarmCloseDuringAHandout(t *testing.T) {
	h := warmHarness(t, 1)
	svc, stop := h.startWarm(h.catalog, nil, func(s string) bool { return s == "claimed" })
	h.awaitPool(t, 1)
	o := owner("close-handout")
	name := Name(o)
	ctx := ctxT(t)
	if _, err := svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "w"}); err == nil {
		t.Fatal("the hook did not stop the hand-out")
	}
	stop()
	var wn string
	for _, inst := range h.instances() {
		if isWarmName(inst.Name) && inst.Config[keyWarmClaim] == name {
			wn = inst.Name
		}
	}
	if wn == "" {
		t.Fatal("no warm instance is claimed for the owner: the test tested nothing")
	}
	// The claim stays fresh for the whole test. The next process finishes
	// the hand-out (a create was answered for it); the runtime's close,
	// asked at once and until closed, is never answered closed while the
	// claim could still land a target.
	fresh, _ := h.startWarmWith(h.catalog, nil, nil, time.Hour)
	deadline := time.Now().Add(90 * time.Second)
	for {
		got, err := fresh.CloseTarget(ctx, controller.TargetRef{Owner: o})
		if err == nil && got.Phase == controller.PhaseClosed {
			for _, inst := range h.instances() {
				if inst.Name == name || isWarmName(inst.Name) && inst.Config[keyWarmClaim] == name {
					t.Fatalf("the close answered closed while %s (claim %q) was still there", inst.Name, inst.Config[keyWarmClaim])
				}
			}
			break
		}
		if err != nil && kindOf(err) != jsonrpc.KindUnavailable {
			t.Fatalf("a close during the hand-out answered %v, want closing, closed or unavailable", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the owner's close never answered closed: %+v %v", got, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, _, err := h.client.GetInstance(ctx, name); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("the owner's name still holds an instance after closed: %v", err)
	}
}

// A spare that a survey deletes (its recipe changed, say, on another
// replica during a rolling change of the catalog) is first retired, and
// deleted only after the grace: a claimant that read it before the retire
// is refused, creates the owner's target another way, and nothing is
// deleted under a hand-out's rename.
func TestWarmRetireRacesAClaim(t *testing.T) {
	h := warmHarness(t, 1)
	read, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	a, _ := h.startWarm(h.catalog, nil, func(step string) bool {
		if step == "read" {
			once.Do(func() {
				close(read)
				<-release
			})
		}
		return false
	})
	spare := h.awaitPool(t, 1)[0]
	o := owner("retire-race")
	answered := make(chan controller.Observation, 1)
	go func() { answered <- createUntilID(t, a, controller.CreateParams{Owner: o, TemplateID: "w"}) }()
	select {
	case <-read:
	case <-time.After(time.Minute):
		close(release)
		t.Fatal("the hand-out never read the spare")
	}
	// Another replica whose catalog builds w another way retires a's spare.
	changed := testrig.Catalog(t, h.client, incustest.Image(t), `templates:
  - templateId: w
    displayName: warm guest
    powerStates: [running, paused, stopped]
    resources: {vcpus: 1}
    imageAlias: {{image}}
    warm: 1
`)
	_, stopB := h.startWarm(changed, nil, nil)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		w, _, err := h.client.GetInstance(ctxT(t), spare.Name)
		if err == nil && w.Config[keyWarmClaim] == warmRetire {
			break
		}
		if time.Now().After(deadline) {
			close(release)
			t.Fatalf("the other replica never retired the spare: %v", err)
		}
	}
	stopB()
	close(release)
	got := <-answered
	if got.TargetID != Name(o) {
		t.Fatalf("the create answered %+v", got)
	}
	ctx := ctxT(t)
	until(t, "active", func() (controller.Observation, error) { return a.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	target, _, err := h.client.GetInstance(ctx, Name(o))
	if err != nil {
		t.Fatal(err)
	}
	if target.Config["volatile.uuid"] == spare.Config["volatile.uuid"] {
		t.Fatal("the retired spare was handed out")
	}
	// The retired spare goes after the grace, and a's pool refills.
	h.awaitPool(t, 1)
	for _, inst := range h.instances() {
		if inst.Config["volatile.uuid"] == spare.Config["volatile.uuid"] {
			t.Fatalf("the retired spare %s is still there", inst.Name)
		}
	}
	h.checkOnePerOwner(t, []controller.Owner{o})
}

// A hand-out whose rename Incus is still carrying out when the create's
// budget runs out (40 at once take seconds) answers provisioning, and the
// target is started the moment the rename lands: not at the reconciler's
// next pass, and not only once the runtime asks again.
func TestWarmRenameOutlivingTheAnswerStartsTheTarget(t *testing.T) {
	h := warmHarness(t, 1)
	cfg := Config{GracefulStop: 2 * time.Second, ReconcileInterval: 2 * time.Minute,
		AnswerWithin: 200 * time.Millisecond, MethodBudget: time.Second}
	svc := mustNew(t, h.client, h.catalog, h.dialer, zaptest.NewLogger(t), cfg)
	svc.warmHook = func(step string) bool {
		if step == "rename-sent" {
			time.Sleep(1500 * time.Millisecond) // past the method's budget
		}
		return false
	}
	runUntilCleanup(t, svc)
	h.awaitPool(t, 1)
	o := owner("rename-outlives")
	got, err := svc.CreateTarget(ctxT(t), controller.CreateParams{Owner: o, TemplateID: "w"})
	if err != nil {
		t.Fatal(err)
	}
	if got.Phase != controller.PhaseProvisioning || got.TargetID != "" {
		t.Fatalf("a create whose rename outlived it answered %+v, want provisioning without an id", got)
	}
	// Well inside the 2-minute reconcile interval, with gets only (a get
	// never starts anything).
	deadline := time.Now().Add(30 * time.Second)
	for {
		o2, err := svc.GetTarget(ctxT(t), controller.TargetRef{Owner: o})
		if isActive(o2, err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the handed-out target was not started after its rename landed: %+v, %v", o2, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.checkOnePerOwner(t, []controller.Owner{o})
}

func TestStagingNamesAreNoSlots(t *testing.T) {
	for _, id := range []string{"t1", "dev-small", ""} {
		a, b := Name(owner("a")), Name(owner("b"))
		if n := stagingName(id, a); !isStagingName(n) || !isWarmName(n) || !stagedFor(n, a) || stagedFor(n, b) || len(n) > 63 {
			t.Fatalf("staging name %q for %s: not taken for one, or for another owner's", n, a)
		}
		for slot := range templates.MaxWarm {
			if n := warmName(id, slot); isStagingName(n) {
				t.Fatalf("slot %q taken for a staging name", n)
			}
		}
	}
	if isStagingName(Name(owner("a"))) {
		t.Fatal("an owner's name taken for a staging name")
	}
}
