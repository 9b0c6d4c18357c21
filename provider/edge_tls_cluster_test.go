package provider_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// TestClusterEdgeTLSThroughTheBalancer: the replicas' edges serve TLS
// themselves and HAProxy passes it through
// (deploy/haproxy/incus-provider-edge-tls.cfg). A route to a guest on
// lsm3, a member no replica runs on, answers HTTP/2 through the balancer
// and through each replica's edge, streams server-sent events over
// HTTP/2, and takes a WebSocket over TLS (HTTP/1.1, as browsers open one
// where the server offers no WebSocket over HTTP/2).
func TestClusterEdgeTLSThroughTheBalancer(t *testing.T) {
	r := newLBRigOpts(t, lbOptions{edgeTLS: true, templates: webOnLsm3})
	_, endpoint := r.ingressOnLsm3(controller.Owner{UniverseID: "u-edge-tls", EnvironmentID: "web"})
	u, err := url.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	if u.Scheme != "https" || !strings.HasSuffix(u.Host, ":"+portOf(t, r.edge)) {
		t.Fatalf("the endpoint %s is not the balancer's TLS edge %s", endpoint, r.edge)
	}
	// h2 is a client that speaks HTTP/2 where the server offers it, to the
	// edge at addr; *.localhost is never looked up.
	h2 := func(addr string) *http.Client {
		return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
			TLSClientConfig: rigTLS.Clone(), ForceAttemptHTTP2: true,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "tcp", addr)
			}}}
	}
	page := func(via, addr string) {
		t.Helper()
		client := h2(addr)
		defer client.CloseIdleConnections()
		// A route ensured through one replica reaches the other through
		// Incus's event: a 404 may come first, for a bounded while.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"/", nil)
			if err != nil {
				cancel()
				t.Fatal(err)
			}
			resp, err := client.Do(req)
			if err != nil {
				cancel()
				t.Fatalf("GET %s through %s: %v", endpoint, via, err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			cancel()
			if resp.StatusCode == http.StatusNotFound && time.Now().Before(deadline) {
				continue
			}
			if resp.StatusCode != http.StatusOK || len(body) == 0 || resp.ProtoMajor != 2 {
				t.Fatalf("GET through %s: %s %s, %d bytes; want 200 over HTTP/2", via, resp.Proto, resp.Status, len(body))
			}
			return
		}
	}
	page("the balancer", r.edge)
	for _, rep := range r.replicas {
		page("replica "+rep.id, rep.edge)
	}

	// Server-sent events over HTTP/2 through the balancer: two events.
	client := h2(r.edge)
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || resp.ProtoMajor != 2 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("GET /events through the balancer: %s %s %s", resp.Proto, resp.Status, resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	events := 0
	for events < 2 && sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data: ") {
			events++
		}
	}
	resp.Body.Close()
	if events < 2 {
		t.Fatalf("the event stream over HTTP/2 gave %d events before it ended: %v", events, sc.Err())
	}

	// A WebSocket over TLS through the balancer, echoed by the guest.
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, TLSClientConfig: rigTLS.Clone(),
		NetDialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var nd net.Dialer
			return nd.DialContext(ctx, "tcp", r.edge)
		}}
	ws, wresp, err := d.Dial("wss://"+u.Host+"/ws", http.Header{"Origin": {endpoint}})
	if err != nil {
		status := 0
		if wresp != nil {
			status = wresp.StatusCode
		}
		t.Fatalf("WebSocket over TLS through the balancer: %v (status %d)", err, status)
	}
	defer ws.Close()
	_ = ws.SetReadDeadline(time.Now().Add(15 * time.Second))
	for _, msg := range []string{"one", strings.Repeat("x", 64<<10)} {
		if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		_, got, err := ws.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != "echo: "+msg {
			t.Fatalf("the echo of a %d-byte message was %d bytes", len(msg), len(got))
		}
	}
}
