package targets

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Route is a target as a data route or a public ingress request finds it,
// decided here so that those who hold it never read an instance: the
// owner's own target (the fence passed), what Incus shows of it now, and
// where its daemon is reached. Only ResolveRoute makes one.
type Route struct {
	// Name is the instance's name, which is the target id.
	Name string
	// Owner is the owner the fence checked the target against.
	Owner controller.Owner
	// State is what Incus shows of the target's processes now.
	State RouteState
	// Observation is the target's observation from the same read
	// (Observe): its phase, and its power when it is active.
	Observation controller.Observation
	// Daemon is where the GuestDialer reaches the target's daemon: the
	// port the instance records (guest.DefaultPort when none) and the
	// cluster member that holds it.
	Daemon guest.Target

	// inst is the instance as the route read it, for the calls that take
	// the route back (Wake, PowerDownPending): they decide on what the
	// route's holder saw, as a moment-old read.
	inst *incus.Instance
}

// RouteState is what Incus shows of a routed target's processes: what a
// wake decides on. The observation's power cannot say it: during a
// transition it is the power the target still has, and a target being
// provisioned has none.
type RouteState uint8

const (
	// RouteOther is any other status: a transition Incus finishes on its
	// own (freezing, thawed, stopping, starting) or one no wake acts on.
	RouteOther RouteState = iota
	// RouteRunning: the processes run, so the daemon may answer.
	RouteRunning
	// RoutePaused: frozen. An unfreeze wakes it, and its daemon answers
	// the moment it thaws.
	RoutePaused
	// RouteStopped: stopped, a stateful stop included. A start wakes it,
	// and its daemon listens only once it has booted.
	RouteStopped
)

// routeOf describes inst, whose owner the fence has checked.
func routeOf(inst *incus.Instance, owner controller.Owner) Route {
	state := RouteOther
	switch {
	case inst.Status.Running():
		state = RouteRunning
	case inst.Status == incus.InstanceFrozen:
		state = RoutePaused
	case inst.Status == incus.InstanceStopped:
		state = RouteStopped
	}
	port := DaemonPort(inst)
	if port == 0 {
		port = guest.DefaultPort
	}
	return Route{Name: inst.Name, Owner: owner, State: state, Observation: Observe(inst, owner),
		Daemon: guest.Target{Instance: inst.Name, Port: port, Location: inst.Location}, inst: inst}
}

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
)

// A route's read that failed on Incus's side is read again after
// resolveRetryPause, while at least resolveRetryRoom of the caller's
// deadline is left, at most resolveTries times in all (a caller without a
// deadline waits no longer than that).
const (
	resolveTries      = 8
	resolveRetryPause = 50 * time.Millisecond
	resolveRetryRoom  = 250 * time.Millisecond
)

// roomFor says whether ctx leaves at least d before its deadline (or has
// none).
func roomFor(ctx context.Context, d time.Duration) bool {
	dl, ok := ctx.Deadline()
	return !ok || time.Until(dl) >= d
}

// errNotResolved: a route that ResolveRoute did not answer (a zero Route)
// was given back to the service, which has no read of the target to go by.
var errNotResolved = errors.New("targets: the route was not resolved")

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
func (s *Service) ResolveRoute(ctx context.Context, owner controller.Owner, targetID string) (Route, error) {
	name := Name(owner)
	if targetID != name {
		switch {
		case isReadyName(targetID):
			// A ready spare handed out: read, and fenced by its claim below.
			name = targetID
		case looksLikeTargetID(targetID):
			return Route{}, ErrRouteOwner
		default:
			return Route{}, ErrRouteGone
		}
	}
	inst, err := s.readFor(owner)(ctx, name)
	// One read is bounded well short of a dial's hold (getAttempt: a
	// cluster member that does not answer leaves time to ask the list),
	// and a single Incus that is merely slow (a storm of wakes) can miss
	// that bound. A refusal while the hold could still see an answer is a
	// refusal too many: the read is tried again while the caller's
	// deadline leaves room for one more.
	for try := 1; try < resolveTries && err != nil && memberTrouble(err) && ctx.Err() == nil && roomFor(ctx, resolveRetryRoom); try++ {
		s.log.Debug("a route's read of the target failed; reading again", zap.String("instance", name), zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(resolveRetryPause):
		}
		inst, err = s.readFor(owner)(ctx, name)
	}
	if err != nil {
		return Route{}, err
	}
	if inst != nil && standinOf(inst) != "" {
		// Only a target's own id reaches it: the runtime holds the spare's.
		inst = nil
	}
	if inst == nil {
		return Route{}, ErrRouteGone
	}
	if err := checkOwned(inst, owner); err != nil {
		return Route{}, ErrRouteOwner
	}
	rt := routeOf(inst, owner)
	if rt.State == RouteRunning {
		// Relayed as it is unless a power-down is in sight: the ones a
		// killed process kept must be (keptKnown).
		if err := s.kept.wait(ctx); err != nil {
			return Route{}, err
		}
	}
	return rt, nil
}
