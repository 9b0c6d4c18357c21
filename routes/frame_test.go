package routes

import (
	"bytes"
	"encoding/binary"
	"testing"
)

func TestParseHeader(t *testing.T) {
	for _, n := range []int{0, 1, 125, 126, 127, 65535, 65536, 16 << 20} {
		for _, masked := range []bool{false, true} {
			f := mkFrame(true, opBinary, make([]byte, n), masked)
			// Every prefix shorter than the header asks for more.
			h, need, err := parseHeader(f[:1])
			if err != nil || need != 2 {
				t.Fatalf("1 byte: need %d, %v", need, err)
			}
			h, need, err = parseHeader(f)
			if err != nil || need != 0 {
				t.Fatalf("n=%d: need %d, %v", n, need, err)
			}
			if h.length != uint64(n) || h.masked != masked || !h.fin || h.op != opBinary || h.size+n != len(f) {
				t.Fatalf("n=%d masked=%v: parsed %+v", n, masked, h)
			}
			if _, need, _ := parseHeader(f[:h.size-1]); need != h.size {
				t.Fatalf("n=%d masked=%v: short header asks for %d, want %d", n, masked, need, h.size)
			}
		}
	}
	// A 64-bit length with the top bit set is refused.
	bad := []byte{0x82, 127, 0x80, 0, 0, 0, 0, 0, 0, 1}
	if _, _, err := parseHeader(bad); err == nil {
		t.Fatal("a length with its top bit set was accepted")
	}
}

func TestCloseFrame(t *testing.T) {
	for _, masked := range []bool{false, true} {
		f := closeFrame(CloseGoingAway, "bye", masked)
		h, need, err := parseHeader(f)
		if err != nil || need != 0 || h.op != opClose || !h.fin || h.masked != masked || h.size+int(h.length) != len(f) {
			t.Fatalf("masked=%v: %+v %d %v", masked, h, need, err)
		}
		p := bytes.Clone(f[h.size:])
		if masked {
			key := f[h.size-4 : h.size]
			for i := range p {
				p[i] ^= key[i%4]
			}
		}
		if binary.BigEndian.Uint16(p) != CloseGoingAway || string(p[2:]) != "bye" {
			t.Fatalf("payload %q", p)
		}
	}
	// A reason is cut to fit a control frame.
	if f := closeFrame(CloseNormal, string(make([]byte, 300)), false); len(f) != 2+125 {
		t.Fatalf("close frame of %d bytes", len(f))
	}
}

func TestMessageStateCountsAcrossFragments(t *testing.T) {
	var m messageState
	hdr := func(fin bool, op byte, n uint64) header {
		return header{fin: fin, op: op, length: n, masked: true}
	}
	if end, v := m.check(hdr(false, opText, 10), true, 25); v != nil || end {
		t.Fatal(v)
	}
	if _, v := m.check(hdr(true, opPing, 5), true, 25); v != nil {
		t.Fatal("a ping inside a message:", v)
	}
	if end, v := m.check(hdr(false, opContinuation, 10), true, 25); v != nil || end {
		t.Fatal(v)
	}
	if end, v := m.check(hdr(true, opContinuation, 5), true, 25); v != nil || !end {
		t.Fatal("exactly the limit:", v)
	}
	// The next message starts from zero.
	if end, v := m.check(hdr(true, opBinary, 25), true, 25); v != nil || !end {
		t.Fatal(v)
	}
	m.check(hdr(false, opText, 20), true, 25)
	if _, v := m.check(hdr(true, opContinuation, 6), true, 25); v == nil || v.code != CloseTooBig {
		t.Fatalf("over the limit across fragments: %v", v)
	}
}
