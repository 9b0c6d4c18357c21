package routes

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// The oracle of this file reads frames its own way, byte by byte from RFC
// 6455 (section 5.2) and the relay's rules (doc.go), so that the fuzz
// targets hold parseHeader, messageState and the relay's forwarding loop to
// something other than themselves.

// refHeader is the oracle's reading of a frame header. whole is false when
// the bytes end inside the header.
type refHeader struct {
	fin      bool
	rsv      byte // the three reserved bits, as a number 0..7
	op       byte
	masked   bool
	lenField byte // the 7-bit length field: a length, or 126 or 127
	length   uint64
	size     int
	whole    bool
}

func refParse(b []byte) refHeader {
	var h refHeader
	if len(b) < 2 {
		return h
	}
	h.fin = b[0] >= 0x80
	h.rsv = b[0] >> 4 & 7
	h.op = b[0] % 16
	h.masked = b[1] >= 0x80
	h.lenField = b[1] % 128
	ext := 0
	switch h.lenField {
	case 126:
		ext = 2
	case 127:
		ext = 8
	}
	h.size = 2 + ext
	if h.masked {
		h.size += 4
	}
	if len(b) < h.size {
		return h
	}
	h.whole = true
	if ext == 0 {
		h.length = uint64(h.lenField)
	}
	for _, c := range b[2 : 2+ext] {
		h.length = h.length<<8 | uint64(c)
	}
	return h
}

// refRules is the oracle's framing state of one direction.
type refRules struct {
	inMessage bool
	size      uint64
}

// step returns the close code a header must be answered with (0 when the
// frame is allowed) and whether the frame ends a data message.
func (s *refRules) step(h refHeader, fromClient bool, limit uint64) (code int, ends bool) {
	control := h.op == 8 || h.op == 9 || h.op == 10
	data := h.op == 1 || h.op == 2
	switch {
	case h.length >= 1<<63, // only a 64-bit length can be this long
		h.rsv != 0,             // no extension is negotiated
		h.masked != fromClient, // clients mask, servers do not
		!control && !data && h.op != 0,
		control && (!h.fin || h.length > 125),
		data && s.inMessage,
		h.op == 0 && !s.inMessage:
		return CloseProtocolError, false
	case control:
		return 0, false
	}
	if data {
		s.size = 0
	}
	s.size += h.length
	if s.size > limit {
		return CloseTooBig, false
	}
	s.inMessage = !h.fin
	return 0, h.fin
}

// FuzzParseHeader holds parseHeader to the oracle's reading (every field,
// the bytes it asks for when the header is cut short, and that nothing past
// the header matters), then runs the bytes as a stream of headers through
// messageState.check and the oracle's rules, which must agree frame by
// frame on every refusal's close code and on where messages end. Every
// refusal's reason fits in a close frame.
func FuzzParseHeader(f *testing.F) {
	f.Add(mkFrame(true, opText, []byte("hello"), true), true, uint16(100))
	f.Add(mkFrame(false, opContinuation, make([]byte, 300), false), false, uint16(1000))
	f.Add(mkFrame(true, opBinary, make([]byte, 70000), true)[:14], true, uint16(0xffff))
	f.Add([]byte{0x81}, true, uint16(1))
	f.Add([]byte{0x82, 127, 0xff, 0, 0, 0, 0, 0, 0, 0}, false, uint16(5))
	f.Add([]byte{0x01, 0x85, 0, 0, 0, 0, 0x89, 0x80, 0, 0, 0, 0, 0x80, 0xfe, 0, 1, 0, 0, 0, 0}, true, uint16(300))
	f.Fuzz(func(t *testing.T, b []byte, fromClient bool, limit uint16) {
		h, need, v := parseHeader(b)
		want := refParse(b)
		if !want.whole {
			wantNeed := want.size
			if len(b) < 2 {
				wantNeed = 2
			}
			if v != nil || need != wantNeed {
				t.Fatalf("parseHeader(%x) = need %d, %v; want need %d", b, need, v, wantNeed)
			}
			return
		}
		if want.length >= 1<<63 {
			if v == nil || v.code != CloseProtocolError || need != 0 {
				t.Fatalf("parseHeader(%x) = need %d, %v; want a protocol error", b, need, v)
			}
			checkReason(t, v)
			return
		}
		if v != nil || need != 0 || h.fin != want.fin || h.rsv != want.rsv<<4 || h.op != want.op ||
			h.masked != want.masked || h.length != want.length || h.size != want.size {
			t.Fatalf("parseHeader(%x) = %+v, need %d, %v; want %+v", b, h, need, v, want)
		}
		if again, need, v := parseHeader(b[:h.size]); again != h || need != 0 || v != nil {
			t.Fatalf("parseHeader(%x) depends on what follows the header: %+v", b, again)
		}
		for i := range h.size {
			wantNeed := h.size
			if i < 2 {
				wantNeed = 2
			}
			if _, need, v := parseHeader(b[:i]); need != wantNeed || v != nil {
				t.Fatalf("parseHeader(%x) with %d bytes: need %d, %v; want %d", b[:h.size], i, need, v, wantNeed)
			}
		}

		// The bytes as headers back to back, payloads left out (check sees
		// only headers).
		var m messageState
		var rules refRules
		for off := 0; off < len(b); {
			h, need, v := parseHeader(b[off:])
			hr := refParse(b[off:])
			if need > 0 {
				return
			}
			var ends bool
			if v == nil {
				ends, v = m.check(h, fromClient, uint64(limit))
			}
			wantCode, wantEnds := rules.step(hr, fromClient, uint64(limit))
			switch {
			case v == nil && wantCode != 0:
				t.Fatalf("%x: header at %d accepted; want close code %d", b, off, wantCode)
			case v != nil && v.code != wantCode:
				t.Fatalf("%x: header at %d refused with %d (%s); want %d", b, off, v.code, v.reason, wantCode)
			case v != nil:
				checkReason(t, v)
				return
			case ends != wantEnds:
				t.Fatalf("%x: header at %d ends a message: %v; want %v", b, off, ends, wantEnds)
			}
			if m.inMessage != rules.inMessage {
				t.Fatalf("%x: after the header at %d in a message: %v; want %v", b, off, m.inMessage, rules.inMessage)
			}
			off += h.size
		}
	})
}

// checkReason: a violation's reason goes into close frames whole.
func checkReason(t *testing.T, v *violation) {
	t.Helper()
	if v.reason == "" || len(v.reason) > 123 || !utf8.ValidString(v.reason) {
		t.Fatalf("violation reason %q does not fit a close frame", v.reason)
	}
}

// relayOutcome is what the oracle expects of one direction of a relay fed
// some bytes and then the end of their source.
type relayOutcome struct {
	forwarded int    // in[:forwarded] reaches the destination whole
	cutHeader int    // > 0: then a frame cut short, at least its header of cutHeader bytes, and nothing after it
	toDst     int    // the close code of the relay's own frame after what it forwarded (0: none)
	toSrc     int    // the close code the relay sends back to the source (0: none)
	messages  int    // data messages forwarded whole
	reason    string // the relay's reason to end, for metrics, as pump leaves it ("" while it waits for the other side)
}

// fuzzMessageLimit is the relay's message limit in the fuzz target: small,
// so that fragments adding up past it are within a fuzzer's reach, and
// above inlineBufferBytes, so that streamed frames are too.
const fuzzMessageLimit = 6000

// expectRelay is the oracle of one direction: frames are forwarded whole
// until the source ends, sends a close frame (forwarded, after which its
// frames are read, still checked, and dropped) or breaks a rule (both sides
// get the relay's close frame with the rule's code). A source that ends
// without a close frame gets the destination a going-away close, unless it
// ended inside a frame that was being streamed: then no frame can follow.
func expectRelay(in []byte, fromClient bool, limit uint64) relayOutcome {
	var (
		o      relayOutcome
		rules  refRules
		closed bool
	)
	for off := 0; ; {
		h := refParse(in[off:])
		if !h.whole {
			break
		}
		code, ends := rules.step(h, fromClient, limit)
		if code != 0 {
			o.toSrc = code
			if !closed {
				o.toDst = code
			}
			o.reason = "protocol_error"
			if code == CloseTooBig {
				o.reason = "too_big"
			}
			return o
		}
		if uint64(len(in)-off-h.size) < h.length {
			if closed {
				return o
			}
			if h.op != opClose {
				o.cutHeader = h.size
				o.reason = "peer_gone"
				return o
			}
			break // a close frame is forwarded only whole
		}
		off += h.size + int(h.length)
		if closed {
			continue
		}
		o.forwarded = off
		closed = h.op == opClose
		if ends {
			o.messages++
		}
	}
	if !closed {
		o.toDst = CloseGoingAway
		o.reason = "peer_gone"
	}
	return o
}

// checkRelayClose: b is exactly one close frame of the relay's own, with
// code, masked as frames to a daemon are.
func checkRelayClose(t *testing.T, what string, b []byte, code int, masked bool) {
	t.Helper()
	h := refParse(b)
	if !h.whole || !h.fin || h.rsv != 0 || h.op != opClose || h.masked != masked || uint64(len(b)-h.size) != h.length || h.length < 2 || h.length > 125 {
		t.Fatalf("%s: %x is not one close frame (masked %v)", what, b, masked)
	}
	p := bytes.Clone(b[h.size:])
	if masked {
		key := b[h.size-4 : h.size]
		for i := range p {
			p[i] ^= key[i%4]
		}
	}
	if got := int(p[0])<<8 | int(p[1]); got != code || len(p) == 2 || !utf8.Valid(p[2:]) {
		t.Fatalf("%s: close frame %d %q; want %d with a reason", what, got, p[2:], code)
	}
}

// checkRelayed holds what one direction of a relay wrote to its
// destination and back to its source to the oracle.
func checkRelayed(t *testing.T, in, toDst, toSrc []byte, fromClient bool) relayOutcome {
	t.Helper()
	want := expectRelay(in, fromClient, fuzzMessageLimit)
	if want.cutHeader > 0 {
		if len(toDst) < want.forwarded+want.cutHeader || len(toDst) > len(in) || !bytes.Equal(toDst, in[:len(toDst)]) {
			t.Fatalf("the destination got %d bytes; want the %d before a cut frame, then at least its %d header bytes, and nothing after", len(toDst), want.forwarded, want.cutHeader)
		}
	} else {
		if len(toDst) < want.forwarded || !bytes.Equal(toDst[:want.forwarded], in[:want.forwarded]) {
			t.Fatalf("the destination got %d bytes that do not start with the %d forwarded whole", len(toDst), want.forwarded)
		}
		if rest := toDst[want.forwarded:]; want.toDst == 0 && len(rest) > 0 {
			t.Fatalf("the destination got %d bytes after the %d forwarded; want none", len(rest), want.forwarded)
		} else if want.toDst != 0 {
			checkRelayClose(t, "to the destination", rest, want.toDst, fromClient)
		}
	}
	if want.toSrc == 0 && len(toSrc) > 0 {
		t.Fatalf("the source got %x back; want nothing", toSrc)
	} else if want.toSrc != 0 {
		checkRelayClose(t, "back to the source", toSrc, want.toSrc, !fromClient)
	}
	return want
}

// memConn is one end of a relay's connection in memory: reads take from in,
// at most chunk bytes each (0: any number), and then find the peer gone;
// writes collect in out. It needs no goroutine and no socket.
type memConn struct {
	in     []byte
	chunk  int
	out    bytes.Buffer
	closed bool
}

func (c *memConn) Read(p []byte) (int, error) {
	if c.closed {
		return 0, net.ErrClosed
	}
	if len(c.in) == 0 {
		return 0, io.EOF
	}
	n := len(p)
	if c.chunk > 0 {
		n = min(n, c.chunk)
	}
	n = copy(p[:n], c.in)
	c.in = c.in[n:]
	return n, nil
}

func (c *memConn) Write(p []byte) (int, error) {
	if c.closed {
		return 0, net.ErrClosed
	}
	return c.out.Write(p)
}

func (c *memConn) Close() error                     { c.closed = true; return nil }
func (c *memConn) LocalAddr() net.Addr              { return &net.UnixAddr{Name: "mem", Net: "unix"} }
func (c *memConn) RemoteAddr() net.Addr             { return &net.UnixAddr{Name: "mem", Net: "unix"} }
func (c *memConn) SetDeadline(time.Time) error      { return nil }
func (c *memConn) SetReadDeadline(time.Time) error  { return nil }
func (c *memConn) SetWriteDeadline(time.Time) error { return nil }

// countingCounter counts what the relay adds to a metric.
type countingCounter struct {
	prometheus.Counter // only Add is used
	n                  float64
}

func (c *countingCounter) Add(v float64) { c.n += v }

type relaySeed struct {
	in        []byte
	early     uint16 // how many of in's bytes the handshake read ahead
	chunk     uint8  // the most bytes one read returns (0: any number)
	fromGuest bool
}

func cat(frames ...[]byte) []byte { return bytes.Join(frames, nil) }

// relaySeeds reach every outcome of expectRelay in both directions, and
// the relay's inline, streamed and read-ahead paths.
func relaySeeds() []relaySeed {
	big := make([]byte, 5000)
	for i := range big {
		big[i] = byte(i)
	}
	return []relaySeed{
		{mkFrame(true, opText, []byte("hello"), true), 0, 0, false},
		{cat(mkFrame(false, opText, []byte("a"), true), mkFrame(true, opPing, nil, true), mkFrame(true, opContinuation, []byte("b"), true)), 0, 3, false},
		{cat(mkFrame(true, opPing, nil, true), mkFrame(true, opText, []byte("x"), false)), 0, 0, false},
		{append(mkFrame(true, opText, make([]byte, 3000), true), 0x81, 0xfe), 0, 0, false},
		{mkFrame(true, opClose, []byte{3, 232}, true), 0, 0, false},
		{cat(mkFrame(true, opClose, []byte{3, 232}, true), mkFrame(true, opText, []byte("dropped"), true), []byte{0x83, 0x80, 1, 2, 3, 4}), 0, 1, false},
		{mkFrame(true, opBinary, big, true), 0, 100, false},
		{cat(mkFrame(false, opBinary, big[:4000], true), mkFrame(true, opContinuation, big[:3000], true)), 0, 0, false},
		{mkFrame(true, opBinary, big, true)[:2500], 0, 0, false},
		{mkFrame(true, opText, big[:40], true)[:30], 0, 7, false},
		{cat(mkFrame(true, opBinary, big[:3000], true), mkFrame(true, opText, []byte("after"), true)), 2500, 0, false},
		{cat(mkFrame(true, opText, []byte("hi"), false), mkFrame(true, opClose, []byte{3, 232}, false)), 0, 0, true},
		{cat(mkFrame(true, opText, []byte("hi"), false), mkFrame(true, opText, []byte("masked"), true)), 3, 0, true},
		{[]byte("\x88"), 0, 0, false},
	}
}

// FuzzRelayForwardsAPrefix feeds arbitrary bytes from one side through one
// direction of a relay and holds what reaches the other side, and what goes
// back, to the oracle: the frames up to the first close frame, broken rule
// or end, forwarded byte for byte, then at most the relay's own close frame
// with the right code; the byte and message counts match.
//
// It drives the relay's own pump synchronously over in-memory connections,
// with the handshake's read-ahead and the size of each read fuzzed too: a
// loopback TCP pair, the other direction's goroutine and the close wait
// cost some 70 ms an execution, which kept this target far from 10^7.
// TestRelayForwardsAPrefixOverTCP runs the seeds through real sockets.
func FuzzRelayForwardsAPrefix(f *testing.F) {
	for _, s := range relaySeeds() {
		f.Add(s.in, s.early, s.chunk, s.fromGuest)
	}
	f.Fuzz(func(t *testing.T, in []byte, early uint16, chunk uint8, fromGuest bool) {
		split := min(int(early), len(in))
		src := &memConn{in: in[split:], chunk: int(chunk)}
		dst := &memConn{}
		client, guest, side := net.Conn(src), net.Conn(dst), 0
		var clientEarly, guestEarly []byte
		if fromGuest {
			client, guest, side = dst, src, 1
			guestEarly = bytes.Clone(in[:split])
		} else {
			clientEarly = bytes.Clone(in[:split])
		}
		bytesFwd, msgsFwd := &countingCounter{}, &countingCounter{}
		m := &Metrics{}
		m.bytes[side], m.messages[side] = bytesFwd, msgsFwd
		cfg := relayConfig{maxMessage: fuzzMessageLimit, idle: time.Hour, closeWait: time.Hour, lockWait: time.Hour}
		r := newRelay("inst", client, guest, clientEarly, guestEarly, cfg, m, nil)
		if fromGuest {
			r.pump(r.guest, r.client, side)
		} else {
			r.pump(r.client, r.guest, side)
		}
		r.mu.Lock()
		reason := r.reason
		r.mu.Unlock()
		r.finish("fuzz")

		want := checkRelayed(t, in, dst.out.Bytes(), src.out.Bytes(), !fromGuest)
		if reason != want.reason {
			t.Fatalf("the relay's reason is %q; want %q", reason, want.reason)
		}
		relayed := dst.out.Len()
		if want.toDst != 0 {
			relayed = want.forwarded
		}
		if bytesFwd.n != float64(relayed) || msgsFwd.n != float64(want.messages) {
			t.Fatalf("counted %v bytes and %v messages; relayed %d bytes and %d messages", bytesFwd.n, msgsFwd.n, relayed, want.messages)
		}
	})
}

// TestRelayForwardsAPrefixOverTCP runs the fuzz seeds through a whole relay
// on loopback sockets, both pumps running and large frames spliced by the
// kernel, against the same oracle.
func TestRelayForwardsAPrefixOverTCP(t *testing.T) {
	for i, s := range relaySeeds() {
		cfg := testRelayConfig()
		cfg.maxMessage = fuzzMessageLimit
		cfg.closeWait = 50 * time.Millisecond
		rig := newRig(t, cfg, nil, nil)
		src, dst := rig.runtime, rig.guest
		if s.fromGuest {
			src, dst = rig.guest, rig.runtime
		}
		toSrc := make(chan []byte, 1)
		go func() {
			_ = src.SetReadDeadline(time.Now().Add(10 * time.Second))
			b, _ := io.ReadAll(src)
			toSrc <- b
		}()
		go func() {
			_, _ = src.Write(s.in)
			_ = src.(*net.TCPConn).CloseWrite()
		}()
		_ = dst.SetReadDeadline(time.Now().Add(10 * time.Second))
		got, err := io.ReadAll(dst)
		if err != nil {
			t.Fatalf("seed %d: read: %v", i, err)
		}
		checkRelayed(t, s.in, got, <-toSrc, !s.fromGuest)
	}
}
