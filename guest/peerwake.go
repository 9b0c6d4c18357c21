package guest

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"slices"
	"time"
)

// Wakes travel the same hop as forwarded dials, so that a target is woken
// once however many replicas its uses arrive at: each target has one
// replica that wakes it (PeerWaker.Waker), and the others ask it to, and
// wait on its answer, which is its one flight's.
//
// The wire, after the handshake, client first:
//
//	request: "lswak1" | mac[32] | budget_ms u32 | age_ms u32 |
//	         len u8 | instance | len u8 | universe | len u8 | environment
//	answer:  as a dial's; status ok (the daemon answered), wake-refused
//	         with message retry_ms u32 | len u8 | state | text, or
//	         not-the-waker
//
// with mac = HMAC-SHA256(secret, "wake" | ekm | the rest of the request).

const wakeMagic = "lswak1"

// WakeRequest asks the replica that wakes a target to wake it.
type WakeRequest struct {
	Instance string
	// Universe and Environment are the owner the use named: the waking
	// replica checks the target against it, as for its own uses.
	Universe, Environment string
	// Age is how long ago the use arrived: its request for running is
	// that old.
	Age time.Duration
}

// WakeAnswer is what the waking replica's wake settled on, or what it
// stood at when the request's budget ran out.
type WakeAnswer struct {
	// Ready: the daemon answered. Otherwise State (a refusal's state),
	// Message (with a failure) and RetryAfter say why not.
	Ready      bool
	State      string
	Message    string
	RetryAfter time.Duration
}

// ErrNotTheWaker is a peer's answer that it does not wake the target: it
// serves no wakes, or chooses another waker (the replicas' PROVIDER_PEERS
// differ). The asking replica wakes the target itself.
var ErrNotTheWaker = errors.New("guest: the peer does not wake this target")

// errWakeFailed is a peer's answer that it could not serve a wake (it
// could not read the target from Incus, say).
var errWakeFailed = errors.New("the waking replica could not wake the target")

// maxOwnerID bounds an owner id on the wire; longer ones are not sent.
const maxOwnerID = 255

// PeerWaker sends each target's wakes to the replica that wakes it.
type PeerWaker struct {
	self    string
	members []string // self and every peer's member, sorted, once each
	fwd     *forwardDialer
}

// PeerWakes returns the PeerWaker of d, a member dialer that forwards to
// peers (guest.New with Peers); nil for any other dialer.
func PeerWakes(d Dialer) *PeerWaker {
	md, ok := d.(*memberDialer)
	if !ok || md.member == "" {
		return nil
	}
	f, ok := md.remote.(*forwardDialer)
	if !ok || len(f.peers) == 0 {
		return nil
	}
	members := []string{md.member}
	for m := range f.peers {
		if !slices.Contains(members, m) {
			members = append(members, m)
		}
	}
	slices.Sort(members)
	return &PeerWaker{self: md.member, members: members, fwd: f}
}

// Waker names the member whose replica wakes the instance, held by the
// member location: that member's own, when a replica runs there (it
// reaches the guest through netns and is the one the others forward their
// dials to), and otherwise the member of highest rendezvous weight for the
// instance, so that replicas with the same peers choose the same one and a
// replica's loss moves only its own share.
func (p *PeerWaker) Waker(instance, location string) string {
	if slices.Contains(p.members, location) {
		return location
	}
	best, bestWeight := "", uint64(0)
	for _, m := range p.members {
		h := fnv.New64a()
		_, _ = h.Write([]byte(m))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(instance))
		if w := mix64(h.Sum64()); best == "" || w > bestWeight {
			best, bestWeight = m, w
		}
	}
	return best
}

// mix64 spreads FNV's sum over all its bits (MurmurHash3's finaliser):
// names that differ in their last bytes only, as instance names do, would
// otherwise weigh the members alike in the high bits that decide.
func mix64(h uint64) uint64 {
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// Here says whether this replica wakes the instance.
func (p *PeerWaker) Here(instance, location string) bool {
	return p.Waker(instance, location) == p.self
}

// Wake asks the replica that wakes the instance to wake it, and waits for
// its answer within ctx. An error means no answer came (the waker is this
// replica, is skipped as unreachable, refused, or could not be reached):
// the caller wakes the target itself.
func (p *PeerWaker) Wake(ctx context.Context, location string, req WakeRequest) (WakeAnswer, error) {
	member := p.Waker(req.Instance, location)
	if member == p.self {
		return WakeAnswer{}, errors.New("guest: this replica wakes the target")
	}
	if len(req.Universe) > maxOwnerID || len(req.Environment) > maxOwnerID || len(req.Instance) > maxInstanceName || req.Instance == "" {
		return WakeAnswer{}, fmt.Errorf("guest: a wake of %q cannot be sent to a peer: an id is too long", req.Instance)
	}
	if why := p.fwd.skipped(member); why != nil {
		return WakeAnswer{}, fmt.Errorf("guest: the replica on %s is skipped: %w", member, why)
	}
	a, err := wakeAt(ctx, p.fwd.peers[member], p.fwd.secrets.proving(), req)
	switch {
	case err == nil:
		p.fwd.markUp(member)
		return a, nil
	case errors.Is(err, ErrNotTheWaker), errors.Is(err, errWakeFailed), ctx.Err() != nil:
		// The peer answered (or this replica gave up waiting): it is up,
		// and its members' dials still go to it.
		return WakeAnswer{}, err
	default:
		p.fwd.markDown(member, err)
		p.fwd.observe(member, ForwardFallback, err)
		return WakeAnswer{}, err
	}
}

// wakeAt sends one wake request to the peer at addr.
func wakeAt(ctx context.Context, addr string, secret []byte, req WakeRequest) (WakeAnswer, error) {
	fail := func(err error) error {
		return fmt.Errorf("guest: wake of %s through the replica at %s: %w", req.Instance, addr, err)
	}
	ps, err := openPeer(ctx, addr)
	if err != nil {
		return WakeAnswer{}, fail(err)
	}
	defer func() { _ = ps.tc.Close() }()
	body := make([]byte, 0, 11+len(req.Instance)+len(req.Universe)+len(req.Environment))
	body = binary.BigEndian.AppendUint32(body, uint32(ps.budgetMillis()))
	body = binary.BigEndian.AppendUint32(body, uint32(min(max(req.Age, 0), time.Hour).Milliseconds()))
	for _, s := range []string{req.Instance, req.Universe, req.Environment} {
		body = append(body, byte(len(s)))
		body = append(body, s...)
	}
	st, msg, err := ps.ask(wakeMagic, "wake", secret, body)
	if err != nil {
		return WakeAnswer{}, fail(err)
	}
	switch st {
	case fwdOK:
		return WakeAnswer{Ready: true}, nil
	case fwdWakeRefused:
		a, err := decodeRefusal(msg)
		if err != nil {
			return WakeAnswer{}, fail(err)
		}
		return a, nil
	case fwdNotTheWaker:
		return WakeAnswer{}, fail(fmt.Errorf("%s: %w", msg, ErrNotTheWaker))
	case fwdRefused:
		// Proved with the secret the replicas share, so the peer is up
		// and one of theirs: one that does not know wakes (a replica of
		// an older version, during a rolling upgrade) answers so. Its
		// dials are still forwarded.
		return WakeAnswer{}, fail(fmt.Errorf("refused: %s: %w", msg, ErrNotTheWaker))
	case fwdDialFailed:
		return WakeAnswer{}, fail(fmt.Errorf("%w: %s", errWakeFailed, msg))
	default:
		return WakeAnswer{}, fail(fmt.Errorf("unknown answer status %d", st))
	}
}

func encodeRefusal(a WakeAnswer) string {
	state := a.State
	if len(state) > 32 {
		state = state[:32]
	}
	b := binary.BigEndian.AppendUint32(nil, uint32(min(max(a.RetryAfter, 0), time.Hour).Milliseconds()))
	b = append(b, byte(len(state)))
	b = append(b, state...)
	b = append(b, a.Message...)
	if len(b) > forwardMaxMessage {
		b = b[:forwardMaxMessage]
	}
	return string(b)
}

func decodeRefusal(msg []byte) (WakeAnswer, error) {
	if len(msg) < 5 || len(msg) < 5+int(msg[4]) || msg[4] == 0 {
		return WakeAnswer{}, fmt.Errorf("a wake refusal of %d bytes is malformed", len(msg))
	}
	n := int(msg[4])
	return WakeAnswer{
		State:      string(msg[5 : 5+n]),
		Message:    string(msg[5+n:]),
		RetryAfter: time.Duration(binary.BigEndian.Uint32(msg[:4])) * time.Millisecond,
	}, nil
}

// serveWake answers one wake request, whose magic and mac were read.
func (s *ForwardServer) serveWake(ctx context.Context, tc *tls.Conn, ekm, mac []byte, provedWith func([]byte), answer func(forwardStatus, string) error) {
	req, budget, err := s.readWake(tc, ekm, mac, provedWith)
	if err != nil {
		s.o.Observe(ForwardRefused, fmt.Errorf("wake request: %w", err))
		_ = answer(fwdRefused, err.Error())
		return
	}
	if s.o.Wake == nil {
		_ = answer(fwdNotTheWaker, "this replica serves no wakes")
		return
	}
	wctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	_ = tc.SetDeadline(time.Now().Add(budget + time.Second))
	a, err := s.o.Wake(wctx, req)
	switch {
	case errors.Is(err, ErrNotTheWaker):
		_ = answer(fwdNotTheWaker, err.Error())
	case err != nil:
		_ = answer(fwdDialFailed, err.Error())
	case a.Ready:
		_ = answer(fwdOK, "")
	default:
		_ = answer(fwdWakeRefused, encodeRefusal(a))
	}
}

// readWake reads a wake request's body and checks its proof.
func (s *ForwardServer) readWake(tc *tls.Conn, ekm, mac []byte, provedWith func([]byte)) (WakeRequest, time.Duration, error) {
	var fixed [4 + 4]byte
	if _, err := io.ReadFull(tc, fixed[:]); err != nil {
		return WakeRequest{}, 0, fmt.Errorf("read: %w", err)
	}
	body := fixed[:]
	var ids [3]string
	for i := range ids {
		var n [1]byte
		if _, err := io.ReadFull(tc, n[:]); err != nil {
			return WakeRequest{}, 0, fmt.Errorf("read: %w", err)
		}
		b := make([]byte, n[0])
		if _, err := io.ReadFull(tc, b); err != nil {
			return WakeRequest{}, 0, fmt.Errorf("read: %w", err)
		}
		body = append(append(body, n[0]), b...)
		ids[i] = string(b)
	}
	proved := s.proved(mac, "wake", ekm, body)
	if proved == nil {
		return WakeRequest{}, 0, errors.New("the request carries no valid proof of the shared secret")
	}
	provedWith(proved)
	t := Target{Instance: ids[0], Port: 1}
	if err := t.validate(); err != nil {
		return WakeRequest{}, 0, err
	}
	if ids[1] == "" || ids[2] == "" {
		return WakeRequest{}, 0, errors.New("a wake names no owner")
	}
	budget := time.Duration(binary.BigEndian.Uint32(fixed[0:4])) * time.Millisecond
	age := time.Duration(binary.BigEndian.Uint32(fixed[4:8])) * time.Millisecond
	return WakeRequest{Instance: ids[0], Universe: ids[1], Environment: ids[2], Age: age},
		max(time.Millisecond, min(budget, forwardMaxBudget)), nil
}
