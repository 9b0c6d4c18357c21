package incus

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// Sentinels for errors.Is. *Error matches the first three by status code;
// *OperationError matches ErrConflict for a duplicate create.
var (
	// ErrNotFound: the object does not exist (HTTP / Incus error code 404).
	ErrNotFound = errors.New("incus: not found")

	// ErrConflict: the object already exists or is in use (409). An
	// instance create that collides with an existing name matches too,
	// whichever way the server reports it (see CreateInstance).
	ErrConflict = errors.New("incus: conflict")

	// ErrPreconditionFailed: the If-Match ETag no longer matches (412);
	// re-read the object and try again.
	ErrPreconditionFailed = errors.New("incus: precondition failed")

	// ErrOperationLost: Wait could no longer find the operation on the
	// server (404 on wait/get: it finished and was pruned, or the daemon
	// restarted). Its outcome is unknown; inspect the object it acted on.
	// It does not match ErrNotFound, so that a lost operation is never
	// mistaken for a missing instance.
	ErrOperationLost = errors.New("incus: operation no longer known to the server")

	// ErrBusy: the instance is busy with another operation (a start, a
	// stop, a freeze) and Incus refuses to change it until that ends; the
	// same call may succeed once it has.
	ErrBusy = errors.New("incus: the instance is busy with another operation")

	// ErrBusyStopping is the ErrBusy of an instance a stop holds. Incus
	// 6.0.4 keeps a graceful stop's hold after the stop failed its
	// timeout, until a forced stop takes it over.
	ErrBusyStopping = errors.New("incus: the instance is held by a stop")

	// ErrAlreadyStopped: a stop of an instance that is stopped already;
	// nothing was done, and nothing needed doing.
	ErrAlreadyStopped = errors.New("incus: the instance is already stopped")

	// ErrAlreadyRunning: a start of an instance that runs already (or is
	// frozen); nothing was done, and nothing needed doing.
	ErrAlreadyRunning = errors.New("incus: the instance is already running")

	// ErrMalformedResponse: the server answered with something that is not
	// an Incus response envelope.
	ErrMalformedResponse = errors.New("incus: malformed response")

	// ErrOutcomeUnknown: a write (POST, PUT, PATCH, DELETE) was sent and
	// no answer came back (no answer in time, or the connection broke), so
	// Incus may or may not have carried it out. It was not sent to another
	// endpoint. Read the object it acted on to know. Never matches
	// ErrUnreachable.
	ErrOutcomeUnknown = errors.New("incus: the request was sent but its outcome is unknown")

	// ErrUnreachable: no endpoint answered the call (each refused the
	// connection, failed the handshake, did not answer in time, or said
	// it could not serve it yet), or the call ran out of time before one
	// did. A write was then sent to none of them: nothing happened. Not
	// matched when the caller cancelled the call.
	ErrUnreachable = errors.New("incus: no Incus endpoint answered")

	// ErrMemberUnavailable: the member that took the call could not reach
	// the cluster member the call needed (the one holding the instance):
	// that member is down or not yet reconnected. Nothing of the call ran.
	ErrMemberUnavailable = errors.New("incus: the cluster member the call needs is not reachable")
)

// Error is a failed call: either the server answered with an error
// (Status is the Incus error_code, which equals the HTTP status), or the
// call never got an answer (Err is the transport error, Status is 0).
type Error struct {
	Op      string // fixed call name, e.g. "instance.get"
	Status  int    // HTTP status / Incus error_code; 0 for transport failures
	Message string // the server's error text
	Err     error  // transport or decoding failure, if any

	unreachable bool // matches ErrUnreachable
	unknown     bool // matches ErrOutcomeUnknown
}

func (e *Error) Error() string {
	switch {
	case e.Err != nil && e.Status != 0:
		return fmt.Sprintf("%s: HTTP %d: %v", e.Op, e.Status, e.Err)
	case e.Err != nil:
		return fmt.Sprintf("%s: %v", e.Op, e.Err)
	case e.Message != "":
		return fmt.Sprintf("%s: %s (%d)", e.Op, e.Message, e.Status)
	default:
		return fmt.Sprintf("%s: %d %s", e.Op, e.Status, http.StatusText(e.Status))
	}
}

func (e *Error) Unwrap() error { return e.Err }

// Is maps the status code onto the package sentinels.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.Status == http.StatusNotFound
	case ErrConflict:
		return e.Status == http.StatusConflict || (e.Status >= 400 && isDuplicateMessage(e.Message))
	case ErrPreconditionFailed:
		return e.Status == http.StatusPreconditionFailed
	case ErrBusy:
		return e.Status >= 400 && isBusyMessage(e.Message)
	case ErrBusyStopping:
		return e.Status >= 400 && isBusyStoppingMessage(e.Message)
	case ErrAlreadyStopped:
		return e.Status >= 400 && isAlreadyStoppedMessage(e.Message)
	case ErrAlreadyRunning:
		return e.Status >= 400 && isAlreadyRunningMessage(e.Message)
	case ErrUnreachable:
		return e.unreachable
	case ErrOutcomeUnknown:
		return e.unknown
	case ErrMemberUnavailable:
		return e.Status >= 500 && isForwardMessage(e.Message)
	}
	return false
}

// isBusyMessage recognises Incus's refusal of a change to an instance that
// another operation holds (Incus 6.0: "Failed to create instance update
// operation: Instance is busy running a "start" operation", error code
// 500); Incus gives it no code of its own.
func isBusyMessage(msg string) bool {
	return strings.Contains(msg, "is busy running a")
}

func isBusyStoppingMessage(msg string) bool {
	return strings.Contains(msg, `is busy running a "stop" operation`)
}

// isLockRace matches LXD 5.0's answer to a change asked the moment the
// operation holding the instance ends ("Failed to create instance update
// operation: A matching non-reusable operation has now succeeded", HTTP
// 500): nothing was done, and the same call made again goes through.
func isLockRace(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Status == http.StatusInternalServerError &&
		strings.Contains(e.Message, "matching non-reusable operation has now succeeded")
}

// OperationError is an operation that reached a final state other than
// Success (Failure or Cancelled).
type OperationError struct {
	ID         string
	Status     string     // "Failure" or "Cancelled"
	StatusCode StatusCode // StatusFailure or StatusCancelled
	Err        string     // the server's description of what went wrong
}

func (e *OperationError) Error() string {
	return fmt.Sprintf("operation %s %s: %s", e.ID, strings.ToLower(e.Status), e.Err)
}

// Is reports ErrConflict for an instance create that lost to an existing
// name, and ErrBusy for a state change refused because another operation
// held the instance; operations carry no error code, so this goes by the
// message.
func (e *OperationError) Is(target error) bool {
	switch target {
	case ErrConflict:
		return isDuplicateMessage(e.Err)
	case ErrBusy:
		return isBusyMessage(e.Err)
	case ErrBusyStopping:
		return isBusyStoppingMessage(e.Err)
	case ErrAlreadyStopped:
		return isAlreadyStoppedMessage(e.Err)
	case ErrAlreadyRunning:
		return isAlreadyRunningMessage(e.Err)
	}
	return false
}

// isAlreadyStoppedMessage recognises Incus's answer to a stop of a stopped
// instance ("The instance is already stopped"), which it gives either as
// the call's error or as the operation's failure, with no code of its own;
// and the forced stop's failure for a container that exited while it was
// asked (Incus 6.0.4, after a graceful stop that timed out as the guest
// halted: "container is not running: ..."), where the stop's end is
// reached all the same.
func isAlreadyStoppedMessage(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "already stopped") || strings.HasPrefix(m, "container is not running")
}

// isAlreadyRunningMessage recognises Incus's answer to a start of a
// running instance ("The instance is already running"), as the call's
// error or as the operation's failure.
func isAlreadyRunningMessage(msg string) bool {
	return strings.Contains(strings.ToLower(msg), "already running")
}

// isDuplicateMessage recognises the ways Incus words "that name is taken".
// Incus 6.0 accepts a create for an existing name and fails the operation
// with a database constraint error; newer releases refuse it up front with
// "Instance "x" already exists" (error code 500) or "This "instances" entry
// already exists" (409).
func isDuplicateMessage(msg string) bool {
	return strings.Contains(msg, "UNIQUE constraint failed") ||
		strings.Contains(msg, "already exists")
}

// IsRetryable reports whether repeating the call may succeed: server errors
// (5xx) other than conflicts, transport failures, and a call that ran out of
// time (context.DeadlineExceeded). Cancellation by the caller, 4xx answers,
// failed operations, lost operations and malformed answers are not.
//
// Incus uses 500 for many refusals that will not go away by themselves
// ("Only empty projects can be removed."), so bound any retry loop. A write
// whose outcome is unknown (ErrOutcomeUnknown) is retryable as a transport
// failure, but may have been carried out: repeat it only if doing it twice
// is harmless, or read what it acted on first.
func IsRetryable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, ErrOperationLost) || errors.Is(err, ErrConflict) || errors.Is(err, ErrMalformedResponse) {
		return false
	}
	var opErr *OperationError
	if errors.As(err, &opErr) {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var e *Error
	if errors.As(err, &e) {
		if e.Err != nil {
			return true // transport: no (complete) answer
		}
		return e.Status >= 500
	}
	return false
}
