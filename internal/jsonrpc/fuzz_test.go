package jsonrpc_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// frameSeeds are the frames both targets start from: one of each kind the
// envelope rules tell apart.
var frameSeeds = []struct {
	binary bool
	frame  string
}{
	{false, `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":4,"clientInfo":{"name":"fuzz"}}}`},
	{false, `{"jsonrpc":"2.0","id":"a","method":"test/echo","params":{"x":[1,2,{"y":"z"}]}}`},
	{false, `{"jsonrpc":"2.0","id":2,"method":"test/echo"}`},
	{false, `{"jsonrpc":"2.0","id":3,"method":"test/typed","params":{"kind":"busy","message":"m"}}`},
	{false, `{"jsonrpc":"2.0","id":4,"method":"test/panic"}`},
	{false, `{"jsonrpc":"2.0","id":5,"method":"no/such","params":[]}`},
	{false, `{"jsonrpc":"2.0","method":"test/note","params":{"a":1}}`},
	{false, `{"jsonrpc":"1.0","method":"test/note"}`},
	{false, `{"jsonrpc":"1.0","id":6,"method":"test/echo"}`},
	{false, `{"jsonrpc":"2.0","id":null,"method":"test/echo"}`},
	{false, `{"jsonrpc":"2.0","id":1.5,"method":"test/echo"}`},
	{false, `{"jsonrpc":"2.0","id":7,"method":"test/echo","extra":true}`},
	{false, `{"jsonrpc":"2.0","id":8,"method":"initialize","params":{"protocolVersion":3}}`},
	{false, `[{"jsonrpc":"2.0","id":9,"method":"test/echo"}]`},
	{false, `{"jsonrpc":"2.0","id":10,"method":"test/echo"}]`},
	{false, `{"jsonrpc":"2.0","id":11`},
	{false, `{}`},
	{false, `null`},
	{false, ``},
	{true, `{"jsonrpc":"2.0","id":12,"method":"test/echo"}`},
}

// FuzzServeFrame sends one arbitrary frame to a live server over loopback,
// then a sentinel request, and checks what came back in between against the
// envelope rules: at most one answer, of the right kind, with the right id,
// and the connection still serving.
//
// Each execution costs a loopback round trip and the decoding of two
// answers; FuzzDecodeFrame holds the decoding of a frame to the same rules
// without them, at four times the rate (BENCHMARKS.md, "Fuzzing").
func FuzzServeFrame(f *testing.F) {
	for _, seed := range frameSeeds {
		f.Add(seed.binary, []byte(seed.frame))
	}
	s := newTestServer(f, func(s *testServer) {
		// Only methods that answer at once, and handlers that never block.
		delete(s.srv.Methods, "test/slow")
		delete(s.srv.Methods, "test/sized")
		s.srv.OnInternal = nil
		s.srv.Observe = nil
		s.srv.Notifications = map[string]func(context.Context, json.RawMessage){
			"test/note": func(context.Context, json.RawMessage) {},
		}
	})
	ws, _, err := websocket.DefaultDialer.Dial(s.url, nil)
	if err != nil {
		f.Fatal(err)
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	f.Cleanup(func() { ws.Close() })
	var sentinels atomic.Uint64

	f.Fuzz(func(t *testing.T, binary bool, frame []byte) {
		if !binary && pastDecoderDepth(frame) {
			t.Skip("nested past encoding/json's limit: TestDeepEnvelopes")
		}
		p := &peer{t: t, ws: ws}
		kind := websocket.TextMessage
		if binary {
			kind = websocket.BinaryMessage
		}
		if err := ws.WriteMessage(kind, frame); err != nil {
			t.Fatalf("write: %v", err)
		}
		sentinel := fmt.Sprintf("sentinel-5f0c9e-%d", sentinels.Add(1))
		sentinelID, _ := json.Marshal(sentinel)
		p.request(sentinel, "test/echo", nil)
		want := expectedAnswer(binary, frame)
		// Refusals with a null id are made before the sentinel is read, so
		// they come first; an answer with the frame's id may come before or
		// after the sentinel's, since requests run concurrently.
		var answers []response
		sawSentinel := false
		for !sawSentinel || (!want.none && len(answers) == 0) {
			r := p.read() // checks every envelope rule on the way
			if r.id == string(sentinelID) && !sawSentinel {
				sawSentinel = true
				continue
			}
			if want.none || len(answers) > 0 || (sawSentinel && r.id == "null") {
				t.Fatalf("frame %q: unexpected answer %s", frame, r.raw)
			}
			answers = append(answers, r)
		}
		if want.none {
			return
		}
		r := answers[0]
		if r.id != want.id {
			t.Fatalf("frame %q answered with id %s, want %s: %s", frame, r.id, want.id, r.raw)
		}
		if want.kind != "" && (r.err == nil || r.err.Kind != want.kind) {
			t.Fatalf("frame %q answered %s, want %s", frame, r.raw, want.kind)
		}
	})
}

type expectation struct {
	none bool         // no answer at all
	id   string       // the answer's id, as JSON
	kind jsonrpc.Kind // the error kind, when the envelope alone decides it
}

// expectedAnswer applies the spec's envelope rules to one frame.
func expectedAnswer(binary bool, frame []byte) expectation {
	refused := func(kind jsonrpc.Kind) expectation { return expectation{id: "null", kind: kind} }
	if binary {
		return refused(jsonrpc.KindInvalidRequest)
	}
	// What is JSON text, strictly (Unicode: no invalid UTF-8, no lone
	// surrogate), is wire.Nesting's to say; FuzzNesting holds it to
	// encoding/json and to an oracle of its own.
	if _, err := wire.Nesting(frame); err != nil {
		return refused(jsonrpc.KindParseError)
	}
	dec := json.NewDecoder(bytes.NewReader(frame))
	dec.UseNumber()
	var generic any
	if err := dec.Decode(&generic); err != nil {
		return refused(jsonrpc.KindParseError)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return refused(jsonrpc.KindParseError)
	}
	obj, ok := generic.(map[string]any)
	if !ok {
		return refused(jsonrpc.KindInvalidRequest) // a batch, or not an object
	}
	repeated := repeatedNames(frame)
	rawID, hasID := obj["id"]
	if !hasID {
		if _, named := obj["method"].(string); named {
			return expectation{none: true}
		}
		return refused(jsonrpc.KindInvalidRequest)
	}
	if repeated["id"] {
		return refused(jsonrpc.KindInvalidRequest)
	}
	var answer expectation
	switch id := rawID.(type) {
	case string:
		b, _ := json.Marshal(id)
		answer.id = string(b)
	case json.Number:
		n, err := id.Int64()
		if err != nil {
			return refused(jsonrpc.KindInvalidRequest)
		}
		answer.id = fmt.Sprint(n) // -0 is 0
	default:
		return refused(jsonrpc.KindInvalidRequest)
	}
	if len(repeated) > 0 {
		answer.kind = jsonrpc.KindInvalidRequest
	}
	return answer
}

// repeatedNames is the set of the names a frame's top-level object sends
// more than once, read with encoding/json's tokenizer (which, unlike a
// decoded map, keeps every member).
func repeatedNames(frame []byte) map[string]bool {
	dec := json.NewDecoder(bytes.NewReader(frame))
	seen, repeated := map[string]bool{}, map[string]bool{}
	depth, expectName := 0, false
	for {
		tok, err := dec.Token()
		if err != nil {
			return repeated
		}
		if d, ok := tok.(json.Delim); ok && (d == '}' || d == ']') {
			depth--
			expectName = depth == 1
			continue
		}
		if depth == 1 && expectName {
			name := tok.(string)
			if seen[name] {
				repeated[name] = true
			}
			seen[name] = true
			expectName = false
			continue
		}
		if d, ok := tok.(json.Delim); ok && (d == '{' || d == '[') {
			depth++
			expectName = depth == 1 && d == '{'
			continue
		}
		expectName = depth == 1
	}
}

// FuzzDecodeFrame holds the decoding of one text frame, the part of serving
// it that does not depend on the connection, to the envelope rules
// FuzzServeFrame checks answers against, and to what encoding/json reads in
// the same frame:
//
//   - a frame expectedAnswer leaves unanswered is a notification, and
//     nothing else is;
//   - a frame it answers with a null id is refused at once, without an id,
//     with its kind (parseError, or invalidRequest for a batch, a non-object,
//     a malformed id or a request without id and method);
//   - any other frame keeps the id the answer must carry, as JSON;
//   - a request or notification is refused exactly when its envelope breaks
//     a rule (a member past the four, jsonrpc not "2.0", method not a
//     string), and then as invalidRequest;
//   - its method is the frame's, and its params are present exactly when the
//     frame has them, and then the same value encoding/json reads there (the
//     last one, when the member is repeated).
func FuzzDecodeFrame(f *testing.F) {
	for _, seed := range frameSeeds {
		if !seed.binary {
			f.Add([]byte(seed.frame))
		}
	}
	for _, frame := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":1},"params":[2]}`,
		`{"params":{"a":[1,{"b":null}]},"id":"x","method":"m","jsonrpc":"2.0"}`,
		`{"jsonrpc":"2.0","method":"test/note","extra":1}`,
		`{"jsonrpc":"2.0","id":{"a":1},"method":"m"}`,
		`{"jsonrpc":"2.0","id":9223372036854775808,"method":"m"}`,
		`{"jsonrpc":"2.0","id":-1e2,"method":"m"}`,
		`{"jsonrpc":"2.0","id":"\u00e9\ud800","method":"m\u0000"}`,
		` [1] `,
		`"2.0"`,
		`{"id":1}`,
	} {
		f.Add([]byte(frame))
	}
	f.Fuzz(func(t *testing.T, frame []byte) {
		if pastDecoderDepth(frame) {
			t.Skip("nested past encoding/json's limit: TestDeepEnvelopes")
		}
		got := jsonrpc.DecodeFrame(frame)
		want := expectedAnswer(false, frame)
		if got.Refusal != nil && (got.Refusal.Kind.Code() != codeOf(got.Refusal.Kind) || got.Refusal.Message == "") {
			t.Fatalf("frame %q: refusal %+v is not a protocol error with a message", frame, got.Refusal)
		}
		switch {
		case want.none != got.Notification:
			t.Fatalf("frame %q: notification %v; want %v", frame, got.Notification, want.none)
		case want.id == "null":
			if got.ID != nil || got.Refusal == nil || got.Refusal.Kind != want.kind {
				t.Fatalf("frame %q: id %s, refusal %v; want a %s refusal without an id", frame, got.ID, got.Refusal, want.kind)
			}
			return
		case !want.none && string(got.ID) != want.id:
			t.Fatalf("frame %q: id %s; want %s", frame, got.ID, want.id)
		}

		// A request or a notification: the envelope itself, as
		// encoding/json reads it.
		dec := json.NewDecoder(bytes.NewReader(frame))
		dec.UseNumber()
		var obj map[string]any
		if err := dec.Decode(&obj); err != nil {
			t.Fatalf("frame %q: expectedAnswer took it for an object: %v", frame, err)
		}
		wellFormed := obj["jsonrpc"] == "2.0" && len(repeatedNames(frame)) == 0
		for k := range obj {
			wellFormed = wellFormed && (k == "jsonrpc" || k == "id" || k == "method" || k == "params")
		}
		method, isString := obj["method"].(string)
		wellFormed = wellFormed && isString
		if wellFormed != (got.Refusal == nil) || got.Refusal != nil && got.Refusal.Kind != jsonrpc.KindInvalidRequest {
			t.Fatalf("frame %q: refusal %v; want one (invalidRequest) exactly when the envelope is malformed (%v)", frame, got.Refusal, !wellFormed)
		}
		if isString && got.Method != method {
			t.Fatalf("frame %q: method %q; want %q", frame, got.Method, method)
		}
		params, hasParams := obj["params"]
		if hasParams != (got.Params != nil) {
			t.Fatalf("frame %q: params %v; want present %v", frame, got.Params, hasParams)
		}
		if hasParams {
			pd := json.NewDecoder(bytes.NewReader(got.Params.Value))
			pd.UseNumber()
			var v any
			if err := pd.Decode(&v); err != nil || !reflect.DeepEqual(v, params) {
				t.Fatalf("frame %q: params %s (%v) read as %#v; want %#v", frame, got.Params.Value, err, v, params)
			}
		}
	})
}

// pastDecoderDepth: the frame nests past the 10,000 levels encoding/json
// reads, so expectedAnswer, which reads it with encoding/json, cannot judge
// it (the server reads any depth; depth_test.go covers those frames).
func pastDecoderDepth(frame []byte) bool {
	var syntax *json.SyntaxError
	err := json.Unmarshal(frame, new(any))
	return errors.As(err, &syntax) && strings.Contains(syntax.Error(), "exceeded max depth")
}

// codeOf is the spec's code for the two kinds a frame is refused with before
// it is served, written out here rather than taken from Kind.Code.
func codeOf(k jsonrpc.Kind) int {
	switch k {
	case jsonrpc.KindParseError:
		return -32700
	case jsonrpc.KindInvalidRequest:
		return -32600
	}
	return 0
}
