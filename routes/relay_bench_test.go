package routes

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/wsframe"
	"github.com/lightspeed-dev/incus-provider/internal/wsframe/wsframetest"
)

// echo serves one connection: every masked frame comes back unmasked.
func echo(t testing.TB, c net.Conn) {
	go func() {
		buf := make([]byte, 0, 1<<20)
		for {
			hdr := make([]byte, 2, wsframe.MaxHeaderBytes)
			if _, err := io.ReadFull(c, hdr); err != nil {
				return
			}
			h, need, _ := wsframe.ParseHeader(hdr)
			if need > 0 {
				hdr = hdr[:need]
				if _, err := io.ReadFull(c, hdr[2:]); err != nil {
					return
				}
				h, _, _ = wsframe.ParseHeader(hdr)
			}
			buf = buf[:h.Length]
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if h.Masked {
				key := hdr[h.Size-4 : h.Size]
				for i := range buf {
					buf[i] ^= key[i%4]
				}
			}
			if _, err := c.Write(wsframetest.Frame(true, h.Op, buf, false)); err != nil {
				return
			}
		}
	}()
}

func roundTrip(b *testing.B, c net.Conn, size int) {
	msg := wsframetest.Frame(true, wsframe.OpText, make([]byte, size), true)
	reply := make([]byte, len(msg)-4)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for b.Loop() {
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, reply); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRoundTrip compares one frame's round trip to an echo peer:
// direct, through the relay, and through a plain byte-copying proxy that
// reads no headers at all (the floor any relay can reach).
func BenchmarkRoundTrip(b *testing.B) {
	for _, size := range []int{64, 64 << 10, 1 << 20} {
		b.Run("direct/"+sizeName(size), func(b *testing.B) {
			client, server := tcpPair(b)
			echo(b, server)
			roundTrip(b, client, size)
		})
		b.Run("relay/"+sizeName(size), func(b *testing.B) {
			client, rt := tcpPair(b)
			g, server := tcpPair(b)
			echo(b, server)
			r := newRelay("bench", rt, g, nil, nil, relayConfig{maxMessage: 16 << 20, idle: time.Minute, closeWait: time.Second, lockWait: time.Second}, nil, nil)
			r.start()
			defer r.finish("")
			roundTrip(b, client, size)
		})
		b.Run("copy-proxy/"+sizeName(size), func(b *testing.B) {
			client, rt := tcpPair(b)
			g, server := tcpPair(b)
			echo(b, server)
			go func() { _, _ = io.Copy(g, rt) }()
			go func() { _, _ = io.Copy(rt, g) }()
			roundTrip(b, client, size)
		})
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return "1MiB"
	case n >= 1<<10:
		return "64KiB"
	}
	return "64B"
}

// BenchmarkStream measures one direction's throughput for a daemon that
// writes each large message as 64 KiB frames (as gorilla/websocket does),
// and for a runtime that sends each message as one frame.
func BenchmarkStream(b *testing.B) {
	for _, c := range []struct {
		name  string
		frame int
	}{{"64KiB-frames", 64 << 10}, {"1MiB-frames", 1 << 20}} {
		frame := wsframetest.Frame(false, wsframe.OpContinuation, make([]byte, c.frame), false)
		run := func(b *testing.B, reader, writer net.Conn) {
			b.SetBytes(int64(len(frame)))
			go func() {
				for {
					if _, err := writer.Write(frame); err != nil {
						return
					}
				}
			}()
			buf := make([]byte, 256<<10)
			b.ResetTimer()
			want := int64(b.N) * int64(len(frame))
			for got := int64(0); got < want; {
				n, err := reader.Read(buf)
				if err != nil {
					b.Fatal(err)
				}
				got += int64(n)
			}
		}
		b.Run("direct/"+c.name, func(b *testing.B) {
			client, server := tcpPair(b)
			run(b, client, server)
		})
		b.Run("relay/"+c.name, func(b *testing.B) {
			client, rt := tcpPair(b)
			g, server := tcpPair(b)
			// A first text frame opens the message the continuations extend.
			if _, err := server.Write(wsframetest.Frame(false, wsframe.OpText, nil, false)); err != nil {
				b.Fatal(err)
			}
			r := newRelay("bench", rt, g, nil, nil, relayConfig{maxMessage: 1 << 62, idle: time.Minute, closeWait: time.Second, lockWait: time.Second}, nil, nil)
			r.start()
			defer r.finish("")
			var first [2]byte
			if _, err := io.ReadFull(client, first[:]); err != nil {
				b.Fatal(err)
			}
			run(b, client, server)
		})
		b.Run("copy-proxy/"+c.name, func(b *testing.B) {
			client, rt := tcpPair(b)
			g, server := tcpPair(b)
			go func() { _, _ = io.Copy(rt, g) }()
			run(b, client, server)
		})
	}
}
