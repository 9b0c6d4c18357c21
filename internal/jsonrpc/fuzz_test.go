package jsonrpc_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"testing"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// FuzzServeFrame sends one arbitrary frame to a live server over loopback,
// then a sentinel request, and checks what came back in between against the
// envelope rules: at most one answer, of the right kind, with the right id,
// and the connection still serving.
func FuzzServeFrame(f *testing.F) {
	for _, seed := range []struct {
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
	} {
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
	rawID, hasID := obj["id"]
	if !hasID {
		if _, named := obj["method"].(string); named {
			return expectation{none: true}
		}
		return refused(jsonrpc.KindInvalidRequest)
	}
	switch id := rawID.(type) {
	case string:
		b, _ := json.Marshal(id)
		return expectation{id: string(b)}
	case json.Number:
		if _, err := id.Int64(); err == nil {
			return expectation{id: id.String()}
		}
	}
	return refused(jsonrpc.KindInvalidRequest)
}
