package conformance

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// checkSetPower: with power advertised, target/setPower refuses a state
// outside the template's powerStates (and one the protocol does not
// know) as invalidParams naming power, an owner with nothing as
// notFound, and another owner naming the target's id as ownerMismatch;
// a state the target has is observed without action; a move answers
// promptly with an active observation and target/get then reaches the
// state; a closing or closed target is not moved.
func checkSetPower(ctx context.Context, r *checkRun) {
	c, init := r.mustOpen(ctx)
	defer c.close()
	if !init.Capabilities.Power {
		r.skipf("the controller does not advertise power (capability-unavailable checks its refusal)")
	}
	tmpl := r.template(ctx)
	if len(tmpl.powerStates) == 0 {
		r.skipf("the template %s offers no powerStates", tmpl.id)
	}
	set := func(ref controller.TargetRef, p controller.Power) controller.SetPowerParams {
		return controller.SetPowerParams{Target: ref, Power: p}
	}

	nobody := controller.TargetRef{Owner: r.owner("power-nobody")}
	what := "target/setPower for an owner that holds no target"
	r.wantError(r.rt(ctx, c, what, controller.MethodTargetSet, set(nobody, tmpl.powerStates[0])), jsonrpc.KindNotFound, what)

	owner, active := r.createActive(ctx, c, "power")
	ref := controller.TargetRef{Owner: owner, TargetID: active.TargetID}

	// A state the target has: observed, nothing moves.
	same := r.mustTarget(ctx, c, "target/setPower to the power it has", controller.MethodTargetSet, set(ref, active.Power), owner)
	if same.Phase != controller.PhaseActive || same.Power != active.Power || same.TargetID != active.TargetID {
		r.failf("target/setPower %s of a target that is %s answered %s; want it observed as it is", active.Power, active.Power, summary(same))
	}

	stranger := controller.TargetRef{Owner: r.owner("power-stranger"), TargetID: active.TargetID}
	what = "target/setPower by another owner naming this target's id"
	if e := r.errorAnswer(r.rt(ctx, c, what, controller.MethodTargetSet, set(stranger, active.Power)), jsonrpc.KindFailedPrecondition, what); e != nil && e.Reason != "ownerMismatch" {
		r.failf("%s: failedPrecondition with reason %q, want ownerMismatch", what, e.Reason)
	}

	for _, p := range []controller.Power{controller.PowerRunning, controller.PowerPaused, controller.PowerSuspended, controller.PowerStopped} {
		if slices.Contains(tmpl.powerStates, p) {
			continue
		}
		what := fmt.Sprintf("target/setPower %s, which the template's powerStates %v do not offer", p, tmpl.powerStates)
		r.wantInvalidParams(r.rt(ctx, c, what, controller.MethodTargetSet, set(ref, p)), what, "power")
	}
	what = "target/setPower to a power the protocol does not know"
	r.wantInvalidParams(r.rt(ctx, c, what, controller.MethodTargetSet, map[string]any{"target": ref, "power": "hibernating"}), what, "power")

	moves := slices.DeleteFunc(slices.Clone(tmpl.powerStates), func(p controller.Power) bool { return p == active.Power })
	if len(moves) > 0 && slices.Contains(tmpl.powerStates, active.Power) {
		moves = append(moves, active.Power) // and back
	}
	for _, p := range moves {
		r.movePower(ctx, c, ref, p)
	}

	closing, err := r.s.callTarget(ctx, c, controller.MethodTargetClose, getParams(controller.TargetRef{Owner: owner}), owner)
	if err != nil {
		r.fatalf("target/close: %s", describeErr(err))
	}
	what = fmt.Sprintf("target/setPower %s of a target whose close answered %s", active.Power, closing.Phase)
	f := r.rt(ctx, c, what, controller.MethodTargetSet, set(ref, active.Power))
	switch {
	case f.rpcErr == nil:
		r.failf("%s: answered a result (%s); want failedPrecondition (targetNotActive), or notFound once closed", what, clip(string(f.result), 200))
	case f.rpcErr.Kind == jsonrpc.KindNotFound:
	case f.rpcErr.Kind == jsonrpc.KindFailedPrecondition && f.rpcErr.Reason == "targetNotActive":
	default:
		r.failf("%s: %s; want failedPrecondition (targetNotActive), or notFound once closed", what, describeErr(f.rpcErr))
	}
	r.notef("target %s: moved through %v, each move answered promptly and reached; refusals typed and fenced", active.TargetID, moves)
}

// movePower asks for p, requires a prompt active answer, and follows
// target/get until the target has p at rest; asked again, p is then
// observed without action.
func (r *checkRun) movePower(ctx context.Context, c *conn, ref controller.TargetRef, p controller.Power) {
	what := fmt.Sprintf("target/setPower %s", p)
	start := time.Now()
	obs := r.mustTarget(ctx, c, what, controller.MethodTargetSet, controller.SetPowerParams{Target: ref, Power: p}, ref.Owner)
	if took := time.Since(start); took > r.s.cfg.AnswerBound {
		r.failf("%s answered after %v; a method answers within a few seconds and the move goes on in the background", what, took.Round(time.Millisecond))
	}
	if obs.Phase != controller.PhaseActive || obs.TargetID != ref.TargetID {
		r.failf("%s answered %s; want the target's transitional observation, phase active", what, summary(obs))
	}
	deadline := time.Now().Add(r.s.cfg.SettleTimeout)
	for obs.Power != p {
		if time.Now().After(deadline) {
			r.fatalf("%s: target/get still observes %s (message %q) after %s", what, summary(obs), obs.Message, r.s.cfg.SettleTimeout)
		}
		if err := sleep(ctx, r.s.cfg.PollInterval); err != nil {
			r.fatalf("%s: %v", what, err)
		}
		obs = r.mustTarget(ctx, c, "target/get after "+what, controller.MethodTargetGet, getParams(ref), ref.Owner)
		if obs.Phase != controller.PhaseActive {
			r.fatalf("%s: the target went %s (message %q)", what, obs.Phase, obs.Message)
		}
	}
	again := r.mustTarget(ctx, c, what+" again", controller.MethodTargetSet, controller.SetPowerParams{Target: ref, Power: p}, ref.Owner)
	if again.Phase != controller.PhaseActive || again.Power != p {
		r.failf("%s asked of a target that is %s answered %s; want it observed as it is", what, p, summary(again))
	}
}
