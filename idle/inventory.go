package idle

import (
	"context"
	"errors"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

// Target is one of the provider's targets as the loop needs to see it.
type Target struct {
	// Name is the Incus instance name (the target id).
	Name string
	// Phase and Power are the controller plane's observation: Power is set
	// exactly when Phase is active.
	Phase controller.Phase
	Power controller.Power
	// Settled is false while Incus moves the target between power states
	// or a power request for it is not yet carried out (targets.State.Settled).
	Settled bool
	// PhaseSince is when the target entered a passing phase: its create
	// for provisioning, its recorded close for closing; zero otherwise or
	// when unknown. It feeds the oldest-target gauge that tells a stuck
	// target from steady churn.
	PhaseSince time.Time
	// Port is the guest daemon's port on the guest's loopback.
	Port int
	// Location is the cluster member holding the instance (empty when
	// standalone); the dialer needs it to pick its way to the guest.
	Location string
	// Policy is the target's idle policy (the template's default or the one
	// target/create named); nil when it has none.
	Policy *idlepolicy.Policy
	// Stages are the power-down stages the target's template offers.
	Stages idlepolicy.Stages
	// IdleSince is the instant idleness began, recorded when the provider
	// powered the target down; zero when none is recorded.
	IdleSince time.Time
}

// Inventory is what the loop asks of the provider's targets:
// provider.IdleInventory puts the targets package's own terms in the
// loop's.
type Inventory interface {
	// IdleTargets lists every target the provider owns, whatever its phase
	// (the loop keeps the targets gauge from it).
	IdleTargets(ctx context.Context) ([]Target, error)
	// RelaysOpen counts the data relays open to the target now.
	RelaysOpen(name string) int
	// RelayEndedSince says a relay or a dial of the target ended at or
	// after since: a reading of the daemon's idle clock asked for then may
	// have missed a use it carried.
	RelayEndedSince(name string, since time.Time) bool
	// IdleAct applies an idle action to a target the loop last saw as t:
	// pause, suspend or stop it, recording idleSince as the instant its
	// idleness began, or close it through the normal close path. It checks
	// first, under the target's lock, that the target is still as t says
	// and that no relay is open or has ended since readAt (when the idle
	// reading the action rests on was asked for), and answers ErrStale or
	// ErrRelayOpen without acting otherwise.
	IdleAct(ctx context.Context, t Target, action idlepolicy.Action, idleSince, readAt time.Time) error
}

// ErrStale says the target changed since the loop looked at it (woken by a
// data route, powered by target/setPower, closed): the loop acts on
// nothing it has not seen.
var ErrStale = errors.New("idle: the target changed since the idle loop looked at it")

// ErrRelayOpen says a data relay to the target is open: the provider never
// powers down a target while it relays a data connection to it.
var ErrRelayOpen = errors.New("idle: a data relay to the target is open")

// Watcher is implemented by an Inventory that can say which targets it
// changed (a new target booted, a wake, a power change asked for), so that
// the loop looks at them at once instead of at its next listing: a new
// target's first probe, and a woken one's fresh idle clock, then do not
// wait for the refresh interval.
type Watcher interface {
	// Changes delivers the names of changed targets. It may drop names;
	// the periodic listing catches up.
	Changes() <-chan string
	// IdleTarget reads one target as IdleTargets lists it; ok is false
	// when there is no such target.
	IdleTarget(ctx context.Context, name string) (t Target, ok bool, err error)
}
