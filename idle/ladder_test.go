package idle

import (
	"testing"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

func TestStagesOfAndLevels(t *testing.T) {
	if got := StagesOf([]controller.Power{controller.PowerRunning, controller.PowerPaused, controller.PowerStopped}); got != idlepolicy.StagePause|idlepolicy.StageStop {
		t.Fatalf("StagesOf = %b", got)
	}
	if got := StagesOf(nil); got != 0 || !got.Allows(idlepolicy.ActionClose) || got.Allows(idlepolicy.ActionPause) {
		t.Fatalf("no power states: only close, got %b", got)
	}
	levels := map[controller.Power]idlepolicy.Action{
		controller.PowerRunning:   idlepolicy.ActionNone,
		controller.PowerPaused:    idlepolicy.ActionPause,
		controller.PowerSuspended: idlepolicy.ActionSuspend,
		controller.PowerStopped:   idlepolicy.ActionStop,
	}
	for power, want := range levels {
		got, ok := LevelOf(power)
		if !ok || got != want || (want != idlepolicy.ActionNone && PowerOf(want) != power) {
			t.Fatalf("LevelOf(%s) = %s %v", power, got, ok)
		}
	}
	if _, ok := LevelOf("asleep"); ok {
		t.Fatal("an unknown power is not a level")
	}
	if PowerOf(idlepolicy.ActionNone) != "" || PowerOf(idlepolicy.ActionClose) != "" {
		t.Fatal("none and close leave no power state")
	}
}
