// Command routecheck proves a running provider's data routes from outside,
// as a runtime meets them: it creates a target through the controller
// plane, powers it down (paused, then stopped), dials its data route until
// the route upgrades, and opens a data-plane session through the relay
// (initialize). It then closes the target. deploy/dev/container-test.sh
// runs it against the provider in its container, where a missing flag
// (--pid=host for the netns dialer) shows as routes that never upgrade.
//
// Usage:
//
//	routecheck -url ws://127.0.0.1:8480/control -credential-file FILE [-template dev-small] [-from paused,stopped]
//
// One line per wake on stdout; it exits 1 with a sentence when a step fails.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/routes"
)

func main() {
	controlURL := flag.String("url", "", "the provider's controller URL (ws://host:port/control)")
	credFile := flag.String("credential-file", "", "file holding the bearer credential")
	template := flag.String("template", "dev-small", "template of the target")
	from := flag.String("from", "paused,stopped", "powers to wake the target from, in order")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := run(ctx, *controlURL, *credFile, *template, strings.Split(*from, ",")); err != nil {
		fmt.Fprintln(os.Stderr, "routecheck: "+err.Error())
		os.Exit(1)
	}
}

func run(ctx context.Context, controlURL, credFile, template string, froms []string) error {
	u, err := url.Parse(controlURL)
	if err != nil || u.Scheme != "ws" || u.Host == "" {
		return fmt.Errorf("-url %q is not a ws://host:port/control URL", controlURL)
	}
	raw, err := os.ReadFile(credFile)
	if err != nil {
		return fmt.Errorf("-credential-file: %w", err)
	}
	credential := strings.TrimSpace(string(raw))
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	ws, resp, err := d.DialContext(ctx, controlURL, map[string][]string{"Authorization": {"Bearer " + credential}})
	if resp != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		return fmt.Errorf("the controller plane: %w", err)
	}
	ctrl := jsonrpc.NewClient(ws)
	defer func() { _ = ctrl.Close() }()
	var init controller.InitializeResult
	if err := ctrl.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: controller.ProtocolVersion,
		ClientInfo: controller.BuildInfo{Name: "routecheck"}}, &init); err != nil {
		return fmt.Errorf("controller initialize: %w", err)
	}
	owner := controller.Owner{UniverseID: "u-routecheck", EnvironmentID: fmt.Sprintf("env-%d", time.Now().UnixNano())}
	ref := controller.TargetRef{Owner: owner}
	defer closeTarget(ctrl, ref)
	var res controller.TargetResult
	if err := ctrl.Call(ctx, "target/create", controller.CreateParams{Owner: owner, TemplateID: template}, &res); err != nil {
		return fmt.Errorf("target/create %s: %w", template, err)
	}
	o, err := await(ctx, ctrl, ref, controller.PowerRunning, 2*time.Minute)
	if err != nil {
		return err
	}
	route := "ws://" + u.Host + routes.Path(routes.DefaultPrefix, routes.Route{Owner: owner, TargetID: o.TargetID})
	for _, p := range froms {
		power := controller.Power(strings.TrimSpace(p))
		if err := ctrl.Call(ctx, "target/setPower", controller.SetPowerParams{Target: ref, Power: power}, &res); err != nil {
			return fmt.Errorf("target/setPower %s: %w", power, err)
		}
		if _, err := await(ctx, ctrl, ref, power, time.Minute); err != nil {
			return err
		}
		took, refusals, err := wake(ctx, route, credential)
		if err != nil {
			return fmt.Errorf("waking %s from %s: %w", o.TargetID, power, err)
		}
		fmt.Printf("wake from %s: upgraded after %s (%d refusals first), the daemon answered initialize through the relay\n",
			power, took.Round(time.Millisecond), refusals)
	}
	return nil
}

// wake dials the route as a runtime does, again after each refusal, for at
// most a minute, then initializes a data session through the relay.
func wake(ctx context.Context, route, credential string) (time.Duration, int, error) {
	start := time.Now()
	deadline := start.Add(time.Minute)
	for refusals := 0; ; refusals++ {
		dial, err := conformance.DialRoute(ctx, route, credential)
		if err != nil {
			return 0, refusals, err
		}
		if dial.Conn != nil {
			defer dial.Conn.Close()
			return time.Since(start), refusals, conformance.InitializeData(dial.Conn, "routecheck", 10*time.Second)
		}
		if time.Now().After(deadline) {
			return 0, refusals, fmt.Errorf("the route still refuses after a minute: %d %s (%s)", dial.Refusal.Status, dial.Refusal.State, dial.Refusal.Message)
		}
		if !clock.Sleep(ctx, time.Second) {
			return 0, refusals, ctx.Err()
		}
	}
}

// await polls target/get until the target is active at power p, settled.
func await(ctx context.Context, ctrl *jsonrpc.Client, ref controller.TargetRef, p controller.Power, most time.Duration) (controller.Observation, error) {
	deadline := time.Now().Add(most)
	for {
		var res controller.TargetResult
		err := ctrl.Call(ctx, "target/get", controller.TargetParams{Target: ref}, &res)
		if o := res.Target; err == nil && o.Phase == controller.PhaseActive && o.Power == p && o.Message == "" {
			return o, nil
		}
		if time.Now().After(deadline) {
			return res.Target, fmt.Errorf("the target was not %s within %s (last seen %+v, %w)", p, most, res.Target, err)
		}
		if !clock.Sleep(ctx, 100*time.Millisecond) {
			return res.Target, ctx.Err()
		}
	}
}

// closeTarget closes the target, waiting up to a minute for closed.
func closeTarget(ctrl *jsonrpc.Client, ref controller.TargetRef) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		var res controller.TargetResult
		err := ctrl.Call(ctx, "target/close", controller.TargetParams{Target: ref}, &res)
		if (err == nil && res.Target.Phase == controller.PhaseClosed) || errors.Is(err, jsonrpc.ErrClosed) || ctx.Err() != nil {
			return
		}
		if !clock.Sleep(ctx, 200*time.Millisecond) {
			return
		}
	}
}
