package targets

import (
	"testing"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// routeFor is the route of inst as ResolveRoute would answer it, for the
// tests that read the instance themselves.
func routeFor(inst *incus.Instance) Route {
	owner, _ := ownerOf(inst)
	return routeOf(inst, owner)
}

// A route says what a wake decides on: whether the processes run, or what
// brings them back, whatever the observation's power says meanwhile.
func TestARouteCarriesWhatAWakeDecidesOn(t *testing.T) {
	owner := controller.Owner{UniverseID: "u1", EnvironmentID: "e1"}
	for status, want := range map[incus.InstanceStatus]RouteState{
		incus.InstanceRunning:  RouteRunning,
		incus.InstanceReady:    RouteRunning,
		incus.InstanceFrozen:   RoutePaused,
		incus.InstanceStopped:  RouteStopped,
		incus.InstanceFreezing: RouteOther, // the observation still says running
		incus.InstanceThawed:   RouteOther,
		incus.InstanceStarting: RouteOther,
		incus.InstanceStopping: RouteOther,
		incus.InstanceError:    RouteOther,
	} {
		inst := &incus.Instance{Name: "ls-x", Status: status, Location: "m2", Config: map[string]string{keyBooted: "1700000000000"}}
		r := routeOf(inst, owner)
		if r.State != want || r.Name != "ls-x" || r.Owner != owner || r.Observation != Observe(inst, owner) {
			t.Fatalf("%s: route %+v, want state %d", status, r, want)
		}
		if r.Daemon != (guest.Target{Instance: "ls-x", Port: guest.DefaultPort, Location: "m2"}) {
			t.Fatalf("%s: daemon %+v", status, r.Daemon)
		}
	}
	inst := &incus.Instance{Name: "ls-x", Status: incus.InstanceRunning, Config: map[string]string{keyDaemonPort: "7777"}}
	if got := routeOf(inst, owner).Daemon.Port; got != 7777 {
		t.Fatalf("the recorded daemon port is not the route's: %d", got)
	}
}
