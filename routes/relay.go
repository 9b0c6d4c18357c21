package routes

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/wsframe"
)

// MinIdleTimeout is the floor of a relay's idle timeout: intermediaries
// never close a connection for idleness sooner than 60 seconds.
const MinIdleTimeout = 60 * time.Second

// inlineBufferBytes is each direction's own read buffer. Small frames (most
// JSON-RPC messages) are read and forwarded from it whole, several per
// write when they arrive together; a frame that does not fit is streamed.
// It is the bulk of an idle relay's memory, so it stays small.
const inlineBufferBytes = 2048

// streamBufferBytes is the size of the pooled buffers large frames are
// copied with when the kernel cannot splice them.
const streamBufferBytes = 64 << 10

var streamBuffers = sync.Pool{New: func() any { b := make([]byte, streamBufferBytes); return &b }}

// Direction of relayed traffic, as metrics label it.
const (
	DirToGuest   = "to_guest"
	DirToRuntime = "to_runtime"
)

// relayConfig bounds one relay.
type relayConfig struct {
	maxMessage uint64        // per message, both directions
	idle       time.Duration // no frame either way for this long closes the relay
	closeWait  time.Duration // how long a close frame waits for the other side's answer
	lockWait   time.Duration // how long an injected close waits for a frame being written
}

// endpoint is one side of a relay: what is read from it and how frames are
// written to it.
type endpoint struct {
	conn       net.Conn
	fromClient bool // frames read from it are client frames (masked)

	// read side
	inline [inlineBufferBytes]byte
	buf    []byte // inline[:], or a larger buffer holding bytes read ahead during the handshake
	r, w   int    // buf[r:w] is read and not yet forwarded

	// write side: a one-slot semaphore so that an injected close frame can
	// give up waiting for a frame being streamed
	wlock     chan struct{}
	closeSent bool // guarded by wlock
	// partial says a frame was cut short on its way here (its source went
	// away mid-frame): no frame of any kind can follow it. Guarded by wlock.
	partial bool
}

func newEndpoint(conn net.Conn, fromClient bool, early []byte) *endpoint {
	e := &endpoint{conn: conn, fromClient: fromClient, wlock: make(chan struct{}, 1)}
	e.buf = e.inline[:]
	if len(early) > len(e.inline) {
		e.buf = early
		e.w = len(early)
	} else {
		e.w = copy(e.inline[:], early)
	}
	return e
}

// fill reads until at least n bytes are buffered (n <= len(inline), or n
// fits in the current buffer). It compacts first when needed.
func (e *endpoint) fill(n int) error {
	if e.w-e.r >= n {
		return nil
	}
	if e.r == e.w {
		e.r, e.w = 0, 0
		if len(e.buf) != len(e.inline) || &e.buf[0] != &e.inline[0] {
			e.buf = e.inline[:] // the handshake's read-ahead is used up
		}
	}
	if e.r+n > len(e.buf) {
		if len(e.buf) != len(e.inline) || &e.buf[0] != &e.inline[0] {
			// Move what is left of the read-ahead into the inline buffer.
			left := copy(e.inline[:], e.buf[e.r:e.w])
			e.buf, e.r, e.w = e.inline[:], 0, left
		} else {
			e.w = copy(e.buf, e.buf[e.r:e.w])
			e.r = 0
		}
	}
	for e.w-e.r < n {
		m, err := e.conn.Read(e.buf[e.w:])
		e.w += m
		if err != nil {
			if e.w-e.r >= n {
				return nil
			}
			return err
		}
	}
	return nil
}

// lock waits for the write slot; with a bound it may give up.
func (e *endpoint) lock(wait time.Duration) bool {
	if wait <= 0 {
		e.wlock <- struct{}{}
		return true
	}
	select {
	case e.wlock <- struct{}{}:
		return true
	default:
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case e.wlock <- struct{}{}:
		return true
	case <-t.C:
		return false
	}
}

func (e *endpoint) unlock() { <-e.wlock }

// Relay carries one data connection between the runtime and a guest daemon.
type Relay struct {
	instance string
	client   *endpoint // the runtime
	guest    *endpoint // the daemon
	cfg      relayConfig
	metrics  *Metrics
	onEnd    func(*Relay)

	activity atomic.Uint64 // frames seen either way
	busy     atomic.Int32  // frames being streamed now
	idleSeen uint64        // activity at the last idle check (timer callback only)
	idleRuns int           // idle checks in a row without activity

	mu        sync.Mutex
	closeFrom [2]bool // 0: the runtime, 1: the guest; a close frame came, or the side is gone
	reason    string  // why the relay ended, for metrics
	finished  bool
	idleTimer *time.Timer
	waitTimer *time.Timer

	done chan struct{}
}

// idleChecks is how many checks an idle timeout is divided into: a relay
// idle for its whole timeout is closed within a quarter more.
const idleChecks = 4

func newRelay(instance string, client, guest net.Conn, clientEarly, guestEarly []byte, cfg relayConfig, m *Metrics, onEnd func(*Relay)) *Relay {
	return &Relay{
		instance: instance,
		client:   newEndpoint(client, true, clientEarly),
		guest:    newEndpoint(guest, false, guestEarly),
		cfg:      cfg,
		metrics:  m,
		onEnd:    onEnd,
		done:     make(chan struct{}),
	}
}

// Instance is the Incus instance the relay reaches.
func (r *Relay) Instance() string { return r.instance }

// Done is closed once the relay has ended and both connections are closed.
func (r *Relay) Done() <-chan struct{} { return r.done }

// start runs both directions on their own goroutines and returns.
func (r *Relay) start() {
	r.mu.Lock()
	r.idleTimer = time.AfterFunc(r.cfg.idle/idleChecks, r.idleCheck)
	r.mu.Unlock()
	// The direction that ends last ends the relay: no third goroutine
	// waits for them (an idle relay costs two goroutines).
	var left atomic.Int32
	left.Store(2)
	end := func() {
		if left.Add(-1) != 0 {
			return
		}
		r.finish("")
		if r.onEnd != nil {
			r.onEnd(r)
		}
		close(r.done)
	}
	go func() { defer end(); r.pump(r.client, r.guest, 0) }()
	go func() { defer end(); r.pump(r.guest, r.client, 1) }()
}

func (r *Relay) idleCheck() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished {
		return
	}
	a := r.activity.Load()
	if a != r.idleSeen || r.busy.Load() > 0 {
		r.idleSeen, r.idleRuns = a, 0
	} else {
		r.idleRuns++
	}
	if r.idleRuns < idleChecks {
		r.idleTimer.Reset(r.cfg.idle / idleChecks)
		return
	}
	go r.GoAway(CloseGoingAway, "idle timeout", "idle")
}

// GoAway closes the relay from the provider's side: both the runtime and
// the daemon get a close frame with code and reason, and the connections
// are closed once both have answered, or after the close wait.
func (r *Relay) GoAway(code int, reason, why string) {
	r.setReason(why)
	okC := r.sendClose(r.client, code, reason)
	okG := r.sendClose(r.guest, code, reason)
	if !okC || !okG {
		r.finish(why)
		return
	}
	r.armCloseWait()
}

func (r *Relay) setReason(why string) {
	r.mu.Lock()
	if r.reason == "" {
		r.reason = why
	}
	r.mu.Unlock()
}

// sendClose writes a close frame of the relay's own to e, unless one went
// there already. It gives up (false) when a frame being streamed to e keeps
// the write slot past the lock wait.
func (r *Relay) sendClose(e *endpoint, code int, reason string) bool {
	if !e.lock(r.cfg.lockWait) {
		return false
	}
	defer e.unlock()
	if e.closeSent {
		return true
	}
	if e.partial {
		return false // only closing the connection is left
	}
	e.closeSent = true
	_ = e.conn.SetWriteDeadline(time.Now().Add(r.cfg.lockWait))
	_, err := e.conn.Write(wsframe.CloseFrame(code, reason, !e.fromClient))
	_ = e.conn.SetWriteDeadline(time.Time{})
	return err == nil
}

func (r *Relay) armCloseWait() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished || r.waitTimer != nil {
		return
	}
	r.waitTimer = time.AfterFunc(r.cfg.closeWait, func() { r.finish("close_timeout") })
}

// sideClosed records a close frame from side (or that side being gone) and
// ends the relay once both sides are done.
func (r *Relay) sideClosed(side int) {
	r.mu.Lock()
	r.closeFrom[side] = true
	both := r.closeFrom[0] && r.closeFrom[1]
	r.mu.Unlock()
	if both {
		r.finish("")
		return
	}
	r.armCloseWait()
}

// finish closes both connections once; the pumps then end.
func (r *Relay) finish(why string) {
	r.mu.Lock()
	if r.finished {
		r.mu.Unlock()
		return
	}
	r.finished = true
	if r.reason == "" {
		r.reason = why
	}
	if r.reason == "" {
		r.reason = "normal"
	}
	if r.idleTimer != nil {
		r.idleTimer.Stop()
	}
	if r.waitTimer != nil {
		r.waitTimer.Stop()
	}
	r.mu.Unlock()
	_ = r.client.conn.Close()
	_ = r.guest.conn.Close()
}

// Kill ends the relay at once: both connections are closed without
// waiting for any close answer.
func (r *Relay) Kill(why string) { r.finish(why) }

// Reason is why the relay ended ("" while it runs).
func (r *Relay) Reason() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.finished {
		return ""
	}
	return r.reason
}

// pump forwards frames from src to dst until src ends. side is src's index
// in closeFrom.
func (r *Relay) pump(src, dst *endpoint, side int) {
	err := r.forward(src, dst, side)
	r.mu.Lock()
	finished, closed := r.finished, r.closeFrom[side]
	r.mu.Unlock()
	if finished {
		return
	}
	var v *wsframe.Violation
	switch {
	case errors.As(err, &v):
		why := "protocol_error"
		if v.Code == CloseTooBig {
			why = "too_big"
		}
		r.setReason(why)
		// Both sides learn why; the offender's answer is not read any more.
		r.mu.Lock()
		r.closeFrom[side] = true
		r.mu.Unlock()
		okS := r.sendClose(src, v.Code, v.Reason)
		okD := r.sendClose(dst, v.Code, v.Reason)
		if !okS || !okD {
			r.finish(why)
			return
		}
		r.armCloseWait()
	case closed:
		// The side closed its connection after its close frame: normal.
		r.sideClosed(side)
	default:
		// The side went away without a close frame: tell the other.
		r.setReason("peer_gone")
		reason := "the runtime closed the connection"
		if side == 1 {
			reason = "the guest daemon closed the connection"
		}
		if !r.sendClose(dst, CloseGoingAway, reason) {
			r.finish("peer_gone")
			return
		}
		r.sideClosed(side)
	}
}

// forward is the frame loop of one direction. It returns src's read error,
// or a *wsframe.Violation.
func (r *Relay) forward(src, dst *endpoint, side int) error {
	var (
		msg       wsframe.MessageState
		pendStart = -1 // src.buf[pendStart:src.r] holds whole frames not yet written
		pendMsgs  uint64
		dropping  bool // src sent its close frame: nothing more from it is forwarded
	)
	dirBytes, dirMsgs := r.metrics.direction(side)
	flush := func() error {
		if pendStart < 0 {
			return nil
		}
		b := src.buf[pendStart:src.r]
		pendStart = -1
		dst.lock(0)
		if dst.closeSent {
			dst.unlock()
			return nil
		}
		_, err := dst.conn.Write(b)
		dst.unlock()
		dirBytes.Add(float64(len(b)))
		if pendMsgs > 0 {
			dirMsgs.Add(float64(pendMsgs))
			pendMsgs = 0
		}
		return err
	}
	for {
		h, need, v := wsframe.ParseHeader(src.buf[src.r:src.w])
		if v == nil && need > 0 {
			if err := flush(); err != nil {
				return err
			}
			if err := src.fill(need); err != nil {
				return err
			}
			continue
		}
		var endsMessage bool
		if v == nil {
			endsMessage, v = msg.Check(h, src.fromClient, r.cfg.maxMessage)
		}
		if v != nil {
			_ = flush()
			return v
		}
		r.activity.Add(1)
		total := uint64(h.Size) + h.Length
		avail := uint64(src.w - src.r)

		if h.Op == wsframe.OpClose || dropping {
			if err := flush(); err != nil {
				return err
			}
			if h.Op == wsframe.OpClose && !dropping {
				if avail < total {
					if err := src.fill(int(total)); err != nil {
						return err
					}
				}
				frame := src.buf[src.r : src.r+int(total)]
				dst.lock(0)
				if !dst.closeSent {
					dst.closeSent = true
					_, _ = dst.conn.Write(frame)
					dirBytes.Add(float64(len(frame)))
				}
				dst.unlock()
				src.r += int(total)
				dropping = true
				r.sideClosed(side)
				continue
			}
			if err := r.discard(src, total); err != nil {
				return err
			}
			continue
		}

		if avail >= total {
			// The whole frame is buffered: forward it with its neighbours.
			if pendStart < 0 {
				pendStart = src.r
			}
			src.r += int(total)
			if endsMessage {
				pendMsgs++
			}
			continue
		}
		if err := flush(); err != nil {
			return err
		}
		if err := r.stream(src, dst, total, dirBytes); err != nil {
			return err
		}
		if endsMessage {
			dirMsgs.Add(1)
		}
	}
}

// counter is the part of a Prometheus counter the pumps use.
type counter interface{ Add(float64) }

// stream forwards a frame that is not wholly buffered: what is buffered
// (its header and the start of its payload), then the rest straight from
// src's connection, spliced by the kernel where it can. Frames being
// streamed count as activity however long they take; each is bounded by
// twice the idle timeout.
func (r *Relay) stream(src, dst *endpoint, total uint64, bytes counter) error {
	r.busy.Add(1)
	defer r.busy.Add(-1)
	dst.lock(0)
	defer dst.unlock()
	if dst.closeSent {
		return r.discard(src, total)
	}
	bound := time.Now().Add(2 * r.cfg.idle)
	_ = dst.conn.SetWriteDeadline(bound)
	defer func() { _ = dst.conn.SetWriteDeadline(time.Time{}) }()
	head := src.buf[src.r:src.w]
	rest := total - uint64(len(head))
	src.r = src.w
	dst.partial = true // until the whole frame is through
	if _, err := dst.conn.Write(head); err != nil {
		return err
	}
	bytes.Add(float64(len(head)))
	if rest <= inlineBufferBytes {
		if err := src.fill(int(rest)); err != nil {
			return err
		}
		_, err := dst.conn.Write(src.buf[src.r : src.r+int(rest)])
		src.r += int(rest)
		bytes.Add(float64(rest))
		if err == nil {
			dst.partial = false
		}
		return err
	}
	_ = src.conn.SetReadDeadline(bound)
	defer func() { _ = src.conn.SetReadDeadline(time.Time{}) }()
	bp := streamBuffers.Get().(*[]byte)
	var w io.Writer = dst.conn
	switch src.conn.(type) {
	case *net.TCPConn, *net.UnixConn:
		// The kernel splices socket to socket (TCPConn.ReadFrom).
	default:
		// A TLS connection cannot be spliced: copy through the pooled
		// buffer rather than let ReadFrom allocate one per frame.
		w = struct{ io.Writer }{dst.conn}
	}
	n, err := io.CopyBuffer(w, &io.LimitedReader{R: src.conn, N: int64(rest)}, *bp)
	streamBuffers.Put(bp)
	bytes.Add(float64(n))
	if err == nil && uint64(n) < rest {
		err = io.ErrUnexpectedEOF
	}
	if err == nil {
		dst.partial = false
	}
	return err
}

// discard reads and drops a frame of total bytes from src.
func (r *Relay) discard(src *endpoint, total uint64) error {
	if buffered := uint64(src.w - src.r); buffered >= total {
		src.r += int(total)
		return nil
	}
	rest := total - uint64(src.w-src.r)
	src.r = src.w
	_ = src.conn.SetReadDeadline(time.Now().Add(r.cfg.closeWait + 2*r.cfg.idle))
	defer func() { _ = src.conn.SetReadDeadline(time.Time{}) }()
	_, err := io.CopyN(io.Discard, src.conn, int64(rest))
	return err
}
