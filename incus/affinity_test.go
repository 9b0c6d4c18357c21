package incus

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"sync"
	"testing"
)

// twoMembers is a client of two members, m1 and m2, that answer their
// cluster's member list and what serve answers (true), 404 otherwise; the
// client has learnt which endpoint is which member.
func twoMembers(t *testing.T, serve func(w http.ResponseWriter, r *http.Request) bool) (m1, m2 *member, c *watched) {
	t.Helper()
	rg := newRig(t)
	var mu sync.Mutex
	urls := map[string]string{}
	handler := func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/cluster/members":
			mu.Lock()
			defer mu.Unlock()
			writeSync(w, []map[string]any{{"server_name": "m1", "url": urls["m1"], "status": "Online"},
				{"server_name": "m2", "url": urls["m2"], "status": "Online"}})
		case serve(w, r):
		default:
			writeError(w, 404, 404, "not found")
		}
	}
	m1, m2 = rg.member(t, handler), rg.member(t, handler)
	mu.Lock()
	urls["m1"], urls["m2"] = m1.url(), m2.url()
	mu.Unlock()
	c = rg.client(t, []string{m1.url(), m2.url()}, nil)
	if _, err := c.ListClusterMembers(t.Context()); err != nil {
		t.Fatal(err)
	}
	return m1, m2, c
}

// TestCallsGoToTheHoldingMember: once the client knows which member holds
// an instance and which endpoint is that member, calls about the instance
// go there first; with that endpoint down they fail over as before, and
// calls about other instances keep the configured order.
func TestCallsGoToTheHoldingMember(t *testing.T) {
	m1, m2, c := twoMembers(t, func(w http.ResponseWriter, r *http.Request) bool {
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/instances/on-m2":
			writeSync(w, map[string]any{"name": "on-m2", "location": "m2", "status": "Running"})
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/instances":
			writeSync(w, []map[string]any{{"name": "listed-m2", "location": "m2"}, {"name": "on-m1", "location": "m1"}})
		case r.Method == http.MethodPut && r.URL.Path != "":
			_, _ = io.Copy(io.Discard, r.Body)
			writeSync(w, json.RawMessage(`{}`))
		default:
			return false
		}
		return true
	})
	ctx := t.Context()
	put := func(name string) {
		t.Helper()
		if _, err := c.UpdateInstanceState(ctx, name, InstanceStatePut{Action: "unfreeze"}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	// Not yet read: the configured order.
	put("on-m2")
	if m1.count(http.MethodPut) != 1 || m2.count(http.MethodPut) != 0 {
		t.Fatalf("before its location is known: m1 %v, m2 %v", m1.methods, m2.methods)
	}
	if _, _, err := c.GetInstance(ctx, "on-m2"); err != nil {
		t.Fatal(err)
	}
	put("on-m2")
	if m2.count(http.MethodPut) != 1 {
		t.Fatalf("once read on m2, its call went to m1: m1 %v, m2 %v", m1.methods, m2.methods)
	}
	// A list teaches every instance's member; a WithProject copy shares
	// the endpoints but not another project's instances.
	if _, err := c.ListInstances(ctx); err != nil {
		t.Fatal(err)
	}
	put("listed-m2")
	put("on-m1")
	if m2.count(http.MethodPut) != 2 || m1.count(http.MethodPut) != 2 {
		t.Fatalf("after a list: m1 %v, m2 %v", m1.methods, m2.methods)
	}
	other := c.WithProject("other")
	if _, err := other.UpdateInstanceState(ctx, "listed-m2", InstanceStatePut{Action: "unfreeze"}); err != nil {
		t.Fatal(err)
	}
	if m1.count(http.MethodPut) != 3 {
		t.Fatalf("another project's instance of the same name went by this one's location: m1 %v", m1.methods)
	}
	// The holding member down: failover to the other, and the down one is
	// not tried first again while it cools down.
	// (on-m2 was not in the list, so the list forgot where it is.)
	// Reads, which move on after a cut connection (a write's outcome would
	// be unknown).
	m2.srv.Close()
	for range 2 {
		if _, err := c.GetInstanceState(ctx, "listed-m2"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("with m2 down, m1 should have answered (not found): %v", err)
		}
	}
	seen := c.seen()
	transport := 0
	for _, o := range seen {
		if o.status == "transport" {
			transport++
		}
	}
	if transport != 1 {
		t.Fatalf("the down holder was tried %d times, want once before its cool-down: %v", transport, seen)
	}
}

// TestLockRaceIsAskedAgain: LXD 5.0 refuses a change asked the moment the
// operation holding the instance ends, with a 500 that says so; nothing was
// done, so the client asks again, a few times. Any other 500 is the caller's.
func TestLockRaceIsAskedAgain(t *testing.T) {
	rg := newRig(t)
	var mu sync.Mutex
	patches := 0
	m := rg.member(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPatch {
			writeError(w, 404, 404, "not found")
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		patches++
		n := patches
		mu.Unlock()
		switch {
		case r.URL.Path == "/1.0/instances/race" && n <= 3:
			writeError(w, 500, 500, "Failed to create instance update operation: A matching non-reusable operation has now succeeded")
		case r.URL.Path == "/1.0/instances/broken":
			writeError(w, 500, 500, "Failed to update instance: disk on fire")
		default:
			writeSync(w, json.RawMessage(`{}`))
		}
	})
	count := func() int { mu.Lock(); defer mu.Unlock(); return patches }
	c := rg.client(t, []string{m.url()}, nil)
	if err := c.PatchInstanceConfig(t.Context(), "race", map[string]string{"user.x": "1"}); err != nil {
		t.Fatalf("a lock race was not asked again: %v", err)
	}
	if n := count(); n != 4 {
		t.Fatalf("%d PATCHes, want 4 (three races, then through)", n)
	}
	if err := c.PatchInstanceConfig(t.Context(), "broken", map[string]string{"user.x": "1"}); err == nil {
		t.Fatal("another 500 was hidden")
	}
	if n := count(); n != 5 {
		t.Fatalf("another 500 was asked again: %d PATCHes, want 5", n)
	}
}

// TestCreatesGoToTheirMember: a create placed on one member goes to that
// member's endpoint (a member handed another's create forwards it, and
// Incus 6.0.4 leaks an event listener on the other member per forward); a
// create Incus places, or places within a group, keeps the configured
// order.
func TestCreatesGoToTheirMember(t *testing.T) {
	m1, m2, c := twoMembers(t, func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodPost || r.URL.Path != "/1.0/instances" {
			return false
		}
		_, _ = io.Copy(io.Discard, r.Body)
		writeAsync(w, map[string]any{"id": "op-1", "status": "Running", "status_code": 103})
		return true
	})
	ctx := t.Context()
	create := func(target string) {
		t.Helper()
		if _, err := c.CreateInstance(ctx, InstancesPost{Name: "x", Target: target}); err != nil {
			t.Fatalf("create with target %q: %v", target, err)
		}
	}
	create("m2")
	if m2.count(http.MethodPost) != 1 || m1.count(http.MethodPost) != 0 {
		t.Fatalf("a create placed on m2: m1 %v, m2 %v", m1.methods, m2.methods)
	}
	create("m1")
	create("")
	create("@gpu")
	if m1.count(http.MethodPost) != 3 || m2.count(http.MethodPost) != 1 {
		t.Fatalf("creates on m1, placed by Incus and in a group: m1 %v, m2 %v", m1.methods, m2.methods)
	}
}
