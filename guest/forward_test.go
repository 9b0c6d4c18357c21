package guest

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeGuests is the forwarding server's local dialer in these tests: a
// loopback echo daemon stands for every guest, and a few instance names
// answer as the real dialers would for a stopped guest or one on another
// member.
type fakeGuests struct {
	addr  string
	mu    sync.Mutex
	dials map[string]int
}

func (f *fakeGuests) Name() string                                { return "fake" }
func (f *fakeGuests) Devices(Target) map[string]map[string]string { return nil }
func (f *fakeGuests) Forget(string)                               {}

func (f *fakeGuests) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	f.mu.Lock()
	f.dials[t.Instance]++
	f.mu.Unlock()
	switch t.Instance {
	case "stopped":
		return nil, fmt.Errorf("fake: %s: %w", t, ErrNotRunning)
	case "moved":
		return nil, fmt.Errorf("fake: %s: %w", t, ErrNotOnMember)
	case "refusing":
		return nil, fmt.Errorf("fake: %s: connection refused", t)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", f.addr)
}

func (f *fakeGuests) count(instance string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.dials[instance]
}

// echoDaemon answers each connection with "echo:" and what it read until
// the client half-closed, then closes: the half-close must cross both hops.
func echoDaemon(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	acceptEach(t, ln, func(c net.Conn) {
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		in, _ := io.ReadAll(c)
		_, _ = c.Write(append([]byte("echo:"), in...))
	})
	return ln.Addr().String()
}

// recordingFallback stands for exec.
type recordingFallback struct {
	fakeGuests
}

func (r *recordingFallback) Name() string { return "fallback" }

// DialContext reaches every guest, wherever it is, as exec does.
func (r *recordingFallback) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	r.mu.Lock()
	r.dials[t.Instance]++
	r.mu.Unlock()
	var d net.Dialer
	return d.DialContext(ctx, "tcp", r.addr)
}

type observed struct {
	mu     sync.Mutex
	events []string
}

func (o *observed) client(member, outcome string, reason error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s := member + " " + outcome
	if reason != nil {
		s += ": " + reason.Error()
	}
	o.events = append(o.events, s)
}

func (o *observed) server(outcome string, reason error) { o.client("server", outcome, reason) }

func (o *observed) all() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return strings.Join(o.events, "\n")
}

var secretA = bytes.Repeat([]byte("a"), MinForwardSecret)

// acceptEach serves each connection ln accepts with serve, on a goroutine
// of its own, and closes it after; ln is closed when the test ends.
func acceptEach(t *testing.T, ln net.Listener, serve func(net.Conn)) {
	t.Helper()
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				serve(c)
			}()
		}
	}()
}

// startForwardServer serves a ForwardServer for member m2 and returns its
// address, its local dialer and what it observed.
func startForwardServer(t *testing.T, secret []byte) (string, *fakeGuests, *observed) {
	t.Helper()
	return startForwardServerHolding(t, nil, secret)
}

// startForwardServerHolding is startForwardServer with replaceable secrets
// (held), when not nil.
func startForwardServerHolding(t *testing.T, held *PeerSecrets, secret []byte) (string, *fakeGuests, *observed) {
	t.Helper()
	local := &fakeGuests{addr: echoDaemon(t), dials: map[string]int{}}
	obs := &observed{}
	addr := serveForward(t, ForwardServerOptions{Member: "m2", Local: local, Secrets: held, Secret: secret, Observe: obs.server})
	return addr, local, obs
}

// serveForward serves a ForwardServer built from o on loopback until the
// test ends, and returns its address.
func serveForward(t *testing.T, o ForwardServerOptions) string {
	t.Helper()
	srv, err := NewForwardServer(o)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return within 10 s of its context ending")
		}
	})
	return ln.Addr().String()
}

func newTestForward(t *testing.T, peers map[string]string, secret []byte) (Dialer, *recordingFallback, *observed) {
	t.Helper()
	fb := &recordingFallback{fakeGuests{addr: echoDaemon(t), dials: map[string]int{}}}
	obs := &observed{}
	d, err := NewForward(ForwardOptions{Peers: peers, Secret: secret, Fallback: fb, Observe: obs.client, PeerDown: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return d, fb, obs
}

// roundTrip sends msg, half-closes and reads the answer to its end.
func roundTrip(t *testing.T, c net.Conn, msg string) string {
	t.Helper()
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		t.Fatalf("write: %v", err)
	}
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		t.Fatalf("%T has no CloseWrite", c)
	}
	if err := cw.CloseWrite(); err != nil {
		t.Fatalf("close write: %v", err)
	}
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return string(got)
}

func TestForwardCarriesBytesBothWaysAndHalfClose(t *testing.T) {
	addr, local, sobs := startForwardServer(t, secretA)
	d, fb, obs := newTestForward(t, map[string]string{"m2": addr}, secretA)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Dozens at once, as many relays of one replica would.
	const n = 40
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := d.DialContext(ctx, Target{Instance: "ls-a", Port: 19091, Location: "m2"})
			if err != nil {
				t.Errorf("dial %d: %v", i, err)
				return
			}
			msg := strings.Repeat(fmt.Sprintf("%d,", i), 20000) // more than one TLS record
			if got := roundTrip(t, c, msg); got != "echo:"+msg {
				t.Errorf("dial %d: answer of %d bytes, want %d", i, len(got), len(msg)+5)
			}
		}()
	}
	wg.Wait()
	if got := local.count("ls-a"); got != n {
		t.Errorf("the server dialled the guest %d times, want %d", got, n)
	}
	if got := fb.count("ls-a"); got != 0 {
		t.Errorf("the fallback was used %d times:\n%s", got, obs.all())
	}
	if got := strings.Count(sobs.all(), "server "+ForwardOK); got != n {
		t.Errorf("server observed %d forwarded, want %d:\n%s", got, n, sobs.all())
	}
}

func TestForwardGuestAnswersAreTheGuests(t *testing.T) {
	addr, _, _ := startForwardServer(t, secretA)
	d, fb, obs := newTestForward(t, map[string]string{"m2": addr}, secretA)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	_, err := d.DialContext(ctx, Target{Instance: "stopped", Port: 19091, Location: "m2"})
	if !errors.Is(err, ErrNotRunning) {
		t.Fatalf("a stopped guest: %v, want ErrNotRunning", err)
	}
	_, err = d.DialContext(ctx, Target{Instance: "refusing", Port: 19091, Location: "m2"})
	if err == nil || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("a guest whose daemon refuses: %v", err)
	}
	if fb.count("stopped")+fb.count("refusing") != 0 {
		t.Fatal("the guest's own refusal went to the fallback")
	}
	// A stale location: the peer says so, the fallback reaches it, and the
	// peer stays in use.
	c, err := d.DialContext(ctx, Target{Instance: "moved", Port: 19091, Location: "m2"})
	if err != nil {
		t.Fatalf("a moved guest: %v", err)
	}
	_ = c.Close()
	if fb.count("moved") != 1 {
		t.Fatal("a moved guest was not dialled through the fallback")
	}
	c, err = d.DialContext(ctx, Target{Instance: "ls-b", Port: 19091, Location: "m2"})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	if fb.count("ls-b") != 0 {
		t.Fatalf("the peer was skipped after a stale location:\n%s", obs.all())
	}
}

func TestForwardFallsBackAndSkipsAnUnreachablePeer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close()
	d, fb, obs := newTestForward(t, map[string]string{"m2": dead}, secretA)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 3 {
		c, err := d.DialContext(ctx, Target{Instance: "ls-a", Port: 19091, Location: "m2"})
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		if got := roundTrip(t, c, "x"); got != "echo:x" {
			t.Fatalf("dial %d: %q", i, got)
		}
	}
	if fb.count("ls-a") != 3 {
		t.Fatalf("fallback dials %d, want 3", fb.count("ls-a"))
	}
	ev := obs.all()
	if strings.Count(ev, "connection refused") != 3 {
		t.Errorf("want every fallback to carry the peer's refusal:\n%s", ev)
	}
	ps := Peers(d)
	if len(ps) != 1 || !ps[0].Down || !strings.Contains(ps[0].Reason, "refused") {
		t.Errorf("peer state %+v, want down with the reason", ps)
	}
	// A member with no peer goes to the fallback, said as such.
	c, err := d.DialContext(ctx, Target{Instance: "ls-c", Port: 19091, Location: "m3"})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	if !strings.Contains(obs.all(), "m3 "+ForwardNoPeer) {
		t.Errorf("no %s outcome for a member without a peer:\n%s", ForwardNoPeer, obs.all())
	}
}

func TestForwardRefusesAWrongSecret(t *testing.T) {
	addr, local, sobs := startForwardServer(t, secretA)
	d, fb, obs := newTestForward(t, map[string]string{"m2": addr}, bytes.Repeat([]byte("b"), MinForwardSecret))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, Target{Instance: "ls-a", Port: 19091, Location: "m2"})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	if local.count("ls-a") != 0 {
		t.Fatal("the server dialled a guest for a client without the secret")
	}
	if fb.count("ls-a") != 1 {
		t.Fatal("the client did not fall back")
	}
	if !strings.Contains(obs.all(), "PROVIDER_PEER_SECRET_FILE differs") {
		t.Errorf("the client's reason does not name the setting:\n%s", obs.all())
	}
	if !strings.Contains(sobs.all(), ForwardRefused+": request from") {
		t.Errorf("the server did not observe a refusal:\n%s", sobs.all())
	}
}

// A man in the middle that terminates TLS with its own certificate and
// passes the bytes on over a second session cannot use a proof made for
// the first.
func TestForwardRefusesAManInTheMiddle(t *testing.T) {
	addr, local, _ := startForwardServer(t, secretA)
	mitm, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cert, err := throwawayCertificate()
	if err != nil {
		t.Fatal(err)
	}
	acceptEach(t, mitm, func(c net.Conn) {
		in := tls.Server(c, &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}})
		defer func() { _ = in.Close() }()
		out, err := tls.Dial("tcp", addr, &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}) //nolint:gosec // the attacker's side
		if err != nil {
			return
		}
		defer func() { _ = out.Close() }()
		go func() { _, _ = io.Copy(out, in) }()
		_, _ = io.Copy(in, out)
	})
	d, fb, obs := newTestForward(t, map[string]string{"m2": mitm.Addr().String()}, secretA)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, Target{Instance: "ls-a", Port: 19091, Location: "m2"})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	if local.count("ls-a") != 0 {
		t.Fatal("the server dialled a guest for a relayed proof")
	}
	if fb.count("ls-a") != 1 {
		t.Fatalf("the client did not fall back:\n%s", obs.all())
	}
}

func TestForwardServerDropsGarbage(t *testing.T) {
	addr, local, sobs := startForwardServer(t, secretA)
	for _, junk := range []string{"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "\x16\x03\x01\x00\x05hello"} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.WriteString(c, junk)
		_, err = io.ReadAll(c)
		_ = c.Close()
		if err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
			t.Fatalf("junk %q: %v", junk, err)
		}
	}
	if len(local.dials) != 0 {
		t.Fatal("garbage reached a guest")
	}
	if strings.Count(sobs.all(), ForwardRefused) != 2 {
		t.Errorf("want two refusals:\n%s", sobs.all())
	}
}

func TestNewForwardRefusesShortSecrets(t *testing.T) {
	_, err := NewForward(ForwardOptions{Secret: []byte("short"), Fallback: &recordingFallback{}})
	if err == nil || !strings.Contains(err.Error(), "at least 32") {
		t.Fatalf("short secret: %v", err)
	}
	_, err = NewForwardServer(ForwardServerOptions{Member: "m", Local: &fakeGuests{}, Secret: []byte("short")})
	if err == nil {
		t.Fatal("server accepted a short secret")
	}
}

func TestOnMemberRefusesOtherMembersPIDs(t *testing.T) {
	lookup := OnMember("m1", func(_ context.Context, instance string) (int, string, error) {
		if instance == "here" {
			return 42, "m1", nil
		}
		return 43, "m2", nil
	})
	if pid, err := lookup(context.Background(), "here"); err != nil || pid != 42 {
		t.Fatalf("here: %d, %v", pid, err)
	}
	if _, err := lookup(context.Background(), "there"); !errors.Is(err, ErrNotOnMember) {
		t.Fatalf("there: %v, want ErrNotOnMember", err)
	}
}

// TestForwardSecretsRotateWithoutARefusal: two replicas rotate their shared
// secret one step at a time (the new one accepted beside the old, then
// proving, then alone), each step reaching one replica before the other,
// and every forwarded dial either way is accepted throughout; replicas
// holding only different secrets refuse each other.
func TestForwardSecretsRotateWithoutARefusal(t *testing.T) {
	oldS, newS := bytes.Repeat([]byte("o"), MinForwardSecret), bytes.Repeat([]byte("n"), MinForwardSecret+8)
	hold := func(ss ...[]byte) *PeerSecrets {
		p, err := NewPeerSecrets(ss)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, b := hold(oldS), hold(oldS)
	addrA, localA, _ := startForwardServerHolding(t, a, nil)
	addrB, localB, _ := startForwardServerHolding(t, b, nil)
	fbA := &recordingFallback{fakeGuests{addr: echoDaemon(t), dials: map[string]int{}}}
	fbB := &recordingFallback{fakeGuests{addr: echoDaemon(t), dials: map[string]int{}}}
	// PeerDown 0 takes the default: a refused peer is set aside, which
	// the steps below must never cause.
	dialA, err := NewForward(ForwardOptions{Peers: map[string]string{"m2": addrB}, Secrets: a, Fallback: fbA})
	if err != nil {
		t.Fatal(err)
	}
	dialB, err := NewForward(ForwardOptions{Peers: map[string]string{"m2": addrA}, Secrets: b, Fallback: fbB})
	if err != nil {
		t.Fatal(err)
	}
	both := func(step string) {
		t.Helper()
		for _, d := range []Dialer{dialA, dialB} {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			c, err := d.DialContext(ctx, Target{Instance: "ls-r", Port: 19091, Location: "m2"})
			cancel()
			if err != nil {
				t.Fatalf("%s: %v", step, err)
			}
			if got := roundTrip(t, c, "ping"); got != "echo:ping" {
				t.Fatalf("%s: echoed %q", step, got)
			}
		}
		if fbA.count("ls-r")+fbB.count("ls-r") != 0 {
			t.Fatalf("%s: a dial fell back: the peer refused it", step)
		}
	}
	both("before")
	steps := []struct {
		name string
		p    *PeerSecrets
		to   [][]byte
	}{
		{"A accepts the new one", a, [][]byte{oldS, newS}},
		{"B accepts the new one", b, [][]byte{oldS, newS}},
		{"A proves with the new one", a, [][]byte{newS, oldS}},
		{"B proves with the new one", b, [][]byte{newS, oldS}},
		{"A drops the old one", a, [][]byte{newS}},
		{"B drops the old one", b, [][]byte{newS}},
	}
	for _, st := range steps {
		if err := st.p.Set(st.to); err != nil {
			t.Fatal(err)
		}
		both(st.name)
	}
	if localA.count("ls-r") != 7 || localB.count("ls-r") != 7 {
		t.Fatalf("forwarded %d and %d dials, want 7 each", localA.count("ls-r"), localB.count("ls-r"))
	}
	// A refused set leaves the one in force.
	if err := a.Set([][]byte{[]byte("short")}); err == nil {
		t.Fatal("a short secret was taken")
	}
	both("after a refused set")
	// Only different secrets: refused, and the client falls back.
	if err := a.Set([][]byte{oldS}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := dialA.DialContext(ctx, Target{Instance: "ls-x", Port: 19091, Location: "m2"})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	if fbA.count("ls-x") != 1 {
		t.Fatal("a replica proving a secret its peer no longer holds was not refused")
	}
}
