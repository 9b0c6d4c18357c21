package incus

// A fake Incus for what the real daemon cannot be made to do on demand
// (5xx, broken bodies, waits that time out on cue). It listens on a unix
// socket in the test's temp dir, so the real dialer is exercised too.

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

type observed struct {
	op, status string
}

type fake struct {
	t      *testing.T
	srv    *httptest.Server
	client *Client

	mu       sync.Mutex
	observed []observed
}

func newFake(t *testing.T, h http.Handler) *fake {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "incus.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{t: t, srv: httptest.NewUnstartedServer(h)}
	f.srv.Listener.Close()
	f.srv.Listener = l
	f.srv.Start()
	t.Cleanup(f.srv.Close)

	c, err := New(Config{
		Socket:      sock,
		Project:     "p1",
		CallTimeout: 2 * time.Second,
		Observe: func(op, status string, _ time.Duration) {
			f.mu.Lock()
			f.observed = append(f.observed, observed{op, status})
			f.mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	c.waitBackoff = time.Millisecond
	c.waitGrace = 500 * time.Millisecond
	f.client = c
	return f
}

func (f *fake) seen() []observed {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]observed(nil), f.observed...)
}

// sync writes a sync envelope around metadata.
func writeSync(w http.ResponseWriter, metadata any) {
	writeJSON(w, http.StatusOK, map[string]any{
		"type": "sync", "status": "Success", "status_code": 200,
		"operation": "", "error_code": 0, "error": "", "metadata": metadata,
	})
}

// writeAsync writes a 202 async envelope for operation op.
func writeAsync(w http.ResponseWriter, op map[string]any) {
	writeJSON(w, http.StatusAccepted, map[string]any{
		"type": "async", "status": "Operation created", "status_code": 100,
		"operation": "/1.0/operations/" + op["id"].(string), "error_code": 0, "error": "", "metadata": op,
	})
}

// writeError writes an error envelope with HTTP status httpStatus and
// Incus error_code code.
func writeError(w http.ResponseWriter, httpStatus, code int, msg string) {
	writeJSON(w, httpStatus, map[string]any{
		"type": "error", "status": "", "status_code": 0,
		"operation": "", "error_code": code, "error": msg, "metadata": nil,
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func opJSON(id, status string, code int, errText string) map[string]any {
	return map[string]any{
		"id": id, "class": "task", "description": "Creating instance",
		"created_at": "2026-01-02T03:04:05Z", "updated_at": "2026-01-02T03:04:05Z",
		"status": status, "status_code": code,
		"resources": map[string][]string{"instances": {"/1.0/instances/c1?project=p1"}},
		"metadata":  nil, "may_cancel": false, "err": errText, "location": "none",
	}
}
