package conformance

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"
)

// refusal writes a data-route refusal as a handler would.
type refusal struct {
	status      int
	contentType string
	retryAfter  []string
	body        string
}

func (r refusal) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	if r.contentType != "" {
		w.Header().Set("Content-Type", r.contentType)
	}
	for _, v := range r.retryAfter {
		w.Header().Add("Retry-After", v)
	}
	w.WriteHeader(r.status)
	_, _ = w.Write([]byte(r.body))
}

func (r refusal) response() *http.Response {
	rec := httptest.NewRecorder()
	r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/routes/u/e/t", nil))
	return rec.Result()
}

const jsonType = "application/json"

func TestCheckRefusalAcceptsEveryState(t *testing.T) {
	for _, r := range []refusal{
		{503, jsonType, []string{"5"}, `{"state":"waking"}`},
		{503, "application/json; charset=utf-8", []string{"1"}, `{"state":"booting"}`},
		{503, jsonType, []string{"60"}, `{"state":"booting","message":"The daemon does not answer yet."}`},
		{410, jsonType, nil, `{"state":"gone"}`},
		{409, jsonType, nil, `{"state":"failed","message":"The instance is in an error state."}`},
	} {
		if err := CheckRefusal(r.response()); err != nil {
			t.Errorf("CheckRefusal(%d %s): %v", r.status, r.body, err)
		}
	}
}

func TestReadRefusal(t *testing.T) {
	got, err := ReadRefusal(refusal{503, jsonType, []string{"7"}, `{"state":"waking"}`}.response())
	if err != nil {
		t.Fatal(err)
	}
	if want := (Refusal{Status: 503, State: "waking", RetryAfter: 7 * time.Second}); got != want {
		t.Errorf("ReadRefusal = %+v, want %+v", got, want)
	}
}

func TestCheckRefusalRefuses(t *testing.T) {
	cases := []struct {
		name string
		r    refusal
		says string
	}{
		{"a state with the wrong status", refusal{410, jsonType, nil, `{"state":"waking"}`}, "goes with HTTP 503"},
		{"failed as a 503", refusal{503, jsonType, []string{"3"}, `{"state":"failed","message":"m"}`}, "goes with HTTP 409"},
		{"gone as a 404", refusal{404, jsonType, nil, `{"state":"gone"}`}, "goes with HTTP 410"},
		{"a 503 without Retry-After", refusal{503, jsonType, nil, `{"state":"waking"}`}, "0 Retry-After"},
		{"Retry-After 0", refusal{503, jsonType, []string{"0"}, `{"state":"booting"}`}, "outside 1 to 60"},
		{"Retry-After 61", refusal{503, jsonType, []string{"61"}, `{"state":"booting"}`}, "outside 1 to 60"},
		{"Retry-After as a date", refusal{503, jsonType, []string{"Wed, 21 Oct 2015 07:28:00 GMT"}, `{"state":"booting"}`}, "whole number"},
		{"Retry-After with a fraction", refusal{503, jsonType, []string{"1.5"}, `{"state":"booting"}`}, "whole number"},
		{"Retry-After negative", refusal{503, jsonType, []string{"-1"}, `{"state":"booting"}`}, "whole number"},
		{"two Retry-After headers", refusal{503, jsonType, []string{"1", "2"}, `{"state":"booting"}`}, "2 Retry-After"},
		{"a text body", refusal{503, "text/plain", []string{"1"}, `{"state":"waking"}`}, "Content-Type"},
		{"no Content-Type", refusal{410, "", nil, `{"state":"gone"}`}, "Content-Type"},
		{"an unknown state", refusal{503, jsonType, []string{"1"}, `{"state":"asleep"}`}, "state"},
		{"the gateway's own state", refusal{503, jsonType, []string{"1"}, `{"state":"provisioning"}`}, "state"},
		{"failed without a message", refusal{409, jsonType, nil, `{"state":"failed"}`}, "no message"},
		{"an unknown member", refusal{410, jsonType, nil, `{"state":"gone","since":1}`}, "since"},
		{"a null message", refusal{410, jsonType, nil, `{"state":"gone","message":null}`}, "message"},
		{"an empty message", refusal{409, jsonType, nil, `{"state":"failed","message":""}`}, "message"},
		{"a message with a control character", refusal{409, jsonType, nil, `{"state":"failed","message":"a\u0007b"}`}, "control"},
		{"a body that is not JSON", refusal{410, jsonType, nil, `gone`}, "not a data-route refusal"},
		{"an empty body", refusal{410, jsonType, nil, ``}, "not a data-route refusal"},
		{"a body over 64 KiB", refusal{409, jsonType, nil, `{"state":"failed","message":"` + strings.Repeat("x", 70<<10) + `"}`}, "over"},
		{"an upgrade", refusal{101, "", nil, ``}, "upgraded"},
	}
	for _, tc := range cases {
		err := CheckRefusal(tc.r.response())
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: CheckRefusal = %v, want an error saying %q", tc.name, err, tc.says)
		}
	}
	if err := CheckRefusal(nil); err == nil {
		t.Error("CheckRefusal(nil) passed")
	}
}

// routeServer serves one data route: it records the Authorization header
// it saw and answers with h.
func routeServer(t *testing.T, h http.Handler, useTLS bool) (url string, auth func() string, client *tls.Config) {
	t.Helper()
	var mu sync.Mutex
	var seen string
	wrapped := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = r.Header.Get("Authorization")
		mu.Unlock()
		h.ServeHTTP(w, r)
	})
	var srv *httptest.Server
	if useTLS {
		srv = httptest.NewTLSServer(wrapped)
		client = srv.Client().Transport.(*http.Transport).TLSClientConfig
	} else {
		srv = httptest.NewServer(wrapped)
	}
	t.Cleanup(srv.Close)
	scheme := "ws"
	if useTLS {
		scheme = "wss"
	}
	return scheme + strings.TrimPrefix(strings.TrimPrefix(srv.URL, "https"), "http") + "/routes/u1/env_1/ls-3f2a",
		func() string {
			mu.Lock()
			defer mu.Unlock()
			return seen
		}, client
}

func TestDialRouteReadsARefusal(t *testing.T) {
	url, auth, _ := routeServer(t, refusal{503, jsonType, []string{"2"}, `{"state":"waking"}`}, false)
	d, err := DialRoute(t.Context(), url, "route-secret")
	if err != nil {
		t.Fatal(err)
	}
	if d.Conn != nil || d.Refusal == nil || d.Status != 503 || d.Refusal.State != "waking" || d.Refusal.RetryAfter != 2*time.Second {
		t.Errorf("DialRoute = %+v (refusal %+v), want a 503 waking refusal with Retry-After 2 s", d, d.Refusal)
	}
	if got := auth(); got != "Bearer route-secret" {
		t.Errorf("the route saw Authorization %q, want the bearer credential", got)
	}
}

func TestDialRouteSendsNoCredentialWhenThereIsNone(t *testing.T) {
	url, auth, _ := routeServer(t, refusal{410, jsonType, nil, `{"state":"gone"}`}, false)
	if _, err := DialRoute(t.Context(), url, ""); err != nil {
		t.Fatal(err)
	}
	if got := auth(); got != "" {
		t.Errorf("the route saw Authorization %q, want none", got)
	}
}

// A refusal's body can be longer than the 1024 bytes the WebSocket library
// keeps; DialRoute reads it whole, over TLS too.
func TestDialRouteReadsALongRefusalWhole(t *testing.T) {
	message := strings.Repeat(`"quoted" `, 113) // 1017 bytes, twice that once escaped
	body, _ := json.Marshal(map[string]string{"state": "failed", "message": message})
	if len(body) <= 1024 {
		t.Fatalf("the body is only %d bytes", len(body))
	}
	for _, useTLS := range []bool{false, true} {
		url, _, client := routeServer(t, refusal{409, jsonType, nil, string(body)}, useTLS)
		d, err := RouteDialer{TLSConfig: client}.Dial(t.Context(), url, "")
		if err != nil {
			t.Fatalf("tls=%t: %v", useTLS, err)
		}
		if d.Refusal == nil || d.Refusal.State != "failed" || d.Refusal.Message != message {
			t.Errorf("tls=%t: DialRoute = %+v, want the failed refusal with its whole message", useTLS, d.Refusal)
		}
	}
}

func TestDialRouteReportsAMalformedRefusal(t *testing.T) {
	url, _, _ := routeServer(t, refusal{503, "text/plain", nil, "waking up"}, false)
	d, err := DialRoute(t.Context(), url, "")
	if err == nil || !strings.Contains(err.Error(), "Content-Type") || d.Status != 503 {
		t.Errorf("DialRoute = %+v, %v; want the malformed 503 reported", d, err)
	}
}

func TestDialRouteUpgrades(t *testing.T) {
	up := websocket.Upgrader{}
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer func() { _ = ws.Close() }()
		for {
			kind, data, err := ws.ReadMessage()
			if err != nil {
				return
			}
			if err := ws.WriteMessage(kind, data); err != nil {
				return
			}
		}
	})
	url, _, _ := routeServer(t, echo, false)
	d, err := DialRoute(t.Context(), url, "")
	if err != nil {
		t.Fatal(err)
	}
	if d.Conn == nil || d.Refusal != nil || d.Status != http.StatusSwitchingProtocols {
		t.Fatalf("DialRoute = %+v, want an upgraded connection", d)
	}
	defer func() { _ = d.Conn.Close() }()
	if err := d.Conn.WriteMessage(websocket.TextMessage, []byte(`{"ping":1}`)); err != nil {
		t.Fatal(err)
	}
	if _, data, err := d.Conn.ReadMessage(); err != nil || string(data) != `{"ping":1}` {
		t.Fatalf("echo = %q, %v", data, err)
	}
}

// A refusal that arrives after the hold bound fails, whatever it says. The
// clock (timeNow) is replaced, so the test waits for nothing.
func TestDialRouteRefusesALateAnswer(t *testing.T) {
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	calls := 0
	timeNow = func() time.Time {
		calls++
		if calls == 1 {
			return start
		}
		return start.Add(MaxDataRouteHold + RouteHoldGrace + time.Second)
	}
	t.Cleanup(func() { timeNow = time.Now })
	url, _, _ := routeServer(t, refusal{503, jsonType, []string{"1"}, `{"state":"booting"}`}, false)
	d, err := DialRoute(t.Context(), url, "")
	if err == nil || !strings.Contains(err.Error(), "hold bound") {
		t.Errorf("DialRoute = %v, want the late refusal reported", err)
	}
	if d.Refusal == nil || d.Refusal.State != "booting" {
		t.Errorf("the late refusal was not read: %+v", d.Refusal)
	}
	// Dialled as a runtime dials, the same late answer is an answer; a
	// malformed one is still refused.
	calls = 0
	if d, err := (RouteDialer{AsARuntime: true}).Dial(t.Context(), url, ""); err != nil || d.Refusal == nil || d.Refusal.State != "booting" {
		t.Errorf("AsARuntime: %+v, %v; want the late refusal read, without an error", d.Refusal, err)
	}
	calls = 0
	bad, _, _ := routeServer(t, refusal{503, jsonType, nil, `{"state":"booting"}`}, false)
	if _, err := (RouteDialer{AsARuntime: true}).Dial(t.Context(), bad, ""); err == nil {
		t.Error("AsARuntime: a 503 without Retry-After passed")
	}
}

func TestDialRouteRefusesABadURL(t *testing.T) {
	for _, u := range []string{"http://127.0.0.1/routes/a/b/c", "ws:///routes", "::"} {
		if _, err := DialRoute(context.Background(), u, ""); err == nil {
			t.Errorf("DialRoute(%q) passed", u)
		}
	}
}
