package routes

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/internal/wsframe"
	"github.com/lightspeed-dev/incus-provider/internal/wsframe/wsframetest"
)

// The relay is held to wsframetest's oracle, which reads frames its own way,
// byte by byte from RFC 6455 and the relay's rules, rather than through
// internal/wsframe, which the relay itself uses.

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
		rules  wsframetest.Rules
		closed bool
	)
	for off := 0; ; {
		h := wsframetest.Parse(in[off:])
		if !h.Whole {
			break
		}
		code, ends := rules.Step(h, fromClient, limit)
		if code != 0 {
			o.toSrc = code
			if !closed {
				o.toDst = code
			}
			o.reason = "protocol_error"
			if code == wsframetest.CloseTooBig {
				o.reason = "too_big"
			}
			return o
		}
		if uint64(len(in)-off-h.Size) < h.Length {
			if closed {
				return o
			}
			if h.Op != wsframe.OpClose {
				o.cutHeader = h.Size
				o.reason = "peer_gone"
				return o
			}
			break // a close frame is forwarded only whole
		}
		off += h.Size + int(h.Length)
		if closed {
			continue
		}
		o.forwarded = off
		closed = h.Op == wsframe.OpClose
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
	h := wsframetest.Parse(b)
	if !h.Whole || !h.Fin || h.RSV != 0 || h.Op != wsframe.OpClose || h.Masked != masked || uint64(len(b)-h.Size) != h.Length || h.Length < 2 || h.Length > 125 {
		t.Fatalf("%s: %x is not one close frame (masked %v)", what, b, masked)
	}
	p := bytes.Clone(b[h.Size:])
	if masked {
		key := b[h.Size-4 : h.Size]
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
		{wsframetest.Frame(true, wsframe.OpText, []byte("hello"), true), 0, 0, false},
		{cat(wsframetest.Frame(false, wsframe.OpText, []byte("a"), true), wsframetest.Frame(true, wsframe.OpPing, nil, true), wsframetest.Frame(true, wsframe.OpContinuation, []byte("b"), true)), 0, 3, false},
		{cat(wsframetest.Frame(true, wsframe.OpPing, nil, true), wsframetest.Frame(true, wsframe.OpText, []byte("x"), false)), 0, 0, false},
		{append(wsframetest.Frame(true, wsframe.OpText, make([]byte, 3000), true), 0x81, 0xfe), 0, 0, false},
		{wsframetest.Frame(true, wsframe.OpClose, []byte{3, 232}, true), 0, 0, false},
		{cat(wsframetest.Frame(true, wsframe.OpClose, []byte{3, 232}, true), wsframetest.Frame(true, wsframe.OpText, []byte("dropped"), true), []byte{0x83, 0x80, 1, 2, 3, 4}), 0, 1, false},
		{wsframetest.Frame(true, wsframe.OpBinary, big, true), 0, 100, false},
		{cat(wsframetest.Frame(false, wsframe.OpBinary, big[:4000], true), wsframetest.Frame(true, wsframe.OpContinuation, big[:3000], true)), 0, 0, false},
		{wsframetest.Frame(true, wsframe.OpBinary, big, true)[:2500], 0, 0, false},
		{wsframetest.Frame(true, wsframe.OpText, big[:40], true)[:30], 0, 7, false},
		{cat(wsframetest.Frame(true, wsframe.OpBinary, big[:3000], true), wsframetest.Frame(true, wsframe.OpText, []byte("after"), true)), 2500, 0, false},
		{cat(wsframetest.Frame(true, wsframe.OpText, []byte("hi"), false), wsframetest.Frame(true, wsframe.OpClose, []byte{3, 232}, false)), 0, 0, true},
		{cat(wsframetest.Frame(true, wsframe.OpText, []byte("hi"), false), wsframetest.Frame(true, wsframe.OpText, []byte("masked"), true)), 3, 0, true},
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
