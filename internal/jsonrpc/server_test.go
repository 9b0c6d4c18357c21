package jsonrpc_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

func TestBinaryFrameIsRefusedAndTheConnectionStays(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	for _, payload := range []string{`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":4,"clientInfo":{"name":"x"}}}`, ""} {
		if err := p.ws.WriteMessage(websocket.BinaryMessage, []byte(payload)); err != nil {
			t.Fatal(err)
		}
		expectError(t, p.read(), jsonrpc.KindInvalidRequest, "null")
	}
	// The binary initialize did not initialize; a text one does.
	p.sentinel("before")
	p.initialize()
	if err := p.ws.WriteMessage(websocket.BinaryMessage, []byte("\x00\x01")); err != nil {
		t.Fatal(err)
	}
	expectError(t, p.read(), jsonrpc.KindInvalidRequest, "null")
	p.sentinel("after")
}

func TestBatchIsOneInvalidRequest(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for _, batch := range []string{
		`[{"jsonrpc":"2.0","id":1,"method":"test/echo"},{"jsonrpc":"2.0","id":2,"method":"test/echo"},{"jsonrpc":"2.0","method":"test/note"}]`,
		`[{"jsonrpc":"2.0","id":1,"method":"test/echo"}]`,
		`[]`,
		`[1,2]`,
	} {
		p.send(batch)
		expectError(t, p.read(), jsonrpc.KindInvalidRequest, "null")
		// Exactly one answer: the next message answers the sentinel.
		p.sentinel(batch)
	}
	if len(s.notes) != 0 {
		t.Fatal("a notification inside a batch was delivered")
	}
}

func TestFrameThatIsNotJSONIsAParseError(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	for _, frame := range []string{
		`{"jsonrpc":"2.0","id":1`,
		`hello`,
		``,
		` `,
		`{"jsonrpc":"2.0","id":1,"method":"test/echo"}]`,
		`{"jsonrpc":"2.0","id":1,"method":"test/echo"}}`,
		`{"jsonrpc":"2.0","id":1,"method":"test/echo"} {"jsonrpc":"2.0","id":2,"method":"test/echo"}`,
		`{"jsonrpc":"2.0","id":1,"method":"test/echo"},`,
		`{"jsonrpc":"2.0","id":1,"method":"test/echo"} x`,
		`{'jsonrpc':'2.0'}`,
		"\xff\xfe",
	} {
		p.send(frame)
		expectError(t, p.read(), jsonrpc.KindParseError, "null")
		p.sentinel(strconv.Quote(frame))
	}
	// White space around one message is still one message.
	r := p.call("init", "initialize", map[string]any{"protocolVersion": testVersion, "clientInfo": map[string]any{"name": "t"}})
	if r.err != nil {
		t.Fatal(r.err)
	}
	p.send("\n {\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"test/echo\"}\r\n\t")
	if r := p.read(); r.err != nil || r.id != "3" {
		t.Fatalf("padded frame: %s", r.raw)
	}
}

func TestMalformedEnvelopes(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	cases := []struct{ frame, id string }{
		{`{"jsonrpc":"1.0","id":7,"method":"test/echo"}`, "7"},
		{`{"id":7,"method":"test/echo"}`, "7"},
		{`{"jsonrpc":2.0,"id":7,"method":"test/echo"}`, "7"},
		{`{"jsonrpc":null,"id":7,"method":"test/echo"}`, "7"},
		{`{"jsonrpc":"2.0","id":"a","method":"test/echo","extra":1}`, `"a"`},
		{`{"jsonrpc":"2.0","id":"a","method":"test/echo","params":{},"result":{}}`, `"a"`},
		{`{"jsonrpc":"2.0","id":7}`, "7"},
		{`{"jsonrpc":"2.0","id":7,"method":1}`, "7"},
		{`{"jsonrpc":"2.0","id":7,"method":null}`, "7"},
		{`{"jsonrpc":"2.0","id":7,"method":["test/echo"]}`, "7"},
		{`{}`, "null"},
		{`{"jsonrpc":"2.0"}`, "null"},
		{`{"jsonrpc":"2.0","method":3}`, "null"},
		{`{"jsonrpc":"2.0","result":{}}`, "null"},
		{`"a string"`, "null"},
		{`42`, "null"},
		{`null`, "null"},
		{`true`, "null"},
	}
	for _, initialized := range []bool{false, true} {
		if initialized {
			p.initialize()
		}
		for _, tc := range cases {
			p.send(tc.frame)
			r := p.read()
			expectError(t, r, jsonrpc.KindInvalidRequest, tc.id)
		}
		p.sentinel(fmt.Sprint(initialized))
	}
}

func TestMalformedIDsAreAnsweredWithANullID(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for _, id := range []string{`null`, `true`, `false`, `1.5`, `1.0`, `1e3`, `-0.5`, `{}`, `{"n":1}`, `[]`, `[1]`, `9223372036854775808`} {
		p.send(`{"jsonrpc":"2.0","id":` + id + `,"method":"test/echo","params":{}}`)
		expectError(t, p.read(), jsonrpc.KindInvalidRequest, "null")
		p.sentinel(id)
	}
	// Integers and strings, including unusual ones, are echoed.
	for _, id := range []any{0, -5, int64(1) << 53, int64(9223372036854775807), "", "a b", "<&>", "é\n"} {
		r := p.call(id, "test/id", nil)
		if r.err != nil {
			t.Fatalf("id %v: %s", id, r.raw)
		}
		var got struct {
			ID json.RawMessage `json:"id"`
		}
		if err := json.Unmarshal(r.result, &got); err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(id)
		if string(got.ID) != string(want) {
			t.Fatalf("RequestID = %s, want %s", got.ID, want)
		}
	}
}

func TestParamsMustBeAnObject(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for _, params := range []string{`[]`, `[1,2]`, `"x"`, `null`, `3`, `true`} {
		p.send(`{"jsonrpc":"2.0","id":"p","method":"test/echo","params":` + params + `}`)
		r := p.read()
		expectError(t, r, jsonrpc.KindInvalidParams, `"p"`)
		if _, named := r.data["field"]; named {
			t.Errorf("params %s: the params as a whole have no field path: %s", params, r.raw)
		}
	}
	// Absent params mean {}.
	p.send(`{"jsonrpc":"2.0","id":1,"method":"test/echo"}`)
	if r := p.read(); r.err != nil || string(r.result) != `{}` {
		t.Fatalf("absent params: %s", r.raw)
	}
	if r := p.call(2, "test/echo", map[string]any{"a": []any{1, "b", map[string]any{"c": true}}}); string(r.result) != `{"a":[1,"b",{"c":true}]}` {
		t.Fatalf("echo: %s", r.raw)
	}
	// A method's strict decoding names the member at fault.
	r := p.call(3, "test/typed", map[string]any{"kind": "notFound", "extra": 1})
	expectError(t, r, jsonrpc.KindInvalidParams, "3")
	if r.err.Field != "extra" {
		t.Fatalf("field = %q: %s", r.err.Field, r.raw)
	}
	r = p.call(4, "test/sized", map[string]any{"frameBytes": 1.5})
	expectError(t, r, jsonrpc.KindInvalidParams, "4")
	if r.err.Field != "frameBytes" {
		t.Fatalf("field = %q: %s", r.err.Field, r.raw)
	}
	r = p.call(5, "test/sized", nil)
	if r.err == nil || r.err.Field != "frameBytes" || !strings.Contains(r.err.Message, "required") {
		t.Fatalf("absent params, required member: %s", r.raw)
	}
}

func TestNotificationsAreNeverAnswered(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	before := []string{
		`{"jsonrpc":"2.0","method":"test/note","params":{"a":1}}`,
		`{"jsonrpc":"2.0","method":"no/such"}`,
		`{"jsonrpc":"2.0","method":"initialize","params":{"protocolVersion":4,"clientInfo":{"name":"x"}}}`,
	}
	for _, frame := range before {
		p.send(frame)
	}
	// Nothing was answered, nothing delivered, and the notification named
	// initialize did not initialize.
	r := p.call("s", "test/echo", nil)
	expectError(t, r, jsonrpc.KindNotInitialized, `"s"`)
	if len(s.notes) != 0 {
		t.Fatal("a notification before initialize was delivered")
	}

	p.initialize()
	after := []string{
		`{"jsonrpc":"2.0","method":"test/note","params":{"a":1}}`,
		`{"jsonrpc":"2.0","method":"test/note"}`,
		`{"jsonrpc":"2.0","method":"no/such","params":{}}`,
		`{"jsonrpc":"2.0","method":"test/echo"}`,
		`{"jsonrpc":"2.0","method":"initialize","params":{"protocolVersion":4,"clientInfo":{"name":"x"}}}`,
		// Malformed, but a string method and no id: dropped without an answer.
		`{"jsonrpc":"1.0","method":"test/note","params":{"b":1}}`,
		`{"method":"test/note","params":{"b":2}}`,
		`{"jsonrpc":"2.0","method":"test/note","params":{"b":3},"extra":true}`,
		`{"jsonrpc":"2.0","method":"test/note","params":[1]}`,
		`{"jsonrpc":"2.0","method":"test/note","params":null}`,
		`{"jsonrpc":"2.0","method":""}`,
	}
	for _, frame := range after {
		p.send(frame)
	}
	p.sentinel("after")
	got := []note{<-s.notes, <-s.notes}
	if got[0].params != `{"a":1}` || got[1].params != `{}` {
		t.Fatalf("delivered %+v", got)
	}
	if len(s.notes) != 0 {
		t.Fatalf("a malformed notification was delivered: %+v", <-s.notes)
	}
}

func TestHandshake(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	expectError(t, p.call(1, "test/echo", nil), jsonrpc.KindNotInitialized, "1")
	expectError(t, p.call(2, "no/such", nil), jsonrpc.KindNotInitialized, "2")
	expectError(t, p.call(3, "test/slow", map[string]any{"key": "k"}), jsonrpc.KindNotInitialized, "3")

	for _, stated := range []uint64{3, 5, 0, 1<<53 - 1} {
		r := p.call("v", "initialize", map[string]any{"protocolVersion": stated, "clientInfo": map[string]any{"name": "x"}})
		expectError(t, r, jsonrpc.KindVersionMismatch, `"v"`)
		if r.err.Expected == nil || *r.err.Expected != testVersion || r.err.Received == nil || *r.err.Received != stated {
			t.Fatalf("versionMismatch fields: %s", r.raw)
		}
		if r.data["expected"] != json.Number("4") || r.data["received"] != json.Number(strconv.FormatUint(stated, 10)) {
			t.Fatalf("versionMismatch data: %s", r.raw)
		}
	}
	// A mismatch is checked before the rest of the params: a future client's
	// new members do not hide it.
	r := p.call("v", "initialize", map[string]any{"protocolVersion": 5, "futureMember": true})
	expectError(t, r, jsonrpc.KindVersionMismatch, `"v"`)

	// A version sent twice is refused, whichever of the two matches.
	p.send(`{"jsonrpc":"2.0","id":"pv","method":"initialize","params":{"protocolVersion":3,"protocolVersion":4,"clientInfo":{"name":"x"}}}`)
	if r := p.read(); r.err == nil || r.err.Kind != jsonrpc.KindInvalidParams || r.err.Field != "protocolVersion" {
		t.Fatalf("a repeated protocolVersion: %s", r.raw)
	}
	for _, params := range []map[string]any{
		{"clientInfo": map[string]any{"name": "x"}},
		{"protocolVersion": "4", "clientInfo": map[string]any{"name": "x"}},
		{"protocolVersion": nil, "clientInfo": map[string]any{"name": "x"}},
		{"protocolVersion": -4, "clientInfo": map[string]any{"name": "x"}},
		{"protocolVersion": 4.5, "clientInfo": map[string]any{"name": "x"}},
		{"protocolVersion": json.Number("4.0"), "clientInfo": map[string]any{"name": "x"}},
		{"protocolVersion": uint64(1) << 53, "clientInfo": map[string]any{"name": "x"}},
		{},
	} {
		r := p.call("pv", "initialize", params)
		expectError(t, r, jsonrpc.KindInvalidParams, `"pv"`)
		if r.err.Field != "protocolVersion" {
			t.Fatalf("params %v: field %q: %s", params, r.err.Field, r.raw)
		}
	}
	// The version matches but the plane's own params do not decode: still
	// uninitialized.
	r = p.call("ci", "initialize", map[string]any{"protocolVersion": 4, "clientInfo": map[string]any{"name": ""}})
	expectError(t, r, jsonrpc.KindInvalidParams, `"ci"`)
	if r.err.Field != "clientInfo.name" {
		t.Fatalf("field %q: %s", r.err.Field, r.raw)
	}
	expectError(t, p.call(4, "test/echo", nil), jsonrpc.KindNotInitialized, "4")

	// After all that, a correct initialize works on the same connection.
	p.initialize()
	if r := p.call(5, "test/echo", map[string]any{"x": 1}); r.err != nil {
		t.Fatalf("after initialize: %s", r.raw)
	}
	expectError(t, p.call(6, "no/such", nil), jsonrpc.KindMethodNotFound, "6")
	// A second initialize, right or wrong, is invalidRequest.
	expectError(t, p.call(7, "initialize", map[string]any{"protocolVersion": 4, "clientInfo": map[string]any{"name": "x"}}), jsonrpc.KindInvalidRequest, "7")
	expectError(t, p.call(8, "initialize", map[string]any{"protocolVersion": 3}), jsonrpc.KindInvalidRequest, "8")
	// Its params, whatever they are, do not make it invalidParams.
	for i, params := range []string{`[]`, `"x"`, `3`, `null`, `{"protocolVersion":4,"protocolVersion":4}`} {
		p.send(fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"initialize","params":%s}`, 80+i, params))
		expectError(t, p.read(), jsonrpc.KindInvalidRequest, fmt.Sprint(80+i))
	}
	if r := p.call(9, "test/echo", nil); r.err != nil {
		t.Fatalf("still initialized: %s", r.raw)
	}
	// Each connection has its own handshake.
	q := s.dial(t)
	expectError(t, q.call(1, "test/echo", nil), jsonrpc.KindNotInitialized, "1")
}

func TestRequestsPipelinedBehindInitializeSeeIt(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.request("init", "initialize", map[string]any{"protocolVersion": testVersion, "clientInfo": map[string]any{"name": "t"}})
	p.request(1, "test/echo", nil)
	seen := map[string]response{}
	for len(seen) < 2 {
		r := p.read()
		seen[r.id] = r
	}
	if seen[`"init"`].err != nil || seen["1"].err != nil {
		t.Fatalf("pipelined behind initialize: %+v", seen)
	}
}

func TestSixteenRequestsRunConcurrentlyAndAnswerOutOfOrder(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for i := range jsonrpc.MinInFlight {
		p.request(i, "test/slow", map[string]any{"key": strconv.Itoa(i)})
	}
	// All sixteen are running at the same time.
	s.waitStarted(t, jsonrpc.MinInFlight)
	// Answered in the order they finish, the reverse of the order sent.
	for i := jsonrpc.MinInFlight - 1; i >= 0; i-- {
		s.release(strconv.Itoa(i))
		r := p.read()
		if r.err != nil || r.id != strconv.Itoa(i) || string(r.result) != fmt.Sprintf(`{"key":"%d"}`, i) {
			t.Fatalf("released %d, read %s", i, r.raw)
		}
	}
}

func TestBeyondTheLimitIsBusyAtOnce(t *testing.T) {
	for _, tc := range []struct {
		configured, effective int
	}{{0, 16}, {3, 16}, {16, 16}, {20, 20}} {
		t.Run(strconv.Itoa(tc.configured), func(t *testing.T) {
			s := newTestServer(t, func(s *testServer) { s.srv.MaxInFlight = tc.configured })
			p := s.dial(t)
			p.initialize()
			for i := range tc.effective {
				p.request(i, "test/slow", map[string]any{"key": strconv.Itoa(i)})
			}
			s.waitStarted(t, tc.effective)
			// None of them has been released, so this answer comes first.
			r := p.call("over", "test/slow", map[string]any{"key": "over"})
			expectError(t, r, jsonrpc.KindBusy, `"over"`)
			if r.err.Reason != "requestLimit" {
				t.Fatalf("busy reason: %s", r.raw)
			}
			// Requests that are not dispatched to a method are still answered.
			expectError(t, p.call("nf", "no/such", nil), jsonrpc.KindMethodNotFound, `"nf"`)
			// Once one finishes there is room again.
			s.release("0")
			if r := p.read(); r.id != "0" {
				t.Fatalf("released 0, read %s", r.raw)
			}
			p.request("again", "test/slow", map[string]any{"key": "again"})
			s.waitStarted(t, 1)
			for i := 1; i < tc.effective; i++ {
				s.release(strconv.Itoa(i))
			}
			s.release("again")
			for range tc.effective {
				if r := p.read(); r.err != nil {
					t.Fatalf("after release: %s", r.raw)
				}
			}
		})
	}
}

func TestAnAnsweredRequestNoLongerCountsInFlight(t *testing.T) {
	// A client that keeps exactly sixteen requests in flight sends the next
	// one as soon as it reads an answer. Observe runs after the answer is
	// written; holding it up shows the slot is already free by then.
	hold := make(chan struct{})
	var once sync.Once
	s := newTestServer(t, func(s *testServer) {
		s.observeHook = func(method string, kind jsonrpc.Kind) {
			if method == "test/slow" && kind == "" {
				once.Do(func() { <-hold })
			}
		}
	})
	defer close(hold)
	p := s.dial(t)
	p.initialize()
	for i := range jsonrpc.MinInFlight {
		p.request(i, "test/slow", map[string]any{"key": strconv.Itoa(i)})
	}
	s.waitStarted(t, jsonrpc.MinInFlight)
	s.release("0")
	if r := p.read(); r.id != "0" {
		t.Fatalf("read %s", r.raw)
	}
	p.request("next", "test/slow", map[string]any{"key": "next"})
	select {
	case <-s.started:
	case <-time.After(hangGuard):
		t.Fatal("the next request never started")
	}
	for i := 1; i < jsonrpc.MinInFlight; i++ {
		s.release(strconv.Itoa(i))
	}
	s.release("next")
	for range jsonrpc.MinInFlight {
		if r := p.read(); r.err != nil {
			t.Fatalf("%s", r.raw)
		}
	}
}

func TestAnswerSizeLimit(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	// Exactly 16 MiB is allowed.
	p.request(1, "test/sized", map[string]any{"frameBytes": jsonrpc.MaxMessageBytes})
	_ = p.ws.SetReadDeadline(time.Now().Add(hangGuard))
	_, data, err := p.ws.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	if len(data) != jsonrpc.MaxMessageBytes {
		t.Fatalf("answer is %d bytes, want exactly %d", len(data), jsonrpc.MaxMessageBytes)
	}
	if r := checkResponse(t, data); r.err != nil || r.id != "1" {
		t.Fatalf("16 MiB answer: %s", clip(r.raw))
	}
	// One byte more is payloadTooLarge, for the same id.
	r := p.call(2, "test/sized", map[string]any{"frameBytes": jsonrpc.MaxMessageBytes + 1})
	expectError(t, r, jsonrpc.KindPayloadTooLarge, "2")
	if r.err.LimitBytes == nil || *r.err.LimitBytes != jsonrpc.MaxMessageBytes {
		t.Fatalf("limitBytes: %s", r.raw)
	}
	p.sentinel("after")
	if o := s.waitObserved(t, "test/sized"); o.kind != "" {
		t.Fatalf("observed %+v for the 16 MiB answer", o)
	}
	if o := s.waitObserved(t, "test/sized"); o.kind != jsonrpc.KindPayloadTooLarge {
		t.Fatalf("Observe saw %+v, want the kind that was sent", o)
	}
}

func TestRequestOverTheLimitEndsTheConnection(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	big := `{"jsonrpc":"2.0","id":1,"method":"test/echo","params":{"x":"` + strings.Repeat("x", jsonrpc.MaxMessageBytes) + `"}}`
	// The server may close before it has read all of it, so the write may fail.
	_ = p.ws.WriteMessage(websocket.TextMessage, []byte(big))
	_ = p.ws.SetReadDeadline(time.Now().Add(hangGuard))
	if _, data, err := p.ws.ReadMessage(); err == nil {
		t.Fatalf("read %s after an oversized request", clip(string(data)))
	}
	if err := <-s.served; !errors.Is(err, websocket.ErrReadLimit) {
		t.Fatalf("ServeConn ended with %v, want the read limit", err)
	}
}

// TestPingIsAnsweredAheadOfQueuedAnswers: each answer is one frame, so a
// pong cannot go between the frames of a large one; it goes ahead of every
// answer still queued instead. Two 4 MiB answers wait for a client that
// does not read; its ping is answered before the second of them.
func TestPingIsAnsweredAheadOfQueuedAnswers(t *testing.T) {
	accepted := make(chan net.Conn, 1)
	s := newTestServer(t, func(s *testServer) {
		s.http.Listener = &listener{Listener: s.http.Listener, accepted: accepted, wrap: func(c net.Conn) net.Conn {
			// Small socket buffers, so the server is still writing the
			// first answer while the client holds off reading.
			_ = c.(*net.TCPConn).SetWriteBuffer(64 << 10)
			return newCountingConn(c)
		}}
	})
	var clientConn *countingConn
	p := s.dialThrough(t, func(c net.Conn) net.Conn {
		_ = c.(*net.TCPConn).SetReadBuffer(64 << 10)
		clientConn = newCountingConn(c)
		return clientConn
	})
	ws := p.ws
	serverConn := (<-accepted).(*countingConn)
	p.initialize()

	const size = 4 << 20
	p.request(1, "test/sized", map[string]any{"frameBytes": size})
	p.request(2, "test/sized", map[string]any{"frameBytes": size})
	// Observe runs once an answer is queued: both are, before the ping.
	s.waitObserved(t, "test/sized")
	s.waitObserved(t, "test/sized")
	answers := 0
	pongAfter := -1
	ws.SetPongHandler(func(data string) error {
		if data == "are you there" && pongAfter < 0 {
			pongAfter = answers
		}
		return nil
	})
	if err := ws.WriteControl(websocket.PingMessage, []byte("are you there"), time.Now().Add(hangGuard)); err != nil {
		t.Fatal(err)
	}
	// Wait until the server has read the ping off the socket.
	_, sent := clientConn.counts()
	for {
		if got, _ := serverConn.counts(); got >= sent {
			break
		}
		select {
		case <-serverConn.change:
		case <-time.After(hangGuard):
			t.Fatal("the server never read the ping")
		}
	}
	for range 2 {
		r := p.read()
		if r.err != nil || len(r.raw) != size {
			t.Fatalf("answer of %d bytes: %.200s", len(r.raw), r.raw)
		}
		answers++
	}
	if pongAfter < 0 || pongAfter > 1 {
		t.Fatalf("the pong came after %d answers; want it before the second (the one still queued)", pongAfter)
	}
	t.Logf("pong after %d of 2 answers", pongAfter)
	p.sentinel("after")
}

// TestEachAnswerIsOneFrame: the contract's "each text frame holds exactly
// one message", read off the wire: answers of every size, many at once,
// each in one final text frame, never a continuation.
func TestEachAnswerIsOneFrame(t *testing.T) {
	s := newTestServer(t)
	var tape *recordingConn
	p := s.dialThrough(t, func(c net.Conn) net.Conn {
		tape = &recordingConn{Conn: c}
		return tape
	})
	p.initialize()
	sizes := []int{200, 65<<10 + 3, jsonrpc.MaxMessageBytes}
	for i, size := range sizes {
		p.request(i, "test/sized", map[string]any{"frameBytes": size})
	}
	got := map[int]bool{}
	for range sizes {
		got[len(p.read().raw)] = true
	}
	for _, size := range sizes {
		if !got[size] {
			t.Fatalf("no answer of %d bytes among %v", size, got)
		}
	}
	frames := tape.frames(t)
	if len(frames) != len(sizes)+1 { // and initialize's
		t.Fatalf("%d frames for %d answers: %+v", len(frames), len(sizes)+1, frames)
	}
	for _, f := range frames {
		if !f.fin || f.opcode != websocket.TextMessage {
			t.Fatalf("a frame of opcode %d, final %v, %d bytes: want each answer in one final text frame", f.opcode, f.fin, f.length)
		}
	}
}

func TestErrorObjects(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for i, kind := range jsonrpc.Kinds() {
		r := p.call(i, "test/typed", map[string]any{"kind": kind, "message": "it went wrong"})
		expectError(t, r, kind, strconv.Itoa(i))
		// The typed fields arrive as sent (compared in their wire form).
		got, _ := json.Marshal(r.err)
		want, _ := json.Marshal(typedError(kind, "it went wrong"))
		if string(got) != string(want) {
			t.Errorf("%s: got %s, want %s", kind, got, want)
		}
		if r.message != "it went wrong" {
			t.Errorf("%s: message %q", kind, r.message)
		}
	}
	// An empty message still says something.
	r := p.call("e", "test/typed", map[string]any{"kind": "notFound"})
	if r.message != "notFound" {
		t.Errorf("empty message sent as %q", r.message)
	}
	// Long messages are cut at a rune boundary within 4096 bytes.
	r = p.call("long", "test/typed", map[string]any{"kind": "notFound", "message": strings.Repeat("é", 5000)})
	if len(r.message) > jsonrpc.MaxMessageLen || !strings.HasSuffix(r.message, "…") {
		t.Errorf("long message: %d bytes, ends %q", len(r.message), r.message[len(r.message)-8:])
	}
	// Invalid UTF-8 does not grow past the limit on the wire (checked by read).
	r = p.call("bad", "test/badText", nil)
	expectError(t, r, jsonrpc.KindNotFound, `"bad"`)
	// A kind the protocol does not define goes out as internal.
	r = p.call("k", "test/typed", map[string]any{"kind": "bogus"})
	expectError(t, r, jsonrpc.KindInternal, `"k"`)
	r = p.call("k2", "test/typed", map[string]any{"kind": ""})
	expectError(t, r, jsonrpc.KindInternal, `"k2"`)
	// An *Error wrapped in another error is still sent as itself.
	r = p.call("w", "test/wrapped", nil)
	expectError(t, r, jsonrpc.KindNotFound, `"w"`)
	if r.err.Reason != "expired" {
		t.Errorf("wrapped: %s", r.raw)
	}
}

func TestDefectsAreInternalAndTheConnectionSurvives(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for _, tc := range []struct{ method, cause string }{
		{"test/panic", "the method fell over"},
		{"test/fail", "disk on fire"},
		{"test/unencodable", "unsupported type"},
	} {
		r := p.call(tc.method, tc.method, nil)
		expectError(t, r, jsonrpc.KindInternal, strconv.Quote(tc.method))
		if strings.Contains(r.raw, tc.cause) || strings.Contains(r.raw, "/var/secret") || strings.Contains(r.raw, "goroutine") {
			t.Errorf("%s: the cause leaked to the client: %s", tc.method, r.raw)
		}
		select {
		case d := <-s.defects:
			if !strings.HasPrefix(d, tc.method+": ") || !strings.Contains(d, tc.cause) {
				t.Errorf("OnInternal saw %q", clip(d))
			}
			if tc.method == "test/panic" && !strings.Contains(d, "goroutine") {
				t.Errorf("a panic's cause carries its stack: %q", clip(d))
			}
		case <-time.After(hangGuard):
			t.Fatalf("%s: OnInternal was not called", tc.method)
		}
		p.sentinel(tc.method)
	}
	if len(s.defects) != 0 {
		t.Fatalf("unexpected defect %q", <-s.defects)
	}
}

func TestEmptyResultsAreObjectsNotNull(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	for _, method := range []string{"test/nothing", "test/nilPointer"} {
		if r := p.call(method, method, nil); r.err != nil || string(r.result) != `{}` {
			t.Errorf("%s answered %s", method, r.raw)
		}
	}
}

func TestObserve(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	step := func(method string, kind jsonrpc.Kind, send func()) {
		t.Helper()
		send()
		_ = p.read()
		select {
		case o := <-s.obs:
			if o.method != method || o.kind != kind {
				t.Fatalf("observed %+v, want {%s %s}", o, method, kind)
			}
		case <-time.After(hangGuard):
			t.Fatalf("nothing observed, want {%s %s}", method, kind)
		}
	}
	call := func(id any, method string, params any) func() {
		return func() { p.request(id, method, params) }
	}
	raw := func(frame string) func() { return func() { p.send(frame) } }
	step("test/echo", jsonrpc.KindNotInitialized, call(1, "test/echo", nil))
	step("unknown", jsonrpc.KindNotInitialized, call(2, "no/such", nil))
	step("initialize", jsonrpc.KindVersionMismatch, call(3, "initialize", map[string]any{"protocolVersion": 1}))
	step("initialize", "", call(4, "initialize", map[string]any{"protocolVersion": 4, "clientInfo": map[string]any{"name": "x"}}))
	step("initialize", jsonrpc.KindInvalidRequest, call(5, "initialize", map[string]any{"protocolVersion": 4}))
	step("test/echo", "", call(6, "test/echo", nil))
	step("unknown", jsonrpc.KindMethodNotFound, call(7, "no/such", nil))
	step("unknown", jsonrpc.KindMethodNotFound, call(8, "a/method/name/a/client/made/up/"+strings.Repeat("x", 100), nil))
	step("test/echo", jsonrpc.KindInvalidParams, raw(`{"jsonrpc":"2.0","id":9,"method":"test/echo","params":[]}`))
	step("test/echo", jsonrpc.KindInvalidRequest, raw(`{"jsonrpc":"1.0","id":10,"method":"test/echo"}`))
	step("unknown", jsonrpc.KindInvalidRequest, raw(`{"jsonrpc":"1.0","id":11,"method":"no/such"}`))
	step("unknown", jsonrpc.KindInvalidRequest, raw(`{"jsonrpc":"2.0","id":12}`))
	step("test/panic", jsonrpc.KindInternal, call(13, "test/panic", nil))
	<-s.defects
	step("test/typed", jsonrpc.KindBusy, call(14, "test/typed", map[string]any{"kind": "busy"}))
	// Frames that are not requests are not observed: the next observation is the sentinel's.
	p.send(`[]`)
	_ = p.read()
	p.send(`{"jsonrpc":"2.0","method":"test/note"}`)
	<-s.notes
	step("test/echo", "", call(15, "test/echo", nil))
}

func TestMethodContextEndsWithTheConnection(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	p.request(1, "test/slow", map[string]any{"key": "a"})
	s.waitStarted(t, 1)
	_ = p.ws.Close()
	select {
	case k := <-s.ended:
		if k != "a" {
			t.Fatalf("ended %q", k)
		}
	case <-time.After(hangGuard):
		t.Fatal("the method's context did not end with the connection")
	}
	select {
	case <-s.served:
	case <-time.After(hangGuard):
		t.Fatal("ServeConn did not return")
	}
}

func TestServeConnEndsWithItsContext(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()
	p.request(1, "test/slow", map[string]any{"key": "a"})
	s.waitStarted(t, 1)
	s.cancel()
	if err := <-s.served; err != nil {
		t.Fatalf("ServeConn after its context ended: %v", err)
	}
	if k := <-s.ended; k != "a" {
		t.Fatalf("ended %q", k)
	}
	// The aborted answer may or may not have left before the close.
	_ = p.ws.SetReadDeadline(time.Now().Add(hangGuard))
	for range 2 {
		if _, _, err := p.ws.ReadMessage(); err != nil {
			return
		}
	}
	t.Fatal("the connection is still open")
}

func TestAFailedWriteEndsTheConnection(t *testing.T) {
	s := newTestServer(t, func(s *testServer) { s.srv.WriteTimeout = time.Nanosecond })
	p := s.dial(t)
	p.request(1, "test/echo", nil)
	_ = p.ws.SetReadDeadline(time.Now().Add(hangGuard))
	if _, data, err := p.ws.ReadMessage(); err == nil {
		t.Fatalf("read %s after a write that cannot succeed", data)
	}
	select {
	case <-s.served:
	case <-time.After(hangGuard):
		t.Fatal("ServeConn did not return")
	}
}

func TestManyConnectionsAndRequestsAtOnce(t *testing.T) {
	s := newTestServer(t)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for c := range 4 {
		p := s.dial(t)
		p.initialize()
		// Four writers share the connection's sixteen slots; each answer frees one.
		inFlight := make(chan struct{}, jsonrpc.MinInFlight)
		wg.Go(func() {
			var mu sync.Mutex
			var inner sync.WaitGroup
			for w := range 4 {
				inner.Go(func() {
					for i := range 25 {
						id := fmt.Sprintf("%d-%d-%d", c, w, i)
						raw, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": "test/echo", "params": map[string]any{"id": id}})
						inFlight <- struct{}{}
						mu.Lock()
						err := p.ws.WriteMessage(websocket.TextMessage, raw)
						mu.Unlock()
						if err != nil {
							errs <- err
							return
						}
					}
				})
			}
			inner.Wait()
		})
		wg.Go(func() {
			for range 100 {
				_ = p.ws.SetReadDeadline(time.Now().Add(hangGuard))
				_, data, err := p.ws.ReadMessage()
				if err != nil {
					errs <- err
					return
				}
				var r struct {
					ID     string `json:"id"`
					Result struct {
						ID string `json:"id"`
					} `json:"result"`
				}
				if err := json.Unmarshal(data, &r); err != nil || r.ID != r.Result.ID {
					errs <- fmt.Errorf("mismatched answer %s (%w)", data, err)
					return
				}
				<-inFlight
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestDecodeParams(t *testing.T) {
	type params struct {
		Owner struct {
			UniverseID string `json:"universeId" wire:"lsid"`
		} `json:"owner"`
	}
	var p params
	if err := jsonrpc.DecodeParams(nil, &struct{}{}); err != nil {
		t.Fatalf("empty params: %v", err)
	}
	err := jsonrpc.DecodeParams(json.RawMessage(`{"owner":{"universeId":"-x"}}`), &p)
	var e *jsonrpc.Error
	if !errors.As(err, &e) || e.Kind != jsonrpc.KindInvalidParams || e.Field != "owner.universeId" || !strings.Contains(e.Message, "owner.universeId") {
		t.Fatalf("DecodeParams = %#v", err)
	}
	err = jsonrpc.DecodeParams(json.RawMessage(`[]`), &p)
	if !errors.As(err, &e) || e.Kind != jsonrpc.KindInvalidParams || e.Field != "" {
		t.Fatalf("DecodeParams([]) = %#v", err)
	}
}

// Handshake rule 1 outranks the params check: before initialize, a request
// with malformed params is still notInitialized.
func TestNotInitializedBeforeParamsShape(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.send(`{"jsonrpc":"2.0","id":1,"method":"echo","params":[1]}`)
	expectError(t, p.read(), jsonrpc.KindNotInitialized, "1")
	p.initialize()
	p.send(`{"jsonrpc":"2.0","id":2,"method":"echo","params":[1]}`)
	expectError(t, p.read(), jsonrpc.KindInvalidParams, "2")
}

// TestStrictEnvelopes: what encoding/json would read leniently is refused.
// A repeated member is invalidRequest (with a null id when the id is the
// one repeated, since which was meant is unknown); a frame whose text is
// not Unicode is not JSON text (parseError); -0 is the id 0.
func TestStrictEnvelopes(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	for _, initialized := range []bool{false, true} {
		if initialized {
			p.initialize()
		}
		for _, tc := range []struct {
			frame string
			kind  jsonrpc.Kind
			id    string
		}{
			{`{"jsonrpc":"2.0","id":1,"id":2,"method":"test/echo"}`, jsonrpc.KindInvalidRequest, "null"},
			{`{"jsonrpc":"2.0","id":"a","id":"a","method":"test/echo"}`, jsonrpc.KindInvalidRequest, "null"},
			{`{"jsonrpc":"2.0","id":3,"method":"test/echo","method":"test/echo"}`, jsonrpc.KindInvalidRequest, "3"},
			{`{"jsonrpc":"2.0","jsonrpc":"2.0","id":4,"method":"test/echo"}`, jsonrpc.KindInvalidRequest, "4"},
			{`{"jsonrpc":"2.0","id":5,"method":"test/echo","params":{},"params":{}}`, jsonrpc.KindInvalidRequest, "5"},
			{`{"jsonrpc":"2.0","id":"a\ud800b","method":"test/echo"}`, jsonrpc.KindParseError, "null"},
			{`{"jsonrpc":"2.0","id":"\udc00","method":"test/echo"}`, jsonrpc.KindParseError, "null"},
			{"{\"jsonrpc\":\"2.0\",\"id\":\"a\xffb\",\"method\":\"test/echo\"}", jsonrpc.KindParseError, "null"},
			{`{"jsonrpc":"2.0","id":6,"method":"test/echo","params":{"s":"\ud83d"}}`, jsonrpc.KindParseError, "null"},
		} {
			p.send(tc.frame)
			expectError(t, p.read(), tc.kind, tc.id)
		}
		// A malformed notification, however it is malformed, is dropped.
		p.send(`{"jsonrpc":"2.0","method":"test/note","method":"test/note"}`)
		p.sentinel(fmt.Sprint("notification ", initialized))
		select {
		case n := <-s.notes:
			t.Fatalf("a notification naming its method twice was delivered: %v", n)
		default:
		}
	}
	// Params that repeat a name are the method's to refuse, by name.
	p.send(`{"jsonrpc":"2.0","id":7,"method":"test/typed","params":{"kind":"busy","kind":"busy","message":"m"}}`)
	if r := p.read(); r.err == nil || r.err.Kind != jsonrpc.KindInvalidParams || r.err.Field != "kind" {
		t.Fatalf("params with a repeated member: %s", r.raw)
	}
	// A surrogate pair is one character, echoed as such; -0 is the id 0.
	p.send(`{"jsonrpc":"2.0","id":-0,"method":"test/echo","params":{"s":"\ud83d\ude00"}}`)
	r := p.read()
	if r.err != nil || r.id != "0" || string(r.result) != `{"s":"😀"}` {
		t.Fatalf("a surrogate pair under id -0: %s", r.raw)
	}
}

// TestDrainAnswersWhatIsInFlightThenGoesAway: a draining connection answers
// the requests it took, refuses new ones as retryable `unavailable`, and
// closes with 1001 only after every answer is written; a connection with
// nothing in flight goes away at once. No method's context is cut.
func TestDrainAnswersWhatIsInFlightThenGoesAway(t *testing.T) {
	s := newTestServer(t)
	busy := s.dial(t)
	busy.initialize()
	quiet := s.dial(t)
	quiet.initialize()
	for i := range 3 {
		busy.request(i, "test/slow", map[string]any{"key": strconv.Itoa(i)})
	}
	s.waitStarted(t, 3)

	s.srv.Drain()
	s.srv.Drain() // twice is the same as once

	// The quiet connection has nothing in flight: 1001 at once.
	_ = quiet.ws.SetReadDeadline(time.Now().Add(hangGuard))
	if _, data, err := quiet.ws.ReadMessage(); !websocket.IsCloseError(err, websocket.CloseGoingAway) {
		t.Fatalf("a quiet connection after Drain: read %q, %v; want close 1001", data, err)
	}

	// A request after the drain began is refused, retryably.
	busy.request("late", "test/echo", map[string]any{"x": 1})
	r := busy.read()
	expectError(t, r, jsonrpc.KindUnavailable, `"late"`)
	if r.data["retryAfterMs"] == nil {
		t.Fatalf("the refusal carries no retryAfterMs: %s", r.raw)
	}

	// The three in flight end and are answered, each, before the close.
	for i := 2; i >= 0; i-- {
		s.release(strconv.Itoa(i))
		r := busy.read()
		if r.err != nil || r.id != strconv.Itoa(i) {
			t.Fatalf("released %d, read %s", i, r.raw)
		}
	}
	_ = busy.ws.SetReadDeadline(time.Now().Add(hangGuard))
	if _, data, err := busy.ws.ReadMessage(); !websocket.IsCloseError(err, websocket.CloseGoingAway) {
		t.Fatalf("after its last answer: read %q, %v; want close 1001", data, err)
	}
	select {
	case k := <-s.ended:
		t.Fatalf("a method's context was cut (%q)", k)
	default:
	}
}
