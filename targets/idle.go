package targets

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// The Service is the idle loop's inventory: it lists the targets, counts
// their relays, and carries the loop's decisions out through the same
// paths as the controller methods. It speaks its own terms (IdleView,
// powers, ErrStale, ErrRelayOpen); the provider puts them in the loop's.

// IdleView is a target as the idle loop needs to see it.
type IdleView struct {
	// Name is the Incus instance name (the target id).
	Name string
	// Phase and Power are the controller plane's observation: Power is set
	// exactly when Phase is active.
	Phase controller.Phase
	Power controller.Power
	// Settled is false while Incus moves the target between power states
	// or a power request for it is not yet carried out (State.Settled).
	Settled bool
	// PhaseSince is when the target entered a passing phase: its create
	// for provisioning, its recorded close for closing; zero otherwise or
	// when unknown.
	PhaseSince time.Time
	// Port is the guest daemon's port on the guest's loopback.
	Port int
	// Location is the cluster member holding the instance (empty when
	// standalone); the dialer needs it to pick its way to the guest.
	Location string
	// Policy is the target's idle policy (the template's default or the one
	// target/create named); nil when it has none.
	Policy *idlepolicy.Policy
	// PowerStates are the power states the target's template offers.
	PowerStates []controller.Power
	// IdleSince is the instant idleness began, recorded when the provider
	// powered the target down; zero when none is recorded.
	IdleSince time.Time
}

// The idle loop's answers: an idle power-down or close that meets either
// does nothing.
var (
	// ErrStale: the target changed since the loop looked at it (woken by
	// a data route, powered by target/setPower, closed).
	ErrStale = errors.New("targets: the target changed since the idle loop looked at it")
	// ErrRelayOpen: the target relays a data connection, or a dial of its
	// data route is in progress (or came while the power-down waited and
	// replaced it): the provider never powers a target down under a relay.
	// The idle loop takes it as "not idle"; an explicit power change
	// closes the relays first.
	ErrRelayOpen = errors.New("targets: not powering the target down: a data relay to the target is open")
)

// IdleTargets lists every target the provider owns in its project, with
// what the idle loop needs: phase and power as Observe reports them, the
// idle policy recorded at create, the template's power states, the
// daemon port and the recorded idle-since instant. It shares the
// reconciler's listing (see instances), so the two loops decode the
// project's inventory once per period between them, not twice.
func (s *Service) IdleTargets(ctx context.Context) ([]IdleView, error) {
	list, err := s.instances(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]IdleView, 0, len(list))
	for i := range list {
		if t, ok := s.idleTargetOf(&list[i]); ok {
			out = append(out, t)
		}
	}
	return out, nil
}

// idleTargetOf describes an instance for the idle loop; ok is false for an
// instance that is not one of the provider's targets.
func (s *Service) idleTargetOf(inst *incus.Instance) (IdleView, bool) {
	if unreadable(inst) && looksLikeTargetID(inst.Name) {
		// Its member does not answer: counted (unknown, on its member),
		// never acted on.
		return IdleView{Name: inst.Name, Phase: controller.PhaseUnknown, Location: inst.Location}, true
	}
	r := recordOf(inst.Config, fOwned|fState|fDaemonPort|fTemplate|fIdle|fIdleSince|fCreatedAt)
	if _, ok := r.owner(inst.Name); !ok {
		return IdleView{}, false
	}
	st := stateOf(inst, &r)
	t := IdleView{
		Name:        inst.Name,
		Phase:       st.Phase,
		Power:       st.Power,
		Settled:     st.Settled(),
		Port:        r.DaemonPort,
		Location:    inst.Location,
		PowerStates: s.templateStates(r.Template),
		IdleSince:   r.IdleSince,
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

// RelayEndedSince says a relay or a dial of the instance ended at or after
// since.
func (s *Service) RelayEndedSince(name string, since time.Time) bool {
	return s.relays.EndedSince(name, since)
}

// IdlePowerDown moves the target the idle loop last saw as t to the power
// to (paused, suspended or stopped), recording idleSince as the instant
// its idleness began. Under the target's lock it first checks that the
// target is still as t says (its name, settled power and, for a
// powered-down one, recorded idle-since; no power request pending), has
// no relay open, and had none end since readAt, when the idle reading the
// power-down rests on was asked for (zero: no reading); otherwise it
// answers ErrStale or ErrRelayOpen and does nothing. The power-down is recorded as the target's wanted power and
// carried out by the reconciler like any other, yielding to a dial that
// comes first; IdlePowerDown waits for that step.
func (s *Service) IdlePowerDown(ctx context.Context, t IdleView, to controller.Power, idleSince, readAt time.Time) error {
	if to == "" {
		return fmt.Errorf("targets: an idle power-down of %s names no power", t.Name)
	}
	return s.idleAct(ctx, t, to, idleSince, readAt)
}

// IdleClose closes the target the idle loop last saw as t, after the same
// checks as IdlePowerDown, through the normal close path (the closing
// marker, then the reconciler), after which target/get answers closing and
// then notFound.
func (s *Service) IdleClose(ctx context.Context, t IdleView, readAt time.Time) error {
	return s.idleAct(ctx, t, "", time.Time{}, readAt)
}

// idleAct carries out IdlePowerDown to the power to, or IdleClose when to
// is empty.
func (s *Service) idleAct(ctx context.Context, t IdleView, to controller.Power, idleSince, readAt time.Time) error {
	unlock, err := s.own.request(ctx, t.Name)
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
		return ErrStale
	}
	r := recordOf(inst.Config, fOwned|fState|fIdleSince|fRelays)
	if _, ok := r.owner(inst.Name); !ok {
		return ErrStale
	}
	st := stateOf(inst, &r)
	if !st.Settled() || st.Power != t.Power {
		return ErrStale
	}
	if st.Power != controller.PowerRunning && !r.idleSinceIs(t.IdleSince) {
		return ErrStale
	}
	if s.relays.Open(t.Name) > 0 || s.relays.EndedSince(t.Name, readAt) || foreignLeases(r.Relays, s.cfg.Replica, s.now()) > 0 {
		// This replica or another relays to it: no idle action while any
		// replica relays a data connection to the target. A relay of this
		// one that ended after the reading was asked for may have carried
		// a use the reading predates (a process started, then the relay
		// closed): the reading is stale.
		return ErrRelayOpen
	}
	if to == "" {
		// Hold new dials off while the close is recorded, as a power-down
		// does: a dial that wakes the target now would be cut by the delete.
		release, ok := s.relays.Quiesce(t.Name)
		if !ok {
			return ErrRelayOpen
		}
		defer release()
		// Public ingress goes first, as on target/close: the edge answers
		// the host 404 from now on, not once a reconcile pass (up to its
		// interval later) finds the target closing.
		s.ingress.closing(t.Name)
		if !r.has(fClosing) {
			c := change{keys: fClosing, to: record{Closing: s.now()}}
			if recordOf(inst.Config, fIngressRouted).has(fIngressRouted) {
				c.keys |= fIngressRouted // to not routed: removed
			}
			if err := s.patch(ctx, t.Name, c.config()); err != nil {
				return err
			}
			// Again after the write: a reconcile pass that listed before
			// it must not put the route back.
			s.ingress.drop(t.Name)
		}
		s.own.kick(t.Name)
		return nil
	}
	if !slices.Contains(s.powerStates(inst), to) {
		return fmt.Errorf("targets: idle power-down to %s: the template does not offer it", to)
	}
	in := Intent{Power: to, At: s.now(), By: ByIdle}
	_, _, err = s.want(ctx, t.Name, in,
		change{keys: fIdleSince, to: record{IdleSince: idleSince}},
		func(_ *incus.Instance, now State) error {
			if now.Intent != st.Intent || now.Power != st.Power {
				return ErrStale
			}
			return nil
		})
	if err != nil {
		return err
	}
	unlock()
	locked = false
	return s.idleCarriedOut(ctx, t.Name, to)
}

// idleCarriedOut waits for the reconciler to carry out a recorded idle
// power-down to the power to. The record decides, not what it means
// (State.Intent): Incus may show a target it has just force-stopped
// running for a moment (a paused target's graceful stop always ends
// forced), which reads as woken under the stop marked carried out, and
// the action, carried out, was counted a relay's overtaking (CI: a
// restarted provider's idle stop counted no success). A step that ends
// short of the power (its mark not yet written, or a retry to come) is
// followed by another, a few at most.
func (s *Service) idleCarriedOut(ctx context.Context, name string, to controller.Power) error {
	const steps = 3
	for step := 1; ; step++ {
		select {
		case <-s.own.kick(name):
		case <-ctx.Done():
			return ctx.Err()
		}
		after, err := s.lookup(ctx, name)
		if err != nil {
			return err
		}
		if after == nil {
			return ErrStale
		}
		now := StateOf(after)
		r := recordOf(after.Config, fState)
		switch {
		case now.Power == to:
			return nil
		case now.Recorded.Power != to:
			return ErrRelayOpen // a use overtook the power-down
		case wokenUnder(&r):
			return nil // carried out and marked so; Incus shows it running since
		case step == steps:
			return fmt.Errorf("targets: idle power-down of %s to %s is recorded; the reconciler retries it", name, to)
		}
	}
}

// IdleTarget reads one target as IdleTargets lists it; ok is false when the
// provider holds no target of that name.
func (s *Service) IdleTarget(ctx context.Context, name string) (t IdleView, ok bool, err error) {
	inst, err := s.read(ctx, name)
	if err != nil || inst == nil {
		return IdleView{}, false, err
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
