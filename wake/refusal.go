package wake

import (
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// State is why a use of a target cannot be served now: the states the
// contract names for a refused data-route dial, which the public ingress
// answers in its own way.
type State string

// The refusal states.
const (
	StateWaking  State = "waking"  // resuming from a powered-down state
	StateBooting State = "booting" // running, the daemon does not answer yet
	StateGone    State = "gone"    // the target no longer exists
	StateFailed  State = "failed"  // broken beyond the provider's recovery
)

// Refusal is a typed answer to a use that is not served.
type Refusal struct {
	State State
	// Message says what broke the target, with StateFailed only.
	Message string
	// RetryAfter is when a use should come back, with the states a wait
	// can change (waking, booting).
	RetryAfter time.Duration
}

func (r *Refusal) Error() string {
	s := "data route refused: " + string(r.State)
	if r.Message != "" {
		s += ": " + r.Message
	}
	return s
}

// DefaultFailedMessage stands in for a failure the observation did not
// explain.
const DefaultFailedMessage = "The target is broken beyond the provider's recovery."

// Terminal is the answer to a use of a target in a phase no wait can
// change (closing, closed, failed, unknown); nil for any other phase.
func Terminal(o controller.Observation) *Refusal {
	switch o.Phase {
	case controller.PhaseClosing, controller.PhaseClosed:
		return refuse(StateGone, 0)
	case controller.PhaseFailed:
		msg := o.Message
		if msg == "" {
			msg = DefaultFailedMessage
		}
		return &Refusal{State: StateFailed, Message: msg}
	case controller.PhaseUnknown:
		// Incus cannot tell (a cluster member down): no wait within a
		// hold would change that, and a wake must not touch the target.
		return refuse(StateBooting, 5*time.Second)
	}
	return nil
}

func refuse(state State, retry time.Duration) *Refusal {
	return &Refusal{State: state, RetryAfter: retry}
}
