package controller_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// Past MaxConnections a controller connection is refused with 503 and
// Retry-After before the upgrade, counted, and a closed connection frees
// its place.
func TestControllerConnectionCeiling(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := controller.NewMetrics(reg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := controller.NewHandler(ctx, controller.Options{Backend: noBackend{}, MaxConnections: 2, Metrics: m})
	srv := httptest.NewServer(h)
	defer srv.Close()
	url := "ws" + strings.TrimPrefix(srv.URL, "http") + "/control"
	dial := func() (*websocket.Conn, *http.Response, error) {
		d := websocket.Dialer{HandshakeTimeout: 5 * time.Second}
		ws, resp, err := d.Dial(url, nil)
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		return ws, resp, err
	}
	first, _, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	second, _, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	_, resp, err := dial()
	if err == nil || resp == nil || resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("a third connection: %v %+v; want 503 with Retry-After", err, resp)
	}
	if n := testutil.ToFloat64(m.Refused(controller.RefusedConnectionLimit)); n != 1 {
		t.Fatalf("refusals counted: %v", n)
	}
	first.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ws, _, err := dial()
		if err == nil {
			ws.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a closed connection freed no place: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// noBackend is never called: these tests do not get past the handshake.
type noBackend struct{ controller.Backend }
