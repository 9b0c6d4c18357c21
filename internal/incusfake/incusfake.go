// Package incusfake is an in-process, stateful fake of the part of the
// Incus REST API that the incus client calls, served over a unix socket,
// so that code built on the client can be tested in seconds, under -race,
// with many owners at once, and against the behaviours of Incus that are
// awkward or slow to provoke on a real daemon:
//
//   - an ETag is checked when a write arrives and the write is applied
//     later (Config.ApplyDelay), so two writes read at one ETag can both
//     pass and the one applied last wins;
//   - an operation (start, stop, freeze, rename, delete, create, a config
//     update being applied) holds its instance, and other changes are
//     refused with Incus's "Instance is busy running a ..." texts; a
//     graceful stop whose guest ignores it keeps its hold after failing,
//     until a forced stop takes it over;
//   - state changes, creates, renames, deletes and PUTs are operations
//     that end later, in real time or on a manual clock (Advance);
//   - the events websocket carries lifecycle and operation events, and
//     can be made to lose events or be cut;
//   - faults on demand (Inject): refusals, hung calls, answers dropped
//     after the write was applied, latency.
//
// Every write applied is recorded (Writes), and state can be seeded and
// read without HTTP. It is not Incus: profiles, images, storage, exec,
// clustering and the transitional statuses (Starting, Stopping) are not
// modelled, and an instance keeps its old status until its operation ends.
package incusfake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// Config sets up a fake. The zero value is usable but for Dir.
type Config struct {
	// Dir is where the socket is made (a test's t.TempDir()).
	Dir string

	// ManualClock: operations and delayed writes move only as Advance
	// moves the fake's time. Otherwise they run in real time.
	ManualClock bool

	// ApplyDelay is the time between a config write passing its checks
	// (ETag, busy) and being applied; default DefaultApplyDelay, negative
	// for none.
	ApplyDelay time.Duration

	// Durations of the operations; a zero field takes DefaultDuration.
	Durations Durations

	// Start is the manual clock's first instant (default 2026-01-01 UTC).
	Start time.Time
}

// Durations are how long each kind of operation holds its instance.
type Durations struct {
	Create, Start, Stop, ForcedStop, Freeze, Unfreeze, Restart, Rename, Delete time.Duration

	// ShutdownTimeout is a graceful stop's limit when the request sets
	// none (Incus waits up to 600 s then).
	ShutdownTimeout time.Duration
}

const (
	// DefaultApplyDelay is short enough for fast tests and long enough
	// for two concurrent writes to overlap in real time.
	DefaultApplyDelay = 3 * time.Millisecond
	// DefaultDuration is every operation's default duration.
	DefaultDuration = 5 * time.Millisecond
	// DefaultShutdownTimeout is Incus's own limit for a graceful stop.
	DefaultShutdownTimeout = 600 * time.Second
)

func (d *Durations) defaults() {
	for _, p := range []*time.Duration{&d.Create, &d.Start, &d.Stop, &d.ForcedStop, &d.Freeze, &d.Unfreeze, &d.Restart, &d.Rename, &d.Delete} {
		if *p <= 0 {
			*p = DefaultDuration
		}
	}
	if d.ShutdownTimeout <= 0 {
		d.ShutdownTimeout = DefaultShutdownTimeout
	}
}

// Server is a running fake. Its methods are safe for concurrent use.
type Server struct {
	cfg    Config
	socket string
	clock  *clock
	srv    *http.Server
	done   chan struct{}
	bg     sync.WaitGroup // the serving and firing goroutines

	gate   sync.Mutex // guards closed and the Add side of calls
	closed bool
	calls  sync.WaitGroup // calls being served, event streams included

	mu         sync.Mutex
	projects   map[string]*project
	ops        map[string]*operation
	finished   []string // IDs of final operations, oldest first
	opSeq      int
	pid        int64
	writes     []Write
	pending    int // writes that passed their checks and are not applied yet
	changed    chan struct{}
	faults     []*Injected
	streams    map[*stream]struct{}
	dropEvents bool
	dropped    int
	delivered  int
}

type project struct {
	name        string
	description string
	config      map[string]string
	instances   map[string]*instance
}

// maxFinished bounds the final operations kept for GET and wait, as Incus
// keeps them only a while after they end.
const maxFinished = 4096

// Start makes the socket in cfg.Dir and serves until Close.
func Start(cfg Config) (*Server, error) {
	if cfg.Dir == "" {
		return nil, errors.New("incusfake: Config.Dir is required")
	}
	if cfg.ApplyDelay == 0 {
		cfg.ApplyDelay = DefaultApplyDelay
	}
	cfg.ApplyDelay = max(cfg.ApplyDelay, 0)
	cfg.Durations.defaults()
	if cfg.Start.IsZero() {
		cfg.Start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	s := &Server{
		cfg:      cfg,
		socket:   filepath.Join(cfg.Dir, "incus.sock"),
		clock:    newClock(cfg.ManualClock, cfg.Start),
		done:     make(chan struct{}),
		projects: map[string]*project{},
		ops:      map[string]*operation{},
		changed:  make(chan struct{}),
		streams:  map[*stream]struct{}{},
		pid:      1000,
	}
	s.projects[incus.DefaultProject] = &project{name: incus.DefaultProject, config: map[string]string{}, instances: map[string]*instance{}}
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "unix", s.socket)
	if err != nil {
		return nil, fmt.Errorf("incusfake: %w", err)
	}
	s.srv = &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	s.bg.Add(2)
	go func() {
		defer s.bg.Done()
		_ = s.srv.Serve(ln)
	}()
	go func() {
		defer s.bg.Done()
		s.clock.run(s.done)
	}()
	return s, nil
}

// Socket is the path to give incus.Config.Socket.
func (s *Server) Socket() string { return s.socket }

// Client is an incus client for project (default when empty) on the fake.
func (s *Server) Client(project string) (*incus.Client, error) {
	return incus.New(incus.Config{Socket: s.socket, Project: project})
}

// Close stops serving, ends every hung call, event stream and operation
// wait, stops the clock, and returns once every goroutine of the fake has
// ended. Operations still running stay as they are.
func (s *Server) Close() error {
	s.gate.Lock()
	if s.closed {
		s.gate.Unlock()
		return nil
	}
	s.closed = true
	s.gate.Unlock()
	close(s.done)
	err := s.srv.Close()
	s.CutEvents()
	s.calls.Wait()
	s.bg.Wait()
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// Now is the fake's time (the manual clock's, or the wall clock).
func (s *Server) Now() time.Time { return s.clock.Now() }

// Advance moves a manual clock on by d and returns once everything due on
// the way (operations ending, writes applying) has happened, in order.
func (s *Server) Advance(d time.Duration) { s.clock.Advance(d) }

// Await returns once cond holds, checking it again after every change to
// the fake's state, or ctx's error. cond may call the fake's methods.
func (s *Server) Await(ctx context.Context, cond func() bool) error {
	for {
		s.mu.Lock()
		ch := s.changed
		s.mu.Unlock()
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.done:
			return errors.New("incusfake: closed")
		}
	}
}

// notify wakes Await; called with s.mu held after every change.
func (s *Server) notify() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// enter admits a call unless the fake is closing.
func (s *Server) enter() bool {
	s.gate.Lock()
	defer s.gate.Unlock()
	if s.closed {
		return false
	}
	s.calls.Add(1)
	return true
}

// ServeHTTP applies the faults that match the call, then serves it.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !s.enter() {
		writeError(w, http.StatusServiceUnavailable, "Shutting down")
		return
	}
	defer s.calls.Done()
	plan := s.faultsFor(r)
	if !s.delay(r.Context(), plan.latency) {
		return
	}
	for _, h := range plan.hangs {
		if !h.hold(r.Context(), s.done) {
			return // the caller gave up: nothing of the call was done
		}
	}
	if plan.refuse != nil {
		writeError(w, plan.refuse.status(), plan.refuse.message())
		return
	}
	if plan.drop {
		s.serveDropped(w, r)
		return
	}
	s.route(w, r)
}

func (s *Server) delay(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-s.done:
	}
	return false
}

// route dispatches on the path; names are single path segments.
func (s *Server) route(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/"), "/")
	if len(parts) == 0 || parts[0] != "1.0" {
		writeError(w, http.StatusNotFound, "not found")
		return
	}
	parts = parts[1:]
	if len(parts) == 0 || (len(parts) == 1 && parts[0] == "") {
		if r.Method == http.MethodGet {
			s.getServer(w, r)
			return
		}
		writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	m := r.Method
	switch {
	case parts[0] == "events" && len(parts) == 1 && m == http.MethodGet:
		s.serveEvents(w, r)
	case parts[0] == "instances" && len(parts) == 1:
		switch m {
		case http.MethodGet:
			s.listInstances(w, r)
		case http.MethodPost:
			s.createInstance(w, r)
		default:
			writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		}
	case parts[0] == "instances" && len(parts) == 2:
		switch m {
		case http.MethodGet:
			s.getInstance(w, r, parts[1])
		case http.MethodPatch, http.MethodPut:
			s.writeInstance(w, r, parts[1])
		case http.MethodPost:
			s.renameInstance(w, r, parts[1])
		case http.MethodDelete:
			s.deleteInstance(w, r, parts[1])
		default:
			writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		}
	case parts[0] == "instances" && len(parts) == 3 && parts[2] == "state":
		switch m {
		case http.MethodGet:
			s.getInstanceState(w, r, parts[1])
		case http.MethodPut:
			s.changeState(w, r, parts[1])
		default:
			writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		}
	case parts[0] == "operations" && len(parts) == 1 && m == http.MethodGet:
		s.listOperations(w, r)
	case parts[0] == "operations" && len(parts) == 2 && m == http.MethodGet:
		s.getOperation(w, parts[1])
	case parts[0] == "operations" && len(parts) == 3 && parts[2] == "wait" && m == http.MethodGet:
		s.waitOperation(w, r, parts[1])
	case parts[0] == "projects" && len(parts) == 1 && m == http.MethodPost:
		s.createProject(w, r)
	case parts[0] == "projects" && len(parts) == 2:
		switch m {
		case http.MethodGet:
			s.getProject(w, parts[1])
		case http.MethodPut, http.MethodPatch:
			s.writeProject(w, r, parts[1])
		case http.MethodDelete:
			s.deleteProject(w, r, parts[1])
		default:
			writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		}
	default:
		writeError(w, http.StatusNotFound, "not found")
	}
}

func (s *Server) getServer(w http.ResponseWriter, r *http.Request) {
	writeSync(w, incus.Server{
		APIExtensions: []string{"instances", "projects", "projects_force_delete", "operation_wait"},
		APIStatus:     "stable", APIVersion: "1.0", Auth: "trusted", AuthMethods: []string{"tls"},
		Config: map[string]string{},
		Environment: incus.ServerEnvironment{Architectures: []string{"x86_64"}, Driver: "lxc",
			Project: projectOf(r), Server: "incus", ServerName: "fake", ServerVersion: "6.0.4"},
	}, "")
}

// projectOf is the call's ?project=, the default project when absent.
func projectOf(r *http.Request) string {
	if p := r.URL.Query().Get("project"); p != "" {
		return p
	}
	return incus.DefaultProject
}

// envelope is the body of every answer, in the key order Incus writes.
type envelope struct {
	Type       string `json:"type"`
	Status     string `json:"status"`
	StatusCode int    `json:"status_code"`
	Operation  string `json:"operation"`
	ErrorCode  int    `json:"error_code"`
	Error      string `json:"error"`
	Metadata   any    `json:"metadata"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeSync(w http.ResponseWriter, md any, etag string) {
	if etag != "" {
		w.Header().Set("ETag", quote(etag))
	}
	writeJSON(w, http.StatusOK, envelope{Type: "sync", Status: "Success", StatusCode: http.StatusOK, Metadata: md})
}

func writeAsync(w http.ResponseWriter, op incus.Operation) {
	writeJSON(w, http.StatusAccepted, envelope{Type: "async", Status: "Operation created", StatusCode: 100,
		Operation: "/1.0/operations/" + op.ID, Metadata: op})
}

// writeError answers as Incus does: the error code repeats the HTTP status.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, envelope{Type: "error", ErrorCode: status, Error: msg})
}

// quote and unquote: Incus sends its ETag quoted and accepts If-Match
// with or without the quotes.
func quote(etag string) string { return `"` + etag + `"` }

func unquote(etag string) string { return strings.Trim(etag, `"`) }

func decodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, 4<<20))
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("Failed to decode request body: %w", err) //nolint:staticcheck // Incus's own capitalised text
	}
	return nil
}

func sortedNames[T any](m map[string]T) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
