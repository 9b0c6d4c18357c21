// Package idletest stands up in-process fake guest daemons for the idle
// loop's tests and its benchmark: as many as wanted, each with its own idle
// clock and daemonInstanceId, reached through a guest.Dialer, so that the
// loop runs its own code path unchanged with only the dialer pointed here.
//
// A fake daemon serves the data plane's initialize and env/getIdle over
// WebSocket JSON-RPC (the project's shared server), and can be told to
// misbehave in the ways the real daemon cannot be made to on demand: never
// answer (a hung or frozen guest), answer a getIdle that does not decode,
// or refuse the dial.
package idletest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// Mode is how a fake daemon behaves.
type Mode int32

// The modes.
const (
	// Normal answers initialize and env/getIdle from its idle clock.
	Normal Mode = iota
	// Silent accepts the connection and never answers anything.
	Silent
	// Malformed answers env/getIdle with a result that does not decode.
	Malformed
	// Refusing refuses the dial, as a stopped guest does.
	Refusing
	// OtherVersion is a daemon of data-plane version 6: it answers
	// initialize with versionMismatch.
	OtherVersion
)

// Daemon is one fake guest daemon.
type Daemon struct {
	Name string

	mode       atomic.Int32
	mu         sync.Mutex
	lastUse    time.Time
	busy       bool
	extra      map[string]uint64
	instanceID string

	// Handshakes counts the initialize requests it answered; GetIdles its
	// env/getIdle answers.
	Handshakes atomic.Int64
	GetIdles   atomic.Int64
}

// SetMode changes how the daemon behaves from the next request on.
func (d *Daemon) SetMode(m Mode) { d.mode.Store(int32(m)) }

// Touch records a use: the idle clock restarts.
func (d *Daemon) Touch() {
	d.mu.Lock()
	d.lastUse = time.Now()
	d.mu.Unlock()
}

// SetIdleSince sets the instant the daemon's idleness began.
func (d *Daemon) SetIdleSince(t time.Time) {
	d.mu.Lock()
	d.lastUse = t
	d.mu.Unlock()
}

// SetBusy holds the idle clock at zero (running work) or lets it run again
// from now.
func (d *Daemon) SetBusy(busy bool) {
	d.mu.Lock()
	if d.busy && !busy {
		d.lastUse = time.Now()
	}
	d.busy = busy
	d.mu.Unlock()
}

// SetExtra adds diagnostic members to every env/getIdle answer, such as
// {"runningProcessCount": 0}.
func (d *Daemon) SetExtra(members map[string]uint64) {
	d.mu.Lock()
	d.extra = members
	d.mu.Unlock()
}

// Restart gives the daemon a new instance id and a fresh idle clock, as a
// guest that was stopped and started again has.
func (d *Daemon) Restart() {
	d.mu.Lock()
	d.instanceID = newID()
	d.lastUse = time.Now()
	d.mu.Unlock()
}

func (d *Daemon) idle() map[string]any {
	d.mu.Lock()
	defer d.mu.Unlock()
	ms := uint64(0)
	if !d.busy {
		ms = uint64(max(time.Since(d.lastUse), 0) / time.Millisecond)
	}
	out := map[string]any{"idleForMs": ms}
	for k, v := range d.extra {
		out[k] = v
	}
	return out
}

// Fleet is a set of fake daemons behind one guest.Dialer.
type Fleet struct {
	pipes bool

	mu      sync.Mutex
	daemons map[string]*Daemon
	conns   map[net.Conn]struct{}

	ln       *chanListener
	srv      *http.Server
	upgrader websocket.Upgrader
	served   chan struct{}

	// Dials counts successful dials.
	Dials atomic.Int64
}

// Options configure a Fleet.
type Options struct {
	// Pipes connects with in-memory net.Pipe pairs instead of unix
	// socketpairs (which cost two file descriptors per open connection).
	Pipes bool
}

var _ guest.Dialer = (*Fleet)(nil)

// NewFleet starts a fleet with no daemons; Close stops it.
func NewFleet(opts Options) *Fleet {
	f := &Fleet{
		pipes:   opts.Pipes,
		daemons: map[string]*Daemon{},
		conns:   map[net.Conn]struct{}{},
		ln:      newChanListener(),
		served:  make(chan struct{}),
		// Buffer sizes 0 reuse the HTTP server's 4 KiB buffers; writes
		// borrow a pooled buffer, so an idle connection holds little.
		upgrader: websocket.Upgrader{WriteBufferPool: &sync.Pool{}, CheckOrigin: func(*http.Request) bool { return true }},
	}
	f.srv = &http.Server{
		Handler:           http.HandlerFunc(f.serve),
		ReadHeaderTimeout: 10 * time.Second,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if nc, ok := c.(*namedConn); ok {
				return context.WithValue(ctx, nameKey{}, nc.name)
			}
			return ctx
		},
	}
	go func() {
		defer close(f.served)
		_ = f.srv.Serve(f.ln)
	}()
	return f
}

// Add stands up a daemon for the named instance (idle since now).
func (f *Fleet) Add(name string) *Daemon {
	d := &Daemon{Name: name, lastUse: time.Now(), instanceID: newID()}
	f.mu.Lock()
	f.daemons[name] = d
	f.mu.Unlock()
	return d
}

// Get returns the named daemon.
func (f *Fleet) Get(name string) *Daemon {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.daemons[name]
}

// OpenConns counts the connections the fleet's daemons hold open.
func (f *Fleet) OpenConns() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.conns)
}

// DropConns ends every open daemon connection, as a guest restart does.
func (f *Fleet) DropConns() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.conns {
		_ = c.Close()
	}
}

// Close stops serving and ends every connection.
func (f *Fleet) Close() {
	_ = f.ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = f.srv.Shutdown(ctx)
	f.mu.Lock()
	for c := range f.conns {
		_ = c.Close()
	}
	f.mu.Unlock()
	<-f.served
}

// Name is the dialer kind.
func (f *Fleet) Name() string { return "fake" }

// Devices is nil: nothing is needed on an instance.
func (f *Fleet) Devices(guest.Target) map[string]map[string]string { return nil }

// Forget keeps nothing per instance.
func (f *Fleet) Forget(string) {}

// DialContext connects to the named daemon.
func (f *Fleet) DialContext(ctx context.Context, t guest.Target) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	d := f.Get(t.Instance)
	if d == nil || Mode(d.mode.Load()) == Refusing {
		return nil, fmt.Errorf("idletest: dial %s: %w", t, syscall.ECONNREFUSED)
	}
	client, server, err := f.pair()
	if err != nil {
		return nil, fmt.Errorf("idletest: dial %s: %w", t, err)
	}
	nc := &namedConn{Conn: server, name: t.Instance}
	if err := f.ln.push(ctx, nc); err != nil {
		_ = client.Close()
		_ = server.Close()
		return nil, err
	}
	f.Dials.Add(1)
	return client, nil
}

// ServeConn serves the named daemon on conn, a connection accepted
// elsewhere (the benchmark's fleet in a process of its own): conn is the
// daemon's side of a dial of that instance. The fleet owns conn from here.
func (f *Fleet) ServeConn(ctx context.Context, name string, conn net.Conn) error {
	if f.Get(name) == nil {
		_ = conn.Close()
		return fmt.Errorf("idletest: no daemon %q", name)
	}
	if err := f.ln.push(ctx, &namedConn{Conn: conn, name: name}); err != nil {
		_ = conn.Close()
		return err
	}
	f.Dials.Add(1)
	return nil
}

func (f *Fleet) pair() (net.Conn, net.Conn, error) {
	if f.pipes {
		a, b := net.Pipe()
		return a, b, nil
	}
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		file := os.NewFile(uintptr(fd), "idletest")
		c, err := net.FileConn(file)
		_ = file.Close()
		if err != nil {
			for _, prev := range conns[:i] {
				_ = prev.Close()
			}
			if i == 0 {
				_ = syscall.Close(fds[1])
			}
			return nil, nil, err
		}
		conns[i] = c
	}
	return conns[0], conns[1], nil
}

type nameKey struct{}

type namedConn struct {
	net.Conn
	name string
}

func (f *Fleet) serve(w http.ResponseWriter, r *http.Request) {
	name, _ := r.Context().Value(nameKey{}).(string)
	d := f.Get(name)
	if d == nil {
		http.Error(w, "no such daemon", http.StatusNotFound)
		return
	}
	if Mode(d.mode.Load()) == Silent {
		<-r.Context().Done() // a hung guest: the upgrade never comes
		return
	}
	ws, err := f.upgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	raw := ws.UnderlyingConn()
	f.mu.Lock()
	f.conns[raw] = struct{}{}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.conns, raw)
		f.mu.Unlock()
		_ = ws.Close()
	}()
	version := uint64(5)
	if Mode(d.mode.Load()) == OtherVersion {
		version = 6
	}
	srv := &jsonrpc.Server{
		Plane:           "data",
		ProtocolVersion: version,
		Initialize: func(context.Context, json.RawMessage) (any, error) {
			d.Handshakes.Add(1)
			d.mu.Lock()
			id := d.instanceID
			d.mu.Unlock()
			return map[string]any{
				"protocolVersion":  5,
				"plane":            "data",
				"serverInfo":       map[string]string{"name": "idletest-daemon", "version": "0"},
				"daemonInstanceId": id,
				"capabilities":     map[string]any{},
				"limits":           map[string]any{"maxConcurrentRequests": 16, "maxWaitMs": 60000},
				"defaultCwd":       "/",
			}, nil
		},
		Methods: map[string]jsonrpc.Method{
			"env/getIdle": func(ctx context.Context, _ json.RawMessage) (any, error) {
				switch Mode(d.mode.Load()) {
				case Silent:
					<-ctx.Done()
					return nil, ctx.Err()
				case Malformed:
					return json.RawMessage(`{"idleForMs":"a while"}`), nil
				}
				d.GetIdles.Add(1)
				return d.idle(), nil
			},
		},
	}
	_ = srv.ServeConn(r.Context(), ws)
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// chanListener hands the server the far ends of dialled pairs.
type chanListener struct {
	ch     chan net.Conn
	done   chan struct{}
	closed sync.Once
}

func newChanListener() *chanListener {
	return &chanListener{ch: make(chan net.Conn), done: make(chan struct{})}
}

func (l *chanListener) push(ctx context.Context, c net.Conn) error {
	select {
	case l.ch <- c:
		return nil
	case <-l.done:
		return errors.New("idletest: the fleet is closed")
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.closed.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return fakeAddr{} }

type fakeAddr struct{}

func (fakeAddr) Network() string { return "idletest" }
func (fakeAddr) String() string  { return "idletest" }
