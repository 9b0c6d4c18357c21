package incus

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"time"
)

// DefaultProject is the project used when Config.Project is empty.
const DefaultProject = "default"

// DefaultCallTimeout bounds one HTTP call when Config.CallTimeout is zero.
const DefaultCallTimeout = 10 * time.Second

// Config says how to reach Incus. Exactly one of Socket and URL is used:
// URL when set, otherwise Socket.
type Config struct {
	// Socket is the path of the Incus unix socket, e.g.
	// /var/lib/incus/unix.socket. Used when URL is empty.
	Socket string

	// URL is the HTTPS endpoint, e.g. https://10.0.0.1:8443. It needs
	// ClientCert and ClientKey (PEM files: the identity Incus trusts) and
	// ServerCert (PEM file: the server's own certificate, which is pinned:
	// it is the only certificate trusted, no system roots).
	URL        string
	ClientCert string
	ClientKey  string
	ServerCert string

	// Project is sent as ?project= on project-scoped calls; default "default".
	Project string

	// CallTimeout bounds one HTTP call when the context has no earlier
	// deadline; default DefaultCallTimeout.
	CallTimeout time.Duration

	// Observe, when set, is called once per HTTP call with a fixed,
	// low-cardinality call name (e.g. "instance.get"), an outcome ("ok",
	// "not_found", "conflict", "error", "transport") and the call's
	// duration. It must be cheap and safe for concurrent use.
	Observe func(op string, status string, d time.Duration)
}

// Client talks to one Incus server in one project. It is safe for concurrent
// use; WithProject gives a copy for another project sharing the connections.
type Client struct {
	http        *http.Client
	base        *url.URL
	project     string
	callTimeout time.Duration
	observe     func(op, status string, d time.Duration)

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
		observe:     cfg.Observe,
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

	tr := &http.Transport{
		MaxIdleConns:          32,
		MaxIdleConnsPerHost:   32,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		ForceAttemptHTTP2:     false,
	}

	switch {
	case cfg.URL != "":
		u, err := url.Parse(cfg.URL)
		if err != nil {
			return nil, fmt.Errorf("incus: config: bad URL: %w", err)
		}
		if u.Scheme != "https" || u.Host == "" {
			return nil, fmt.Errorf("incus: config: URL %q: want https://host:port", cfg.URL)
		}
		tlsCfg, err := pinnedTLS(cfg, u.Hostname())
		if err != nil {
			return nil, err
		}
		tr.TLSClientConfig = tlsCfg
		dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
		tr.DialContext = dialer.DialContext
		c.base = &url.URL{Scheme: "https", Host: u.Host}
	case cfg.Socket != "":
		socket := cfg.Socket
		dialer := &net.Dialer{Timeout: 5 * time.Second}
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, "unix", socket)
		}
		// The host name is never resolved: every connection goes to the socket.
		c.base = &url.URL{Scheme: "http", Host: "unix.socket"}
	default:
		return nil, errors.New("incus: config: need Socket or URL")
	}

	// No client-wide Timeout: each call carries its own context deadline,
	// and operation waits legitimately run longer than CallTimeout.
	c.http = &http.Client{
		Transport: tr,
		// Incus does not redirect API calls; never follow one elsewhere.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	return c, nil
}

// pinnedTLS builds a TLS config that presents the client certificate and
// trusts exactly the configured server certificate.
func pinnedTLS(cfg Config, host string) (*tls.Config, error) {
	if cfg.ClientCert == "" || cfg.ClientKey == "" || cfg.ServerCert == "" {
		return nil, errors.New("incus: config: URL needs ClientCert, ClientKey and ServerCert")
	}
	pair, err := tls.LoadX509KeyPair(cfg.ClientCert, cfg.ClientKey)
	if err != nil {
		return nil, fmt.Errorf("incus: config: client certificate: %w", err)
	}
	raw, err := os.ReadFile(cfg.ServerCert)
	if err != nil {
		return nil, fmt.Errorf("incus: config: server certificate: %w", err)
	}
	block, _ := pem.Decode(raw)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("incus: config: server certificate %s: no PEM certificate", cfg.ServerCert)
	}
	server, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("incus: config: server certificate: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(server)

	t := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{pair},
		RootCAs:      pool,
	}
	// Incus server certificates often do not name the address they are
	// reached at. The pool holds only the pinned certificate, so verifying
	// against one of its own names still accepts that certificate alone.
	if server.VerifyHostname(host) != nil && len(server.DNSNames) > 0 {
		t.ServerName = server.DNSNames[0]
	}
	return t, nil
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
	c.http.CloseIdleConnections()
}

// escape quotes one path segment (a name or an ID).
func escape(s string) string { return url.PathEscape(s) }
