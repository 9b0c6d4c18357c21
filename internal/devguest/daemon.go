package devguest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// ServerName is the serverInfo name this daemon reports.
const ServerName = "lsenvd-dev"

// Config configures a Daemon. Zero values take the defaults noted.
type Config struct {
	// Cwd is the default cwd of commands (defaultCwd); it must be an
	// absolute, normalized path of a directory. Default: the process's
	// working directory.
	Cwd string
	// Version is serverInfo.version. Default "dev".
	Version string
	// TerminationGrace is the pause between SIGTERM and SIGKILL of
	// process/terminate (mode terminate) and of timeoutMs. Default 2 s.
	TerminationGrace time.Duration
	// ShutdownGrace is that pause when the daemon itself stops. Default 300 ms.
	ShutdownGrace time.Duration
	// Limits overrides the advertised ceilings (tests). Zero: the defaults.
	Limits Limits
	// ResultBudgetBytes overrides the result budget of fs/searchText,
	// fs/globFiles and fs/scan (tests). Zero: the spec's 12 MiB.
	ResultBudgetBytes int64
	// Now is the monotonic clock (tests). Default time.Now.
	Now func() time.Time
	// Logf logs a line. Default: discard.
	Logf func(format string, args ...any)
}

// DefaultLimits are the ceilings the daemon advertises and enforces. Byte
// ceilings keep one base64 payload well inside the 16 MiB message limit.
var DefaultLimits = Limits{
	MaxConcurrentRequests: 32,
	MaxWaitMs:             60_000,
	Filesystem: FilesystemLimits{
		MaxReadBytes:        8 << 20,
		MaxWriteBytes:       8 << 20,
		MaxDirectoryEntries: 4096,
		MaxScanRoots:        64,
	},
	Process: ProcessLimits{
		MaxReadBytes:           1 << 20,
		MaxProcessCount:        32,
		MaxRetainedOutputBytes: 4 << 20,
		MaxPendingInputBytes:   1 << 20,
	},
}

// Daemon serves the data plane on WebSocket connections (ServeHTTP).
type Daemon struct {
	instanceID       string
	version          string
	defaultCwd       string
	home             string
	platform         Platform
	limits           Limits
	baseEnv          []string
	terminationGrace time.Duration
	shutdownGrace    time.Duration
	resultBudget     int64
	logf             func(string, ...any)
	// walkPaused, when set before the daemon serves, runs before each
	// entry of a walk (tests hold a walk open to cancel it).
	walkPaused func(context.Context)

	idle       *idleClock
	procs      procTable
	writeLocks *writeLocks
	upgrader   websocket.Upgrader

	mu           sync.Mutex
	conns        map[*connection]struct{}
	shuttingDown bool
	connsDone    sync.WaitGroup
}

// New prepares a daemon: a fresh daemonInstanceId and the one-time probe of
// the shells installed.
func New(ctx context.Context, cfg Config) (*Daemon, error) {
	cwd := cfg.Cwd
	if cwd == "" {
		wd, err := os.Getwd()
		if err != nil {
			return nil, fmt.Errorf("devguest: working directory: %w", err)
		}
		cwd = wd
	}
	if e := checkPath("cwd", cwd); e != nil {
		return nil, fmt.Errorf("devguest: the default cwd %q is not an absolute, normalized path", cwd)
	}
	if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("devguest: the default cwd %q is not a directory", cwd)
	}
	var id [16]byte
	if _, err := rand.Read(id[:]); err != nil {
		return nil, fmt.Errorf("devguest: daemon instance id: %w", err)
	}
	d := &Daemon{
		instanceID:       hex.EncodeToString(id[:]),
		version:          cmp.Or(cfg.Version, "dev"),
		defaultCwd:       cwd,
		home:             homeDirectory(),
		limits:           cfg.Limits,
		terminationGrace: cmp.Or(cfg.TerminationGrace, 2*time.Second),
		shutdownGrace:    cmp.Or(cfg.ShutdownGrace, 300*time.Millisecond),
		resultBudget:     cmp.Or(cfg.ResultBudgetBytes, ResultBudgetBytes),
		logf:             cfg.Logf,
		writeLocks:       newWriteLocks(),
		conns:            map[*connection]struct{}{},
	}
	if d.limits == (Limits{}) {
		d.limits = DefaultLimits
	}
	if d.logf == nil {
		d.logf = func(string, ...any) {}
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	d.idle = newIdleClock(now)
	d.procs = procTable{byID: map[string]*proc{}, expired: map[string]struct{}{}, limit: int(d.limits.Process.MaxProcessCount)}
	d.platform = Platform{OS: "linux", PathConvention: "posix", Shells: probeShells(ctx)}
	if len(d.platform.Shells) > 0 {
		d.platform.DefaultShell = d.platform.Shells[0].Kind
	}
	d.baseEnv = os.Environ()
	if d.home != "" && !slices.ContainsFunc(d.baseEnv, func(kv string) bool { return strings.HasPrefix(kv, "HOME=") }) {
		d.baseEnv = append(d.baseEnv, "HOME="+d.home)
	}
	d.upgrader = websocket.Upgrader{
		ReadBufferSize:  64 << 10,
		WriteBufferSize: 64 << 10,
		// No browser reaches this daemon: it listens on the guest's loopback
		// behind the provider, so any Origin is accepted.
		CheckOrigin: func(*http.Request) bool { return true },
	}
	return d, nil
}

// InstanceID is this start's daemonInstanceId.
func (d *Daemon) InstanceID() string { return d.instanceID }

// Initialized is the initialize response this daemon sends.
func (d *Daemon) Initialized() InitializeResult {
	return InitializeResult{
		ProtocolVersion:  ProtocolVersion,
		Plane:            Plane,
		ServerInfo:       BuildInfo{Name: ServerName, Version: d.version},
		DaemonInstanceID: d.instanceID,
		Capabilities: Capabilities{
			Filesystem: &FilesystemCapability{Write: true},
			Process: &ProcessCapability{
				Tree:        "posixProcessGroup",
				Termination: "gracefulThenKill",
				Interrupt:   InterruptSupport{Pipe: true},
			},
		},
		Limits:        d.limits,
		DefaultCwd:    d.defaultCwd,
		HomeDirectory: d.home,
		Platform:      d.platform,
	}
}

func (d *Daemon) isShuttingDown() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.shuttingDown
}

// connection is one data connection: its socket and the abortable requests
// pending on it, by request id.
type connection struct {
	ws      *websocket.Conn
	cancel  context.CancelFunc
	mu      sync.Mutex
	pending map[string]*pendingRequest
}

type pendingRequest struct{ cancel context.CancelFunc }

// ServeHTTP upgrades a request for "/" and serves the data plane on it until
// the connection ends.
func (d *Daemon) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	d.mu.Lock()
	if d.shuttingDown {
		d.mu.Unlock()
		http.Error(w, "the daemon is shutting down", http.StatusServiceUnavailable)
		return
	}
	d.connsDone.Add(1)
	d.mu.Unlock()
	defer d.connsDone.Done()
	ws, err := d.upgrader.Upgrade(w, r, nil)
	if err != nil {
		return // the upgrader has answered
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &connection{ws: ws, cancel: cancel, pending: map[string]*pendingRequest{}}
	d.mu.Lock()
	if d.shuttingDown {
		d.mu.Unlock()
		_ = ws.Close()
		return
	}
	d.conns[c] = struct{}{}
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.conns, c)
		d.mu.Unlock()
		_ = ws.Close()
	}()
	if err := d.server(c).ServeConn(ctx, ws); err != nil {
		d.logf("connection from %s ended: %v", r.RemoteAddr, err)
	}
}

// server is the data-plane server of one connection; its cancellation
// bookkeeping is that connection's own, since request ids are per connection.
func (d *Daemon) server(c *connection) *jsonrpc.Server {
	counted := func(m jsonrpc.Method) jsonrpc.Method {
		return func(ctx context.Context, params json.RawMessage) (any, error) {
			d.idle.touch()
			defer d.idle.touch()
			return m(ctx, params)
		}
	}
	abortable := func(m jsonrpc.Method) jsonrpc.Method {
		return func(ctx context.Context, params json.RawMessage) (any, error) {
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			if id, ok := jsonrpc.RequestID(ctx); ok {
				key := string(id)
				entry := &pendingRequest{cancel: cancel}
				c.mu.Lock()
				c.pending[key] = entry
				c.mu.Unlock()
				defer func() {
					c.mu.Lock()
					if c.pending[key] == entry {
						delete(c.pending, key)
					}
					c.mu.Unlock()
				}()
			}
			return m(ctx, params)
		}
	}
	methods := map[string]jsonrpc.Method{
		"env/getIdle":        d.getIdle,
		"fs/readFile":        counted(d.readFile),
		"fs/writeFile":       counted(d.writeFile),
		"fs/createDirectory": counted(d.createDirectory),
		"fs/getMetadata":     counted(d.getMetadata),
		"fs/readDirectory":   counted(d.readDirectory),
		"fs/remove":          counted(d.remove),
		"fs/rename":          counted(d.rename),
		"fs/searchText":      counted(abortable(d.searchText)),
		"fs/globFiles":       counted(abortable(d.globFiles)),
		"fs/scan":            abortable(d.scan), // a scan is not use
		"process/start":      counted(d.processStart),
		"process/read":       counted(abortable(d.processRead)),
		"process/write":      counted(d.processWrite),
		"process/terminate":  counted(d.processTerminate),
	}
	// Methods of families this daemon does not advertise exist on the plane
	// all the same: they are refused as capabilityUnavailable, before any
	// side effect, as the spec asks.
	for _, m := range jobMethods {
		methods[m] = counted(unavailable("job", m))
	}
	for _, m := range transferMethods {
		methods[m] = counted(unavailable("filesystemTransfer", m))
	}
	return &jsonrpc.Server{
		Plane:           Plane,
		ProtocolVersion: ProtocolVersion,
		Initialize:      d.initialize,
		Methods:         methods,
		Notifications: map[string]func(context.Context, json.RawMessage){
			"$/cancelRequest": func(_ context.Context, params json.RawMessage) {
				var p CancelRequestParams
				if jsonrpc.DecodeParams(params, &p) != nil {
					return
				}
				c.mu.Lock()
				entry := c.pending[string(p.ID)]
				c.mu.Unlock()
				if entry != nil {
					entry.cancel()
				}
			},
		},
		MaxInFlight: int(d.limits.MaxConcurrentRequests),
	}
}

var (
	jobMethods      = []string{"job/start", "job/read", "job/cancel"}
	transferMethods = []string{"transfer/begin", "transfer/advance", "transfer/getStatus", "transfer/readInventory",
		"transfer/append", "transfer/listMissing", "transfer/read", "transfer/write", "transfer/commit", "transfer/abort"}
)

func unavailable(capability, method string) jsonrpc.Method {
	return func(context.Context, json.RawMessage) (any, error) {
		return nil, jsonrpc.CapabilityUnavailable(capability, "lsenvd-dev does not offer %s: the capability %s is not advertised.", method, capability)
	}
}

func (d *Daemon) initialize(_ context.Context, raw json.RawMessage) (any, error) {
	var p InitializeParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	return d.Initialized(), nil
}

func (d *Daemon) getIdle(_ context.Context, raw json.RawMessage) (any, error) {
	var p GetIdleParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	idleFor, roots, leftover := d.idle.idleFor()
	d.mu.Lock()
	conns := len(d.conns)
	d.mu.Unlock()
	return GetIdleResult{
		IdleForMs:                 uint64(idleFor / time.Millisecond),
		RunningProcessCount:       uint32(roots),
		LeftoverProcessGroupCount: uint32(leftover),
		RetainedProcessCount:      uint32(d.procs.counts()),
		ConnectionCount:           uint32(conns),
	}, nil
}

// Shutdown closes every connection with a going-away close frame, refuses
// new ones, and stops every process group still running: SIGTERM, then
// SIGKILL after the shutdown grace (or when ctx ends, if sooner).
func (d *Daemon) Shutdown(ctx context.Context) error {
	d.mu.Lock()
	d.shuttingDown = true
	conns := make([]*connection, 0, len(d.conns))
	for c := range d.conns {
		conns = append(conns, c)
	}
	d.mu.Unlock()
	for _, c := range conns {
		_ = c.ws.WriteControl(websocket.CloseMessage,
			websocket.FormatCloseMessage(websocket.CloseGoingAway, "lsenvd-dev is shutting down"),
			time.Now().Add(100*time.Millisecond))
		c.cancel()
	}

	procs := d.procs.all()
	for _, p := range procs {
		p.mu.Lock()
		p.signalLocked(syscall.SIGTERM)
		p.signalLocked(syscall.SIGCONT)
		p.mu.Unlock()
	}
	grace := time.NewTimer(d.shutdownGrace)
	defer grace.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		anyAlive := false
		for _, p := range procs {
			p.mu.Lock()
			alive := p.aliveLocked()
			p.mu.Unlock()
			anyAlive = anyAlive || (alive && groupAlive(p.pgid))
		}
		if !anyAlive {
			break
		}
		select {
		case <-tick.C:
			continue
		case <-grace.C:
		case <-ctx.Done():
		}
		for _, p := range procs {
			p.mu.Lock()
			p.signalLocked(syscall.SIGKILL)
			p.mu.Unlock()
		}
		break
	}

	done := make(chan struct{})
	go func() { d.connsDone.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
