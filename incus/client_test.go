package incus

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestConfigValidation(t *testing.T) {
	if _, err := New(Config{}); err == nil {
		t.Fatal("New with neither Socket nor URL: want error")
	}
	if _, err := New(Config{URL: "http://127.0.0.1:8443"}); err == nil {
		t.Fatal("New with plain http URL: want error")
	}
	if _, err := New(Config{URL: "https://127.0.0.1:8443"}); err == nil {
		t.Fatal("New with URL but no certificates: want error")
	}
	c, err := New(Config{Socket: "/nonexistent.sock"})
	if err != nil {
		t.Fatal(err)
	}
	if c.Project() != "default" || c.callTimeout != DefaultCallTimeout {
		t.Fatalf("defaults: project %q timeout %s", c.Project(), c.callTimeout)
	}
	other := c.WithProject("p2")
	if other.Project() != "p2" || c.Project() != "default" {
		t.Fatalf("WithProject: got %q, original now %q", other.Project(), c.Project())
	}
	if other.eps != c.eps {
		t.Fatal("WithProject should share the HTTP client")
	}
	if c.WithProject("").Project() != "default" {
		t.Fatal(`WithProject("") should mean the default project`)
	}
}

func TestGetInstanceDecodesEnvelopeAndETag(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/1.0/instances/c1" || r.URL.Query().Get("project") != "p1" || r.Method != http.MethodGet {
			writeError(w, http.StatusBadRequest, 400, "unexpected "+r.Method+" "+r.URL.String())
			return
		}
		w.Header().Set("ETag", `"abc123"`)
		writeSync(w, map[string]any{
			"name": "c1", "type": "container", "status": "Running", "status_code": 103,
			"config":   map[string]string{"user.x": "1", "volatile.uuid": "u"},
			"devices":  map[string]map[string]string{"eth0": {"type": "nic"}},
			"profiles": []string{"default"}, "project": "p1", "location": "none",
			"created_at": "2026-01-02T03:04:05.5Z", "last_used_at": "1970-01-01T00:00:00Z",
			"expanded_config": map[string]string{"user.x": "1"},
		})
	}))
	inst, etag, err := f.client.GetInstance(t.Context(), "c1")
	if err != nil {
		t.Fatal(err)
	}
	if etag != `"abc123"` {
		t.Errorf("etag %q", etag)
	}
	if inst.Name != "c1" || inst.StatusCode != StatusRunning || inst.Config["user.x"] != "1" ||
		inst.Devices["eth0"]["type"] != "nic" || inst.CreatedAt.IsZero() {
		t.Errorf("decoded %+v", inst)
	}
	ex, err := f.client.GetInstanceExpanded(t.Context(), "c1")
	if err != nil {
		t.Fatal(err)
	}
	if ex.Name != "c1" || ex.Config["user.x"] != "1" || ex.ExpandedConfig["user.x"] != "1" {
		t.Errorf("decoded expanded %+v", ex)
	}
	w := inst.Writable()
	w.Config["user.y"] = "2"
	if _, ok := inst.Config["user.y"]; ok {
		t.Error("Writable must copy Config, not alias it")
	}
	// GetInstance, then GetInstanceExpanded.
	if got := f.seen(); len(got) != 2 || got[0] != (observed{"instance.get", "ok"}) || got[1] != got[0] {
		t.Errorf("observed %v", got)
	}
}

func TestErrorMapping(t *testing.T) {
	cases := []struct {
		name       string
		httpStatus int
		code       int
		msg        string
		is         error
		retryable  bool
		observed   string
	}{
		{"not found", 404, 404, "Instance not found", ErrNotFound, false, "not_found"},
		{"conflict", 409, 409, "This \"instances\" entry already exists", ErrConflict, false, "conflict"},
		{"etag", 412, 412, "ETag doesn't match", ErrPreconditionFailed, false, "conflict"},
		{"bad request", 400, 400, "Instance is running", nil, false, "error"},
		{"server error", 500, 500, "boom", nil, true, "error"},
		{"unavailable", 503, 503, "busy", nil, true, "error"},
		{"duplicate worded as 500", 500, 500, `Failed creating project "x": Failed to create "projects" entry: UNIQUE constraint failed: projects.name`, ErrConflict, false, "error"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				writeError(w, tc.httpStatus, tc.code, tc.msg)
			}))
			_, _, err := f.client.GetInstance(t.Context(), "c1")
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("want *Error, got %T %v", err, err)
			}
			if e.Status != tc.code || e.Message != tc.msg || e.Op != "instance.get" {
				t.Errorf("got %+v", e)
			}
			for _, s := range []error{ErrNotFound, ErrConflict, ErrPreconditionFailed} {
				if got := errors.Is(err, s); got != errors.Is(tc.is, s) {
					t.Errorf("errors.Is(err, %v) = %v", s, got)
				}
			}
			if got := IsRetryable(err); got != tc.retryable {
				t.Errorf("IsRetryable = %v", got)
			}
			if !strings.HasPrefix(err.Error(), `incus: get instance "c1": `) || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("message %q", err.Error())
			}
			if got := f.seen(); len(got) != 1 || got[0].status != tc.observed {
				t.Errorf("observed %v, want %s", got, tc.observed)
			}
		})
	}
}

func TestMalformedResponses(t *testing.T) {
	cases := []struct {
		name      string
		status    int
		body      string
		malformed bool
		retryable bool
	}{
		{"not json", 200, "hello", true, false},
		{"no type", 200, `{"metadata":{}}`, true, false},
		{"unknown type", 200, `{"type":"weird","metadata":{}}`, true, false},
		{"bad metadata", 200, `{"type":"sync","status_code":200,"metadata":"a string"}`, true, false},
		{"proxy 502 html", 502, "<html>bad gateway</html>", false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(tc.status)
				_, _ = io.WriteString(w, tc.body)
			}))
			_, _, err := f.client.GetInstance(t.Context(), "c1")
			if err == nil {
				t.Fatal("want error")
			}
			if got := errors.Is(err, ErrMalformedResponse); got != tc.malformed {
				t.Errorf("malformed = %v (%v)", got, err)
			}
			if got := IsRetryable(err); got != tc.retryable {
				t.Errorf("retryable = %v (%v)", got, err)
			}
			if errors.Is(err, ErrNotFound) {
				t.Error("must not look like not found")
			}
		})
	}
}

// A server that dies in the middle of a response: transport error, retryable.
func TestConnectionDroppedMidBody(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"type":"sync","metadata":{"na`)
		w.(http.Flusher).Flush()
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	_, _, err := f.client.GetInstance(t.Context(), "c1")
	var e *Error
	if !errors.As(err, &e) || e.Err == nil {
		t.Fatalf("want transport *Error, got %v", err)
	}
	if !IsRetryable(err) {
		t.Errorf("dropped connection should be retryable: %v", err)
	}
	if got := f.seen(); len(got) != 1 || got[0].status != "transport" {
		t.Errorf("observed %v", got)
	}
}

func TestCallTimeoutAndCancellation(t *testing.T) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	f.client.callTimeout = 100 * time.Millisecond

	start := time.Now()
	_, _, err := f.client.GetInstance(t.Context(), "c1")
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("call took %s despite a 100ms CallTimeout", d)
	}
	if !errors.Is(err, context.DeadlineExceeded) || !IsRetryable(err) {
		t.Fatalf("own timeout: want retryable deadline error, got %v", err)
	}
	if !strings.Contains(err.Error(), "longer than 100ms") {
		t.Errorf("message should say the call timed out: %v", err)
	}

	// An earlier ctx deadline wins over CallTimeout.
	f.client.callTimeout = time.Hour
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	start = time.Now()
	_, _, err = f.client.GetInstance(ctx, "c1")
	if d := time.Since(start); d > 2*time.Second || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ctx deadline: took %s, err %v", d, err)
	}

	// Cancellation by the caller is not retryable.
	ctx, cancel = context.WithCancel(t.Context())
	time.AfterFunc(50*time.Millisecond, cancel)
	_, _, err = f.client.GetInstance(ctx, "c1")
	if !errors.Is(err, context.Canceled) || IsRetryable(err) {
		t.Fatalf("cancel: want non-retryable context.Canceled, got %v (retryable %v)", err, IsRetryable(err))
	}
}

func TestRequestsCarryProjectETagAndBody(t *testing.T) {
	var patched, put atomic.Value
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("project") != "p1" {
			writeError(w, 400, 400, "no project")
			return
		}
		body, _ := io.ReadAll(r.Body)
		switch {
		case r.Method == http.MethodPatch && r.URL.Path == "/1.0/instances/c1":
			patched.Store(string(body))
			writeSync(w, map[string]any{})
		case r.Method == http.MethodPut && r.URL.Path == "/1.0/instances/c1":
			if r.Header.Get("If-Match") != `"good"` {
				writeError(w, 412, 412, "ETag doesn't match: x vs y")
				return
			}
			put.Store(string(body))
			writeAsync(w, opJSON("op-put", "Running", 103, ""))
		case r.URL.Path == "/1.0/operations/op-put/wait":
			writeSync(w, opJSON("op-put", "Success", 200, ""))
		default:
			writeError(w, 404, 404, "not found")
		}
	}))
	ctx := t.Context()
	if err := f.client.PatchInstanceConfig(ctx, "c1", map[string]string{"user.a": "1"}); err != nil {
		t.Fatal(err)
	}
	if got := patched.Load(); got != `{"config":{"user.a":"1"}}` {
		t.Errorf("PATCH body %v", got)
	}
	if err := f.client.PatchInstanceConfig(ctx, "c1", nil); err != nil {
		t.Fatal("empty patch should be a no-op")
	}

	in := InstancePut{Config: map[string]string{"user.b": "2"}, Profiles: []string{"default"}}
	err := f.client.UpdateInstance(ctx, "c1", in, `"stale"`)
	if !errors.Is(err, ErrPreconditionFailed) {
		t.Fatalf("stale etag: want ErrPreconditionFailed, got %v", err)
	}
	if err := f.client.UpdateInstance(ctx, "c1", in, `"good"`); err != nil {
		t.Fatal(err)
	}
	var sent map[string]any
	if err := json.Unmarshal([]byte(put.Load().(string)), &sent); err != nil {
		t.Fatal(err)
	}
	if sent["config"].(map[string]any)["user.b"] != "2" {
		t.Errorf("PUT body %v", sent)
	}
	want := []observed{
		{"instance.patch", "ok"}, {"instance.put", "conflict"}, {"instance.put", "ok"}, {"operation.wait", "ok"},
	}
	if got := f.seen(); !equalObserved(got, want) {
		t.Errorf("observed %v, want %v", got, want)
	}
}

func TestCreateInstanceRequestShape(t *testing.T) {
	var body atomic.Value
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		body.Store(b)
		writeAsync(w, opJSON("op-1", "Running", 103, ""))
	}))
	op, err := f.client.CreateInstance(t.Context(), InstancesPost{
		Name: "c1", Source: InstanceSource{Type: "image", Alias: "img"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if op.ID != "op-1" || op.StatusCode != StatusRunning || op.Resources["instances"][0] == "" {
		t.Errorf("operation %+v", op)
	}
	var sent map[string]any
	_ = json.Unmarshal(body.Load().([]byte), &sent)
	if p, ok := sent["profiles"]; !ok || p != nil {
		t.Errorf("nil Profiles must be sent as null (server applies the default profile), got %v", sent)
	}
	if sent["start"] != false || sent["source"].(map[string]any)["alias"] != "img" {
		t.Errorf("body %v", sent)
	}
	if _, ok := sent["source"].(map[string]any)["fingerprint"]; ok {
		t.Errorf("empty fingerprint should be omitted: %v", sent)
	}
}

func TestOperationID(t *testing.T) {
	for in, want := range map[string]string{
		"/1.0/operations/abc-123":             "abc-123",
		"/1.0/operations/abc-123?project=foo": "abc-123",
		"/1.0/operations/":                    "",
		"/1.0/instances/x":                    "",
		"":                                    "",
	} {
		if got := operationID(in); got != want {
			t.Errorf("operationID(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestListOperationsOnlyUnfinished(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("recursion") != "1" || r.URL.Query().Get("project") != "p1" {
			writeError(w, 400, 400, "bad query "+r.URL.RawQuery)
			return
		}
		writeSync(w, map[string]any{
			"running": []any{opJSON("r1", "Running", 103, "")},
			"pending": []any{opJSON("p1", "Pending", 105, "")},
			"success": []any{opJSON("s1", "Success", 200, "")},
			"failure": []any{opJSON("f1", "Failure", 400, "x")},
		})
	}))
	ops, err := f.client.ListOperations(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, o := range ops {
		ids[o.ID] = true
	}
	if len(ops) != 2 || !ids["r1"] || !ids["p1"] {
		t.Errorf("got %v", ids)
	}
}

func TestOperationErrorClassification(t *testing.T) {
	dup := &OperationError{ID: "x", Status: "Failure", StatusCode: 400,
		Err: `Failed creating instance record: Add instance info to the database: Failed to create "instances" entry: UNIQUE constraint failed: instances.project_id, instances.name`}
	if !errors.Is(dup, ErrConflict) || errors.Is(dup, ErrNotFound) || IsRetryable(dup) {
		t.Errorf("duplicate create: conflict %v", errors.Is(dup, ErrConflict))
	}
	other := &OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: "The instance is already running"}
	if errors.Is(other, ErrConflict) || errors.Is(other, ErrBusy) {
		t.Error("ordinary failure is neither a conflict nor busy")
	}
	// Seen on Incus 6.0.4 when a state change meets a config update.
	busyOp := &OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: `Instance is busy running a "update" operation`}
	busyCall := &Error{Op: "instance.patch", Status: 500,
		Message: `Failed to create instance update operation: Instance is busy running a "start" operation`}
	if !errors.Is(busyOp, ErrBusy) || !errors.Is(busyCall, ErrBusy) || errors.Is(busyOp, ErrConflict) {
		t.Error("a refusal because another operation holds the instance is ErrBusy, from a call or an operation")
	}
	// A stop's hold, as a graceful stop that failed its timeout leaves it.
	stopHeld := &Error{Op: "instance.patch", Status: 500,
		Message: `Failed to create instance update operation: Instance is busy running a "stop" operation`}
	if !errors.Is(stopHeld, ErrBusyStopping) || !errors.Is(stopHeld, ErrBusy) || errors.Is(busyCall, ErrBusyStopping) || errors.Is(busyOp, ErrBusyStopping) {
		t.Error("only a stop's hold is ErrBusyStopping")
	}
	if IsRetryable(nil) || IsRetryable(errors.New("x")) {
		t.Error("IsRetryable of nil / foreign error")
	}
}

func equalObserved(a, b []observed) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A start of a running instance and a stop of a stopped one are answered
// either as the call's error or as the operation's failure; each is its
// sentinel (never ErrBusy, never the other), and nothing else is.
func TestAlreadyThereIsTyped(t *testing.T) {
	for _, tc := range []struct {
		want, other error
		is, isNot   []error
	}{{
		want: ErrAlreadyRunning, other: ErrAlreadyStopped,
		is: []error{
			&Error{Op: "instance.state", Status: 400, Message: "The instance is already running"},
			&OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: "The instance is already running"},
		},
		isNot: []error{
			&OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: `Instance is busy running a "start" operation`},
			&Error{Op: "instance.state", Err: errors.New("already running")}, // a transport error is no answer
		},
	}, {
		want: ErrAlreadyStopped, other: ErrAlreadyRunning,
		is: []error{
			&Error{Op: "instance.state", Status: 400, Message: "The instance is already stopped"},
			&OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: "The instance is already stopped"},
			&OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: `container is not running: "p_c1"`},
		},
		isNot: []error{
			&OperationError{ID: "x", Status: "Failure", StatusCode: 400, Err: `Instance is busy running a "stop" operation`},
			&Error{Op: "instance.state", Err: errors.New("already stopped")}, // a transport error is no answer
		},
	}} {
		for _, err := range tc.is {
			if !errors.Is(err, tc.want) || errors.Is(err, tc.other) || errors.Is(err, ErrBusy) {
				t.Errorf("%v: is %v %v, is %v %v, busy %v", err, tc.want, errors.Is(err, tc.want), tc.other, errors.Is(err, tc.other), errors.Is(err, ErrBusy))
			}
		}
		// The other sentinel's answers are checked against this one in its
		// own case (tc.other); these are the near misses.
		for _, err := range tc.isNot {
			if errors.Is(err, tc.want) {
				t.Errorf("%v is %v", err, tc.want)
			}
		}
	}
}
