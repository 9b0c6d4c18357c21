package targets

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// Relays is what power changes ask of the data routes' relay registry: the
// provider never powers a target down while it relays a data connection.
type Relays interface {
	// Open counts the relays open to the instance now.
	Open(instance string) int
	// CloseAll sends every relay of the instance a going-away close and
	// ends it, before an explicit power-down.
	CloseAll(instance string)
}

type noRelays struct{}

func (noRelays) Open(string) int { return 0 }
func (noRelays) CloseAll(string) {}

// UseRelays connects the relay registry. Call before serving.
func (s *Service) UseRelays(r Relays) { s.relays = r }

// act runs one Incus state action and waits for it within most.
func (s *Service) act(ctx context.Context, name string, put incus.InstanceStatePut, most time.Duration) error {
	op, err := s.incus.UpdateInstanceState(ctx, name, put)
	if err != nil {
		return err
	}
	_, err = s.wait(ctx, op, most)
	s.listingChanged()
	return err
}

// stop stops gracefully within grace, then forcibly: on Incus a graceful
// stop that never ends would otherwise block every later change.
func (s *Service) stop(ctx context.Context, name string, grace time.Duration, stateful bool) error {
	if stateful {
		return s.act(ctx, name, incus.InstanceStatePut{Action: "stop", Stateful: true}, 10*time.Minute)
	}
	if grace >= time.Second {
		err := s.act(ctx, name, incus.InstanceStatePut{Action: "stop", Timeout: int(grace / time.Second)}, grace+10*time.Second)
		if err == nil || isAlreadyStopped(err) {
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		s.log.Info("graceful stop did not finish in time; forcing", zap.String("instance", name), zap.Error(err))
	}
	err := s.act(ctx, name, incus.InstanceStatePut{Action: "stop", Force: true}, time.Minute)
	if isAlreadyStopped(err) {
		return nil
	}
	return err
}

// Wake brings a powered-down target back to running: unfreeze a paused one,
// start a stopped or suspended one (Incus restores a stateful stop on
// start). It returns the power the target had, and clears the recorded
// idle-since instant so the idle clock is the daemon's again.
func (s *Service) Wake(ctx context.Context, inst *incus.Instance) (from controller.Power, err error) {
	owner, ok := ownerOf(inst)
	if !ok {
		return "", errors.New("targets: wake of an instance that is not a target")
	}
	o := Observe(inst, owner)
	if o.Phase != controller.PhaseActive {
		return "", errors.New("targets: wake of a target that is not active")
	}
	switch o.Power {
	case controller.PowerPaused:
		err = s.act(ctx, inst.Name, incus.InstanceStatePut{Action: "unfreeze"}, 30*time.Second)
	case controller.PowerStopped, controller.PowerSuspended:
		if inst.Status == "Stopped" {
			err = s.act(ctx, inst.Name, incus.InstanceStatePut{Action: "start"}, time.Minute)
		}
	}
	if err != nil {
		return o.Power, err
	}
	if o.Power != controller.PowerPaused {
		s.dialer.Forget(inst.Name) // a start makes a new init process; an unfreeze does not
	}
	if inst.Config[KeyIdleSince] != "" {
		if perr := s.patch(ctx, inst.Name, map[string]string{KeyIdleSince: ""}); perr != nil {
			s.log.Warn("clearing idle-since failed", zap.String("instance", inst.Name), zap.Error(perr))
		}
	}
	s.changes.note(inst.Name) // a wake is a use: the idle loop counts from it
	return o.Power, nil
}

// PowerDown moves a running target to paused, suspended or stopped, first
// recording idleSince (the instant its idleness began) so that the idle
// clock keeps running while the guest cannot answer, across restarts. It
// refuses with ErrRelayOpen while the target relays a data connection, and
// holds new dials of its data route until it is done (see PowerGuard).
func (s *Service) PowerDown(ctx context.Context, name string, to controller.Power, idleSince time.Time) error {
	release, err := s.quiesce(name)
	if err != nil {
		return err
	}
	defer release()
	if err := s.patch(ctx, name, map[string]string{KeyIdleSince: msString(idleSince)}); err != nil {
		return err
	}
	if to != controller.PowerPaused {
		s.dialer.Forget(name) // a freeze keeps the init process
	}
	switch to {
	case controller.PowerPaused:
		return s.act(ctx, name, incus.InstanceStatePut{Action: "freeze"}, 30*time.Second)
	case controller.PowerSuspended:
		return s.stop(ctx, name, 0, true)
	case controller.PowerStopped:
		return s.stop(ctx, name, s.cfg.GracefulStop, false)
	}
	return errors.New("targets: power down to " + string(to))
}

// SetPower moves an active target to one of its template's power states.
// It answers within AnswerWithin with what Incus shows; a longer move goes
// on in the background. A target already there, or moving there, is
// observed without action; a move asked for while another runs follows it.
func (s *Service) SetPower(ctx context.Context, ref controller.TargetRef, power controller.Power) (controller.Observation, error) {
	name, inst, err := s.resolve(ctx, ref)
	if err != nil {
		return controller.Observation{}, err
	}
	if inst == nil {
		return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "This provider holds no target for this owner.")
	}
	states := s.powerStates(inst)
	if !slices.Contains(states, power) {
		return controller.Observation{}, jsonrpc.InvalidParams("power", "The target's template does not offer power state %s; template/list names the states it offers.", power)
	}
	unlock := s.locks.lock(name)
	released := false
	defer func() {
		if !released {
			unlock()
		}
	}()
	// Read again under the lock: the idle loop or another setPower may
	// have moved the target meanwhile.
	if inst, err = s.lookup(ctx, name); err != nil {
		return controller.Observation{}, s.incusError("looking up the owner's target", err)
	}
	if inst == nil {
		return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "This provider holds no target for this owner.")
	}
	o := Observe(inst, ref.Owner)
	if o.Phase != controller.PhaseActive {
		return controller.Observation{}, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "targetNotActive",
			"The target is %s, not active; power can change only once it is active.", o.Phase)
	}
	// Moving there already (this provider's own move, or Incus's transition),
	// or there and going nowhere else.
	current := s.moves.current(name)
	if current != nil && current.to == power {
		return moving(o, power), nil
	}
	if current == nil && (movingTo(inst.Status) == power || (o.Message == "" && o.Power == power)) {
		return o, nil
	}
	mv, prev := s.moves.start(name, power)
	done := make(chan error, 1)
	spawned := s.work.spawn(func(ctx context.Context) {
		defer s.moves.end(name, mv)
		if prev != nil {
			select {
			case <-prev.done:
			case <-ctx.Done():
				done <- ctx.Err()
				return
			}
		}
		done <- s.movePower(ctx, name, power, s.now(), true)
		s.changes.note(name)
	})
	if !spawned {
		s.moves.end(name, mv)
		return controller.Observation{}, jsonrpc.Unavailable(retryAfter, "The provider is shutting down; retry shortly.")
	}
	// The move is recorded: close, create and the idle loop need not wait
	// on this answer's bound for the lock.
	unlock()
	released = true
	wait, cancel := context.WithTimeout(ctx, s.cfg.AnswerWithin)
	defer cancel()
	select {
	case err := <-done:
		if err != nil {
			s.log.Warn("power change failed", zap.String("instance", name), zap.String("to", string(power)), zap.Error(err))
			if incus.IsRetryable(err) {
				return controller.Observation{}, s.incusError("changing power", err)
			}
		}
	case <-wait.Done():
	}
	after, err := s.lookup(ctx, name)
	if err != nil {
		return controller.Observation{}, s.incusError("observing the power change", err)
	}
	if after == nil {
		return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "The target disappeared while its power changed.")
	}
	obs := Observe(after, ref.Owner)
	if obs.Phase == controller.PhaseActive && obs.Power != power && obs.Message == "" {
		obs = moving(obs, power)
	}
	return obs, nil
}

func moving(o controller.Observation, to controller.Power) controller.Observation {
	if o.Power != to && o.Message == "" {
		o.Message = "Moving to " + string(to) + "."
	}
	return o
}

// movePower moves an active target to power `to`, first waiting out a
// transition Incus has in progress. A power-down records idleSince as the
// instant the target's idleness began. An explicit move (target/setPower)
// closes the target's relays first; any other (the idle loop's) answers
// ErrRelayOpen instead.
func (s *Service) movePower(ctx context.Context, name string, to controller.Power, idleSince time.Time, explicit bool) error {
	inst, err := s.lookup(ctx, name)
	if err != nil {
		return err
	}
	if inst == nil {
		return errors.New("targets: the instance disappeared before its power changed")
	}
	if inst, err = s.settle(ctx, inst); err != nil {
		return err
	}
	owner, ok := ownerOf(inst)
	if !ok {
		return errors.New("targets: power change of an instance that is not a target")
	}
	o := Observe(inst, owner)
	if o.Phase != controller.PhaseActive {
		return errors.New("targets: power change of a target that is no longer active")
	}
	from := o.Power
	if from == to {
		return nil
	}
	if to == controller.PowerRunning {
		_, err := s.Wake(ctx, inst)
		return err
	}
	if s.relays.Open(name) > 0 {
		if !explicit {
			return ErrRelayOpen
		}
		s.relays.CloseAll(name)
	}
	switch from {
	case controller.PowerPaused:
		if err := s.act(ctx, name, incus.InstanceStatePut{Action: "unfreeze"}, 30*time.Second); err != nil {
			return err
		}
	case controller.PowerStopped, controller.PowerSuspended:
		// A stopped instance cannot be frozen: start it, then freeze.
		if err := s.act(ctx, name, incus.InstanceStatePut{Action: "start"}, time.Minute); err != nil {
			return err
		}
	}
	return s.PowerDown(ctx, name, to, idleSince)
}

// settle waits, within a minute, for a power transition Incus has in
// progress (freezing, stopping, starting) to end, and returns the instance
// as it then is.
func (s *Service) settle(ctx context.Context, inst *incus.Instance) (*incus.Instance, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		owner, _ := ownerOf(inst)
		if o := Observe(inst, owner); o.Phase != controller.PhaseActive || o.Message == "" {
			return inst, nil
		}
		if time.Now().After(deadline) {
			return nil, errors.New("targets: the instance stayed in status " + inst.Status + " for a minute")
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		next, err := s.lookup(ctx, inst.Name)
		if err != nil {
			return nil, err
		}
		if next == nil {
			return nil, errors.New("targets: the instance disappeared during a power change")
		}
		inst = next
	}
}

// moveTable records the power changes in flight, by instance: Incus shows
// a graceful stop as Running until it ends, so only the provider knows a
// target is on its way somewhere.
type moveTable struct {
	mu sync.Mutex
	m  map[string]*powerMove
}

type powerMove struct {
	to   controller.Power
	done chan struct{}
}

// current is the move in flight for name, or nil.
func (t *moveTable) current(name string) *powerMove {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[name]
}

// start records a move to `to` and returns it with the move it follows, if any.
func (t *moveTable) start(name string, to controller.Power) (mv, prev *powerMove) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]*powerMove{}
	}
	prev = t.m[name]
	mv = &powerMove{to: to, done: make(chan struct{})}
	t.m[name] = mv
	return mv, prev
}

// end marks a move finished.
func (t *moveTable) end(name string, mv *powerMove) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[name] == mv {
		delete(t.m, name)
	}
	close(mv.done)
}

// movingTo is the power an in-flight Incus transition ends in.
func movingTo(status string) controller.Power {
	switch status {
	case "Freezing":
		return controller.PowerPaused
	case "Stopping", "Shutdown":
		return controller.PowerStopped
	case "Starting", "Thawed":
		return controller.PowerRunning
	}
	return ""
}

// powerStates are the states the target's template offers. A target whose
// template left the catalog keeps the states every instance can reach.
func (s *Service) powerStates(inst *incus.Instance) []controller.Power {
	if t, ok := s.catalog.Get(inst.Config[keyTemplate]); ok {
		return t.Wire.PowerStates
	}
	return []controller.Power{controller.PowerRunning, controller.PowerPaused, controller.PowerStopped}
}
