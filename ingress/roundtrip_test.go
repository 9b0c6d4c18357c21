package ingress

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The inline transport: what it must keep of http.Transport's behaviour
// for the requests it carries (no body, idempotent).

// rawApp is a guest app written by hand: serve runs for each connection
// accepted, with its number.
func rawApp(t *testing.T, serve func(c net.Conn, n int)) string {
	t.Helper()
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 0; ; n++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				serve(c, n)
			}()
		}
	}()
	return ln.Addr().String()
}

func (r *edgeRig) host() string { return r.label + ".env.example.com" }

// awaitNoUpstream waits, at most 2 s, until the registry counts no upstream
// connection of the target: the edge closes them on its own goroutines.
func (r *edgeRig) awaitNoUpstream(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for r.reg.Open(instance) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the registry still counts %d connections", r.reg.Open(instance))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// countingApp is a guest app serving h that counts the connections it
// accepted.
func countingApp(t *testing.T, h http.HandlerFunc) (addr string, conns *atomic.Int32) {
	t.Helper()
	conns = new(atomic.Int32)
	app := httptest.NewUnstartedServer(h)
	app.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	app.Start()
	t.Cleanup(app.Close)
	return app.Listener.Addr().String(), conns
}

func TestSmallRequestsShareOneKeptUpstreamConnection(t *testing.T) {
	addr, conns := countingApp(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	r := newEdgeRigTo(t, addr, 0)
	for i := range 20 {
		method := []string{http.MethodGet, http.MethodHead, http.MethodOptions}[i%3]
		req, _ := http.NewRequest(method, r.srv.URL+"/", nil)
		req.Host = r.host()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d (%s): %s", i, method, resp.Status)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("20 requests one after another opened %d upstream connections, want 1", n)
	}
	if n := r.reg.Open(instance); n != 1 {
		t.Fatalf("the registry counts %d connections, want the kept one", n)
	}
}

// An app that closes each connection after one answer, with no
// Connection: close (as a server whose keep-alive timeout is shorter
// than the edge's does): each next request finds its kept connection
// dead and is sent again on a new one, not answered 502.
func TestARequestOnAKeptConnectionTheAppClosedIsSentAgain(t *testing.T) {
	addr := rawApp(t, func(c net.Conn, n int) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok-%d", n)
	})
	r := newEdgeRigTo(t, addr, 0)
	for i := range 5 {
		resp, body := r.get(t, r.host(), "/", nil)
		if resp.StatusCode != http.StatusOK || body != fmt.Sprintf("ok-%d", i) {
			t.Fatalf("request %d: %s %q", i, resp.Status, body)
		}
		time.Sleep(20 * time.Millisecond) // the close reaches the edge's kept connection
	}
}

func TestAnAnswerHeadOverTheLimitIsRefused(t *testing.T) {
	addr := rawApp(t, func(c net.Conn, _ int) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		w := bufio.NewWriter(c)
		_, _ = io.WriteString(w, "HTTP/1.1 200 OK\r\nX-Big: ")
		_, _ = io.WriteString(w, strings.Repeat("x", 200<<10))
		_, _ = io.WriteString(w, "\r\nContent-Length: 2\r\n\r\nok")
		_ = w.Flush()
	})
	r := newEdgeRigTo(t, addr, 0)
	resp, _ := r.get(t, r.host(), "/", nil)
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("an answer with a 200 KiB head: %s, want 502", resp.Status)
	}
	if n := r.reg.Open(instance); n != 0 {
		t.Fatalf("%d upstream connections left open after a refused head", n)
	}
}

func TestAKeptConnectionIsClosedOnceIdleTooLong(t *testing.T) {
	closed := make(chan struct{})
	addr := rawApp(t, func(c net.Conn, _ int) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		if _, err := br.ReadByte(); err != nil {
			close(closed) // the edge closed its kept connection
		}
	})
	r := newEdgeRigTo(t, addr, 0)
	r.edge.rt.idleTimeout = 200 * time.Millisecond
	if resp, body := r.get(t, r.host(), "/", nil); resp.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("%s %q", resp.Status, body)
	}
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the kept connection was still open 5 s after its 200 ms idle timeout")
	}
	r.awaitNoUpstream(t)
}

// A client that leaves in the middle of an answer takes the upstream
// connection with it: it is closed, not kept with half an answer unread.
func TestAClientThatLeavesMidAnswerClosesTheUpstream(t *testing.T) {
	gone := make(chan struct{})
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.WriteString(w, "first\n")
		_ = http.NewResponseController(w).Flush()
		<-req.Context().Done()
		close(gone)
	}))
	t.Cleanup(app.Close)
	r := newEdgeRigTo(t, app.Listener.Addr().String(), 0)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.srv.URL+"/", nil)
	req.Host = r.host()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || line != "first\n" {
		t.Fatalf("%q, %v", line, err)
	}
	cancel()
	resp.Body.Close()
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("the app's connection was still open 5 s after the client left")
	}
	r.awaitNoUpstream(t)
}

func TestInformationalAnswersPassThrough(t *testing.T) {
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		_, _ = io.WriteString(w, "page")
	}))
	t.Cleanup(app.Close)
	r := newEdgeRigTo(t, app.Listener.Addr().String(), 0)
	var hints []string
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			hints = append(hints, fmt.Sprintf("%d %s", code, h.Get("Link")))
			return nil
		},
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.srv.URL+"/", nil)
	req.Host = r.host()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(body) != "page" {
		t.Fatalf("%s %q", resp.Status, body)
	}
	if len(hints) != 1 || hints[0] != "103 </style.css>; rel=preload" {
		t.Fatalf("informational answers seen by the client: %q", hints)
	}
}

// A client that stops reading a long answer is cut after the stall bound,
// and so is the guest's connection, at once: the edge does not read the
// rest of the answer from the guest first, which an answer's Close does to
// keep a connection, unless the request's end has closed it already (the
// server ends the request when a write to its client fails).
func TestAClientThatStallsADownloadLetsTheGuestGo(t *testing.T) {
	const declared = 64 << 30 // more than the app can write before its 10 s deadline
	var written atomic.Int64
	ended := make(chan error, 1)
	addr := rawApp(t, func(c net.Conn, _ int) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			ended <- err
			return
		}
		_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", declared)
		chunk := make([]byte, 64<<10)
		for {
			n, err := c.Write(chunk)
			written.Add(int64(n))
			if err != nil {
				ended <- err
				return
			}
		}
	})
	r := newEdgeRigTo(t, addr, 300*time.Millisecond)
	var d net.Dialer
	conn, err := d.DialContext(context.Background(), "tcp", r.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, _ = io.WriteString(conn, "GET /big HTTP/1.1\r\nHost: "+r.host()+"\r\n\r\n")
	// The head and a little of the body, then the client reads no more.
	if _, err := io.ReadFull(conn, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ended:
	case <-time.After(8 * time.Second):
		t.Fatalf("the app's connection was still open 8 s after the client stopped reading (%d MiB written)", written.Load()>>20)
	}
	r.awaitNoUpstream(t)
	// What a stalled client leaves in the socket buffers is megabytes; a
	// drain reads on at loopback speed, gigabytes in these seconds.
	if w := written.Load(); w > 256<<20 {
		t.Fatalf("the app wrote %d MiB to a client that read 4 KiB: the edge read on after the stall", w>>20)
	}
}

// An app that takes a request and never answers its head is given up at
// the transport's header bound, for both of its paths: the request is
// answered 502 and the upstream connection closed, whichever carried it.
func TestAnAppThatNeverAnswersIsGivenUpAtTheHeaderBound(t *testing.T) {
	const bound = 300 * time.Millisecond
	release := make(chan struct{})
	addr := rawApp(t, func(c net.Conn, _ int) {
		if req, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
			_, _ = io.Copy(io.Discard, req.Body)
		}
		<-release
	})
	t.Cleanup(func() { close(release) }) // before rawApp's, which waits for the handlers
	r := newEdgeRigTo(t, addr, 0)
	r.edge.rt.headerTimeout = bound
	r.edge.tr.ResponseHeaderTimeout = bound
	for _, method := range []string{http.MethodGet, http.MethodPost} {
		req, _ := http.NewRequest(method, r.srv.URL+"/", strings.NewReader("body"))
		if method == http.MethodGet {
			req.Body, req.ContentLength = nil, 0 // the inline path
		}
		req.Host = r.host()
		start := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		took := time.Since(start)
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("%s to an app that never answers: %s, want 502", method, resp.Status)
		}
		if took < bound || took > bound+5*time.Second {
			t.Fatalf("%s answered after %s; the bound is %s", method, took, bound)
		}
		r.awaitNoUpstream(t)
	}
}

// Many clients at once each keep their upstream connection: the next
// round of as many requests opens none (with a pool of 8, most of a busy
// target's requests dialled the guest and closed the connection after).
func TestManyClientsKeepTheirUpstreamConnections(t *testing.T) {
	const clients = 64
	// A barrier per round: every request waits at the app until all of
	// the round's are there, so each holds an upstream connection of its
	// own at once.
	var mu sync.Mutex
	arrived, all := 0, make(chan struct{})
	addr, conns := countingApp(t, func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		if arrived++; arrived == clients {
			close(all)
		}
		wait := all
		mu.Unlock()
		select {
		case <-wait:
		case <-time.After(5 * time.Second):
			http.Error(w, "the round's other requests never came", http.StatusGatewayTimeout)
			return
		}
		_, _ = io.WriteString(w, "ok")
	})
	r := newEdgeRigTo(t, addr, 0)
	tr := &http.Transport{MaxIdleConnsPerHost: clients}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	round := func() {
		t.Helper()
		mu.Lock()
		arrived, all = 0, make(chan struct{})
		mu.Unlock()
		var wg sync.WaitGroup
		errs := make(chan error, clients)
		for range clients {
			wg.Go(func() {
				req, _ := http.NewRequest(http.MethodGet, r.srv.URL+"/", nil)
				req.Host = r.host()
				resp, err := client.Do(req)
				if err != nil {
					errs <- err
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					errs <- fmt.Errorf("status %s", resp.Status)
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	round()
	first := conns.Load()
	for range 3 {
		round()
	}
	if n := conns.Load(); n != first {
		t.Fatalf("three more rounds of %d requests opened %d upstream connections more (the first opened %d), want none", clients, n-first, first)
	}
}

// An answer followed by bytes it did not announce leaves its connection
// out of step: it is closed, never kept, and the next request is not
// answered with the stray bytes.
func TestStrayBytesAfterAnAnswerEndItsConnection(t *testing.T) {
	addr := rawApp(t, func(c net.Conn, n int) {
		br := bufio.NewReader(c)
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok-%dHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray", n)
		}
	})
	r := newEdgeRigTo(t, addr, 0)
	for i := range 3 {
		resp, body := r.get(t, r.host(), "/", nil)
		if resp.StatusCode != http.StatusOK || body != fmt.Sprintf("ok-%d", i) {
			t.Fatalf("request %d: %s %q", i, resp.Status, body)
		}
	}
}
