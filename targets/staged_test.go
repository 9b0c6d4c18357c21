package targets

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// A create that finds the pool empty, while the catalog keeps one, builds
// the owner's instance under a staging name and renames it: the instance
// at the owner's name carries the claim of that rename, and no create was
// ever sent to the owner's name.
func TestStagedCreateWhenThePoolIsEmpty(t *testing.T) {
	h := warmHarness(t, 1)
	svc, _ := h.startWarm(h.catalog, prometheus.NewRegistry(), nil)
	ready := h.awaitPool(t, 1)
	ctx := ctxT(t)
	hit, miss := owner("staged-hit"), owner("staged-miss")
	createUntilID(t, svc, controller.CreateParams{Owner: hit, TemplateID: "w"})
	// The refill waits a second after a hand-out: this create misses.
	createUntilID(t, svc, controller.CreateParams{Owner: miss, TemplateID: "w"})
	for _, o := range []controller.Owner{hit, miss} {
		until(t, "active", func() (controller.Observation, error) { return svc.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	}
	inst, _, err := h.client.GetInstance(ctx, Name(miss))
	if err != nil {
		t.Fatal(err)
	}
	if inst.Config[keyWarmClaim] != Name(miss) {
		t.Fatalf("the missed create's instance carries claim %q, want %q: it was not created under a staging name", inst.Config[keyWarmClaim], Name(miss))
	}
	if inst.Config["volatile.uuid"] == ready[0].Config["volatile.uuid"] {
		t.Fatal("the missed create got the warm instance: the test tested nothing")
	}
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, []controller.Owner{hit, miss})
}

// A provider that stops once a staged create is built, before its rename:
// the next process renames it on its own, and the owner's gets answer
// provisioning, never notFound, until it is active.
func TestStagedCreateCrashBeforeItsRename(t *testing.T) {
	h := warmHarness(t, 1)
	o := owner("staged-crash")
	h.crashBeforeTheRename(t, o)
	ctx := ctxT(t)
	fresh, _ := h.startWarmWith(h.catalog, nil, nil, 30*time.Second)
	until(t, "active on gets alone", func() (controller.Observation, error) {
		got, err := fresh.GetTarget(ctx, controller.TargetRef{Owner: o})
		if err != nil && kindOf(err) == jsonrpc.KindNotFound {
			t.Fatalf("a get after the crash answered %v: a staged create is a create on its way", err)
		}
		return got, err
	}, isActive)
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, []controller.Owner{o})
}

// A get that reads the owner's name empty while another replica renames
// the owner's staged instance onto it, the rename landing before the get
// looks for the claim: the claim is gone and the name holds the target,
// which the get must find (CI answered notFound there, failing the
// owner's environment). The rename is the test's own, made inside the
// get's window; the claim is dated ahead so no survey makes it first.
func TestAGetAcrossARenameOntoTheOwnersName(t *testing.T) {
	h := warmHarness(t, 1)
	o := owner("staged-get-rename")
	name, staged := h.crashBeforeTheRename(t, o)
	ctx := ctxT(t)
	ahead := msString(time.Now().Add(time.Hour))
	if err := h.client.PatchInstanceConfig(ctx, staged, map[string]string{keyWarmClaimAt: ahead}); err != nil {
		t.Fatal(err)
	}
	renamed := false
	fresh, _ := h.startWarmWith(h.catalog, nil, func(stage string) bool {
		if stage != "get-absent" || renamed {
			return false
		}
		renamed = true
		op, err := h.client.RenameInstance(ctx, staged, name)
		if err == nil {
			_, err = h.client.Wait(ctx, op)
		}
		if err != nil {
			t.Errorf("renaming the staged instance inside the get's window: %v", err)
		}
		return false
	}, time.Hour)
	got, err := fresh.GetTarget(ctx, controller.TargetRef{Owner: o})
	if err != nil {
		t.Fatalf("a get across the rename answered %v; want the target", err)
	}
	if !renamed {
		t.Fatal("the get never read the owner's name empty: the test tested nothing")
	}
	if got.TargetID != name {
		t.Fatalf("a get across the rename answered %+v; want target %s", got, name)
	}
	until(t, "active on gets alone", func() (controller.Observation, error) {
		return fresh.GetTarget(ctx, controller.TargetRef{Owner: o})
	}, isActive)
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, []controller.Owner{o})
}

// crashBeforeTheRename makes o's create miss the pool and stage, and
// stops its provider once the staged instance is built, before its
// rename: it answers o's name and the staged instance's.
func (h *harness) crashBeforeTheRename(t *testing.T, o controller.Owner) (name, staged string) {
	t.Helper()
	svc, stop := h.startWarm(h.catalog, nil, func(s string) bool { return s == "staged" })
	missThePool(svc, h.awaitPool(t, 1))
	name = Name(o)
	got, err := svc.CreateTarget(ctxT(t), controller.CreateParams{Owner: o, TemplateID: "w"})
	if err != nil || got.TargetID != "" {
		t.Fatalf("the staged create answered %+v, %v; want provisioning without an id (the hook held its rename)", got, err)
	}
	stop()
	for _, inst := range h.instances() {
		if isWarmName(inst.Name) && inst.Config[keyWarmClaim] == name {
			staged = inst.Name
		}
		if inst.Name == name {
			t.Fatal("the owner's name holds an instance though the rename was held: the test tested nothing")
		}
	}
	if staged == "" {
		t.Fatal("the crash left no staged instance claimed for the owner")
	}
	return name, staged
}

// Both replicas keep a pool of three, and each owner's create is sent to
// both at once: a hand-out and a staged create, two hand-outs or two
// staged creates race for every owner's name. Each owner ends with one instance, nothing
// claimed is left, and every owner's target becomes active.
func TestStagedCreatesRaceHandoutsForOneName(t *testing.T) {
	const pool, rounds = 3, 6
	h := warmHarness(t, pool)
	a, _ := h.startWarm(h.catalog, prometheus.NewRegistry(), nil)
	b, _ := h.startWarm(h.catalog, prometheus.NewRegistry(), nil)
	var owners []controller.Owner
	for round := range rounds {
		h.awaitPool(t, pool)
		var wg sync.WaitGroup
		for i := range pool {
			o := owner(fmt.Sprintf("staged-race-%d-%d", round, i))
			owners = append(owners, o)
			for _, svc := range []*Service{a, b} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					createUntilID(t, svc, controller.CreateParams{Owner: o, TemplateID: "w"})
				}()
			}
		}
		wg.Wait()
	}
	h.awaitPool(t, pool)
	h.checkOnePerOwner(t, owners)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, o := range owners {
		until(t, "active", func() (controller.Observation, error) { return a.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	}
}

// A staged create whose claimant is alive but slow (on a loaded daemon the
// create outlives its claim's freshness, and the rename comes seconds
// later) is never deleted under it by another replica's survey: a delete
// racing the claimant's rename leaves the owner's name with a volume and
// no instance, and every later create of the owner fails (CI lost an
// owner so). The survey renames it onto the owner's name instead, and
// the claimant's own rename then finds it there.
func TestAnOldStagedClaimIsRenamedNotDeleted(t *testing.T) {
	h := warmHarness(t, 1)
	o := owner("staged-slow")
	name := Name(o)
	ctx := ctxT(t)
	uuid := make(chan string, 1)
	a, _ := h.startWarm(h.catalog, nil, func(stage string) bool {
		if stage != "staged" {
			return false
		}
		// The claim is made to look as old as a slow create's, and the
		// claimant waits past several of the other replica's surveys.
		for _, inst := range h.instances() {
			if isWarmName(inst.Name) && inst.Config[keyWarmClaim] == name {
				old := msString(time.Now().Add(-time.Minute))
				if err := h.client.PatchInstanceConfig(ctx, inst.Name, map[string]string{keyWarmClaimAt: old}); err != nil {
					t.Errorf("ageing the claim: %v", err)
				}
				uuid <- inst.Config["volatile.uuid"]
			}
		}
		time.Sleep(5 * time.Second)
		return false
	})
	missThePool(a, h.awaitPool(t, 1))
	h.startWarm(h.catalog, nil, nil)
	// The other replica's survey may rename it within the answer bound,
	// so the answer may carry the id already.
	if _, err := a.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "w"}); err != nil {
		t.Fatalf("the staged create: %v", err)
	}
	var staged string
	select {
	case staged = <-uuid:
	case <-time.After(time.Minute):
		t.Fatal("no staged instance claimed for the owner")
	}
	createUntilID(t, a, controller.CreateParams{Owner: o, TemplateID: "w"})
	until(t, "active", func() (controller.Observation, error) { return a.GetTarget(ctx, controller.TargetRef{Owner: o}) }, isActive)
	inst, _, err := h.client.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if inst.Config["volatile.uuid"] != staged {
		t.Fatal("the owner's target is not the staged instance: the survey deleted it under its claimant")
	}
	h.awaitPool(t, 1)
	h.checkOnePerOwner(t, []controller.Owner{o})
}

// missThePool keeps the ready warm instances Incus listed taken in svc, so
// that its next create misses and stages. The names come from Incus, not
// from svc's own map: a fill marks its instance ready in Incus before it
// records it (CI: the pool's one instance was handed out, missing from
// the map a moment before).
func missThePool(svc *Service, ready []incus.Instance) {
	svc.warm.mu.Lock()
	defer svc.warm.mu.Unlock()
	for n := range svc.warm.known {
		svc.warm.taken[n] = true
	}
	for _, inst := range ready {
		svc.warm.taken[inst.Name] = true
	}
}
