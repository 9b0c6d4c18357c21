package incus

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// writeSelfSigned writes a fresh self-signed certificate and key as PEM files.
func writeSelfSigned(t *testing.T, dir, name string, dnsNames ...string) (certFile, keyFile string, cert *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		DNSNames:     dnsNames,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ = x509.ParseCertificate(der)
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile = filepath.Join(dir, name+".crt")
	keyFile = filepath.Join(dir, name+".key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile, cert
}

// HTTPS: the client presents its certificate, trusts exactly the pinned
// server certificate, and refuses any other.
func TestHTTPSPinnedServerCertificate(t *testing.T) {
	dir := t.TempDir()
	clientCrt, clientKey, clientCert := writeSelfSigned(t, dir, "client")
	// A server certificate that does not name 127.0.0.1, like most Incus
	// server certificates reached by address.
	srvCrt, srvKey, _ := writeSelfSigned(t, dir, "server", "incus-host")
	pair, err := tls.LoadX509KeyPair(srvCrt, srvKey)
	if err != nil {
		t.Fatal(err)
	}

	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TLS.PeerCertificates) != 1 || !r.TLS.PeerCertificates[0].Equal(clientCert) {
			writeError(w, 403, 403, "not authorized")
			return
		}
		writeSync(w, map[string]any{"auth": "trusted", "api_version": "1.0",
			"environment": map[string]any{"server": "incus", "server_version": "6.0.4"}})
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAnyClientCert}
	srv.StartTLS()
	t.Cleanup(srv.Close)

	c, err := New(Config{URL: srv.URL, ClientCert: clientCrt, ClientKey: clientKey, ServerCert: srvCrt})
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.GetServer(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if s.Auth != "trusted" || s.Environment.ServerVersion != "6.0.4" {
		t.Errorf("got %+v", s)
	}

	// Pinning another certificate (even one with the same name) fails.
	otherCrt, _, _ := writeSelfSigned(t, dir, "other", "incus-host")
	c2, err := New(Config{URL: srv.URL, ClientCert: clientCrt, ClientKey: clientKey, ServerCert: otherCrt})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c2.GetServer(t.Context())
	var e *Error
	if !errors.As(err, &e) || e.Err == nil {
		t.Fatalf("wrong server certificate: want transport error, got %v", err)
	}
	var unknown x509.UnknownAuthorityError
	if !errors.As(err, &unknown) {
		t.Errorf("want an unknown-authority error, got %v", err)
	}
}
