package conformance

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// checkIdleObligations: a target created with an idle policy whose only
// threshold is a short power-down is watched from outside through three
// windows, each as long as the threshold and the provider's grace:
//
//  1. its data route relays a connection that makes no use of it (only
//     env/getIdle, which is no use): the target is never powered down,
//     though the daemon reports it idle past the threshold (obligation 4);
//  2. that connection has closed, and a process it started still runs:
//     the target is never powered down (obligation 3);
//  3. the process has ended: the target is powered down within the
//     window (and the settle timeout for the move), which shows the
//     provider runs the clock at all, and so that the first two windows
//     were a test of something.
//
// When the daemon does not advertise process, window 2 is left out and
// says so. The windows are long by nature; the check runs beside the
// checks before it (alongside).
func checkIdleObligations(ctx context.Context, r *checkRun) {
	c, tmpl, down := r.openPoweringDown(ctx)
	defer c.close()
	after, grace := r.s.cfg.IdleAfter, r.s.cfg.IdleGrace
	window := after + grace
	policy := policyAfter(down, after)
	owner := r.owner("idle")
	asked := time.Now()
	first := r.mustTarget(ctx, c, "target/create with an idle policy", controller.MethodTargetCreate,
		controller.CreateParams{Owner: owner, TemplateID: tmpl.id, Idle: &policy}, owner)
	active := r.waitActive(ctx, c, controller.TargetRef{Owner: owner}, first.TargetID)
	ref := controller.TargetRef{Owner: owner, TargetID: active.TargetID}
	early := ""
	if active.Power != controller.PowerRunning {
		// The daemon's idleness counts from its start, and a loaded
		// provider's answers can come after the threshold has passed: the
		// power-down is then the policy at work, and window 1's dial
		// wakes the target. Before the threshold it cannot be.
		took := r.notBeforeThreshold(asked, after, "the new target is active but "+string(active.Power)+"; want it running")
		early = fmt.Sprintf(" (first seen active %s, %v after its create was sent; woken by the route's dial)", active.Power, took.Round(100*time.Millisecond))
	}

	// Window 1: a relay open, no use.
	ws, _ := r.upgradeRoute(ctx, r.s.routeURL(owner, active.TargetID), true)
	defer func() { _ = ws.Close() }()
	d := dataConn{ws: ws, timeout: r.s.cfg.Timeout}
	var dataInit struct {
		Capabilities map[string]json.RawMessage `json:"capabilities"`
	}
	if err := d.call("initialize", map[string]any{"protocolVersion": 5, "clientInfo": clientInfo}, &dataInit); err != nil {
		r.fatalf("the data plane's initialize on the target's route: %v", err)
	}
	maxIdle := uint64(0)
	readIdle := func() {
		var idle struct {
			IdleForMs uint64 `json:"idleForMs"`
		}
		if err := d.call("env/getIdle", struct{}{}, &idle); err != nil {
			r.fatalf("env/getIdle over the relay, in window 1 (a relay open): %v", err)
		}
		maxIdle = max(maxIdle, idle.IdleForMs)
	}
	readIdle()
	until := time.Now().Add(window)
	nextIdle := time.Now().Add(time.Second)
	r.stayRunning(ctx, c, ref, until, down, "while its data route relayed a connection (obligation 4: never powered down while the provider relays a data connection to it)", func() {
		if time.Now().After(nextIdle) {
			readIdle()
			nextIdle = time.Now().Add(time.Second)
		}
	})
	readIdle()
	if maxIdle < uint64(after.Milliseconds()) {
		r.fatalf("the daemon behind the route reported idleForMs %d at most over %v without use, under the policy's %d ms: the window tested nothing", maxIdle, window, after.Milliseconds())
	}

	// Window 2: the relay closed, a process running.
	runs := ""
	ends := time.Now()
	if _, ok := dataInit.Capabilities["process"]; ok {
		// The process outlives the window by two seconds, in whole
		// seconds: every sleep takes those.
		secs := int64(math.Ceil((window + 2*time.Second).Seconds()))
		start := map[string]any{"processId": "lsconform-idle", "argv": []string{"sleep", strconv.FormatInt(secs, 10)}}
		if err := d.call("process/start", start, nil); err != nil {
			r.fatalf("process/start of sleep %d over the relay: %v", secs, err)
		}
		ends = time.Now().Add(time.Duration(secs) * time.Second)
		runs = fmt.Sprintf("; with the relay closed and sleep %d running, never powered down for %v", secs, window)
	}
	_ = ws.Close()
	if runs != "" {
		r.stayRunning(ctx, c, ref, time.Now().Add(window), down, "after its relay closed, while a process it started ran (obligation 3: running processes keep the target awake)", nil)
	} else {
		runs = "; the daemon does not advertise process, so running processes were not tried"
	}

	// Window 3: nothing runs: the policy must act. The grace is for the
	// provider to decide; the move itself may take up to the settle
	// timeout, as any power move the suite follows.
	deadline := ends.Add(window + r.s.cfg.SettleTimeout)
	for {
		obs := r.mustTarget(ctx, c, "target/get while the idle policy is due", controller.MethodTargetGet, getParams(ref), owner)
		if obs.Phase == controller.PhaseActive && obs.Power != controller.PowerRunning {
			r.notef("target %s with policy %s%s: never powered down for %v with a relay open (env/getIdle reported up to %d ms idle)%s; %s %v after the last work ended",
				active.TargetID, policyText(policy), early, window, maxIdle, runs, obs.Power, time.Since(ends).Round(100*time.Millisecond))
			return
		}
		if obs.Phase != controller.PhaseActive {
			r.fatalf("the idle target went %s; its policy names only %s", obs.Phase, down)
		}
		if time.Now().After(deadline) {
			r.fatalf("the target is still %s %v after its last work ended, under a policy to be %s after %v idle: the provider does not apply the idle policy (allow it more with -idle-grace if its clock is slower than %v)",
				obs.Power, time.Since(ends).Round(100*time.Millisecond), down, after, grace)
		}
		if err := sleep(ctx, r.s.cfg.PollInterval); err != nil {
			r.fatalf("%v", err)
		}
	}
}

// checkIdleClose: a target created with an idle policy that only closes
// it, and never used, is closed by the provider on its own, after which
// target/get answers closed or notFound, by owner and by id, and its data
// route 410 gone (obligation 5).
func checkIdleClose(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	tmpl := r.template(ctx)
	after := r.s.cfg.IdleAfter
	ms := uint64(max(after.Milliseconds(), 1))
	policy := idlepolicy.Policy{CloseAfterMs: &ms}
	owner := r.owner("idle-close")
	asked := time.Now()
	first := r.mustTarget(ctx, c, "target/create with an idle policy that closes", controller.MethodTargetCreate,
		controller.CreateParams{Owner: owner, TemplateID: tmpl.id, Idle: &policy}, owner)
	// The close may come before a poll sees the target active: the
	// daemon's idleness counts from its start, and a loaded provider's
	// answers can take longer than the active phase lasts.
	active, early := r.waitActiveOr(ctx, c, controller.TargetRef{Owner: owner}, first.TargetID, true)
	id := cmp.Or(active.TargetID, first.TargetID)
	since := time.Now()
	deadline := since.Add(after + r.s.cfg.IdleGrace + r.s.cfg.SettleTimeout)
	refs := []controller.TargetRef{{Owner: owner}}
	if id != "" {
		refs = append(refs, controller.TargetRef{Owner: owner, TargetID: id})
	}
	var seen []controller.Phase
	if early {
		r.notBeforeThreshold(asked, after, "the target was closed")
		seen = append(seen, "closed before a poll saw it active")
	}
	for _, ref := range refs {
		for {
			obs, err := r.s.callTarget(ctx, c, controller.MethodTargetGet, getParams(ref), owner)
			if wait, ok := retryable(err); ok {
				if err := sleep(ctx, max(wait, r.s.cfg.PollInterval)); err != nil {
					r.fatalf("%v", err)
				}
				continue
			}
			var rpcErr *jsonrpc.Error
			if errors.As(err, &rpcErr) && rpcErr.Kind == jsonrpc.KindNotFound {
				seen = append(seen, "notFound")
				break
			}
			if err != nil {
				r.fatalf("target/get while the idle close is due: %s", describeErr(err))
			}
			if len(seen) == 0 || seen[len(seen)-1] != obs.Phase {
				seen = append(seen, obs.Phase)
			}
			if obs.Phase == controller.PhaseClosed {
				break
			}
			if obs.Phase != controller.PhaseActive && obs.Phase != controller.PhaseClosing {
				r.fatalf("target/get observed %s after an idle close fell due (through %v); a target the provider removed on its own is closed, or notFound", summary(obs), seen)
			}
			if time.Now().After(deadline) {
				r.fatalf("target/get still observes %s %v after the target fell idle, under a policy to close it after %v: the provider does not apply the idle policy (allow it more with -idle-grace)",
					summary(obs), time.Since(since).Round(100*time.Millisecond), after)
			}
			if err := sleep(ctx, r.s.cfg.PollInterval); err != nil {
				r.fatalf("%v", err)
			}
		}
	}
	if id == "" {
		// Closed before any answer carried its id: only the owner's view
		// can be checked.
		r.notef("target with policy %s: closed by the provider before any answer carried its id, observed through %v by owner",
			policyText(policy), seen)
		return
	}
	route := ""
	if r.s.cfg.RouteBase != "" {
		r.wantRouteGone(ctx, r.s.routeURL(owner, id), "the target closed for idleness")
		route = "; its data route answers 410 gone"
	}
	r.notef("target %s with policy %s: closed by the provider %v after it became active, observed through %v by owner and by id%s",
		id, policyText(policy), time.Since(since).Round(100*time.Millisecond), seen, route)
}

// stayRunning follows target/get until the deadline and ends the check
// when the target is anything but active and running; each is also a
// moment for tick, when set.
func (r *checkRun) stayRunning(ctx context.Context, c *conn, ref controller.TargetRef, until time.Time, down controller.Power, while string, tick func()) {
	for time.Now().Before(until) {
		obs := r.mustTarget(ctx, c, "target/get "+while, controller.MethodTargetGet, getParams(ref), ref.Owner)
		if obs.Phase != controller.PhaseActive || obs.Power != controller.PowerRunning {
			r.fatalf("target/get observed %s %s, under a policy to be %s when idle", summary(obs), while, down)
		}
		if tick != nil {
			tick()
		}
		if err := sleep(ctx, r.s.cfg.PollInterval); err != nil {
			r.fatalf("%v", err)
		}
	}
}

// openPoweringDown is the set-up of a check of data routes and power-downs:
// an initialized connection (the caller closes it), the template, and the
// least escalated power-down it offers. The check is skipped without data
// routes, without power advertised, or without a power-down to reach.
func (r *checkRun) openPoweringDown(ctx context.Context) (*conn, templateChoice, controller.Power) {
	r.needRoutes()
	c, init := r.mustOpen(ctx)
	handed := false
	defer func() {
		if !handed { // skipped or ended on the way
			c.close()
		}
	}()
	if !init.Capabilities.Power {
		r.skipf("the controller does not advertise power: no target can be powered down")
	}
	tmpl := r.template(ctx)
	down := powerDown(tmpl.powerStates)
	if down == "" {
		r.skipf("the template %s offers no power-down (powerStates %v)", tmpl.id, tmpl.powerStates)
	}
	handed = true
	return c, tmpl, down
}

// notBeforeThreshold fails the check with what happened when less than
// the policy's threshold has passed since the create was asked: an idle
// action that early cannot be the policy at work. It answers how long it
// has been.
func (r *checkRun) notBeforeThreshold(asked time.Time, after time.Duration, what string) time.Duration {
	took := time.Since(asked)
	if took < after {
		r.fatalf("%s %v after its create was sent, before its policy's %v could have passed", what, took.Round(time.Millisecond), after)
	}
	return took
}

// powerDown is the least escalated power-down a template offers: the one
// an idle policy reaches first; empty when it offers none.
func powerDown(states []controller.Power) controller.Power {
	for _, p := range []controller.Power{controller.PowerPaused, controller.PowerSuspended, controller.PowerStopped} {
		if slices.Contains(states, p) {
			return p
		}
	}
	return ""
}

// policyAfter is the idle policy that powers down to p after d idle, and
// does nothing else.
func policyAfter(p controller.Power, d time.Duration) idlepolicy.Policy {
	ms := uint64(max(d.Milliseconds(), 1))
	var policy idlepolicy.Policy
	switch p {
	case controller.PowerPaused:
		policy.PauseAfterMs = &ms
	case controller.PowerSuspended:
		policy.SuspendAfterMs = &ms
	default:
		policy.StopAfterMs = &ms
	}
	return policy
}

func policyText(p idlepolicy.Policy) string {
	b, _ := json.Marshal(p)
	return string(b)
}

// dataConn makes data-plane calls on a relayed connection, one at a time.
type dataConn struct {
	ws      *websocket.Conn
	timeout time.Duration
	seq     int
}

// call sends method and reads until its answer, skipping notifications;
// an error answer is returned as an error. out may be nil.
func (d *dataConn) call(method string, params, out any) error {
	d.seq++
	id := "lsconform-" + strconv.Itoa(d.seq)
	req, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": method, "params": params})
	if err != nil {
		return fmt.Errorf("%s: encode: %w", method, err)
	}
	deadline := time.Now().Add(d.timeout)
	_ = d.ws.SetWriteDeadline(deadline)
	if err := d.ws.WriteMessage(websocket.TextMessage, req); err != nil {
		return fmt.Errorf("%s: send: %w", method, err)
	}
	_ = d.ws.SetReadDeadline(deadline)
	for {
		_, data, err := d.ws.ReadMessage()
		if err != nil {
			return fmt.Errorf("%s: no answer: %w", method, err)
		}
		var resp struct {
			ID     *string          `json:"id"`
			Result json.RawMessage  `json:"result"`
			Error  *json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(data, &resp); err != nil {
			return fmt.Errorf("%s: the answer is not JSON-RPC: %s", method, clip(string(data), 200))
		}
		if resp.ID == nil || *resp.ID != id {
			continue // a notification, or not ours
		}
		if resp.Error != nil {
			return fmt.Errorf("%s answered an error: %s", method, clip(string(*resp.Error), 300))
		}
		if out == nil {
			return nil
		}
		if err := json.Unmarshal(resp.Result, out); err != nil {
			return fmt.Errorf("%s: the result does not decode: %w (%s)", method, err, clip(string(resp.Result), 200))
		}
		return nil
	}
}
