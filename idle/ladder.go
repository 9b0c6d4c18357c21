package idle

import (
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

// PowerOf is the power state an action leaves a target in ("" for
// ActionNone and ActionClose, which leave no active target). It lives here
// rather than on idlepolicy.Action because the names are the controller
// plane's, and controller imports idlepolicy.
func PowerOf(a idlepolicy.Action) controller.Power {
	switch a {
	case idlepolicy.ActionPause:
		return controller.PowerPaused
	case idlepolicy.ActionSuspend:
		return controller.PowerSuspended
	case idlepolicy.ActionStop:
		return controller.PowerStopped
	default:
		return ""
	}
}

// LevelOf places a power state on the escalation ladder: the action that
// leaves a target in that state, ActionNone for running. ok is false for a
// name the protocol does not know.
func LevelOf(power controller.Power) (level idlepolicy.Action, ok bool) {
	switch power {
	case controller.PowerRunning:
		return idlepolicy.ActionNone, true
	case controller.PowerPaused:
		return idlepolicy.ActionPause, true
	case controller.PowerSuspended:
		return idlepolicy.ActionSuspend, true
	case controller.PowerStopped:
		return idlepolicy.ActionStop, true
	}
	return idlepolicy.ActionNone, false
}

// StagesOf reads a template's powerStates: paused allows the pause stage,
// suspended the suspend stage, stopped the stop stage; running and unknown
// names allow nothing.
func StagesOf(powerStates []controller.Power) idlepolicy.Stages {
	var s idlepolicy.Stages
	for _, p := range powerStates {
		switch p {
		case controller.PowerPaused:
			s |= idlepolicy.StagePause
		case controller.PowerSuspended:
			s |= idlepolicy.StageSuspend
		case controller.PowerStopped:
			s |= idlepolicy.StageStop
		}
	}
	return s
}
