// Package jsonrpc is the protocol's JSON-RPC 2.0 envelope over WebSocket,
// shared by every plane this project serves or dials: the controller server,
// the development guest daemon, and the provider's own data-plane client.
//
// It owns the rules the spec states once for all planes (framing errors,
// the handshake, pipelining, the 16 MiB limit, typed errors) so that no
// plane can drift from them.
package jsonrpc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// MaxMessageBytes is the protocol's limit on every message, and so on every
// frame, on every hop.
const MaxMessageBytes = 16 << 20

// MinInFlight is the protocol's floor on requests a server accepts in flight
// per connection.
const MinInFlight = 16

// Method serves one request. A returned *Error is sent as is; any other
// error is a defect and goes out as `internal`.
type Method func(ctx context.Context, params json.RawMessage) (any, error)

// Server serves one plane on WebSocket connections.
type Server struct {
	Plane           string
	ProtocolVersion uint64
	// Initialize runs after the server has checked that this is the first
	// initialize and that protocolVersion is present and equal to ours.
	Initialize Method
	Methods    map[string]Method
	// Notifications handle client notifications by method; others are dropped.
	Notifications map[string]func(ctx context.Context, params json.RawMessage)
	// MaxInFlight bounds concurrent requests per connection (at least MinInFlight).
	MaxInFlight int
	// Observe, when set, sees every answered request: the method (or
	// "unknown" for a name not served, to keep label sets bounded), the
	// error kind sent ("" on success) and the time taken. It is called
	// from several goroutines at once.
	Observe func(method string, kind Kind, d time.Duration)
	// WriteTimeout bounds one message write to a slow reader (default 30 s).
	WriteTimeout time.Duration
	// OnInternal, when set, sees the cause of every `internal` answer the
	// server makes up itself: an error that is not an *Error, a panic (with
	// its stack), or a result that does not encode. The client only ever
	// sees a fixed sentence.
	OnInternal func(method string, err error)
	// Budget, when set, bounds the bytes of large frames in decode at once
	// across every connection sharing it (see Budget); nil bounds none.
	Budget *Budget
	// OnBudgetRefused, when set, is told of each request refused for want
	// of budget (for metrics).
	OnBudgetRefused func()

	drainOnce sync.Once
	drainCh   chan struct{} // closed by Drain
}

// drainRetryMs is the retryAfterMs of a request refused while draining:
// the client's next connection reaches another replica at once.
const drainRetryMs = 100

// Drain begins a graceful end of every connection, open or to come: each
// answers every request it has in flight, refuses new ones as
// `unavailable` (a client asks again, on a connection that reaches another
// replica), and once nothing is in flight and every answer is written,
// closes with 1001 (going away). It does not wait; a connection whose
// requests do not end keeps running until ServeConn's ctx ends.
func (s *Server) Drain() {
	ch := s.draining()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

func (s *Server) draining() chan struct{} {
	s.drainOnce.Do(func() { s.drainCh = make(chan struct{}) })
	return s.drainCh
}

// goingAwayWait bounds a shutdown's close handshake on each connection.
const goingAwayWait = time.Second

type ctxKey struct{}

// RequestID is the id of the request a Method is serving.
func RequestID(ctx context.Context) (json.RawMessage, bool) {
	id, ok := ctx.Value(ctxKey{}).(json.RawMessage)
	return id, ok
}

var nullID = json.RawMessage("null")

type conn struct {
	srv   *Server
	ws    *websocket.Conn
	out   *outbox
	slots chan struct{}
	wg    sync.WaitGroup

	// The drain's view of requests in flight: once drainMu finds the
	// connection draining, no request is admitted, and idle is closed as
	// the last one in flight is answered (queued for writing).
	drainMu      sync.Mutex
	drainStarted bool
	inFlight     int
	idle         chan struct{}

	initMu      sync.Mutex
	initialized bool
}

// ServeConn runs the connection until it closes or ctx ends. Requests are
// dispatched concurrently and answered in any order; the ctx handed to a
// Method ends when the connection does.
func (s *Server) ServeConn(ctx context.Context, ws *websocket.Conn) error {
	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	most := s.MaxInFlight
	if most < MinInFlight {
		most = MinInFlight
	}
	c := &conn{srv: s, ws: ws, slots: make(chan struct{}, most), idle: make(chan struct{})}
	c.out = newOutbox(ws, c.writeTimeout())
	go c.out.run()
	ws.SetReadLimit(MaxMessageBytes)
	// The pong goes to the outbox, ahead of every queued answer; gorilla's
	// default handler would write it here, in the read loop, and give up
	// after one second behind an answer being written.
	ws.SetPingHandler(func(appData string) error {
		c.out.ping(appData)
		return nil
	})
	stop := context.AfterFunc(ctx, func() {
		if parent.Err() == nil {
			_ = ws.Close() // the connection ended by itself
			return
		}
		// The server goes away (a shutdown): say so with a close frame, and
		// let the read loop take the peer's answering close, for at most
		// goingAwayWait, so the peer sees 1001 rather than a cut (1006).
		deadline := time.Now().Add(goingAwayWait)
		if ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseGoingAway, "server shutting down"), deadline) != nil {
			_ = ws.Close()
			return
		}
		_ = ws.SetReadDeadline(deadline)
	})
	defer stop()
	drained := make(chan struct{})
	defer close(drained)
	go c.drainWhenAsked(ctx, drained)
	defer c.wg.Wait()
	defer func() {
		// The read loop has ended: no answer can reach the peer any more.
		// Closing the socket first ends a write that waits on a peer that
		// does not read; what is queued is dropped, and every method's
		// answer with it.
		_ = ws.Close()
		c.out.close()
	}()
	defer cancel()
	for {
		msgType, data, err := ws.ReadMessage()
		if err != nil {
			if websocket.IsCloseError(err, websocket.CloseNormalClosure, websocket.CloseGoingAway, websocket.CloseNoStatusReceived) || ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("jsonrpc: read: %w", err)
		}
		if msgType != websocket.TextMessage {
			c.reply("", nullID, nil, Errorf(KindInvalidRequest, "Binary frames are not part of the protocol; send each message as one text frame."), nil)
			continue
		}
		// The frame is admitted before anything is decoded from it; one
		// that finds no room is still read as an envelope (which costs no
		// more than the names it keeps), so that a request is refused with
		// its own id, and then refused rather than served.
		release := s.Budget.acquire(ctx, len(data))
		c.handle(ctx, data, release)
	}
}

type envelope struct {
	id       json.RawMessage // nil when absent
	method   string
	params   json.RawMessage
	hasParam bool
	// release returns the frame's budget; nil when the frame found none
	// and is to be refused.
	release func()
	// queued, when set, is called as the outbox takes the answer (or drops
	// it, the connection being gone).
	queued func()
}

// envelopeMembers are the names a request may carry.
var envelopeMembers = []string{"jsonrpc", "id", "method", "params"}

// nested stands for an envelope member's value that is an array or an
// object. No member but params may be one, so the value itself is never
// needed, and leaving it undecoded keeps a deep one from costing anything.
type nested struct{}

// frame is what one text frame says under the envelope rules alone. None of
// it depends on the connection, so that the rules can be fuzzed without one
// (FuzzDecodeFrame): a frame sent over a live connection costs a round trip
// and both answers' decoding, which keeps FuzzServeFrame to a few thousand
// executions a second.
type frame struct {
	// refusal, when set, answers the frame at once: with id when it has
	// one, with a null id otherwise. A notification with a refusal is
	// dropped, as every malformed notification is.
	refusal      *Error
	id           json.RawMessage // nil when absent or malformed
	method       string
	params       *wire.Member // nil when absent
	notification bool         // no id: never answered
}

// decodeFrame reads one frame. Any frame that is valid JSON is read, however
// deep: parseError says "not JSON" and nothing else. Depth is then judged
// where it lies: params nested past wire.MaxDepth are invalidParams naming
// the limit (paramsProblem, which handle applies once it knows whether the
// connection is initialized); any other member that nests at all is refused
// by the envelope rules (an id, jsonrpc or method must be a string or a
// number; another member is unknown), and a batch is a batch however deep.
func decodeFrame(data []byte) frame {
	members, unknown, isObject, err := wire.SplitNamed(data, envelopeMembers...)
	if err != nil {
		return frame{refusal: Errorf(KindParseError, "The frame is not one JSON value: send exactly one JSON-RPC message per text frame.")}
	}
	if !isObject {
		if t := bytes.TrimLeft(data, " \t\r\n"); t[0] == '[' {
			return frame{refusal: Errorf(KindInvalidRequest, "Batches are not supported; send each request in its own frame.")}
		}
		return frame{refusal: Errorf(KindInvalidRequest, "A JSON-RPC message must be an object.")}
	}
	obj := make(map[string]any, len(members)+1)
	if unknown != nil {
		// Any member past the four is refused, and naming one is enough.
		obj[*unknown] = nested{}
	}
	var f frame
	repeated := ""
	for i, m := range members {
		if m.Repeated {
			if m.Name == "id" {
				// Which of its ids the sender meant is unknown: the
				// refusal cannot name one.
				return frame{refusal: Errorf(KindInvalidRequest, "The envelope member id is sent more than once; send it once.")}
			}
			repeated = m.Name
		}
		if m.Name == "params" {
			f.params = &members[i]
			obj[m.Name] = nested{}
			continue
		}
		obj[m.Name] = scalar(m)
	}
	id, idOK := parseID(obj)
	method, methodIsString := obj["method"].(string)
	if !idOK {
		if _, present := obj["id"]; present {
			return frame{refusal: Errorf(KindInvalidRequest, "The id must be an integer or a string.")}
		}
		// No id: a notification, well-formed or not, is never answered.
		if methodIsString {
			f.notification, f.method = true, method
			if problem := envelopeProblem(obj); problem != "" || repeated != "" {
				f.refusal = Errorf(KindInvalidRequest, "A malformed notification is dropped.")
			}
			return f
		}
		return frame{refusal: Errorf(KindInvalidRequest, "A request needs an id and a string method.")}
	}
	f.id, f.method = id, method
	if problem := envelopeProblem(obj); problem != "" {
		f.refusal = Errorf(KindInvalidRequest, "%s", problem)
	} else if repeated != "" {
		f.refusal = Errorf(KindInvalidRequest, "The envelope member %s is sent more than once; send it once.", repeated)
	}
	return f
}

// handle serves one frame.
//
// release returns the frame's budget (nil: it found none). handle calls it
// once it is done with the frame, or hands it to the request that serves it.
func (c *conn) handle(ctx context.Context, data []byte, release func()) {
	owned := true
	defer func() {
		if owned && release != nil {
			release()
		}
	}()
	f := decodeFrame(data)
	switch {
	case f.notification:
		if f.refusal == nil {
			c.notify(ctx, f)
		}
		return
	case f.id == nil:
		c.reply("", nullID, nil, f.refusal, nil)
		return
	}
	env := envelope{id: f.id, method: f.method}
	if f.refusal != nil {
		c.finish(env, time.Now(), nil, f.refusal)
		return
	}
	if f.params != nil {
		env.hasParam = true
		// Handshake rule 1 comes first: before initialize, every other
		// request is notInitialized, whatever its params; and rule 3 after
		// it: a second initialize is invalidRequest, whatever its params.
		if initialized := c.isInitialized(); f.method == "initialize" && !initialized || f.method != "initialize" && initialized {
			if e := paramsProblem(f.params); e != nil {
				c.finish(env, time.Now(), nil, e)
				return
			}
		}
		env.params = f.params.Value
	} else {
		env.params = json.RawMessage("{}")
	}
	owned = false
	env.release = release
	c.request(ctx, env)
}

// scalar decodes an envelope member that holds no array or object.
func scalar(m wire.Member) any {
	if m.Depth > 0 {
		return nested{}
	}
	dec := json.NewDecoder(bytes.NewReader(m.Value))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nested{} // cannot happen: Split checked the frame
	}
	return v
}

// paramsProblem is the refusal of params that are not an object, or that
// nest deeper than any method may decode; nil for acceptable params.
func paramsProblem(params *wire.Member) *Error {
	if params.Value[0] != '{' {
		return InvalidParams("", "The params must be an object of named members, not %s.", wire.DescribeJSON(params.Value))
	}
	if params.Depth > wire.MaxDepth {
		return InvalidParams("", "The params nest arrays and objects %d levels deep; this server accepts at most %d levels.", params.Depth, wire.MaxDepth)
	}
	return nil
}

// parseID reads the id, as JSON: an integer or a string. ok is false when it
// is absent or malformed.
func parseID(obj map[string]any) (id json.RawMessage, ok bool) {
	switch v := obj["id"].(type) {
	case string:
		b, _ := json.Marshal(v)
		return b, true
	case json.Number:
		n, err := v.Int64()
		if err != nil {
			return nil, false
		}
		// The id's value, written as an integer is written: -0 is 0, and a
		// peer that compares the answer's id with its request's by text
		// (or by value) finds its own.
		return json.RawMessage(strconv.FormatInt(n, 10)), true
	}
	return nil, false
}

func envelopeProblem(obj map[string]any) string {
	for k := range obj {
		switch k {
		case "jsonrpc", "id", "method", "params":
		default:
			return fmt.Sprintf("The envelope member %q is not part of a JSON-RPC request.", k)
		}
	}
	if v, _ := obj["jsonrpc"].(string); v != "2.0" {
		return `The member jsonrpc must be the string "2.0".`
	}
	if _, ok := obj["method"].(string); !ok {
		return "A request needs a string method."
	}
	return ""
}

// notify serves a well-formed notification; one the server does not handle,
// or whose params it would refuse, is dropped, since nothing is ever
// answered to a notification.
func (c *conn) notify(ctx context.Context, f frame) {
	if !c.isInitialized() {
		return
	}
	h, ok := c.srv.Notifications[f.method]
	if !ok {
		return
	}
	raw := json.RawMessage("{}")
	if f.params != nil {
		if paramsProblem(f.params) != nil {
			return
		}
		raw = f.params.Value
	}
	h(ctx, raw)
}

func (c *conn) isInitialized() bool {
	c.initMu.Lock()
	defer c.initMu.Unlock()
	return c.initialized
}

// drainWhenAsked ends the connection gracefully once the server drains:
// no request admitted, every one in flight answered and written, then the
// going-away close, whose answer the read loop takes (as on a shutdown).
// It returns when the connection ends (done) whatever it was doing.
func (c *conn) drainWhenAsked(ctx context.Context, done <-chan struct{}) {
	select {
	case <-c.srv.draining():
	case <-done:
		return
	}
	c.drainMu.Lock()
	c.drainStarted = true
	if c.inFlight == 0 {
		close(c.idle)
	}
	c.drainMu.Unlock()
	select {
	case <-c.idle:
	case <-done:
		return
	}
	if !c.out.flushed(ctx) {
		return
	}
	deadline := time.Now().Add(goingAwayWait)
	if c.ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseGoingAway, "server draining"), deadline) != nil {
		_ = c.ws.Close()
		return
	}
	_ = c.ws.SetReadDeadline(deadline)
}

// admit counts a request in flight, unless the connection drains.
func (c *conn) admit() bool {
	c.drainMu.Lock()
	defer c.drainMu.Unlock()
	if c.drainStarted {
		return false
	}
	select {
	case <-c.srv.draining():
		// The drain has begun and has not reached this connection yet:
		// refuse as it will.
		return false
	default:
	}
	c.inFlight++
	return true
}

// answered counts a request's answer queued; the last one in flight of a
// draining connection lets the drain go on.
func (c *conn) answered() {
	c.drainMu.Lock()
	defer c.drainMu.Unlock()
	c.inFlight--
	if c.drainStarted && c.inFlight == 0 {
		close(c.idle)
	}
}

// request serves one well-formed request, and returns its frame's budget
// once the method has returned (or at once, for a request it answers
// itself).
func (c *conn) request(ctx context.Context, env envelope) {
	start := time.Now()
	held := true
	defer func() {
		if held && env.release != nil {
			env.release()
		}
	}()
	if !c.admit() {
		c.finish(env, start, nil, Unavailable(drainRetryMs, "This provider is shutting down and takes no new request; ask again on a new connection, which reaches another replica."))
		return
	}
	inline := true
	defer func() {
		if inline {
			c.answered()
		}
	}()
	if env.release == nil {
		if h := c.srv.OnBudgetRefused; h != nil {
			h()
		}
		c.finish(env, start, nil, c.srv.Budget.refusal())
		return
	}
	if env.method == "initialize" {
		// Inline, so requests pipelined behind initialize see its outcome.
		result, err := c.initialize(ctx, env.params)
		c.finish(env, start, result, err)
		return
	}
	if !c.isInitialized() {
		c.finish(env, start, nil, Errorf(KindNotInitialized, "Call initialize on this connection before %s.", env.method))
		return
	}
	m, ok := c.srv.Methods[env.method]
	if !ok {
		c.finish(env, start, nil, Errorf(KindMethodNotFound, "The %s plane has no method %q.", c.srv.Plane, env.method))
		return
	}
	select {
	case c.slots <- struct{}{}:
	default:
		e := WithReason(KindBusy, "requestLimit", "This connection already has %d requests in flight; wait for an answer before sending more.", cap(c.slots))
		c.finish(env, start, nil, e)
		return
	}
	held, inline = false, false
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer c.answered()
		result, err := c.call(context.WithValue(ctx, ctxKey{}, env.id), m, env.params)
		// The budget is free, and the slot too, before the answer can leave:
		// a client that sends its next request as soon as it reads this
		// answer must find room. The slot is kept until the outbox takes
		// the answer, so that answers waiting for room, for a peer that
		// does not read, are bounded by the slots.
		env.release()
		env.queued = func() { <-c.slots }
		c.finish(env, start, result, err)
	}()
}

func (c *conn) call(ctx context.Context, m Method, params json.RawMessage) (result any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
		}
	}()
	return m(ctx, params)
}

func (c *conn) initialize(ctx context.Context, params json.RawMessage) (any, error) {
	c.initMu.Lock()
	defer c.initMu.Unlock()
	if c.initialized {
		return nil, Errorf(KindInvalidRequest, "This connection is already initialized; initialize is sent once per connection.")
	}
	// Only the version is read before the version is checked: the params
	// are decoded strictly (unknown members refused) by Initialize after it.
	head, _, isObject, err := wire.SplitNamed(params, "protocolVersion")
	if err != nil || !isObject {
		return nil, InvalidParams("", "The params must be an object.")
	}
	if len(head) == 1 && head[0].Repeated {
		return nil, InvalidParams("protocolVersion", "The member protocolVersion is sent more than once; send it once.")
	}
	if len(head) == 0 {
		return nil, InvalidParams("protocolVersion", "The member protocolVersion is required: state the %s plane version you speak (this server speaks %d).", c.srv.Plane, c.srv.ProtocolVersion)
	}
	var version uint64
	if err := wire.Decode(head[0].Value, &version); err != nil {
		return nil, InvalidParams("protocolVersion", "The member protocolVersion must be an unsigned whole number below 2^53.")
	}
	if version != c.srv.ProtocolVersion {
		return nil, &Error{Kind: KindVersionMismatch, Expected: u64(c.srv.ProtocolVersion), Received: u64(version),
			Message: fmt.Sprintf("This server speaks %s protocol version %d, not %d; upgrade or downgrade the client to match.", c.srv.Plane, c.srv.ProtocolVersion, version)}
	}
	result, err := c.call(ctx, c.srv.Initialize, params)
	if err == nil {
		c.initialized = true
	}
	return result, err
}

type response struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Result  json.RawMessage `json:"result,omitempty"`
	Error   *Error          `json:"error,omitempty"`
}

func (c *conn) finish(env envelope, start time.Time, result any, err error) {
	method := env.method
	if _, known := c.srv.Methods[method]; !known && method != "initialize" {
		method = "unknown"
	}
	rpcErr := c.asError(method, err)
	kind := c.reply(method, env.id, result, rpcErr, env.queued)
	if obs := c.srv.Observe; obs != nil {
		obs(method, kind, time.Since(start))
	}
}

func (c *conn) asError(method string, err error) *Error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	c.defect(method, err)
	return Errorf(KindInternal, "The server failed while serving this request (a defect in the server). Retry later.")
}

func (c *conn) defect(method string, err error) {
	if h := c.srv.OnInternal; h != nil {
		h(method, err)
	}
}

func (c *conn) writeTimeout() time.Duration {
	if c.srv.WriteTimeout > 0 {
		return c.srv.WriteTimeout
	}
	return 30 * time.Second
}

// reply sends one response and returns the kind of error it carried ("" for a result).
//
// queued, when set, is called as the outbox takes the answer, or gives up
// on it.
func (c *conn) reply(method string, id json.RawMessage, result any, rpcErr *Error, queued func()) Kind {
	resp := response{JSONRPC: "2.0", ID: id}
	if rpcErr != nil {
		resp.Error = rpcErr
	} else {
		raw, err := json.Marshal(result)
		switch {
		case err != nil:
			c.defect(method, fmt.Errorf("encode result: %w", err))
			resp.Error = Errorf(KindInternal, "The server could not encode its answer (a defect in the server).")
		case string(raw) == "null":
			// The protocol has no null but the id's; a result with no members is {}.
			resp.Result = json.RawMessage("{}")
		default:
			resp.Result = raw
		}
	}
	frame, err := json.Marshal(resp)
	if err == nil && len(frame) > MaxMessageBytes {
		resp.Result, resp.Error = nil, &Error{Kind: KindPayloadTooLarge, LimitBytes: u64(MaxMessageBytes),
			Message: fmt.Sprintf("The answer would be %d bytes, over the %d-byte message limit; ask for less.", len(frame), MaxMessageBytes)}
		frame, err = json.Marshal(resp)
	}
	var kind Kind
	if resp.Error != nil {
		kind = resp.Error.Object().Data.Kind
	}
	if err != nil {
		c.defect(method, fmt.Errorf("encode response: %w", err))
		if queued != nil {
			queued()
		}
		return kind
	}
	c.out.put(frame, queued)
	return kind
}

// DecodeParams decodes params strictly into v; a refusal is invalidParams
// naming the member.
func DecodeParams(params json.RawMessage, v any) error {
	if len(params) == 0 {
		params = json.RawMessage("{}")
	}
	if err := wire.Decode(params, v); err != nil {
		return FromFieldError(err)
	}
	return nil
}
