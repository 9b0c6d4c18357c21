package provider_test

import (
	"context"
	"fmt"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// poolSlot is the name of a pool's slot (targets/warm.go, warmName).
var poolSlot = regexp.MustCompile(`^warm-[0-9a-f]{12}-[0-9]+$`)

// TestClusterWarmPoolFollowsDemand: two replicas behind the balancer share
// a pool sized by demand (warm 1, warmMax 4) of a template placed on lsm2.
// A burst of creates, spread over both replicas, grows it; every spare is
// on lsm2, the pool never passes its maximum whatever the replicas want,
// and once the shrink period has passed without a burst it is back at 1.
// Every owner holds one instance.
func TestClusterWarmPoolFollowsDemand(t *testing.T) {
	r := newLBRigOpts(t, lbOptions{
		env: []string{"PROVIDER_WARM_SHRINK_AFTER=10s", "PROVIDER_WARM_BURST_WINDOW=10s"},
		templates: `  - templateId: pooled-lsm2
    displayName: a pool on lsm2 sized by demand
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm2
    warm: 1
    warmMax: 4
`})
	spares := func() (ready, all int, where map[string]int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		list, err := r.client.ListInstances(ctx)
		if err != nil {
			t.Fatal(err)
		}
		where = map[string]int{}
		for _, i := range list {
			// Pool slots only: a create that finds no spare while pools
			// exist is built under a staging name (warm-…-s…) of its own.
			if !poolSlot.MatchString(i.Name) {
				continue
			}
			all++
			where[i.Location]++
			if i.Config["user.lightspeed.warm_ready_ms"] != "" && i.Config["user.lightspeed.warm_claim"] == "" && i.Status == incus.InstanceStopped {
				ready++
			}
		}
		return ready, all, where
	}
	// watch fails the test whenever the pool passes its maximum or a spare
	// is off its placement; it runs until the test ends.
	most := 0
	var mu sync.Mutex
	stop := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			_, all, where := spares()
			mu.Lock()
			most = max(most, all)
			mu.Unlock()
			for m, n := range where {
				if m != "lsm2" {
					t.Errorf("%d warm instances on %s, not on the template's placement lsm2", n, m)
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	defer func() { close(stop); <-watched }()
	await := func(what string, within time.Duration, cond func(ready, all int) bool) {
		t.Helper()
		for deadline := time.Now().Add(within); ; {
			ready, all, _ := spares()
			if cond(ready, all) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the pool never %s in %s (ready %d, all %d)", what, within, ready, all)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	await("held its minimum", 90*time.Second, func(ready, _ int) bool { return ready == 1 })

	// A burst of 5 through the balancer: each create on a connection of
	// its own, so both replicas answer some.
	var owners []controller.Owner
	var wg sync.WaitGroup
	for i := range 5 {
		o := controller.Owner{UniverseID: "u-warm-cluster", EnvironmentID: fmt.Sprintf("burst-%d", i)}
		owners = append(owners, o)
		wg.Go(func() {
			if _, err := r.call("target/create", controller.CreateParams{Owner: o, TemplateID: "pooled-lsm2"}, 60*time.Second); err != nil {
				t.Errorf("create %v: %v", o, err)
			}
		})
	}
	wg.Wait()
	for _, o := range owners {
		r.until(o, "active", 120*time.Second, func(ob controller.Observation) bool { return ob.Phase == controller.PhaseActive })
	}
	await("grew past its minimum", 90*time.Second, func(ready, _ int) bool { return ready >= 2 })
	await("shrank back to its minimum", 120*time.Second, func(ready, all int) bool { return ready == 1 && all == 1 })
	mu.Lock()
	if most > 4 {
		t.Errorf("the pool held %d warm instances at once, more than its maximum 4", most)
	}
	t.Logf("the pool held at most %d warm instances", most)
	mu.Unlock()

	// One instance per owner, each the owner's.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := r.client.ListInstances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]int{}
	for _, i := range list {
		byName[i.Name]++
	}
	for _, o := range owners {
		if byName[targets.Name(o)] != 1 {
			t.Errorf("owner %v has %d instances", o, byName[targets.Name(o)])
		}
	}
}
