package idle

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// The targets gauge follows the inventory's change notes, not only its
// listings: with listings an hour apart, a create, a power change and a
// close each show once the noted target is read.
func TestTargetsGaugeFollowsChangeNotes(t *testing.T) {
	h := newHarness(t)
	w := &watchingInventory{fakeInventory: h.inv, changes: make(chan string, 8)}
	h.inv.add(Target{Name: "old", Power: controller.PowerRunning, Stages: containerStages})
	l, stop := h.run(func(c *Config) {
		c.Inventory = w
		c.RefreshInterval = time.Hour
	})
	defer stop()
	gauge := func(phase, power string) float64 {
		return testutil.ToFloat64(l.m.targets.WithLabelValues(phase, power))
	}
	eventually(t, "the first listing counted", func() bool { return gauge("active", "running") == 1 })

	created := time.Now().Add(-10 * time.Minute)
	h.inv.add(Target{Name: "new", Phase: controller.PhaseProvisioning, Location: "m1", PhaseSince: created})
	w.changes <- "new"
	// The gauge moves before the oldest instant and the per-member count
	// (in the loop's goroutine): wait for all three.
	eventually(t, "a created target counted", func() bool {
		return gauge("provisioning", "none") == 1 && testutil.ToFloat64(l.m.byMember.WithLabelValues("m1", "provisioning")) == 1 &&
			l.m.oldestAge(controller.PhaseProvisioning, time.Now()) > 0
	})
	if age := l.m.oldestAge(controller.PhaseProvisioning, time.Now()); age < 600 || age > 700 {
		t.Fatalf("oldest provisioning target is %v s old, want about 600", age)
	}
	if got := testutil.ToFloat64(l.m.byMember.WithLabelValues("m1", "provisioning")); got != 1 {
		t.Fatalf("targets_by_member{m1,provisioning} = %v, want 1", got)
	}

	h.inv.set("new", func(t *Target) { t.Phase, t.Power, t.Settled = controller.PhaseActive, controller.PowerPaused, true })
	w.changes <- "new"
	eventually(t, "its power change counted", func() bool {
		return gauge("provisioning", "none") == 0 && gauge("active", "paused") == 1 &&
			l.m.oldestAge(controller.PhaseProvisioning, time.Now()) == 0
	})
	if age := l.m.oldestAge(controller.PhaseProvisioning, time.Now()); age != 0 {
		t.Fatalf("no target provisions, yet the oldest is %v s old", age)
	}

	h.inv.set("old", func(t *Target) { t.Phase, t.Power = controller.PhaseClosing, "" })
	w.changes <- "old"
	eventually(t, "a close counted", func() bool { return gauge("active", "running") == 0 && gauge("closing", "none") == 1 })
	h.inv.mu.Lock()
	delete(h.inv.targets, "old")
	h.inv.mu.Unlock()
	w.changes <- "old"
	eventually(t, "a removed target uncounted", func() bool { return gauge("closing", "none") == 0 })
	if got := gauge("active", "paused"); got != 1 {
		t.Fatalf("active/paused = %v after another target closed, want 1", got)
	}
	h.inv.mu.Lock()
	n := h.inv.lists
	h.inv.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d listings: the gauge must have moved on notes alone", n)
	}
}
