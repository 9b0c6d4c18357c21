package serve_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/lightspeed-dev/incus-provider/internal/serve"
)

// start serves handler through Listener and Server on a loopback port.
func start(t *testing.T, handler http.Handler, opts serve.Options) (string, *serve.Metrics) {
	t.Helper()
	reg := prometheus.NewRegistry()
	opts.Metrics = serve.NewMetrics(reg)
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := serve.Server(handler, opts, nil)
	go func() { _ = srv.Serve(serve.Listener(ln, opts)) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String(), opts.Metrics
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedWithin reads c until the server closes it, within d; it returns
// what was read.
func closedWithin(t *testing.T, c net.Conn, d time.Duration) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(d))
	got, err := io.ReadAll(c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the connection was still open after %s (read %q)", d, got)
	}
	return string(got)
}

func ok(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }

func get(t *testing.T, c net.Conn) string {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.Status + " " + string(b)
}

func TestConnectionsOverTheCeilingAreClosedAtOnce(t *testing.T) {
	addr, m := start(t, http.HandlerFunc(ok), serve.Options{MaxConnections: 4})
	held := make([]net.Conn, 4)
	for i := range held {
		held[i] = dial(t, addr)
		if got := get(t, held[i]); got != "200 OK ok" {
			t.Fatalf("connection %d: %s", i, got)
		}
	}
	for range 3 {
		over := dial(t, addr)
		if got := closedWithin(t, over, 2*time.Second); got != "" {
			t.Fatalf("a refused connection was sent %q", got)
		}
	}
	if n := testutil.ToFloat64(m.Refused(serve.ReasonConnectionLimit)); n != 3 {
		t.Fatalf("refusals counted: %v, want 3", n)
	}
	// A closed connection frees its place.
	_ = held[0].Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c := dial(t, addr)
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err == nil {
			if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
				resp.Body.Close()
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no place was freed by a closed connection")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// On plain HTTP a connection over the ceiling is answered, at once and
// before its request is read, 503 with a Retry-After the contract allows
// (1 to 60 s), so that a runtime's dial retries it rather than failing on a
// reset; a place freed is taken again as before.
func TestOverTheCeilingPlainHTTPIsAnswered503(t *testing.T) {
	addr, m := start(t, http.HandlerFunc(ok), serve.Options{MaxConnections: 2, PlainHTTP: true})
	held := []net.Conn{dial(t, addr), dial(t, addr)}
	for i, c := range held {
		if got := get(t, c); got != "200 OK ok" {
			t.Fatalf("connection %d: %s", i, got)
		}
	}
	for range 3 {
		over := dial(t, addr)
		_ = over.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(over, "GET /routes/u/e/t HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(over), nil)
		if err != nil {
			t.Fatalf("over the ceiling: %v", err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("over the ceiling: %s, Retry-After %q; want 503 with Retry-After 1", resp.Status, resp.Header.Get("Retry-After"))
		}
		_ = over.Close()
	}
	if n := testutil.ToFloat64(m.Refused(serve.ReasonConnectionLimit)); n != 3 {
		t.Fatalf("refusals counted: %v, want 3", n)
	}
}

// A request that announces a body which never comes is answered 400 at
// once and its connection closed; before, the server waited for the body
// before it sent even a 401.
func TestARequestBodyIsRefusedUnread(t *testing.T) {
	addr, m := start(t, http.HandlerFunc(ok), serve.Options{})
	for _, head := range []string{
		"GET /control HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
		"GET /routes/u/e/t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
		"POST /control HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
	} {
		c := dial(t, addr)
		begun := time.Now()
		if _, err := io.WriteString(c, head); err != nil {
			t.Fatal(err)
		}
		got := closedWithin(t, c, 3*time.Second)
		if !strings.HasPrefix(got, "HTTP/1.1 400 ") || !strings.Contains(got, "Connection: close") {
			t.Fatalf("%q: answered %q", head, got)
		}
		t.Logf("%.40q… answered 400 and closed after %s", head, time.Since(begun).Round(time.Millisecond))
	}
	if n := testutil.ToFloat64(m.Refused(serve.ReasonRequestBody)); n != 3 {
		t.Fatalf("refusals counted: %v, want 3", n)
	}
}

// The HTTP bounds end stalled exchanges but not a hijacked connection (a
// WebSocket), which may stay quiet far longer than any of them.
func TestTimeoutsSpareHijackedConnections(t *testing.T) {
	const bound = 300 * time.Millisecond
	opts := serve.Options{ReadHeaderTimeout: bound, ReadTimeout: bound, WriteTimeout: bound, IdleTimeout: bound}
	addr, _ := start(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/hijack" {
			ok(w, r)
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		_ = brw.Flush()
		line, err := brw.ReadString('\n')
		if err != nil {
			return
		}
		_, _ = brw.WriteString(line)
		_ = brw.Flush()
	}), opts)

	// Silent, a half-sent header, an idle kept-alive connection: each is cut.
	silent := dial(t, addr)
	half := dial(t, addr)
	_, _ = io.WriteString(half, "GET / HTTP/1.1\r\nHost:")
	idle := dial(t, addr)
	if got := get(t, idle); got != "200 OK ok" {
		t.Fatal(got)
	}
	_ = idle.SetDeadline(time.Time{})
	for name, c := range map[string]net.Conn{"silent": silent, "half a header": half, "idle": idle} {
		closedWithin(t, c, 10*bound)
		t.Logf("%s: cut", name)
	}

	h := dial(t, addr)
	if _, err := io.WriteString(h, "GET /hijack HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(h)
	_ = h.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("hijack: %v %v", resp, err)
	}
	time.Sleep(4 * bound)
	if _, err := io.WriteString(h, "still here\n"); err != nil {
		t.Fatal(err)
	}
	line, err := br.ReadString('\n')
	if err != nil || line != "still here\n" {
		t.Fatalf("the hijacked connection did not outlive the HTTP bounds: %q %v", line, err)
	}
}

// Below TLS a connection over the ceiling is answered too, once a
// handshake is made: 503 with Retry-After 1 over HTTP/1.1, whatever the
// client offers in ALPN.
func TestOverTheCeilingTLSIsAnswered503(t *testing.T) {
	cert := selfSigned(t)
	reg := prometheus.NewRegistry()
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}
	opts := serve.Options{MaxConnections: 2, Metrics: serve.NewMetrics(reg), TLS: cfg}
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := serve.Server(http.HandlerFunc(ok), opts, nil)
	srv.TLSConfig = cfg
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true) // as the provider serves it
	go func() { _ = srv.ServeTLS(serve.Listener(ln, opts), "", "") }()
	t.Cleanup(func() { _ = srv.Close() })
	addr := ln.Addr().String()
	client := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2", "http/1.1"}} //nolint:gosec // a test's self-signed certificate
	held := make([]*tls.Conn, 2)
	for i := range held {
		held[i] = tls.Client(dial(t, addr), client)
		if got := get(t, held[i]); got != "200 OK ok" {
			t.Fatalf("connection %d: %s", i, got)
		}
	}
	for range 3 {
		over := tls.Client(dial(t, addr), client)
		_ = over.SetDeadline(time.Now().Add(5 * time.Second))
		if err := over.Handshake(); err != nil {
			t.Fatalf("over the ceiling, the handshake: %v", err)
		}
		if p := over.ConnectionState().NegotiatedProtocol; p == "h2" {
			t.Fatalf("over the ceiling, ALPN chose %q", p)
		}
		if _, err := io.WriteString(over, "GET /routes/u/e/t HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(over), nil)
		if err != nil {
			t.Fatalf("over the ceiling: %v", err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("over the ceiling: %s, Retry-After %q; want 503 with Retry-After 1", resp.Status, resp.Header.Get("Retry-After"))
		}
		_ = over.Close()
	}
	if n := testutil.ToFloat64(opts.Metrics.Refused(serve.ReasonConnectionLimit)); n != 3 {
		t.Fatalf("refusals counted: %v, want 3", n)
	}
}

// selfSigned is a certificate for 127.0.0.1, made for one test.
func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "serve test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}
