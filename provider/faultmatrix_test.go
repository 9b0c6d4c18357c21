package provider_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// The fault matrix: each fault the proxy can inject, on each kind of Incus
// call the provider makes, during a whole target life driven as the
// runtime drives it (create until an id, setPower once and follow, wake by
// dialing, close until closed). Every answer is bounded and typed, the life
// completes once the fault has passed, and nothing is left in Incus.
func TestFaultMatrix(t *testing.T) {
	calls := []struct{ method, path string }{
		{"POST", "/1.0/instances"},
		{"GET", "/1.0/instances/*"},
		{"PATCH", "/1.0/instances/*"},
		{"PUT", "/1.0/instances/*/state"},
		{"DELETE", "/1.0/instances/*"},
		{"GET", "/1.0/operations/*/wait"},
	}
	faults := []incusfault.Rule{
		{Fault: incusfault.Refuse, Times: 2},
		{Fault: incusfault.Fail, Status: 503, Message: "injected", Times: 2},
		{Fault: incusfault.Fail, Status: 500, Message: "injected", Times: 1},
		{Fault: incusfault.DropResponse, Times: 1},
		{Fault: incusfault.Delay, Delay: 3 * time.Second, Times: 1},
		{Fault: incusfault.BlackHole, Times: 1},
	}
	// One provider and one fault proxy per kind of call, the kinds at once:
	// a rule matches every call of its kind through its proxy, so only
	// lives on separate proxies can run side by side. Within a kind the
	// lives run one after another, each fault alone.
	for ci, c := range calls {
		t.Run(c.method+" "+c.path, func(t *testing.T) {
			t.Parallel()
			r, proxy := faultRig(t)
			for fi, f := range faults {
				rule := f
				rule.Method, rule.Path = c.method, c.path
				owner := controller.Owner{UniverseID: "u-matrix", EnvironmentID: fmt.Sprintf("env-%02d", ci*len(faults)+fi+1)}
				id := proxy.Add(rule)
				if err := life(r, owner); err != nil {
					t.Errorf("%s: %v", rule, err)
				}
				hits := proxy.Hits(id)
				proxy.Remove(id)
				t.Logf("%s: hit %d times", rule, hits)
				if hits == 0 {
					t.Errorf("%s: the fault was never hit, so this life tested nothing of it", rule)
				}
			}
			list, err := r.client.ListInstances(r.ctx())
			if err != nil {
				t.Fatal(err)
			}
			if len(list) != 0 {
				t.Fatalf("%d instances left after every life ended", len(list))
			}
		})
	}
}

// life drives one owner's target from create to closed as the runtime does,
// with every answer bounded and every refusal typed and retried.
func life(r *rig, owner controller.Owner) error {
	deadline := time.Now().Add(90 * time.Second)
	ref := controller.TargetRef{Owner: owner}
	step := func(what string, call func() (controller.Observation, error), done func(controller.Observation) bool) error {
		for {
			start := time.Now()
			o, err := call()
			if took := time.Since(start); took > answerBound {
				return fmt.Errorf("%s answered after %s", what, took.Round(time.Millisecond))
			}
			switch {
			case err == nil && done(o):
				return nil
			case err != nil && !retryable(err):
				return fmt.Errorf("%s: %w", what, err)
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s never done: last %+v %w", what, o, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	var id string
	if err := step("create", func() (controller.Observation, error) {
		return r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"})
	}, func(o controller.Observation) bool { id = o.TargetID; return id != "" }); err != nil {
		return err
	}
	if err := step("get until active", func() (controller.Observation, error) {
		return r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner, TargetID: id}})
	}, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
	}); err != nil {
		return err
	}
	asked := false
	if err := step("setPower paused", func() (controller.Observation, error) {
		if asked {
			return r.get(owner)
		}
		o, err := r.setPower(owner, controller.PowerPaused)
		asked = err == nil
		return o, err
	}, func(o controller.Observation) bool {
		return o.Power == controller.PowerPaused && o.Message == ""
	}); err != nil {
		return err
	}
	for {
		d := r.dial(routeOf(owner, id))
		if d.Conn != nil {
			initialize(r.t, d.Conn)
			d.Conn.Close()
			break
		}
		if d.Refusal.State != "waking" && d.Refusal.State != "booting" {
			return fmt.Errorf("the waking dial was refused %s", d.Refusal.State)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("never woken: %+v", d.Refusal)
		}
		time.Sleep(d.Refusal.RetryAfter)
	}
	return step("close", func() (controller.Observation, error) {
		return r.closeTarget(ref.Owner)
	}, func(o controller.Observation) bool { return o.Phase == controller.PhaseClosed })
}

// retryable is what the runtime retries: unavailable, busy, and a target
// not active yet.
func retryable(err error) bool {
	var e *jsonrpc.Error
	if !errors.As(err, &e) {
		return false
	}
	return e.Kind == jsonrpc.KindUnavailable || e.Kind == jsonrpc.KindBusy ||
		e.Kind == jsonrpc.KindFailedPrecondition && e.Reason == "targetNotActive"
}
