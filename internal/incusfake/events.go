package incusfake

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// stream is one subscriber of GET /1.0/events.
type stream struct {
	conn    *websocket.Conn
	project string
	types   map[string]bool
	queue   [][]byte      // frames not yet written; s.mu guards it
	signal  chan struct{} // capacity 1: the queue grew
	gone    chan struct{} // closed when the stream is cut or its reader ends
	once    sync.Once
}

func (st *stream) cut() {
	st.once.Do(func() {
		close(st.gone)
		_ = st.conn.Close()
	})
}

// maxQueued bounds a subscriber's backlog; Incus likewise drops a
// listener that does not keep up.
const maxQueued = 10000

// eventJSON is one frame of the stream.
type eventJSON struct {
	Type      string    `json:"type"`
	Timestamp time.Time `json:"timestamp"`
	Location  string    `json:"location"`
	Project   string    `json:"project"`
	Metadata  any       `json:"metadata"`
}

type lifecycleJSON struct {
	Action  string         `json:"action"`
	Source  string         `json:"source"`
	Name    string         `json:"name,omitempty"`
	Context map[string]any `json:"context"`
}

// lifecycle announces a completed action on source; s.mu held.
func (s *Server) lifecycle(project, action, source string, ctx map[string]any) {
	if ctx == nil {
		ctx = map[string]any{}
	}
	name := source[strings.LastIndex(source, "/")+1:]
	name, _, _ = strings.Cut(name, "?")
	s.emit(eventJSON{Type: incus.EventLifecycle, Timestamp: s.clock.Now(), Location: "none", Project: project,
		Metadata: lifecycleJSON{Action: action, Source: source, Name: name, Context: ctx}})
}

// opEvent announces an operation's new state; s.mu held.
func (s *Server) opEvent(op *operation) {
	s.emit(eventJSON{Type: incus.EventOperation, Timestamp: s.clock.Now(), Location: "none", Project: op.project,
		Metadata: op.Operation})
}

// emit queues ev for every subscriber of its project and type, unless
// events are being dropped; s.mu held, so that frames keep the order of
// the changes they tell of.
func (s *Server) emit(ev eventJSON) {
	if s.dropEvents {
		s.dropped++
		return
	}
	raw, err := json.Marshal(ev)
	if err != nil {
		return
	}
	for st := range s.streams {
		if st.project != ev.Project || !st.types[ev.Type] {
			continue
		}
		if len(st.queue) >= maxQueued {
			delete(s.streams, st)
			st.cut()
			continue
		}
		st.queue = append(st.queue, raw)
		s.delivered++
		select {
		case st.signal <- struct{}{}:
		default:
		}
	}
}

// DropEvents switches event loss on or off: while on, every event is
// dropped for every subscriber, as events lost on the way would be.
func (s *Server) DropEvents(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropEvents = on
}

// EventsDropped counts the events DropEvents dropped.
func (s *Server) EventsDropped() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dropped
}

// EventStreams counts the event subscribers connected now.
func (s *Server) EventStreams() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.streams)
}

// CutEvents closes every event stream at once, without a close frame, as
// a broken connection would, and says how many there were.
func (s *Server) CutEvents() int {
	s.mu.Lock()
	cut := make([]*stream, 0, len(s.streams))
	for st := range s.streams {
		cut = append(cut, st)
		delete(s.streams, st)
	}
	s.notify()
	s.mu.Unlock()
	for _, st := range cut {
		st.cut()
	}
	return len(cut)
}

var upgrader = websocket.Upgrader{}

// serveEvents follows one subscriber until it goes, is cut, or the fake
// closes. Its reader answers the client's pings and sees it go.
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	types := map[string]bool{}
	for _, t := range strings.Split(r.URL.Query().Get("type"), ",") {
		if t != "" {
			types[t] = true
		}
	}
	if len(types) == 0 {
		types[incus.EventLifecycle], types[incus.EventOperation] = true, true
	}
	conn, err := upgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	st := &stream{conn: conn, project: projectOf(r), types: types, signal: make(chan struct{}, 1), gone: make(chan struct{})}
	s.mu.Lock()
	select {
	case <-s.done:
		s.mu.Unlock()
		st.cut()
		return
	default:
	}
	s.streams[st] = struct{}{}
	s.notify()
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.streams, st)
		s.notify()
		s.mu.Unlock()
		st.cut()
	}()

	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		defer st.cut()
		for {
			if _, _, err := conn.NextReader(); err != nil {
				return
			}
		}
	}()
	defer func() { <-readerDone }()

	for {
		select {
		case <-st.gone:
			return
		case <-s.done:
			return
		case <-st.signal:
		}
		s.mu.Lock()
		frames := st.queue
		st.queue = nil
		s.mu.Unlock()
		for _, f := range frames {
			_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
			if err := conn.WriteMessage(websocket.TextMessage, f); err != nil {
				return
			}
		}
	}
}
