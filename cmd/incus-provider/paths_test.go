package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
)

// TestUnixControllerWithARouteListener: the contract lets a controller URL
// have any path, and a unix:// controller has no data route base a runtime
// could derive, so the operator names one. The provider listens on a unix
// socket, serves the same on a TCP route listener, and takes its data
// routes from PROVIDER_ROUTE_PATH: the controller answers on the socket at
// any path and on the route listener; a data route under the configured
// path is a data route (refused as gone, with its typed body, for a target
// that does not exist).
func TestUnixControllerWithARouteListener(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "provider.sock")
	routeAddr := freePort(t)
	c := startProvider(t, "PROVIDER_LISTEN=unix:"+sock, "PROVIDER_ROUTE_LISTEN="+routeAddr, "PROVIDER_ROUTE_PATH=/env/data")
	c.waitLog(t, `"dataRouteBase":"ws://`+routeAddr+`/env/data"`)
	auth := http.Header{"Authorization": {"Bearer " + c.credential}}

	overUnix := websocket.Dialer{HandshakeTimeout: 10 * time.Second, NetDialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}
	for _, path := range []string{"/", "/control", "/any/path/at/all"} {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		ws, resp, err := overUnix.DialContext(ctx, "ws://provider"+path, auth)
		cancel()
		if resp != nil && resp.Body != nil {
			_ = resp.Body.Close()
		}
		if err != nil {
			t.Fatalf("the controller over the unix socket at %s: %v", path, err)
		}
		rc := &rpcConn{ws: ws}
		rc.initialize(t)
		rc.templateIDs(t, 1)
		_ = ws.Close()
	}

	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	ws, resp, err := websocket.DefaultDialer.DialContext(ctx, "ws://"+routeAddr+"/control", auth)
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		t.Fatalf("the controller on the route listener: %v", err)
	}
	rc := &rpcConn{ws: ws}
	rc.initialize(t)
	_ = ws.Close()

	// A data route under the configured path, for an owner with no target.
	d, err := conformance.DialRoute(ctx, "ws://"+routeAddr+"/env/data/u1/env-paths/ls-00000000000000000000", c.credential)
	if err != nil {
		t.Fatalf("a data route under PROVIDER_ROUTE_PATH: %v", err)
	}
	if d.Refusal == nil || d.Status != http.StatusGone || d.Refusal.State != "gone" {
		t.Fatalf("a data route to no target: status %d, %+v; want 410 gone", d.Status, d.Refusal)
	}
	// The same route under the default path is no data route here.
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+routeAddr+"/routes/u1/env-paths/ls-00000000000000000000", nil)
	req.Header.Set("Authorization", "Bearer "+c.credential)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	_ = res.Body.Close()
	var typed struct {
		State string `json:"state"`
	}
	if json.Unmarshal(body, &typed) == nil && typed.State != "" {
		t.Fatalf("/routes/… answered a data route's refusal (%d %s) with PROVIDER_ROUTE_PATH=/env/data", res.StatusCode, body)
	}
}
