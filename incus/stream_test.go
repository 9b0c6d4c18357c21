package incus

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// listOf writes a listing of n instances, each with config keys the keep
// function drops, the way Incus writes it (the type before the metadata).
func listOf(n int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/1.0/instances" || r.URL.Query().Get("recursion") != "1" {
			http.Error(w, "unexpected "+r.URL.String(), http.StatusTeapot)
			return
		}
		list := make([]map[string]any, n)
		for i := range list {
			list[i] = map[string]any{
				"name": fmt.Sprintf("c%d", i), "status": "Running", "status_code": 103, "location": "m1",
				"config": map[string]string{"user.owner": fmt.Sprint(i), "volatile.idmap": strings.Repeat("x", 100)},
			}
		}
		writeSync(w, list)
	}
}

func keepUser(inst *Instance) *Instance {
	if inst.Name == "c1" {
		return nil // dropped: not the caller's
	}
	return &Instance{Name: inst.Name, Status: inst.Status, Config: map[string]string{"user.owner": inst.Config["user.owner"]}}
}

func TestListInstancesKeptMatchesTheWholeListing(t *testing.T) {
	f := newFake(t, listOf(500))
	whole, err := f.client.ListInstances(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	kept, err := f.client.ListInstancesKept(t.Context(), keepUser)
	if err != nil {
		t.Fatal(err)
	}
	if len(whole) != 500 || len(kept) != 499 {
		t.Fatalf("whole %d, kept %d", len(whole), len(kept))
	}
	j := 0
	for i := range whole {
		want := keepUser(&whole[i])
		if want == nil {
			continue
		}
		got := kept[j]
		j++
		if got.Name != want.Name || got.Status != want.Status || len(got.Config) != 1 || got.Config["user.owner"] != want.Config["user.owner"] {
			t.Fatalf("item %d: kept %+v, want %+v", i, got, want)
		}
	}
	if got := f.seen(); len(got) != 2 || got[1] != (observed{"instance.list", "ok"}) {
		t.Errorf("observed %v", got)
	}
}

// Every way a streamed body can be wrong is refused as the whole-body
// parse refuses it, and an error envelope keeps its status.
func TestListInstancesKeptRefusesWhatParseRefuses(t *testing.T) {
	cases := []struct {
		name, body string
		status     int // 0: malformed
	}{
		{"not json", "hello", 0},
		{"no type", `{"metadata":[]}`, 0},
		{"unknown type", `{"type":"weird","metadata":[]}`, 0},
		{"metadata not an array", `{"type":"sync","metadata":"a string"}`, 0},
		{"an item not an instance", `{"type":"sync","metadata":[{"name":"c0"},7]}`, 0},
		{"cut short", `{"type":"sync","metadata":[{"name":"c0"}`, 0},
		{"more after the object", `{"type":"sync","metadata":[]} {}`, 0},
		{"error envelope under 200", `{"type":"error","error_code":403,"error":"not allowed","metadata":null}`, 403},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.WriteString(w, tc.body)
			}))
			list, err := f.client.ListInstancesKept(t.Context(), keepUser)
			if err == nil {
				t.Fatalf("want an error, got %v", list)
			}
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("want *Error, got %v", err)
			}
			if tc.status == 0 && !errors.Is(err, ErrMalformedResponse) {
				t.Errorf("want malformed, got %v", err)
			}
			if tc.status != 0 && e.Status != tc.status {
				t.Errorf("want status %d, got %v", tc.status, err)
			}
		})
	}
}

// An empty project lists as null or as an empty array; both are no instances.
func TestListInstancesKeptEmpty(t *testing.T) {
	for _, md := range []string{"null", "[]"} {
		f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"type":"sync","status_code":200,"metadata":`+md+`}`)
		}))
		list, err := f.client.ListInstancesKept(t.Context(), keepUser)
		if err != nil || len(list) != 0 {
			t.Errorf("%s: %v %v", md, list, err)
		}
	}
}

// A body larger than the client reads at most is refused, not read on.
func TestListInstancesKeptRefusesAnOversizedBody(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"type":"sync","metadata":[{"name":"`)
		pad := []byte(strings.Repeat("x", 1<<20))
		for range maxResponse>>20 + 1 {
			if _, err := w.Write(pad); err != nil {
				return
			}
		}
		_, _ = io.WriteString(w, `"}]}`)
	}))
	// 64 MiB takes a second here and several under a loaded CI: the
	// fake's 2 s call bound would turn a slow machine into a timeout.
	f.client.callTimeout = 2 * time.Minute
	_, err := f.client.ListInstancesKept(t.Context(), keepUser)
	if !errors.Is(err, ErrMalformedResponse) || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("want an oversized refusal, got %v", err)
	}
}

// A connection that breaks mid-listing is a transport failure, as with a
// whole body, not a malformed answer.
func TestListInstancesKeptConnectionDroppedMidBody(t *testing.T) {
	f := newFake(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"type":"sync","metadata":[{"name":"c0"},{"na`)
		w.(http.Flusher).Flush()
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			_ = conn.Close()
		}
	}))
	_, err := f.client.ListInstancesKept(t.Context(), keepUser)
	if err == nil || errors.Is(err, ErrMalformedResponse) || !IsRetryable(err) {
		t.Fatalf("want a retryable transport failure, got %v", err)
	}
	if got := f.seen(); len(got) != 1 || got[0].status != "transport" {
		t.Errorf("observed %v", got)
	}
}

// A listing cut short on one member is read again from the next, and only
// that second listing is answered: nothing of the first is kept twice.
func TestListInstancesKeptFailsOverWithoutDuplicates(t *testing.T) {
	rg := newRig(t)
	cut := rg.member(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/1.0/instances" {
			serverOK(w, r)
			return
		}
		w.Header().Set("Content-Length", "100000")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"type":"sync","metadata":[{"name":"c0"},{"name":"c2"},{"na`)
		w.(http.Flusher).Flush()
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			_ = conn.Close()
		}
	})
	whole := rg.member(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/1.0/instances" {
			serverOK(w, r)
			return
		}
		listOf(3)(w, r)
	})
	c := rg.client(t, []string{cut.url(), whole.url()}, nil)
	list, err := c.ListInstancesKept(t.Context(), keepUser)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, inst := range list {
		names = append(names, inst.Name)
	}
	if strings.Join(names, ",") != "c0,c2" {
		t.Fatalf("listed %v, want c0,c2 once each", names)
	}
	if cut.count("GET") != 1 || whole.count("GET") != 1 {
		t.Errorf("cut saw %v, whole saw %v", cut.methods, whole.methods)
	}
}
