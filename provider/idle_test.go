package provider

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// The loop reads the targets' answers as its own, keeping their words, and
// the template's power states as the policy's stages.
func TestIdleInventorySpeaksTheLoopsTerms(t *testing.T) {
	for _, c := range []struct{ targets, loop error }{
		{targets.ErrStale, idle.ErrStale},
		{targets.ErrRelayOpen, idle.ErrRelayOpen},
	} {
		err := error(idleAnswer{err: fmt.Errorf("wrapped: %w", c.targets), is: c.loop})
		if !errors.Is(err, c.loop) || !errors.Is(err, c.targets) || err.Error() != "wrapped: "+c.targets.Error() {
			t.Errorf("%v: the loop's %v and the targets' %v do not both match it", err, c.loop, c.targets)
		}
	}
	since := time.UnixMilli(1_700_000_000_000)
	v := targets.IdleView{Name: "ls-x", Phase: controller.PhaseActive, Power: controller.PowerPaused, Settled: true,
		Port: 19091, Location: "m1", Policy: &idlepolicy.Policy{}, IdleSince: since,
		PowerStates: []controller.Power{controller.PowerRunning, controller.PowerPaused, controller.PowerStopped}}
	got := idleTarget(&v)
	want := idle.Target{Name: "ls-x", Phase: controller.PhaseActive, Power: controller.PowerPaused, Settled: true,
		Port: 19091, Location: "m1", Policy: v.Policy, IdleSince: since, Stages: idlepolicy.StagePause | idlepolicy.StageStop}
	if got != want {
		t.Fatalf("idle target %+v, want %+v", got, want)
	}
}
