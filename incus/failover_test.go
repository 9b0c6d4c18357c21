package incus

// Several HTTPS endpoints, as the members of one cluster: each a TLS test
// server presenting the same (pinned) certificate and asking for the
// client's. No Incus needed.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/loopback"
)

// rig is a cluster's certificates: one server certificate all members
// present (as Incus members present the cluster certificate), one client.
type rig struct {
	clientCrt, clientKey, serverCrt string
	pair                            tls.Certificate
}

func newRig(t *testing.T) *rig {
	t.Helper()
	dir := t.TempDir()
	clientCrt, clientKey, _ := writeSelfSigned(t, dir, "client")
	srvCrt, srvKey, _ := writeSelfSigned(t, dir, "cluster", "incus-cluster")
	pair, err := tls.LoadX509KeyPair(srvCrt, srvKey)
	if err != nil {
		t.Fatal(err)
	}
	return &rig{clientCrt: clientCrt, clientKey: clientKey, serverCrt: srvCrt, pair: pair}
}

// member is one TLS test server; it counts the requests that reached it.
type member struct {
	srv *httptest.Server

	mu      sync.Mutex
	methods map[string]int
	paths   []string
}

func (rg *rig) member(t *testing.T, h http.HandlerFunc) *member {
	return rg.memberWith(t, rg.pair, h)
}

func (rg *rig) memberWith(t *testing.T, pair tls.Certificate, h http.HandlerFunc) *member {
	t.Helper()
	m := &member{methods: map[string]int{}}
	m.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.mu.Lock()
		m.methods[r.Method]++
		m.paths = append(m.paths, r.Method+" "+r.URL.Path)
		m.mu.Unlock()
		h(w, r)
	}))
	m.srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAnyClientCert}
	// Refused handshakes are what some tests are about; keep them out of the log.
	m.srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	m.srv.StartTLS()
	t.Cleanup(m.srv.Close)
	return m
}

func (m *member) url() string { return m.srv.URL }

func (m *member) label() string { return strings.TrimPrefix(m.srv.URL, "https://") }

func (m *member) count(method string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if method == "" {
		n := 0
		for _, c := range m.methods {
			n += c
		}
		return n
	}
	return m.methods[method]
}

// serverOK answers GET /1.0 like Incus.
func serverOK(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/1.0":
		writeSync(w, map[string]any{"auth": "trusted", "api_version": "1.0"})
	case r.Method == http.MethodPost && r.URL.Path == "/1.0/instances":
		_, _ = io.Copy(io.Discard, r.Body)
		writeAsync(w, opJSON("op-1", "Running", 103, ""))
	default:
		writeError(w, 404, 404, "not found")
	}
}

// hang holds a request, read in full, without answering until the client
// goes away or the test ends.
func hang(done <-chan struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-done:
		}
	}
}

// silent is a TCP listener that accepts connections and never says a
// word (a stopped daemon: the kernel completes the handshake). close
// makes it close each connection at once instead.
type silent struct {
	l       net.Listener
	closeIt bool

	mu      sync.Mutex
	conns   []net.Conn
	accepts int
	wg      sync.WaitGroup
}

func newSilent(t *testing.T, closeIt bool) *silent {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &silent{l: l, closeIt: closeIt}
	s.wg.Add(1)
	go func() { // ends when the listener is closed
		defer s.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.accepts++
			if s.closeIt {
				c.Close()
			} else {
				s.conns = append(s.conns, c)
			}
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		s.wg.Wait()
		s.mu.Lock()
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
	})
	return s
}

func (s *silent) url() string { return "https://" + s.l.Addr().String() }

func (s *silent) accepted() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.accepts
}

type epObserved struct{ endpoint, op, status string }

type watched struct {
	*Client
	mu  sync.Mutex
	obs []epObserved
}

func (w *watched) seen() []epObserved {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]epObserved(nil), w.obs...)
}

func (rg *rig) client(t *testing.T, urls []string, mod func(*Config)) *watched {
	t.Helper()
	w := &watched{}
	cfg := Config{
		URLs: urls, ClientCert: rg.clientCrt, ClientKey: rg.clientKey, ServerCert: rg.serverCrt,
		CallTimeout: 5 * time.Second, ConnectTimeout: 500 * time.Millisecond, AttemptTimeout: 500 * time.Millisecond,
		ObserveEndpoint: func(ep, op, status string, _ time.Duration) {
			w.mu.Lock()
			w.obs = append(w.obs, epObserved{ep, op, status})
			w.mu.Unlock()
		},
	}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	w.Client = c
	return w
}

func within(t *testing.T, what string, d, most time.Duration) {
	t.Helper()
	if d > most {
		t.Errorf("%s took %s, want at most %s", what, d, most)
	}
}

func TestCheckURL(t *testing.T) {
	for _, ok := range []string{"https://10.0.0.1:8443", "https://10.0.0.1:8443/", "https://incus.example:8443", "https://[fd00::1]:8443"} {
		if err := CheckURL(ok); err != nil {
			t.Errorf("%s refused: %v", ok, err)
		}
	}
	for raw, want := range map[string]string{
		"http://10.0.0.1:8443":          "https://",
		"10.0.0.1:8443":                 "https://",
		"https://10.0.0.1":              "port",
		"https://:8443":                 "host",
		"https://10.0.0.1:8443/1.0":     "path",
		"https://10.0.0.1:8443?x=1":     "query",
		"https://10.0.0.1:8443#frag":    "fragment",
		"https://user:pw@10.0.0.1:8443": "user",
		"https://10.0.0.1:99999":        "port",
		"https://10.0.0.1:8443 ":        "",
	} {
		err := CheckURL(raw)
		if err == nil {
			t.Errorf("%q accepted", raw)
			continue
		}
		if !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: %q should be one line saying %q", raw, err, want)
		}
	}

	rg := newRig(t)
	base := Config{ClientCert: rg.clientCrt, ClientKey: rg.clientKey, ServerCert: rg.serverCrt}
	cfg := base
	cfg.URLs = []string{"https://10.0.0.1:8443", "https://10.0.0.2:8443", "https://10.0.0.1:8443/"}
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("duplicate endpoint: got %v", err)
	}
	cfg = base
	cfg.URL, cfg.URLs = "https://10.0.0.1:8443", []string{"https://10.0.0.2:8443"}
	if _, err := New(cfg); err == nil {
		t.Error("URL and URLs together accepted")
	}
	cfg = base
	cfg.URLs = []string{"https://10.0.0.1:8443", "https://10.0.0.2:8443"}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	st := c.Endpoints()
	if len(st) != 2 || st[0].Label != "10.0.0.1:8443" || st[1].URL != "https://10.0.0.2:8443" || !st[0].Healthy || !st[1].Healthy {
		t.Errorf("endpoints %+v", st)
	}
	if c.connectTO != DefaultConnectTimeout || c.attemptTO != DefaultAttemptTimeout {
		t.Errorf("defaults: connect %s attempt %s", c.connectTO, c.attemptTO)
	}
}

// A member that refuses connections: the call goes on to the next at once,
// for writes too, and the refusing one is set aside.
func TestFailoverRefusedThenGood(t *testing.T) {
	rg := newRig(t)
	good := rg.member(t, serverOK)
	dead := "https://" + loopback.FreeAddr(t)
	c := rg.client(t, []string{dead, good.url()}, nil)

	start := time.Now()
	if _, err := c.GetServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	within(t, "a read past a refusing member", time.Since(start), 2*time.Second)
	if _, err := c.CreateInstance(t.Context(), InstancesPost{Name: "c1"}); err != nil {
		t.Fatalf("a write that reached no one moves on: %v", err)
	}
	if good.count(http.MethodGet) != 1 || good.count(http.MethodPost) != 1 {
		t.Errorf("good member saw %v", good.methods)
	}
	st := c.Endpoints()
	if st[0].Healthy || st[0].Failures != 1 || !strings.Contains(st[0].LastError, "refused") || st[0].DownSince.IsZero() {
		t.Errorf("refusing endpoint %+v", st[0])
	}
	if !st[1].Healthy || st[1].LastOK.IsZero() {
		t.Errorf("good endpoint %+v", st[1])
	}
	want := []epObserved{
		{strings.TrimPrefix(dead, "https://"), "server.get", "transport"}, {good.label(), "server.get", "ok"},
		{good.label(), "instance.create", "ok"}, // the write went straight to the healthy one
	}
	if got := c.seen(); len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Errorf("attempts %v, want %v", got, want)
	}
}

// fakeClock is the endpoints' clock in tests that are about time passing.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// A member that is down is set aside: later calls go straight to a healthy
// one, until its cool-down ends; then one read tries it again first, and
// another failure doubles the cool-down, up to 30 s. Writes never try it
// while a healthy endpoint is there. Once it answers it is preferred again.
func TestFailoverCoolDown(t *testing.T) {
	rg := newRig(t)
	good := rg.member(t, serverOK)
	var ready atomic.Bool
	bad := rg.member(t, func(w http.ResponseWriter, r *http.Request) {
		if !ready.Load() {
			writeError(w, 503, 503, "Daemon is starting up")
			return
		}
		serverOK(w, r)
	})
	c := rg.client(t, []string{bad.url(), good.url()}, nil)
	clock := newFakeClock()
	c.eps.now = clock.now

	ctx := t.Context()
	if _, err := c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	if bad.count("") != 1 {
		t.Fatalf("first call: bad member saw %v, want one GET", bad.methods)
	}
	st := c.Endpoints()[0]
	if st.Healthy || st.Failures != 1 || st.RetryAt.Sub(st.DownSince) != time.Second {
		t.Errorf("after one failure: %+v, want a 1s cool-down", st)
	}
	clock.advance(999 * time.Millisecond)
	for range 5 {
		if _, err := c.GetServer(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if bad.count("") != 1 {
		t.Fatalf("during its cool-down the bad member was tried again: %v", bad.methods)
	}

	// Cool-down over: a write still goes to the healthy endpoint.
	clock.advance(time.Millisecond)
	if _, err := c.CreateInstance(ctx, InstancesPost{Name: "c1"}); err != nil {
		t.Fatal(err)
	}
	if bad.count("") != 1 || good.count(http.MethodPost) != 1 {
		t.Fatalf("a write probed a member that had failed: %v", bad.methods)
	}
	// A read tries it first, and each failure doubles the cool-down, up
	// to 30 s.
	for i, want := range []time.Duration{2, 4, 8, 16, 30, 30} {
		if _, err := c.GetServer(ctx); err != nil {
			t.Fatal(err)
		}
		if bad.count("") != 2+i {
			t.Fatalf("after its cool-down a read should try the member again: %v", bad.methods)
		}
		st = c.Endpoints()[0]
		if st.Failures != 2+i || st.RetryAt.Sub(clock.now()) != want*time.Second {
			t.Fatalf("failure %d: %+v, cool-down %s, want %ds", 2+i, st, st.RetryAt.Sub(clock.now()), want)
		}
		clock.advance(want * time.Second)
	}

	// Back: the next read finds out, and writes go there again.
	ready.Store(true)
	if _, err := c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	if st = c.Endpoints()[0]; !st.Healthy || st.Failures != 0 || !st.RetryAt.IsZero() || st.LastError == "" {
		t.Errorf("recovered endpoint %+v", st)
	}
	if _, err := c.CreateInstance(ctx, InstancesPost{Name: "c2"}); err != nil {
		t.Fatal(err)
	}
	if bad.count(http.MethodPost) != 1 || good.count(http.MethodPost) != 1 {
		t.Errorf("after recovery the first member should take the write: bad %v, good %v", bad.methods, good.methods)
	}
}

// A member that accepts and never answers: a read moves on after the
// attempt bound; a write that was sent is not sent again elsewhere and
// says its outcome is unknown.
func TestFailoverHungMember(t *testing.T) {
	rg := newRig(t)
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	hung := rg.member(t, hang(done))
	good := rg.member(t, serverOK)
	ctx := t.Context()

	c := rg.client(t, []string{hung.url(), good.url()}, nil)
	start := time.Now()
	if _, err := c.GetServer(ctx); err != nil {
		t.Fatal(err)
	}
	d := time.Since(start)
	if d < 450*time.Millisecond {
		t.Errorf("read moved on after %s, before its 500ms bound", d)
	}
	within(t, "a read past a hung member", d, 500*time.Millisecond+1500*time.Millisecond)
	if hung.count(http.MethodGet) != 1 || good.count(http.MethodGet) != 1 {
		t.Errorf("hung saw %v, good saw %v", hung.methods, good.methods)
	}
	// The hung one is to blame: the other answered the same call.
	if st := c.Endpoints(); st[0].Healthy || !strings.Contains(st[0].LastError, "no answer within 500ms") || !st[1].Healthy {
		t.Errorf("endpoints %+v", st)
	}

	// A fresh client prefers the hung member for its write.
	w := rg.client(t, []string{hung.url(), good.url()}, func(cfg *Config) { cfg.CallTimeout = time.Second })
	start = time.Now()
	_, err := w.CreateInstance(ctx, InstancesPost{Name: "c1"})
	within(t, "a write to a hung member", time.Since(start), time.Second+1500*time.Millisecond)
	if !errors.Is(err, ErrOutcomeUnknown) || errors.Is(err, ErrUnreachable) {
		t.Fatalf("want ErrOutcomeUnknown (and not ErrUnreachable), got %v", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "may have been carried out") {
		t.Errorf("the error should say the call ran out of time and may have happened: %v", err)
	}
	var e *Error
	if !errors.As(err, &e) || e.Status != 0 || e.Op != "instance.create" {
		t.Errorf("want a transport *Error, got %#v", err)
	}
	if n := good.count(http.MethodPost); n != 0 {
		t.Fatalf("the write was sent to a second member (%d POSTs)", n)
	}
	if hung.count(http.MethodPost) != 1 {
		t.Errorf("hung member saw %v", hung.methods)
	}
}

// A member that accepts TCP and never completes TLS: nothing was sent, so
// writes move on too, after the connect bound.
func TestFailoverHandshakeNeverCompletes(t *testing.T) {
	rg := newRig(t)
	good := rg.member(t, serverOK)
	mute := newSilent(t, false)
	c := rg.client(t, []string{mute.url(), good.url()}, nil)
	start := time.Now()
	if _, err := c.CreateInstance(t.Context(), InstancesPost{Name: "c1"}); err != nil {
		t.Fatal(err)
	}
	within(t, "a write past a member that never handshakes", time.Since(start), 500*time.Millisecond+1500*time.Millisecond)
	if good.count(http.MethodPost) != 1 || mute.accepted() != 1 {
		t.Errorf("good saw %v, mute accepted %d", good.methods, mute.accepted())
	}
	if st := c.Endpoints()[0]; st.Healthy {
		t.Errorf("mute endpoint %+v", st)
	}
}

// A member that cuts the connection after reading the request: a read goes
// on, a write's outcome is unknown.
func TestFailoverConnectionCutAfterRequest(t *testing.T) {
	rg := newRig(t)
	cut := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
	}
	cutter := rg.member(t, cut)
	good := rg.member(t, serverOK)
	c := rg.client(t, []string{cutter.url(), good.url()}, nil)
	if _, err := c.GetServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	c2 := rg.client(t, []string{cutter.url(), good.url()}, nil)
	_, err := c2.CreateInstance(t.Context(), InstancesPost{Name: "c1"})
	if !errors.Is(err, ErrOutcomeUnknown) || !IsRetryable(err) {
		t.Fatalf("want ErrOutcomeUnknown, got %v", err)
	}
	if good.count(http.MethodPost) != 0 {
		t.Fatal("a write whose connection broke after sending was sent again")
	}
	if st := c2.Endpoints()[0]; st.Healthy {
		t.Errorf("a member that cut the connection stays preferred: %+v", st)
	}
}

// "Server isn't ready yet" and "Daemon is starting up": nothing ran, so any
// method goes on to the next member.
func TestFailoverNotReady(t *testing.T) {
	rg := newRig(t)
	good := rg.member(t, serverOK)
	for _, tc := range []struct {
		name, msg string
		status    int
	}{
		{"forward target offline", "Server isn't ready yet", 500},
		{"forward target lost", "Missing event connection with target cluster member", 500},
		{"starting", "Daemon is starting up", 503},
	} {
		t.Run(tc.name, func(t *testing.T) {
			notReady := rg.member(t, func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				writeError(w, tc.status, tc.status, tc.msg)
			})
			posts := good.count(http.MethodPost)
			c := rg.client(t, []string{notReady.url(), good.url()}, nil)
			if _, err := c.CreateInstance(t.Context(), InstancesPost{Name: "c1"}); err != nil {
				t.Fatal(err)
			}
			if good.count(http.MethodPost) != posts+1 || notReady.count(http.MethodPost) != 1 {
				t.Errorf("good saw %d more POSTs, not-ready saw %v", good.count(http.MethodPost)-posts, notReady.methods)
			}
			if st := c.Endpoints()[0]; st.Healthy || !strings.Contains(st.LastError, tc.msg) {
				t.Errorf("not-ready endpoint %+v", st)
			}
		})
	}

	// Every member says it cannot reach the member the call needs: the
	// answer says so, and no member is blamed for it.
	offline := func(w http.ResponseWriter, r *http.Request) { writeError(w, 500, 500, "Server isn't ready yet") }
	a, b := rg.member(t, offline), rg.member(t, offline)
	c := rg.client(t, []string{a.url(), b.url()}, nil)
	_, _, err := c.GetInstance(t.Context(), "c1")
	if !errors.Is(err, ErrMemberUnavailable) || !errors.Is(err, ErrUnreachable) || !IsRetryable(err) || errors.Is(err, ErrNotFound) {
		t.Fatalf("got %v", err)
	}
	if a.count("") != 1 || b.count("") != 1 {
		t.Errorf("a saw %v, b saw %v", a.methods, b.methods)
	}
	for _, st := range c.Endpoints() {
		if !st.Healthy {
			t.Errorf("%s blamed for another member's absence: %+v", st.URL, st)
		}
	}
}

// Nobody answers: a transport error, soon, that says so.
func TestFailoverAllDown(t *testing.T) {
	rg := newRig(t)
	mute := newSilent(t, false)
	c := rg.client(t, []string{"https://" + loopback.FreeAddr(t), mute.url(), "https://" + loopback.FreeAddr(t)}, nil)
	for _, write := range []bool{false, true} {
		start := time.Now()
		var err error
		if write {
			_, err = c.CreateInstance(t.Context(), InstancesPost{Name: "c1"})
		} else {
			_, err = c.GetServer(t.Context())
		}
		within(t, "a call with every member down", time.Since(start), 500*time.Millisecond+1500*time.Millisecond)
		var e *Error
		if !errors.As(err, &e) || e.Status != 0 || e.Err == nil {
			t.Fatalf("want a transport *Error, got %v", err)
		}
		if !errors.Is(err, ErrUnreachable) || errors.Is(err, ErrOutcomeUnknown) || !IsRetryable(err) || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("write %v: got %v", write, err)
		}
		if n := strings.Count(err.Error(), "127.0.0.1:"); n < 3 {
			t.Errorf("the error should name each endpoint: %v", err)
		}
	}
	for _, st := range c.Endpoints() {
		if st.Healthy {
			t.Errorf("%+v", st)
		}
	}
}

// A member presenting another certificate is refused, never trusted, and
// the call goes on to one presenting the pinned certificate.
func TestFailoverPinnedCertificate(t *testing.T) {
	rg := newRig(t)
	otherCrt, otherKey, _ := writeSelfSigned(t, t.TempDir(), "impostor", "incus-cluster")
	pair, err := tls.LoadX509KeyPair(otherCrt, otherKey)
	if err != nil {
		t.Fatal(err)
	}
	impostor := rg.memberWith(t, pair, serverOK)
	good := rg.member(t, serverOK)

	c := rg.client(t, []string{impostor.url(), good.url()}, nil)
	if _, err := c.CreateInstance(t.Context(), InstancesPost{Name: "c1"}); err != nil {
		t.Fatal(err)
	}
	if impostor.count("") != 0 || good.count(http.MethodPost) != 1 {
		t.Fatalf("impostor saw %v, good saw %v", impostor.methods, good.methods)
	}
	if st := c.Endpoints()[0]; st.Healthy || !strings.Contains(st.LastError, "certificate") {
		t.Errorf("impostor endpoint %+v", st)
	}

	alone := rg.client(t, []string{impostor.url()}, nil)
	_, err = alone.GetServer(t.Context())
	var unknown x509.UnknownAuthorityError
	if !errors.As(err, &unknown) || !errors.Is(err, ErrUnreachable) {
		t.Fatalf("want an unknown-authority error, got %v", err)
	}
	if impostor.count("") != 0 {
		t.Fatal("a request reached a server with the wrong certificate")
	}
}

// An operation is followed through the endpoint that started it, even once
// calls prefer another; its websockets too.
func TestOperationFollowsItsEndpoint(t *testing.T) {
	rg := newRig(t)
	waits := 0
	var mu sync.Mutex
	runs := rg.member(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/1.0/instances":
			op := opJSON("op-9", "Running", 103, "")
			// As a member not holding the instance words it.
			writeJSON(w, http.StatusAccepted, map[string]any{
				"type": "async", "status": "Operation created", "status_code": 100,
				"operation": "/1.0/operations/op-9?project=p1", "metadata": op,
			})
		case "/1.0/operations/op-9/wait":
			mu.Lock()
			waits++
			mu.Unlock()
			writeSync(w, opJSON("op-9", "Success", 200, ""))
		case "/1.0/operations/op-9":
			writeSync(w, opJSON("op-9", "Running", 103, ""))
		default:
			writeError(w, 404, 404, "not found")
		}
	})
	other := rg.member(t, func(w http.ResponseWriter, r *http.Request) { writeError(w, 404, 404, "not found") })
	c := rg.client(t, []string{runs.url(), other.url()}, func(cfg *Config) { cfg.Project = "p1" })
	ctx := t.Context()
	op, err := c.CreateInstance(ctx, InstancesPost{Name: "c1"})
	if err != nil || op.ID != "op-9" {
		t.Fatalf("%+v %v", op, err)
	}
	// Calls now prefer the other member.
	c.eps.failed(pinned(c.eps.list[0])[0], errors.New("set aside by the test"))
	if _, err := c.GetServer(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("calls should now go to the other member: %v", err)
	}

	cur, err := c.RefreshOperation(ctx, op)
	if err != nil || cur.StatusCode != StatusRunning {
		t.Fatalf("refresh: %+v %v", cur, err)
	}
	final, err := c.Wait(ctx, cur)
	if err != nil || final.StatusCode != StatusSuccess || waits != 1 {
		t.Fatalf("wait: %+v %v (waits %d)", final, err, waits)
	}
	for _, p := range other.paths {
		if strings.Contains(p, "operations") {
			t.Errorf("the other member was asked about the operation: %v", other.paths)
		}
	}

	u, err := c.WebsocketURL(op, "s3cret")
	if err != nil {
		t.Fatal(err)
	}
	if want := "wss://" + runs.label() + "/1.0/operations/op-9/websocket?project=p1&secret=s3cret"; u != want {
		t.Errorf("websocket URL %s, want %s", u, want)
	}
	conn, err := c.DialOperation(ctx, op)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if conn.RemoteAddr().String() != runs.label() {
		t.Errorf("websocket connection to %s, want %s", conn.RemoteAddr(), runs.label())
	}
	if tc, ok := conn.(*tls.Conn); !ok || !tc.ConnectionState().HandshakeComplete {
		t.Errorf("want a TLS connection with its handshake done, got %T", conn)
	}
}

// slowly answers every request after d, as a member under load.
func slowly(d time.Duration, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(d):
			h(w, r)
		case <-r.Context().Done():
		}
	}
}

func instanceList(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/1.0/instances" {
		writeSync(w, []map[string]any{{"name": "c1"}})
		return
	}
	serverOK(w, r)
}

// A read that is slow on every member is not the members' fault: the one
// cut short is not blamed when the next is slow as well.
func TestFailoverSlowEverywhereBlamesNobody(t *testing.T) {
	rg := newRig(t)
	a := rg.member(t, slowly(700*time.Millisecond, serverOK))
	b := rg.member(t, slowly(700*time.Millisecond, serverOK))
	c := rg.client(t, []string{a.url(), b.url()}, nil)
	if _, err := c.GetServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	if a.count("") != 1 || b.count("") != 1 {
		t.Errorf("a saw %v, b saw %v", a.methods, b.methods)
	}
	for _, st := range c.Endpoints() {
		if !st.Healthy {
			t.Errorf("%s blamed for a call that was slow everywhere: %+v", st.URL, st)
		}
	}
}

// A recursive list may rightly take longer than the attempt bound: it is
// not cut short, and it does not probe a member that failed.
func TestFailoverListsArePatient(t *testing.T) {
	rg := newRig(t)
	slow := rg.member(t, slowly(900*time.Millisecond, instanceList))
	other := rg.member(t, instanceList)
	c := rg.client(t, []string{slow.url(), other.url()}, nil)
	list, err := c.ListInstances(t.Context())
	if err != nil || len(list) != 1 {
		t.Fatalf("%v %v", list, err)
	}
	if slow.count("") != 1 || other.count("") != 0 {
		t.Errorf("a slow list was cut short: slow saw %v, other saw %v", slow.methods, other.methods)
	}

	// Set aside and cooled down: a short read would probe it, a list does not.
	clock := newFakeClock()
	c.eps.now = clock.now
	c.eps.failed(pinned(c.eps.list[0])[0], errors.New("set aside by the test"))
	clock.advance(time.Minute)
	if _, err := c.ListInstances(t.Context()); err != nil {
		t.Fatal(err)
	}
	if slow.count("") != 1 || other.count("") != 1 {
		t.Errorf("a list probed a member that had failed: slow saw %v, other saw %v", slow.methods, other.methods)
	}
}
