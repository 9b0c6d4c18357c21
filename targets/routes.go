package targets

import (
	"context"
	"errors"
	"fmt"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Data-route answers of ResolveRoute. Both are refusals that no later dial
// of the same route can turn into a success.
var (
	// ErrRouteGone: the owner holds no such target (never created, closed,
	// or a target id that is not this provider's).
	ErrRouteGone = errors.New("targets: the owner holds no such target")
	// ErrRouteOwner: the target id names a target of another owner (or an
	// instance whose recorded owner differs). Nothing about that target is
	// read or changed.
	ErrRouteOwner = errors.New("targets: the target belongs to another owner")
	// ErrRelayOpen is what IdleAct answers when the target relays a data
	// connection, or a dial of its data route is in progress (or came
	// while the power-down waited and replaced it): the provider never
	// powers a target down under a relay. It matches idle.ErrRelayOpen,
	// which the idle loop treats as "not idle"; an explicit power change
	// closes the relays first.
	ErrRelayOpen = fmt.Errorf("targets: not powering the target down: %w", idle.ErrRelayOpen)
)

// ResolveRoute fences a data route before anything else. A targetID that is
// not the owner's own derived name is refused without asking Incus anything
// (another owner's id: ErrRouteOwner, anything else: ErrRouteGone), so a
// route of the wrong owner reaches nothing, whatever that target's state.
// Otherwise the owner's instance is read once (from the observation cache
// when it is confirmed, see cache.go); a missing one is
// ErrRouteGone, one whose recorded owner differs ErrRouteOwner. Both, and
// an observation a dial is refused for good on (closing, closed, failed),
// are read from Incus, never from the cache alone (readSure). Any other
// error is Incus's, unchanged. Nothing is ever changed.
func (s *Service) ResolveRoute(ctx context.Context, owner controller.Owner, targetID string) (*incus.Instance, controller.Observation, error) {
	name := Name(owner)
	if targetID != name {
		if looksLikeTargetID(targetID) {
			return nil, controller.Observation{}, ErrRouteOwner
		}
		return nil, controller.Observation{}, ErrRouteGone
	}
	inst, err := s.readFor(owner)(ctx, name)
	if err != nil {
		return nil, controller.Observation{}, err
	}
	if inst == nil {
		return nil, controller.Observation{}, ErrRouteGone
	}
	if err := checkOwned(inst, owner); err != nil {
		return nil, controller.Observation{}, ErrRouteOwner
	}
	return inst, Observe(inst, owner), nil
}
