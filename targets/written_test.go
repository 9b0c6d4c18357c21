package targets

import (
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Two replicas' intent writes can both pass Incus's ETag check, and the
// one applied last stays (see written.go). Here the older request is
// applied over the newer one by hand, after the newer one's write: the
// replica that wrote the newer request records it again, and the target
// ends at the newer power, never at the older one's.
func TestAnOlderRequestAppliedOverANewerOneIsOvertakenAgain(t *testing.T) {
	h := newHarness(t)
	svc, _ := h.start(h.catalog)
	ctx := ctxT(t)
	o := owner("overtaken")
	ref := controller.TargetRef{Owner: o}
	if _, err := svc.CreateTarget(ctx, controller.CreateParams{Owner: o, TemplateID: "t1"}); err != nil {
		t.Fatal(err)
	}
	until(t, "active", func() (controller.Observation, error) { return svc.GetTarget(ctx, ref) }, isActive)

	asked := time.Now()
	if _, err := svc.SetPower(ctx, ref, controller.PowerPaused); err != nil {
		t.Fatal(err)
	}
	// Another replica's request for running, asked a second before the
	// pause, applied after it.
	older := Intent{Power: controller.PowerRunning, At: asked.Add(-time.Second), By: BySetPower}
	if err := h.client.PatchInstanceConfig(ctx, Name(o), older.config()); err != nil {
		t.Fatal(err)
	}
	until(t, "paused, the newer request", func() (controller.Observation, error) { return svc.GetTarget(ctx, ref) },
		func(o controller.Observation, err error) bool {
			return err == nil && o.Power == controller.PowerPaused && o.Message == ""
		})
	inst, _, err := h.client.GetInstance(ctx, Name(o))
	if err != nil {
		t.Fatal(err)
	}
	if got := intentOf(inst); got.Power != controller.PowerPaused {
		t.Fatalf("the instance records %+v, want the newer request (paused)", got)
	}
	// And it stays there: nothing carries out the older request later.
	time.Sleep(writtenLastLook + time.Second)
	if inst, _, err = h.client.GetInstance(ctx, Name(o)); err != nil {
		t.Fatal(err)
	}
	if inst.Status != incus.InstanceFrozen || intentOf(inst).Power != controller.PowerPaused {
		t.Fatalf("later: Incus shows %s with %+v recorded, want Frozen with paused", inst.Status, intentOf(inst))
	}
}
