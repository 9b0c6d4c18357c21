package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/loopback"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// selfSigned writes one certificate and key as PEM files; the tests below
// never complete a handshake, so it serves as client and pinned server
// certificate alike.
func selfSigned(t *testing.T) (crt, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	kd, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	crt, key = filepath.Join(dir, "t.crt"), filepath.Join(dir, "t.key")
	if err := os.WriteFile(crt, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd}), 0o600); err != nil {
		t.Fatal(err)
	}
	return crt, key
}

// With several Incus endpoints, /readyz says what this replica can reach,
// and the metrics carry each endpoint.
func TestReadyzAndMetricsNameEachEndpoint(t *testing.T) {
	crt, key := selfSigned(t)
	a, b := loopback.FreeAddr(t), loopback.FreeAddr(t)
	reg := prometheus.NewRegistry()
	m := newIncusMetrics(reg)
	client, err := incus.New(incus.Config{URLs: []string{"https://" + a, "https://" + b},
		ClientCert: crt, ClientKey: key, ServerCert: crt, Observe: m.observe, ObserveEndpoint: m.observeEndpoint})
	if err != nil {
		t.Fatal(err)
	}
	watchEndpoints(reg, client)
	if got := endpointUp(t, reg, a); got != 1 {
		t.Errorf("before any call endpoint_up = %v, want 1", got)
	}

	// A peer replica that does not answer: its member's guests go to exec,
	// and /readyz says so.
	dead := loopback.FreeAddr(t)
	fwd, err := guest.NewForward(guest.ForwardOptions{Peers: map[string]string{"m2": dead}, Secret: []byte(strings.Repeat("s", 32)),
		Fallback: guest.NewExec(func(context.Context, string, []string) (net.Conn, error) { return nil, errors.New("no exec here") }, nil)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fwd.DialContext(context.Background(), guest.Target{Instance: "ls-x", Port: 1, Location: "m2"}); err == nil {
		t.Fatal("a dial through a dead peer and a failing fallback succeeded")
	}
	rec := httptest.NewRecorder()
	var draining atomic.Bool
	ready := readyz(client, func() *templates.Catalog { return &templates.Catalog{} }, reachOf(guest.KindMember, "m1", map[string]string{"m1": "x:1", "m2": dead}), true, fwd, cacheStateOf(true, func() bool { return false }), draining.Load)
	ready(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	body := rec.Body.String()
	if !strings.Contains(body, "guests: netns on member m1, through the replicas of m2 on theirs (exec while one is unreachable), exec on every other member\n") {
		t.Errorf("readyz does not say how guests are reached: %q", body)
	}
	if !strings.Contains(body, "observation cache: not confirmed") {
		t.Errorf("readyz does not say the cache is not confirmed: %q", body)
	}
	if !strings.Contains(body, "peer m2 at "+dead+": unreachable, its guests are dialled through exec: ") || !strings.Contains(body, "connection refused") {
		t.Errorf("readyz does not report the dead peer: %q", body)
	}
	// Incus unreachable is reported, not a reason to leave the balancer:
	// every replica would leave at once.
	if rec.Code != http.StatusOK || !strings.HasPrefix(body, "ok\nincus: unreachable; calls that need it answer unavailable\n") {
		t.Fatalf("got %d %q", rec.Code, body)
	}
	for _, addr := range []string{a, b} {
		if !strings.Contains(body, "incus endpoint https://"+addr+": down since ") || !strings.Contains(body, "1 failures in a row") {
			t.Errorf("readyz does not report %s: %q", addr, body)
		}
	}
	if !strings.Contains(body, "connection refused") {
		t.Errorf("readyz should give the last error: %q", body)
	}
	// Draining is: 503 from then on.
	draining.Store(true)
	rec = httptest.NewRecorder()
	ready(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.HasPrefix(rec.Body.String(), "draining: ") {
		t.Fatalf("draining: got %d %q", rec.Code, rec.Body.String())
	}
	// The second /readyz, within readyzIncusEvery of the first, reported
	// what the first asked of Incus: one attempt on each endpoint.
	if got := testutil.ToFloat64(m.attempts.WithLabelValues(a, "transport")); got != 1 {
		t.Errorf("attempts{endpoint=%s,status=transport} = %v, want 1 for two /readyz within %s", a, got, readyzIncusEvery)
	}
	if got := endpointUp(t, reg, b); got != 0 {
		t.Errorf("after a refusal endpoint_up = %v, want 0", got)
	}
}

// endpointUp is the incus_provider_incus_endpoint_up sample of one endpoint.
func endpointUp(t *testing.T, reg *prometheus.Registry, endpoint string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "incus_provider_incus_endpoint_up" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == "endpoint" && lp.GetValue() == endpoint {
					return mt.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no incus_provider_incus_endpoint_up{endpoint=%q}", endpoint)
	return 0
}
