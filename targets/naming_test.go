package targets

import (
	"testing"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

func TestNameIsDeterministicAndSeparatesIDs(t *testing.T) {
	a := Name(controller.Owner{UniverseID: "u1", EnvironmentID: "env_1"})
	if a != Name(controller.Owner{UniverseID: "u1", EnvironmentID: "env_1"}) {
		t.Fatal("the same owner must always get the same name")
	}
	if !looksLikeTargetID(a) || len(a) != 23 {
		t.Fatalf("name %q is not ls- and 20 hex digits", a)
	}
	// Length-prefixing keeps a boundary shift from colliding.
	if Name(controller.Owner{UniverseID: "a", EnvironmentID: "bc"}) == Name(controller.Owner{UniverseID: "ab", EnvironmentID: "c"}) {
		t.Fatal("owners differing only in where the ids split share a name")
	}
	if Name(controller.Owner{UniverseID: "u1", EnvironmentID: "env_2"}) == a {
		t.Fatal("two environments share a name")
	}
	// Pinned: changing the derivation would orphan every existing target.
	if a != "ls-862b136f1176212001b1" {
		t.Fatalf("the derivation changed: %s", a)
	}
}

func TestOwnerOfRefusesWhatIsNotOurs(t *testing.T) {
	owner := controller.Owner{UniverseID: "u1", EnvironmentID: "env_1"}
	meta := map[string]string{keySchema: "1", keyUniverse: "u1", keyEnvironment: "env_1"}
	if got, ok := ownerOf(&incus.Instance{Name: Name(owner), Config: meta}); !ok || got != owner {
		t.Fatalf("own instance not recognised: %v %v", got, ok)
	}
	cases := map[string]*incus.Instance{
		"renamed copy":  {Name: "ls-00000000000000000000", Config: meta},
		"no metadata":   {Name: Name(owner), Config: map[string]string{}},
		"no schema":     {Name: Name(owner), Config: map[string]string{keyUniverse: "u1", keyEnvironment: "env_1"}},
		"other owner":   {Name: Name(owner), Config: map[string]string{keySchema: "1", keyUniverse: "u1", keyEnvironment: "env_2"}},
		"missing owner": {Name: Name(owner), Config: map[string]string{keySchema: "1", keyUniverse: "u1"}},
	}
	for name, inst := range cases {
		if _, ok := ownerOf(inst); ok {
			t.Errorf("%s: taken for a target", name)
		}
	}
}

func TestObserveMapsIncusStatus(t *testing.T) {
	owner := controller.Owner{UniverseID: "u1", EnvironmentID: "e1"}
	booted := map[string]string{keyBooted: "1700000000000"}
	cases := []struct {
		name     string
		status   incus.InstanceStatus
		config   map[string]string
		stateful bool
		phase    controller.Phase
		power    controller.Power
	}{
		{"running", "Running", booted, false, controller.PhaseActive, controller.PowerRunning},
		{"ready", "Ready", booted, false, controller.PhaseActive, controller.PowerRunning},
		// Running before the reconciler marked it booted: LXD shows that
		// while its start operation still runs.
		{"running before first boot is marked", "Running", nil, false, controller.PhaseProvisioning, ""},
		{"frozen before first boot is marked", "Frozen", nil, false, controller.PhaseProvisioning, ""},
		{"frozen", "Frozen", booted, false, controller.PhaseActive, controller.PowerPaused},
		{"stopped before first boot", "Stopped", nil, false, controller.PhaseProvisioning, ""},
		{"stopped after boot", "Stopped", booted, false, controller.PhaseActive, controller.PowerStopped},
		{"suspended", "Stopped", booted, true, controller.PhaseActive, controller.PowerSuspended},
		{"error (Incus cannot tell: its member is down)", "Error", booted, false, controller.PhaseUnknown, ""},
		{"unknown status", "Migrating", booted, false, controller.PhaseUnknown, ""},
		{"closing wins", "Running", map[string]string{keyClosing: "1"}, false, controller.PhaseClosing, ""},
		{"recorded failure", "Stopped", map[string]string{keyFailure: "could not start"}, false, controller.PhaseFailed, ""},
	}
	for _, c := range cases {
		o := Observe(&incus.Instance{Name: "ls-x", Status: c.status, Config: c.config, Stateful: c.stateful}, owner)
		if o.Phase != c.phase || o.Power != c.power {
			t.Errorf("%s: got %s/%s, want %s/%s", c.name, o.Phase, o.Power, c.phase, c.power)
		}
		if (o.Phase == controller.PhaseFailed || o.Phase == controller.PhaseUnknown) && o.Message == "" {
			t.Errorf("%s: %s carries no message", c.name, o.Phase)
		}
		if fe := o.CheckWire(); fe != nil {
			t.Errorf("%s: observation breaks the wire rules: %v", c.name, fe)
		}
	}
}
