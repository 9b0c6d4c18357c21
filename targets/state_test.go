package targets

import (
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// An observation says what the move asked last waits for, never what a
// move it replaced was waiting for.
func TestObservationDetailFollowsTheCurrentRequest(t *testing.T) {
	owner := controller.Owner{UniverseID: "u1", EnvironmentID: "e1"}
	inst := &incus.Instance{Name: "ls-x", Status: incus.InstanceRunning, Config: map[string]string{
		keyBooted: "1700000000000", keyPower: "stopped", keyPowerAt: "1700000000001", keyPowerBy: string(BySetPower)}}
	st := StateOf(inst)
	now := time.Now()
	waiting := &progress{to: controller.PowerStopped, waiting: 2}
	if got := observation(inst, owner, st, waiting, now).Message; got != "Moving to stopped: waiting for 2 data connections to close." {
		t.Fatalf("message %q", got)
	}
	stale := &progress{to: controller.PowerPaused, waiting: 1}
	if got := observation(inst, owner, st, stale, now).Message; got != "Moving to stopped." {
		t.Fatalf("a replaced move's progress shows: %q", got)
	}
	if !st.PowerPending() || st.Settled() {
		t.Fatalf("a recorded stop not carried out is pending: %+v", st)
	}
}
