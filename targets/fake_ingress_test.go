package targets

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/relays"
)

// TestFakeIngressReachesTheOtherReplicaWithinASecond: two replicas on one
// project, neither making a reconcile pass within the test. A route one
// ensures is in the other's index within a second, from Incus's event; a
// remove, then a close, take it out of the other's within a second too.
func TestFakeIngressReachesTheOtherReplicaWithinASecond(t *testing.T) {
	base, err := ingressurl.Parse("http://{label}.localhost:1")
	if err != nil {
		t.Fatal(err)
	}
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{IngressBase: &base, ReconcileInterval: time.Hour})
	other, err := New(r.client, fakeCatalog(t), nopDialer{}, relays.New(0), zaptest.NewLogger(t),
		Config{Replica: "r-fake-2", IngressBase: &base, ReconcileInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, other)
	o := fakeOwner("env-ingress-replicas")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	ref := controller.TargetRef{Owner: o, TargetID: name}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Both caches confirmed and holding the target: the first pass of each
	// is behind them.
	for _, svc := range []*Service{r.svc, other} {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if inst, known := svc.cache.peek(name); known && inst != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("a replica's cache never held the target")
			}
		}
	}
	within := func(what string, want bool, label string) {
		t.Helper()
		began := time.Now()
		for {
			if _, routed := other.IngressLookup(label); routed == want {
				t.Logf("%s: the other replica's index followed in %s", what, time.Since(began).Round(time.Millisecond))
				return
			}
			if time.Since(began) > time.Second {
				t.Fatalf("%s: the other replica's index did not follow within 1 s (routed %v)", what, !want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	obs, err := r.svc.EnsureIngress(ctx, ref)
	if err != nil || obs.Ingress == nil {
		t.Fatalf("ensure answered %+v, %v", obs, err)
	}
	label, ok := base.Label(strings.TrimPrefix(obs.Ingress.Endpoint, "http://"))
	if !ok {
		t.Fatalf("endpoint %s has no label", obs.Ingress.Endpoint)
	}
	within("ensure", true, label)
	if _, err := r.svc.RemoveIngress(ctx, ref); err != nil {
		t.Fatal(err)
	}
	within("remove", false, label)
	if _, err := r.svc.EnsureIngress(ctx, ref); err != nil {
		t.Fatal(err)
	}
	within("ensure again", true, label)
	if _, err := r.svc.CloseTarget(ctx, ref); err != nil {
		t.Fatal(err)
	}
	within("close", false, label)
	r.closed(name)
}
