package ingress

import (
	"io"
	"net"
	"sync"

	"github.com/lightspeed-dev/incus-provider/relays"
)

// upstream is one connection from the edge to a guest's ingress port,
// entered in the relay registry as a relay: while it is open the target is
// in use, and a power-down that must close it simply closes it (an HTTP
// connection has no going-away frame; the client sees its response end, or
// its next request wake the target again).
type upstream struct {
	net.Conn
	instance string
	reg      *relays.Registry
	metrics  *Metrics
	once     sync.Once
	done     chan struct{}
}

var _ relays.Conn = (*upstream)(nil)

func (u *upstream) Read(p []byte) (int, error) {
	n, err := u.Conn.Read(p)
	u.metrics.carried(false, n)
	return n, err
}

func (u *upstream) Write(p []byte) (int, error) {
	n, err := u.Conn.Write(p)
	u.metrics.carried(true, n)
	return n, err
}

// ReadFrom sends a request body to the guest in 256 KiB writes: the
// transport hands the body to the connection this way, and io.Copy's own
// 32 KiB would make a 1 MiB upload 32 write calls.
func (u *upstream) ReadFrom(r io.Reader) (int64, error) {
	bp := largeCopyPool.Get().(*[]byte)
	defer largeCopyPool.Put(bp)
	// The wrappers hide ReadFrom and WriteTo, so the copy is this loop.
	return io.CopyBuffer(struct{ io.Writer }{u}, struct{ io.Reader }{r}, *bp)
}

// Close ends the connection and takes it out of the registry, once.
func (u *upstream) Close() error {
	err := u.Conn.Close()
	u.once.Do(func() {
		close(u.done)
		if u.reg.Remove(u.instance, u) {
			u.metrics.opened(-1)
		}
	})
	return err
}

// GoAway closes the connection: see the type's comment.
func (u *upstream) GoAway(_ int, _, _ string) { _ = u.Close() }

// Kill closes the connection.
func (u *upstream) Kill(_ string) { _ = u.Close() }

// Done is closed once the connection is closed.
func (u *upstream) Done() <-chan struct{} { return u.done }
