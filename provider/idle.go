package provider

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// IdleInventory is the idle loop's inventory on the targets: it hands the
// loop the targets' listing in the loop's terms (the template's power
// states read as the policy's stages) and carries the loop's actions out
// in the targets' (a power-down to the power the action leaves, or a
// close), so that the loop and the targets need not know each other. The
// targets' ErrStale and ErrRelayOpen reach the loop as idle.ErrStale and
// idle.ErrRelayOpen, which they then match too.
type IdleInventory struct {
	Targets *targets.Service
}

var (
	_ idle.Inventory = IdleInventory{}
	_ idle.Watcher   = IdleInventory{}
)

// IdleTargets lists the targets (targets.Service.IdleTargets).
func (v IdleInventory) IdleTargets(ctx context.Context) ([]idle.Target, error) {
	views, err := v.Targets.IdleTargets(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]idle.Target, len(views))
	for i := range views {
		out[i] = idleTarget(&views[i])
	}
	return out, nil
}

// IdleTarget reads one target (targets.Service.IdleTarget).
func (v IdleInventory) IdleTarget(ctx context.Context, name string) (idle.Target, bool, error) {
	view, ok, err := v.Targets.IdleTarget(ctx, name)
	if err != nil || !ok {
		return idle.Target{}, ok, err
	}
	return idleTarget(&view), true, nil
}

// RelaysOpen counts the data relays open to the target.
func (v IdleInventory) RelaysOpen(name string) int { return v.Targets.RelaysOpen(name) }

// RelayEndedSince says a relay or dial of the target ended at or after
// since (targets.Service.RelayEndedSince).
func (v IdleInventory) RelayEndedSince(name string, since time.Time) bool {
	return v.Targets.RelayEndedSince(name, since)
}

// Changes names the targets this process changed (targets.Service.Changes).
func (v IdleInventory) Changes() <-chan string { return v.Targets.Changes() }

// IdleAct carries an idle action out on the target the loop last saw as t:
// a close, or a power-down to the power the action leaves it in.
func (v IdleInventory) IdleAct(ctx context.Context, t idle.Target, action idlepolicy.Action, idleSince, readAt time.Time) error {
	// What the targets check the target against; the stages are the loop's
	// reading of the power states, which the check does not need.
	view := targets.IdleView{Name: t.Name, Phase: t.Phase, Power: t.Power, Settled: t.Settled, PhaseSince: t.PhaseSince,
		Port: t.Port, Location: t.Location, Policy: t.Policy, IdleSince: t.IdleSince}
	var err error
	if action == idlepolicy.ActionClose {
		err = v.Targets.IdleClose(ctx, view, readAt)
	} else {
		to := idle.PowerOf(action)
		if to == "" {
			return fmt.Errorf("provider: the idle action %s powers nothing down", action)
		}
		err = v.Targets.IdlePowerDown(ctx, view, to, idleSince, readAt)
	}
	switch {
	case errors.Is(err, targets.ErrStale):
		return idleAnswer{err: err, is: idle.ErrStale}
	case errors.Is(err, targets.ErrRelayOpen):
		return idleAnswer{err: err, is: idle.ErrRelayOpen}
	}
	return err
}

func idleTarget(v *targets.IdleView) idle.Target {
	return idle.Target{Name: v.Name, Phase: v.Phase, Power: v.Power, Settled: v.Settled, PhaseSince: v.PhaseSince,
		Port: v.Port, Location: v.Location, Policy: v.Policy, Stages: idle.StagesOf(v.PowerStates), IdleSince: v.IdleSince}
}

// idleAnswer is an answer of the targets that the idle loop matches as its
// own answer too (is), keeping the targets' words.
type idleAnswer struct{ err, is error }

func (a idleAnswer) Error() string   { return a.err.Error() }
func (a idleAnswer) Unwrap() []error { return []error{a.err, a.is} }
