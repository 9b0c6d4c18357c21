package targets

import (
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// TestInspectReadsWhatTheInstanceRecords: an operator's view of a target is
// decoded from its keys by the provider's own encoding (written here by
// the provider's own change), with the observation a get would answer;
// an instance that is no target (a warm spare, another program's) is none.
func TestInspectReadsWhatTheInstanceRecords(t *testing.T) {
	owner := controller.Owner{UniverseID: "u-inspect", EnvironmentID: "env-1"}
	asked := time.UnixMilli(1_790_000_000_000).UTC()
	c := change{keys: fIntent | fOwned | fTemplate | fImage | fCreatedAt | fBooted | fDisplayName | fIngressLabel | fIngressRouted | fRelays | fWarmClaim,
		to: record{
			Intent: Intent{Power: controller.PowerPaused, At: asked, By: ByCreate}, Schema: schemaVersion, Owner: owner,
			Template: "dev-small", Image: "abc", CreatedAt: asked.Add(-time.Hour), Booted: asked.Add(-59 * time.Minute),
			DisplayName: "shown", IngressLabel: "lbl", IngressRouted: true, WarmClaim: Name(owner),
			Relays: map[string]time.Time{"replica-b": asked.Add(time.Minute), "replica-a": asked.Add(2 * time.Minute)},
		}}
	inst := &incus.Instance{Name: Name(owner), Status: incus.InstanceFrozen, Location: "lsm2", Config: c.config()}
	v, ok := Inspect(inst)
	if !ok {
		t.Fatal("a target's instance read as no target")
	}
	want := View{
		TargetID: Name(owner), Owner: owner, Template: "dev-small", Image: "abc", DisplayName: "shown",
		Status: "Frozen", Location: "lsm2", Intent: "paused", IntentAt: asked, IntentBy: string(ByCreate),
		CreatedAt: asked.Add(-time.Hour), BootedAt: asked.Add(-59 * time.Minute), IngressLabel: "lbl", IngressOn: true, FromPool: true,
		Relays: []RelayLease{{"replica-a", asked.Add(2 * time.Minute)}, {"replica-b", asked.Add(time.Minute)}},
	}
	want.Observation = Observe(inst, owner)
	if v.Observation.Phase != controller.PhaseActive || v.Observation.Power != controller.PowerPaused {
		t.Errorf("observation %+v, want active and paused", v.Observation)
	}
	v.Observation, want.Observation = controller.Observation{}, controller.Observation{}
	if got, exp := v, want; !equalViews(got, exp) {
		t.Errorf("view\n got %+v\nwant %+v", got, exp)
	}

	// A warm spare: pool keys, no owner.
	spare := &incus.Instance{Name: warmName("dev-small", 0), Status: incus.InstanceStopped,
		Config: change{keys: fWarm, to: record{Warm: "dev-small"}}.config()}
	if _, ok := Inspect(spare); ok {
		t.Error("a warm spare read as a target")
	}
	// An owner's keys under a name they do not derive: a copy, not a target.
	copied := &incus.Instance{Name: "ls-00000000000000000000", Status: incus.InstanceRunning, Config: c.config()}
	if _, ok := Inspect(copied); ok {
		t.Error("a copy under another name read as the owner's target")
	}
}

func equalViews(a, b View) bool {
	if len(a.Relays) != len(b.Relays) {
		return false
	}
	for i := range a.Relays {
		if a.Relays[i].Replica != b.Relays[i].Replica || !a.Relays[i].Until.Equal(b.Relays[i].Until) {
			return false
		}
	}
	a.Relays, b.Relays = nil, nil
	return a.TargetID == b.TargetID && a.Owner == b.Owner && a.Template == b.Template && a.Image == b.Image &&
		a.DisplayName == b.DisplayName && a.Status == b.Status && a.Location == b.Location && a.Intent == b.Intent &&
		a.IntentAt.Equal(b.IntentAt) && a.IntentBy == b.IntentBy && a.CreatedAt.Equal(b.CreatedAt) && a.BootedAt.Equal(b.BootedAt) &&
		a.ClosingFrom.Equal(b.ClosingFrom) && a.IdleSince.Equal(b.IdleSince) && a.IngressLabel == b.IngressLabel &&
		a.IngressOn == b.IngressOn && a.FromPool == b.FromPool
}

// TestInspectShowsEveryPhase: the view's observation is the phase a get
// would answer, for a target in each: provisioning (never booted), active,
// closing (a close recorded), failed (a failure recorded) and unknown (a
// cluster member Incus cannot reach).
func TestInspectShowsEveryPhase(t *testing.T) {
	owner := controller.Owner{UniverseID: "u-phases", EnvironmentID: "env"}
	at := time.UnixMilli(1_790_000_000_000).UTC()
	base := change{keys: fIntent | fOwned | fTemplate, to: record{
		Intent: Intent{Power: controller.PowerRunning, At: at, By: ByCreate}, Schema: schemaVersion, Owner: owner, Template: "t"}}
	with := func(keys fields, set func(*record)) map[string]string {
		c := base
		c.keys |= keys
		set(&c.to)
		return c.config()
	}
	booted := func(r *record) { r.Booted = at }
	for _, c := range []struct {
		status incus.InstanceStatus
		config map[string]string
		want   controller.Phase
	}{
		{incus.InstanceStopped, base.config(), controller.PhaseProvisioning},
		{incus.InstanceRunning, with(fBooted, booted), controller.PhaseActive},
		{incus.InstanceRunning, with(fBooted|fClosing, func(r *record) { booted(r); r.Closing = at }), controller.PhaseClosing},
		{incus.InstanceStopped, with(fBooted|fFailure, func(r *record) { booted(r); r.Failure = "Incus refused every start." }), controller.PhaseFailed},
		{incus.InstanceError, with(fBooted, booted), controller.PhaseUnknown},
	} {
		v, ok := Inspect(&incus.Instance{Name: Name(owner), Status: c.status, Location: "lsm3", Config: c.config})
		if !ok || v.Observation.Phase != c.want {
			t.Errorf("%s with %v: phase %q (target %v), want %q", c.status, c.config, v.Observation.Phase, ok, c.want)
		}
		if c.want == controller.PhaseClosing && v.ClosingFrom.IsZero() {
			t.Error("a closing target's view says not since when")
		}
	}
}

// TestInspectShowsAnUnreadableTarget: an instance under a target's name on
// a member that does not answer is listed by Incus with no record; the
// operator is shown it, unknown, with its member, and never a foreign
// instance the same way.
func TestInspectShowsAnUnreadableTarget(t *testing.T) {
	name := Name(controller.Owner{UniverseID: "u", EnvironmentID: "e"})
	v, ok := Inspect(&incus.Instance{Name: name, Status: incus.InstanceError, Location: "lsm3"})
	if !ok || v.TargetID != name || v.Observation.Phase != controller.PhaseUnknown || v.Location != "lsm3" ||
		!strings.Contains(v.Observation.Message, "lsm3") || v.Owner != (controller.Owner{}) {
		t.Errorf("an unreadable target: %+v, %v", v, ok)
	}
	if v, ok := Inspect(&incus.Instance{Name: "someone-elses", Status: incus.InstanceError, Location: "lsm3"}); ok {
		t.Errorf("an unreadable instance of another program is shown: %+v", v)
	}
}
