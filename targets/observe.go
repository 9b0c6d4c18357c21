package targets

import (
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Observe maps what Incus shows of an instance to the protocol's phase and
// power. It reports the infrastructure, never what a caller asked for.
func Observe(inst *incus.Instance, owner controller.Owner) controller.Observation {
	o := controller.Observation{TargetID: inst.Name, Owner: owner}
	_, booted := parseMs(inst.Config[keyBooted])
	switch {
	case inst.Config[keyClosing] != "":
		o.Phase = controller.PhaseClosing
		o.Message = "The instance is being stopped and deleted."
		return o
	case inst.Config[keyFailure] != "":
		o.Phase = controller.PhaseFailed
		o.Message = inst.Config[keyFailure]
		return o
	}
	active := func(p controller.Power, msg string) controller.Observation {
		o.Phase, o.Power, o.Message = controller.PhaseActive, p, msg
		return o
	}
	switch inst.Status {
	case "Running", "Ready", "Thawed":
		return active(controller.PowerRunning, "")
	case "Frozen":
		return active(controller.PowerPaused, "")
	case "Freezing":
		return active(controller.PowerRunning, "Pausing.")
	case "Stopping", "Shutdown", "Aborting":
		return active(controller.PowerRunning, "Stopping.")
	case "Stopped":
		if !booted {
			o.Phase, o.Message = controller.PhaseProvisioning, "Starting the instance."
			return o
		}
		if inst.Stateful {
			return active(controller.PowerSuspended, "")
		}
		return active(controller.PowerStopped, "")
	case "Starting", "Pending":
		if !booted {
			o.Phase, o.Message = controller.PhaseProvisioning, "Starting the instance."
			return o
		}
		return active(controller.PowerStopped, "Starting.")
	case "Error":
		o.Phase, o.Message = controller.PhaseFailed, "Incus reports the instance in an error state."
		return o
	default:
		o.Phase, o.Message = controller.PhaseUnknown, "Incus reports an instance status this provider does not know: "+inst.Status+"."
		return o
	}
}
