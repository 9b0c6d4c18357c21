package targets

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// Each instance has one owner in this process (an entry of owners): one
// entry, by name, that everything the process does to the instance passes
// through. It holds three things.
//
//   - The turn: the one right to act on the instance in Incus. Every
//     write and state action (an intent record, a lease, the idle-since
//     clear, a claim, a wake's unfreeze or start, a power move, a close
//     step) and the wait on its operation runs holding it, one at a time.
//     Incus refuses a config change or a state action while another
//     operation holds the instance ("busy"), and this process used to
//     meet its own writes that way: a lease renewal landing in a wake's
//     start, an idle-since clear in an intent write. With the turn, a busy
//     refusal can only come from outside the process (another replica, an
//     operator, an operation Incus carries on after its caller stopped
//     waiting), and it is retried as routine wherever it is met. A wake
//     waiting for the turn goes before every other waiter: it is a
//     dial's latency, the rest are records and moves that can wait.
//   - The converge: at most one reconcile step of the instance runs at a
//     time, on a bounded pool of goroutines, with the instance's own queue
//     entry, retry timer and backoff (client-go's workqueue is the model).
//   - The request: one controller request (a create, a close, a setPower,
//     an ingress change, an idle action) decides about the instance at a
//     time.
//
// The turn is held only around Incus calls and the waits on their
// operations, never around a wait on the relay registry or on a converge,
// so that no holder ever waits for something that waits for the turn. A
// step that holds it and calls another step on the same instance passes
// the hold on through its context (see owned). Steps that act for a
// caller (a wake, a method's write) run on the caller's goroutine holding
// the turn: waiting for a pool goroutine behind a graceful stop would put
// seconds on a wake whose floor is milliseconds.

// ownHold marks, on a context, the instance whose turn the caller holds.
type ownHold struct{ name string }

// errHeld: the instance's turn stayed held by another of this process's
// writes for as long as the caller could wait. It is a busy refusal (the
// caller retries or keeps the request as for Incus's own), but one that
// never reached Incus.
var errHeld = heldError{}

type heldError struct{}

func (heldError) Error() string {
	return "targets: another write of this process holds the instance"
}

// Is makes a held turn an incus.ErrBusy to every caller that already
// handles Incus's own busy refusal as routine.
func (heldError) Is(target error) bool { return target == incus.ErrBusy }

// holds says whether ctx carries the turn of name.
func holds(ctx context.Context, name string) bool {
	h, ok := ctx.Value(ownHold{name}).(bool)
	return ok && h
}

// owned runs fn holding name's turn; fn's context carries the hold,
// so a step under it that reaches owned again for the same name runs at
// once instead of waiting on itself. Waiting for the turn is bounded by
// ctx; a wait cut short is errHeld (with ctx's error when ctx itself
// ended).
func (s *Service) owned(ctx context.Context, name string, fn func(ctx context.Context) error) error {
	return s.ownedBy(ctx, time.Time{}, name, fn)
}

// ownedBy is owned with a bound on waiting for the turn (by, zero: none)
// that is shorter than ctx's: a method that would rather keep a request
// than wait out a long hold (a graceful stop) gives up the wait at by and
// keeps ctx's whole deadline for the Incus calls themselves.
func (s *Service) ownedBy(ctx context.Context, by time.Time, name string, fn func(ctx context.Context) error) error {
	if holds(ctx, name) {
		return fn(ctx)
	}
	wctx := ctx
	if !by.IsZero() {
		var cancel context.CancelFunc
		wctx, cancel = context.WithDeadline(ctx, by)
		defer cancel()
	}
	unlock, _, err := s.own.take(wctx, name, false)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("instance %s: %w (%w)", name, errHeld, ctx.Err())
		}
		return fmt.Errorf("instance %s: %w", name, errHeld)
	}
	defer unlock()
	return fn(context.WithValue(ctx, ownHold{name}, true))
}

// isHeld says whether err is a turn this process held, as opposed to a
// refusal Incus itself gave.
func isHeld(err error) bool {
	var h heldError
	return errors.As(err, &h)
}

// logRetry logs a step that failed and is retried, or an answer given
// from what was last seen because a read after a recorded write failed.
// A busy refusal can only come from outside this process (another
// replica, an operator, an operation Incus carries on after its caller
// stopped waiting), and an Incus that did not answer in time is counted
// and alerted on by its own metrics (incus_provider_incus_requests_total,
// incus_provider_incus_endpoint_up): routine for the log, at info, so
// that a loaded Incus does not fill it with warnings for steps that go
// on. Anything else is a warning.
func (s *Service) logRetry(msg string, err error, fields ...zap.Field) {
	log := s.log.Warn
	if errors.Is(err, incus.ErrBusy) || errors.Is(err, incus.ErrUnreachable) {
		log = s.log.Info
	}
	log(msg, append(fields, zap.Error(err))...)
}
