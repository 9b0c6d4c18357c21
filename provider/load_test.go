package provider_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// Many owners create at once, and each observes the id its create handed
// out at once, half a second later and two seconds later (the runtime's
// own pace): an id handed out is never notFound. Then every owner closes
// and nothing is left in Incus.
func TestManyOwnersCreateAndObserveAtOnce(t *testing.T) {
	const owners = 40
	r := newRig(t, rigOptions{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var slowest time.Duration
	withID := 0
	for i := range owners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := controller.Owner{UniverseID: "u-load", EnvironmentID: fmt.Sprintf("env-%02d", i)}
			// A connection per owner, as many runtimes would hold.
			ctl := r.connect()
			defer func() { _ = ctl.Close() }()
			start := time.Now()
			o, err := callOn(ctl, "target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"})
			took := time.Since(start)
			mu.Lock()
			slowest = max(slowest, took)
			mu.Unlock()
			if err != nil {
				t.Errorf("%s: create: %v", owner.EnvironmentID, err)
				return
			}
			for o.TargetID == "" {
				// An answer without an id: the runtime asks again.
				time.Sleep(2 * time.Second)
				if o, err = callOn(ctl, "target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"}); err != nil {
					t.Errorf("%s: create again: %v", owner.EnvironmentID, err)
					return
				}
			}
			mu.Lock()
			withID++
			mu.Unlock()
			ref := controller.TargetRef{Owner: owner, TargetID: o.TargetID}
			at := time.Now()
			for _, after := range []time.Duration{0, 500 * time.Millisecond, 2 * time.Second} {
				time.Sleep(time.Until(at.Add(after)))
				got, err := callOn(ctl, "target/get", controller.TargetParams{Target: ref})
				if err != nil {
					t.Errorf("%s: get %s after the id was handed out: %v", owner.EnvironmentID, after, err)
					return
				}
				if got.TargetID != o.TargetID || got.Phase == controller.PhaseClosed || got.Phase == controller.PhaseFailed {
					t.Errorf("%s: get %s after: %+v", owner.EnvironmentID, after, got)
					return
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("%d owners, slowest create answer %s", owners, slowest.Round(time.Millisecond))
	if withID != owners {
		t.Fatalf("%d of %d owners got an id", withID, owners)
	}
	// Every owner closes; nothing is left.
	all := make([]controller.Owner, owners)
	for i := range all {
		all[i] = controller.Owner{UniverseID: "u-load", EnvironmentID: fmt.Sprintf("env-%02d", i)}
	}
	r.closeAll(all...)
}
