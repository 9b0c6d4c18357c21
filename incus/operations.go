package incus

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/clock"
)

// StatusCode is the numeric status Incus gives an operation, an instance
// and a response (status_code). Its own type, so that it is compared with
// the constants below and never mistaken for an HTTP status or a count.
type StatusCode int

// Status codes Incus uses for operations and instances.
const (
	StatusStarted   StatusCode = 101
	StatusStopped   StatusCode = 102
	StatusRunning   StatusCode = 103
	StatusPending   StatusCode = 105
	StatusStarting  StatusCode = 106
	StatusStopping  StatusCode = 107
	StatusFreezing  StatusCode = 109
	StatusFrozen    StatusCode = 110
	StatusError     StatusCode = 112
	StatusReady     StatusCode = 113
	StatusSuccess   StatusCode = 200
	StatusFailure   StatusCode = 400
	StatusCancelled StatusCode = 401
)

// Operation is a background task on the server. It is final once StatusCode
// is 200 (Success), 400 (Failure) or 401 (Cancelled).
type Operation struct {
	ID          string              `json:"id"`
	Class       string              `json:"class"` // task, websocket, token
	Description string              `json:"description"`
	Status      string              `json:"status"`
	StatusCode  StatusCode          `json:"status_code"`
	Err         string              `json:"err"`
	Resources   map[string][]string `json:"resources"`
	Metadata    map[string]any      `json:"metadata"`
	MayCancel   bool                `json:"may_cancel"`
	Location    string              `json:"location"`
	CreatedAt   time.Time           `json:"created_at"`
	UpdatedAt   time.Time           `json:"updated_at"`

	// via is the endpoint that started the operation, which follows it.
	via *endpoint
}

// Held reports whether the operation lasts as long as a client holds it
// (an exec or console session, a migration token) rather than being a
// task that ends on its own: waiting for one may never end.
func (o *Operation) Held() bool { return o.Class == "websocket" || o.Class == "token" }

// Final reports whether the operation has finished, successfully or not.
func (o *Operation) Final() bool { return o.StatusCode >= StatusSuccess }

// GetOperation fetches an operation by ID through any endpoint, relying on
// the member that answers to know it or forward to the one that does. For
// an operation this client started, RefreshOperation asks where it runs.
func (c *Client) GetOperation(ctx context.Context, id string) (*Operation, error) {
	o, err := c.getOperation(ctx, id, nil)
	if err != nil {
		return nil, fmt.Errorf("incus: get operation %q: %w", id, err)
	}
	return o, nil
}

// RefreshOperation fetches the current state of op through the endpoint
// that started it (see Client), and keeps following it there.
func (c *Client) RefreshOperation(ctx context.Context, op *Operation) (*Operation, error) {
	if op == nil || op.ID == "" {
		return nil, errors.New("incus: refresh operation: operation without ID")
	}
	o, err := c.getOperation(ctx, op.ID, op.via)
	if err != nil {
		return nil, fmt.Errorf("incus: get operation %q: %w", op.ID, err)
	}
	return o, nil
}

// getOperation fetches operation id, through via when that is set.
func (c *Client) getOperation(ctx context.Context, id string, via *endpoint) (*Operation, error) {
	resp, err := c.do(ctx, request{
		op: "operation.get", method: http.MethodGet, scoped: true,
		path: "/1.0/operations/" + escape(id), via: via,
	})
	if err != nil {
		return nil, err
	}
	var o Operation
	if err := decode("operation.get", resp, &o); err != nil {
		return nil, err
	}
	o.via = resp.via
	return &o, nil
}

// ListOperations returns the unfinished (running or pending) operations of
// the client's project, oldest first.
func (c *Client) ListOperations(ctx context.Context) ([]Operation, error) {
	resp, err := c.do(ctx, request{
		op: "operation.list", method: http.MethodGet, scoped: true,
		path: "/1.0/operations", query: url.Values{"recursion": {"1"}}, patient: true,
	})
	if err != nil {
		return nil, fmt.Errorf("incus: list operations: %w", err)
	}
	// Grouped by lower-cased status: {"running": [...], "success": [...]}.
	var byStatus map[string][]Operation
	if err := decode("operation.list", resp, &byStatus); err != nil {
		return nil, fmt.Errorf("incus: list operations: %w", err)
	}
	var out []Operation
	for _, ops := range byStatus {
		for _, o := range ops {
			if !o.Final() {
				out = append(out, o)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// WebsocketURL is the address of one of op's websockets (secret from
// op.Metadata, as Incus hands it out), on the endpoint that started op:
// an operation lives on the member that runs it, and other members need
// not forward its websockets. It is built from op.ID, never from the
// operation URL the server returned, which carries ?project= when the
// answering member does not hold the instance. Dial it over a connection
// from DialOperation.
func (c *Client) WebsocketURL(op *Operation, secret string) (string, error) {
	if op == nil || op.ID == "" {
		return "", errors.New("incus: websocket: operation without ID")
	}
	ep := c.opEndpoint(op)
	u := *ep.base
	u.Scheme = map[string]string{"https": "wss", "http": "ws"}[u.Scheme]
	u.Path = "/1.0/operations/" + op.ID + "/websocket"
	u.RawPath = "/1.0/operations/" + escape(op.ID) + "/websocket"
	u.RawQuery = url.Values{"project": {c.project}, "secret": {secret}}.Encode()
	return u.String(), nil
}

// DialOperation opens a connection to the endpoint that started op, ready
// for a websocket handshake to WebsocketURL: TLS done (client certificate
// presented, server certificate pinned) for an HTTPS endpoint, the unix
// socket otherwise. It is bounded by ctx, and by the call timeout when ctx
// has no deadline.
func (c *Client) DialOperation(ctx context.Context, op *Operation) (net.Conn, error) {
	if op == nil || op.ID == "" {
		return nil, errors.New("incus: websocket: operation without ID")
	}
	ep := c.opEndpoint(op)
	by := time.Now().Add(c.callTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(by) {
		by = dl
	}
	conn, err := ep.dial(withConnectBy(ctx, by))
	if err != nil {
		return nil, fmt.Errorf("incus: websocket of operation %s: %s: %w", op.ID, ep.label, err)
	}
	return conn, nil
}

// opEndpoint is the endpoint that follows op: the one that started it, or
// for an operation of unknown origin the one calls prefer.
func (c *Client) opEndpoint(op *Operation) *endpoint {
	if op.via != nil {
		return op.via
	}
	return c.eps.preferred()
}

// maxTransient is how many failed rounds in a row Wait tolerates (transport
// errors, 5xx) before it gives up and returns the last error.
const maxTransient = 5

// Wait follows op until it is final and returns its last state.
//
// It asks the server to wait a few seconds at a time
// (GET /1.0/operations/{id}/wait?timeout=N) and keeps asking until the
// operation is final or ctx ends; each of those calls is bounded by N plus a
// short grace, and by ctx. When the server's wait runs out, the operation is
// still running and Wait goes on; it never takes a timed-out wait for success.
//
// Results:
//   - Success: the final operation and nil.
//   - Failure or Cancelled: the final operation and an error wrapping
//     *OperationError (errors.Is(err, ErrConflict) for a duplicate create).
//   - ctx ended first: the last known state and an error wrapping ctx's error
//     (context.DeadlineExceeded or context.Canceled).
//   - the server no longer knows the operation: an error wrapping
//     ErrOperationLost.
//
// An op that is already final (e.g. a create response that finished at once,
// or a synchronous answer) is returned straight away without a call.
//
// An op this client started is followed through the endpoint that started
// it, with no failover: the operation lives on the member that runs it.
// That endpoint failing is one of the transient rounds above.
func (c *Client) Wait(ctx context.Context, op *Operation) (*Operation, error) {
	got, err := c.wait(ctx, op)
	if err != nil {
		return got, fmt.Errorf("incus: wait: %w", err)
	}
	return got, nil
}

// wait is Wait with errors that still need the caller's context.
func (c *Client) wait(ctx context.Context, op *Operation) (*Operation, error) {
	if op == nil {
		return nil, errors.New("nil operation")
	}
	// However the wait ends, what the operation changed is now to be read.
	defer c.writes.tell(c.project, opInstances(op, c.project), op.ID, true)
	if op.Final() {
		return op, finalError(op)
	}
	if op.ID == "" {
		return op, errors.New("operation without ID")
	}
	id, via := op.ID, op.via
	wrap := func(err error) error { return fmt.Errorf("operation %s: %w", id, err) }

	cur := op
	backoff := c.waitBackoff
	transient := 0
	var lastErr error
	for {
		if ctx.Err() != nil {
			return cur, wrap(ctxErr(ctx))
		}
		n := waitSeconds(ctx, c.waitSlice)
		started := time.Now()
		resp, err := c.do(ctx, request{
			op: "operation.wait", method: http.MethodGet, scoped: true,
			path:     "/1.0/operations/" + escape(id) + "/wait",
			query:    url.Values{"timeout": {strconv.Itoa(n)}},
			timeout:  time.Duration(n)*time.Second + c.waitGrace,
			waitCall: true,
			via:      via,
		})

		switch {
		case err == nil && resp.Type != "error":
			var got Operation
			if err := decode("operation.wait", resp, &got); err != nil {
				return cur, wrap(err)
			}
			if got.ID == "" {
				got.ID = id
			}
			got.via = resp.via
			via = resp.via
			cur = &got
			transient = 0
			if cur.Final() {
				return cur, finalError(cur)
			}

		default:
			// The wait ended without the operation: it failed, the
			// server-side timeout ran out, or the call itself failed. The
			// error text cannot tell these apart (a failed operation's
			// own message may well read "context deadline exceeded"), so
			// ask for the operation.
			waitSaid := ""
			if err != nil {
				if ctx.Err() != nil {
					return cur, wrap(ctxErr(ctx))
				}
				if errors.Is(err, ErrNotFound) {
					// err is kept as text only: the operation is lost, and
					// the result must not also match ErrNotFound, which
					// would read as the instance being gone.
					return cur, wrap(fmt.Errorf("%w: %s", ErrOperationLost, err.Error()))
				}
				if !IsRetryable(err) {
					return cur, wrap(err)
				}
				lastErr = err
				transient++
				if transient > maxTransient {
					return cur, wrap(lastErr)
				}
			} else {
				waitSaid = resp.Error
			}

			got, gerr := c.getOperation(ctx, id, via)
			switch {
			case gerr == nil:
				cur = got
				if err == nil {
					transient = 0
				}
				if cur.Final() {
					return cur, finalError(cur)
				}
			case ctx.Err() != nil:
				return cur, wrap(ctxErr(ctx))
			case errors.Is(gerr, ErrNotFound):
				if waitSaid != "" {
					// Gone already; the wait's message is all there is.
					return cur, wrap(fmt.Errorf("%w (wait reported: %s)", ErrOperationLost, waitSaid))
				}
				return cur, wrap(ErrOperationLost)
			case IsRetryable(gerr):
				lastErr = gerr
				transient++
				if transient > maxTransient {
					return cur, wrap(lastErr)
				}
			default:
				return cur, wrap(gerr)
			}
		}

		// A round that came back well before its server-side timeout with
		// the operation still unfinished (a transient failure, or a server
		// that does not really wait) is followed by a growing pause, so
		// this loop never spins.
		if time.Since(started) < time.Duration(n)*time.Second/2 {
			if !clock.Sleep(ctx, backoff) {
				return cur, wrap(ctxErr(ctx))
			}
			backoff = min(backoff*2, time.Second)
		} else {
			backoff = c.waitBackoff
		}
	}
}

// finalError is nil for a successful operation, else an *OperationError.
func finalError(op *Operation) error {
	if op.StatusCode == StatusSuccess {
		return nil
	}
	oe := &OperationError{ID: op.ID, Status: op.Status, StatusCode: op.StatusCode, Err: op.Err}
	if oe.Err == "" {
		oe.Err = "no reason given"
	}
	return oe
}

// waitSeconds is the server-side wait for one round: slice, or what is left
// of ctx if that is shorter, but at least one second (timeout=0 would return
// at once and make the loop spin).
func waitSeconds(ctx context.Context, slice time.Duration) int {
	n := int(math.Ceil(slice.Seconds()))
	if dl, ok := ctx.Deadline(); ok {
		if left := int(math.Ceil(time.Until(dl).Seconds())); left < n {
			n = left
		}
	}
	return max(n, 1)
}

// ctxErr is ctx's error, with its cause attached when that says more.
// It always matches context.Canceled or context.DeadlineExceeded.
func ctxErr(ctx context.Context) error {
	err := ctx.Err()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, err) {
		return fmt.Errorf("%w: %w", err, cause)
	}
	if cause := context.Cause(ctx); cause != nil {
		return cause
	}
	return err
}
