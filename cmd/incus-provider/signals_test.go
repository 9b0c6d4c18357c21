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

// SIGHUP reloads the TLS certificate: new handshakes get the new one, and
// a connection made before keeps working.
func TestSighupReloadsTheCertificate(t *testing.T) {
	crtA, keyA := selfSigned(t)
	crtB, keyB := selfSigned(t)
	dir := t.TempDir()
	crt, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	install := func(fromCrt, fromKey string) {
		for _, p := range [][2]string{{fromCrt, crt}, {fromKey, key}} {
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
	c := startProvider(t, "PROVIDER_TLS_CERT="+crt, "PROVIDER_TLS_KEY="+key)
	// The test's own self-signed certificates, on loopback: nothing to verify.
	tlsConf := &tls.Config{InsecureSkipVerify: true} //nolint:gosec
	served := func() []byte {
		// A client that offers h2 first, as browsers and many HTTP stacks
		// do, must still be given HTTP/1.1, the only way to a WebSocket.
		offer := tlsConf.Clone()
		offer.NextProtos = []string{"h2", "http/1.1"}
		d := tls.Dialer{Config: offer, NetDialer: &net.Dialer{Timeout: 10 * time.Second}}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := d.DialContext(ctx, "tcp", c.listen)
		if err != nil {
			t.Fatalf("TLS dial: %v", err)
		}
		defer conn.Close()
		state := conn.(*tls.Conn).ConnectionState()
		if state.NegotiatedProtocol != "http/1.1" {
			t.Fatalf("ALPN gave %q to a client offering h2 and http/1.1; want http/1.1", state.NegotiatedProtocol)
		}
		return state.PeerCertificates[0].Raw
	}
	pemDER := func(path string) []byte {
		cert, err := tls.LoadX509KeyPair(path, strings.TrimSuffix(path, ".crt")+".key")
		if err != nil {
			t.Fatal(err)
		}
		return cert.Certificate[0]
	}
	if !bytes.Equal(served(), pemDER(crtA)) {
		t.Fatal("the provider does not serve the configured certificate")
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
	if !bytes.Equal(served(), pemDER(crtB)) {
		t.Fatal("a new handshake after SIGHUP does not get the new certificate")
	}
	old.templateIDs(t, 1) // the connection from before still answers

	if err := os.WriteFile(crt, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	c.waitLog(t, "SIGHUP: the TLS certificate is refused")
	if !bytes.Equal(served(), pemDER(crtB)) {
		t.Fatal("a refused certificate replaced the one in force")
	}
}
