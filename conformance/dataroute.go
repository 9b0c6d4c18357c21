package conformance

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// routeSegment percent-encodes s as one data route segment: every byte
// but RFC 3986's unreserved characters.
func routeSegment(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' {
			b.WriteByte(c)
			continue
		}
		fmt.Fprintf(&b, "%%%02X", c)
	}
	return b.String()
}

// routeURL is the data route of owner's target id.
func (s *suite) routeURL(owner controller.Owner, targetID string) string {
	return s.cfg.RouteBase + "/" + routeSegment(owner.UniverseID) + "/" + routeSegment(owner.EnvironmentID) + "/" + routeSegment(targetID)
}

// needRoutes ends the check as skipped when no data route base is known.
func (r *checkRun) needRoutes() {
	if r.s.cfg.RouteBase == "" {
		r.skipf("a unix:// controller has no data route base the runtime can derive; give one (-route-base)")
	}
}

// upgradeRoute dials a route as the runtime does until it upgrades: a
// 503 is dialed again after its Retry-After, within the settle timeout;
// every answer must be an upgrade or a typed refusal, and within the hold
// bound unless asRuntime (the subject is then the relay, not the hold).
// It answers the connection and the dials it took.
func (r *checkRun) upgradeRoute(ctx context.Context, routeURL string, asRuntime bool) (*websocket.Conn, int) {
	d := RouteDialer{TLSConfig: r.s.cfg.TLSConfig, AsARuntime: asRuntime}
	deadline := time.Now().Add(r.s.cfg.SettleTimeout)
	for dials := 1; ; dials++ {
		got, err := d.Dial(ctx, routeURL, r.s.cfg.Credential)
		if err != nil {
			if got.Conn != nil {
				_ = got.Conn.Close()
			}
			r.fatalf("dial %d of the data route %s: %v", dials, routeURL, err)
		}
		if got.Conn != nil {
			return got.Conn, dials
		}
		if got.Refusal.Status != http.StatusServiceUnavailable {
			r.fatalf("dial %d of the data route of an active target answered HTTP %d (%s); only a 503 may succeed later", dials, got.Status, got.Refusal.State)
		}
		if time.Now().Add(got.Refusal.RetryAfter).After(deadline) {
			r.fatalf("the data route still refuses (%s, Retry-After %s) after %d dials over %s", got.Refusal.State, got.Refusal.RetryAfter, dials, r.s.cfg.SettleTimeout)
		}
		if err := sleep(ctx, got.Refusal.RetryAfter); err != nil {
			r.fatalf("waiting to dial the data route again: %v", err)
		}
	}
}

// wantRouteGone requires the route of a target that no longer exists to
// answer a typed 410 gone.
func (r *checkRun) wantRouteGone(ctx context.Context, routeURL, whose string) {
	got, err := RouteDialer{TLSConfig: r.s.cfg.TLSConfig}.Dial(ctx, routeURL, r.s.cfg.Credential)
	switch {
	case got.Conn != nil:
		_ = got.Conn.Close()
		r.failf("the route of %s upgraded", whose)
	case err != nil:
		r.failf("the route of %s: %v", whose, err)
	case got.Refusal.Status != http.StatusGone:
		r.failf("the route of %s answered HTTP %d (%s); want 410 gone: the target no longer exists", whose, got.Status, got.Refusal.State)
	}
}

// rawRouteStatus dials a route with the given Authorization (none when
// empty) and answers the HTTP status, closing whatever came.
func (r *checkRun) rawRouteStatus(ctx context.Context, routeURL, authorization string) int {
	d := websocket.Dialer{TLSClientConfig: r.s.cfg.TLSConfig, HandshakeTimeout: MaxDataRouteHold + RouteHoldGrace}
	h := http.Header{}
	if authorization != "" {
		h.Set("Authorization", authorization)
	}
	ws, resp, err := d.DialContext(ctx, routeURL, h)
	if ws != nil {
		_ = ws.Close()
	}
	if resp == nil {
		r.fatalf("dial %s: no HTTP answer: %v", routeURL, err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// checkDataRoute: an active target's route, its segments percent-encoded,
// upgrades and relays the daemon's data plane (initialize answered,
// pings answered); it refuses a missing or wrong credential with 401, and
// every owner but the target's; once the target is closed it answers 410
// gone.
func checkDataRoute(ctx context.Context, r *checkRun) {
	r.needRoutes()
	c, _ := r.mustOpen(ctx)
	defer c.close()
	// A ':' in the environment id is allowed by its grammar and is not
	// unreserved: the route carries it as %3A.
	owner := r.adopt(controller.Owner{UniverseID: r.s.cfg.UniverseID, EnvironmentID: fmt.Sprintf("lsconf-%s:route-%d", r.s.runID, r.s.seq.Add(1))})
	_, active := r.createActiveAs(ctx, c, owner, r.template(ctx).id)
	routeURL := r.s.routeURL(owner, active.TargetID)

	ws, dials := r.upgradeRoute(ctx, routeURL, true)
	func() {
		defer func() { _ = ws.Close() }()
		if err := InitializeData(ws, clientInfo.Name, r.s.cfg.Timeout); err != nil {
			r.failf("the upgraded data route did not relay the daemon's initialize: %v", err)
			return
		}
		pong := make(chan struct{}, 1)
		ws.SetPongHandler(func(data string) error {
			if data == "lsconform-route" {
				select {
				case pong <- struct{}{}:
				default:
				}
			}
			return nil
		})
		if err := ws.WriteControl(websocket.PingMessage, []byte("lsconform-route"), time.Now().Add(r.s.cfg.Timeout)); err != nil {
			r.failf("send a ping on the data route: %v", err)
			return
		}
		// Pongs are read along with messages: ask the daemon again.
		_ = ws.SetReadDeadline(time.Now().Add(r.s.cfg.Timeout))
		req := `{"jsonrpc":"2.0","id":2,"method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":"lightspeed-conformance"}}}`
		if err := ws.WriteMessage(websocket.TextMessage, []byte(req)); err != nil {
			r.failf("send on the data route after a ping: %v", err)
			return
		}
		if _, _, err := ws.ReadMessage(); err != nil {
			r.failf("read on the data route after a ping: %v", err)
			return
		}
		select {
		case <-pong:
		default:
			r.failf("a ping on the data route got no pong before the answer to a request sent after it; a route forwards ping and pong frames")
		}
	}()

	if r.s.cfg.Credential != "" {
		for _, a := range []struct{ what, header string }{
			{"without a credential", ""},
			{"with a wrong credential", "Bearer " + r.s.cfg.Credential + "-wrong"},
		} {
			if got := r.rawRouteStatus(ctx, routeURL, a.header); got != http.StatusUnauthorized {
				r.failf("the data route dialed %s answered HTTP %d; want 401 before the upgrade", a.what, got)
			}
		}
	}

	d := RouteDialer{TLSConfig: r.s.cfg.TLSConfig, AsARuntime: true}
	others := []controller.Owner{
		{UniverseID: owner.UniverseID, EnvironmentID: owner.EnvironmentID + "-stranger"},
		{UniverseID: "lsconf-other-" + r.s.runID, EnvironmentID: owner.EnvironmentID},
	}
	for _, o := range others {
		got, err := d.Dial(ctx, r.s.routeURL(o, active.TargetID), r.s.cfg.Credential)
		if got.Conn != nil {
			_ = got.Conn.Close()
			r.failf("the route of owner %s/%s to another owner's target %s upgraded; a route whose owner does not own the target is refused", o.UniverseID, o.EnvironmentID, active.TargetID)
			continue
		}
		if err != nil && got.Status == 0 {
			r.failf("the route of owner %s/%s to another owner's target: %v", o.UniverseID, o.EnvironmentID, err)
		}
	}

	if _, err := r.s.closeUntilClosed(ctx, c, controller.TargetRef{Owner: owner}); err != nil {
		r.fatalf("closing the target: %s", describeErr(err))
	}
	r.wantRouteGone(ctx, routeURL, "a closed target")
	r.notef("target %s relayed on %s after %d dials; pings forwarded; foreign owners refused; 410 gone once closed", active.TargetID, routeURL, dials)
}

// checkRouteWake: the route of a powered-down target wakes it: every
// answer comes within the hold bound, an upgrade or a typed 503 with its
// Retry-After, until it upgrades and relays; target/get then observes it
// running.
func checkRouteWake(ctx context.Context, r *checkRun) {
	c, _, down := r.openPoweringDown(ctx)
	defer c.close()
	owner, active := r.createActive(ctx, c, "wake")
	ref := controller.TargetRef{Owner: owner, TargetID: active.TargetID}
	r.movePower(ctx, c, ref, down)

	start := time.Now()
	ws, dials := r.upgradeRoute(ctx, r.s.routeURL(owner, active.TargetID), false)
	took := time.Since(start)
	defer func() { _ = ws.Close() }()
	if err := InitializeData(ws, clientInfo.Name, r.s.cfg.Timeout); err != nil {
		r.failf("the woken target's route did not relay the daemon's initialize: %v", err)
	}
	deadline := time.Now().Add(r.s.cfg.SettleTimeout)
	for {
		obs := r.mustTarget(ctx, c, "target/get after the wake", controller.MethodTargetGet, getParams(ref), owner)
		if obs.Phase == controller.PhaseActive && obs.Power == controller.PowerRunning {
			break
		}
		if time.Now().After(deadline) {
			r.fatalf("target/get observes %s after the route relayed; a woken target runs", summary(obs))
		}
		if err := sleep(ctx, r.s.cfg.PollInterval); err != nil {
			r.fatalf("%v", err)
		}
	}
	r.notef("woken from %s by %d dials in %v, each answered within the hold bound", down, dials, took.Round(time.Millisecond))
}
