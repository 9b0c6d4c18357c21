package guest

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// peerWaker builds the PeerWaker of a replica on member self whose peers
// are given, with a fallback that dials nothing.
func peerWaker(t *testing.T, self string, peers map[string]string, secret []byte) *PeerWaker {
	t.Helper()
	fwd, _, _ := newTestForward(t, peers, secret)
	p := PeerWakes(NewMember(self, &fakeGuests{}, fwd))
	if p == nil {
		t.Fatal("PeerWakes: nil for a member dialer forwarding to peers")
	}
	return p
}

func TestPeerWakersAgreeOnEachTargetsWaker(t *testing.T) {
	peers := map[string]string{"m1": "127.0.0.1:1", "m2": "127.0.0.1:2", "m3": "127.0.0.1:3"}
	ws := []*PeerWaker{peerWaker(t, "m1", peers, secretA), peerWaker(t, "m2", peers, secretA), peerWaker(t, "m3", peers, secretA)}
	share := map[string]int{}
	for i := range 300 {
		name := fmt.Sprintf("lsc-t%03d", i)
		// A guest on a member a replica runs on is that replica's to wake.
		for _, m := range []string{"m1", "m2", "m3"} {
			for _, w := range ws {
				if got := w.Waker(name, m); got != m {
					t.Fatalf("replica %s names %s the waker of %s on %s, want its member's replica", w.self, got, name, m)
				}
			}
		}
		// One on a member no replica runs on has one waker all agree on.
		got := ws[0].Waker(name, "m9")
		for _, w := range ws[1:] {
			if w.Waker(name, "m9") != got {
				t.Fatalf("replicas disagree on the waker of %s: %s and %s", name, got, w.Waker(name, "m9"))
			}
		}
		if ws[0].Here(name, "m9") != (got == "m1") {
			t.Fatalf("Here(%s) disagrees with Waker %s", name, got)
		}
		share[got]++
	}
	// Spread: each replica wakes a share (a third each, give or take).
	for _, m := range []string{"m1", "m2", "m3"} {
		if share[m] < 60 {
			t.Fatalf("member %s wakes %d of 300 targets on a member without a replica (%v), want about a third", m, share[m], share)
		}
	}
	if PeerWakes(&fakeGuests{}) != nil {
		t.Fatal("PeerWakes of a dialer that forwards to no peer is not nil")
	}
}

func TestPeerWakeCarriesTheWakersAnswer(t *testing.T) {
	var mu sync.Mutex
	var got []WakeRequest
	answers := map[string]WakeAnswer{
		"ready":   {Ready: true},
		"waking":  {State: "waking", RetryAfter: 1500 * time.Millisecond},
		"failed":  {State: "failed", Message: "the guest's disk is gone"},
		"elsewhr": {},
		"broken":  {},
	}
	addr := serveForward(t, ForwardServerOptions{Member: "m2", Local: &fakeGuests{}, Secret: secretA,
		Wake: func(ctx context.Context, req WakeRequest) (WakeAnswer, error) {
			mu.Lock()
			got = append(got, req)
			mu.Unlock()
			switch req.Instance {
			case "elsewhr":
				return WakeAnswer{}, fmt.Errorf("another replica wakes it: %w", ErrNotTheWaker)
			case "broken":
				return WakeAnswer{}, errors.New("incus did not answer")
			}
			if _, ok := ctx.Deadline(); !ok {
				return WakeAnswer{}, errors.New("a wake served without a deadline")
			}
			return answers[req.Instance], nil
		}})
	w := peerWaker(t, "m1", map[string]string{"m2": addr}, secretA)
	for name, want := range answers {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		a, err := w.Wake(ctx, "m2", WakeRequest{Instance: name, Universe: "u1", Environment: "e1", Age: 40 * time.Millisecond})
		cancel()
		switch name {
		case "elsewhr":
			if !errors.Is(err, ErrNotTheWaker) {
				t.Fatalf("a peer that is not the waker: %v, want ErrNotTheWaker", err)
			}
			continue
		case "broken":
			if err == nil || !strings.Contains(err.Error(), "incus did not answer") {
				t.Fatalf("a peer that could not wake: %v, want its failure", err)
			}
			continue
		}
		if err != nil || a != want {
			t.Fatalf("wake of %s: %+v, %v; want %+v", name, a, err, want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, r := range got {
		if r.Universe != "u1" || r.Environment != "e1" || r.Age != 40*time.Millisecond {
			t.Fatalf("the waker was asked %+v, want the owner u1/e1 and an age of 40ms", r)
		}
	}
	// None of those answers marks the peer down: its dials still go to it.
	if why := w.fwd.skipped("m2"); why != nil {
		t.Fatalf("a peer that answered every wake is skipped: %v", why)
	}
	// A guest on this replica's own member is its own to wake.
	if _, err := w.Wake(context.Background(), "m1", WakeRequest{Instance: "x", Universe: "u", Environment: "e"}); err == nil {
		t.Fatal("a wake of this replica's own guest was sent to a peer")
	}
}

func TestPeerWakeRefusedWithoutTheSecretOrAHandler(t *testing.T) {
	served := 0
	addr := serveForward(t, ForwardServerOptions{Member: "m2", Local: &fakeGuests{}, Secret: secretA,
		Wake: func(context.Context, WakeRequest) (WakeAnswer, error) { served++; return WakeAnswer{Ready: true}, nil }})
	wrong := peerWaker(t, "m1", map[string]string{"m2": addr}, []byte(strings.Repeat("b", MinForwardSecret)))
	if _, err := wrong.Wake(context.Background(), "m2", WakeRequest{Instance: "x", Universe: "u", Environment: "e"}); err == nil {
		t.Fatal("a wake proved with another secret was answered")
	}
	if served != 0 {
		t.Fatal("a wake proved with another secret reached the handler")
	}
	// The refused peer is skipped for a while: the next wake is not sent.
	if _, err := wrong.Wake(context.Background(), "m2", WakeRequest{Instance: "x", Universe: "u", Environment: "e"}); err == nil || !strings.Contains(err.Error(), "skipped") {
		t.Fatalf("a wake right after a refusal: %v, want the peer skipped", err)
	}
	plain := serveForward(t, ForwardServerOptions{Member: "m2", Local: &fakeGuests{addr: echoDaemon(t), dials: map[string]int{}}, Secret: secretA})
	w := peerWaker(t, "m1", map[string]string{"m2": plain}, secretA)
	if _, err := w.Wake(context.Background(), "m2", WakeRequest{Instance: "x", Universe: "u", Environment: "e"}); !errors.Is(err, ErrNotTheWaker) {
		t.Fatalf("a peer serving no wakes: %v, want ErrNotTheWaker", err)
	}
	// Forwarded dials still work beside wakes on the same server.
	d, _, _ := newTestForward(t, map[string]string{"m2": plain}, secretA)
	c, err := d.DialContext(context.Background(), Target{Instance: "g", Port: 8080, Location: "m2"})
	if err != nil {
		t.Fatalf("a forwarded dial beside wakes: %v", err)
	}
	_ = c.Close()
}

// A replica of an older version knows no wakes: it refuses the request as
// a malformed dial, with a valid proof. The asking replica wakes the
// target itself and keeps forwarding its dials to that replica.
func TestPeerWakeOfAnOlderReplicaLeavesItsDialsForwarded(t *testing.T) {
	older := olderPeer(t)
	w := peerWaker(t, "m1", map[string]string{"m2": older}, secretA)
	_, err := w.Wake(context.Background(), "m2", WakeRequest{Instance: "lsc-x", Universe: "u", Environment: "e"})
	if !errors.Is(err, ErrNotTheWaker) {
		t.Fatalf("a wake through an older replica: %v, want ErrNotTheWaker", err)
	}
	if why := w.fwd.skipped("m2"); why != nil {
		t.Fatalf("an older replica that refused a wake is skipped for dials: %v", why)
	}
}

// olderPeer is a replica that knows no wakes, as before they were added:
// it reads a request as a dial's (magic, proof, 7 bytes, the instance) and
// refuses one of another magic, proving its answer with secretA.
func olderPeer(t *testing.T) string {
	t.Helper()
	cert, err := throwawayCertificate()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatal(err)
	}
	acceptEach(t, ln, func(c net.Conn) {
		tc := c.(*tls.Conn)
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		if tc.Handshake() != nil {
			return
		}
		cs := tc.ConnectionState()
		ekm, err := cs.ExportKeyingMaterial(forwardExporter, nil, 32)
		if err != nil {
			return
		}
		var head [len(forwardMagic) + 32 + 2 + 4 + 1]byte
		if _, err := io.ReadFull(tc, head[:]); err != nil || string(head[:len(forwardMagic)]) == forwardMagic {
			return
		}
		msg := "not a forwarding request (bad magic)"
		signed := binary.BigEndian.AppendUint16([]byte{byte(fwdRefused)}, uint16(len(msg)))
		signed = append(signed, msg...)
		out := append([]byte{byte(fwdRefused)}, forwardMAC(secretA, "answer", ekm, signed)...)
		_, _ = tc.Write(append(out, signed[1:]...))
	})
	return ln.Addr().String()
}
