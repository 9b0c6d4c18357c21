package incus

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// waitServer fakes GET /1.0/operations/op-1/wait and GET /1.0/operations/op-1.
// wait(n) answers the n-th wait call (1-based); get answers a plain GET.
type waitServer struct {
	waits, gets atomic.Int32
	maxTimeout  atomic.Int32
	wait        func(w http.ResponseWriter, n int)
	get         func(w http.ResponseWriter)
}

func (s *waitServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/1.0/operations/op-1/wait":
		n := int(s.waits.Add(1))
		to, err := strconv.Atoi(r.URL.Query().Get("timeout"))
		if err != nil || to < 1 {
			writeError(w, 400, 400, "bad timeout "+r.URL.RawQuery)
			return
		}
		if int32(to) > s.maxTimeout.Load() {
			s.maxTimeout.Store(int32(to))
		}
		s.wait(w, n)
	case "/1.0/operations/op-1":
		s.gets.Add(1)
		s.get(w)
	default:
		writeError(w, 404, 404, "not found")
	}
}

// serverTimedOut is what incusd sends when ?timeout= runs out: HTTP 200
// (already sent before waiting) and an error envelope.
func serverTimedOut(w http.ResponseWriter) {
	writeError(w, http.StatusOK, 500, "context deadline exceeded")
}

func running() *Operation {
	return &Operation{ID: "op-1", Status: "Running", StatusCode: StatusRunning}
}

// The server-side wait runs out several times before the operation ends:
// Wait keeps waiting and only then reports success.
func TestWaitKeepsWaitingAcrossServerTimeouts(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) {
			if n <= 4 {
				serverTimedOut(w)
				return
			}
			writeSync(w, opJSON("op-1", "Success", 200, ""))
		},
		get: func(w http.ResponseWriter) { writeSync(w, opJSON("op-1", "Running", 103, "")) },
	}
	f := newFake(t, s)
	op, err := f.client.Wait(t.Context(), running())
	if err != nil {
		t.Fatal(err)
	}
	if op.StatusCode != StatusSuccess {
		t.Fatalf("final %+v", op)
	}
	if s.waits.Load() != 5 || s.gets.Load() != 4 {
		t.Errorf("waits %d gets %d, want 5 and 4", s.waits.Load(), s.gets.Load())
	}
	if m := s.maxTimeout.Load(); m > 5 {
		t.Errorf("asked the server to wait %ds per round, want <= 5", m)
	}
	for _, o := range f.seen() {
		if o.status != "ok" {
			t.Errorf("a server-side wait timeout is not a failed call: %v", f.seen())
			break
		}
	}
}

// A failed operation whose error text happens to read like a timeout is
// still a failure: Wait asks for the operation instead of guessing.
func TestWaitFailureIsOperationError(t *testing.T) {
	for _, tc := range []struct {
		status string
		code   int
		msg    string
	}{
		{"Failure", 400, `Failed shutting down instance, status is "Running": context deadline exceeded`},
		{"Cancelled", 401, "cancelled by user"},
	} {
		t.Run(tc.status, func(t *testing.T) {
			s := &waitServer{
				wait: func(w http.ResponseWriter, n int) { writeError(w, http.StatusOK, 500, tc.msg) },
				get:  func(w http.ResponseWriter) { writeSync(w, opJSON("op-1", tc.status, tc.code, tc.msg)) },
			}
			f := newFake(t, s)
			op, err := f.client.Wait(t.Context(), running())
			var oe *OperationError
			if !errors.As(err, &oe) {
				t.Fatalf("want *OperationError, got %T %v", err, err)
			}
			if oe.ID != "op-1" || oe.Status != tc.status || oe.StatusCode != StatusCode(tc.code) || oe.Err != tc.msg {
				t.Errorf("got %+v", oe)
			}
			if op == nil || op.StatusCode != StatusCode(tc.code) {
				t.Errorf("returned op %+v", op)
			}
			if IsRetryable(err) || errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("a failed operation is neither retryable nor a deadline: %v", err)
			}
			if s.waits.Load() != 1 {
				t.Errorf("waits %d", s.waits.Load())
			}
		})
	}
}

// The wait endpoint itself may also return the final operation as a sync
// response with a Failure status (older servers, or a wait that starts after
// the end): that is an OperationError too.
func TestWaitReturnsFailedOperationDirectly(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) { writeSync(w, opJSON("op-1", "Failure", 400, "disk full")) },
		get:  func(w http.ResponseWriter) { t.Error("no GET needed") },
	}
	f := newFake(t, s)
	_, err := f.client.Wait(t.Context(), running())
	var oe *OperationError
	if !errors.As(err, &oe) || oe.Err != "disk full" {
		t.Fatalf("got %v", err)
	}
}

// An operation that is already final needs no call at all.
func TestWaitAlreadyFinal(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) { t.Error("unexpected wait call") },
		get:  func(w http.ResponseWriter) { t.Error("unexpected get call") },
	}
	f := newFake(t, s)
	op, err := f.client.Wait(t.Context(), &Operation{ID: "op-1", Status: "Success", StatusCode: 200})
	if err != nil || op.StatusCode != 200 {
		t.Fatalf("%v %v", op, err)
	}
	_, err = f.client.Wait(t.Context(), &Operation{ID: "op-1", Status: "Failure", StatusCode: 400, Err: "nope"})
	var oe *OperationError
	if !errors.As(err, &oe) || oe.Err != "nope" {
		t.Fatalf("already failed: %v", err)
	}
	if _, err := f.client.Wait(t.Context(), nil); err == nil {
		t.Fatal("nil op: want error")
	}
}

// A create answer that already carries a final operation is honoured.
func TestCreateResponseAlreadyFinal(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			t.Errorf("unexpected %s %s", r.Method, r.URL)
		}
		writeAsync(w, opJSON("op-9", "Success", 200, ""))
	}))
	op, err := f.client.CreateInstance(t.Context(), InstancesPost{Name: "c1", Source: InstanceSource{Type: "none"}})
	if err != nil {
		t.Fatal(err)
	}
	if op, err = f.client.Wait(t.Context(), op); err != nil || op.ID != "op-9" {
		t.Fatalf("%+v %v", op, err)
	}
}

// The operation vanished (404 on wait): a recognisable error that is not
// mistaken for a missing instance.
func TestWaitOperationVanished(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, 404, 404, "Operation not found")
	}))
	_, err := f.client.Wait(t.Context(), running())
	if !errors.Is(err, ErrOperationLost) {
		t.Fatalf("want ErrOperationLost, got %v", err)
	}
	if errors.Is(err, ErrNotFound) || IsRetryable(err) {
		t.Errorf("lost op must not match ErrNotFound nor be retryable: %v", err)
	}

	// Failed, then pruned before we could look: still lost, and the
	// wait's message is kept.
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) { writeError(w, http.StatusOK, 500, "disk full") },
		get:  func(w http.ResponseWriter) { writeError(w, 404, 404, "Operation not found") },
	}
	f = newFake(t, s)
	_, err = f.client.Wait(t.Context(), running())
	if !errors.Is(err, ErrOperationLost) || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("got %v", err)
	}
}

// A 500 (and a transport failure) in the middle of waiting is survived.
func TestWaitSurvivesTransientErrors(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) {
			switch n {
			case 1:
				writeError(w, 500, 500, "database is locked")
			case 2:
				conn, _, err := w.(http.Hijacker).Hijack()
				if err == nil {
					conn.Close()
				}
			case 3:
				serverTimedOut(w)
			default:
				writeSync(w, opJSON("op-1", "Success", 200, ""))
			}
		},
		get: func(w http.ResponseWriter) { writeSync(w, opJSON("op-1", "Running", 103, "")) },
	}
	f := newFake(t, s)
	op, err := f.client.Wait(t.Context(), running())
	if err != nil || op.StatusCode != StatusSuccess {
		t.Fatalf("%+v %v", op, err)
	}
	if s.waits.Load() != 4 {
		t.Errorf("waits %d", s.waits.Load())
	}
}

// A server that keeps failing is given up on after a few rounds.
func TestWaitGivesUpOnPersistentErrors(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) { writeError(w, 503, 503, "unavailable") },
		get:  func(w http.ResponseWriter) { writeError(w, 503, 503, "unavailable") },
	}
	f := newFake(t, s)
	_, err := f.client.Wait(t.Context(), running())
	var e *Error
	if !errors.As(err, &e) || e.Status != 503 || !IsRetryable(err) {
		t.Fatalf("got %v", err)
	}
	if n := s.waits.Load(); n < 2 || n > maxTransient+1 {
		t.Errorf("waits %d", n)
	}
}

// ctx ends while the operation runs on: an error, never success; each round
// asks the server to wait no longer than what is left of ctx.
func TestWaitContextEndsFirst(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) {
			time.Sleep(20 * time.Millisecond)
			serverTimedOut(w)
		},
		get: func(w http.ResponseWriter) { writeSync(w, opJSON("op-1", "Running", 103, "")) },
	}
	f := newFake(t, s)
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	op, err := f.client.Wait(ctx, running())
	if err == nil {
		t.Fatal("a wait cut short by ctx must not succeed")
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("want DeadlineExceeded, got %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("returned after %s", d)
	}
	if op == nil || op.StatusCode != StatusRunning {
		t.Errorf("should return the last known state, got %+v", op)
	}
	if m := s.maxTimeout.Load(); m != 1 {
		t.Errorf("with <1s of ctx left the server should be asked for timeout=1, got %d", m)
	}

	// A caller's own cause is kept, and the error still matches
	// context.DeadlineExceeded.
	errBudget := errors.New("job budget used up")
	ctx, cancel = context.WithTimeoutCause(t.Context(), 100*time.Millisecond, errBudget)
	defer cancel()
	_, err = f.client.Wait(ctx, running())
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, errBudget) {
		t.Errorf("custom cause: got %v", err)
	}

	// Cancelled by the caller while the server is holding the wait open.
	f = newFake(t, &waitServer{
		wait: func(w http.ResponseWriter, n int) { time.Sleep(time.Second) },
		get:  func(w http.ResponseWriter) {},
	})
	ctx, cancel = context.WithCancel(t.Context())
	time.AfterFunc(50*time.Millisecond, cancel)
	_, err = f.client.Wait(ctx, running())
	if !errors.Is(err, context.Canceled) || IsRetryable(err) {
		t.Fatalf("cancel: got %v", err)
	}
}

// A wait call that hangs past timeout+grace is abandoned and retried, not
// waited on forever.
func TestWaitCallIsBounded(t *testing.T) {
	s := &waitServer{
		wait: func(w http.ResponseWriter, n int) {
			if n == 1 {
				time.Sleep(2 * time.Second) // ignores ?timeout=1
				return
			}
			writeSync(w, opJSON("op-1", "Success", 200, ""))
		},
		get: func(w http.ResponseWriter) { writeSync(w, opJSON("op-1", "Running", 103, "")) },
	}
	f := newFake(t, s)
	f.client.waitSlice = time.Second
	f.client.waitGrace = 200 * time.Millisecond
	start := time.Now()
	op, err := f.client.Wait(t.Context(), running())
	if err != nil || op.StatusCode != StatusSuccess {
		t.Fatalf("%+v %v", op, err)
	}
	if d := time.Since(start); d < time.Second || d > 3*time.Second {
		t.Errorf("took %s, want about 1.2s", d)
	}
}
