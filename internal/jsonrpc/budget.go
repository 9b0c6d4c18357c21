package jsonrpc

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"
)

// Budget bounds the bytes of frames that are being decoded and served at
// once, across every connection of every Server that shares it: a frame
// holds as many bytes of the budget as it has from the moment it was read
// until its method returns (its params, a slice of the frame, live that
// long), or until it is refused. A frame that finds no room waits at most
// the budget's wait, then is answered busy with reason capacityExhausted
// and is never handed to its method.
//
// Frames below SmallFrame take no budget: what one costs is bounded by the
// connection's in-flight limit, and a client's ordinary requests must not
// queue behind a stranger's megabytes.
type Budget struct {
	sem     *semaphore.Weighted
	size    int64
	wait    time.Duration
	inUse   atomic.Int64
	refused atomic.Uint64
}

// SmallFrame is the size below which a frame takes no budget.
const SmallFrame = 64 << 10

// DefaultBudgetWait is how long a frame waits for budget before it is
// refused, when NewBudget is given none.
const DefaultBudgetWait = 2 * time.Second

// NewBudget makes a budget of size bytes (a frame larger than the whole
// budget takes all of it) whose frames wait at most wait for room.
func NewBudget(size int64, wait time.Duration) *Budget {
	if size < 1 {
		size = 1
	}
	if wait <= 0 {
		wait = DefaultBudgetWait
	}
	return &Budget{sem: semaphore.NewWeighted(size), size: size, wait: wait}
}

// Size is the budget's bytes.
func (b *Budget) Size() int64 { return b.size }

// InUse is the bytes frames hold now.
func (b *Budget) InUse() int64 { return b.inUse.Load() }

// Refused counts the frames refused for want of budget.
func (b *Budget) Refused() uint64 { return b.refused.Load() }

// acquire takes the weight of a frame of n bytes, waiting at most the
// budget's wait (less if ctx ends first). It returns the release, to be
// called once, or nil when the frame is refused.
func (b *Budget) acquire(ctx context.Context, n int) func() {
	if b == nil || n < SmallFrame {
		return func() {}
	}
	w := min(int64(n), b.size)
	ctx, cancel := context.WithTimeout(ctx, b.wait)
	defer cancel()
	if err := b.sem.Acquire(ctx, w); err != nil {
		b.refused.Add(1)
		return nil
	}
	b.inUse.Add(w)
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			b.inUse.Add(-w)
			b.sem.Release(w)
		}
	}
}

// refusal is the answer to a request whose frame found no budget.
func (b *Budget) refusal() *Error {
	retry := uint64(time.Second / time.Millisecond)
	return &Error{Kind: KindBusy, Reason: "capacityExhausted", RetryAfterMs: &retry,
		Message: fmt.Sprintf("The server is decoding %d MiB of other large frames, its limit, and this one waited %s for room; retry in a second.",
			b.size>>20, b.wait)}
}
