// Package lazyconn provides a net.Conn that connects on its first write.
//
// Incus (and LXD) read the first bytes of every connection to their unix
// socket inside the accept loop, to tell STARTTLS from plain HTTP, with no
// deadline. One connection that is open and silent therefore keeps every
// later client of the socket from being served: other providers, the CLI,
// and the start and stop hooks of Incus's own containers, which time out
// after 30 s and fail the start. Go's http.Transport makes such connections
// as a matter of course: when a call that started a dial is served first by
// a connection another call freed, the finished dial is parked in the idle
// pool without a byte written, for as long as the pool keeps it. A Conn
// from this package is not connected until something is written to it, so
// a parked one holds nothing open.
package lazyconn

import (
	"net"
	"os"
	"sync"
	"time"
)

// Conn is a connection whose dial is made by its first Write. Reads wait
// for that dial (or for Close, or for the read deadline).
type Conn struct {
	dial   func() (net.Conn, error)
	remote net.Addr

	mu      sync.Mutex
	started bool          // a Write has begun the dial
	ready   chan struct{} // closed once conn or err is set
	conn    net.Conn
	err     error
	closed  bool
	readBy  time.Time
	writeBy time.Time
}

// New returns a Conn that calls dial on its first Write. remote is what
// RemoteAddr reports before then. dial must bound itself in time: nothing
// else does.
func New(remote net.Addr, dial func() (net.Conn, error)) *Conn {
	return &Conn{dial: dial, remote: remote, ready: make(chan struct{})}
}

// connect makes the dial once; later callers wait for its result.
func (c *Conn) connect() (net.Conn, error) {
	if conn, err, ok := c.made(); ok {
		return conn, err // every write after the first: no lock
	}
	c.mu.Lock()
	// Close before any write has set err already.
	if c.started || c.err != nil {
		c.mu.Unlock()
		<-c.ready
		return c.conn, c.err
	}
	c.started = true
	c.mu.Unlock()

	conn, err := c.dial()

	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case err != nil:
		c.err = err
	case c.closed:
		// Closed while dialling: the new connection is nobody's.
		_ = conn.Close()
		c.err = net.ErrClosed
	default:
		c.conn = conn
		if !c.readBy.IsZero() {
			_ = conn.SetReadDeadline(c.readBy)
		}
		if !c.writeBy.IsZero() {
			_ = conn.SetWriteDeadline(c.writeBy)
		}
	}
	close(c.ready)
	return c.conn, c.err
}

// made is the dial's result once there is one. conn and err are written
// before ready is closed and never after, so they are read without the
// lock once it is.
func (c *Conn) made() (net.Conn, error, bool) {
	select {
	case <-c.ready:
		return c.conn, c.err, true
	default:
		return nil, nil, false
	}
}

// Connect makes the dial now if no write has; it returns the dial's
// result, which every later call sees.
func (c *Conn) Connect() error {
	_, err := c.connect()
	return err
}

// Write dials if this is the first write, then writes. A failed dial is
// returned as it is, and nothing was sent.
func (c *Conn) Write(b []byte) (int, error) {
	conn, err := c.connect()
	if err != nil {
		return 0, err
	}
	return conn.Write(b)
}

// Read waits for the first write's dial, then reads.
func (c *Conn) Read(b []byte) (int, error) {
	if conn, err, ok := c.made(); ok {
		// Made: no lock, no timer; the connection's own deadline applies.
		if err != nil {
			return 0, err
		}
		return conn.Read(b)
	}
	c.mu.Lock()
	by := c.readBy
	c.mu.Unlock()
	var expired <-chan time.Time
	if !by.IsZero() {
		t := time.NewTimer(time.Until(by))
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-c.ready:
	case <-expired:
		return 0, os.ErrDeadlineExceeded
	}
	if c.err != nil {
		return 0, c.err
	}
	return c.conn.Read(b)
}

// Close closes the connection if it was made; one not yet made never is.
func (c *Conn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if c.conn != nil {
		return c.conn.Close()
	}
	if !c.started && c.err == nil {
		c.err = net.ErrClosed
		close(c.ready)
	}
	return nil
}

// LocalAddr is the connection's once made, else an unnamed address of the
// remote's network.
func (c *Conn) LocalAddr() net.Addr {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil {
		return c.conn.LocalAddr()
	}
	return &net.UnixAddr{Net: c.remote.Network()}
}

// RemoteAddr is the connection's once made, else the address given to New.
func (c *Conn) RemoteAddr() net.Addr {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil {
		return c.conn.RemoteAddr()
	}
	return c.remote
}

// SetDeadline sets both deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

// SetReadDeadline applies to the connection once made; a Read waiting for
// the dial honours the deadline set when it began.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readBy = t
	if c.conn != nil {
		return c.conn.SetReadDeadline(t)
	}
	return nil
}

// SetWriteDeadline applies to the connection once made. The dial itself is
// bounded by the dial function, not by this deadline.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.writeBy = t
	if c.conn != nil {
		return c.conn.SetWriteDeadline(t)
	}
	return nil
}
