package routes

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/wsframe"
	"github.com/lightspeed-dev/incus-provider/internal/wsframe/wsframetest"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// tcpPair is a connected pair of loopback TCP connections.
func tcpPair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b := <-accepted
	if b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// readFrame reads one frame from c and returns its header, its unmasked
// payload and its raw bytes.
func readFrame(t testing.TB, c net.Conn) (wsframe.Header, []byte, []byte) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	raw := make([]byte, 2, wsframe.MaxHeaderBytes)
	if _, err := io.ReadFull(c, raw); err != nil {
		t.Fatalf("read frame header: %v", err)
	}
	h, need, err := wsframe.ParseHeader(raw)
	if err != nil {
		t.Fatal(err)
	}
	if need > 0 {
		raw = raw[:need]
		if _, err := io.ReadFull(c, raw[2:]); err != nil {
			t.Fatalf("read frame header: %v", err)
		}
		if h, _, err = wsframe.ParseHeader(raw); err != nil {
			t.Fatal(err)
		}
	}
	payload := make([]byte, h.Length)
	if _, err := io.ReadFull(c, payload); err != nil {
		t.Fatalf("read frame payload: %v", err)
	}
	raw = append(raw, payload...)
	if h.Masked {
		key := raw[h.Size-4 : h.Size]
		for i := range payload {
			payload[i] ^= key[i%4]
		}
	}
	return h, payload, raw
}

func closeCode(t testing.TB, h wsframe.Header, payload []byte) (int, string) {
	t.Helper()
	if h.Op != wsframe.OpClose {
		t.Fatalf("got opcode %#x, want a close frame", h.Op)
	}
	if len(payload) < 2 {
		return 0, ""
	}
	return int(binary.BigEndian.Uint16(payload)), string(payload[2:])
}

// expectEOF checks that the relay closed its end of c.
func expectEOF(t testing.TB, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var b [1]byte
	n, err := c.Read(b[:])
	if n != 0 || err == nil {
		t.Fatalf("expected the relay to close the connection, read %d bytes, %v", n, err)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("the relay did not close the connection")
	}
}

type relayRig struct {
	runtime net.Conn // the test's runtime end
	guest   net.Conn // the test's daemon end
	relay   *Relay
	metrics *Metrics
	ended   chan string
}

func testRelayConfig() relayConfig {
	return relayConfig{maxMessage: 16 << 20, idle: time.Minute, closeWait: time.Second, lockWait: time.Second}
}

func newRig(t testing.TB, cfg relayConfig, runtimeEarly, guestEarly []byte) *relayRig {
	rt, rtRelay := tcpPair(t)
	gRelay, g := tcpPair(t)
	m := newMetrics()
	rig := &relayRig{runtime: rt, guest: g, metrics: m, ended: make(chan string, 1)}
	rig.relay = newRelay("inst", rtRelay, gRelay, runtimeEarly, guestEarly, cfg, m, func(r *Relay) { rig.ended <- r.Reason() })
	rig.relay.start()
	t.Cleanup(func() { rig.relay.finish("test"); <-rig.relay.Done() })
	return rig
}

func (rig *relayRig) waitEnd(t testing.TB) string {
	t.Helper()
	select {
	case why := <-rig.ended:
		return why
	case <-time.After(15 * time.Second):
		t.Fatal("the relay did not end")
		return ""
	}
}

func write(t testing.TB, c net.Conn, b []byte) {
	t.Helper()
	go func() { _, _ = c.Write(b) }()
}

func TestRelayForwardsFramesByteExact(t *testing.T) {
	rig := newRig(t, testRelayConfig(), nil, nil)
	big := make([]byte, 3<<20)
	_, _ = rand.Read(big)
	mid := make([]byte, 100<<10)
	_, _ = rand.Read(mid)
	// Client frames are masked and must reach the daemon unchanged (the
	// same masking key and masked bytes); server frames unmasked.
	for _, masked := range []bool{true, false} {
		src, dst := rig.runtime, rig.guest
		if !masked {
			src, dst = rig.guest, rig.runtime
		}
		frames := [][]byte{
			wsframetest.Frame(true, wsframe.OpText, []byte(`{"jsonrpc":"2.0","id":1,"method":"initialize"}`), masked),
			wsframetest.Frame(true, wsframe.OpText, nil, masked),
			wsframetest.Frame(true, wsframe.OpText, bytes.Repeat([]byte("x"), 125), masked),
			wsframetest.Frame(true, wsframe.OpText, bytes.Repeat([]byte("y"), 126), masked),
			wsframetest.Frame(true, wsframe.OpText, bytes.Repeat([]byte("z"), 3000), masked), // over the inline buffer
			wsframetest.Frame(true, wsframe.OpBinary, mid, masked),
			wsframetest.Frame(true, wsframe.OpPing, []byte("are you there"), masked),
			wsframetest.Frame(true, wsframe.OpPong, []byte("here"), masked),
			// A fragmented message with a ping between its fragments.
			wsframetest.Frame(false, wsframe.OpText, []byte("frag-1 "), masked),
			wsframetest.Frame(true, wsframe.OpPing, nil, masked),
			wsframetest.Frame(false, wsframe.OpContinuation, big[:1<<20], masked),
			wsframetest.Frame(true, wsframe.OpContinuation, big[1<<20:], masked),
			wsframetest.Frame(true, wsframe.OpText, big[:64], masked),
		}
		var all []byte
		for _, f := range frames {
			all = append(all, f...)
		}
		// Written in odd-sized pieces, so frames straddle reads.
		go func() {
			for rest := all; len(rest) > 0; {
				n := min(len(rest), 777)
				if len(rest) > 8<<10 && len(rest)%3 == 0 {
					n = min(len(rest), 200<<10)
				}
				if _, err := src.Write(rest[:n]); err != nil {
					return
				}
				rest = rest[n:]
			}
		}()
		for i, want := range frames {
			_, _, got := readFrame(t, dst)
			if !bytes.Equal(got, want) {
				t.Fatalf("masked=%v: frame %d arrived changed (%d bytes, want %d)", masked, i, len(got), len(want))
			}
		}
	}
	// Counted: every byte, and the data messages (eight each way: seven
	// unfragmented, one in fragments; pings and pongs are not messages).
	// A pump counts what it wrote after the write, so the last frame's
	// reader may see it before its count: wait a bounded time.
	for deadline := time.Now().Add(5 * time.Second); value(rig.metrics.messages[1]) != 8 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if got := value(rig.metrics.messages[0]); got != 8 {
		t.Errorf("messages to the guest: %v, want 8", got)
	}
	if got := value(rig.metrics.messages[1]); got != 8 {
		t.Errorf("messages to the runtime: %v, want 8", got)
	}
	if value(rig.metrics.bytes[0]) < float64(len(big)) || value(rig.metrics.bytes[1]) < float64(len(big)) {
		t.Error("relayed bytes not counted")
	}
}

func TestRelayForwardsEarlyBytes(t *testing.T) {
	// Bytes each side sent right after its handshake, read along with it,
	// are forwarded before anything else: small and larger than the inline
	// buffer.
	runtimeEarly := append(wsframetest.Frame(true, wsframe.OpText, []byte("early from runtime"), true), wsframetest.Frame(false, wsframe.OpText, bytes.Repeat([]byte("r"), 5000), true)...)
	guestEarly := wsframetest.Frame(true, wsframe.OpText, []byte("early from guest"), false)
	rig := newRig(t, testRelayConfig(), runtimeEarly, guestEarly)
	write(t, rig.runtime, wsframetest.Frame(true, wsframe.OpContinuation, []byte("end"), true))
	_, p, _ := readFrame(t, rig.guest)
	if string(p) != "early from runtime" {
		t.Fatalf("guest got %q", p)
	}
	_, p, _ = readFrame(t, rig.guest)
	if len(p) != 5000 {
		t.Fatalf("guest got %d bytes", len(p))
	}
	_, p, _ = readFrame(t, rig.guest)
	if string(p) != "end" {
		t.Fatalf("guest got %q", p)
	}
	_, p, _ = readFrame(t, rig.runtime)
	if string(p) != "early from guest" {
		t.Fatalf("runtime got %q", p)
	}
}

func TestRelayClosePropagation(t *testing.T) {
	t.Run("runtime closes", func(t *testing.T) {
		rig := newRig(t, testRelayConfig(), nil, nil)
		closing := wsframetest.Frame(true, wsframe.OpClose, append([]byte{0x03, 0xe8}, "bye"...), true)
		write(t, rig.runtime, closing)
		_, _, raw := readFrame(t, rig.guest)
		if !bytes.Equal(raw, closing) {
			t.Fatal("the runtime's close frame did not reach the daemon unchanged")
		}
		// The daemon answers; the relay forwards and closes both.
		answer := wsframetest.Frame(true, wsframe.OpClose, []byte{0x03, 0xe8}, false)
		write(t, rig.guest, answer)
		_, _, raw = readFrame(t, rig.runtime)
		if !bytes.Equal(raw, answer) {
			t.Fatal("the daemon's close answer did not reach the runtime unchanged")
		}
		expectEOF(t, rig.runtime)
		expectEOF(t, rig.guest)
		if why := rig.waitEnd(t); why != "normal" {
			t.Fatalf("ended %q", why)
		}
	})
	t.Run("daemon closes", func(t *testing.T) {
		rig := newRig(t, testRelayConfig(), nil, nil)
		closing := wsframetest.Frame(true, wsframe.OpClose, append([]byte{0x03, 0xe9}, "going"...), false)
		write(t, rig.guest, closing)
		h, p, raw := readFrame(t, rig.runtime)
		if !bytes.Equal(raw, closing) {
			t.Fatal("the daemon's close frame did not reach the runtime unchanged")
		}
		if code, _ := closeCode(t, h, p); code != CloseGoingAway {
			t.Fatalf("code %d", code)
		}
		write(t, rig.runtime, wsframetest.Frame(true, wsframe.OpClose, []byte{0x03, 0xe9}, true))
		readFrame(t, rig.guest)
		expectEOF(t, rig.runtime)
		expectEOF(t, rig.guest)
	})
	t.Run("runtime vanishes", func(t *testing.T) {
		rig := newRig(t, testRelayConfig(), nil, nil)
		rig.runtime.Close()
		h, p, _ := readFrame(t, rig.guest)
		if !h.Masked {
			t.Fatal("a close frame to the daemon must be masked")
		}
		if code, _ := closeCode(t, h, p); code != CloseGoingAway {
			t.Fatalf("code %d, want 1001", code)
		}
		write(t, rig.guest, wsframetest.Frame(true, wsframe.OpClose, []byte{0x03, 0xe9}, false))
		expectEOF(t, rig.guest)
		if why := rig.waitEnd(t); why != "peer_gone" {
			t.Fatalf("ended %q", why)
		}
	})
	t.Run("daemon vanishes", func(t *testing.T) {
		rig := newRig(t, testRelayConfig(), nil, nil)
		rig.guest.Close()
		h, p, _ := readFrame(t, rig.runtime)
		if h.Masked {
			t.Fatal("a close frame to the runtime must not be masked")
		}
		if code, _ := closeCode(t, h, p); code != CloseGoingAway {
			t.Fatalf("code %d, want 1001", code)
		}
		// The runtime does not answer: the relay closes after its close wait.
		start := time.Now()
		expectEOF(t, rig.runtime)
		if time.Since(start) > 5*time.Second {
			t.Fatal("close wait not bounded")
		}
	})
	t.Run("go away", func(t *testing.T) {
		rig := newRig(t, testRelayConfig(), nil, nil)
		go rig.relay.GoAway(CloseGoingAway, "the target is powering down", "power_down")
		h, p, _ := readFrame(t, rig.runtime)
		if code, reason := closeCode(t, h, p); code != CloseGoingAway || reason != "the target is powering down" {
			t.Fatalf("runtime got %d %q", code, reason)
		}
		h, p, _ = readFrame(t, rig.guest)
		if code, _ := closeCode(t, h, p); code != CloseGoingAway || !h.Masked {
			t.Fatalf("daemon got %d (masked %v)", code, h.Masked)
		}
		write(t, rig.runtime, wsframetest.Frame(true, wsframe.OpClose, []byte{0x03, 0xe9}, true))
		write(t, rig.guest, wsframetest.Frame(true, wsframe.OpClose, []byte{0x03, 0xe9}, false))
		expectEOF(t, rig.runtime)
		expectEOF(t, rig.guest)
		if why := rig.waitEnd(t); why != "power_down" {
			t.Fatalf("ended %q", why)
		}
	})
}

func TestRelayMessageLimit(t *testing.T) {
	const limit = 16 << 20
	for _, fromRuntime := range []bool{true, false} {
		name := "to the daemon"
		if !fromRuntime {
			name = "to the runtime"
		}
		t.Run(name+": exactly the limit passes", func(t *testing.T) {
			rig := newRig(t, testRelayConfig(), nil, nil)
			src, dst := rig.runtime, rig.guest
			if !fromRuntime {
				src, dst = rig.guest, rig.runtime
			}
			payload := make([]byte, limit)
			// One message of exactly 16 MiB in three fragments.
			write(t, src, bytes.Join([][]byte{
				wsframetest.Frame(false, wsframe.OpBinary, payload[:1<<20], fromRuntime),
				wsframetest.Frame(false, wsframe.OpContinuation, payload[1<<20:10<<20], fromRuntime),
				wsframetest.Frame(true, wsframe.OpContinuation, payload[10<<20:], fromRuntime),
			}, nil))
			total := 0
			for total < limit {
				_, p, _ := readFrame(t, dst)
				total += len(p)
			}
			if total != limit {
				t.Fatalf("forwarded %d bytes", total)
			}
		})
		for _, fragmented := range []bool{false, true} {
			label := "one frame"
			if fragmented {
				label = "fragments"
			}
			t.Run(name+": over the limit in "+label, func(t *testing.T) {
				rig := newRig(t, testRelayConfig(), nil, nil)
				src, dst := rig.runtime, rig.guest
				if !fromRuntime {
					src, dst = rig.guest, rig.runtime
				}
				if fragmented {
					first := make([]byte, 10<<20)
					write(t, src, append(wsframetest.Frame(false, wsframe.OpText, first, fromRuntime),
						wsframetest.Frame(true, wsframe.OpContinuation, make([]byte, limit-len(first)+1), fromRuntime)...))
					// The first fragment was within the limit and went through.
					if _, p, _ := readFrame(t, dst); len(p) != len(first) {
						t.Fatalf("first fragment: %d bytes", len(p))
					}
				} else {
					// Only the header: the relay must refuse on the length alone.
					hdr := wsframetest.Frame(true, wsframe.OpBinary, nil, fromRuntime)
					hdr[1] = hdr[1]&0x80 | 127
					var l [8]byte
					binary.BigEndian.PutUint64(l[:], limit+1)
					hdr = append(hdr[:2], append(l[:], hdr[2:]...)...)
					write(t, src, hdr)
				}
				// Both sides get 1009, the daemon's masked.
				for _, c := range []net.Conn{src, dst} {
					h, p, _ := readFrame(t, c)
					if code, _ := closeCode(t, h, p); code != CloseTooBig {
						t.Fatalf("close code %d, want 1009", code)
					}
					if h.Masked != (c == rig.guest) {
						t.Fatalf("close frame masking wrong (masked=%v)", h.Masked)
					}
				}
				if why := rig.waitEnd(t); why != "too_big" {
					t.Fatalf("ended %q", why)
				}
			})
		}
	}
}

func TestRelayProtocolErrors(t *testing.T) {
	cases := []struct {
		name        string
		fromRuntime bool
		frame       []byte
	}{
		{"unmasked client frame", true, wsframetest.Frame(true, wsframe.OpText, []byte("x"), false)},
		{"masked server frame", false, wsframetest.Frame(true, wsframe.OpText, []byte("x"), true)},
		{"reserved bit (compression was not negotiated)", true, func() []byte { f := wsframetest.Frame(true, wsframe.OpText, []byte("x"), true); f[0] |= 0x40; return f }()},
		{"unknown opcode", false, wsframetest.Frame(true, 0x3, nil, false)},
		{"long control frame", true, wsframetest.Frame(true, wsframe.OpPing, make([]byte, 126), true)},
		{"fragmented control frame", false, wsframetest.Frame(false, wsframe.OpPing, nil, false)},
		{"stray continuation", true, wsframetest.Frame(true, wsframe.OpContinuation, []byte("x"), true)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rig := newRig(t, testRelayConfig(), nil, nil)
			src, dst := rig.runtime, rig.guest
			if !c.fromRuntime {
				src, dst = rig.guest, rig.runtime
			}
			write(t, src, c.frame)
			for _, conn := range []net.Conn{dst, src} {
				h, p, _ := readFrame(t, conn)
				if code, _ := closeCode(t, h, p); code != CloseProtocolError {
					t.Fatalf("close code %d, want 1002", code)
				}
			}
			if why := rig.waitEnd(t); why != "protocol_error" {
				t.Fatalf("ended %q", why)
			}
		})
	}
}

func TestRelayIdle(t *testing.T) {
	cfg := testRelayConfig()
	cfg.idle = 400 * time.Millisecond
	t.Run("an idle relay closes, not sooner than its timeout", func(t *testing.T) {
		// The relay's idle clock starts when the rig starts it: measured
		// from after that, the close may come a moment before the timeout.
		start := time.Now()
		rig := newRig(t, cfg, nil, nil)
		h, p, _ := readFrame(t, rig.runtime)
		if code, reason := closeCode(t, h, p); code != CloseGoingAway || reason != "idle timeout" {
			t.Fatalf("got %d %q", code, reason)
		}
		if d := time.Since(start); d < cfg.idle {
			t.Fatalf("closed after %s, sooner than the idle timeout %s", d, cfg.idle)
		}
		if why := rig.waitEnd(t); why != "idle" {
			t.Fatalf("ended %q", why)
		}
	})
	t.Run("pings and pongs are activity", func(t *testing.T) {
		rig := newRig(t, cfg, nil, nil)
		var wg sync.WaitGroup
		wg.Add(1)
		stop := make(chan struct{})
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
				if _, err := rig.runtime.Write(wsframetest.Frame(true, wsframe.OpPing, nil, true)); err != nil {
					return
				}
			}
		}()
		deadline := time.Now().Add(3 * cfg.idle)
		for time.Now().Before(deadline) {
			h, _, _ := readFrame(t, rig.guest)
			if h.Op != wsframe.OpPing {
				t.Fatalf("daemon got opcode %#x, want only pings", h.Op)
			}
		}
		close(stop)
		wg.Wait()
		if r := rig.relay.Reason(); r != "" {
			t.Fatalf("relay ended (%s) although it carried pings", r)
		}
	})
}

func TestNewRefusesIdleBelowFloor(t *testing.T) {
	reg := relays.New(0)
	wk, err := wake.New(t.Context(), wake.Options{Targets: &fakeTargets{}, Dialer: &loopDialer{}, Relays: reg})
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(t.Context(), Options{Targets: &fakeTargets{}, Wake: wk, Dialer: &loopDialer{}, Relays: reg, IdleTimeout: 59 * time.Second})
	if err == nil {
		t.Fatal("an idle timeout below 60 s was accepted")
	}
	if _, err := New(t.Context(), Options{Targets: &fakeTargets{}, Wake: wk, Dialer: &loopDialer{}, Relays: reg, Hold: 6 * time.Second}); err == nil {
		t.Fatal("a hold over 5 s was accepted")
	}
	if _, err := New(t.Context(), Options{Targets: &fakeTargets{}, Dialer: &loopDialer{}, Relays: reg}); err == nil {
		t.Fatal("data routes without a wake were accepted")
	}
	h, err := New(t.Context(), Options{Targets: &fakeTargets{}, Wake: wk, Dialer: &loopDialer{}, Relays: reg})
	if err != nil {
		t.Fatal(err)
	}
	if h.relay.idle != MinIdleTimeout || h.opts.Hold != MaxHold {
		t.Fatalf("defaults: idle %s, hold %s", h.relay.idle, h.opts.Hold)
	}
}
