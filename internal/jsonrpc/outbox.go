package jsonrpc

import (
	"context"
	"sync"
	"time"

	"github.com/gorilla/websocket"
)

// outboxBytes bounds the answers a connection holds queued for a peer that
// is slow to read them, beyond the one being written: past it, whoever
// answers waits (a method, holding its in-flight slot; or the read loop,
// which then stops reading a peer that does not read).
const outboxBytes = 2 * MaxMessageBytes

// outbox is a connection's one writer. Each answer goes out as one text
// frame (the contract: one message per frame), so a pong cannot be slipped
// between the frames of a large answer; instead it goes ahead of every
// answer still queued, and waits for at most the one being written. Neither
// the read loop nor a method ever waits on the socket itself, so a ping is
// read, and answered, while answers are being written.
type outbox struct {
	ws      *websocket.Conn
	timeout time.Duration

	mu     sync.Mutex
	queue  [][]byte
	queued int     // bytes in queue
	pong   *string // the latest ping's data, not yet answered
	wake   chan struct{}
	room   chan struct{} // closed, and replaced, whenever queue shrinks
	closed bool
	done   chan struct{} // closed when run returns
}

func newOutbox(ws *websocket.Conn, timeout time.Duration) *outbox {
	return &outbox{ws: ws, timeout: timeout, wake: make(chan struct{}, 1), room: make(chan struct{}), done: make(chan struct{})}
}

// put queues one message, waiting while the queue is full, and calls
// taken (when set) once it no longer waits, before the writer can see the
// message. It reports false when the connection can no longer be written
// (the message is dropped).
func (o *outbox) put(message []byte, taken func()) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	for !o.closed && o.queued > 0 && o.queued+len(message) > outboxBytes {
		room := o.room
		o.mu.Unlock()
		<-room
		o.mu.Lock()
	}
	if taken != nil {
		taken()
	}
	if o.closed {
		return false
	}
	o.queue = append(o.queue, message)
	o.queued += len(message)
	o.signal()
	return true
}

// ping queues the answer to a ping; a later ping's data replaces one not
// yet answered, as RFC 6455 allows.
func (o *outbox) ping(data string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.pong = &data
	o.signal()
}

func (o *outbox) signal() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// close drops what is queued and ends run; every put waiting returns false.
func (o *outbox) close() {
	o.mu.Lock()
	o.shut()
	o.signal()
	o.mu.Unlock()
	<-o.done
}

// shut marks the outbox closed; o.mu is held.
func (o *outbox) shut() {
	if o.closed {
		return
	}
	o.closed = true
	o.queue, o.queued = nil, 0
	close(o.room)
}

// run writes until close. A failed or timed-out write leaves the connection
// unusable (gorilla refuses every later write), so it ends the connection
// rather than let requests be read that can never be answered.
func (o *outbox) run() {
	defer close(o.done)
	for range o.wake {
		for {
			pong, message, ok := o.next()
			if !ok {
				return
			}
			if pong == nil && message == nil {
				break // nothing left: wait for the next signal
			}
			if err := o.write(pong, message); err != nil {
				_ = o.ws.Close()
				o.mu.Lock()
				o.shut()
				o.mu.Unlock()
				return
			}
		}
	}
}

func (o *outbox) write(pong *string, message []byte) error {
	if pong != nil {
		return o.ws.WriteControl(websocket.PongMessage, []byte(*pong), time.Now().Add(o.timeout))
	}
	defer o.wrote(len(message))
	_ = o.ws.SetWriteDeadline(time.Now().Add(o.timeout))
	return o.ws.WriteMessage(websocket.TextMessage, message)
}

// next takes what to write: a pong first, else the oldest answer; neither
// when there is nothing. ok is false once closed.
func (o *outbox) next() (pong *string, message []byte, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil, nil, false
	}
	if o.pong != nil {
		pong, o.pong = o.pong, nil
		return pong, nil, true
	}
	if len(o.queue) > 0 {
		message = o.queue[0]
		o.queue[0] = nil
		o.queue = o.queue[1:]
	}
	return nil, message, true
}

// flushed waits until every message queued has been written, and says
// so; false when the outbox closed first or ctx ended.
func (o *outbox) flushed(ctx context.Context) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	for !o.closed && o.queued > 0 {
		room := o.room
		o.mu.Unlock()
		select {
		case <-room:
		case <-ctx.Done():
			o.mu.Lock()
			return false
		}
		o.mu.Lock()
	}
	return !o.closed
}

// wrote frees the room a written message held.
func (o *outbox) wrote(n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return
	}
	o.queued -= n
	close(o.room)
	o.room = make(chan struct{})
}
