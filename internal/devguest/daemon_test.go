package devguest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

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

// serve runs a daemon on a loopback httptest server and returns its ws URL.
func serve(t *testing.T, cfg Config) (*Daemon, string) {
	t.Helper()
	return serveWith(t, cfg, nil)
}

// serveWith is serve, with prepare (if set) run on the daemon before it
// serves.
func serveWith(t *testing.T, cfg Config, prepare func(*Daemon)) (*Daemon, string) {
	t.Helper()
	if cfg.Cwd == "" {
		cfg.Cwd = t.TempDir()
	}
	d, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if prepare != nil {
		prepare(d)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = d.Shutdown(ctx)
		srv.Close()
	})
	return d, "ws" + strings.TrimPrefix(srv.URL, "http") + "/"
}

func dial(t *testing.T, url string) *jsonrpc.Client {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(url, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := jsonrpc.NewClient(ws)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

var testClient = map[string]any{"name": "devguest-test", "version": "1"}

func initialized(t *testing.T, url string) *jsonrpc.Client {
	t.Helper()
	c := dial(t, url)
	var res InitializeResult
	if err := c.Call(ctx(t), "initialize", map[string]any{"protocolVersion": 5, "clientInfo": testClient}, &res); err != nil {
		t.Fatal(err)
	}
	return c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

// rpcError asserts err is a protocol error of kind and returns it.
func rpcError(t *testing.T, err error, kind jsonrpc.Kind) *jsonrpc.Error {
	t.Helper()
	var e *jsonrpc.Error
	if !errors.As(err, &e) {
		t.Fatalf("want a %s error, got %v", kind, err)
	}
	if e.Kind != kind {
		t.Fatalf("want kind %s, got %s: %s", kind, e.Kind, e.Message)
	}
	return e
}

func TestHandshakeRules(t *testing.T) {
	d, url := serve(t, Config{})
	c := dial(t, url)

	err := c.Call(ctx(t), "env/getIdle", nil, nil)
	rpcError(t, err, jsonrpc.KindNotInitialized)

	err = c.Call(ctx(t), "initialize", map[string]any{"protocolVersion": 4, "clientInfo": testClient}, nil)
	e := rpcError(t, err, jsonrpc.KindVersionMismatch)
	if e.Expected == nil || *e.Expected != 5 || e.Received == nil || *e.Received != 4 {
		t.Fatalf("versionMismatch fields: expected %v received %v", e.Expected, e.Received)
	}
	err = c.Call(ctx(t), "initialize", map[string]any{"clientInfo": testClient}, nil)
	if e := rpcError(t, err, jsonrpc.KindInvalidParams); e.Field != "protocolVersion" {
		t.Fatalf("field %q", e.Field)
	}

	for _, tc := range []struct {
		params map[string]any
		field  string
	}{
		{map[string]any{"protocolVersion": 5}, "clientInfo"},
		{map[string]any{"protocolVersion": 5, "clientInfo": map[string]any{"name": ""}}, "clientInfo.name"},
		{map[string]any{"protocolVersion": 5, "clientInfo": map[string]any{"name": "x", "colour": "red"}}, "clientInfo.colour"},
		{map[string]any{"protocolVersion": 5, "clientInfo": map[string]any{"name": "x", "version": nil}}, "clientInfo.version"},
		{map[string]any{"protocolVersion": 5, "clientInfo": testClient, "extra": 1}, "extra"},
	} {
		err := c.Call(ctx(t), "initialize", tc.params, nil)
		if e := rpcError(t, err, jsonrpc.KindInvalidParams); e.Field != tc.field {
			t.Errorf("params %v: field %q, want %q", tc.params, e.Field, tc.field)
		}
	}
	// Still not initialized after the refusals.
	rpcError(t, c.Call(ctx(t), "env/getIdle", nil, nil), jsonrpc.KindNotInitialized)

	var res InitializeResult
	if err := c.Call(ctx(t), "initialize", map[string]any{"protocolVersion": 5, "clientInfo": testClient}, &res); err != nil {
		t.Fatal(err)
	}
	if res.Plane != "data" || res.ProtocolVersion != 5 || res.DaemonInstanceID != d.InstanceID() || res.ServerInfo.Name != "lsenvd-dev" {
		t.Fatalf("initialize answered %+v", res)
	}
	if res.Capabilities.Filesystem == nil || !res.Capabilities.Filesystem.Write || res.Capabilities.Filesystem.Transfer {
		t.Fatalf("filesystem capability %+v", res.Capabilities.Filesystem)
	}
	if res.Capabilities.Process == nil || res.Capabilities.Process.Pty || !res.Capabilities.Process.Interrupt.Pipe {
		t.Fatalf("process capability %+v", res.Capabilities.Process)
	}
	if res.Platform.OS != "linux" || res.Platform.PathConvention != "posix" || res.Limits != DefaultLimits {
		t.Fatalf("platform %+v limits %+v", res.Platform, res.Limits)
	}
	err = c.Call(ctx(t), "initialize", map[string]any{"protocolVersion": 5, "clientInfo": testClient}, nil)
	rpcError(t, err, jsonrpc.KindInvalidRequest)

	// Every fs/* method is served, as the filesystem capability promises:
	// empty params are refused by the method itself, not as methodNotFound.
	for _, m := range []string{"fs/readFile", "fs/writeFile", "fs/createDirectory", "fs/getMetadata", "fs/readDirectory",
		"fs/remove", "fs/rename", "fs/searchText", "fs/globFiles", "fs/scan"} {
		rpcError(t, c.Call(ctx(t), m, map[string]any{}, nil), jsonrpc.KindInvalidParams)
	}
	rpcError(t, c.Call(ctx(t), "no/such", nil, nil), jsonrpc.KindMethodNotFound)
	if e := rpcError(t, c.Call(ctx(t), "job/start", map[string]any{}, nil), jsonrpc.KindCapabilityUnavailable); e.Capability != "job" {
		t.Fatalf("capability %q", e.Capability)
	}
	if e := rpcError(t, c.Call(ctx(t), "transfer/begin", map[string]any{}, nil), jsonrpc.KindCapabilityUnavailable); e.Capability != "filesystemTransfer" {
		t.Fatalf("capability %q", e.Capability)
	}
	rpcError(t, c.Call(ctx(t), "env/getIdle", map[string]any{"x": 1}, nil), jsonrpc.KindInvalidParams)

	// A second connection has its own handshake and sees the same instance.
	var again InitializeResult
	if err := dial(t, url).Call(ctx(t), "initialize", map[string]any{"protocolVersion": 5, "clientInfo": map[string]any{"name": "other"}}, &again); err != nil {
		t.Fatal(err)
	}
	if again.DaemonInstanceID != res.DaemonInstanceID {
		t.Fatal("daemonInstanceId changed between connections")
	}
}

func getIdle(t *testing.T, c *jsonrpc.Client) GetIdleResult {
	t.Helper()
	var r GetIdleResult
	if err := c.Call(ctx(t), "env/getIdle", nil, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

func TestIdleClock(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	_, url := serve(t, Config{Now: clock.now})
	c := initialized(t, url)

	clock.advance(5 * time.Second)
	if r := getIdle(t, c); r.IdleForMs != 5000 {
		t.Fatalf("idleForMs %d, want 5000", r.IdleForMs)
	}
	// Neither getIdle nor a handshake (nor a refused request) is use.
	initialized(t, url)
	if r := getIdle(t, c); r.IdleForMs != 5000 || r.ConnectionCount != 2 {
		t.Fatalf("after getIdle and initialize: %+v, want idle 5000 with 2 connections", r)
	}
	// A counted request resets the clock, even one that fails.
	err := c.Call(ctx(t), "fs/readFile", map[string]any{"path": "/nonexistent-devguest", "maxBytes": 10}, nil)
	rpcError(t, err, jsonrpc.KindNotFound)
	if r := getIdle(t, c); r.IdleForMs != 0 {
		t.Fatalf("idleForMs %d after fs/readFile, want 0", r.IdleForMs)
	}
	clock.advance(time.Second)
	if r := getIdle(t, c); r.IdleForMs != 1000 {
		t.Fatalf("idleForMs %d, want 1000", r.IdleForMs)
	}

	// A running process holds the clock at zero, however much time passes.
	start(t, c, "sleeper", []string{"sleep", "1"})
	clock.advance(time.Minute)
	if r := getIdle(t, c); r.IdleForMs != 0 || r.RunningProcessCount != 1 {
		t.Fatalf("while sleep runs: %+v", r)
	}
	if res := readUntilExit(t, c, "sleeper"); res.Exit == nil || res.Exit.Kind != "code" || *res.Exit.Code != 0 {
		t.Fatalf("sleep ended %+v", res.Exit)
	}
	// The clock restarted when the process ended.
	clock.advance(2 * time.Second)
	if r := getIdle(t, c); r.IdleForMs != 2000 || r.RunningProcessCount != 0 || r.RetainedProcessCount != 1 {
		t.Fatalf("after sleep: %+v", r)
	}
}

func start(t *testing.T, c *jsonrpc.Client, id string, argv []string, extra ...map[string]any) {
	t.Helper()
	params := map[string]any{"processId": id, "argv": argv}
	for _, e := range extra {
		for k, v := range e {
			params[k] = v
		}
	}
	var r ProcessStartResult
	if err := c.Call(ctx(t), "process/start", params, &r); err != nil {
		t.Fatal(err)
	}
	if r.Pid == 0 {
		t.Fatal("no pid")
	}
}

func read(t *testing.T, c *jsonrpc.Client, params map[string]any) ProcessReadResult {
	t.Helper()
	var r ProcessReadResult
	if err := c.Call(ctx(t), "process/read", params, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

func readUntilExit(t *testing.T, c *jsonrpc.Client, id string) ProcessReadResult {
	t.Helper()
	r := read(t, c, map[string]any{"processId": id, "after": 0, "maxBytes": 1 << 20, "waitMs": 15000, "returnOn": "exit"})
	if r.State != "exited" {
		t.Fatalf("%s still %s after waiting", id, r.State)
	}
	return r
}

func output(t *testing.T, r ProcessReadResult) string {
	t.Helper()
	var b strings.Builder
	for _, ch := range r.Chunks {
		data, err := base64.StdEncoding.DecodeString(ch.Data)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(data)
	}
	return b.String()
}

func TestProcessExitCodeAndCursor(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	start(t, c, "p1", []string{"sh", "-c", "echo out; echo err >&2; exit 3"})
	r := readUntilExit(t, c, "p1")
	if got := output(t, r); got != "out\nerr\n" {
		t.Fatalf("output %q", got)
	}
	if r.Exit == nil || r.Exit.Kind != "code" || r.Exit.Code == nil || *r.Exit.Code != 3 || r.StoppedBy != "" || r.Leftovers != nil {
		t.Fatalf("exit %+v stoppedBy %q leftovers %+v", r.Exit, r.StoppedBy, r.Leftovers)
	}
	if r.Next != 8 || r.End != 8 {
		t.Fatalf("next %d end %d", r.Next, r.End)
	}
	// Cursor reads: the first page of 3 bytes, then the rest, then nothing.
	first := read(t, c, map[string]any{"processId": "p1", "maxBytes": 3, "waitMs": 0})
	if output(t, first) != "out" || first.Next != 3 {
		t.Fatalf("first cursor page %+v", first)
	}
	rest := read(t, c, map[string]any{"processId": "p1", "maxBytes": 100, "waitMs": 0})
	if output(t, rest) != "\nerr\n" || rest.Chunks[0].Offset != 3 || rest.Next != 8 {
		t.Fatalf("second cursor page %+v", rest)
	}
	empty := read(t, c, map[string]any{"processId": "p1", "maxBytes": 100, "waitMs": 0})
	if len(empty.Chunks) != 0 || empty.Next != 8 || empty.State != "exited" {
		t.Fatalf("third cursor page %+v", empty)
	}
	// after and tailBytes never move the cursor.
	tail := read(t, c, map[string]any{"processId": "p1", "tailBytes": 4, "maxBytes": 100, "waitMs": 0})
	if output(t, tail) != "err\n" || tail.Chunks[0].Offset != 4 {
		t.Fatalf("tail %+v", tail)
	}
}

func TestProcessSignalTerminateAndInput(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)

	start(t, c, "sleeper", []string{"sleep", "30"})
	var empty Empty
	if err := c.Call(ctx(t), "process/terminate", map[string]any{"processId": "sleeper", "mode": "kill"}, &empty); err != nil {
		t.Fatal(err)
	}
	r := readUntilExit(t, c, "sleeper")
	if r.Exit == nil || r.Exit.Kind != "signal" || r.Exit.Signal != "SIGKILL" || r.StoppedBy != "kill" {
		t.Fatalf("exit %+v stoppedBy %q", r.Exit, r.StoppedBy)
	}

	start(t, c, "graceful", []string{"sh", "-c", "trap 'echo bye; exit 7' TERM; echo ready; while :; do sleep 0.05; done"})
	read(t, c, map[string]any{"processId": "graceful", "maxBytes": 100, "waitMs": 5000})
	if err := c.Call(ctx(t), "process/terminate", map[string]any{"processId": "graceful", "mode": "terminate"}, nil); err != nil {
		t.Fatal(err)
	}
	r = readUntilExit(t, c, "graceful")
	if !strings.Contains(output(t, r), "bye") || r.Exit.Kind != "code" || *r.Exit.Code != 7 || r.StoppedBy != "terminate" {
		t.Fatalf("graceful: %q exit %+v stoppedBy %q", output(t, r), r.Exit, r.StoppedBy)
	}

	start(t, c, "cat", []string{"cat"}, map[string]any{"stdin": "pipe"})
	in := base64.StdEncoding.EncodeToString([]byte("hello\n"))
	if err := c.Call(ctx(t), "process/write", map[string]any{"processId": "cat", "data": in}, nil); err != nil {
		t.Fatal(err)
	}
	if err := c.Call(ctx(t), "process/write", map[string]any{"processId": "cat", "close": true}, nil); err != nil {
		t.Fatal(err)
	}
	err := c.Call(ctx(t), "process/write", map[string]any{"processId": "cat", "data": in}, nil)
	if e := rpcError(t, err, jsonrpc.KindFailedPrecondition); e.Reason != "inputClosed" {
		t.Fatalf("reason %q", e.Reason)
	}
	if r := readUntilExit(t, c, "cat"); output(t, r) != "hello\n" || *r.Exit.Code != 0 {
		t.Fatalf("cat: %q %+v", output(t, r), r.Exit)
	}

	start(t, c, "nostdin", []string{"cat"})
	if r := readUntilExit(t, c, "nostdin"); *r.Exit.Code != 0 {
		t.Fatalf("cat without stdin: %+v", r.Exit)
	}
	err = c.Call(ctx(t), "process/write", map[string]any{"processId": "nostdin", "data": in}, nil)
	rpcError(t, err, jsonrpc.KindFailedPrecondition)

	start(t, c, "timed", []string{"sleep", "30"}, map[string]any{"timeoutMs": 50})
	if r := readUntilExit(t, c, "timed"); r.StoppedBy != "timeout" || r.Exit.Signal != "SIGTERM" {
		t.Fatalf("timeout: %+v %q", r.Exit, r.StoppedBy)
	}
}

func TestProcessErrors(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	start(t, c, "p", []string{"true"})

	for _, tc := range []struct {
		method string
		params map[string]any
		kind   jsonrpc.Kind
		field  string
		reason string
	}{
		{"process/start", map[string]any{"processId": "p", "argv": []string{"true"}}, jsonrpc.KindAlreadyExists, "", ""},
		{"process/start", map[string]any{"processId": "q"}, jsonrpc.KindInvalidParams, "argv", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{}}, jsonrpc.KindInvalidParams, "argv", ""},
		{"process/start", map[string]any{"processId": "-bad", "argv": []string{"true"}}, jsonrpc.KindInvalidParams, "processId", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"true"}, "shell": "bash"}, jsonrpc.KindInvalidParams, "shell", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []any{"true", 1}}, jsonrpc.KindInvalidParams, "argv[1]", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"true"}, "cwd": "/tmp/../etc"}, jsonrpc.KindInvalidParams, "cwd", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"true"}, "env": map[string]any{"A=B": "c"}}, jsonrpc.KindInvalidParams, "env.A=B", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"true"}, "stdin": "tty"}, jsonrpc.KindInvalidParams, "stdin", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"true"}, "pty": map[string]any{"rows": 24}}, jsonrpc.KindCapabilityUnavailable, "", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"/no/such/program"}}, jsonrpc.KindProcessFailed, "", ""},
		{"process/start", map[string]any{"processId": "q", "argv": []string{"true"}, "cwd": "/no/such/dir"}, jsonrpc.KindNotFound, "", ""},
		{"process/read", map[string]any{"processId": "nope", "maxBytes": 1, "waitMs": 0}, jsonrpc.KindNotFound, "", ""},
		{"process/read", map[string]any{"processId": "p", "waitMs": 0}, jsonrpc.KindInvalidParams, "maxBytes", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 0, "waitMs": 0}, jsonrpc.KindInvalidParams, "maxBytes", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1, "waitMs": -1}, jsonrpc.KindInvalidParams, "waitMs", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1.5, "waitMs": 0}, jsonrpc.KindInvalidParams, "maxBytes", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1, "waitMs": 0, "after": 0, "tailBytes": 1}, jsonrpc.KindInvalidParams, "tailBytes", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1, "waitMs": 0, "after": 99}, jsonrpc.KindInvalidParams, "after", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1, "waitMs": 0, "returnOn": "never"}, jsonrpc.KindInvalidParams, "returnOn", ""},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1, "waitMs": 0, "after": nil}, jsonrpc.KindInvalidParams, "after", ""},
		{"process/terminate", map[string]any{"processId": "p", "mode": "stop"}, jsonrpc.KindInvalidParams, "mode", ""},
		{"process/terminate", map[string]any{"processId": "nope", "mode": "kill"}, jsonrpc.KindNotFound, "", ""},
	} {
		err := c.Call(ctx(t), tc.method, tc.params, nil)
		e := rpcError(t, err, tc.kind)
		if e.Field != tc.field {
			t.Errorf("%s %v: field %q, want %q (%s)", tc.method, tc.params, e.Field, tc.field, e.Message)
		}
	}
}

func TestCeilings(t *testing.T) {
	limits := DefaultLimits
	limits.Filesystem.MaxWriteBytes = 4
	_, url := serve(t, Config{Limits: limits})
	c := initialized(t, url)
	start(t, c, "p", []string{"true"})
	dir := t.TempDir()
	for _, tc := range []struct {
		method  string
		params  map[string]any
		field   string
		ceiling uint64
	}{
		{"process/read", map[string]any{"processId": "p", "maxBytes": limits.Process.MaxReadBytes + 1, "waitMs": 0}, "maxBytes", limits.Process.MaxReadBytes},
		{"process/read", map[string]any{"processId": "p", "maxBytes": 1, "waitMs": limits.MaxWaitMs + 1}, "waitMs", limits.MaxWaitMs},
		{"fs/readFile", map[string]any{"path": "/etc/hostname", "maxBytes": limits.Filesystem.MaxReadBytes + 1}, "maxBytes", limits.Filesystem.MaxReadBytes},
		{"fs/writeFile", map[string]any{"path": dir + "/f", "data": base64.StdEncoding.EncodeToString([]byte("12345"))}, "data", 4},
	} {
		err := c.Call(ctx(t), tc.method, tc.params, nil)
		e := rpcError(t, err, jsonrpc.KindInvalidParams)
		if e.Field != tc.field || e.Ceiling == nil || *e.Ceiling != tc.ceiling {
			t.Errorf("%s: field %q ceiling %v, want %q %d", tc.method, e.Field, e.Ceiling, tc.field, tc.ceiling)
		}
	}
	// Exactly at the ceiling is accepted.
	if err := c.Call(ctx(t), "fs/writeFile", map[string]any{"path": dir + "/f", "data": base64.StdEncoding.EncodeToString([]byte("1234"))}, nil); err != nil {
		t.Fatal(err)
	}
}

func TestCancelRequestAbortsRead(t *testing.T) {
	_, url := serve(t, Config{})
	ws, _, err := websocket.DefaultDialer.Dial(url, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	send := func(msg string) {
		if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
			t.Fatal(err)
		}
	}
	type answer struct {
		ID     json.RawMessage `json:"id"`
		Result json.RawMessage `json:"result"`
		Error  *jsonrpc.Error  `json:"error"`
	}
	recv := func() answer {
		_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, data, err := ws.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		var a answer
		if err := json.Unmarshal(data, &a); err != nil {
			t.Fatalf("%s: %v", data, err)
		}
		return a
	}
	send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":"raw"}}}`)
	if a := recv(); a.Error != nil {
		t.Fatal(a.Error)
	}
	send(`{"jsonrpc":"2.0","id":2,"method":"process/start","params":{"processId":"s","argv":["sleep","30"]}}`)
	if a := recv(); a.Error != nil {
		t.Fatal(a.Error)
	}
	send(`{"jsonrpc":"2.0","id":"read-1","method":"process/read","params":{"processId":"s","maxBytes":10,"waitMs":30000,"returnOn":"exit"}}`)
	// An unknown id and a malformed cancel are ignored; the known one aborts.
	time.Sleep(50 * time.Millisecond)
	send(`{"jsonrpc":"2.0","method":"$/cancelRequest","params":{"id":"read-2"}}`)
	send(`{"jsonrpc":"2.0","method":"$/cancelRequest","params":{}}`)
	send(`{"jsonrpc":"2.0","method":"$/cancelRequest","params":{"id":"read-1"}}`)
	a := recv()
	if string(a.ID) != `"read-1"` || a.Error == nil || a.Error.Kind != jsonrpc.KindAborted || a.Error.Reason != "cancelled" {
		t.Fatalf("answer %s %+v", a.ID, a.Error)
	}
	send(`{"jsonrpc":"2.0","id":3,"method":"process/terminate","params":{"processId":"s","mode":"kill"}}`)
	if a := recv(); a.Error != nil {
		t.Fatal(a.Error)
	}
}

func TestLeftoversKeepIdleAtZero(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	_, url := serve(t, Config{Now: clock.now})
	c := initialized(t, url)
	start(t, c, "bg", []string{"sh", "-c", "sleep 1 >/dev/null 2>&1 & echo started"})
	r := readUntilExit(t, c, "bg")
	if output(t, r) != "started\n" || r.Leftovers == nil || r.Leftovers.Disposition != "kept" || len(r.Leftovers.Processes) != 1 ||
		!strings.HasPrefix(r.Leftovers.Processes[0].Command, "sleep 1") {
		t.Fatalf("leftovers %+v", r.Leftovers)
	}
	clock.advance(time.Hour)
	if g := getIdle(t, c); g.IdleForMs != 0 || g.LeftoverProcessGroupCount != 1 || g.RunningProcessCount != 0 {
		t.Fatalf("with a leftover: %+v", g)
	}
	deadline := time.Now().Add(10 * time.Second)
	for getIdle(t, c).LeftoverProcessGroupCount != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the leftover group never ended")
		}
		time.Sleep(50 * time.Millisecond)
	}
	clock.advance(3 * time.Second)
	if g := getIdle(t, c); g.IdleForMs != 3000 {
		t.Fatalf("after the leftover ended: %+v", g)
	}
}

func TestOutputOverflowGap(t *testing.T) {
	limits := DefaultLimits
	limits.Process.MaxRetainedOutputBytes = 1024
	_, url := serve(t, Config{Limits: limits})
	c := initialized(t, url)
	start(t, c, "big", []string{"sh", "-c", "head -c 5000 /dev/zero"})
	r := readUntilExit(t, c, "big")
	if r.End != 5000 || len(r.Gaps) != 1 || r.Gaps[0].Offset != 0 || r.Gaps[0].Reason != "overflow" {
		t.Fatalf("end %d gaps %+v", r.End, r.Gaps)
	}
	if got := uint64(len(output(t, r))); r.Gaps[0].SizeBytes+got != 5000 || got > 1024 || r.Next != 5000 {
		t.Fatalf("gap %d + data %d, next %d", r.Gaps[0].SizeBytes, got, r.Next)
	}
}

func TestReturnOnWindow(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	start(t, c, "slow", []string{"sh", "-c", "echo a; sleep 0.2; echo b; sleep 30"})
	r := read(t, c, map[string]any{"processId": "slow", "after": 0, "maxBytes": 4, "waitMs": 10000, "returnOn": "window"})
	if output(t, r) != "a\nb\n" || r.State != "running" {
		t.Fatalf("window read %q %s", output(t, r), r.State)
	}
	if err := c.Call(ctx(t), "process/terminate", map[string]any{"processId": "slow", "mode": "kill"}, nil); err != nil {
		t.Fatal(err)
	}
	// A read with waitMs that runs out answers what there is.
	start(t, c, "quiet", []string{"sleep", "30"})
	r = read(t, c, map[string]any{"processId": "quiet", "maxBytes": 4, "waitMs": 20})
	if len(r.Chunks) != 0 || r.State != "running" || r.Next != 0 {
		t.Fatalf("quiet read %+v", r)
	}
}

func TestFilesystem(t *testing.T) {
	_, url := serve(t, Config{})
	c := initialized(t, url)
	dir := t.TempDir()
	path := filepath.Join(dir, "notes.txt")
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

	var w1 WriteFileResult
	if err := c.Call(ctx(t), "fs/writeFile", map[string]any{"path": path, "data": b64("hello world")}, &w1); err != nil {
		t.Fatal(err)
	}
	var r ReadFileResult
	if err := c.Call(ctx(t), "fs/readFile", map[string]any{"path": path, "maxBytes": 100}, &r); err != nil {
		t.Fatal(err)
	}
	if r.Data != b64("hello world") || r.SizeBytes != 11 || r.Version != w1.Version || !strings.HasPrefix(r.Version, "file:v1:") {
		t.Fatalf("read %+v after write %+v", r, w1)
	}
	if err := c.Call(ctx(t), "fs/readFile", map[string]any{"path": path, "offset": 6, "maxBytes": 3}, &r); err != nil {
		t.Fatal(err)
	}
	if r.Data != b64("wor") || r.SizeBytes != 11 {
		t.Fatalf("ranged read %+v", r)
	}
	if err := c.Call(ctx(t), "fs/readFile", map[string]any{"path": path, "offset": 60, "maxBytes": 3}, &r); err != nil || r.Data != "" {
		t.Fatalf("read past the end: %+v %v", r, err)
	}

	var w2 WriteFileResult
	if err := c.Call(ctx(t), "fs/writeFile", map[string]any{"path": path, "data": b64("v2"), "ifMatch": w1.Version, "executable": true}, &w2); err != nil {
		t.Fatal(err)
	}
	if w2.Version == w1.Version {
		t.Fatal("the version did not change")
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("mode after executable write: %v %v", fi.Mode(), err)
	}
	// An existing file keeps its mode.
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.Call(ctx(t), "fs/writeFile", map[string]any{"path": path, "data": b64("v3")}, &w2); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode not kept: %v", fi.Mode())
	}
	// A symlink is followed to its target.
	link := filepath.Join(dir, "link")
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	if err := c.Call(ctx(t), "fs/writeFile", map[string]any{"path": link, "data": b64("via link")}, nil); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(path); string(got) != "via link" {
		t.Fatalf("target holds %q", got)
	}
	if fi, _ := os.Lstat(link); fi.Mode()&os.ModeSymlink == 0 {
		t.Fatal("the link was replaced")
	}
	// Empty data writes an empty file.
	if err := c.Call(ctx(t), "fs/writeFile", map[string]any{"path": filepath.Join(dir, "empty"), "data": ""}, nil); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 3 {
		t.Fatalf("stray files left behind: %v", entries)
	}

	for _, tc := range []struct {
		method string
		params map[string]any
		kind   jsonrpc.Kind
		field  string
		reason string
	}{
		{"fs/writeFile", map[string]any{"path": path, "data": b64("x"), "ifMatch": w1.Version}, jsonrpc.KindFailedPrecondition, "", "ifMatchFailed"},
		{"fs/writeFile", map[string]any{"path": filepath.Join(dir, "new"), "data": b64("x"), "ifMatch": w1.Version}, jsonrpc.KindFailedPrecondition, "", "ifMatchFailed"},
		{"fs/writeFile", map[string]any{"path": path, "data": b64("x"), "create": "createNew"}, jsonrpc.KindFailedPrecondition, "", "createCondition"},
		{"fs/writeFile", map[string]any{"path": filepath.Join(dir, "absent"), "data": b64("x"), "create": "replaceExisting"}, jsonrpc.KindFailedPrecondition, "", "createCondition"},
		{"fs/writeFile", map[string]any{"path": filepath.Join(dir, "missing", "f"), "data": b64("x")}, jsonrpc.KindNotFound, "", ""},
		{"fs/writeFile", map[string]any{"path": filepath.Join(path, "f"), "data": b64("x")}, jsonrpc.KindFailedPrecondition, "", "notDirectory"},
		{"fs/writeFile", map[string]any{"path": dir, "data": b64("x")}, jsonrpc.KindFailedPrecondition, "", "isDirectory"},
		{"fs/writeFile", map[string]any{"path": path, "data": "not base64!"}, jsonrpc.KindInvalidParams, "data", ""},
		{"fs/writeFile", map[string]any{"path": path, "data": "eA"}, jsonrpc.KindInvalidParams, "data", ""},
		{"fs/writeFile", map[string]any{"path": path}, jsonrpc.KindInvalidParams, "data", ""},
		{"fs/writeFile", map[string]any{"path": path, "data": b64("x"), "create": "maybe"}, jsonrpc.KindInvalidParams, "create", ""},
		{"fs/readFile", map[string]any{"path": dir, "maxBytes": 1}, jsonrpc.KindFailedPrecondition, "", "isDirectory"},
		{"fs/readFile", map[string]any{"path": "/dev/null", "maxBytes": 1}, jsonrpc.KindFailedPrecondition, "", "notRegularFile"},
		{"fs/readFile", map[string]any{"path": filepath.Join(dir, "nope"), "maxBytes": 1}, jsonrpc.KindNotFound, "", ""},
		{"fs/readFile", map[string]any{"path": dir + "/../x", "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
		{"fs/readFile", map[string]any{"path": dir + "/./x", "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
		{"fs/readFile", map[string]any{"path": dir + "//x", "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
		{"fs/readFile", map[string]any{"path": dir + "/", "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
		{"fs/readFile", map[string]any{"path": "relative/x", "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
		{"fs/readFile", map[string]any{"path": "/" + strings.Repeat("a", 4096), "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
		{"fs/readFile", map[string]any{"path": path, "maxBytes": 1, "offset": 9007199254740992}, jsonrpc.KindInvalidParams, "offset", ""},
		{"fs/readFile", map[string]any{"path": path, "maxBytes": 1, "follow": true}, jsonrpc.KindInvalidParams, "follow", ""},
		{"fs/readFile", map[string]any{"path": path}, jsonrpc.KindInvalidParams, "maxBytes", ""},
		{"fs/readFile", map[string]any{"path": nil, "maxBytes": 1}, jsonrpc.KindInvalidParams, "path", ""},
	} {
		err := c.Call(ctx(t), tc.method, tc.params, nil)
		e := rpcError(t, err, tc.kind)
		if e.Field != tc.field || e.Reason != tc.reason {
			t.Errorf("%s %v: field %q reason %q, want %q %q (%s)", tc.method, tc.params, e.Field, e.Reason, tc.field, tc.reason, e.Message)
		}
	}
}

func TestCheckPath(t *testing.T) {
	for p, ok := range map[string]bool{
		"/": true, "/a": true, "/a/b.c": true, "/a/..b": true, "/a/.b": true,
		"": false, "a": false, "/a/": false, "//": false, "/a//b": false, "/a/./b": false, "/..": false, "/a/.": false,
		"/a\x00b": false, "/\xff": false,
	} {
		if got := checkPath("path", p) == nil; got != ok {
			t.Errorf("checkPath(%q) ok=%v, want %v", p, got, ok)
		}
	}
}

// The answers decode with the project's strict decoder: no member the types do not declare.
func TestAnswersDecodeStrictly(t *testing.T) {
	d, _ := serve(t, Config{})
	raw, err := json.Marshal(d.Initialized())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("initialize: %s", raw)
	var back InitializeResult
	if err := wire.Decode(raw, &back); err != nil {
		t.Fatalf("%s: %v", raw, err)
	}
	if strings.Contains(string(raw), "transfer") || strings.Contains(string(raw), "pty") || strings.Contains(string(raw), "null") {
		t.Fatalf("initialize advertises more than it implements: %s", raw)
	}
}
