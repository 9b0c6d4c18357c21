// Package controller serves the controller plane (protocol version 4) over
// WebSocket JSON-RPC: its wire types, the handshake, the methods' dispatch
// and their limits. What a method does to infrastructure lives behind the
// Backend interface; this package never touches Incus.
package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"
	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/serve"
)

// Backend is what the controller plane asks of the infrastructure. Each
// method answers within a few seconds; a returned *jsonrpc.Error is sent as
// is, any other error is `internal`.
type Backend interface {
	ListTemplates(ctx context.Context, universeID string) ([]Template, error)
	CreateTarget(ctx context.Context, p CreateParams) (Observation, error)
	GetTarget(ctx context.Context, ref TargetRef) (Observation, error)
	SetPower(ctx context.Context, ref TargetRef, power Power) (Observation, error)
	CloseTarget(ctx context.Context, ref TargetRef) (Observation, error)
	EnsureIngress(ctx context.Context, ref TargetRef) (Observation, error)
	RemoveIngress(ctx context.Context, ref TargetRef) (Observation, error)
}

// Options configure the controller endpoint.
type Options struct {
	Backend      Backend
	Capabilities Capabilities
	Credential   bearer.Credential
	// MaxInFlight bounds concurrent requests per connection (at least 16).
	MaxInFlight int
	// MaxConnections bounds the open controller connections
	// (DefaultMaxConnections); past it a connection is refused with 503 and
	// Retry-After before the upgrade.
	MaxConnections int
	// DecodeBudget, when set, bounds the bytes of large frames in decode
	// at once across every connection (see jsonrpc.Budget); share one per
	// process.
	DecodeBudget *jsonrpc.Budget
	Metrics      *Metrics
	Log          *zap.Logger
	// Audit, when set, gets a line for every method call answered (see
	// audit.go); nil keeps no audit trail.
	Audit *zap.Logger
	// ServerName is serverInfo.name.
	ServerName string
}

// DefaultMaxConnections is the default ceiling on open controller connections.
const DefaultMaxConnections = 64

// Handler serves /control.
type Handler struct {
	opts     Options
	rpc      *jsonrpc.Server
	upgrader websocket.Upgrader
	info     BuildInfo
	ctx      context.Context
	open     atomic.Int64
	fullLog  *serve.Every
}

// NewHandler builds the endpoint. ctx bounds every connection it serves:
// cancel it to end them all at shutdown.
func NewHandler(ctx context.Context, opts Options) *Handler {
	if opts.Log == nil {
		opts.Log = zap.NewNop()
	}
	if opts.ServerName == "" {
		opts.ServerName = "incus-provider"
	}
	if opts.MaxConnections <= 0 {
		opts.MaxConnections = DefaultMaxConnections
	}
	h := &Handler{
		opts:    opts,
		ctx:     ctx,
		fullLog: serve.NewEvery(opts.Log, 10*time.Second),
		info:    buildinfo.Describe(opts.ServerName),
		upgrader: websocket.Upgrader{
			HandshakeTimeout: 10 * time.Second,
			ReadBufferSize:   64 << 10,
			WriteBufferSize:  64 << 10,
			// The runtime is not a browser and sends no Origin; a browser
			// page from elsewhere must not ride on an operator's network position.
			CheckOrigin: sameOriginOrNone,
		},
	}
	h.rpc = &jsonrpc.Server{
		Plane:           Plane,
		ProtocolVersion: ProtocolVersion,
		Initialize:      h.initialize,
		Methods:         h.auditedMethods(),
		MaxInFlight:     opts.MaxInFlight,
		Budget:          opts.DecodeBudget,
	}
	if m := opts.Metrics; m != nil {
		h.rpc.Observe = m.observe
		h.rpc.OnBudgetRefused = func() { m.refuse(RefusedDecodeBudget) }
		if opts.DecodeBudget != nil {
			m.budget.Store(opts.DecodeBudget)
		}
	}
	return h
}

// BeginDrain starts a graceful end of every controller connection: each
// answers what it has in flight, refuses new requests as `unavailable`
// (the runtime asks again, on a connection the load balancer gives
// another replica) and then closes with 1001. Drain waits for it.
func (h *Handler) BeginDrain() { h.rpc.Drain() }

// Drain waits until every controller connection has ended, or ctx does.
// Cancelling the handler's context makes each send its going-away close
// first; a shutdown waits here so the process does not exit before those
// frames are out.
func (h *Handler) Drain(ctx context.Context) {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for h.open.Load() > 0 {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// ServeHTTP checks the credential, then upgrades and serves the plane.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.opts.Credential.Require(http.HandlerFunc(h.serve), func(*http.Request) {
		if h.opts.Metrics != nil {
			h.opts.Metrics.unauthorized.Inc()
		}
	}).ServeHTTP(w, r)
}

func (h *Handler) serve(w http.ResponseWriter, r *http.Request) {
	if h.open.Add(1) > int64(h.opts.MaxConnections) {
		h.open.Add(-1)
		h.opts.Metrics.refuse(RefusedConnectionLimit)
		h.fullLog.Warn("controller connections are at their ceiling; refusing new ones with 503",
			zap.Int("maxConnections", h.opts.MaxConnections))
		w.Header().Set("Retry-After", "5")
		w.Header().Set("Cache-Control", "no-store")
		http.Error(w, fmt.Sprintf("This provider already serves %d controller connections, its limit; retry later.", h.opts.MaxConnections),
			http.StatusServiceUnavailable)
		return
	}
	defer h.open.Add(-1)
	ws, err := h.upgrader.Upgrade(w, r, nil)
	if err != nil {
		return // the upgrader has answered the HTTP error
	}
	if m := h.opts.Metrics; m != nil {
		m.connections.Inc()
		defer m.connections.Dec()
	}
	defer func() { _ = ws.Close() }()
	if err := h.rpc.ServeConn(withRemote(h.ctx, r.RemoteAddr), ws); err != nil {
		h.opts.Log.Debug("controller connection ended", zap.Error(err))
	}
}

func sameOriginOrNone(r *http.Request) bool {
	origin := r.Header.Get("Origin")
	if origin == "" {
		return true
	}
	return origin == "http://"+r.Host || origin == "https://"+r.Host
}

func (h *Handler) initialize(_ context.Context, params json.RawMessage) (any, error) {
	var p InitializeParams
	if err := jsonrpc.DecodeParams(params, &p); err != nil {
		return nil, err
	}
	return InitializeResult{
		ProtocolVersion: ProtocolVersion,
		Plane:           Plane,
		ServerInfo:      h.info,
		Capabilities:    h.opts.Capabilities,
	}, nil
}

// Method names, as the manifest spells them.
const (
	MethodInitialize    = "initialize"
	MethodTemplateList  = "template/list"
	MethodTargetCreate  = "target/create"
	MethodTargetGet     = "target/get"
	MethodTargetSet     = "target/setPower"
	MethodTargetClose   = "target/close"
	MethodIngressEnsure = "ingress/ensure"
	MethodIngressRemove = "ingress/remove"
)

// Methods lists every controller method this package knows, initialize included.
func Methods() []string {
	return []string{MethodInitialize, MethodTemplateList, MethodTargetCreate, MethodTargetGet,
		MethodTargetSet, MethodTargetClose, MethodIngressEnsure, MethodIngressRemove}
}

// auditedMethods are the methods, each logged to the audit trail when
// there is one.
func (h *Handler) auditedMethods() map[string]jsonrpc.Method {
	ms := h.methods()
	if h.opts.Audit != nil {
		for name, m := range ms {
			ms[name] = audited(h.opts.Audit, name, m)
		}
	}
	return ms
}

func (h *Handler) methods() map[string]jsonrpc.Method {
	b := h.opts.Backend
	caps := h.opts.Capabilities
	return map[string]jsonrpc.Method{
		MethodTemplateList: func(ctx context.Context, raw json.RawMessage) (any, error) {
			var p TemplateListParams
			if err := jsonrpc.DecodeParams(raw, &p); err != nil {
				return nil, err
			}
			ts, err := b.ListTemplates(ctx, p.UniverseID)
			if err != nil {
				return nil, err
			}
			return TemplateListResult{Templates: ts}, nil
		},
		MethodTargetCreate: func(ctx context.Context, raw json.RawMessage) (any, error) {
			var p CreateParams
			if err := jsonrpc.DecodeParams(raw, &p); err != nil {
				return nil, err
			}
			return observed(b.CreateTarget(ctx, p))
		},
		MethodTargetGet: targetMethod(b.GetTarget),
		MethodTargetSet: func(ctx context.Context, raw json.RawMessage) (any, error) {
			if !caps.Power {
				return nil, jsonrpc.CapabilityUnavailable("power", "This provider does not serve target/setPower: its initialize answer does not advertise the power capability.")
			}
			var p SetPowerParams
			if err := jsonrpc.DecodeParams(raw, &p); err != nil {
				return nil, err
			}
			return observed(b.SetPower(ctx, p.Target, p.Power))
		},
		MethodTargetClose: targetMethod(b.CloseTarget),
		MethodIngressEnsure: capabilityGuard(caps.Ingress, "ingress", MethodIngressEnsure,
			targetMethod(b.EnsureIngress)),
		MethodIngressRemove: capabilityGuard(caps.Ingress, "ingress", MethodIngressRemove,
			targetMethod(b.RemoveIngress)),
	}
}

func targetMethod(f func(context.Context, TargetRef) (Observation, error)) jsonrpc.Method {
	return func(ctx context.Context, raw json.RawMessage) (any, error) {
		var p TargetParams
		if err := jsonrpc.DecodeParams(raw, &p); err != nil {
			return nil, err
		}
		return observed(f(ctx, p.Target))
	}
}

func capabilityGuard(served bool, capability, method string, m jsonrpc.Method) jsonrpc.Method {
	if served {
		return m
	}
	return func(context.Context, json.RawMessage) (any, error) {
		return nil, jsonrpc.CapabilityUnavailable(capability, "This provider does not serve %s: its initialize answer does not advertise the %s capability.", method, capability)
	}
}

func observed(o Observation, err error) (any, error) {
	if err != nil {
		return nil, err
	}
	return TargetResult{Target: o}, nil
}
