package provider_test

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/targets"
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
			var o controller.Observation
			var err error
			// As the runtime does: create until an id is recorded, retrying
			// what is retryable (unavailable, an answer without an id).
			for attempt := 0; ; attempt++ {
				o, err = callOn(ctl, "target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"})
				if attempt == 0 {
					mu.Lock()
					slowest = max(slowest, time.Since(start))
					mu.Unlock()
				}
				if err == nil && o.TargetID != "" {
					break
				}
				if (err != nil && !retryable(err)) || attempt == 30 {
					t.Errorf("%s: create, attempt %d: %+v %v", owner.EnvironmentID, attempt+1, o, err)
					return
				}
				time.Sleep(2 * time.Second)
			}
			mu.Lock()
			withID++
			mu.Unlock()
			ref := controller.TargetRef{Owner: owner, TargetID: o.TargetID}
			at := time.Now()
			for _, after := range []time.Duration{0, 500 * time.Millisecond, 2 * time.Second} {
				time.Sleep(time.Until(at.Add(after)))
				got, err := callOn(ctl, "target/get", controller.TargetParams{Target: ref})
				for retry := 0; err != nil && retryable(err) && retry < 10; retry++ {
					// Unavailable is retried; notFound is the defect this test is for.
					time.Sleep(500 * time.Millisecond)
					got, err = callOn(ctl, "target/get", controller.TargetParams{Target: ref})
				}
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

// Dozens of owners close right after their create's answer, while Incus may
// still be unpacking their images (its record is written first, and a close
// is recorded on it at once). Incus takes a delete then, and the dir
// driver's removal races the unpack: the create fails, and a half-removed
// root filesystem stays behind, which CI's image stage met as "directory
// not empty" and "storage pool not found" on later calls. Afterwards
// nothing may be left: no instance, and no storage directory of any owner.
func TestClosesRightAfterCreatesLeaveNothing(t *testing.T) {
	const owners = 24
	r := newRig(t, rigOptions{})
	var wg sync.WaitGroup
	errs := make(chan error, owners)
	all := make([]controller.Owner, owners)
	for i := range owners {
		all[i] = controller.Owner{UniverseID: "u-load", EnvironmentID: fmt.Sprintf("env-quick-close-%02d", i)}
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := all[i]
			ctl := r.connect()
			defer func() { _ = ctl.Close() }()
			if _, err := callOn(ctl, "target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"}); err != nil {
				errs <- fmt.Errorf("%s: create: %w", owner.EnvironmentID, err)
				return
			}
			// As the runtime closes: until closed, whatever it answers.
			deadline := time.Now().Add(90 * time.Second)
			for {
				o, err := callOn(ctl, "target/close", controller.TargetParams{Target: controller.TargetRef{Owner: owner}})
				if err == nil && o.Phase == controller.PhaseClosed {
					return
				}
				if time.Now().After(deadline) {
					if err != nil {
						errs <- fmt.Errorf("%s: never closed: %w", owner.EnvironmentID, err)
					} else {
						errs <- fmt.Errorf("%s: never closed: last answer %+v", owner.EnvironmentID, o)
					}
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	r.closeAll(all...)
	pool := filepath.Join(filepath.Dir(incustest.Socket()), "storage-pools/default/containers")
	for _, o := range all {
		dir := filepath.Join(pool, r.client.Project()+"_"+targets.Name(o))
		if _, err := os.Lstat(dir); err == nil {
			t.Errorf("%s: its storage directory %s is left behind", o.EnvironmentID, dir)
		} else if !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
}
