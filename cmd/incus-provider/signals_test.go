package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// On SIGTERM an open controller connection is told 1001 (going away) in a
// close frame before the process exits, rather than cut (1006).
func TestSigtermSendsGoingAway(t *testing.T) {
	c := startProvider(t)
	conns := []*rpcConn{c.dial(t), c.dial(t)}
	for _, r := range conns {
		r.initialize(t)
	}
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for i, r := range conns {
		_ = r.ws.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, _, err := r.ws.ReadMessage()
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.CloseGoingAway {
			t.Errorf("connection %d ended with %v, want a close frame with 1001", i, err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for c.alive() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if c.alive() {
		t.Fatal("the provider still runs 20 s after SIGTERM")
	}
}

// TestSigtermDrains: on SIGTERM readiness goes first (503 draining) while
// the provider still serves, a connection made then included, for
// PROVIDER_DRAIN_DELAY; then every controller connection goes away with
// 1001 and the process exits.
func TestSigtermDrains(t *testing.T) {
	// Long enough for a loopback dial and three calls answered from memory
	// on a machine starved for seconds (seen beside stress-ng): the calls
	// are what the delay is for.
	const delay = 10 * time.Second
	c := startProvider(t, "PROVIDER_DRAIN_DELAY=10s", "PROVIDER_DRAIN_TIMEOUT=5s")
	readyzURL := strings.TrimSuffix(c.metrics, "/metrics") + "/readyz"
	readyStatus := func() int {
		resp, err := http.Get(readyzURL) //nolint:noctx // loopback, bounded by the client's default dial and the process's own deadline
		if err != nil {
			return 0
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if got := readyStatus(); got != http.StatusOK {
		t.Fatalf("/readyz before SIGTERM: %d", got)
	}
	before := c.dial(t)
	before.initialize(t)
	sent := time.Now()
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for readyStatus() != http.StatusServiceUnavailable {
		if time.Since(sent) > delay {
			t.Fatal("/readyz did not answer 503 within the drain delay")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.waitLog(t, "draining: /readyz answers 503")
	// Still serving: a new connection and a call on the old one.
	during := c.dial(t)
	during.initialize(t)
	during.templateIDs(t, 1)
	before.templateIDs(t, 2)
	t.Logf("served a new connection and two calls %v into the %v drain delay", time.Since(sent).Round(time.Millisecond), delay)
	for i, r := range []*rpcConn{before, during} {
		_ = r.ws.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, _, err := r.ws.ReadMessage()
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.CloseGoingAway {
			t.Errorf("connection %d ended with %v, want a close frame with 1001", i, err)
		}
		if time.Since(sent) < delay {
			t.Errorf("connection %d went away %v after SIGTERM, inside the drain delay", i, time.Since(sent))
		}
	}
	select {
	case <-c.exited:
	case <-time.After(20 * time.Second):
		t.Fatal("the provider still runs 20 s after SIGTERM")
	}
	c.waitLog(t, "drained the controller plane")
}

// templateIDs asks template/list on r.
func (r *rpcConn) templateIDs(t *testing.T, id int) []string {
	t.Helper()
	frame, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": "template/list", "params": map[string]any{"universeId": "u"}})
	a, err := r.call(frame, 15*time.Second)
	if err != nil || a.Error != nil {
		t.Fatalf("template/list: %v %+v", err, a.Error)
	}
	var res struct {
		Templates []struct {
			TemplateID string `json:"templateId"`
		} `json:"templates"`
	}
	if err := json.Unmarshal(a.Result, &res); err != nil {
		t.Fatalf("template/list answer %s: %v", a.Result, err)
	}
	var ids []string
	for _, tm := range res.Templates {
		ids = append(ids, tm.TemplateID)
	}
	slices.Sort(ids)
	return ids
}

func (c *child) waitLog(t *testing.T, what string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		c.logMu.Lock()
		found := strings.Contains(c.log.String(), what)
		c.logMu.Unlock()
		if found {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the provider never logged %q:\n%s", what, c.logTail(20))
}

// SIGHUP reloads the templates file on a connection that stays open, and
// refuses a bad file with a logged sentence, keeping the templates it had.
// A target of a template the reload removed stays its owner's: observed,
// powered down and up, and closed.
func TestSighupReloadsTemplates(t *testing.T) {
	src, err := os.ReadFile("../../deploy/templates.dev.yaml")
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "templates.yaml")
	if err := os.WriteFile(file, src, 0o600); err != nil {
		t.Fatal(err)
	}
	c := startProvider(t, "PROVIDER_TEMPLATES="+file)
	r := c.dial(t)
	r.initialize(t)
	before := r.templateIDs(t, 1)
	if !slices.Contains(before, "dev-small") {
		t.Fatalf("templates at start: %v", before)
	}
	call := targetCaller(c.controller(t))
	kept := controller.TargetRef{Owner: controller.Owner{UniverseID: "u-reload", EnvironmentID: "kept"}}
	if _, err := call("target/create", controller.CreateParams{Owner: kept.Owner, TemplateID: "dev-small"}); err != nil {
		t.Fatal(err)
	}
	awaitObserved := func(what string, cond func(controller.Observation) bool) {
		t.Helper()
		for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			o, err := call("target/get", controller.TargetParams{Target: kept})
			if err == nil && cond(o) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the target of a removed template never %s: %+v, %v", what, o, err)
			}
		}
	}
	awaitObserved("active", func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning
	})

	renamed := bytes.Replace(src, []byte("templateId: dev-small"), []byte("templateId: dev-reloaded"), 1)
	if bytes.Equal(renamed, src) {
		t.Fatal("deploy/templates.dev.yaml no longer names dev-small; update this test")
	}
	if err := os.WriteFile(file, renamed, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: templates reloaded")
	after := r.templateIDs(t, 2)
	if !slices.Contains(after, "dev-reloaded") || slices.Contains(after, "dev-small") {
		t.Fatalf("templates after the reload, on the same connection: %v", after)
	}
	// dev-small is gone from the catalog; its target is not.
	if _, err := call("target/create", controller.CreateParams{Owner: controller.Owner{UniverseID: "u-reload", EnvironmentID: "new"}, TemplateID: "dev-small"}); err == nil || !strings.Contains(err.Error(), "notFound") {
		t.Fatalf("a new owner's create from the removed template: %v, want notFound", err)
	}
	if o, err := call("target/create", controller.CreateParams{Owner: kept.Owner, TemplateID: "dev-small"}); err != nil || o.Phase != controller.PhaseActive {
		t.Fatalf("the kept target's owner creating again: %+v, %v; want its target, active", o, err)
	}
	if _, err := call("target/setPower", controller.SetPowerParams{Target: kept, Power: controller.PowerPaused}); err != nil {
		t.Fatal(err)
	}
	awaitObserved("paused", func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
	})
	if _, err := call("target/setPower", controller.SetPowerParams{Target: kept, Power: controller.PowerRunning}); err != nil {
		t.Fatal(err)
	}
	awaitObserved("running again", func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
	})
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		o, err := call("target/close", controller.TargetParams{Target: kept})
		if err == nil && o.Phase == controller.PhaseClosed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the target of a removed template never closed: %+v, %v", o, err)
		}
	}

	if err := os.WriteFile(file, []byte("templates:\n  - nonsense: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: the templates file is refused; the templates loaded before stay in force")
	if got := r.templateIDs(t, 3); !slices.Equal(got, after) {
		t.Fatalf("after a refused reload: %v, want %v", got, after)
	}
	if !c.alive() {
		t.Fatal("the provider died of a refused reload")
	}
}

// SIGHUP rotates the bearer credential: a connection admitted before stays
// open, a new one needs the new credential and the old is refused; a file
// that cannot be used is refused with a sentence and the credential in
// force stays; no secret reaches the log.
func TestSighupRotatesTheCredential(t *testing.T) {
	c := startProvider(t)
	old := c.credential
	before := c.dial(t)
	before.initialize(t)
	ids := before.templateIDs(t, 1)

	const rotated = "rotated-credential-after-sighup-42"
	if err := os.WriteFile(c.credFile, []byte(rotated+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: credential reloaded")
	if got := c.upgradeStatus(t, old); got != http.StatusUnauthorized {
		t.Fatalf("the old credential after the rotation: HTTP %d, want 401", got)
	}
	c.credential = rotated
	after := c.dial(t)
	after.initialize(t)
	if got := before.templateIDs(t, 2); !slices.Equal(got, ids) {
		t.Fatalf("the connection admitted before the rotation: %v, want %v", got, ids)
	}

	if err := os.WriteFile(c.credFile, []byte("  \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: the credential file is refused; the credential loaded before stays in force")
	if got := c.upgradeStatus(t, rotated); got != http.StatusSwitchingProtocols {
		t.Fatalf("the credential in force after a refused reload: HTTP %d, want 101", got)
	}
	if got := c.upgradeStatus(t, ""); got != http.StatusUnauthorized {
		t.Fatalf("no credential after a refused reload: HTTP %d, want 401", got)
	}
	c.logMu.Lock()
	logged := c.log.String()
	c.logMu.Unlock()
	if strings.Contains(logged, rotated) || strings.Contains(logged, old) {
		t.Fatal("a credential reached the log")
	}
}

// upgradeStatus is the HTTP status of a controller upgrade presenting
// secret (none when empty).
func (c *child) upgradeStatus(t *testing.T, secret string) int {
	t.Helper()
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	h := http.Header{}
	if secret != "" {
		h.Set("Authorization", "Bearer "+secret)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	ws, resp, err := d.DialContext(ctx, c.control, h)
	if ws != nil {
		_ = ws.Close()
	}
	if resp == nil {
		t.Fatalf("no HTTP answer to the upgrade: %v", err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// SIGHUP reloads the TLS certificates, the controller's and the public
// edge's: new handshakes get the new ones, a connection made before keeps
// working, and a file refused leaves the one in force.
func TestSighupReloadsTheCertificate(t *testing.T) {
	crtA, keyA := selfSigned(t)
	crtB, keyB := selfSigned(t)
	dir := t.TempDir()
	crt, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	edgeCrt, edgeKey := filepath.Join(dir, "edge.crt"), filepath.Join(dir, "edge.key")
	install := func(fromCrt, fromKey string) {
		for _, p := range [][2]string{{fromCrt, crt}, {fromKey, key}, {fromCrt, edgeCrt}, {fromKey, edgeKey}} {
			b, err := os.ReadFile(p[0])
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p[1], b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	install(crtA, keyA)
	edge := freePort(t)
	c := startProvider(t, "PROVIDER_TLS_CERT="+crt, "PROVIDER_TLS_KEY="+key,
		"PROVIDER_INGRESS_LISTEN="+edge, "PROVIDER_INGRESS_BASE_URL=https://{label}.localhost:1",
		"PROVIDER_INGRESS_TLS_CERT="+edgeCrt, "PROVIDER_INGRESS_TLS_KEY="+edgeKey)
	// The test's own self-signed certificates, on loopback: nothing to verify.
	tlsConf := &tls.Config{InsecureSkipVerify: true} //nolint:gosec
	// served is the certificate a new handshake with addr gets. A client
	// that offers h2 first, as browsers and many HTTP stacks do, must be
	// given HTTP/1.1 by the controller (the only way to a WebSocket) and
	// h2 by the edge.
	served := func(addr, alpn string) []byte {
		offer := tlsConf.Clone()
		offer.NextProtos = []string{"h2", "http/1.1"}
		d := tls.Dialer{Config: offer, NetDialer: &net.Dialer{Timeout: 10 * time.Second}}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			t.Fatalf("TLS dial %s: %v", addr, err)
		}
		defer conn.Close()
		state := conn.(*tls.Conn).ConnectionState()
		if state.NegotiatedProtocol != alpn {
			t.Fatalf("%s: ALPN gave %q to a client offering h2 and http/1.1; want %s", addr, state.NegotiatedProtocol, alpn)
		}
		return state.PeerCertificates[0].Raw
	}
	both := func(want []byte) bool {
		return bytes.Equal(served(c.listen, "http/1.1"), want) && bytes.Equal(served(edge, "h2"), want)
	}
	pemDER := func(path string) []byte {
		cert, err := tls.LoadX509KeyPair(path, strings.TrimSuffix(path, ".crt")+".key")
		if err != nil {
			t.Fatal(err)
		}
		return cert.Certificate[0]
	}
	if !both(pemDER(crtA)) {
		t.Fatal("the provider does not serve the configured certificates")
	}
	d := websocket.Dialer{TLSClientConfig: tlsConf, HandshakeTimeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	ws, resp, err := d.DialContext(ctx, "wss://"+c.listen+"/control", http.Header{"Authorization": {"Bearer " + c.credential}})
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		t.Fatalf("wss dial: %v", err)
	}
	defer ws.Close()
	old := &rpcConn{ws: ws}
	old.initialize(t)

	install(crtB, keyB)
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: TLS certificate reloaded")
	c.waitLog(t, "SIGHUP: ingress TLS certificate reloaded")
	if !both(pemDER(crtB)) {
		t.Fatal("a new handshake after SIGHUP does not get the new certificate")
	}
	old.templateIDs(t, 1) // the connection from before still answers

	for _, f := range []string{crt, edgeCrt} {
		if err := os.WriteFile(f, []byte("not a certificate\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: the TLS certificate is refused")
	c.waitLog(t, "SIGHUP: the ingress TLS certificate is refused")
	if !both(pemDER(crtB)) {
		t.Fatal("a refused certificate replaced the one in force")
	}
}

// TestSighupReadsTheSettingsFileAgain: with PROVIDER_SETTINGS_FILE, SIGHUP
// applies the file's PROVIDER_LOG_LEVEL in place (debug lines appear), names
// another changed setting as taking a restart, and refuses a file with a
// bad value as a whole, keeping the level in force.
func TestSighupReadsTheSettingsFileAgain(t *testing.T) {
	file := filepath.Join(t.TempDir(), "provider.env")
	write := func(body string) {
		t.Helper()
		if err := os.WriteFile(file, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("# as the unit's EnvironmentFile\nPROVIDER_LOG_LEVEL=info\nPROVIDER_GRACEFUL_STOP=5s\n")
	c := startProvider(t, "PROVIDER_SETTINGS_FILE="+file)

	write("PROVIDER_LOG_LEVEL=\"debug\"\nPROVIDER_GRACEFUL_STOP=7s\n")
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: the log level is now debug")
	c.waitLog(t, "SIGHUP: PROVIDER_GRACEFUL_STOP differs in the settings file; it takes a restart")
	// A connection's end is logged at debug: now it is.
	r := c.dial(t)
	r.initialize(t)
	_ = r.ws.Close()
	c.waitLog(t, `"level":"debug"`)

	write("PROVIDER_LOG_LEVEL=loud\n")
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: the settings file is refused; the settings in force stay")
	c.logMu.Lock()
	logged := c.log.String()
	c.logMu.Unlock()
	if strings.Contains(logged, "the log level is now loud") || !c.alive() {
		t.Fatal("a refused settings file changed the level or ended the process")
	}
}
