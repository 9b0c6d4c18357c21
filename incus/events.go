package incus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"
)

// Event types this client subscribes to (GET /1.0/events?type=).
const (
	EventLifecycle = "lifecycle"
	EventOperation = "operation"
)

// ErrMalformedEvent is matched by the error EventStream.Next returns for a
// frame that does not decode as an event of the types asked for. The
// stream itself is still usable; what the frame said is lost, which is
// a gap for anyone keeping state from the stream.
var ErrMalformedEvent = errors.New("incus: malformed event")

// Event is one message of the events stream, as Incus 6.0 and LXD 5.0
// send it. Exactly one of Lifecycle and Operation is set, by Type.
type Event struct {
	Type      string    `json:"type"`
	Timestamp time.Time `json:"timestamp"`
	// Location is the cluster member the event happened on ("none" or
	// empty on a standalone server).
	Location string `json:"location"`
	// Project is the event's project; LXD 5.0 may leave it empty, and the
	// source's ?project= then tells.
	Project  string          `json:"project"`
	Metadata json.RawMessage `json:"metadata"`

	Lifecycle *LifecycleEvent `json:"-"`
	Operation *Operation      `json:"-"`
}

// LifecycleEvent is the metadata of a lifecycle event: an action that
// completed, such as instance-started or instance-updated.
type LifecycleEvent struct {
	Action string `json:"action"`
	// Source is the API path of what the action was on, with ?project=
	// when not the default project: /1.0/instances/x?project=p.
	Source  string         `json:"source"`
	Name    string         `json:"name"`
	Context map[string]any `json:"context"`
}

// Instances names the instances of project p an event is about: the
// instance a lifecycle event's source names (and the old name of a
// rename), or every instance an operation event lists among its
// resources. ok is false when the event concerns instances of p without
// saying which (a source under /1.0/instances that does not parse).
func (e *Event) Instances(p string) (names []string, ok bool) {
	switch {
	case e.Lifecycle != nil:
		name, mine, ok := instanceOfPath(e.Lifecycle.Source, e.Project, p)
		if !ok {
			return nil, false
		}
		if !mine {
			return nil, true
		}
		names = append(names, name)
		if old, _ := e.Lifecycle.Context["old_name"].(string); old != "" && old != name {
			names = append(names, old)
		}
		return names, true
	case e.Operation != nil:
		for _, u := range e.Operation.Resources["instances"] {
			name, mine, ok := instanceOfPath(u, e.Project, p)
			if !ok {
				return nil, false
			}
			if mine {
				names = append(names, name)
			}
		}
		return names, true
	}
	return nil, true
}

// instanceOfPath takes the instance name out of an API path such as
// /1.0/instances/x, /1.0/instances/x/snapshots/s or
// /1.0/instances/x?project=p. mine says the path is an instance of project
// want (the path's own ?project= first, then the event's project, then
// the default project); ok is false for a path under /1.0/instances that
// names no instance.
func instanceOfPath(raw, eventProject, want string) (name string, mine, ok bool) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", false, !strings.HasPrefix(raw, "/1.0/instances")
	}
	rest, under := strings.CutPrefix(u.Path, "/1.0/instances")
	if !under {
		return "", false, true
	}
	rest, _ = strings.CutPrefix(rest, "/")
	name, _, _ = strings.Cut(rest, "/")
	if name == "" {
		return "", false, false
	}
	proj := u.Query().Get("project")
	if proj == "" {
		proj = eventProject
	}
	if proj == "" {
		proj = DefaultProject
	}
	return name, proj == want, true
}

// decodeEvent decodes one frame strictly where it matters: a frame of
// another type than those asked for, a lifecycle event without an action
// or source, or an operation event without an id or status code is
// malformed. Fields this client does not know are ignored, since Incus
// adds them between releases.
func decodeEvent(raw []byte, types []string) (Event, error) {
	var e Event
	if err := json.Unmarshal(raw, &e); err != nil {
		return Event{}, fmt.Errorf("%w: %w", ErrMalformedEvent, err)
	}
	known := false
	for _, t := range types {
		known = known || t == e.Type
	}
	if !known {
		return Event{}, fmt.Errorf("%w: type %q, not one of %s", ErrMalformedEvent, e.Type, strings.Join(types, ", "))
	}
	if len(e.Metadata) == 0 || e.Metadata[0] != '{' {
		return Event{}, fmt.Errorf("%w: %s event without a metadata object", ErrMalformedEvent, e.Type)
	}
	switch e.Type {
	case EventLifecycle:
		var l LifecycleEvent
		if err := json.Unmarshal(e.Metadata, &l); err != nil {
			return Event{}, fmt.Errorf("%w: lifecycle metadata: %w", ErrMalformedEvent, err)
		}
		if l.Action == "" || !strings.HasPrefix(l.Source, "/1.0") {
			return Event{}, fmt.Errorf("%w: lifecycle event without an action or an API source (action %q, source %q)", ErrMalformedEvent, l.Action, l.Source)
		}
		e.Lifecycle = &l
	case EventOperation:
		var o Operation
		if err := json.Unmarshal(e.Metadata, &o); err != nil {
			return Event{}, fmt.Errorf("%w: operation metadata: %w", ErrMalformedEvent, err)
		}
		if o.ID == "" || o.StatusCode == 0 {
			return Event{}, fmt.Errorf("%w: operation event without an id or status code", ErrMalformedEvent)
		}
		e.Operation = &o
	}
	return e, nil
}

// Event stream keep-alive: a ping every eventPing, and a stream that has
// shown no sign of life (a frame or a pong) for eventSilence is taken for
// dead, since a connection cut without a FIN would otherwise leave Next
// waiting forever.
// Variables so that tests can shrink them.
var (
	eventPing    = 10 * time.Second
	eventSilence = 30 * time.Second
)

// EventStream is a subscription to the events of the client's project.
// Next is for one goroutine; Close may be called from any, at any time.
type EventStream struct {
	conn     *websocket.Conn
	types    []string
	endpoint string

	done      chan struct{}
	closeOnce sync.Once
	pinger    sync.WaitGroup
	ping      time.Duration
	silence   time.Duration
}

// ListenEvents subscribes to the client's project's events of the given
// types (EventLifecycle, EventOperation; both when none). ctx bounds the
// connection and handshake, not the stream's life: Close ends that. The
// endpoints are tried in the order calls prefer them; on a cluster, the
// member connected to forwards the events of every member.
func (c *Client) ListenEvents(ctx context.Context, types ...string) (*EventStream, error) {
	if len(types) == 0 {
		types = []string{EventLifecycle, EventOperation}
	}
	for _, t := range types {
		if t != EventLifecycle && t != EventOperation {
			return nil, fmt.Errorf("incus: events: type %q is not one this client decodes (lifecycle, operation)", t)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, c.callTimeout)
	defer cancel()
	var failures []error
	for _, p := range c.eps.order(false) {
		conn, err := c.dialEvents(ctx, p.ep, types)
		p.release()
		if err == nil {
			s := &EventStream{conn: conn, types: types, endpoint: p.ep.label, done: make(chan struct{}),
				ping: eventPing, silence: eventSilence}
			s.start()
			return s, nil
		}
		failures = append(failures, &endpointError{p.ep.label, err})
		if ctx.Err() != nil {
			break
		}
	}
	return nil, &Error{Op: "events", Err: contextual(ctx, joinAttempts(failures)), unreachable: true}
}

func (c *Client) dialEvents(ctx context.Context, ep *endpoint, types []string) (*websocket.Conn, error) {
	u := *ep.base
	u.Scheme = map[string]string{"https": "wss", "http": "ws"}[u.Scheme]
	u.Path = "/1.0/events"
	u.RawQuery = url.Values{"project": {c.project}, "type": {strings.Join(types, ",")}}.Encode()
	by, _ := ctx.Deadline()
	dial := func(ctx context.Context, _, _ string) (net.Conn, error) { return ep.dial(withConnectBy(ctx, by)) }
	d := websocket.Dialer{NetDialContext: dial, NetDialTLSContext: dial, HandshakeTimeout: time.Until(by)}
	conn, resp, err := d.DialContext(ctx, u.String(), http.Header{"User-Agent": {"incus-provider"}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		if resp != nil {
			return nil, fmt.Errorf("events handshake answered %s: %w", resp.Status, err)
		}
		return nil, err
	}
	return conn, nil
}

// start arms the keep-alive: every pong and frame pushes the read
// deadline on, and a goroutine owned by the stream pings until Close.
func (s *EventStream) start() {
	_ = s.conn.SetReadDeadline(time.Now().Add(s.silence))
	s.conn.SetPongHandler(func(string) error {
		return s.conn.SetReadDeadline(time.Now().Add(s.silence))
	})
	s.pinger.Add(1)
	go func() {
		defer s.pinger.Done()
		t := time.NewTicker(s.ping)
		defer t.Stop()
		for {
			select {
			case <-s.done:
				return
			case <-t.C:
				// WriteControl may be called concurrently with the reader.
				if err := s.conn.WriteControl(websocket.PingMessage, nil, time.Now().Add(s.ping)); err != nil {
					_ = s.conn.Close() // Next sees it and reports the stream dead
					return
				}
			}
		}
	}()
}

// Endpoint is the label of the endpoint the stream is connected to.
func (s *EventStream) Endpoint() string { return s.endpoint }

// Next waits for the next event. An error matching ErrMalformedEvent is
// one bad frame, and the stream goes on; any other error means the stream
// is over (cut, silent for too long, or closed) and Close is all that is
// left to call.
func (s *EventStream) Next() (Event, error) {
	for {
		kind, raw, err := s.conn.ReadMessage()
		if err != nil {
			select {
			case <-s.done:
				return Event{}, fmt.Errorf("incus: events: %w", net.ErrClosed)
			default:
			}
			return Event{}, fmt.Errorf("incus: events from %s: %w", s.endpoint, err)
		}
		_ = s.conn.SetReadDeadline(time.Now().Add(s.silence))
		if kind != websocket.TextMessage && kind != websocket.BinaryMessage {
			continue
		}
		return decodeEvent(raw, s.types)
	}
}

// Close ends the stream and its keep-alive, and waits for the latter.
func (s *EventStream) Close() error {
	var err error
	s.closeOnce.Do(func() {
		close(s.done)
		err = s.conn.Close()
		s.pinger.Wait()
	})
	return err
}
