package wsframe

import (
	"testing"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/wsframe/wsframetest"
)

// FuzzParseHeader holds ParseHeader to the oracle's reading (every field,
// the bytes it asks for when the header is cut short, and that nothing past
// the header matters), then runs the bytes as a stream of headers through
// MessageState.Check and the oracle's rules, which must agree frame by
// frame on every refusal's close code and on where messages end. Every
// refusal's reason fits in a close frame.
func FuzzParseHeader(f *testing.F) {
	f.Add(wsframetest.Frame(true, OpText, []byte("hello"), true), true, uint16(100))
	f.Add(wsframetest.Frame(false, OpContinuation, make([]byte, 300), false), false, uint16(1000))
	f.Add(wsframetest.Frame(true, OpBinary, make([]byte, 70000), true)[:14], true, uint16(0xffff))
	f.Add([]byte{0x81}, true, uint16(1))
	f.Add([]byte{0x82, 127, 0xff, 0, 0, 0, 0, 0, 0, 0}, false, uint16(5))
	f.Add([]byte{0x01, 0x85, 0, 0, 0, 0, 0x89, 0x80, 0, 0, 0, 0, 0x80, 0xfe, 0, 1, 0, 0, 0, 0}, true, uint16(300))
	f.Fuzz(func(t *testing.T, b []byte, fromClient bool, limit uint16) {
		h, need, v := ParseHeader(b)
		want := wsframetest.Parse(b)
		if !want.Whole {
			wantNeed := want.Size
			if len(b) < 2 {
				wantNeed = 2
			}
			if v != nil || need != wantNeed {
				t.Fatalf("ParseHeader(%x) = need %d, %v; want need %d", b, need, v, wantNeed)
			}
			return
		}
		if want.Length >= 1<<63 {
			if v == nil || v.Code != wsframetest.CloseProtocolError || need != 0 {
				t.Fatalf("ParseHeader(%x) = need %d, %v; want a protocol error", b, need, v)
			}
			checkReason(t, v)
			return
		}
		if v != nil || need != 0 || h.Fin != want.Fin || h.RSV != want.RSV<<4 || h.Op != want.Op ||
			h.Masked != want.Masked || h.Length != want.Length || h.Size != want.Size {
			t.Fatalf("ParseHeader(%x) = %+v, need %d, %v; want %+v", b, h, need, v, want)
		}
		if again, need, v := ParseHeader(b[:h.Size]); again != h || need != 0 || v != nil {
			t.Fatalf("ParseHeader(%x) depends on what follows the header: %+v", b, again)
		}
		for i := range h.Size {
			wantNeed := h.Size
			if i < 2 {
				wantNeed = 2
			}
			if _, need, v := ParseHeader(b[:i]); need != wantNeed || v != nil {
				t.Fatalf("ParseHeader(%x) with %d bytes: need %d, %v; want %d", b[:h.Size], i, need, v, wantNeed)
			}
		}

		// The bytes as headers back to back, payloads left out (Check sees
		// only headers).
		var m MessageState
		var rules wsframetest.Rules
		for off := 0; off < len(b); {
			h, need, v := ParseHeader(b[off:])
			hr := wsframetest.Parse(b[off:])
			if need > 0 {
				return
			}
			var ends bool
			if v == nil {
				ends, v = m.Check(h, fromClient, uint64(limit))
			}
			wantCode, wantEnds := rules.Step(hr, fromClient, uint64(limit))
			switch {
			case v == nil && wantCode != 0:
				t.Fatalf("%x: header at %d accepted; want close code %d", b, off, wantCode)
			case v != nil && v.Code != wantCode:
				t.Fatalf("%x: header at %d refused with %d (%s); want %d", b, off, v.Code, v.Reason, wantCode)
			case v != nil:
				checkReason(t, v)
				return
			case ends != wantEnds:
				t.Fatalf("%x: header at %d ends a message: %v; want %v", b, off, ends, wantEnds)
			}
			if m.inMessage != rules.InMessage {
				t.Fatalf("%x: after the header at %d in a message: %v; want %v", b, off, m.inMessage, rules.InMessage)
			}
			off += h.Size
		}
	})
}

// checkReason: a violation's reason goes into close frames whole.
func checkReason(t *testing.T, v *Violation) {
	t.Helper()
	if v.Reason == "" || len(v.Reason) > 123 || !utf8.ValidString(v.Reason) {
		t.Fatalf("violation reason %q does not fit a close frame", v.Reason)
	}
}
