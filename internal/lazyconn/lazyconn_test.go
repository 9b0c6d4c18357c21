package lazyconn_test

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/lazyconn"
)

// server is a unix socket that counts its connections and echoes what
// each one sends.
type server struct {
	path     string
	accepted atomic.Int64
}

func newServer(t *testing.T) *server {
	t.Helper()
	s := &server{path: filepath.Join(t.TempDir(), "s.sock")}
	ln, err := net.Listen("unix", s.path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			wg.Go(func() { defer c.Close(); _, _ = io.Copy(c, c) })
		}
	})
	return s
}

func (s *server) conn(dials *atomic.Int64) *lazyconn.Conn {
	return lazyconn.New(&net.UnixAddr{Name: s.path, Net: "unix"}, func() (net.Conn, error) {
		dials.Add(1)
		return net.DialTimeout("unix", s.path, 2*time.Second)
	})
}

func TestNoDialBeforeTheFirstWrite(t *testing.T) {
	s := newServer(t)
	var dials atomic.Int64
	c := s.conn(&dials)
	// A reader waiting for the dial (as the transport's read loop does) must
	// not make it.
	readErr := make(chan error, 1)
	go func() { _, err := c.Read(make([]byte, 1)); readErr <- err }()
	time.Sleep(50 * time.Millisecond)
	if n := dials.Load(); n != 0 {
		t.Fatalf("%d dials before any write", n)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-readErr:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("read after close: %v, want net.ErrClosed", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a read waiting for the dial outlived Close")
	}
	if n, err := c.Write([]byte("x")); n != 0 || !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %d, %v", n, err)
	}
	if d, a := dials.Load(), s.accepted.Load(); d != 0 || a != 0 {
		t.Fatalf("closed before any write: %d dials, %d accepted; want none", d, a)
	}
}

func TestFirstWriteDialsOnceAndReadsFollow(t *testing.T) {
	s := newServer(t)
	var dials atomic.Int64
	c := s.conn(&dials)
	defer c.Close()
	got := make(chan string, 1)
	go func() {
		b := make([]byte, 64)
		n, err := io.ReadAtLeast(c, b, 8*4)
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(b[:n])
	}()
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if _, err := c.Write([]byte("12345678")); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	select {
	case echo := <-got:
		if echo != strings.Repeat("12345678", 4) {
			t.Fatalf("echo %q", echo)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no echo")
	}
	if d, a := dials.Load(), s.accepted.Load(); d != 1 || a != 1 {
		t.Fatalf("four writes made %d dials and %d accepted connections, want 1 and 1", d, a)
	}
}

func TestAFailedDialIsTheWritesErrorAndTheReads(t *testing.T) {
	refused := errors.New("refused")
	c := lazyconn.New(&net.UnixAddr{Name: "/nowhere", Net: "unix"}, func() (net.Conn, error) { return nil, refused })
	if n, err := c.Write([]byte("x")); n != 0 || !errors.Is(err, refused) {
		t.Fatalf("write: %d, %v; want 0, the dial's error", n, err)
	}
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, refused) {
		t.Fatalf("read: %v, want the dial's error", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestAReadWaitingForTheDialHonoursItsDeadline(t *testing.T) {
	s := newServer(t)
	var dials atomic.Int64
	c := s.conn(&dials)
	defer c.Close()
	if err := c.SetReadDeadline(time.Now().Add(30 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := c.Read(make([]byte, 1))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read: %v, want os.ErrDeadlineExceeded", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("read returned after %v", took)
	}
}

func TestCloseDuringTheDialClosesWhatItMade(t *testing.T) {
	s := newServer(t)
	release := make(chan struct{})
	var made net.Conn
	c := lazyconn.New(&net.UnixAddr{Name: s.path, Net: "unix"}, func() (net.Conn, error) {
		<-release
		conn, err := net.DialTimeout("unix", s.path, 2*time.Second)
		made = conn
		return conn, err
	})
	writeErr := make(chan error, 1)
	go func() { _, err := c.Write([]byte("x")); writeErr <- err }()
	time.Sleep(20 * time.Millisecond)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-writeErr; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write closed during its dial: %v, want net.ErrClosed", err)
	}
	if made == nil {
		t.Fatal("the dial made no connection")
	}
	if _, err := made.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the connection made after Close is still open (write: %v)", err)
	}
}

// BenchmarkRoundTrip is one small write and its echo through a Conn
// already made, against the bare connection in the same run: what the
// lazy dial costs each call once it is done.
func BenchmarkRoundTrip(b *testing.B) {
	for _, lazy := range []bool{false, true} {
		name := map[bool]string{false: "bare", true: "lazy"}[lazy]
		b.Run(name, func(b *testing.B) {
			client, server := net.Pipe()
			defer func() { _ = client.Close() }()
			go func() {
				buf := make([]byte, 64)
				for {
					n, err := server.Read(buf)
					if err != nil {
						return
					}
					if _, err := server.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
			conns := map[bool]net.Conn{false: client,
				true: lazyconn.New(client.RemoteAddr(), func() (net.Conn, error) { return client, nil })}
			c := conns[lazy]
			msg, buf := []byte("ping"), make([]byte, 64)
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, buf[:len(msg)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
