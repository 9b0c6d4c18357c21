package targets

// How targets reads the Incus client's failures when it has several
// endpoints (the members of a cluster). Loopback TLS servers; no Incus.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/loopback"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// tlsFiles writes a client certificate and key, and pins server's
// certificate, as PEM files.
func tlsFiles(t *testing.T, server *x509.Certificate) (clientCrt, clientKey, serverCrt string) {
	t.Helper()
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "provider"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	clientCrt, clientKey, serverCrt = filepath.Join(dir, "c.crt"), filepath.Join(dir, "c.key"), filepath.Join(dir, "s.crt")
	for path, block := range map[string]*pem.Block{
		clientCrt: {Type: "CERTIFICATE", Bytes: der},
		clientKey: {Type: "EC PRIVATE KEY", Bytes: keyDER},
		serverCrt: {Type: "CERTIFICATE", Bytes: server.Raw},
	} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return clientCrt, clientKey, serverCrt
}

// member is a loopback TLS server standing in for one cluster member.
func member(t *testing.T, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	srv := httptest.NewTLSServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// mutedURL names a listener that never accepts: the kernel completes the
// TCP handshake and the TLS one never starts, like a stopped daemon.
func mutedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return "https://" + l.Addr().String()
}

func incusError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"type": "error", "error_code": status, "error": msg})
}

func clusterClient(t *testing.T, pin *x509.Certificate, callTimeout time.Duration, urls ...string) *incus.Client {
	t.Helper()
	crt, key, srv := tlsFiles(t, pin)
	c, err := incus.New(incus.Config{URLs: urls, ClientCert: crt, ClientKey: key, ServerCert: srv, CallTimeout: callTimeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// A write that reached no member is not "may have landed"; one that a
// member took and never answered is.
func TestWriteLandedAcrossEndpoints(t *testing.T) {
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	hung := member(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-done:
		}
		// Never an answer: a handler that returned would send an empty
		// 200, which a client still reading takes for one (seen under
		// load in CI).
		panic(http.ErrAbortHandler)
	})
	notReady := member(t, func(w http.ResponseWriter, r *http.Request) { incusError(w, 500, "Server isn't ready yet") })
	pin := hung.Certificate() // every httptest TLS server presents the same one, as cluster members do

	for _, tc := range []struct {
		name   string
		urls   []string
		landed bool
	}{
		{"every member refuses", []string{"https://" + loopback.FreeAddr(t), "https://" + loopback.FreeAddr(t)}, false},
		{"no member completes a handshake", []string{mutedURL(t), mutedURL(t)}, false},
		{"no member can reach the instance's", []string{notReady.URL, "https://" + loopback.FreeAddr(t)}, false},
		{"a member took it and did not answer", []string{"https://" + loopback.FreeAddr(t), hung.URL}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := clusterClient(t, pin, 1500*time.Millisecond, tc.urls...)
			start := time.Now()
			err := c.PatchInstanceConfigIf(context.Background(), "c1", map[string]string{"user.x": "1"}, `"etag"`)
			if err == nil {
				t.Fatal("the write succeeded")
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("took %s", d)
			}
			if got := writeMayHaveLanded(err); got != tc.landed {
				t.Errorf("writeMayHaveLanded = %v, want %v, for %v", got, tc.landed, err)
			}
			if tc.landed != errors.Is(err, incus.ErrOutcomeUnknown) {
				t.Errorf("ErrOutcomeUnknown = %v for %v", !tc.landed, err)
			}
		})
	}
}

// Every member down: targets answers unavailable, with retryAfterMs, soon.
func TestEveryMemberDownIsUnavailable(t *testing.T) {
	pin := member(t, func(http.ResponseWriter, *http.Request) {}).Certificate()
	client := clusterClient(t, pin, 0, "https://"+loopback.FreeAddr(t), mutedURL(t), "https://"+loopback.FreeAddr(t))
	dialer, err := guest.New(guest.KindProxy, guest.Options{Lookup: client.InitPID, SocketDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	svc := mustNew(t, client, &templates.Catalog{}, dialer, zaptest.NewLogger(t), Config{})
	start := time.Now()
	_, err = svc.GetTarget(context.Background(), controller.TargetRef{Owner: owner("e")})
	if d := time.Since(start); d > incus.DefaultConnectTimeout+2*time.Second {
		t.Errorf("took %s with every member down", d)
	}
	var e *jsonrpc.Error
	if !errors.As(err, &e) || e.Kind != jsonrpc.KindUnavailable || e.RetryAfterMs == nil {
		t.Fatalf("want unavailable with retryAfterMs, got %v", err)
	}
}
