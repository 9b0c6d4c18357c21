package jsonrpc_test

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// deepObject is an object nesting depth levels deep.
func deepObject(depth int) string {
	return `{"a":` + strings.Repeat("[", depth-1) + "1" + strings.Repeat("]", depth-1) + `}`
}

// Deep params are valid JSON: never parseError (encoding/json's 10,000
// levels are no limit of the protocol's), but invalidParams naming the
// limit, with the request's id, wherever the id stands in the frame.
func TestDeepParamsAreInvalidParamsNotAParseError(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	p.initialize()

	// At the limit, params are served as any others.
	r := p.call(1, "test/echo", json.RawMessage(deepObject(wire.MaxDepth)))
	if r.err != nil {
		t.Fatalf("params at the %d-level limit: %s", wire.MaxDepth, clip(r.raw))
	}
	for _, depth := range []int{wire.MaxDepth + 1, 9999, 10000, 10001, 100000} {
		params := deepObject(depth)
		for _, frame := range []string{
			`{"jsonrpc":"2.0","id":"deep","method":"test/echo","params":` + params + `}`,
			`{"params":` + params + `,"method":"test/echo","jsonrpc":"2.0","id":"deep"}`,
		} {
			p.send(frame)
			r := p.read()
			expectError(t, r, jsonrpc.KindInvalidParams, `"deep"`)
			if !strings.Contains(r.err.Message, strconv.Itoa(depth)+" levels") || !strings.Contains(r.err.Message, "at most "+strconv.Itoa(wire.MaxDepth)) {
				t.Errorf("params %d levels deep: the message should give the depth and the limit: %q", depth, r.err.Message)
			}
		}
		// A method that decodes its own params sees no more than the
		// server lets through.
		p.send(`{"jsonrpc":"2.0","id":2,"method":"test/typed","params":` + params + `}`)
		expectError(t, p.read(), jsonrpc.KindInvalidParams, "2")
		p.sentinel("depth " + strconv.Itoa(depth))
	}
}

// The decisions for a deep frame whose depth is not in its params: a frame
// that is valid JSON is read whatever its depth, and judged by the envelope
// rules as any other; only a frame that is not JSON is parseError.
func TestDeepEnvelopes(t *testing.T) {
	s := newTestServer(t)
	p := s.dial(t)
	deep := strings.Repeat("[", 20000) + strings.Repeat("]", 20000)
	for _, initialized := range []bool{false, true} {
		if initialized {
			p.initialize()
		}
		for _, c := range []struct {
			frame string
			kind  jsonrpc.Kind
			id    string
		}{
			// Handshake rule 1 outranks the params, deep ones too.
			{`{"jsonrpc":"2.0","id":3,"method":"test/echo","params":{"a":` + deep + `}}`, jsonrpc.KindNotInitialized, "3"},
			{`{"jsonrpc":"2.0","id":4,"method":"test/echo","extra":` + deep + `}`, jsonrpc.KindInvalidRequest, "4"},
			{`{"jsonrpc":"2.0","id":5,"method":` + deep + `}`, jsonrpc.KindInvalidRequest, "5"},
			{`{"jsonrpc":` + deep + `,"id":6,"method":"test/echo"}`, jsonrpc.KindInvalidRequest, "6"},
			{`{"jsonrpc":"2.0","id":` + deep + `,"method":"test/echo"}`, jsonrpc.KindInvalidRequest, "null"},
			{`[` + deep + `]`, jsonrpc.KindInvalidRequest, "null"},
			{`{"jsonrpc":"2.0","id":7,"method":"test/echo","params":` + deep + `}`, jsonrpc.KindInvalidParams, "7"},
			{`{"jsonrpc":"2.0","id":8,"method":"test/echo","params":{"a":` + deep + `}`, jsonrpc.KindParseError, "null"},
			{`{"jsonrpc":"2.0","id":9,"method":"test/echo","params":{"a":` + deep + `]}}`, jsonrpc.KindParseError, "null"},
		} {
			if c.kind == jsonrpc.KindNotInitialized && initialized {
				c.kind = jsonrpc.KindInvalidParams
			}
			if c.kind == jsonrpc.KindInvalidParams && !initialized {
				c.kind = jsonrpc.KindNotInitialized
			}
			p.send(c.frame)
			expectError(t, p.read(), c.kind, c.id)
		}
		// A notification with deep params is dropped, like any malformed one.
		p.send(`{"jsonrpc":"2.0","method":"test/note","params":{"a":` + deep + `}}`)
		p.sentinel("envelopes " + strconv.FormatBool(initialized))
	}
	select {
	case n := <-s.notes:
		t.Fatalf("a notification with deep params was delivered: %v", n)
	default:
	}
}
