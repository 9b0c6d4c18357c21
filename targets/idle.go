package targets

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// The Service is the idle loop's inventory: it lists the targets, counts
// their relays, and applies idle actions through the same paths as the
// controller methods.
var (
	_ idle.Inventory = (*Service)(nil)
	_ idle.Watcher   = (*Service)(nil)
)

// IdleTargets lists every target the provider owns in its project, with
// what the idle loop needs: phase and power as Observe reports them, the
// idle policy recorded at create, the template's power-down stages, the
// daemon port and the recorded idle-since instant. It shares the
// reconciler's listing (see instances), so the two loops decode the
// project's inventory once per period between them, not twice.
func (s *Service) IdleTargets(ctx context.Context) ([]idle.Target, error) {
	list, err := s.instances(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]idle.Target, 0, len(list))
	for i := range list {
		if t, ok := s.idleTargetOf(&list[i]); ok {
			out = append(out, t)
		}
	}
	return out, nil
}

// idleTargetOf describes an instance for the idle loop; ok is false for an
// instance that is not one of the provider's targets.
func (s *Service) idleTargetOf(inst *incus.Instance) (idle.Target, bool) {
	if unreadable(inst) && looksLikeTargetID(inst.Name) {
		// Its member does not answer: counted (unknown, on its member),
		// never acted on.
		return idle.Target{Name: inst.Name, Phase: controller.PhaseUnknown, Location: inst.Location}, true
	}
	r := recordOf(inst.Config, fOwned|fState|fDaemonPort|fTemplate|fIdle|fIdleSince|fCreatedAt)
	if _, ok := r.owner(inst.Name); !ok {
		return idle.Target{}, false
	}
	st := stateOf(inst, &r)
	t := idle.Target{
		Name:      inst.Name,
		Phase:     st.Phase,
		Power:     st.Power,
		Settled:   st.Settled(),
		Port:      r.DaemonPort,
		Location:  inst.Location,
		Stages:    idle.StagesOf(s.templateStates(r.Template)),
		IdleSince: r.IdleSince,
	}
	switch {
	case r.IdleErr != nil:
		// Only this provider writes the key, so this is a defect or a
		// hand edit: the target gets no idle policy rather than a guess.
		s.log.Warn("the recorded idle policy does not decode; the target gets none",
			zap.String("instance", inst.Name), zap.Error(r.IdleErr))
	case r.Idle != nil:
		t.Policy = r.Idle
	}
	switch t.Phase {
	case controller.PhaseProvisioning:
		t.PhaseSince = inst.CreatedAt
		if !r.CreatedAt.IsZero() {
			// A warm instance handed out was created long before its owner.
			t.PhaseSince = r.CreatedAt
		}
	case controller.PhaseClosing:
		if !r.Closing.IsZero() {
			t.PhaseSince = r.Closing
		}
	}
	return t, true
}

// RelaysOpen counts the data relays open to the instance.
func (s *Service) RelaysOpen(name string) int { return s.relays.Open(name) }

// IdleAct applies an idle action to the target the loop last saw as t.
// Under the target's lock it first checks that the target is still as t
// says (the same phase and settled power, the same recorded idle-since for
// a powered-down one, no power request pending) and has no relay open;
// otherwise it answers idle.ErrStale or idle.ErrRelayOpen and does nothing.
// A power-down is recorded as the target's wanted power (with idleSince)
// and carried out by the reconciler like any other, yielding to a dial that
// comes first; IdleAct waits for that step. A close takes the normal close
// path (the closing marker, then the reconciler), after which target/get
// answers closing and then notFound.
func (s *Service) IdleAct(ctx context.Context, t idle.Target, action idlepolicy.Action, idleSince time.Time) error {
	unlock, err := s.locks.lock(ctx, t.Name)
	if err != nil {
		return err
	}
	locked := true
	defer func() {
		if locked {
			unlock()
		}
	}()
	inst, err := s.lookup(ctx, t.Name)
	if err != nil {
		return err
	}
	if inst == nil {
		return idle.ErrStale
	}
	r := recordOf(inst.Config, fOwned|fState|fIdleSince|fRelays)
	if _, ok := r.owner(inst.Name); !ok {
		return idle.ErrStale
	}
	st := stateOf(inst, &r)
	if !st.Settled() || st.Power != t.Power {
		return idle.ErrStale
	}
	if st.Power != controller.PowerRunning && !r.idleSinceIs(t.IdleSince) {
		return idle.ErrStale
	}
	if s.relays.Open(t.Name) > 0 || foreignLeases(r.Relays, s.cfg.Replica, s.now()) > 0 {
		// This replica or another relays to it: no idle action while any
		// replica relays a data connection to the target.
		return ErrRelayOpen
	}
	if action == idlepolicy.ActionClose {
		// Hold new dials off while the close is recorded, as a power-down
		// does: a dial that wakes the target now would be cut by the delete.
		release, ok := s.relays.Quiesce(t.Name)
		if !ok {
			return ErrRelayOpen
		}
		defer release()
		if !r.has(fClosing) {
			if err := s.patch(ctx, t.Name, change{keys: fClosing, to: record{Closing: s.now()}}.config()); err != nil {
				return err
			}
		}
		s.work.kick(t.Name)
		return nil
	}
	to := idle.PowerOf(action)
	if to == "" || !slices.Contains(s.powerStates(inst), to) {
		return fmt.Errorf("targets: idle action %s: the template does not offer %q", action, to)
	}
	_, _, err = s.want(ctx, t.Name, Intent{Power: to, At: s.now(), By: ByIdle},
		change{keys: fIdleSince, to: record{IdleSince: idleSince}},
		func(_ *incus.Instance, now State) error {
			if now.Intent != st.Intent || now.Power != st.Power {
				return idle.ErrStale
			}
			return nil
		})
	if err != nil {
		return err
	}
	unlock()
	locked = false
	select {
	case <-s.work.kick(t.Name):
	case <-ctx.Done():
		return ctx.Err()
	}
	after, err := s.lookup(ctx, t.Name)
	if err != nil {
		return err
	}
	if after == nil {
		return idle.ErrStale
	}
	switch now := StateOf(after); {
	case now.Power == to:
		return nil
	case now.Intent.Power != to:
		return ErrRelayOpen // a use overtook the power-down
	default:
		return fmt.Errorf("targets: idle %s of %s is recorded; the reconciler retries it", action, t.Name)
	}
}

// IdleTarget reads one target as IdleTargets lists it; ok is false when the
// provider holds no target of that name.
func (s *Service) IdleTarget(ctx context.Context, name string) (t idle.Target, ok bool, err error) {
	inst, err := s.read(ctx, name)
	if err != nil || inst == nil {
		return idle.Target{}, false, err
	}
	t, ok = s.idleTargetOf(inst)
	return t, ok, nil
}

// Changes names the targets whose state this process changed: a new target
// booted, a wake, a finished target/setPower. The idle loop looks at each at
// once instead of at its next listing. Names are dropped rather than ever
// blocking the sender; the listing catches up with what was dropped.
func (s *Service) Changes() <-chan string { return s.changes.ch() }

// changeFeed is the channel behind Changes; its zero value is ready.
type changeFeed struct {
	once sync.Once
	c    chan string
}

func (f *changeFeed) ch() chan string {
	f.once.Do(func() { f.c = make(chan string, 1024) })
	return f.c
}

func (f *changeFeed) note(name string) {
	select {
	case f.ch() <- name:
	default:
	}
}
