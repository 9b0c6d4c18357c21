package targets

import (
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// State is what an instance is, for every decision the provider takes on
// it: the protocol's phase and power as Incus shows them, whether Incus
// rests or has a transition under way, and the power recorded as wanted.
// Decisions read these fields; messages are written from them for people
// and never read back.
type State struct {
	Phase controller.Phase
	// Power is what Incus shows, present when Phase is active. During an
	// Incus transition it is the power the target still has.
	Power controller.Power
	// Status is Incus's own status of the instance.
	Status incus.InstanceStatus
	// Resting: Incus has no transition of the instance under way.
	Resting bool
	// Booted: the instance ran at least once (before that, a stopped
	// instance is still being provisioned).
	Booted bool
	// Intent is the power wanted: the one recorded (Recorded), except on
	// a target Incus runs although the power-down recorded was carried
	// out (PowerDone): something woke it since, which only a use does (a
	// dial's or an ingress request's wake, an operator). That is a
	// request for running made after the power-down, by a use, the
	// record of which may not have landed yet (a wake relays its dial
	// before it, and a crash may lose it): Intent says so, a millisecond
	// after the power-down.
	Intent Intent
	// Recorded is the intent as the instance records it; zero when none
	// is. A write of an intent compares with it.
	Recorded Intent
	// Failure is the reason recorded when the provider gave up on it.
	Failure string
	// Location is the cluster member of an instance whose state Incus
	// cannot tell (phase unknown).
	Location string
}

// Settled says the target is active, Incus rests, and it has the power
// wanted of it: nothing about its power is under way, and a new power
// decision (the idle loop's) may be taken on it.
func (st State) Settled() bool {
	return st.Phase == controller.PhaseActive && st.Resting &&
		(st.Intent.Power == "" || st.Intent.Power == st.Power)
}

// PowerPending says a recorded request for another power than the one the
// target has is not yet carried out.
func (st State) PowerPending() bool {
	return st.Phase == controller.PhaseActive && st.Intent.Power != "" &&
		(st.Intent.Power != st.Power || !st.Resting)
}

// RecordedPending is PowerPending for the recorded intent: a power-down
// recorded and not shown by Incus is pending here even where Intent reads
// the target as woken under it.
func (st State) RecordedPending() bool {
	return st.Phase == controller.PhaseActive && st.Recorded.Power != "" &&
		(st.Recorded.Power != st.Power || !st.Resting)
}

// StateOf reads an instance. It is the one place where Incus's statuses
// become the protocol's phases and powers.
func StateOf(inst *incus.Instance) State {
	r := recordOf(inst.Config, fState)
	return stateOf(inst, &r)
}

// stateOf is StateOf on the instance's record, decoded with fState.
func stateOf(inst *incus.Instance, r *record) State {
	booted := !r.Booted.IsZero()
	st := State{Status: inst.Status, Resting: inst.Status.Final(), Booted: booted, Intent: r.Intent, Recorded: r.Intent}
	switch {
	case r.has(fClosing):
		st.Phase = controller.PhaseClosing
		return st
	case r.Failure != "":
		st.Phase, st.Failure = controller.PhaseFailed, r.Failure
		return st
	}
	active := func(p controller.Power) State {
		st.Phase, st.Power = controller.PhaseActive, p
		if p == controller.PowerRunning && st.Resting && wokenUnder(r) {
			st.Intent = Intent{Power: controller.PowerRunning, At: r.Intent.At.Add(time.Millisecond), By: ByUse}
		}
		return st
	}
	switch inst.Status {
	case incus.InstanceRunning, incus.InstanceReady, incus.InstanceThawed,
		incus.InstanceFreezing, incus.InstanceStopping, incus.InstanceShutdown, incus.InstanceAborting, incus.InstanceFrozen:
		if !booted {
			// Running is not started yet: LXD shows a container Running
			// while its start operation still brings devices up, and
			// refuses every change to it meanwhile. The reconciler marks
			// the instance booted once no operation holds it.
			st.Phase = controller.PhaseProvisioning
			return st
		}
	}
	switch inst.Status {
	case incus.InstanceRunning, incus.InstanceReady, incus.InstanceThawed,
		incus.InstanceFreezing, incus.InstanceStopping, incus.InstanceShutdown, incus.InstanceAborting:
		return active(controller.PowerRunning)
	case incus.InstanceFrozen:
		return active(controller.PowerPaused)
	case incus.InstanceStopped, incus.InstanceStarting, incus.InstancePending:
		if !booted {
			st.Phase = controller.PhaseProvisioning
			return st
		}
		if inst.Status == incus.InstanceStopped && inst.Stateful {
			return active(controller.PowerSuspended)
		}
		return active(controller.PowerStopped)
	case incus.InstanceError:
		// Incus cannot tell the instance's state: on a cluster, the member
		// that holds it does not answer. Nothing is known to be broken, so
		// the target is unknown (never failed: the runtime would give it up).
		st.Phase, st.Location = controller.PhaseUnknown, inst.Location
		return st
	default:
		st.Phase = controller.PhaseUnknown
		return st
	}
}

// wokenUnder says r records a power-down that Incus carried out: an
// instance of it that runs was woken since.
func wokenUnder(r *record) bool {
	return r.Intent.Power != "" && r.Intent.Power != controller.PowerRunning &&
		!r.PowerDone.IsZero() && r.PowerDone.Equal(r.Intent.At)
}

// Observe maps an instance to the protocol's observation: what Incus
// shows, with a message saying what a transition waits for.
func Observe(inst *incus.Instance, owner controller.Owner) controller.Observation {
	return observation(inst, owner, StateOf(inst), nil, time.Time{})
}

// observation writes the observation of st for people. A move this process
// is carrying out may say more about what it waits for (p).
func observation(inst *incus.Instance, owner controller.Owner, st State, p *progress, now time.Time) controller.Observation {
	o := controller.Observation{TargetID: inst.Name, Owner: owner, Phase: st.Phase}
	switch st.Phase {
	case controller.PhaseClosing:
		o.Message = "The instance is being stopped and deleted."
	case controller.PhaseFailed:
		o.Message = st.Failure
		if o.Message == "" {
			o.Message = "Incus reports the instance in an error state."
		}
	case controller.PhaseProvisioning:
		o.Message = "Starting the instance."
	case controller.PhaseUnknown:
		switch {
		case st.Status == incus.InstanceError && st.Location != "" && st.Location != "none":
			o.Message = "The Incus cluster member " + st.Location + " that holds this target does not answer; the target is left as it is and observed again once the member is back."
		case st.Status == incus.InstanceError:
			o.Message = "Incus cannot tell this target's state (status Error); it is left as it is and observed again."
		default:
			o.Message = "Incus reports an instance status this provider does not know: " + string(st.Status) + "."
		}
	case controller.PhaseActive:
		o.Power = st.Power
		switch {
		case st.PowerPending() && st.Intent.Power != st.Power:
			o.Message = "Moving to " + string(st.Intent.Power) + p.detail(st.Intent.Power, now) + "."
		case !st.Resting:
			o.Message = transitionMessage(st.Status)
		}
	}
	return o
}

func transitionMessage(s incus.InstanceStatus) string {
	switch s {
	case incus.InstanceFreezing:
		return "Pausing."
	case incus.InstanceThawed:
		return "Resuming."
	case incus.InstanceStarting, incus.InstancePending:
		return "Starting."
	default:
		return "Stopping."
	}
}
