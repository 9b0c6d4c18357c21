package incus

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

// DefaultProject is the project used when Config.Project is empty.
const DefaultProject = "default"

// DefaultCallTimeout bounds one HTTP call when Config.CallTimeout is zero.
const DefaultCallTimeout = 10 * time.Second

// Config says how to reach Incus: through the unix Socket, or over HTTPS
// through one URL or several URLs (the members of one cluster). The HTTPS
// endpoints are used when set, otherwise Socket.
type Config struct {
	// Socket is the path of the Incus unix socket, e.g.
	// /var/lib/incus/unix.socket. Used when URL and URLs are empty.
	Socket string

	// URL is one HTTPS endpoint, e.g. https://10.0.0.1:8443; URLs is
	// several, the members of one Incus cluster, in the order they are
	// preferred (set one or the other). Each is https://host:port and
	// nothing more (CheckURL). They need ClientCert and ClientKey (PEM
	// files: the identity Incus trusts) and ServerCert (PEM file: the
	// server's own certificate, which is pinned: it is the only
	// certificate trusted, no system roots). Every member of a cluster
	// presents the same cluster certificate, so one pinned certificate
	// pins them all; an endpoint presenting another is refused.
	URL        string
	URLs       []string
	ClientCert string
	ClientKey  string
	ServerCert string

	// Project is sent as ?project= on project-scoped calls; default "default".
	Project string

	// CallTimeout bounds one call, every endpoint it tries included, when
	// the context has no earlier deadline; default DefaultCallTimeout.
	CallTimeout time.Duration

	// ConnectTimeout bounds connecting (TCP and TLS handshake) to one
	// endpoint while another remains to be tried; default
	// DefaultConnectTimeout. The last endpoint a call tries has what is
	// left of the call.
	ConnectTimeout time.Duration

	// AttemptTimeout bounds a read (GET) on one endpoint while another
	// remains to be tried; default DefaultAttemptTimeout. Writes and
	// operation waits are not cut short: see Client.
	AttemptTimeout time.Duration

	// Observe, when set, is called once per call with a fixed,
	// low-cardinality call name (e.g. "instance.get"), an outcome ("ok",
	// "not_found", "conflict", "error", "transport") and the call's
	// duration. It must be cheap and safe for concurrent use.
	Observe func(op string, status string, d time.Duration)

	// ObserveEndpoint, when set, is called once per endpoint a call tries,
	// with the endpoint's label (EndpointState.Label: one per configured
	// endpoint), the call name, the attempt's outcome (Observe's, or
	// "timeout", "not_ready", "canceled") and its duration. Same rules as
	// Observe.
	ObserveEndpoint func(endpoint, op, status string, d time.Duration)
}

// Client talks to Incus in one project. It is safe for concurrent use;
// WithProject gives a copy for another project sharing the connections.
//
// With several endpoints, each has its own connections, and a call goes to
// the one preferred at the time: the first in the configured order that
// has not failed lately. A call moves on to the next endpoint when:
//
//   - it could not connect (refused, timed out after ConnectTimeout, TLS
//     handshake failed), or the connection broke before any byte of the
//     request was written: any method, since nothing was sent;
//   - the member answered that it is starting up or shutting down (503),
//     or that it cannot reach the member the call needs (500 "Server isn't
//     ready yet", "Missing event connection with target cluster member"):
//     any method, since Incus says so before it acts;
//   - a read got no answer within AttemptTimeout, or lost its connection,
//     or got a 503. A recursive list (ListInstances, ListOperations) may
//     rightly take seconds on a large project and is not cut short.
//
// A write (POST, PUT, PATCH, DELETE) that was sent and got no answer is
// never sent elsewhere, because it may have been carried out: its error
// matches ErrOutcomeUnknown. When no endpoint answers, the error matches
// ErrUnreachable (and a write was then sent to none). An endpoint that
// failed is set aside for a cool-down that doubles from 1 s to 30 s;
// calls try it after the others, and the first short read after the
// cool-down tries it first (writes and lists never probe). A read that
// timed out, or a member that could not reach the member the call needs,
// counts against its endpoint only once another endpoint has answered the
// same call within AttemptTimeout, since a call can be slow or refused
// everywhere for a reason that is not the member's (one that must be
// forwarded to a dead member is). Endpoints reports what is known of each.
//
// An operation is followed (Wait, RefreshOperation, its websockets)
// through the endpoint that started it, which is the member that runs it
// or forwards to it; there the wait's own pacing applies, not failover.
type Client struct {
	eps         *endpointSet
	project     string
	callTimeout time.Duration
	connectTO   time.Duration
	attemptTO   time.Duration
	observe     func(op, status string, d time.Duration)
	observeEP   func(endpoint, op, status string, d time.Duration)
	writes      *writeWatchers

	// Wait pacing; fields so that unit tests can shrink them.
	waitSlice   time.Duration // server-side wait per round (timeout=N)
	waitGrace   time.Duration // extra time the HTTP call gets beyond N
	waitBackoff time.Duration // first pause after a round that returned early
}

// New checks the configuration and builds a client. It does not contact the
// server; use GetServer for that.
func New(cfg Config) (*Client, error) {
	c := &Client{
		project:     cfg.Project,
		callTimeout: cfg.CallTimeout,
		connectTO:   cfg.ConnectTimeout,
		attemptTO:   cfg.AttemptTimeout,
		observe:     cfg.Observe,
		observeEP:   cfg.ObserveEndpoint,
		writes:      &writeWatchers{},
		waitSlice:   5 * time.Second,
		waitGrace:   5 * time.Second,
		waitBackoff: 50 * time.Millisecond,
	}
	if c.project == "" {
		c.project = DefaultProject
	}
	if c.callTimeout <= 0 {
		c.callTimeout = DefaultCallTimeout
	}
	if c.connectTO <= 0 {
		c.connectTO = DefaultConnectTimeout
	}
	if c.attemptTO <= 0 {
		c.attemptTO = DefaultAttemptTimeout
	}
	c.eps = &endpointSet{coolMin: defaultCoolMin, coolMax: defaultCoolMax, now: time.Now}

	urls := cfg.URLs
	if cfg.URL != "" {
		if len(cfg.URLs) > 0 {
			return nil, errors.New("incus: config: set URL or URLs, not both")
		}
		urls = []string{cfg.URL}
	}
	switch {
	case len(urls) > 0:
		seen := map[string]bool{}
		var hosts []string
		for _, raw := range urls {
			if err := CheckURL(raw); err != nil {
				return nil, fmt.Errorf("incus: config: URL %q %w", raw, err)
			}
			u, _ := url.Parse(raw)
			host := strings.ToLower(u.Host)
			if seen[host] {
				return nil, fmt.Errorf("incus: config: URL %q is given twice", raw)
			}
			seen[host] = true
			hosts = append(hosts, host)
		}
		tlsCfg, server, err := pinnedTLS(cfg)
		if err != nil {
			return nil, err
		}
		for i, host := range hosts {
			h, _, _ := net.SplitHostPort(host)
			t := tlsCfg.Clone()
			t.ServerName = h
			// Incus server certificates often do not name the address
			// they are reached at. The pool holds only the pinned
			// certificate, so verifying against one of its own names
			// still accepts that certificate alone.
			if server.VerifyHostname(h) != nil && len(server.DNSNames) > 0 {
				t.ServerName = server.DNSNames[0]
			}
			c.eps.list = append(c.eps.list, newEndpoint(i, urls[i], host,
				&url.URL{Scheme: "https", Host: host}, true, tcpDialer(t, host)))
		}
	case cfg.Socket != "":
		// The host name is never resolved: every connection goes to the socket.
		c.eps.list = []*endpoint{newEndpoint(0, "unix:"+cfg.Socket, "unix",
			&url.URL{Scheme: "http", Host: "unix.socket"}, false, unixDialer(cfg.Socket))}
	default:
		return nil, errors.New("incus: config: need Socket, URL or URLs")
	}
	return c, nil
}

// CheckURL says whether raw is usable as an HTTPS endpoint: https, a host
// and a port, and nothing else (no user, path, query or fragment), so that
// no two spellings name one member. Its error is a predicate that reads
// after the URL: `"http://x:1" must start with https://`.
func CheckURL(raw string) error {
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return fmt.Errorf("is not an https://host:port URL (%w)", errors.Unwrap(err))
	case u.Scheme != "https":
		return errors.New("must start with https://")
	case u.User != nil:
		return errors.New("must not carry a user or password (the client certificate is the identity)")
	case u.Host == "":
		return errors.New("must name a host, as https://10.0.0.1:8443")
	case u.Port() == "":
		return errors.New("must give a port, as https://10.0.0.1:8443")
	case u.Hostname() == "":
		return errors.New("must name a host, as https://10.0.0.1:8443")
	case u.Path != "" && u.Path != "/", u.RawQuery != "", u.Fragment != "", u.Opaque != "":
		return errors.New("must be https://host:port only, without a path, query or fragment")
	}
	if n, err := strconv.Atoi(u.Port()); err != nil || n < 1 || n > 65535 {
		return errors.New("must have a port from 1 to 65535")
	}
	return nil
}

// pinnedTLS builds a TLS config that presents the client certificate and
// trusts exactly the configured server certificate, which it returns too.
func pinnedTLS(cfg Config) (*tls.Config, *x509.Certificate, error) {
	if cfg.ClientCert == "" || cfg.ClientKey == "" || cfg.ServerCert == "" {
		return nil, nil, errors.New("incus: config: URL needs ClientCert, ClientKey and ServerCert")
	}
	pair, err := tls.LoadX509KeyPair(cfg.ClientCert, cfg.ClientKey)
	if err != nil {
		return nil, nil, fmt.Errorf("incus: config: client certificate: %w", err)
	}
	raw, err := os.ReadFile(cfg.ServerCert)
	if err != nil {
		return nil, nil, fmt.Errorf("incus: config: server certificate: %w", err)
	}
	block, _ := pem.Decode(raw)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, nil, fmt.Errorf("incus: config: server certificate %s: no PEM certificate", cfg.ServerCert)
	}
	server, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("incus: config: server certificate: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(server)

	return &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{pair},
		RootCAs:      pool,
	}, server, nil
}

// Project returns the project this client works in.
func (c *Client) Project() string { return c.project }

// WithProject returns a shallow copy of c working in project p (the default
// project when p is empty). The copy shares c's connections.
func (c *Client) WithProject(p string) *Client {
	if p == "" {
		p = DefaultProject
	}
	cp := *c
	cp.project = p
	return &cp
}

// Close releases idle connections. The client stays usable.
func (c *Client) Close() {
	for _, ep := range c.eps.list {
		ep.tr.CloseIdleConnections()
	}
}

// Endpoints reports the state of every configured endpoint, in the
// configured order (one entry for the socket).
func (c *Client) Endpoints() []EndpointState { return c.eps.states() }

// escape quotes one path segment (a name or an ID).
func escape(s string) string { return url.PathEscape(s) }
