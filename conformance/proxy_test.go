package conformance_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
)

// wireFlaws are the ways flawProxy breaks the wire rules of a correct
// controller behind it.
type wireFlaws struct {
	// fragment writes every answer in frames of 4 KiB.
	fragment bool
	// readLimit, when set, is the proxy's own limit on a client message.
	readLimit int64
	// busyAfter answers busy (requestLimit) to every request of a
	// connection after its first busyAfter: a server that takes fewer
	// than 16 in flight, made deterministic (counting the ones in flight
	// would depend on how fast the controller answers).
	busyAfter int
	// noPong answers no ping.
	noPong bool
	// secondInitialize answers a repeated initialize with the first one's
	// result, as a server that does not track the handshake would.
	secondInitialize bool
	// answerNotifications answers every notification with an error.
	answerNotifications bool
	// fieldlessInvalidParams drops data.field from invalidParams answers.
	fieldlessInvalidParams bool
	// wrongErrorCode answers notFound with the code -32000.
	wrongErrorCode bool
	// unknownSetPower answers target/setPower methodNotFound (in front of
	// a controller that does not advertise power).
	unknownSetPower bool
	// oddIDs answers a request whose id is neither an integer nor a
	// string (1.5, an object, an array, null) with a result.
	oddIDs bool
	// oversize answers a request whose id is over 1 MiB with a result
	// over 16 MiB, as a server that does not bound its answers would.
	oversize bool
}

// flawProxy stands in front of the controller at upstream with flaws and
// returns its ws:// URL.
func flawProxy(t *testing.T, upstream string, flaws wireFlaws) string {
	t.Helper()
	up := websocket.Upgrader{CheckOrigin: func(*http.Request) bool { return true }, WriteBufferSize: 4096}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		back, resp, err := websocket.DefaultDialer.DialContext(r.Context(), upstream, nil)
		if resp != nil && resp.Body != nil {
			_ = resp.Body.Close()
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		back.SetReadLimit(32 << 20)
		defer back.Close()
		front, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer front.Close()
		front.SetReadLimit(32 << 20)
		if flaws.readLimit > 0 {
			front.SetReadLimit(flaws.readLimit)
		}
		if flaws.noPong {
			front.SetPingHandler(func(string) error { return nil })
		}
		var (
			mu        sync.Mutex // one writer of front at a time
			requests  int        // requests read from the client
			firstInit atomic.Pointer[[]byte]
		)
		write := func(data []byte) error {
			mu.Lock()
			defer mu.Unlock()
			if !flaws.fragment {
				return front.WriteMessage(websocket.TextMessage, data)
			}
			wr, err := front.NextWriter(websocket.TextMessage)
			if err != nil {
				return err
			}
			for len(data) > 0 {
				n := min(len(data), 4096)
				if _, err := wr.Write(data[:n]); err != nil {
					return err
				}
				data = data[n:]
			}
			return wr.Close()
		}
		idOf := func(data []byte) string {
			var env struct {
				ID json.RawMessage `json:"id"`
			}
			_ = json.Unmarshal(data, &env)
			return string(env.ID)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				_, data, err := back.ReadMessage()
				if err != nil {
					// The controller ended the connection: so does the
					// proxy, with the controller's close code when it sent one.
					code := websocket.CloseGoingAway
					var ce *websocket.CloseError
					if errors.As(err, &ce) {
						code = ce.Code
					}
					mu.Lock()
					_ = front.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, ""), time.Now().Add(time.Second))
					mu.Unlock()
					_ = front.Close()
					return
				}
				if flaws.secondInitialize && firstInit.Load() == nil && bytes.Contains(data, []byte(`"plane":"controller"`)) {
					result := bytes.Clone(data)
					firstInit.Store(&result)
				}
				if flaws.fieldlessInvalidParams {
					data = stripField(data)
				}
				if flaws.wrongErrorCode {
					data = bytes.ReplaceAll(data, []byte(`"code":-32004`), []byte(`"code":-32000`))
				}
				if write(data) != nil {
					return
				}
			}
		}()
		for {
			kind, data, err := front.ReadMessage()
			if err != nil {
				break
			}
			var env struct {
				ID     json.RawMessage `json:"id"`
				Method string          `json:"method"`
			}
			_ = json.Unmarshal(data, &env)
			if flaws.answerNotifications && env.ID == nil && env.Method != "" {
				if write([]byte(`{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Notifications are not taken.","data":{"kind":"invalidRequest"}}}`)) != nil {
					break
				}
				continue
			}
			if id := bytes.TrimSpace(env.ID); flaws.oddIDs && env.Method != "" && len(id) > 0 && id[0] != '"' && (bytes.ContainsAny(id, ".{[") || string(id) == "null") {
				if write([]byte(`{"jsonrpc":"2.0","id":null,"result":{"templates":[]}}`)) != nil {
					break
				}
				continue
			}
			if flaws.oversize && len(env.ID) > 1<<20 {
				big := `{"jsonrpc":"2.0","id":` + string(env.ID) + `,"result":{"templates":[]}` + strings.Repeat(" ", 17<<20) + `}`
				if write([]byte(big)) != nil {
					break
				}
				continue
			}
			if flaws.unknownSetPower && env.Method == "target/setPower" && env.ID != nil {
				if write([]byte(`{"jsonrpc":"2.0","id":`+string(env.ID)+`,"error":{"code":-32601,"message":"No such method.","data":{"kind":"methodNotFound"}}}`)) != nil {
					break
				}
				continue
			}
			if first := firstInit.Load(); flaws.secondInitialize && first != nil && env.Method == "initialize" {
				answer := bytes.Replace(*first, []byte(idOf(*first)), env.ID, 1)
				if write(answer) != nil {
					break
				}
				continue
			}
			if id := idOf(data); flaws.busyAfter > 0 && id != "" && id != "null" {
				requests++
				if requests > flaws.busyAfter {
					busy := `{"jsonrpc":"2.0","id":` + id + `,"error":{"code":-32008,"message":"Too many requests in flight.","data":{"kind":"busy","reason":"requestLimit","retryAfterMs":100}}}`
					if write([]byte(busy)) != nil {
						break
					}
					continue
				}
			}
			if back.WriteMessage(kind, data) != nil {
				break
			}
		}
		_ = back.Close()
		<-done
	}))
	t.Cleanup(srv.Close)
	return "ws" + strings.TrimPrefix(srv.URL, "http") + "/control"
}

// stripField drops data.field from an invalidParams answer.
func stripField(frame []byte) []byte {
	var env map[string]any
	if json.Unmarshal(frame, &env) != nil {
		return frame
	}
	e, _ := env["error"].(map[string]any)
	d, _ := e["data"].(map[string]any)
	if d == nil || d["kind"] != "invalidParams" {
		return frame
	}
	delete(d, "field")
	out, err := json.Marshal(env)
	if err != nil {
		return frame
	}
	return out
}
