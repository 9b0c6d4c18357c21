package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/routes"
)

func numCPU() int { return runtime.NumCPU() }

// session is what every target of a run shares: the provider child, its
// controller connection and the benchmark's own way to the guests.
type session struct {
	cfg        benchConfig
	addr       string
	credential string
	incus      *incus.Client
	// dialer is the provider's kind of GuestDialer, for the direct path.
	dialer guest.Dialer

	ctrl *jsonrpc.Client
	// connPerOwner: measureCreates opens a controller connection per owner
	// (through a load balancer, so that the owners spread over replicas).
	connPerOwner bool
	// through says what create → active is measured through, for the report.
	through string
}

// bench measures one target of the session.
type bench struct {
	*session
	// label names the target in progress lines and the cluster report.
	label    string
	template string

	owner    controller.Owner
	targetID string
	location string // the member holding the instance; empty off a cluster
	routeURL string
	pipeAddr string
	// socatPort is the guest-namespace port of a socat byte relay to the
	// daemon (see socat.go); 0 when the run has none.
	socatPort int
}

func (s *session) header() http.Header {
	return http.Header{"Authorization": {"Bearer " + s.credential}}
}

func logf(format string, args ...any) { fmt.Fprintf(os.Stderr, "routebench: "+format+"\n", args...) }

// logf is logf naming the target when the run has several.
func (b *bench) logf(format string, args ...any) {
	if b.label != "" {
		format = b.label + ": " + format
	}
	logf(format, args...)
}

// connect opens the provider's controller plane.
func (s *session) connect(ctx context.Context) error {
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	ws, resp, err := d.DialContext(ctx, "ws://"+s.addr+"/control", s.header())
	if resp != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	s.ctrl = jsonrpc.NewClient(ws)
	var init controller.InitializeResult
	if err := s.ctrl.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: controller.ProtocolVersion,
		ClientInfo: controller.BuildInfo{Name: "routebench"}}, &init); err != nil {
		return fmt.Errorf("controller initialize: %w", err)
	}
	return nil
}

func (s *session) close() {
	if s.ctrl != nil {
		_ = s.ctrl.Close()
	}
}

// create creates the target from b.template, waits until it runs, and
// asks the provider for a plain pipe to its daemon.
func (b *bench) create(ctx context.Context) error {
	b.owner = controller.Owner{UniverseID: "u-routebench", EnvironmentID: "env-" + randomHex(4)}
	var res controller.TargetResult
	if err := b.ctrl.Call(ctx, "target/create", controller.CreateParams{Owner: b.owner, TemplateID: b.template}, &res); err != nil {
		return fmt.Errorf("target/create %s: %w", b.template, err)
	}
	o, err := b.await(ctx, controller.PowerRunning, 2*time.Minute)
	if err != nil {
		return err
	}
	b.targetID = o.TargetID
	inst, _, err := b.incus.GetInstance(ctx, b.targetID)
	if err != nil {
		return fmt.Errorf("target %s: %w", b.targetID, err)
	}
	if inst.Location != "none" {
		b.location = inst.Location
	}
	b.routeURL = "ws://" + b.addr + routes.Path(routes.DefaultPrefix, routes.Route{Owner: b.owner, TargetID: b.targetID})
	q := url.Values{"instance": {b.targetID}, "location": {b.location}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.addr+"/bench/pipe?"+q.Encode(), nil)
	req.Header = b.header()
	pipe, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	addr, _ := io.ReadAll(pipe.Body)
	_ = pipe.Body.Close()
	b.pipeAddr = string(addr)
	if b.location != "" {
		logf("target %s (%s) is running on %s", b.targetID, b.label, b.location)
	} else {
		logf("target %s is running", b.targetID)
	}
	return nil
}

// tearDown closes the target and waits until it is closed.
func (b *bench) tearDown() {
	if b.ctrl == nil || b.targetID == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for {
		var res controller.TargetResult
		err := b.ctrl.Call(ctx, "target/close", controller.TargetParams{Target: controller.TargetRef{Owner: b.owner}}, &res)
		if err == nil && res.Target.Phase == controller.PhaseClosed {
			break
		}
		if ctx.Err() != nil || errors.Is(err, jsonrpc.ErrClosed) {
			break // the project's removal deletes whatever is left
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (b *bench) get(ctx context.Context) (controller.Observation, error) {
	var res controller.TargetResult
	err := b.ctrl.Call(ctx, "target/get", controller.TargetParams{Target: controller.TargetRef{Owner: b.owner}}, &res)
	return res.Target, err
}

// await polls target/get until the target is active at power p with no
// transition under way.
func (b *bench) await(ctx context.Context, p controller.Power, most time.Duration) (controller.Observation, error) {
	deadline := time.Now().Add(most)
	for {
		o, err := b.get(ctx)
		if err == nil && o.Phase == controller.PhaseActive && o.Power == p && o.Message == "" {
			return o, nil
		}
		if time.Now().After(deadline) {
			return o, fmt.Errorf("the target did not reach %s within %s: last %+v, %w", p, most, o, err)
		}
		if !clock.Sleep(ctx, 50*time.Millisecond) {
			return o, ctx.Err()
		}
	}
}

// setPower asks for p once, as the runtime does (it never retries a
// setPower), and waits until the target is there.
func (b *bench) setPower(ctx context.Context, p controller.Power) error {
	var res controller.TargetResult
	if err := b.ctrl.Call(ctx, "target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: b.owner}, Power: p}, &res); err != nil {
		return fmt.Errorf("target/setPower %s: %w", p, err)
	}
	_, err := b.await(ctx, p, 20*time.Second)
	return err
}

// dialRoute dials the data route; it returns the connection or why not.
func (b *bench) dialRoute(ctx context.Context, bufSize int) (*websocket.Conn, time.Duration, string, error) {
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, ReadBufferSize: bufSize, WriteBufferSize: bufSize}
	start := time.Now()
	ws, resp, err := d.DialContext(ctx, b.routeURL, b.header())
	took := time.Since(start)
	if resp != nil {
		defer resp.Body.Close()
	}
	if err != nil {
		if resp != nil {
			var body bytes.Buffer
			_, _ = body.ReadFrom(resp.Body)
			return nil, took, fmt.Sprintf("HTTP %d %s Retry-After %s", resp.StatusCode, strings.TrimSpace(body.String()), resp.Header.Get("Retry-After")), nil
		}
		return nil, took, "", err
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	return ws, took, "", nil
}

// dialDirect opens the provider's own kind of connection to the daemon:
// the GuestDialer, then a WebSocket.
func (b *bench) dialDirect(ctx context.Context) (*websocket.Conn, error) {
	conn, err := b.dialer.DialContext(ctx, guest.Target{Instance: b.targetID, Port: guest.DefaultPort, Location: b.location})
	if err != nil {
		return nil, err
	}
	return wsOver(ctx, conn)
}

// dialPipe opens a WebSocket to the daemon through the provider's plain
// byte pipe (the floor of any relay).
func (b *bench) dialPipe(ctx context.Context) (*websocket.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", b.pipeAddr)
	if err != nil {
		return nil, err
	}
	return wsOver(ctx, conn)
}

// wsOver runs the WebSocket client handshake on conn.
func wsOver(ctx context.Context, conn net.Conn) (*websocket.Conn, error) {
	used := false
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, ReadBufferSize: 64 << 10, WriteBufferSize: 64 << 10,
		NetDialContext: func(context.Context, string, string) (net.Conn, error) {
			if used {
				return nil, errors.New("used")
			}
			used = true
			return conn, nil
		}}
	ws, resp, err := d.DialContext(ctx, "ws://guest/", nil)
	if resp != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	ws.SetReadLimit(jsonrpc.MaxMessageBytes)
	return ws, nil
}

// call sends one request and waits for its answer (nothing else is in
// flight on the connection).
func call(ws *websocket.Conn, id, method string, params any) (json.RawMessage, error) {
	p, _ := json.Marshal(params)
	msg := fmt.Sprintf(`{"jsonrpc":"2.0","id":%q,"method":%q,"params":%s}`, id, method, p)
	if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
		return nil, err
	}
	_, data, err := ws.ReadMessage()
	if err != nil {
		return nil, err
	}
	var resp struct {
		Result json.RawMessage `json:"result"`
		Error  *jsonrpc.Error  `json:"error"`
	}
	if err := json.Unmarshal(data, &resp); err != nil {
		return nil, err
	}
	if resp.Error != nil {
		return nil, resp.Error
	}
	return resp.Result, nil
}

func initializeData(ws *websocket.Conn) error {
	return conformance.InitializeData(ws, "routebench", 10*time.Second)
}

func closeWS(ws *websocket.Conn) {
	_ = ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
	_ = ws.SetReadDeadline(time.Now().Add(2 * time.Second))
	for {
		if _, _, err := ws.ReadMessage(); err != nil {
			break
		}
	}
	_ = ws.Close()
}

// stats are a sample's order statistics.
type stats struct {
	n        int
	p50, p95 time.Duration
	mean     time.Duration
}

func summarize(d []time.Duration) stats {
	if len(d) == 0 {
		return stats{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	var sum time.Duration
	for _, v := range s {
		sum += v
	}
	q := func(p float64) time.Duration { return s[min(len(s)-1, int(p*float64(len(s))))] }
	return stats{n: len(s), p50: q(0.5), p95: q(0.95), mean: sum / time.Duration(len(s))}
}

type wakeResult struct {
	from      controller.Power
	latencies []time.Duration
	firstOK   int
	refusals  []string
	// dials is how the provider dialled in each upgraded first dial (on a
	// cluster only).
	dials []wakeDials
	// traces are the provider's own traces of the upgraded first dials,
	// each with the latency the benchmark saw of it.
	traces []tracedWake
}

// tracedWake is a wake seen from both sides.
type tracedWake struct {
	rec     wakeRecord
	outside time.Duration
}

type throughput struct {
	label        string
	direction    string
	messageBytes int
	bps          map[string]float64 // bytes per second, by path
	msgs         map[string]int     // messages, by path
}

type memResult struct {
	relays               int
	before, after        memReport
	perRelay             float64
	goroutinesPerRelay   float64
	heapPerRelay         float64
	stackPerRelay        float64
	openedIn             time.Duration
	relaysSeenByProvider int
}

type report struct {
	header string
	// wakesOnly: the run measured the wakes alone (-only wakes).
	wakesOnly  bool
	cycles     cycleResult
	wakes      []wakeResult
	rtt        map[string]stats // by path
	throughput []throughput
	mem        memResult
}

func (b *bench) measure(ctx context.Context) (*report, error) {
	rep := &report{}
	// Warm up: the first dial proves the daemon and primes nothing else.
	ws, _, why, err := b.dialRoute(ctx, 64<<10)
	if err != nil {
		return nil, fmt.Errorf("first dial: %w", err)
	}
	if ws == nil {
		return nil, fmt.Errorf("first dial refused: %s", why)
	}
	if err := initializeData(ws); err != nil {
		return nil, err
	}
	closeWS(ws)

	if b.cfg.only == onlyWakes {
		rep.wakesOnly = true
		for _, from := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
			w, err := b.measureWakes(ctx, from)
			if err != nil {
				return nil, err
			}
			rep.wakes = append(rep.wakes, w)
		}
		return rep, nil
	}
	c, err := b.measureCycles(ctx)
	if err != nil {
		return nil, err
	}
	rep.cycles = c
	for _, from := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		w, err := b.measureWakes(ctx, from)
		if err != nil {
			return nil, err
		}
		rep.wakes = append(rep.wakes, w)
	}
	// After the last start: socat must run in the namespace of the init
	// process that serves the measurements.
	sr, err := b.startSocat(ctx, b.cfg.socat)
	if err != nil {
		return nil, err
	}
	defer sr.stop()
	if err := b.measureRTT(ctx, rep); err != nil {
		return nil, err
	}
	if err := b.measureThroughput(ctx, rep); err != nil {
		return nil, err
	}
	if err := b.measureMemory(ctx, rep); err != nil {
		return nil, err
	}
	return rep, nil
}

func (b *bench) measureWakes(ctx context.Context, from controller.Power) (wakeResult, error) {
	w := wakeResult{from: from}
	b.logf("measuring %d wakes from %s", b.cfg.wakes, from)
	for i := 0; i < b.cfg.wakes; i++ {
		if err := b.setPower(ctx, from); err != nil {
			return w, err
		}
		// Let the power-down's own work (metadata, the dialer's cache) end.
		if !clock.Sleep(ctx, 150*time.Millisecond) {
			return w, ctx.Err()
		}
		t0 := time.Now()
		ws, took, why, err := b.dialRoute(ctx, 64<<10)
		if err != nil {
			return w, err
		}
		firstUpgraded := ws != nil
		if ws != nil && b.location != "" {
			d, err := b.dialsSince(ctx, t0, took)
			if err != nil {
				return w, err
			}
			w.dials = append(w.dials, d)
		}
		if ws == nil {
			w.refusals = append(w.refusals, fmt.Sprintf("after %s: %s", took.Round(time.Millisecond), why))
			// Dial again until it upgrades, as the runtime would.
			for ws == nil {
				if !clock.Sleep(ctx, time.Second) {
					return w, ctx.Err()
				}
				if ws, _, _, err = b.dialRoute(ctx, 64<<10); err != nil {
					return w, err
				}
			}
		} else {
			w.firstOK++
			w.latencies = append(w.latencies, took)
		}
		if err := initializeData(ws); err != nil {
			return w, fmt.Errorf("through the woken relay: %w", err)
		}
		closeWS(ws)
		if firstUpgraded {
			b.traceWake(ctx, &w, t0, took)
		}
	}
	return w, nil
}

// traceWake adds the provider's trace of the wake whose first dial started
// at t0 and was upgraded after took. A missing trace is said, not fatal:
// the outside figures stand without it.
func (b *bench) traceWake(ctx context.Context, w *wakeResult, t0 time.Time, took time.Duration) {
	rec, err := b.wakeSince(ctx, t0)
	if err != nil {
		b.logf("no breakdown of this wake: %v", err)
		return
	}
	w.traces = append(w.traces, tracedWake{rec: rec, outside: took})
}

// cycleResult is the pause → wake → pause-again measure: each cycle's
// single dial wakes the paused target, the client closes, and one setPower
// asks for paused again at once, the sequence that lost the power-down
// before power was level-triggered.
type cycleResult struct {
	asked     int
	completed int
	wakes     []time.Duration
	failures  []string
}

func (b *bench) measureCycles(ctx context.Context) (cycleResult, error) {
	c := cycleResult{asked: b.cfg.wakes}
	b.logf("measuring %d pause → wake → pause cycles", c.asked)
	if err := b.setPower(ctx, controller.PowerPaused); err != nil {
		return c, err
	}
	for i := 0; i < c.asked; i++ {
		ws, took, why, err := b.dialRoute(ctx, 64<<10)
		if err != nil {
			return c, err
		}
		if ws == nil {
			c.failures = append(c.failures, fmt.Sprintf("cycle %d: the waking dial was refused after %s: %s", i+1, took.Round(time.Millisecond), why))
			break
		}
		c.wakes = append(c.wakes, took)
		if err := initializeData(ws); err != nil {
			return c, fmt.Errorf("through the woken relay: %w", err)
		}
		closeWS(ws)
		if err := b.setPower(ctx, controller.PowerPaused); err != nil {
			c.failures = append(c.failures, fmt.Sprintf("cycle %d: %v", i+1, err))
			break
		}
		c.completed++
	}
	return c, nil
}

// rttMessage is an env/getIdle request of exactly 64 bytes.
func rttMessage(i int) []byte {
	m := fmt.Sprintf(`{"jsonrpc":"2.0","id":"%016d","method":"env/getIdle"}`, i)
	if len(m) != 64 {
		panic("rtt message is " + strconv.Itoa(len(m)) + " bytes")
	}
	return []byte(m)
}

func roundTrips(ws *websocket.Conn, n, base int, out *[]time.Duration) error {
	for i := 0; i < n; i++ {
		msg := rttMessage(base + i)
		start := time.Now()
		if err := ws.WriteMessage(websocket.TextMessage, msg); err != nil {
			return err
		}
		_, data, err := ws.ReadMessage()
		if err != nil {
			return err
		}
		*out = append(*out, time.Since(start))
		if !bytes.Contains(data, []byte(`"result"`)) {
			return fmt.Errorf("env/getIdle answered %s", data)
		}
	}
	return nil
}

// The paths to the daemon each measurement compares; socat only where the
// run has one (not on a cluster's remote member).
const (
	pathDirect  = "direct"
	pathRelayed = "relayed"
	pathPipe    = "pipe"
	pathSocat   = "socat"
)

var pathNames = []string{pathDirect, pathRelayed, pathPipe, pathSocat}

// lane is one path to one target's daemon; a measurement interleaves
// every lane of every target it compares.
type lane struct {
	idx  int // in the list of lanes
	b    *bench
	rep  *report
	path string
	ws   *websocket.Conn
}

// rotated is the lanes' order in round i: each lane goes first, second and
// last equally often, so that whatever one lane leaves behind (the
// daemon's garbage collection, say) does not always fall on the same next
// one. With one target the lanes are its paths in pathNames order.
func rotated(lanes []lane, i int) []lane {
	n := len(lanes)
	out := make([]lane, n)
	for j := range out {
		out[j] = lanes[(i+j)%n]
	}
	return out
}

// openPaths opens and initializes one connection per path.
func (b *bench) openPaths(ctx context.Context) (map[string]*websocket.Conn, func(), error) {
	conns := map[string]*websocket.Conn{}
	closeAll := func() {
		for _, ws := range conns {
			closeWS(ws)
		}
	}
	direct, err := b.dialDirect(ctx)
	if err != nil {
		return nil, nil, err
	}
	conns[pathDirect] = direct
	relayed, _, why, err := b.dialRoute(ctx, 64<<10)
	if err == nil && relayed == nil {
		err = fmt.Errorf("refused: %s", why)
	}
	if err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("route: %w", err)
	}
	conns[pathRelayed] = relayed
	pipe, err := b.dialPipe(ctx)
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	conns[pathPipe] = pipe
	if b.socatPort != 0 {
		sc, err := b.dialSocat(ctx)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		conns[pathSocat] = sc
	}
	for _, ws := range conns {
		if err := initializeData(ws); err != nil {
			closeAll()
			return nil, nil, err
		}
	}
	return conns, closeAll, nil
}

// openLanes opens every path of every target, bs[i]'s results going to
// reps[i].
func openLanes(ctx context.Context, bs []*bench, reps []*report) ([]lane, func(), error) {
	var lanes []lane
	var closers []func()
	closeAll := func() {
		for _, c := range closers {
			c()
		}
	}
	for i, b := range bs {
		conns, c, err := b.openPaths(ctx)
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("%s: %w", b.label, err)
		}
		closers = append(closers, c)
		for _, p := range pathNames {
			if ws, ok := conns[p]; ok {
				lanes = append(lanes, lane{idx: len(lanes), b: b, rep: reps[i], path: p, ws: ws})
			}
		}
	}
	return lanes, closeAll, nil
}

func (b *bench) measureRTT(ctx context.Context, rep *report) error {
	return measureRTT(ctx, []*bench{b}, []*report{rep})
}

// measureRTT measures round trips on every path of every target, in
// interleaved blocks.
func measureRTT(ctx context.Context, bs []*bench, reps []*report) error {
	cfg := bs[0].cfg
	logf("measuring %d round trips on each path of %d target(s)", cfg.rtt, len(bs))
	lanes, closeAll, err := openLanes(ctx, bs, reps)
	if err != nil {
		return err
	}
	defer closeAll()
	for _, l := range lanes {
		var warm []time.Duration
		if err := roundTrips(l.ws, 200, 0, &warm); err != nil {
			return err
		}
	}
	// Interleaved blocks, so that drift affects every lane alike; a
	// multiple of the lanes, so that each goes first equally often.
	samples := make([][]time.Duration, len(lanes))
	blocks := 4 * len(lanes)
	per := max(1, (cfg.rtt+blocks-1)/blocks)
	for i := 0; i < blocks; i++ {
		for _, l := range rotated(lanes, i) {
			if err := roundTrips(l.ws, per, i*per, &samples[l.idx]); err != nil {
				return fmt.Errorf("%s, %s: %w", l.b.label, l.path, err)
			}
		}
	}
	for _, rep := range reps {
		rep.rtt = map[string]stats{}
	}
	for _, l := range lanes {
		l.rep.rtt[l.path] = summarize(samples[l.idx])
	}
	return nil
}

func (b *bench) measureThroughput(ctx context.Context, rep *report) error {
	return measureThroughput(ctx, []*bench{b}, []*report{rep})
}

// measureThroughput measures downloads and uploads of 64 KiB and 1 MiB
// messages on every path of every target, in interleaved slices.
func measureThroughput(ctx context.Context, bs []*bench, reps []*report) error {
	cfg := bs[0].cfg
	lanes, closeAll, err := openLanes(ctx, bs, reps)
	if err != nil {
		return err
	}
	defer closeAll()
	// Calibrate the answer's overhead with a small file, on each guest.
	probe := "/tmp/routebench-probe"
	overhead := 0
	for _, l := range lanes {
		if l.path != pathDirect {
			continue
		}
		if _, err := call(l.ws, "w0", "fs/writeFile", map[string]any{"path": probe, "data": base64.StdEncoding.EncodeToString(make([]byte, 3000))}); err != nil {
			return fmt.Errorf("%s: fs/writeFile: %w", l.b.label, err)
		}
		ans, err := rawCall(l.ws, "r0", "fs/readFile", map[string]any{"path": probe, "maxBytes": 3000})
		if err != nil {
			return err
		}
		overhead = len(ans) - 4000 // base64 of 3000 bytes is 4000; the same daemon everywhere
	}
	for _, size := range []int{64 << 10, 1 << 20} {
		label := sizeLabel(size)
		raw := (size - overhead) / 4 * 3 // base64 length = 4/3 raw
		path := fmt.Sprintf("/tmp/routebench-%d", size)
		data := make([]byte, raw)
		_, _ = rand.Read(data)
		for _, l := range lanes {
			if l.path != pathDirect {
				continue
			}
			if _, err := call(l.ws, "w"+label, "fs/writeFile", map[string]any{"path": path, "data": base64.StdEncoding.EncodeToString(data)}); err != nil {
				return fmt.Errorf("%s: fs/writeFile %s: %w", l.b.label, label, err)
			}
		}
		logf("measuring %s downloads and uploads, %s per path of %d target(s)", label, cfg.seconds, len(bs))
		down := make(map[*report]*throughput, len(reps))
		up := make(map[*report]*throughput, len(reps))
		req := make(map[*report]*throughput, len(reps))
		for _, rep := range reps {
			req[rep] = &throughput{label: label, direction: "requests", messageBytes: size, bps: map[string]float64{}, msgs: map[string]int{}}
			down[rep] = &throughput{label: label, direction: "download", bps: map[string]float64{}, msgs: map[string]int{}}
			up[rep] = &throughput{label: label, direction: "upload", messageBytes: size, bps: map[string]float64{}, msgs: map[string]int{}}
		}
		// A multiple of the lanes: each goes first equally often.
		rounds := 3 * len(lanes)
		slice := cfg.seconds / time.Duration(rounds)
		for i := 0; i < rounds; i++ {
			for _, l := range rotated(lanes, i) {
				n, msgBytes, bps, err := download(l.ws, path, raw, slice)
				if err != nil {
					return fmt.Errorf("%s, %s: %w", l.b.label, l.path, err)
				}
				d := down[l.rep]
				d.messageBytes = msgBytes
				d.bps[l.path] += bps / float64(rounds)
				d.msgs[l.path] += n
				un, ubps, err := upload(l.ws, size, slice)
				if err != nil {
					return fmt.Errorf("%s, %s: %w", l.b.label, l.path, err)
				}
				u := up[l.rep]
				u.bps[l.path] += ubps / float64(rounds)
				u.msgs[l.path] += un
				rn, rbps, err := requests(l.ws, size, slice)
				if err != nil {
					return fmt.Errorf("%s, %s: %w", l.b.label, l.path, err)
				}
				q := req[l.rep]
				q.bps[l.path] += rbps / float64(rounds)
				q.msgs[l.path] += rn
			}
		}
		for _, rep := range reps {
			rep.throughput = append(rep.throughput, *down[rep], *up[rep], *req[rep])
		}
	}
	return nil
}

func sizeLabel(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}

// rawCall is call that returns the whole answer message.
func rawCall(ws *websocket.Conn, id, method string, params any) ([]byte, error) {
	p, _ := json.Marshal(params)
	msg := fmt.Sprintf(`{"jsonrpc":"2.0","id":%q,"method":%q,"params":%s}`, id, method, p)
	if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
		return nil, err
	}
	_, data, err := ws.ReadMessage()
	return data, err
}

// download keeps four fs/readFile requests in flight for d and reports
// the answers, their size and the bytes per second they arrived at.
func download(ws *websocket.Conn, path string, raw int, d time.Duration) (int, int, float64, error) {
	const depth = 4
	req := []byte(fmt.Sprintf(`{"jsonrpc":"2.0","id":1,"method":"fs/readFile","params":{"path":%q,"maxBytes":%d}}`, path, raw))
	for i := 0; i < depth; i++ {
		if err := ws.WriteMessage(websocket.TextMessage, req); err != nil {
			return 0, 0, 0, err
		}
	}
	start := time.Now()
	var total, n, size int
	sent := depth
	for sent > n {
		_, data, err := ws.ReadMessage()
		if err != nil {
			return 0, 0, 0, err
		}
		if n == 0 && !bytes.Contains(data, []byte(`"result"`)) {
			return 0, 0, 0, fmt.Errorf("fs/readFile answered %.200s", data)
		}
		n++
		total += len(data)
		size = len(data)
		if time.Since(start) < d {
			if err := ws.WriteMessage(websocket.TextMessage, req); err != nil {
				return 0, 0, 0, err
			}
			sent++
		}
	}
	return n, size, float64(total) / time.Since(start).Seconds(), nil
}

// discardMessage is a routebench/discard message of exactly size bytes,
// a request (which the daemon answers with an error: no such method) or a
// notification (read and dropped).
func discardMessage(size int, request bool) []byte {
	head := `{"jsonrpc":"2.0","method":"routebench/discard","params":{"data":"`
	if request {
		head = `{"jsonrpc":"2.0","id":7,"method":"routebench/discard","params":{"data":"`
	}
	const tail = `"}}`
	msg := make([]byte, size)
	copy(msg, head)
	for i := len(head); i < size-len(tail); i++ {
		msg[i] = 'a'
	}
	copy(msg[size-len(tail):], tail)
	return msg
}

// requests sends requests of exactly size bytes one at a time for d, each
// answered by the daemon (an error: no such method) before the next goes:
// the shape of an agent writing one large file after another, where every
// hop's latency adds to each message's.
func requests(ws *websocket.Conn, size int, d time.Duration) (int, float64, error) {
	msg := discardMessage(size, true)
	start := time.Now()
	n := 0
	for n == 0 || time.Since(start) < d {
		if err := ws.WriteMessage(websocket.TextMessage, msg); err != nil {
			return 0, 0, err
		}
		_, data, err := ws.ReadMessage()
		if err != nil {
			return 0, 0, err
		}
		if !bytes.Contains(data, []byte(`"error"`)) {
			return 0, 0, fmt.Errorf("routebench/discard answered %.200s", data)
		}
		n++
	}
	return n, float64(n*size) / time.Since(start).Seconds(), nil
}

// upload sends notifications of exactly size bytes (the daemon reads and
// drops them: no such notification method) for d, then one request whose
// answer proves they were all read.
func upload(ws *websocket.Conn, size int, d time.Duration) (int, float64, error) {
	msg := discardMessage(size, false)
	start := time.Now()
	n := 0
	for time.Since(start) < d {
		if err := ws.WriteMessage(websocket.TextMessage, msg); err != nil {
			return 0, 0, err
		}
		n++
	}
	if err := ws.WriteMessage(websocket.TextMessage, rttMessage(0)); err != nil {
		return 0, 0, err
	}
	if _, _, err := ws.ReadMessage(); err != nil {
		return 0, 0, err
	}
	return n, float64(n*size) / time.Since(start).Seconds(), nil
}

func (b *bench) mem(ctx context.Context) (memReport, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.addr+"/bench/mem", nil)
	req.Header = b.header()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return memReport{}, err
	}
	defer resp.Body.Close()
	var m memReport
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		return memReport{}, err
	}
	return m, nil
}

func (b *bench) measureMemory(ctx context.Context, rep *report) error {
	n := b.cfg.idleRelays
	b.logf("opening %d idle relays", n)
	// Let the relays of the measurements above end.
	for i := 0; i < 50; i++ {
		m, err := b.mem(ctx)
		if err != nil {
			return err
		}
		if m.Relays == 0 {
			break
		}
		clock.Sleep(ctx, 100*time.Millisecond)
	}
	before, err := b.mem(ctx)
	if err != nil {
		return err
	}
	conns := make([]*websocket.Conn, n)
	start := time.Now()
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	next := make(chan int)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				ws, _, why, err := b.dialRoute(ctx, 1024)
				if err == nil && ws == nil {
					err = errors.New(why)
				}
				if err == nil {
					err = initializeData(ws)
				}
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				conns[i] = ws
				mu.Unlock()
			}
		}()
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	opened := time.Since(start)
	defer func() {
		for _, ws := range conns {
			if ws != nil {
				ws.Close()
			}
		}
	}()
	if firstErr != nil {
		return fmt.Errorf("opening idle relays: %w", firstErr)
	}
	clock.Sleep(ctx, 2*time.Second)
	after, err := b.mem(ctx)
	if err != nil {
		return err
	}
	rep.mem = memResult{relays: n, before: before, after: after, openedIn: opened, relaysSeenByProvider: after.Relays,
		perRelay:           float64(int64(after.RSSBytes)-int64(before.RSSBytes)) / float64(n),
		heapPerRelay:       float64(int64(after.HeapInuseBytes)-int64(before.HeapInuseBytes)) / float64(n),
		stackPerRelay:      float64(int64(after.StackBytes)-int64(before.StackBytes)) / float64(n),
		goroutinesPerRelay: float64(after.Goroutines-before.Goroutines) / float64(n)}
	return nil
}
