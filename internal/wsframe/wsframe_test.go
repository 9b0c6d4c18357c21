package wsframe

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/wsframe/wsframetest"
)

func TestParseHeader(t *testing.T) {
	for _, n := range []int{0, 1, 125, 126, 127, 65535, 65536, 16 << 20} {
		for _, masked := range []bool{false, true} {
			f := wsframetest.Frame(true, OpBinary, make([]byte, n), masked)
			// Every prefix shorter than the header asks for more.
			h, need, err := ParseHeader(f[:1])
			if err != nil || need != 2 {
				t.Fatalf("1 byte: need %d, %v", need, err)
			}
			h, need, err = ParseHeader(f)
			if err != nil || need != 0 {
				t.Fatalf("n=%d: need %d, %v", n, need, err)
			}
			if h.Length != uint64(n) || h.Masked != masked || !h.Fin || h.Op != OpBinary || h.Size+n != len(f) {
				t.Fatalf("n=%d masked=%v: parsed %+v", n, masked, h)
			}
			if _, need, _ := ParseHeader(f[:h.Size-1]); need != h.Size {
				t.Fatalf("n=%d masked=%v: short header asks for %d, want %d", n, masked, need, h.Size)
			}
		}
	}
	// A 64-bit length with the top bit set is refused.
	bad := []byte{0x82, 127, 0x80, 0, 0, 0, 0, 0, 0, 1}
	if _, _, err := ParseHeader(bad); err == nil {
		t.Fatal("a length with its top bit set was accepted")
	}
}

func TestCloseFrame(t *testing.T) {
	for _, masked := range []bool{false, true} {
		f := CloseFrame(CloseGoingAway, "bye", masked)
		h, need, err := ParseHeader(f)
		if err != nil || need != 0 || h.Op != OpClose || !h.Fin || h.Masked != masked || h.Size+int(h.Length) != len(f) {
			t.Fatalf("masked=%v: %+v %d %v", masked, h, need, err)
		}
		p := bytes.Clone(f[h.Size:])
		if masked {
			key := f[h.Size-4 : h.Size]
			for i := range p {
				p[i] ^= key[i%4]
			}
		}
		if binary.BigEndian.Uint16(p) != CloseGoingAway || string(p[2:]) != "bye" {
			t.Fatalf("payload %q", p)
		}
	}
	// A reason is cut to fit a control frame.
	if f := CloseFrame(CloseNormal, string(make([]byte, 300)), false); len(f) != 2+125 {
		t.Fatalf("close frame of %d bytes", len(f))
	}
}

func TestMessageStateCountsAcrossFragments(t *testing.T) {
	var m MessageState
	hdr := func(fin bool, op byte, n uint64) Header {
		return Header{Fin: fin, Op: op, Length: n, Masked: true}
	}
	if end, v := m.Check(hdr(false, OpText, 10), true, 25); v != nil || end {
		t.Fatal(v)
	}
	if _, v := m.Check(hdr(true, OpPing, 5), true, 25); v != nil {
		t.Fatal("a ping inside a message:", v)
	}
	if end, v := m.Check(hdr(false, OpContinuation, 10), true, 25); v != nil || end {
		t.Fatal(v)
	}
	if end, v := m.Check(hdr(true, OpContinuation, 5), true, 25); v != nil || !end {
		t.Fatal("exactly the limit:", v)
	}
	// The next message starts from zero.
	if end, v := m.Check(hdr(true, OpBinary, 25), true, 25); v != nil || !end {
		t.Fatal(v)
	}
	m.Check(hdr(false, OpText, 20), true, 25)
	if _, v := m.Check(hdr(true, OpContinuation, 6), true, 25); v == nil || v.Code != CloseTooBig {
		t.Fatalf("over the limit across fragments: %v", v)
	}
}

// Each rule refuses on its own; the relay's tests see the same refusals end
// to end, but this package's coverage should not depend on them.
func TestMessageStateRefusals(t *testing.T) {
	cases := []struct {
		name       string
		inMessage  bool
		h          Header
		fromClient bool
		code       int
	}{
		{"reserved bit", false, Header{Fin: true, RSV: 0x40, Op: OpText, Masked: true}, true, CloseProtocolError},
		{"unmasked client frame", false, Header{Fin: true, Op: OpText}, true, CloseProtocolError},
		{"masked server frame", false, Header{Fin: true, Op: OpText, Masked: true}, false, CloseProtocolError},
		{"fragmented control frame", false, Header{Op: OpPing}, false, CloseProtocolError},
		{"long control frame", false, Header{Fin: true, Op: OpPong, Length: 126}, false, CloseProtocolError},
		{"new message inside one", true, Header{Fin: true, Op: OpBinary}, false, CloseProtocolError},
		{"stray continuation", false, Header{Fin: true, Op: OpContinuation}, false, CloseProtocolError},
		{"unknown opcode", false, Header{Fin: true, Op: 0x3}, false, CloseProtocolError},
		{"one frame over the limit", false, Header{Fin: true, Op: OpText, Length: 101}, false, CloseTooBig},
	}
	for _, c := range cases {
		m := MessageState{inMessage: c.inMessage}
		end, v := m.Check(c.h, c.fromClient, 100)
		if v == nil || end || v.Code != c.code {
			t.Errorf("%s: end %v, %v; want close code %d", c.name, end, v, c.code)
			continue
		}
		if v.Error() != fmt.Sprintf("websocket %d: %s", c.code, v.Reason) {
			t.Errorf("%s: Error() = %q", c.name, v.Error())
		}
	}
}
