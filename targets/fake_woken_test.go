package targets

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
	"github.com/lightspeed-dev/incus-provider/relays"
)

// A power-down Incus carried out is recorded as such on the instance
// (power_done_ms is the request's own power_at_ms), whether the action
// was needed or the target already had that power.
func TestFakeAPowerDownCarriedOutIsMarked(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, tc := range []struct {
		env    string
		from   incus.InstanceStatus
		to     controller.Power
		status incus.InstanceStatus
	}{
		{"env-mark-pause", incus.InstanceRunning, controller.PowerPaused, incus.InstanceFrozen},
		{"env-mark-stop", incus.InstanceRunning, controller.PowerStopped, incus.InstanceStopped},
		{"env-mark-already", incus.InstanceFrozen, controller.PowerPaused, incus.InstanceFrozen},
	} {
		o := fakeOwner(tc.env)
		power := controller.PowerRunning
		if tc.from == incus.InstanceFrozen {
			power = controller.PowerPaused
		}
		name := r.seedTarget(o, tc.from, power)
		if _, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, tc.to); err != nil {
			t.Fatalf("%s: setPower %s: %v", tc.env, tc.to, err)
		}
		r.awaitFake(tc.env+" marked carried out", 10*time.Second, func() bool {
			v := r.instance(name)
			return v.Status == tc.status && v.Config[keyPower] == string(tc.to) && v.Config[keyPowerDone] != "" &&
				v.Config[keyPowerDone] == v.Config[keyPowerAt]
		})
	}
}

// A target Incus runs under a power-down recorded as carried out was
// woken since, by a use whose own record may have been lost with the
// process that relayed it: a new process reads that as a use's request for
// running and leaves the target up. Without the mark, the same state is a
// power-down not carried out yet, and it is.
func TestFakeATargetWokenUnderAMarkedPowerDownStaysUp(t *testing.T) {
	for _, done := range []bool{true, false} {
		t.Run(map[bool]string{true: "marked", false: "unmarked"}[done], func(t *testing.T) {
			r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: 50 * time.Millisecond})
			o := fakeOwner("env-woken")
			name := r.seedTargetWith(o, incus.InstanceRunning, controller.PowerPaused, done)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if !done {
				r.awaitFake("the pause carried out", 10*time.Second, func() bool { return r.instance(name).Status == incus.InstanceFrozen })
				return
			}
			inst, _, err := r.client.GetInstance(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			st := StateOf(inst)
			if st.Intent.Power != controller.PowerRunning || st.Intent.By != ByUse || !st.Intent.At.After(st.Recorded.At) || st.PowerPending() {
				t.Fatalf("woken under a marked pause: intent %+v, recorded %+v", st.Intent, st.Recorded)
			}
			// A use still records its request: PowerDownPending reads the
			// record (Incus may show a target it just stopped running for a
			// moment, which no use woke).
			if !r.svc.PowerDownPending(routeFor(inst), time.Now()) || !st.RecordedPending() {
				t.Fatal("a use of a target running under a recorded pause does not record its own request")
			}
			// Many reconcile passes later, Incus still runs it.
			time.Sleep(time.Second)
			if v := r.instance(name); v.Status != incus.InstanceRunning {
				t.Fatalf("Incus shows %s, want Running\n%s", v.Status, r.history(name))
			}
			obs, err := r.svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: name})
			if err != nil || obs.Phase != controller.PhaseActive || obs.Power != controller.PowerRunning {
				t.Fatalf("target/get: %+v %v", obs, err)
			}
			// A setPower asked now is newer, and is carried out.
			if _, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerPaused); err != nil {
				t.Fatal(err)
			}
			r.awaitFake("the newer pause carried out", 10*time.Second, func() bool { return r.instance(name).Status == incus.InstanceFrozen })
		})
	}
}

// A wake of a target whose power-down is marked carried out says the use
// may be relayed right after its action, while its record is still on the
// way; one of an unmarked power-down says nothing until Wake answers.
func TestFakeAWakeOfAMarkedPowerDownIsRelayableBeforeItsRecord(t *testing.T) {
	for _, done := range []bool{true, false} {
		t.Run(map[bool]string{true: "marked", false: "unmarked"}[done], func(t *testing.T) {
			r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: time.Hour})
			o := fakeOwner("env-early")
			// Unmarked: frozen with no power-down recorded (an operator's
			// freeze), which no reconcile pass marks.
			power := controller.PowerPaused
			if !done {
				power = ""
			}
			name := r.seedTargetWith(o, incus.InstanceFrozen, power, done)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			relayable := make(chan struct{})
			record, wakeDone := r.wakeHeld(ctx, name, http.MethodPatch, "", time.Now(), func() { close(relayable) })
			select {
			case <-relayable:
				if !done {
					t.Fatal("relayable before the record, with no mark to tell of the use")
				}
			default:
				if done {
					t.Fatal("not relayable while the record is held, though the pause was marked carried out")
				}
			}
			if v := r.instance(name); v.Status != incus.InstanceRunning {
				t.Fatalf("Incus shows %s while the record is held, want Running", v.Status)
			}
			record.Release()
			if err := <-wakeDone; err != nil {
				t.Fatalf("wake: %v\n%s", err, r.history(name))
			}
			v := r.instance(name)
			if v.Config[keyPower] != string(controller.PowerRunning) || v.Config[keyPowerBy] != string(ByUse) {
				t.Fatalf("after the wake the record is %s by %s, want running by use", v.Config[keyPower], v.Config[keyPowerBy])
			}
		})
	}
}

// Marking a power-down carried out lists Incus's tasks, which on a
// cluster asks every member; one slow to answer held a replica's dials
// past their 5 s hold (a member had just restarted). The mark is no part
// of the power-down: once the target is frozen, a dial is admitted and
// its wake takes the turn, while the listing still hangs. Without that,
// the dial waits for the hang (here for good: it is released only at the
// end).
func TestFakeAWakeDoesNotWaitForAMark(t *testing.T) {
	r := newFakeRig(t, fakeDurations(seeded(t)), Config{GracefulStop: time.Second, ReconcileInterval: 100 * time.Millisecond, NoCache: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	o := fakeOwner("env-mark-hangs")
	name := r.seedTarget(o, incus.InstanceRunning, controller.PowerRunning)
	hang := r.fake.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: http.MethodGet, Path: "/1.0/operations"})
	defer hang.Release()
	if _, err := r.svc.SetPower(ctx, controller.TargetRef{Owner: o, TargetID: name}, controller.PowerPaused); err != nil {
		t.Fatalf("setPower paused: %v", err)
	}
	r.awaitFake("frozen", 10*time.Second, func() bool { return r.instance(name).Status == incus.InstanceFrozen })
	select {
	case <-hang.Hit():
	case <-ctx.Done():
		t.Fatal("the mark never listed Incus's tasks")
	}

	// The dial is admitted while the mark's listing hangs.
	var tk *relays.Ticket
	for deadline := time.Now().Add(5 * time.Second); tk == nil; {
		var quiet <-chan struct{}
		if tk, quiet = r.svc.relays.Enter(name, time.Now()); tk != nil {
			break
		}
		select {
		case <-quiet:
		case <-time.After(time.Until(deadline)):
			t.Fatal("the power-down's guard still holds dials off while its mark waits on Incus")
		}
	}
	defer tk.Leave()
	// Its wake takes the turn from the mark, acts and records running.
	rt, err := r.svc.ResolveRoute(ctx, o, name)
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	defer wcancel()
	if _, err := r.svc.Wake(wctx, rt, time.Now(), nil); err != nil {
		t.Fatalf("the wake waited for the mark's listing: %v", err)
	}
	v := r.instance(name)
	if v.Status != incus.InstanceRunning || v.Config[keyPower] != string(controller.PowerRunning) {
		t.Fatalf("after the wake: %s, power %q", v.Status, v.Config[keyPower])
	}
	if hang.Hits() == 0 {
		t.Fatal("the listing was never held")
	}
	hang.Release()
	r.awaitFake("left running", 5*time.Second, func() bool {
		v := r.instance(name)
		return restsAt(v, incus.InstanceRunning, controller.PowerRunning)
	})
}
