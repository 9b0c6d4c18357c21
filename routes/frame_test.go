package routes

import (
	"bytes"
	"encoding/binary"
	"io"
	"testing"
	"time"
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

func FuzzParseHeader(f *testing.F) {
	f.Add(mkFrame(true, opText, []byte("hello"), true))
	f.Add(mkFrame(false, opContinuation, make([]byte, 300), false))
	f.Add(mkFrame(true, opBinary, make([]byte, 70000), true)[:14])
	f.Add([]byte{0x81})
	f.Add([]byte{0x82, 127, 0xff, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, need, err := parseHeader(b)
		if err != nil {
			return
		}
		if need > 0 {
			if need <= len(b) || need > maxHeaderBytes {
				t.Fatalf("need %d with %d bytes", need, len(b))
			}
			return
		}
		if h.size < 2 || h.size > maxHeaderBytes || h.size > len(b) || h.length>>63 != 0 {
			t.Fatalf("parsed %+v from %d bytes", h, len(b))
		}
		var m messageState
		_, _ = m.check(h, h.masked, 16<<20)
	})
}

// FuzzRelayForwardsAPrefix feeds arbitrary bytes from the runtime's side
// through a relay: what reaches the daemon is always a prefix of them (cut
// at a frame boundary), followed by nothing but the relay's own close frame.
func FuzzRelayForwardsAPrefix(f *testing.F) {
	f.Add(mkFrame(true, opText, []byte("hello"), true))
	f.Add(append(mkFrame(false, opText, []byte("a"), true), mkFrame(true, opContinuation, []byte("b"), true)...))
	f.Add(append(mkFrame(true, opPing, nil, true), mkFrame(true, opText, []byte("x"), false)...))
	f.Add(append(mkFrame(true, opText, make([]byte, 3000), true), 0x81, 0xfe))
	f.Add(mkFrame(true, opClose, []byte{3, 232}, true))
	f.Fuzz(func(t *testing.T, in []byte) {
		cfg := testRelayConfig()
		cfg.closeWait = 50 * time.Millisecond
		rig := newRig(t, cfg, nil, nil)
		go func() {
			_, _ = rig.runtime.Write(in)
			time.Sleep(20 * time.Millisecond)
			_ = rig.runtime.Close()
		}()
		_ = rig.guest.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, err := io.ReadAll(rig.guest)
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		// got must be in[:k] for some k, then nothing or one close frame of
		// the relay's own (masked) after a whole frame. (The relay's close
		// frame may itself look like a continuation of in, so every k that
		// fits is tried.)
		boundaries := map[int]bool{0: true}
		for off := 0; off < len(in); {
			h, need, err := parseHeader(in[off:])
			if err != nil || need > 0 {
				break
			}
			off += h.size + int(h.length)
			boundaries[off] = true
		}
		for k := min(len(got), len(in)); k >= 0; k-- {
			if !bytes.Equal(got[:k], in[:k]) {
				continue
			}
			rest := got[k:]
			if len(rest) == 0 {
				return
			}
			h, need, err := parseHeader(rest)
			if boundaries[k] && err == nil && need == 0 && h.op == opClose && h.masked && h.size+int(h.length) == len(rest) {
				return
			}
		}
		t.Fatalf("the daemon got %d bytes that are not a prefix of the %d sent plus a close frame of the relay's", len(got), len(in))
	})
}
