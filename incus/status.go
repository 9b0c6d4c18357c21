package incus

// InstanceStatus is an instance's status as Incus names it. The provider
// decides on these values, never on a status text it was not written for:
// a status outside this list is reported as unknown, not guessed at.
type InstanceStatus string

// The instance statuses Incus 6.0 reports (and LXD 5.0 alike).
const (
	InstanceRunning  InstanceStatus = "Running"
	InstanceReady    InstanceStatus = "Ready" // running, and its agent said it is ready
	InstanceFrozen   InstanceStatus = "Frozen"
	InstanceStopped  InstanceStatus = "Stopped"
	InstanceError    InstanceStatus = "Error"
	InstanceStarting InstanceStatus = "Starting"
	InstancePending  InstanceStatus = "Pending"
	InstanceStopping InstanceStatus = "Stopping"
	InstanceShutdown InstanceStatus = "Shutdown"
	InstanceAborting InstanceStatus = "Aborting"
	InstanceFreezing InstanceStatus = "Freezing"
	InstanceThawed   InstanceStatus = "Thawed"
)

// Known says whether Incus's documentation names this status.
func (s InstanceStatus) Known() bool {
	switch s {
	case InstanceRunning, InstanceReady, InstanceFrozen, InstanceStopped, InstanceError,
		InstanceStarting, InstancePending, InstanceStopping, InstanceShutdown, InstanceAborting,
		InstanceFreezing, InstanceThawed:
		return true
	}
	return false
}

// Final says whether the instance rests in this status: Incus has no
// transition of it under way, so a state change asked for now is not
// refused as busy and the status will not change by itself. An unknown
// status is not final: nothing may be decided on it.
func (s InstanceStatus) Final() bool {
	switch s {
	case InstanceRunning, InstanceReady, InstanceFrozen, InstanceStopped, InstanceError:
		return true
	}
	return false
}

// Running says whether the instance's processes run (not frozen, not on
// the way anywhere).
func (s InstanceStatus) Running() bool { return s == InstanceRunning || s == InstanceReady }
