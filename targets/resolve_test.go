package targets

import (
	"context"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
)

// A route's read that Incus is slow to answer (past one read's bound, as
// in a storm of wakes on one host) is read again while the dial's hold
// leaves room: the route resolves, where it used to be refused with a
// 503 at 1.9 s of a 5 s hold (seen in the fifty-dials race on the real
// Incus).
func TestASlowReadOfARouteIsReadAgainWithinTheHold(t *testing.T) {
	r := newFakeRig(t, incusfake.Config{}, Config{NoCache: true})
	o := fakeOwner("slow-read")
	name := r.seedTarget(o, incus.InstanceFrozen, "paused")
	slow := r.fake.Inject(incusfake.Fault{Kind: incusfake.Latency, Method: "GET", Path: "/1.0/instances/" + name,
		Latency: 1700 * time.Millisecond, Times: 1})
	defer slow.Remove()
	ctx, cancel := context.WithTimeout(context.Background(), 4900*time.Millisecond)
	defer cancel()
	start := time.Now()
	rt, err := r.svc.ResolveRoute(ctx, o, name)
	if err != nil {
		t.Fatalf("ResolveRoute after %s: %v", time.Since(start).Round(time.Millisecond), err)
	}
	if rt.State != RoutePaused || slow.Hits() != 1 {
		t.Fatalf("route %+v after %d slow reads", rt.State, slow.Hits())
	}

	// With no room left for a second read, the first one's failure is the
	// answer, at once.
	slow2 := r.fake.Inject(incusfake.Fault{Kind: incusfake.Latency, Method: "GET", Path: "/1.0/instances/" + name,
		Latency: 1700 * time.Millisecond})
	defer slow2.Remove()
	short, cancel2 := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel2()
	if _, err := r.svc.ResolveRoute(short, o, name); err == nil {
		t.Fatal("a read that could not be answered within the deadline resolved")
	}
}
