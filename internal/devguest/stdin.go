package devguest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

func (d *Daemon) processWrite(_ context.Context, raw json.RawMessage) (any, error) {
	var p ProcessWriteParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	data, err := base64.StdEncoding.Strict().DecodeString(p.Data)
	if err != nil {
		return nil, jsonrpc.InvalidParams("data", "The member data must be padded standard base64: %v.", err)
	}
	if ceiling := d.limits.Process.MaxPendingInputBytes; uint64(len(data)) > ceiling {
		return nil, ceilingError("data", ceiling, uint64(len(data)))
	}
	pr, err := d.procs.lookup(p.ProcessID)
	if err != nil {
		return nil, err
	}
	pr.mu.Lock()
	q := pr.stdin
	pr.mu.Unlock()
	if q == nil {
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "inputClosed", "The process %s was started without a stdin pipe (stdin: pipe).", p.ProcessID)
	}
	if err := q.enqueue(data, p.Close); err != nil {
		return nil, err
	}
	return Empty{}, nil
}

// inputQueue feeds a process's stdin pipe from process/write without ever
// blocking a request: bytes are queued (up to a bound) and written by one
// goroutine.
type inputQueue struct {
	mu       sync.Mutex
	w        *os.File
	pending  [][]byte
	bytes    uint64
	limit    uint64
	closing  bool // close requested: after the queue drains
	closed   bool // the pipe is closed or broken
	wake     chan struct{}
	finished chan struct{}
}

func newInputQueue(w *os.File, limit uint64) *inputQueue {
	q := &inputQueue{w: w, limit: limit, wake: make(chan struct{}, 1), finished: make(chan struct{})}
	go q.run()
	return q
}

func (q *inputQueue) enqueue(data []byte, closeAfter bool) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closing || q.closed {
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "inputClosed", "The process's input is closed.")
	}
	if q.bytes+uint64(len(data)) > q.limit {
		e := jsonrpc.WithReason(jsonrpc.KindBusy, "capacityExhausted", "%d bytes of input are still queued; wait until the process reads them.", q.bytes)
		retry := uint64(100)
		e.RetryAfterMs = &retry
		return e
	}
	if len(data) > 0 {
		q.pending = append(q.pending, data)
		q.bytes += uint64(len(data))
	}
	if closeAfter {
		q.closing = true
	}
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return nil
}

func (q *inputQueue) run() {
	defer close(q.finished)
	for range q.wake {
		for {
			q.mu.Lock()
			if len(q.pending) == 0 {
				done := q.closing || q.closed
				if done {
					q.closed = true
					q.mu.Unlock()
					_ = q.w.Close()
					return
				}
				q.mu.Unlock()
				break
			}
			chunk := q.pending[0]
			q.mu.Unlock()
			_, err := q.w.Write(chunk)
			q.mu.Lock()
			q.pending = q.pending[1:]
			q.bytes -= uint64(len(chunk))
			if err != nil {
				q.closed = true
				q.pending, q.bytes = nil, 0
			}
			q.mu.Unlock()
		}
	}
}

// rootExited closes the input once the root is gone: nobody is left to read
// what the daemon would queue.
func (q *inputQueue) rootExited() {
	q.mu.Lock()
	q.closing = true
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	// A writer blocked on a full pipe whose reader lives on in a descendant
	// would keep the queue open; a deadline unblocks it.
	_ = q.w.SetWriteDeadline(time.Now().Add(time.Second))
}
