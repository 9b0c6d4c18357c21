package conformance_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
)

// routeFlaw makes the fake's data routes wrong on purpose.
type routeFlaw int

const (
	// routeIgnoresOwner relays whoever names a target's id (the zero
	// routeFlaw is a correct route).
	routeIgnoresOwner routeFlaw = iota + 1
	// routeNoCredential upgrades without the credential.
	routeNoCredential
	// routeRawSegments looks targets up by the segments as sent, not
	// percent-decoded.
	routeRawSegments
	// routeNoWake refuses a powered-down target's dial as waking, forever.
	routeNoWake
	// routeNoRetryAfter refuses a powered-down target's first dial with a
	// 503 that carries no Retry-After.
	routeNoRetryAfter
	// routeNoPongs answers no ping on a relayed connection.
	routeNoPongs
	// routeGoneAs404 answers a closed target's route with a bare 404.
	routeGoneAs404
)

// fakeRoutes serves the fake backend's data routes under /routes/: the
// guest's daemon is a stand-in that answers the data plane's initialize.
type fakeRoutes struct {
	b          *fakeBackend
	flaw       routeFlaw
	credential bearer.Credential
}

func (h *fakeRoutes) refuse(w http.ResponseWriter, status int, state string, retryAfter bool) {
	w.Header().Set("Content-Type", "application/json")
	if retryAfter {
		w.Header().Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	_, _ = w.Write([]byte(`{"state":"` + state + `"}`))
}

func (h *fakeRoutes) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if h.credential.Enabled() && h.flaw != routeNoCredential && !h.credential.Allows(r) {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	segs := strings.Split(strings.TrimPrefix(r.URL.EscapedPath(), "/routes/"), "/")
	if len(segs) != 3 {
		http.NotFound(w, r)
		return
	}
	if h.flaw != routeRawSegments {
		for i, s := range segs {
			v, err := url.PathUnescape(s)
			if err != nil {
				http.NotFound(w, r)
				return
			}
			segs[i] = v
		}
	}
	owner := controller.Owner{UniverseID: segs[0], EnvironmentID: segs[1]}
	f := h.b
	f.mu.Lock()
	t := f.byID[segs[2]]
	switch {
	case t == nil || t.phase != controller.PhaseActive || (t.owner != owner && h.flaw != routeIgnoresOwner):
		f.mu.Unlock()
		if h.flaw == routeGoneAs404 {
			http.NotFound(w, r)
			return
		}
		h.refuse(w, http.StatusGone, "gone", false)
		return
	case t.power != "" && t.power != controller.PowerRunning:
		if h.flaw == routeNoWake || (h.flaw == routeNoRetryAfter && !t.refused) {
			t.refused = true
			f.mu.Unlock()
			h.refuse(w, http.StatusServiceUnavailable, "waking", h.flaw != routeNoRetryAfter)
			return
		}
		t.power, t.moving = controller.PowerRunning, ""
		t.lastUse = time.Now() // a daemon started anew
	}
	t.relays++
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		t.relays--
		f.mu.Unlock()
	}()
	up := websocket.Upgrader{}
	ws, err := up.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	defer ws.Close()
	if h.flaw == routeNoPongs {
		ws.SetPingHandler(func(string) error { return nil })
	}
	for {
		_, data, err := ws.ReadMessage()
		if err != nil {
			return
		}
		var req struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
			Params struct {
				Argv []string `json:"argv"`
			} `json:"params"`
		}
		_ = json.Unmarshal(data, &req)
		if ws.WriteMessage(websocket.TextMessage, []byte(`{"jsonrpc":"2.0","id":`+string(req.ID)+`,`+h.daemon(t, req.Method, req.Params.Argv)+`}`)) != nil {
			return
		}
	}
}

// daemon is the stand-in daemon's answer to a request, as its result or
// error member: initialize, env/getIdle, and process/start of sleep, which
// holds its idle clock at zero while it "runs"; anything else is a use.
func (h *fakeRoutes) daemon(t *fakeTarget, method string, argv []string) string {
	f := h.b
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	switch method {
	case "initialize":
		return `"result":{"protocolVersion":5,"plane":"data","capabilities":{"process":{}}}`
	case "env/getIdle":
		return fmt.Sprintf(`"result":{"idleForMs":%d}`, t.idleFor(now).Milliseconds())
	case "process/start":
		secs := 0
		if len(argv) == 2 && argv[0] == "sleep" {
			secs, _ = strconv.Atoi(argv[1])
		}
		if secs <= 0 {
			return `"error":{"code":-32602,"message":"Only sleep N runs here.","data":{"kind":"invalidParams","field":"argv"}}`
		}
		t.lastUse, t.busyUntil = now, now.Add(time.Duration(secs)*time.Second)
		return `"result":{"pid":1}`
	default:
		t.lastUse = now
		return `"result":{}`
	}
}
