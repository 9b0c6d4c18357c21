package guest

import (
	"context"
	"errors"
	"fmt"
)

// ErrNotOnMember is matched (errors.Is) by a dial refused because the
// instance is held by another cluster member than the dialer's: a PID that
// Incus reports for an instance on another host names some process of
// that host, and entering whatever process has that PID here would reach
// the wrong guest.
var ErrNotOnMember = errors.New("instance is on another cluster member")

// LocatedLookup returns an instance's init PID and the member that holds it,
// read together (incus.Client.LocatedInitPID).
type LocatedLookup func(ctx context.Context, instance string) (pid int, location string, err error)

// OnMember returns a PIDLookup that answers only for instances on member:
// the netns dialer of a provider on one member of a multi-host cluster
// must never enter a PID that belongs to another host. The check costs
// nothing per dial: the netns dialer looks a PID up only on its first dial
// of an instance and when its cached PID has gone stale.
func OnMember(member string, lookup LocatedLookup) PIDLookup {
	return func(ctx context.Context, instance string) (int, error) {
		pid, location, err := lookup(ctx, instance)
		if err != nil {
			return 0, err
		}
		if location != member && location != "" && location != "none" {
			return 0, fmt.Errorf("instance %q is on member %q, not on %q where this provider runs: %w", instance, location, member, ErrNotOnMember)
		}
		return pid, nil
	}
}
