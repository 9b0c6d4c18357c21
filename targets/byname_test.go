package targets

import (
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// The two tables on byName keep their own rules: a kept power request is
// replaced only by a newer one and dropped only once recorded or
// outranked; a written intent is replaced by any later write and dropped
// only while it is still the one settled.
func TestTablesByNameKeepTheirRules(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	older := pendingWrite{intent: Intent{Power: controller.PowerRunning, At: t0}}
	newer := pendingWrite{intent: Intent{Power: controller.PowerPaused, At: t0.Add(time.Second)}}
	var p pendingTable
	p.put("a", newer)
	p.put("a", older)
	if w, _ := p.get("a"); w.intent != newer.intent {
		t.Fatalf("an older request replaced a newer one: %+v", w.intent)
	}
	p.done("a", older)
	if _, ok := p.get("a"); !ok {
		t.Fatal("done of another request dropped the kept one")
	}
	if p.drop("a", t0) {
		t.Fatal("a record older than the kept request dropped it")
	}
	if !p.drop("a", newer.intent.At) {
		t.Fatal("a record as new as the kept request did not drop it")
	}

	var w writtenTable
	w.put("a", older.intent, t0)
	first, _ := w.get("a")
	w.put("a", newer.intent, t0.Add(time.Second))
	w.drop("a", first)
	if cur, ok := w.get("a"); !ok || cur.intent != newer.intent {
		t.Fatalf("the settled look of an earlier write dropped a later one: %+v, %v", cur, ok)
	}
	if got := w.lookIn("a", t0.Add(1500*time.Millisecond)); got != 500*time.Millisecond {
		t.Fatalf("lookIn half a second after the write = %v, want 500ms (the first look)", got)
	}
	w.forget("a")
	if _, ok := w.get("a"); ok {
		t.Fatal("forget left the entry")
	}
}

// A dial outranks a power-down kept until Incus takes it only when the
// power-down was asked before the dial; a kept request for running is no
// power-down.
func TestAKeptPowerDownIsPendingForAUseAfterIt(t *testing.T) {
	s := &Service{}
	t0 := time.UnixMilli(1_700_000_000_000)
	if s.PowerDownPending(routeFor(&incus.Instance{Name: "a"}), t0) {
		t.Fatal("nothing kept, yet a power-down is")
	}
	s.pending.put("a", pendingWrite{intent: Intent{Power: controller.PowerStopped, At: t0, By: BySetPower}})
	if !s.PowerDownPending(routeFor(&incus.Instance{Name: "a"}), t0.Add(time.Millisecond)) || !s.PowerDownPending(routeFor(&incus.Instance{Name: "a"}), t0) {
		t.Fatal("a power-down asked before the dial is not seen")
	}
	if s.PowerDownPending(routeFor(&incus.Instance{Name: "a"}), t0.Add(-time.Millisecond)) {
		t.Fatal("a power-down asked after the dial is counted as older")
	}
	s.pending.put("b", pendingWrite{intent: Intent{Power: controller.PowerRunning, At: t0, By: BySetPower}})
	if s.PowerDownPending(routeFor(&incus.Instance{Name: "b"}), t0.Add(time.Second)) {
		t.Fatal("a kept request for running counted as a power-down")
	}
	// What Wake does once its request is recorded.
	s.pending.drop("a", t0.Add(time.Millisecond))
	if s.PowerDownPending(routeFor(&incus.Instance{Name: "a"}), t0.Add(time.Second)) {
		t.Fatal("the older power-down outlived a newer recorded request")
	}
}

// Between a wake's action and its record, the target runs under the older
// power-down's record: a use then is told that record is being replaced,
// so it does not record running again (nor wake again); a request newer
// than the wake's still counts.
func TestARecordedPowerDownIsNotPendingWhileAWakeRecordsRunning(t *testing.T) {
	s := &Service{}
	t0 := time.UnixMilli(1_700_000_000_000)
	running := func(in Intent) Route {
		inst := &incus.Instance{Name: "a", Status: incus.InstanceRunning, Config: map[string]string{
			keySchema: schemaVersion, keyUniverse: "u", keyEnvironment: "e", keyBooted: msString(t0.Add(-time.Hour)),
		}}
		for k, v := range in.config() {
			inst.Config[k] = v
		}
		return routeFor(inst)
	}
	older := running(Intent{Power: controller.PowerPaused, At: t0, By: BySetPower})
	if !s.PowerDownPending(older, t0.Add(time.Second)) {
		t.Fatal("a recorded pause the running target has not reached is not pending")
	}
	s.waking.putUnless("a", t0.Add(time.Millisecond), nil)
	if s.PowerDownPending(older, t0.Add(time.Second)) {
		t.Fatal("a wake records running over the pause, yet the pause is pending for a later use")
	}
	if !s.PowerDownPending(running(Intent{Power: controller.PowerPaused, At: t0.Add(time.Second), By: BySetPower}), t0.Add(2*time.Second)) {
		t.Fatal("a pause asked after the wake is not pending")
	}
}
