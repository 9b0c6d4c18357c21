package targets

import (
	"context"
	"errors"
	"testing"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

func routedInstance(o controller.Owner, label string, routed bool) incus.Instance {
	inst := incus.Instance{Name: Name(o), Status: incus.InstanceRunning, Config: map[string]string{
		keySchema: schemaVersion, keyUniverse: o.UniverseID, keyEnvironment: o.EnvironmentID,
		keyIngressLabel: label, keyIngressPort: "8080",
	}}
	if routed {
		inst.Config[keyIngressRouted] = "true"
	}
	return inst
}

func TestIngressIndexRebuildKeepsNewerLocalChanges(t *testing.T) {
	a, b, c := owner("ix-a"), owner("ix-b"), owner("ix-c")
	la, lb, lc := ingressurl.NewLabel(), ingressurl.NewLabel(), ingressurl.NewLabel()
	var x ingressIndex
	x.init()
	x.rebuild([]incus.Instance{routedInstance(a, la, true), routedInstance(b, lb, true), routedInstance(c, lc, false)}, x.mark(), nil)
	if r, ok := x.lookup(la); !ok || r.Instance != Name(a) || r.Port != 8080 || r.Owner != a {
		t.Fatalf("a: %+v %v", r, ok)
	}
	if _, ok := x.lookup(lc); ok {
		t.Fatal("an unrouted instance is in the index")
	}
	// A list asked for before a remove and a new route must not undo them.
	since := x.mark()
	x.drop(Name(a))
	x.put(lc, IngressRoute{Instance: Name(c), Owner: c, Port: 8080})
	x.rebuild([]incus.Instance{routedInstance(a, la, true), routedInstance(b, lb, true), routedInstance(c, lc, false)}, since, nil)
	if _, ok := x.lookup(la); ok {
		t.Fatal("a stale list put a removed route back")
	}
	if _, ok := x.lookup(lc); !ok {
		t.Fatal("a stale list took a new route away")
	}
	// A list asked for after a change, that says it may show an older
	// state of the name (the cache's entry was touched by the write and not
	// read again yet), must not undo it either: a route put after a
	// remove, with the list still showing the remove, stays.
	x.drop(Name(c))
	x.put(lc, IngressRoute{Instance: Name(c), Owner: c, Port: 8080})
	x.rebuild([]incus.Instance{routedInstance(b, lb, true), routedInstance(c, lc, false)}, x.mark(), map[string]bool{Name(c): true})
	if _, ok := x.lookup(lc); !ok {
		t.Fatal("a list stale for the name took its new route away")
	}
	// A list asked for after them is the truth again.
	x.rebuild([]incus.Instance{routedInstance(b, lb, true)}, x.mark(), nil)
	if _, ok := x.lookup(lc); ok {
		t.Fatal("a route Incus no longer shows stayed")
	}
	if _, ok := x.lookup(lb); !ok {
		t.Fatal("b is gone")
	}
	// Closing instances and foreign ones are never routed.
	closing := routedInstance(b, lb, true)
	closing.Config[keyClosing] = "1"
	foreign := routedInstance(a, la, true)
	foreign.Name = "ls-00000000000000000000"
	x.rebuild([]incus.Instance{closing, foreign}, x.mark(), nil)
	if _, ok := x.lookup(lb); ok {
		t.Fatal("a closing instance is routed")
	}
	if _, ok := x.lookup(la); ok {
		t.Fatal("an instance whose name its owner does not derive is routed")
	}
}

func TestObservationCarriesTheEndpointExactlyWhileRouted(t *testing.T) {
	base, err := ingressurl.Parse("https://{label}.env.example.com")
	if err != nil {
		t.Fatal(err)
	}
	s := &Service{cfg: Config{IngressBase: &base}}
	o := owner("ix-obs")
	label := ingressurl.NewLabel()
	inst := routedInstance(o, label, true)
	inst.Config[keyBooted] = "1"
	if got := s.withIngress(&inst, Observe(&inst, o)); got.Ingress == nil || got.Ingress.Endpoint != "https://"+label+".env.example.com" {
		t.Fatalf("routed: %+v", got.Ingress)
	}
	inst.Config[keyIngressRouted] = ""
	if got := s.withIngress(&inst, Observe(&inst, o)); got.Ingress != nil {
		t.Fatalf("removed: %+v", got.Ingress)
	}
	inst.Config[keyIngressRouted] = "true"
	inst.Config[keyClosing] = "1"
	if got := s.withIngress(&inst, Observe(&inst, o)); got.Ingress != nil {
		t.Fatalf("closing: %+v", got.Ingress)
	}
}

func TestIngressMethodsWithoutAnEdgeAreUnavailable(t *testing.T) {
	s := &Service{}
	for _, call := range []func(context.Context, controller.TargetRef) (controller.Observation, error){s.EnsureIngress, s.RemoveIngress} {
		_, err := call(context.Background(), controller.TargetRef{Owner: owner("ix-off")})
		var e *jsonrpc.Error
		if !errors.As(err, &e) || e.Kind != jsonrpc.KindCapabilityUnavailable || e.Capability != "ingress" {
			t.Fatalf("without an edge: %v", err)
		}
	}
}
