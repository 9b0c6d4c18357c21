package jsonrpc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// PingInterval is how often a client pings while it waits for an answer: the
// spec asks for at least every 20 seconds.
const PingInterval = 15 * time.Second

// pingEvery is PingInterval; tests shorten it.
var pingEvery = PingInterval

// ErrClosed is returned by calls on a client whose connection has ended.
var ErrClosed = errors.New("jsonrpc: connection closed")

// Client pipelines requests over one connection and matches answers by id.
type Client struct {
	ws      *websocket.Conn
	writeMu sync.Mutex

	mu      sync.Mutex
	nextID  uint64
	pending map[string]chan *inbound
	err     error // why the connection ended; set once
	done    chan struct{}
	reading bool // a read loop runs: exactly while calls wait, or until it sees the end
	closing bool // Close has closed the connection: a read loop runs on until it sees that

	lastPing atomic.Int64 // unix nanoseconds of the last ping sent
}

type inbound struct {
	result json.RawMessage
	err    *Error
}

// NewClient takes over the connection: from now on only it reads.
//
// It reads only while a call waits for its answer. The servers of these
// planes send nothing unasked (no requests, no notifications, and never a
// ping), so a connection kept open between calls, as the idle loop keeps
// one with each of thousands of daemons, needs no goroutine: at 10,000
// sessions their read loops' stacks were 52 MiB of the loop's 239. The
// price is that a peer's close between calls is seen by the next call
// (which fails with ErrClosed), not the moment it comes; Done says so
// then.
func NewClient(ws *websocket.Conn) *Client {
	ws.SetReadLimit(MaxMessageBytes)
	return &Client{ws: ws, pending: map[string]chan *inbound{}, done: make(chan struct{})}
}

// Call sends one request and decodes the result strictly into result (which
// may be nil to discard it). An error answer comes back as *Error.
func (c *Client) Call(ctx context.Context, method string, params any, result any) error {
	if params == nil {
		params = struct{}{}
	}
	rawParams, err := json.Marshal(params)
	if err != nil {
		return fmt.Errorf("jsonrpc: encode %s params: %w", method, err)
	}
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return c.err
	}
	c.nextID++
	id := strconv.FormatUint(c.nextID, 10)
	ch := make(chan *inbound, 1)
	c.pending[id] = ch
	if !c.reading {
		c.reading = true
		go c.readLoop()
	}
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		delete(c.pending, id)
		c.mu.Unlock()
	}()

	frame, err := requestFrame(id, method, rawParams)
	if err != nil {
		return fmt.Errorf("jsonrpc: encode %s: %w", method, err)
	}
	if len(frame) > MaxMessageBytes {
		return &Error{Kind: KindPayloadTooLarge, LimitBytes: u64(MaxMessageBytes),
			Message: fmt.Sprintf("The %s request would be %d bytes, over the %d-byte message limit.", method, len(frame), MaxMessageBytes)}
	}
	if err := c.write(ctx, websocket.TextMessage, frame); err != nil {
		return fmt.Errorf("jsonrpc: send %s: %w", method, err)
	}
	// Pings go only while a call waits, from the call itself: a client
	// kept open between calls (the idle loop's session with each of
	// thousands of daemons) then costs no goroutine and no ticker.
	var ping *time.Timer
	var pingC <-chan time.Time
	if dl, ok := ctx.Deadline(); !ok || time.Until(dl) > pingEvery {
		ping = time.NewTimer(pingEvery)
		defer ping.Stop()
		pingC = ping.C
	}
	for {
		select {
		case in := <-ch:
			if in.err != nil {
				return in.err
			}
			if result == nil {
				return nil
			}
			if err := wire.Decode(in.result, result); err != nil {
				return fmt.Errorf("jsonrpc: %s answered a result that does not decode: %w", method, err)
			}
			return nil
		case <-c.done:
			return c.closedErr()
		case <-ctx.Done():
			return fmt.Errorf("jsonrpc: %s: %w", method, ctx.Err())
		case <-pingC:
			c.ping()
			ping.Reset(pingEvery)
		}
	}
}

// requestFrame writes the request's members around params, which
// json.Marshal produced (compact, valid): marshalling a struct with
// RawMessage members scans them again, which at a thousand idle probes a
// second was a tenth of the loop's CPU.
func requestFrame(id, method string, params []byte) ([]byte, error) {
	quoted, err := json.Marshal(method)
	if err != nil {
		return nil, err
	}
	const a, b, c = `{"jsonrpc":"2.0","id":`, `,"method":`, `,"params":`
	frame := make([]byte, 0, len(a)+len(id)+len(b)+len(quoted)+len(c)+len(params)+1)
	frame = append(frame, a...)
	frame = append(frame, id...)
	frame = append(frame, b...)
	frame = append(frame, quoted...)
	frame = append(frame, c...)
	frame = append(frame, params...)
	return append(frame, '}'), nil
}

// ping sends one ping unless another waiting call sent one within half an
// interval, so that many calls in flight do not each ping.
func (c *Client) ping() {
	now := time.Now().UnixNano()
	last := c.lastPing.Load()
	if now-last < int64(pingEvery/2) || !c.lastPing.CompareAndSwap(last, now) {
		return
	}
	_ = c.ws.WriteControl(websocket.PingMessage, nil, time.Now().Add(5*time.Second))
}

// Notify sends a notification, which is never answered.
func (c *Client) Notify(ctx context.Context, method string, params any) error {
	if params == nil {
		// Params are an object or absent; a null would make the server drop it.
		params = struct{}{}
	}
	raw, err := json.Marshal(struct {
		JSONRPC string `json:"jsonrpc"`
		Method  string `json:"method"`
		Params  any    `json:"params"`
	}{"2.0", method, params})
	if err != nil {
		return fmt.Errorf("jsonrpc: encode %s: %w", method, err)
	}
	if len(raw) > MaxMessageBytes {
		return &Error{Kind: KindPayloadTooLarge, LimitBytes: u64(MaxMessageBytes),
			Message: fmt.Sprintf("The %s notification would be %d bytes, over the %d-byte message limit.", method, len(raw), MaxMessageBytes)}
	}
	if err := c.write(ctx, websocket.TextMessage, raw); err != nil {
		return fmt.Errorf("jsonrpc: send %s: %w", method, err)
	}
	return nil
}

func (c *Client) write(ctx context.Context, kind int, frame []byte) error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if err := c.closedErr(); err != nil {
		return err
	}
	// A write that times out leaves the connection unusable, so a context
	// that has already ended must not reach the socket.
	if err := ctx.Err(); err != nil {
		return err
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(30 * time.Second)
	}
	_ = c.ws.SetWriteDeadline(deadline)
	if err := c.ws.WriteMessage(kind, frame); err != nil {
		// gorilla refuses every write after a failed one: end the
		// connection so that pending and later calls fail at once.
		c.fail(fmt.Errorf("write: %w", err))
		_ = c.ws.Close()
		// ErrClosed, with the first cause: a read that saw the peer's
		// close may have closed the connection under this write.
		return c.closedErr()
	}
	return nil
}

// Done is closed when the connection has ended: when this client closed
// it, or when a read, which happens only while a call waits, saw its end.
func (c *Client) Done() <-chan struct{} { return c.done }

// Close ends the connection with a normal close frame.
func (c *Client) Close() error {
	_ = c.ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
	err := c.ws.Close()
	c.mu.Lock()
	c.closing = true
	reading := c.reading
	c.mu.Unlock()
	if reading {
		// The read loop sees the closed connection and ends. It no longer
		// stops when its last call is answered (an answer read from the
		// buffer after the close), which would leave this wait with no one
		// to end it.
		<-c.done
	} else {
		c.fail(errors.New("closed by this client"))
	}
	if errors.Is(err, net.ErrClosed) {
		// The read loop saw the peer's close answer and closed the
		// connection first: closed is what was asked.
		err = nil
	}
	return err
}

func (c *Client) closedErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *Client) fail(err error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = fmt.Errorf("%w: %w", ErrClosed, err)
		close(c.done)
	}
	c.mu.Unlock()
}

type responseEnvelope struct {
	JSONRPC string          `json:"jsonrpc" wire:"enum=2.0"`
	ID      json.RawMessage `json:"id"`
	Result  json.RawMessage `json:"result,omitempty"`
	Error   json.RawMessage `json:"error,omitempty"`
}

// afterRead, set only by tests, runs after each message the read loop
// reads, before it is delivered. Atomic: a read loop of an earlier test
// may still be running when a test sets it.
var afterRead atomic.Pointer[func()]

func (c *Client) readLoop() {
	for {
		kind, data, err := c.ws.ReadMessage()
		if err != nil {
			c.fail(err)
			_ = c.ws.Close()
			return
		}
		if f := afterRead.Load(); f != nil {
			(*f)()
		}
		if kind != websocket.TextMessage {
			// Binary frames are not part of any plane: a client closes.
			c.fail(errors.New("server sent a binary frame"))
			_ = c.ws.Close()
			return
		}
		var env responseEnvelope
		// The result is decoded, against its own limit, by the call.
		err = wire.DecodeEnvelope(data, &env)
		if err == nil && (env.Result == nil) == (env.Error == nil) {
			err = errors.New("a response carries exactly one of result and error")
		}
		if err == nil && string(env.ID) == "null" {
			// The server could not read a frame of ours, so some call will
			// never be answered: end the connection, saying why.
			var refusal Error
			if env.Error == nil {
				err = errors.New("a response with a null id carries no error")
			} else if err = json.Unmarshal(env.Error, &refusal); err == nil {
				c.fail(fmt.Errorf("the server refused a frame of this client: %w", &refusal))
				_ = c.ws.Close()
				return
			}
		}
		if err != nil {
			// The server never sends requests or notifications on these planes.
			c.fail(fmt.Errorf("server sent a message that is not a response: %w", err))
			_ = c.ws.Close()
			return
		}
		in := &inbound{result: env.Result}
		if env.Error != nil {
			var e Error
			if err := json.Unmarshal(env.Error, &e); err != nil {
				e = Error{Kind: KindInternal, Message: fmt.Sprintf("the server's error object does not decode: %v", err)}
			}
			in.err = &e
		}
		c.mu.Lock()
		ch := c.pending[string(env.ID)]
		// One answer per id: a repeated answer finds no channel rather
		// than blocking this loop on a full one.
		delete(c.pending, string(env.ID))
		// Decided under the same lock as a new call's registration, so
		// that a call never waits with no reader.
		idle := len(c.pending) == 0 && !c.closing
		if idle {
			c.reading = false
		}
		c.mu.Unlock()
		if ch != nil {
			ch <- in
		}
		if idle {
			return
		}
	}
}
