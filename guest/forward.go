package guest

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"sync"
	"time"
)

// Forwarding is the cluster form with a provider replica on every member:
// a replica dials a guest held by another member through the replica that
// runs there, which dials it through netns and joins the two streams. The
// cost over a local guest is one TCP hop between replicas (and TLS on it),
// where an exec costs an Incus operation, four websockets and a process
// start in the guest per connection (tens of milliseconds, see
// BENCHMARKS.md).
//
// The hop is TLS 1.3 with a throw-away certificate on each side; who may
// use it is decided by a secret every replica holds (PROVIDER_PEER_SECRET_FILE):
// each side proves it knows the secret with an HMAC over the TLS session's
// exported keying material, so a proof cannot be replayed on another
// connection and a man in the middle, who necessarily runs two TLS
// sessions, cannot pass one on.
//
// The wire, after the handshake, client first:
//
//	request: "lsfwd1" | mac[32] | port u16 | budget_ms u32 | len u8 | instance[len]
//	answer:  status u8 | mac[32] | len u16 | message[len]
//
// with mac = HMAC-SHA256(secret, role | ekm | the rest of the message), role
// "dial" or "answer", and every integer big-endian. After an ok answer the
// connection carries the guest daemon's bytes both ways.

// MinForwardSecret is the shortest secret accepted, in bytes: 256 bits, the
// HMAC's own strength.
const MinForwardSecret = 32

const (
	forwardMagic = "lsfwd1"
	// forwardExporter labels the keying material both proofs are bound to.
	forwardExporter = "EXPORTER-lightspeed-forward-1"
	// forwardHandshake bounds a client's TLS handshake and request on the
	// server, so a connection that says nothing is dropped.
	forwardHandshake = 5 * time.Second
	// forwardMaxBudget caps the time a server spends dialling for one
	// request, whatever the client asks: the client's own deadline ends
	// the wait sooner, and the provider's longest dial (a wake's probe,
	// bounded by the 5-second hold) is well under it.
	forwardMaxBudget = 10 * time.Second
	// forwardMaxMessage bounds an answer's message: an error sentence.
	forwardMaxMessage = 1024
	// maxInstanceName is Incus's own limit on instance names.
	maxInstanceName = 63
	// joinGrace is how long one direction of a forwarded connection may
	// outlive the other.
	joinGrace = 5 * time.Second
	// DefaultPeerDown is how long a peer that could not be reached is left
	// alone: its members' dials go to the fallback meanwhile instead of
	// each paying a connect timeout.
	DefaultPeerDown = 2 * time.Second
)

// forwardStatus is the server's answer to a request.
type forwardStatus byte

const (
	fwdOK forwardStatus = iota
	// fwdNotRunning: the instance has no init process (ErrNotRunning).
	fwdNotRunning
	// fwdDialFailed: the dial inside the guest failed (the daemon does
	// not listen yet, or any more); the message says how.
	fwdDialFailed
	// fwdNotHere: the instance is not on the server's member; the client
	// falls back (an instance can move, and a client's location can be
	// stale).
	fwdNotHere
	// fwdRefused: the request was malformed or its proof wrong.
	fwdRefused
	// fwdWakeRefused: a wake's answer that the target is not served now;
	// the message holds the refusal (see peerwake.go).
	fwdWakeRefused
	// fwdNotTheWaker: the server does not wake this target (it serves no
	// wakes, or its choice of waker differs): the client wakes it itself.
	fwdNotTheWaker
)

// Forward outcomes, as ForwardOptions.Observe and ForwardServerOptions.Observe
// report them. They are a closed set, fit for a metric label.
const (
	ForwardOK = "forwarded"
	// ForwardGuest: the peer reached the member and the guest refused
	// (not running, or its daemon not listening): the guest's own answer.
	ForwardGuest = "guest_refused"
	// ForwardFallback: the dial went to the fallback dialer because the
	// peer was unreachable, refused the request, or the instance was not
	// on its member.
	ForwardFallback = "fallback"
	// ForwardNoPeer: no peer serves the instance's member.
	ForwardNoPeer = "no_peer"
	// ForwardRefused (server side): a request without a valid proof.
	ForwardRefused = "refused"
	// ForwardFailed (server side): the local dial failed.
	ForwardFailed = "dial_failed"
)

// ForwardOutcomes lists the client outcomes, for initialising series.
var ForwardOutcomes = []string{ForwardOK, ForwardGuest, ForwardFallback, ForwardNoPeer}

// ForwardServerOutcomes lists the server outcomes.
var ForwardServerOutcomes = []string{ForwardOK, ForwardGuest, ForwardFailed, ForwardRefused}

// ForwardOptions configure the client side (NewForward).
type ForwardOptions struct {
	// Peers maps a cluster member to the address (host:port) of the
	// replica serving its guests.
	Peers map[string]string
	// Secrets are the replicas' shared secrets (SIGHUP replaces them);
	// Secret, when Secrets is nil, is the one secret, at least
	// MinForwardSecret bytes.
	Secrets *PeerSecrets
	Secret  []byte
	// Fallback dials guests of members without a reachable peer (exec).
	Fallback Dialer
	// PeerDown is how long an unreachable peer is skipped (0: DefaultPeerDown).
	PeerDown time.Duration
	// Observe, if set, is told of every dial: the member, an outcome from
	// ForwardOutcomes, and for a fallback the reason.
	Observe func(member, outcome string, reason error)
}

type forwardDialer struct {
	peers    map[string]string
	secrets  *PeerSecrets
	fallback Dialer
	downFor  time.Duration
	observe  func(member, outcome string, reason error)

	mu   sync.Mutex
	down map[string]peerDown // member -> why and until when its peer is skipped
}

type peerDown struct {
	until time.Time
	err   error
}

// NewForward returns a Dialer that reaches each guest through the peer
// replica of the guest's member (Target.Location) and through o.Fallback
// where there is none or it cannot be reached.
func NewForward(o ForwardOptions) (Dialer, error) {
	secrets, err := secretsOf(o.Secrets, o.Secret)
	if err != nil {
		return nil, err
	}
	if o.Fallback == nil {
		return nil, errors.New("guest: forwarding needs a fallback dialer for members without a reachable peer")
	}
	peers := make(map[string]string, len(o.Peers))
	for m, a := range o.Peers {
		if _, _, err := net.SplitHostPort(a); err != nil || m == "" {
			return nil, fmt.Errorf("guest: peer %q=%q: want member=host:port: %w", m, a, err)
		}
		peers[m] = a
	}
	down := o.PeerDown
	if down <= 0 {
		down = DefaultPeerDown
	}
	observe := o.Observe
	if observe == nil {
		observe = func(string, string, error) {}
	}
	return &forwardDialer{peers: peers, secrets: secrets, fallback: o.Fallback,
		downFor: down, observe: observe, down: map[string]peerDown{}}, nil
}

func (d *forwardDialer) Name() string { return d.fallback.Name() }

func (d *forwardDialer) Devices(t Target) map[string]map[string]string { return d.fallback.Devices(t) }

func (d *forwardDialer) Forget(instance string) { d.fallback.Forget(instance) }

// PeerState is a peer as the dialer last found it, for /readyz.
type PeerState struct {
	Member, Address string
	// Down is set while the peer is skipped; Reason says why.
	Down   bool
	Reason string
}

// Peers reports each configured peer, sorted by member. d must come from
// NewForward (or wrap one, as the member dialer does).
func Peers(d Dialer) []PeerState {
	var f *forwardDialer
	switch v := d.(type) {
	case *forwardDialer:
		f = v
	case *memberDialer:
		f, _ = v.remote.(*forwardDialer)
	}
	if f == nil {
		return nil
	}
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]PeerState, 0, len(f.peers))
	for m, a := range f.peers {
		st := PeerState{Member: m, Address: a}
		if pd, ok := f.down[m]; ok && now.Before(pd.until) {
			st.Down, st.Reason = true, pd.err.Error()
		}
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Member < out[j].Member })
	return out
}

func (d *forwardDialer) skipped(member string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if pd, ok := d.down[member]; ok && time.Now().Before(pd.until) {
		return pd.err
	}
	return nil
}

func (d *forwardDialer) markDown(member string, err error) {
	d.mu.Lock()
	d.down[member] = peerDown{until: time.Now().Add(d.downFor), err: err}
	d.mu.Unlock()
}

func (d *forwardDialer) markUp(member string) {
	d.mu.Lock()
	delete(d.down, member)
	d.mu.Unlock()
}

func (d *forwardDialer) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	if err := t.validate(); err != nil {
		return nil, err
	}
	addr, ok := d.peers[t.Location]
	if !ok {
		d.observe(t.Location, ForwardNoPeer, nil)
		return d.fallback.DialContext(ctx, t)
	}
	if why := d.skipped(t.Location); why != nil {
		d.observe(t.Location, ForwardFallback, why)
		return d.fallback.DialContext(ctx, t)
	}
	c, err := forwardDial(ctx, addr, d.secrets.proving(), t)
	if err == nil {
		d.markUp(t.Location)
		d.observe(t.Location, ForwardOK, nil)
		return c, nil
	}
	var ge *forwardGuestError
	switch {
	case errors.As(err, &ge):
		// The peer is fine and has answered for the guest.
		d.markUp(t.Location)
		d.observe(t.Location, ForwardGuest, nil)
		return nil, err
	case ctx.Err() != nil:
		return nil, err
	case errors.Is(err, ErrNotOnMember):
		// The peer is fine; the location was stale. The fallback reaches
		// an instance wherever it is.
		d.observe(t.Location, ForwardFallback, err)
		return d.fallback.DialContext(ctx, t)
	default:
		d.markDown(t.Location, err)
		d.observe(t.Location, ForwardFallback, err)
		return d.fallback.DialContext(ctx, t)
	}
}

// forwardGuestError is the peer's answer for the guest itself: the instance
// is not running, or its daemon refused the connection.
type forwardGuestError struct {
	target  Target
	status  forwardStatus
	message string
}

func (e *forwardGuestError) Error() string {
	return fmt.Sprintf("guest: forwarded dial %s through the replica on %s: %s", e.target, e.target.Location, e.message)
}

func (e *forwardGuestError) Unwrap() error {
	if e.status == fwdNotRunning {
		return ErrNotRunning
	}
	return nil
}

// forwardDial opens a connection to the guest through the peer at addr.
func forwardDial(ctx context.Context, addr string, secret []byte, t Target) (net.Conn, error) {
	fail := func(err error) error {
		return fmt.Errorf("guest: forwarded dial %s through the replica on %s at %s: %w", t, t.Location, addr, err)
	}
	ps, err := openPeer(ctx, addr)
	if err != nil {
		return nil, fail(err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = ps.tc.Close()
		}
	}()
	body := make([]byte, 0, 7+len(t.Instance))
	body = binary.BigEndian.AppendUint16(body, uint16(t.Port))
	body = binary.BigEndian.AppendUint32(body, uint32(ps.budgetMillis()))
	body = append(body, byte(len(t.Instance)))
	body = append(body, t.Instance...)
	st, msg, err := ps.ask(forwardMagic, "dial", secret, body)
	if err != nil {
		return nil, fail(err)
	}
	switch st {
	case fwdOK:
	case fwdNotRunning, fwdDialFailed:
		return nil, &forwardGuestError{target: t, status: st, message: string(msg)}
	case fwdNotHere:
		return nil, fail(fmt.Errorf("%s: %w", msg, ErrNotOnMember))
	case fwdRefused:
		return nil, fail(fmt.Errorf("refused: %s", msg))
	default:
		return nil, fail(fmt.Errorf("unknown answer status %d", st))
	}
	_ = ps.raw.SetDeadline(time.Time{})
	ok = true
	return ps.tc, nil
}

// peerSession is a TLS session with a peer, set for one request.
type peerSession struct {
	raw      net.Conn
	tc       *tls.Conn
	ekm      []byte
	deadline time.Time
}

// openPeer connects to the peer at addr and completes the TLS handshake;
// the session's deadline is ctx's, or forwardMaxBudget away.
func openPeer(ctx context.Context, addr string) (*peerSession, error) {
	var nd net.Dialer
	raw, err := nd.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if tc, ok := raw.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(forwardMaxBudget)
	}
	_ = raw.SetDeadline(deadline)
	// The certificate is not checked: it is thrown away with its replica.
	// The peer is authenticated by its proof over this session's keying
	// material (ask).
	tc := tls.Client(raw, &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true, ServerName: "incus-provider-peer"}) //nolint:gosec // see above
	if err := tc.HandshakeContext(ctx); err != nil {
		_ = tc.Close()
		return nil, fmt.Errorf("TLS handshake: %w", err)
	}
	cs := tc.ConnectionState()
	ekm, err := cs.ExportKeyingMaterial(forwardExporter, nil, 32)
	if err != nil {
		_ = tc.Close()
		return nil, fmt.Errorf("keying material: %w", err)
	}
	return &peerSession{raw: raw, tc: tc, ekm: ekm, deadline: deadline}, nil
}

// budgetMillis is what is left of the session's deadline, as a request's
// budget.
func (ps *peerSession) budgetMillis() int64 {
	return max(1, min(time.Until(ps.deadline).Milliseconds(), forwardMaxBudget.Milliseconds()))
}

// ask sends a request (magic, its proof for role, body) and reads the
// peer's answer, whose proof it checks.
func (ps *peerSession) ask(magic, role string, secret, body []byte) (forwardStatus, []byte, error) {
	req := make([]byte, 0, len(magic)+32+len(body))
	req = append(req, magic...)
	req = append(req, forwardMAC(secret, role, ps.ekm, body)...)
	req = append(req, body...)
	if _, err := ps.tc.Write(req); err != nil {
		return 0, nil, fmt.Errorf("send request: %w", err)
	}
	var head [1 + 32 + 2]byte
	if _, err := io.ReadFull(ps.tc, head[:]); err != nil {
		return 0, nil, fmt.Errorf("read answer: %w", err)
	}
	n := int(binary.BigEndian.Uint16(head[33:]))
	if n > forwardMaxMessage {
		return 0, nil, fmt.Errorf("answer message of %d bytes exceeds %d", n, forwardMaxMessage)
	}
	msg := make([]byte, n)
	if _, err := io.ReadFull(ps.tc, msg); err != nil {
		return 0, nil, fmt.Errorf("read answer: %w", err)
	}
	signed := append([]byte{head[0]}, head[33:]...)
	signed = append(signed, msg...)
	if !hmac.Equal(head[1:33], forwardMAC(secret, "answer", ps.ekm, signed)) {
		return 0, nil, errors.New("the answer carries no valid proof of the shared secret: PROVIDER_PEER_SECRET_FILE differs between the replicas")
	}
	return forwardStatus(head[0]), msg, nil
}

func forwardMAC(secret []byte, role string, ekm, body []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(role))
	m.Write(ekm)
	m.Write(body)
	return m.Sum(nil)
}

// ForwardServerOptions configure the server side (NewForwardServer).
type ForwardServerOptions struct {
	// Member is the cluster member whose guests this server dials.
	Member string
	// Local dials them (netns, with an OnMember lookup).
	Local Dialer
	// Secrets are the replicas' shared secrets (SIGHUP replaces them);
	// Secret, when Secrets is nil, is the one secret.
	Secrets *PeerSecrets
	Secret  []byte
	// Observe, if set, is told of every request's outcome (from
	// ForwardServerOutcomes) and, when it failed, why.
	Observe func(outcome string, reason error)
	// Opened, if set, is told when a forwarded connection opens (+1) and
	// closes (-1).
	Opened func(delta int)
	// Wake, if set, serves the other replicas' wakes of the targets this
	// replica wakes (see PeerWaker): it wakes the target, sharing the
	// replica's one flight for it, and answers what that settled on
	// within ctx. ErrNotTheWaker sends the asking replica to wake the
	// target itself. Without it every wake is answered that way.
	Wake func(ctx context.Context, req WakeRequest) (WakeAnswer, error)
}

// ForwardServer accepts other replicas' forwarded dials.
type ForwardServer struct {
	o       ForwardServerOptions
	secrets *PeerSecrets
	tls     *tls.Config

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// NewForwardServer returns a server with a fresh self-signed certificate.
func NewForwardServer(o ForwardServerOptions) (*ForwardServer, error) {
	secrets, err := secretsOf(o.Secrets, o.Secret)
	if err != nil {
		return nil, err
	}
	if o.Local == nil || o.Member == "" {
		return nil, errors.New("guest: a forwarding server needs its member and its local dialer")
	}
	cert, err := throwawayCertificate()
	if err != nil {
		return nil, err
	}
	if o.Observe == nil {
		o.Observe = func(string, error) {}
	}
	if o.Opened == nil {
		o.Opened = func(int) {}
	}
	o.Secret = nil
	return &ForwardServer{o: o, secrets: secrets, conns: map[net.Conn]struct{}{},
		tls: &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}}, nil
}

// Serve accepts on ln until ctx ends, then closes ln and every connection
// it holds and returns once their goroutines have ended.
func (s *ForwardServer) Serve(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, func() {
		_ = ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
	})
	defer stop()
	defer s.wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("guest: forwarding listener: %w", err)
		}
		if !s.track(c) {
			_ = c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.untrack(c)
			s.serveConn(ctx, c)
		}()
	}
}

func (s *ForwardServer) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conns == nil {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *ForwardServer) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	_ = c.Close()
}

// request is a decoded, authenticated request.
type forwardRequest struct {
	target Target
	budget time.Duration
	secret []byte // the secret its proof was made with
}

func (s *ForwardServer) serveConn(ctx context.Context, raw net.Conn) {
	if tc, ok := raw.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	_ = raw.SetDeadline(time.Now().Add(forwardHandshake))
	tc := tls.Server(raw, s.tls)
	hctx, cancel := context.WithTimeout(ctx, forwardHandshake)
	err := tc.HandshakeContext(hctx)
	cancel()
	if err != nil {
		s.o.Observe(ForwardRefused, fmt.Errorf("TLS handshake from %s: %w", raw.RemoteAddr(), err))
		return
	}
	cs := tc.ConnectionState()
	ekm, err := cs.ExportKeyingMaterial(forwardExporter, nil, 32)
	if err != nil {
		s.o.Observe(ForwardRefused, fmt.Errorf("keying material: %w", err))
		return
	}
	// The answer is proved with the secret the request was proved with,
	// which the client holds; a refusal of a request proved with none of
	// ours is proved with the one this replica proves itself with.
	secret := s.secrets.proving()
	answer := func(st forwardStatus, msg string) error {
		if len(msg) > forwardMaxMessage {
			msg = msg[:forwardMaxMessage]
		}
		signed := []byte{byte(st)}
		signed = binary.BigEndian.AppendUint16(signed, uint16(len(msg)))
		signed = append(signed, msg...)
		out := []byte{byte(st)}
		out = append(out, forwardMAC(secret, "answer", ekm, signed)...)
		out = append(out, signed[1:]...)
		_, err := tc.Write(out)
		return err
	}
	var prefix [len(forwardMagic) + 32]byte
	if _, err := io.ReadFull(tc, prefix[:]); err != nil {
		s.o.Observe(ForwardRefused, fmt.Errorf("request from %s: read: %w", raw.RemoteAddr(), err))
		return
	}
	mac := prefix[len(forwardMagic):]
	switch string(prefix[:len(forwardMagic)]) {
	case forwardMagic:
	case wakeMagic:
		s.serveWake(ctx, tc, ekm, mac, func(proved []byte) { secret = proved }, answer)
		return
	default:
		s.o.Observe(ForwardRefused, fmt.Errorf("request from %s: not a forwarding request (bad magic)", raw.RemoteAddr()))
		_ = answer(fwdRefused, "not a forwarding request (bad magic)")
		return
	}
	req, err := s.readRequest(tc, ekm, mac)
	if req.secret != nil {
		secret = req.secret
	}
	if err != nil {
		s.o.Observe(ForwardRefused, fmt.Errorf("request from %s: %w", raw.RemoteAddr(), err))
		_ = answer(fwdRefused, err.Error())
		return
	}
	dctx, cancel := context.WithTimeout(ctx, req.budget)
	// The client's hang-up ends the dial too.
	_ = raw.SetDeadline(time.Now().Add(req.budget))
	g, err := s.o.Local.DialContext(dctx, req.target)
	cancel()
	if err != nil {
		st := fwdDialFailed
		switch {
		case errors.Is(err, ErrNotOnMember):
			st = fwdNotHere
		case errors.Is(err, ErrNotRunning):
			st = fwdNotRunning
		}
		if st == fwdDialFailed {
			s.o.Observe(ForwardFailed, err)
		} else {
			s.o.Observe(ForwardGuest, err)
		}
		_ = answer(st, err.Error())
		return
	}
	defer func() { _ = g.Close() }()
	if err := answer(fwdOK, ""); err != nil {
		s.o.Observe(ForwardFailed, fmt.Errorf("answer %s: %w", raw.RemoteAddr(), err))
		return
	}
	_ = raw.SetDeadline(time.Time{})
	s.o.Observe(ForwardOK, nil)
	s.o.Opened(1)
	defer s.o.Opened(-1)
	join(tc, g)
}

// readRequest reads a dial request's body, after its magic and mac.
func (s *ForwardServer) readRequest(tc *tls.Conn, ekm, mac []byte) (forwardRequest, error) {
	var fixed [2 + 4 + 1]byte
	if _, err := io.ReadFull(tc, fixed[:]); err != nil {
		return forwardRequest{}, fmt.Errorf("read: %w", err)
	}
	n := int(fixed[6])
	if n == 0 || n > maxInstanceName {
		return forwardRequest{}, fmt.Errorf("instance name of %d bytes: want 1 to %d", n, maxInstanceName)
	}
	name := make([]byte, n)
	if _, err := io.ReadFull(tc, name); err != nil {
		return forwardRequest{}, fmt.Errorf("read: %w", err)
	}
	body := append(fixed[:], name...)
	proved := s.proved(mac, "dial", ekm, body)
	if proved == nil {
		return forwardRequest{}, errors.New("the request carries no valid proof of the shared secret")
	}
	t := Target{Instance: string(name), Port: int(binary.BigEndian.Uint16(fixed[0:2])), Location: s.o.Member}
	if err := t.validate(); err != nil {
		return forwardRequest{secret: proved}, err
	}
	budget := time.Duration(binary.BigEndian.Uint32(fixed[2:6])) * time.Millisecond
	return forwardRequest{target: t, budget: max(time.Millisecond, min(budget, forwardMaxBudget)), secret: proved}, nil
}

// proved is the accepted secret that mac proves body with, nil for none.
func (s *ForwardServer) proved(mac []byte, role string, ekm, body []byte) []byte {
	for _, secret := range s.secrets.accepted() {
		if hmac.Equal(mac, forwardMAC(secret, role, ekm, body)) {
			return secret
		}
	}
	return nil
}

// join copies both ways. When one direction ends, its end is passed on as
// a half-close (so what was sent before it, a going-away frame say, is
// delivered rather than cut by a reset) and the other direction has
// joinGrace to end too before both connections are closed: a daemon that
// never closes its side cannot hold the connection and its goroutines.
func join(a, b net.Conn) {
	done := make(chan struct{}, 2)
	go func() {
		_, _ = io.Copy(b, a)
		closeWrite(b)
		done <- struct{}{}
	}()
	go func() {
		_, _ = io.Copy(a, b)
		closeWrite(a)
		done <- struct{}{}
	}()
	<-done
	t := time.NewTimer(joinGrace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		_ = a.Close()
		_ = b.Close()
		<-done
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		if cw.CloseWrite() == nil {
			return
		}
	}
	_ = c.Close()
}
