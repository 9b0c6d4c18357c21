package incusfake

import (
	"context"
	"net"
	"net/http"
	"path"
	"sync"
	"time"
)

// FaultKind is what a fault does to a call it matches.
type FaultKind int

const (
	// Refuse answers the call with an Incus error (Status, Message)
	// without serving it.
	Refuse FaultKind = iota + 1
	// Hang holds the call before it is served until Release, or until
	// the caller gives up (then nothing of it is done).
	Hang
	// DropResponse serves the call (a write is applied) and then cuts the
	// connection without an answer: the client cannot know the outcome.
	DropResponse
	// Latency adds Latency of wall-clock time before the call is served.
	Latency
)

// Fault is a misbehaviour for the calls it matches, given to Inject.
type Fault struct {
	Kind FaultKind
	// Method matches the HTTP method; "" matches any.
	Method string
	// Path matches the URL path with path.Match ("/1.0/instances/*",
	// "/1.0/operations/*/wait"); "" matches any.
	Path string
	// Times is how many matching calls the fault applies to; 0 is every
	// one until Remove.
	Times int
	// Skip is how many matching calls pass untouched before the fault
	// applies: a test that holds the second read of an instance, not the
	// first.
	Skip int
	// Status and Message are a Refuse's answer (default 500 and a text
	// saying it was injected). The status is also the Incus error code.
	Status  int
	Message string
	// Latency is a Latency fault's delay.
	Latency time.Duration
}

// Injected is a fault in force.
type Injected struct {
	s       *Server
	f       Fault
	left    int
	skip    int
	hits    int
	removed bool
	hit     chan struct{} // closed at the first hit
	release chan struct{} // closed by Release
	relOnce sync.Once
}

// Inject puts f in force for the calls that arrive from now on; faults
// apply in the order injected.
func (s *Server) Inject(f Fault) *Injected {
	h := &Injected{s: s, f: f, left: f.Times, skip: f.Skip, hit: make(chan struct{}), release: make(chan struct{})}
	s.mu.Lock()
	s.faults = append(s.faults, h)
	s.mu.Unlock()
	return h
}

// Hit is closed once the fault has met its first call; for a Hang, the
// call is then held.
func (h *Injected) Hit() <-chan struct{} { return h.hit }

// Hits counts the calls the fault applied to.
func (h *Injected) Hits() int {
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	return h.hits
}

// Release lets calls a Hang holds go on to be served, and later matching
// calls pass without being held.
func (h *Injected) Release() { h.relOnce.Do(func() { close(h.release) }) }

// Remove takes the fault out of force (a held call stays held until
// Release).
func (h *Injected) Remove() {
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	h.removed = true
}

func (h *Injected) matches(r *http.Request) bool {
	if h.removed || (h.f.Times > 0 && h.left <= 0) {
		return false
	}
	if h.f.Method != "" && h.f.Method != r.Method {
		return false
	}
	if h.f.Path != "" {
		ok, err := path.Match(h.f.Path, r.URL.Path)
		if err != nil || !ok {
			return false
		}
	}
	return true
}

func (h *Injected) status() int {
	if h.f.Status == 0 {
		return http.StatusInternalServerError
	}
	return h.f.Status
}

func (h *Injected) message() string {
	if h.f.Message == "" {
		return "incusfake: injected refusal"
	}
	return h.f.Message
}

// hold waits for Release; false when the call or the fake ended first.
func (h *Injected) hold(ctx context.Context, done <-chan struct{}) bool {
	select {
	case <-h.release:
		return true
	case <-ctx.Done():
	case <-done:
	}
	return false
}

// callPlan is what the faults do to one call.
type callPlan struct {
	latency time.Duration
	hangs   []*Injected
	refuse  *Injected
	drop    bool
}

func (s *Server) faultsFor(r *http.Request) callPlan {
	var plan callPlan
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range s.faults {
		if !h.matches(r) {
			continue
		}
		if h.skip > 0 {
			h.skip--
			continue
		}
		if plan.refuse != nil && (h.f.Kind == Refuse || h.f.Kind == DropResponse) {
			continue // one outcome per call: the first fault that decides it
		}
		if plan.drop && (h.f.Kind == Refuse || h.f.Kind == DropResponse) {
			continue
		}
		h.left--
		h.hits++
		if h.hits == 1 {
			close(h.hit)
		}
		switch h.f.Kind {
		case Refuse:
			plan.refuse = h
		case Hang:
			plan.hangs = append(plan.hangs, h)
		case DropResponse:
			plan.drop = true
		case Latency:
			plan.latency += h.f.Latency
		}
	}
	if len(s.faults) > 0 {
		s.notify()
	}
	return plan
}

// serveDropped serves the call into nothing and cuts its connection.
func (s *Server) serveDropped(w http.ResponseWriter, r *http.Request) {
	s.route(&discard{header: http.Header{}}, r)
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		// Without the connection, the best left is an answer that is not
		// one: a broken body.
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(http.StatusOK)
		return
	}
	if uc, ok := conn.(*net.UnixConn); ok {
		_ = uc.CloseWrite()
	}
	_ = conn.Close()
}

// discard is a ResponseWriter that keeps nothing.
type discard struct {
	header http.Header
}

func (d *discard) Header() http.Header         { return d.header }
func (d *discard) Write(b []byte) (int, error) { return len(b), nil }
func (d *discard) WriteHeader(int)             {}
func (d *discard) Flush()                      {}

var _ http.Flusher = (*discard)(nil)
