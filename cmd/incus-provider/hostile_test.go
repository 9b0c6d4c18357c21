package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// These tests run the shipped binary, built here without the race detector
// (whose shadow memory would swamp what they measure), against the real
// Incus in a throwaway project, and attack it the way issue 12 did: only
// on loopback, with every loop bounded in count and time.

// child is a provider process under test.
type child struct {
	cmd        *exec.Cmd
	control    string // ws://127.0.0.1:port/control
	listen     string // 127.0.0.1:port
	metrics    string // http://127.0.0.1:port/metrics
	credential string
	credFile   string   // where credential is, for a test that rotates it
	env        []string // the settings it was started with
	log        *bytes.Buffer
	logMu      *sync.Mutex
	exited     chan struct{} // closed once Wait has returned
}

// startProvider builds cmd/incus-provider and starts it with the given
// settings on free loopback ports, in a fresh Incus project, with a
// credential; it returns once the provider says it serves.
func startProvider(t *testing.T, env ...string) *child {
	t.Helper()
	client := incustest.Client(t)
	incustest.Image(t)
	dir := t.TempDir()
	bin := providerBinary(t)
	credFile := filepath.Join(dir, "credential")
	const secret = "hostile-test-credential-0123456789"
	if err := os.WriteFile(credFile, []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	templates, err := filepath.Abs("../../deploy/templates.dev.yaml")
	if err != nil {
		t.Fatal(err)
	}
	listen, metrics := freePort(t), freePort(t)
	cmd := exec.Command(bin)
	cmd.Env = append([]string{
		"PATH=" + os.Getenv("PATH"),
		"PROVIDER_LISTEN=" + listen,
		"PROVIDER_METRICS_LISTEN=" + metrics,
		"PROVIDER_INGRESS_LISTEN=off",
		"PROVIDER_TEMPLATES=" + templates,
		"PROVIDER_CREDENTIAL_FILE=" + credFile,
		"PROVIDER_GRACEFUL_STOP=5s",
		"PROVIDER_LOG_LEVEL=info",
		"INCUS_SOCKET=" + incustest.Socket(),
		"INCUS_PROJECT=" + client.Project(),
	}, env...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, control: "ws://" + listen + "/control", listen: listen,
		metrics: "http://" + metrics + "/metrics", credential: secret, credFile: credFile, env: cmd.Env, log: &bytes.Buffer{}, logMu: &sync.Mutex{}}
	cmd.Stderr = lockedWriter{c.logMu, c.log}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	c.exited = exited
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("provider log (tail):\n%s", c.logTail(40))
		}
	})
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		found := false
		for sc.Scan() {
			if !found && strings.HasPrefix(sc.Text(), "controller URL:") {
				found = true
				ready <- nil
			}
		}
		if !found {
			ready <- fmt.Errorf("the provider exited before it served")
		}
		_ = cmd.Wait()
		close(exited)
	}()
	select {
	case err := <-ready:
		if err != nil {
			<-exited
			t.Fatalf("%v: %s\n%s", err, cmd.ProcessState, c.logTail(20))
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("the provider did not serve within 60 s:\n%s", c.logTail(20))
	}
	return c
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (c *child) logTail(lines int) string {
	c.logMu.Lock()
	defer c.logMu.Unlock()
	all := strings.Split(strings.TrimRight(c.log.String(), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// alive reads the exit through the channel the waiting goroutine closes,
// not ProcessState, which that goroutine writes.
func (c *child) alive() bool {
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}

// status reads one kB field (VmHWM, VmRSS) of the child's /proc status.
func (c *child) status(t *testing.T, field string) uint64 {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("read the provider's status: %v", err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("%s: %q", field, line)
			}
			return kb << 10
		}
	}
	t.Fatalf("no %s in the provider's status", field)
	return 0
}

// metric scrapes one sample (name with its labels as exposed, such as
// `incus_provider_x{reason="y"}`) from the child's /metrics; -1 when absent.
func (c *child) metric(t *testing.T, sample string) float64 {
	t.Helper()
	for _, line := range c.scrapeLines(t) {
		if rest, ok := strings.CutPrefix(line, sample+" "); ok {
			v, err := strconv.ParseFloat(rest, 64)
			if err != nil {
				t.Fatalf("sample %s: %q", sample, rest)
			}
			return v
		}
	}
	return -1
}

// scrapeLines reads the child's /metrics, a line each.
func (c *child) scrapeLines(t *testing.T) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.metrics, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	var lines []string
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("scrape: %v", err)
	}
	return lines
}

func freePort(t *testing.T) string {
	t.Helper()
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// rpcConn is an authenticated controller connection.
type rpcConn struct {
	ws *websocket.Conn
}

func (c *child) dial(t *testing.T) *rpcConn {
	t.Helper()
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, ReadBufferSize: 64 << 10, WriteBufferSize: 64 << 10}
	h := http.Header{"Authorization": {"Bearer " + c.credential}}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	ws, resp, err := d.DialContext(ctx, c.control, h)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		t.Fatalf("dial the controller: %v", err)
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	t.Cleanup(func() { _ = ws.Close() })
	return &rpcConn{ws: ws}
}

type rpcAnswer struct {
	ID     json.RawMessage `json:"id"`
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Code int `json:"code"`
		Data struct {
			Kind         string  `json:"kind"`
			Reason       string  `json:"reason"`
			RetryAfterMs *uint64 `json:"retryAfterMs"`
		} `json:"data"`
		Message string `json:"message"`
	} `json:"error"`
}

// call sends one frame and reads one answer within d.
func (r *rpcConn) call(frame []byte, d time.Duration) (rpcAnswer, error) {
	var a rpcAnswer
	_ = r.ws.SetWriteDeadline(time.Now().Add(d))
	if err := r.ws.WriteMessage(websocket.TextMessage, frame); err != nil {
		return a, fmt.Errorf("write: %w", err)
	}
	_ = r.ws.SetReadDeadline(time.Now().Add(d))
	_, data, err := r.ws.ReadMessage()
	if err != nil {
		return a, fmt.Errorf("read: %w", err)
	}
	if err := json.Unmarshal(data, &a); err != nil {
		return a, fmt.Errorf("answer %.200q: %w", data, err)
	}
	return a, nil
}

func (r *rpcConn) initialize(t *testing.T) {
	t.Helper()
	a, err := r.call([]byte(`{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":4,"clientInfo":{"name":"hostile-test"}}}`), 15*time.Second)
	if err != nil || a.Error != nil {
		t.Fatalf("initialize: %v %+v", err, a.Error)
	}
}

// manyMembers is `{"a0":0,"a1":0,…}` with n members.
func manyMembers(n int) []byte {
	var b bytes.Buffer
	b.Grow(n * 13)
	b.WriteByte('{')
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"a`)
		b.WriteString(strconv.Itoa(i))
		b.WriteString(`":0`)
	}
	b.WriteByte('}')
	return b.Bytes()
}

// TestManyMemberFramesStayWithinMemory is issue 12 item 4: eight frames of
// 15 MiB, each a params object of 1.3 million members, sent at once on
// eight authenticated connections. Every one must be answered with a typed
// error, the provider must live, and its peak resident set must stay
// within 512 MiB (it reached 2.92 GB).
func TestManyMemberFramesStayWithinMemory(t *testing.T) {
	c := startProvider(t)
	const conns, members = 8, 1_300_000
	params := manyMembers(members)
	frame := append([]byte(`{"jsonrpc":"2.0","id":1,"method":"target/get","params":`), params...)
	frame = append(frame, '}')
	if len(frame) > jsonrpc.MaxMessageBytes || len(frame) < 15<<20 {
		t.Fatalf("the frame is %d bytes; the attack is 15 MiB to 16 MiB", len(frame))
	}
	base := c.status(t, "VmRSS")
	// Further shapes of the same attack: the members one level down, at
	// the envelope's own level, in an initialize's params.
	nested := append([]byte(`{"jsonrpc":"2.0","id":1,"method":"target/get","params":{"target":`), params...)
	nested = append(nested, "}}"...)
	envelope := append([]byte(`{"jsonrpc":"2.0","id":1,"method":"target/get",`), params[1:]...)
	initialize := append([]byte(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":`), params...)
	initialize = append(initialize, '}')

	rounds := []struct {
		name   string
		frames [][]byte
		init   bool
	}{
		{"params members", [][]byte{frame}, true},
		{"nested, envelope and initialize members", [][]byte{nested, envelope, initialize}, false},
	}
	for _, round := range rounds {
		rcs := make([]*rpcConn, conns)
		for i := range rcs {
			rcs[i] = c.dial(t)
			f := round.frames[i%len(round.frames)]
			if round.init || !bytes.Contains(f[:60], []byte(`"initialize"`)) {
				rcs[i].initialize(t)
			}
		}
		kinds := map[string]int{}
		var mu sync.Mutex
		var wg sync.WaitGroup
		start := time.Now()
		for i, rc := range rcs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a, err := rc.call(round.frames[i%len(round.frames)], 2*time.Minute)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
					t.Errorf("%s: connection %d: no answer: %v", round.name, i, err)
				case a.Error == nil || a.Error.Data.Kind == "" || string(a.ID) != "1":
					t.Errorf("%s: connection %d: want a typed error for id 1, got %+v", round.name, i, a)
				default:
					kinds[a.Error.Data.Kind+"/"+a.Error.Data.Reason]++
				}
			}()
		}
		wg.Wait()
		t.Logf("%s: %d frames of %d bytes answered in %s: %v; peak resident set so far %d MiB", round.name, conns,
			len(round.frames[0]), time.Since(start).Round(time.Millisecond), kinds, c.status(t, "VmHWM")>>20)
	}
	if !c.alive() {
		t.Fatal("the provider died")
	}
	peak := c.status(t, "VmHWM")
	t.Logf("provider resident set: %d MiB at rest after start-up, peak %d MiB, now %d MiB", base>>20, peak>>20, c.status(t, "VmRSS")>>20)
	inuse := c.metric(t, "go_memstats_heap_inuse_bytes")
	time.Sleep(5 * time.Second)
	t.Logf("heap in use: %.0f MiB just after, %.0f MiB 5 s later; decode budget refusals %v",
		inuse/(1<<20), c.metric(t, "go_memstats_heap_inuse_bytes")/(1<<20), c.metric(t, `incus_provider_controller_refused_total{reason="decodeBudget"}`))
	// Served as before, on a fresh connection.
	rc := c.dial(t)
	rc.initialize(t)
	if a, err := rc.call([]byte(`{"jsonrpc":"2.0","id":2,"method":"template/list","params":{"universeId":"u1"}}`), 15*time.Second); err != nil || a.Error != nil {
		t.Fatalf("template/list after the attack: %v %+v", err, a.Error)
	}
	if peak > 512<<20 {
		t.Fatalf("peak resident set %d MiB, over 512 MiB", peak>>20)
	}
	runtime.KeepAlive(frame)
}

// raiseFileLimit lifts the test process's open-file limit to at least n.
func raiseFileLimit(t *testing.T, n uint64) {
	t.Helper()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur >= n {
		return
	}
	lim.Cur = min(n, lim.Max)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Cur < n {
		t.Skipf("cannot raise the open-file limit to %d (hard limit %d): %v", n, lim.Max, err)
	}
}

// settled polls the child's goroutines and open files until both are
// within slack of base, for at most d; it returns the last values.
func (c *child) settled(t *testing.T, baseG, baseF, slack float64, d time.Duration) (float64, float64) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		g, f := c.metric(t, "go_goroutines"), c.metric(t, "process_open_fds")
		if g <= baseG+slack && f <= baseF+slack || time.Now().After(deadline) {
			return g, f
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// TestStalledConnectionsAreCut is issue 12 item 5: 2,000 connections
// without a credential send complete headers announcing a body
// (Content-Length: 100) and never send it, to the data routes and to
// /control; 100 more stop half-way through their headers. Each must be cut
// within 15 s (they were held for as long as anyone cared to wait), while
// an authenticated client is served throughout, and the provider's
// goroutines and open files must come back to where they were.
func TestStalledConnectionsAreCut(t *testing.T) {
	const stalled, halfHeaders, bound = 2000, 100, 15 * time.Second
	raiseFileLimit(t, 3*stalled)
	c := startProvider(t)

	rc := c.dial(t)
	rc.initialize(t)
	time.Sleep(500 * time.Millisecond)
	baseG, baseF := c.metric(t, "go_goroutines"), c.metric(t, "process_open_fds")

	// The authenticated client, throughout: a template/list on its open
	// connection and a new connection's initialize, every 250 ms.
	stop := make(chan struct{})
	served := make(chan error, 1)
	var slowest time.Duration
	go func() {
		var err error
		defer func() { served <- err }()
		for i := 0; i < 400; i++ { // 100 s at most
			select {
			case <-stop:
				return
			case <-time.After(250 * time.Millisecond):
			}
			begun := time.Now()
			a, cerr := rc.call([]byte(`{"jsonrpc":"2.0","id":"l`+strconv.Itoa(i)+`","method":"template/list","params":{"universeId":"u1"}}`), 5*time.Second)
			if cerr != nil || a.Error != nil {
				err = fmt.Errorf("template/list %d: %w %+v", i, cerr, a.Error)
				return
			}
			fresh := websocket.Dialer{HandshakeTimeout: 5 * time.Second}
			ws, resp, derr := fresh.Dial(c.control, http.Header{"Authorization": {"Bearer " + c.credential}})
			if resp != nil && resp.Body != nil {
				resp.Body.Close()
			}
			if derr != nil {
				err = fmt.Errorf("a new controller connection %d: %w", i, derr)
				return
			}
			init := &rpcConn{ws: ws}
			a, cerr = init.call([]byte(`{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":4,"clientInfo":{"name":"hostile-test"}}}`), 5*time.Second)
			_ = ws.Close()
			if cerr != nil || a.Error != nil {
				err = fmt.Errorf("initialize %d: %w %+v", i, cerr, a.Error)
				return
			}
			slowest = max(slowest, time.Since(begun))
		}
	}()

	type stall struct {
		conn net.Conn
		sent time.Time
		cut  time.Duration // -1: still open at the end of the wait
	}
	stalls := make([]*stall, stalled+halfHeaders)
	dialer := net.Dialer{Timeout: 10 * time.Second}
	var wg sync.WaitGroup
	work := make(chan int)
	var dialErrs sync.Map
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				conn, err := dialer.DialContext(context.Background(), "tcp", c.listen)
				if err != nil {
					dialErrs.Store(i, err)
					continue
				}
				path := "/routes/u1/e1/ls-00000000000000000000"
				if i%2 == 1 {
					path = "/control"
				}
				head := "GET " + path + " HTTP/1.1\r\nHost: " + c.listen + "\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n" +
					"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nContent-Length: 100\r\n\r\n"
				if i >= stalled {
					head = "GET " + path + " HTTP/1.1\r\nHost: " + c.listen + "\r\nUpgrade: webs"
				}
				if _, err := io.WriteString(conn, head); err != nil {
					dialErrs.Store(i, err)
					_ = conn.Close()
					continue
				}
				stalls[i] = &stall{conn: conn, sent: time.Now(), cut: -1}
			}
		}()
	}
	begun := time.Now()
	for i := range stalls {
		work <- i
	}
	close(work)
	wg.Wait()
	dialErrs.Range(func(k, v any) bool { t.Errorf("stalled connection %v: %v", k, v); return true })
	t.Logf("%d stalled connections opened in %s", len(stalls), time.Since(begun).Round(time.Millisecond))
	peakG, peakF := c.metric(t, "go_goroutines"), c.metric(t, "process_open_fds")

	// Wait for each to be cut: read until the provider closes it, for at
	// most bound and 5 s more from when its headers went out.
	for _, s := range stalls {
		if s == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer s.conn.Close()
			_ = s.conn.SetReadDeadline(s.sent.Add(bound + 5*time.Second))
			_, err := io.Copy(io.Discard, s.conn)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return
			}
			s.cut = time.Since(s.sent)
		}()
	}
	wg.Wait()
	close(stop)
	if err := <-served; err != nil {
		t.Errorf("the authenticated client was not served throughout: %v", err)
	}
	var cutStalled, cutHalf []time.Duration
	held := 0
	for i, s := range stalls {
		switch {
		case s == nil:
		case s.cut < 0:
			held++
		case i < stalled:
			cutStalled = append(cutStalled, s.cut)
		default:
			cutHalf = append(cutHalf, s.cut)
		}
	}
	slices.Sort(cutStalled)
	slices.Sort(cutHalf)
	quantile := func(d []time.Duration, q float64) time.Duration {
		if len(d) == 0 {
			return 0
		}
		return d[int(q*float64(len(d)-1))].Round(time.Millisecond)
	}
	t.Logf("body never sent: %d cut, median after %s, slowest %s; headers half sent: %d cut, median %s, slowest %s; %d still held after %s",
		len(cutStalled), quantile(cutStalled, 0.5), quantile(cutStalled, 1), len(cutHalf), quantile(cutHalf, 0.5), quantile(cutHalf, 1),
		held, bound+5*time.Second)
	t.Logf("authenticated client: slowest template/list plus new initialize %s", slowest.Round(time.Millisecond))
	g, f := c.settled(t, baseG, baseF, 10, 20*time.Second)
	t.Logf("provider goroutines %v at rest, %v with the stalls open, %v after; open files %v, %v, %v", baseG, peakG, g, baseF, peakF, f)
	if held > 0 || quantile(cutStalled, 1) > bound || quantile(cutHalf, 1) > bound {
		t.Errorf("stalled connections must each be cut within %s", bound)
	}
	if slowest > 2*time.Second {
		t.Errorf("the authenticated client waited %s", slowest)
	}
	if g > baseG+10 || f > baseF+10 {
		t.Errorf("goroutines %v and open files %v did not come back to %v and %v", g, f, baseG, baseF)
	}
	if n := c.metric(t, `incus_provider_listener_refused_total{reason="requestBody"}`); n != stalled {
		t.Errorf("requestBody refusals counted: %v, want %d", n, stalled)
	}
	if !c.alive() {
		t.Fatal("the provider died")
	}
}
