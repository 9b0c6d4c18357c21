package incus

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/lazyconn"
)

// Defaults for the failover bounds (see Config).
const (
	// DefaultConnectTimeout bounds connecting to one endpoint (TCP and TLS
	// handshake) while another endpoint remains to be tried. A member on
	// loopback or a LAN connects in well under 10 ms; a second is many
	// times that on a busy host, and short enough that a dead member costs
	// a call little.
	DefaultConnectTimeout = time.Second

	// DefaultAttemptTimeout bounds one read (a GET) on one endpoint while
	// another endpoint remains to be tried. Incus answers the reads this
	// client makes in milliseconds; two seconds means the member is stuck,
	// not slow.
	DefaultAttemptTimeout = 2 * time.Second
)

// An endpoint that failed is set aside for a cool-down that doubles with
// each failure in a row, from coolMin to coolMax.
const (
	defaultCoolMin = time.Second
	defaultCoolMax = 30 * time.Second
)

// EndpointState is what the client knows of one configured endpoint, for
// readiness reports and logs.
type EndpointState struct {
	// URL is the endpoint as configured ("unix:" and the path for the socket).
	URL string
	// Label is its bounded name for metrics: host:port, or "unix".
	Label string
	// Healthy is false from a failure until a call through it succeeds.
	Healthy bool
	// DownSince is when the current run of failures began (zero if healthy).
	DownSince time.Time
	// RetryAt is when the cool-down ends: until then calls try the
	// endpoint only after every healthy one (zero if healthy).
	RetryAt time.Time
	// Failures counts failures in a row.
	Failures int
	// LastError is the text of the last failure (kept after recovery).
	LastError string
	// LastOK is when a call through it last succeeded.
	LastOK time.Time
}

// endpoint is one way to reach Incus: its own connection pool, and what
// recent calls learned of it.
type endpoint struct {
	index int      // position in the configured order
	url   string   // as configured, for EndpointState
	label string   // host:port or "unix"
	base  *url.URL // scheme and host requests are built on
	http  *http.Client
	tr    *http.Transport
	dial  func(ctx context.Context) (net.Conn, error) // a raw connection, for websockets

	mu        sync.Mutex
	gen       uint64 // bumped on every change of health, so stale failures do not escalate
	failures  int
	downSince time.Time
	retryAt   time.Time
	probing   bool // a read is trying it now, after its cool-down ended
	lastErr   string
	lastOK    time.Time
}

// endpointSet is every configured endpoint and the cool-down rules; shared
// by a client and its WithProject copies.
type endpointSet struct {
	list    []*endpoint
	aff     affinity
	coolMin time.Duration
	coolMax time.Duration
	now     func() time.Time
}

// pick is one endpoint in a call's order, and whether this call holds its probe.
type pick struct {
	ep      *endpoint
	gen     uint64
	retryAt time.Time
	probe   bool
}

// order is the sequence a call tries endpoints in.
//
// Healthy endpoints come in the configured order, so the first configured
// one that works takes the calls. A call that may probe (a short read)
// also takes, first of all, an endpoint whose cool-down has ended and that
// no other call is trying: that is how a member that is back is noticed,
// at the cost of one read. Writes never probe, because a write to a
// member that accepts and then hangs has an unknown outcome; nor do long
// reads, which nothing cuts short. They go to endpoints known to work
// first. Endpoints still cooling down come last, soonest-to-retry first,
// so that a call tries every endpoint before it gives up.
func (s *endpointSet) order(probe bool) []pick {
	if len(s.list) == 1 {
		ep := s.list[0]
		ep.mu.Lock()
		defer ep.mu.Unlock()
		return []pick{{ep: ep, gen: ep.gen}}
	}
	now := s.now()
	var probes, healthy, cooling []pick
	for _, ep := range s.list {
		ep.mu.Lock()
		p := pick{ep: ep, gen: ep.gen, retryAt: ep.retryAt}
		switch {
		case ep.failures == 0:
			healthy = append(healthy, p)
		case probe && !ep.probing && !now.Before(ep.retryAt):
			ep.probing = true
			p.probe = true
			probes = append(probes, p)
		default:
			cooling = append(cooling, p)
		}
		ep.mu.Unlock()
	}
	// Insertion sort: a handful of endpoints, and stable for equal times.
	for i := 1; i < len(cooling); i++ {
		for j := i; j > 0 && cooling[j].retryAt.Before(cooling[j-1].retryAt); j-- {
			cooling[j], cooling[j-1] = cooling[j-1], cooling[j]
		}
	}
	out := make([]pick, 0, len(s.list))
	out = append(out, probes...)
	out = append(out, healthy...)
	return append(out, cooling...)
}

// preferred is the first healthy endpoint in the configured order, or the
// first configured when none is healthy.
func (s *endpointSet) preferred() *endpoint {
	for _, ep := range s.list {
		ep.mu.Lock()
		ok := ep.failures == 0
		ep.mu.Unlock()
		if ok {
			return ep
		}
	}
	return s.list[0]
}

// pinned is the one-endpoint order for a call that must go to ep.
func pinned(ep *endpoint) []pick {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return []pick{{ep: ep, gen: ep.gen}}
}

// release gives back a probe the call did not use.
func (p pick) release() {
	if !p.probe {
		return
	}
	p.ep.mu.Lock()
	p.ep.probing = false
	p.ep.mu.Unlock()
}

// succeeded records an answer through the endpoint.
func (s *endpointSet) succeeded(p pick) {
	e := p.ep
	e.mu.Lock()
	defer e.mu.Unlock()
	if p.probe {
		e.probing = false
	}
	if e.failures != 0 {
		e.gen++
	}
	e.failures = 0
	e.downSince = time.Time{}
	e.retryAt = time.Time{}
	e.lastOK = s.now()
}

// failed records a failure of the endpoint. Only a failure of an attempt
// that began after the endpoint's last change lengthens the cool-down:
// twenty calls in flight when a member dies are one failure, not twenty.
func (s *endpointSet) failed(p pick, err error) {
	e := p.ep
	now := s.now()
	e.mu.Lock()
	defer e.mu.Unlock()
	if p.probe {
		e.probing = false
	}
	e.lastErr = err.Error()
	if p.gen != e.gen {
		return
	}
	e.gen++
	if e.failures == 0 {
		e.downSince = now
	}
	e.failures++
	cool := s.coolMin
	for i := 1; i < e.failures && cool < s.coolMax; i++ {
		cool *= 2
	}
	e.retryAt = now.Add(min(cool, s.coolMax))
}

// states is EndpointState for every endpoint, in the configured order.
func (s *endpointSet) states() []EndpointState {
	out := make([]EndpointState, 0, len(s.list))
	for _, e := range s.list {
		e.mu.Lock()
		out = append(out, EndpointState{
			URL: e.url, Label: e.label, Healthy: e.failures == 0,
			DownSince: e.downSince, RetryAt: e.retryAt, Failures: e.failures,
			LastError: e.lastErr, LastOK: e.lastOK,
		})
		e.mu.Unlock()
	}
	return out
}

// connectBy carries, in a request's context, the time by which its
// connection must be up; the endpoint's dialer reads it. (The transport
// dials under a context detached from the request's cancellation that
// keeps its values.)
type connectByKey struct{}

func withConnectBy(ctx context.Context, t time.Time) context.Context {
	return context.WithValue(ctx, connectByKey{}, t)
}

func connectDeadline(ctx context.Context) (context.Context, context.CancelFunc) {
	if t, ok := ctx.Value(connectByKey{}).(time.Time); ok {
		return context.WithDeadline(ctx, t)
	}
	return context.WithCancel(ctx)
}

// countingConn counts the writes begun on a connection, so that a failed
// call can tell whether any byte of its request may have left. The count
// goes up before the write, so a write in progress counts as sent.
// A connection still to be made (lazyconn) is made before the count goes
// up, so a failed connect counts as nothing sent.
type countingConn struct {
	net.Conn
	writes atomic.Int64
}

func (c *countingConn) Write(b []byte) (int, error) {
	if lc, ok := c.Conn.(*lazyconn.Conn); ok {
		if err := lc.Connect(); err != nil {
			return 0, err
		}
	}
	c.writes.Add(1)
	return c.Conn.Write(b)
}

// tcpDialer connects to host:port with TLS under the connect deadline.
func tcpDialer(tlsCfg *tls.Config, hostport string) func(ctx context.Context) (net.Conn, error) {
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	return func(ctx context.Context) (net.Conn, error) {
		ctx, cancel := connectDeadline(ctx)
		defer cancel()
		raw, err := d.DialContext(ctx, "tcp", hostport)
		if err != nil {
			return nil, err
		}
		tc := tls.Client(raw, tlsCfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = raw.Close()
			return nil, fmt.Errorf("tls handshake: %w", err)
		}
		return tc, nil
	}
}

// unixDialer connects to the socket under the connect deadline.
func unixDialer(socket string) func(ctx context.Context) (net.Conn, error) {
	d := &net.Dialer{Timeout: 5 * time.Second}
	return func(ctx context.Context) (net.Conn, error) {
		ctx, cancel := connectDeadline(ctx)
		defer cancel()
		return d.DialContext(ctx, "unix", socket)
	}
}

// newEndpoint builds an endpoint with its own transport around dial.
func newEndpoint(index int, rawURL, label string, base *url.URL, tlsDial bool, dial func(ctx context.Context) (net.Conn, error)) *endpoint {
	counted := func(ctx context.Context, _, _ string) (net.Conn, error) {
		if !tlsDial {
			// See internal/lazyconn: a unix connection the transport parks
			// unused must not be open, or Incus serves nobody else on the
			// socket until it is closed. The dial is bounded by the
			// socket dialer's own timeout, since by the time of the first
			// write ctx may belong to a call that went elsewhere.
			return &countingConn{Conn: lazyconn.New(&net.UnixAddr{Name: strings.TrimPrefix(rawURL, "unix:"), Net: "unix"}, func() (net.Conn, error) {
				return dial(context.Background())
			})}, nil
		}
		conn, err := dial(ctx)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: conn}, nil
	}
	tr := &http.Transport{
		MaxIdleConns:          32,
		MaxIdleConnsPerHost:   32,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
		ForceAttemptHTTP2:     false,
	}
	if tlsDial {
		// The handshake is done by dial, so that it falls under the
		// connect deadline and the connection handed to the transport
		// can count the request's bytes.
		tr.DialTLSContext = counted
	} else {
		tr.DialContext = counted
	}
	return &endpoint{
		index: index, url: rawURL, label: label, base: base, tr: tr, dial: dial,
		// No client-wide Timeout: each call carries its own context
		// deadline, and operation waits legitimately run longer than
		// CallTimeout.
		http: &http.Client{
			Transport: tr,
			// Incus does not redirect API calls; never follow one elsewhere.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
	}
}
