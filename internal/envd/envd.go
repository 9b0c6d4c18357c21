// Package envd is the provider's own data-plane client of a guest daemon:
// the handshake and env/getIdle, which is all the readiness probe and the
// idle loop need. The connection itself (a network namespace dial, a proxy
// socket, a guest address) is another package's business; this one speaks
// WebSocket JSON-RPC over whatever net.Conn it is given.
//
// The daemon is not this project's: a real lightspeed-envd may answer
// members this client does not model. The handshake therefore checks the
// facts it relies on strictly (plane, protocolVersion, daemonInstanceId,
// serverInfo) and keeps the rest of the initialize response as raw JSON,
// and env/getIdle reads idleForMs strictly while setting every other
// member aside as a diagnostic: an idle loop that broke on a diagnostic
// field would keep every target awake forever.
package envd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// ProtocolVersion is the data-plane version this client speaks.
const ProtocolVersion = 5

// Plane is the plane this client expects the daemon to serve.
const Plane = "data"

// ClientInfo describes this client's build in initialize (descriptive only).
type ClientInfo = buildinfo.Peer

// ServerInfo describes the daemon's build, as it reported it.
type ServerInfo = ClientInfo

// InitializeResult holds what the handshake checked, and every member of
// the response as received.
type InitializeResult struct {
	ProtocolVersion  uint64
	Plane            string
	DaemonInstanceID string
	ServerInfo       ServerInfo
	// Members is the whole response, member by member, for callers that
	// want capabilities, limits or platform facts.
	Members map[string]json.RawMessage
}

// HandshakeError says the daemon answered initialize, but not as a data
// plane of this version: the client reached the wrong socket or a daemon of
// another version. (A daemon that refuses our version answers an error
// instead, returned as a *jsonrpc.Error of kind versionMismatch.)
type HandshakeError struct {
	Field    string // "plane" or "protocolVersion"
	Expected string
	Received string
}

func (e *HandshakeError) Error() string {
	return fmt.Sprintf("envd: the daemon answered initialize with %s %s, but this client needs %s", e.Field, e.Received, e.Expected)
}

// AnsweredError says the daemon answered initialize, in a well-formed
// JSON-RPC response to this client's request, but not with a data-plane
// initialize result of this version: an error object (versionMismatch
// among them, or one whose kind this version does not know), a result of
// another plane or version (a *HandshakeError), or a result this version
// cannot read. Something that speaks the protocol's
// envelope is listening, which is all a readiness probe asks: the runtime's
// own handshake meets the same answer and judges it (it fails an
// environment whose daemon speaks another version, naming both).
//
// Everything else Handshake returns means no answer came: the dial, the
// WebSocket upgrade or the connection failed, the context ended first, or
// what came back was no JSON-RPC response to the request (not JSON, a
// binary frame, a request of the server's, a null id).
type AnsweredError struct {
	// Err is the answer's problem: a *jsonrpc.Error, a *HandshakeError or a
	// decoding error.
	Err error
}

func (e *AnsweredError) Error() string { return "envd: initialize answered: " + e.Err.Error() }

func (e *AnsweredError) Unwrap() error { return e.Err }

// Answered says whether err is a well-formed answer to initialize that was
// not a compatible success (an *AnsweredError).
func Answered(err error) bool {
	var ae *AnsweredError
	return errors.As(err, &ae)
}

// Mismatch names what the daemon's answer disagrees on and both sides'
// values: "protocolVersion" with the daemon's number and this client's, or
// "plane" with the daemon's plane and this client's. ok is false for any
// other answer.
func (e *AnsweredError) Mismatch() (field, daemon, client string, ok bool) {
	var rpc *jsonrpc.Error
	if errors.As(e.Err, &rpc) && rpc.Kind == jsonrpc.KindVersionMismatch {
		// The daemon's refusal states its number as expected, and ours, as
		// it read it, as received.
		daemon, client = "unknown", strconv.Itoa(ProtocolVersion)
		if rpc.Expected != nil {
			daemon = strconv.FormatUint(*rpc.Expected, 10)
		}
		if rpc.Received != nil {
			client = strconv.FormatUint(*rpc.Received, 10)
		}
		return "protocolVersion", daemon, client, true
	}
	var he *HandshakeError
	if errors.As(e.Err, &he) {
		return he.Field, he.Received, he.Expected, true
	}
	return "", "", "", false
}

// IsVersionMismatch says whether err is a version disagreement, either way
// round: the daemon refused our version, or it answered with another one.
func IsVersionMismatch(err error) bool {
	var rpc *jsonrpc.Error
	if errors.As(err, &rpc) && rpc.Kind == jsonrpc.KindVersionMismatch {
		return true
	}
	var he *HandshakeError
	return errors.As(err, &he) && he.Field == "protocolVersion"
}

// Session is one initialized data connection.
type Session struct {
	client *jsonrpc.Client
	init   InitializeResult
}

// Handshake upgrades conn to a WebSocket (URL ws://guest/), then sends the
// data-plane initialize with protocolVersion 5 and checks the answer's plane
// and protocolVersion. It is bounded by ctx; on any failure conn is closed.
// A daemon that answered, but not with a usable success, fails it with an
// *AnsweredError.
func Handshake(ctx context.Context, conn net.Conn, client ClientInfo) (*Session, error) {
	if problem := wire.CheckGrammar(wire.GrammarInfo, client.Name); problem != "" {
		conn.Close()
		return nil, fmt.Errorf("envd: clientInfo.name %s", problem)
	}
	// A context without a deadline must still interrupt a stalled peer.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	used := false
	dialer := websocket.Dialer{
		NetDialContext: func(context.Context, string, string) (net.Conn, error) {
			if used {
				return nil, errors.New("envd: the connection was already used")
			}
			used = true
			return conn, nil
		},
		// The provider keeps one session per running target (the idle loop
		// probes over it), so buffers are small and writes share a pool:
		// 64 KiB each way cost 1.25 GiB at 10,000 targets, and a 4 KiB read
		// buffer still 40 MiB. A getIdle answer is a few hundred bytes; a
		// larger message (the initialize answer) is read through in pieces.
		ReadBufferSize:  1 << 10,
		WriteBufferSize: 4 << 10,
		WriteBufferPool: writeBuffers,
	}
	ws, resp, err := dialer.DialContext(ctx, "ws://guest/", nil)
	if resp != nil {
		// Only the status is read from resp; the library has already kept
		// what it wanted of the body.
		_ = resp.Body.Close()
	}
	if err != nil {
		conn.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("envd: WebSocket upgrade: %w", ctx.Err())
		}
		if resp != nil {
			return nil, fmt.Errorf("envd: WebSocket upgrade refused with HTTP %s: %w", resp.Status, err)
		}
		return nil, fmt.Errorf("envd: WebSocket upgrade: %w", err)
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	rpc := jsonrpc.NewClient(ws)
	s, err := initialize(ctx, rpc, client)
	if err != nil {
		_ = rpc.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("envd: handshake: %w", ctx.Err())
		}
		return nil, err
	}
	if !stop() {
		// ctx ended just as the handshake finished: the deadline may be set.
		_ = rpc.Close()
		return nil, fmt.Errorf("envd: handshake: %w", ctx.Err())
	}
	return s, nil
}

func initialize(ctx context.Context, rpc *jsonrpc.Client, client ClientInfo) (*Session, error) {
	params := struct {
		ProtocolVersion uint64     `json:"protocolVersion"`
		ClientInfo      ClientInfo `json:"clientInfo"`
	}{ProtocolVersion, client}
	// The result is taken raw and read here, so that a result that does
	// not decode (an answer all the same) is told from a transport failure.
	// The envelope's own depth bound keeps the raw decode from failing.
	var raw json.RawMessage
	if err := rpc.Call(ctx, "initialize", params, &raw); err != nil {
		if answeredWithError(err) {
			return nil, &AnsweredError{Err: err}
		}
		return nil, err
	}
	var members map[string]json.RawMessage
	if err := wire.Decode(raw, &members); err != nil {
		return nil, &AnsweredError{Err: fmt.Errorf("envd: initialize answered a result that is not an object: %w", err)}
	}
	res, err := checkInitialize(members)
	if err != nil {
		return nil, &AnsweredError{Err: err}
	}
	return &Session{client: rpc, init: *res}, nil
}

// answeredWithError says whether a failed call is the daemon's error answer
// to it. The client returns that answer's *jsonrpc.Error as it is; when the
// connection ended instead (a null-id refusal of a frame among the causes)
// the error is jsonrpc.ErrClosed, whatever it wraps: a daemon that cannot
// read a well-formed initialize did not answer it.
func answeredWithError(err error) bool {
	var rpc *jsonrpc.Error
	return errors.As(err, &rpc) && !errors.Is(err, jsonrpc.ErrClosed)
}

// checkInitialize reads the members a client relies on: plane and
// protocolVersion first (before anything else is trusted), then the
// daemon's identity.
func checkInitialize(members map[string]json.RawMessage) (*InitializeResult, error) {
	res := &InitializeResult{Members: members}
	decode := func(name string, v any) error {
		raw, ok := members[name]
		if !ok {
			return fmt.Errorf("envd: initialize answered without %s", name)
		}
		if err := wire.Decode(raw, v); err != nil {
			var fe *wire.FieldError
			if errors.As(err, &fe) {
				return fmt.Errorf("envd: initialize answered a bad %s: %w", name, &wire.FieldError{Path: joinPath(name, fe.Path), Problem: fe.Problem})
			}
			return fmt.Errorf("envd: initialize answered a bad %s: %w", name, err)
		}
		return nil
	}
	if err := decode("protocolVersion", &res.ProtocolVersion); err != nil {
		return nil, err
	}
	if res.ProtocolVersion != ProtocolVersion {
		return nil, &HandshakeError{Field: "protocolVersion", Expected: strconv.Itoa(ProtocolVersion), Received: strconv.FormatUint(res.ProtocolVersion, 10)}
	}
	if err := decode("plane", &res.Plane); err != nil {
		return nil, err
	}
	if res.Plane != Plane {
		return nil, &HandshakeError{Field: "plane", Expected: strconv.Quote(Plane), Received: strconv.Quote(res.Plane)}
	}
	if err := decode("daemonInstanceId", &res.DaemonInstanceID); err != nil {
		return nil, err
	}
	if problem := wire.CheckGrammar(wire.GrammarInfo, res.DaemonInstanceID); problem != "" {
		return nil, fmt.Errorf("envd: initialize answered a bad daemonInstanceId: %w", &wire.FieldError{Path: "daemonInstanceId", Problem: problem})
	}
	if err := decode("serverInfo", &res.ServerInfo); err != nil {
		return nil, err
	}
	return res, nil
}

func joinPath(a, b string) string {
	if b == "" {
		return a
	}
	return a + "." + b
}

// Initialized is what the daemon answered to initialize.
func (s *Session) Initialized() InitializeResult { return s.init }

// Idle is an env/getIdle answer.
type Idle struct {
	IdleForMs uint64
	// IdleFor is IdleForMs as a duration.
	IdleFor time.Duration
	// Counts holds the diagnostic `…Count` members, by wire name.
	Counts map[string]uint64
	// Ignored names, sorted, the other members the daemon sent: neither
	// idleForMs nor a well-formed count.
	Ignored []string
}

// GetIdle asks how long the environment has been unused. It is not use.
func (s *Session) GetIdle(ctx context.Context) (Idle, error) {
	var raw json.RawMessage
	if err := s.client.Call(ctx, "env/getIdle", struct{}{}, &raw); err != nil {
		return Idle{}, err
	}
	idle, err := DecodeIdle(raw)
	if err != nil {
		return Idle{}, fmt.Errorf("envd: env/getIdle answered %w", err)
	}
	return idle, nil
}

// DecodeIdle reads an env/getIdle result: idleForMs, the one member the
// idle decision reads, is required and strict (an unsigned integer below
// 2^53); a *wire.FieldError names it otherwise. The rest are the
// daemon's diagnostics, whose names the contract does not fix: a
// `…Count` member holding an unsigned integer below 2^32 is kept in
// Counts, and any other member is set aside, by name, in Ignored. None is
// refused: an idle loop that refused a diagnostic it does not know would
// keep a newer daemon's target awake forever (issue 26).
func DecodeIdle(raw []byte) (Idle, error) {
	var members map[string]json.RawMessage
	if err := wire.Decode(raw, &members); err != nil {
		return Idle{}, err
	}
	idle := Idle{Counts: map[string]uint64{}}
	rawIdle, ok := members["idleForMs"]
	if !ok {
		return Idle{}, &wire.FieldError{Path: "idleForMs", Problem: "is required"}
	}
	var err error
	if idle.IdleForMs, err = unsignedMember("idleForMs", rawIdle, wire.MaxSafeInteger); err != nil {
		return Idle{}, err
	}
	idle.IdleFor = time.Duration(idle.IdleForMs) * time.Millisecond
	for name, value := range members {
		if name == "idleForMs" {
			continue
		}
		if strings.HasSuffix(name, "Count") && len(name) > len("Count") {
			if n, err := unsignedMember(name, value, math.MaxUint32); err == nil {
				idle.Counts[name] = n
				continue
			}
		}
		idle.Ignored = append(idle.Ignored, name)
	}
	slices.Sort(idle.Ignored)
	return idle, nil
}

func unsignedMember(name string, raw json.RawMessage, most uint64) (uint64, error) {
	var n uint64
	if err := wire.Decode(raw, &n); err != nil {
		var fe *wire.FieldError
		if errors.As(err, &fe) {
			return 0, &wire.FieldError{Path: joinPath(name, fe.Path), Problem: fe.Problem}
		}
		return 0, err
	}
	if n > most {
		return 0, &wire.FieldError{Path: name, Problem: fmt.Sprintf("must be at most %d", most)}
	}
	return n, nil
}

// Done is closed when the connection has ended.
func (s *Session) Done() <-chan struct{} { return s.client.Done() }

// Close ends the session with a normal close frame.
func (s *Session) Close() error { return s.client.Close() }

// writeBuffers is shared by every session: a write buffer is held only while
// a message is being written.
var writeBuffers = &sync.Pool{}
