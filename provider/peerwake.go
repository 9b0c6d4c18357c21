package provider

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// peerWakes is the wake's Elsewhere on a cluster whose replicas forward to
// each other: a powered-down target is woken by one replica, its
// guest.PeerWaker.Waker, and every other replica's flight for it asks that
// one over the peer hop and settles on its answer. Whatever stands in the
// way (the waker unreachable, or of another mind) leaves the wake to the
// replica that has the use, as without peers: two replicas may then both
// wake the target, which Incus carries out as one wake (TestClusterTwoReplicas).
type peerWakes struct {
	p   *guest.PeerWaker
	log *zap.Logger
}

func (e peerWakes) Wake(ctx context.Context, r targets.Route, arrived time.Time) (*wake.Refusal, bool) {
	if e.p.Here(r.Name, r.Daemon.Location) {
		return nil, false
	}
	a, err := e.p.Wake(ctx, r.Daemon.Location, guest.WakeRequest{Instance: r.Name,
		Universe: r.Owner.UniverseID, Environment: r.Owner.EnvironmentID, Age: time.Since(arrived)})
	if err != nil {
		e.log.Debug("the replica that wakes a target gave no answer: this one wakes it", zap.String("instance", r.Name), zap.Error(err))
		return nil, false
	}
	if a.Ready {
		return nil, true
	}
	switch st := wake.State(a.State); st {
	case wake.StateWaking, wake.StateBooting, wake.StateGone, wake.StateFailed:
		return &wake.Refusal{State: st, Message: a.Message, RetryAfter: a.RetryAfter}, true
	}
	e.log.Warn("the replica that wakes a target answered a state this one does not know: this one wakes it",
		zap.String("instance", r.Name), zap.String("state", a.State))
	return nil, false
}

// WakeForPeer serves another replica's wake of a target this replica wakes
// (guest.ForwardServerOptions.Wake): the target is checked against the
// owner the use named, as a use here is, and woken by the one flight every
// use of it here shares.
func (p *Provider) WakeForPeer(ctx context.Context, req guest.WakeRequest) (guest.WakeAnswer, error) {
	if p.peerWakes == nil {
		return guest.WakeAnswer{}, fmt.Errorf("this replica forwards to no peers: %w", guest.ErrNotTheWaker)
	}
	owner := controller.Owner{UniverseID: req.Universe, EnvironmentID: req.Environment}
	r, err := p.Targets.ResolveRoute(ctx, owner, req.Instance)
	if errors.Is(err, targets.ErrRouteGone) || errors.Is(err, targets.ErrRouteOwner) {
		return guest.WakeAnswer{State: string(wake.StateGone)}, nil
	}
	if err != nil {
		return guest.WakeAnswer{}, fmt.Errorf("reading %s: %w", req.Instance, err)
	}
	if !p.peerWakes.Here(r.Name, r.Daemon.Location) {
		return guest.WakeAnswer{}, fmt.Errorf("%s on %s is woken by the replica on %s: %w",
			r.Name, r.Daemon.Location, p.peerWakes.Waker(r.Name, r.Daemon.Location), guest.ErrNotTheWaker)
	}
	// A refusal is the wake's answer, which the asking replica's uses are
	// told, not a failure to serve the request.
	ref := p.Wake.WakeForUse(ctx, r, time.Now().Add(-req.Age))
	if ref == nil {
		return guest.WakeAnswer{Ready: true}, nil
	}
	return guest.WakeAnswer{State: string(ref.State), Message: ref.Message, RetryAfter: ref.RetryAfter}, nil
}
