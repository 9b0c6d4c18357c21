// Package provider assembles the service from its parts: the targets on
// Incus and their reconciler, the relay registry, the wake, the data
// routes, the public ingress edge, the idle loop and the controller plane. It is the one wiring of them: the command,
// the benchmarks and the integration tests all build the provider here, so
// a test runs the provider that ships.
package provider

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/ingress"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/routes"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// Config is what the provider is built from. Incus, Catalog (resolved) and
// Dialer are required; zero values of the rest take their parts' defaults.
type Config struct {
	Incus      *incus.Client
	Catalog    *templates.Catalog
	Dialer     guest.Dialer
	Credential bearer.Credential
	// Audit, when set, logs every controller call answered; AccessLog,
	// when set, every request the public edge answers.
	Audit, AccessLog *zap.Logger
	Log              *zap.Logger
	// Metrics is where the provider's collectors are registered; nil
	// registers none.
	Metrics prometheus.Registerer

	GracefulStop      time.Duration
	ReconcileInterval time.Duration
	MaxInFlight       int
	RelayIdleTimeout  time.Duration
	RouteMaxHeld      int
	// RoutePath is the path the data routes are served under
	// (routes.DefaultPrefix when empty).
	RoutePath string
	// RelayCloseWait bounds how long a relay told to go away may take to
	// end before it is killed (default 4 s).
	RelayCloseWait time.Duration
	// DecodeBudget is the bytes of large controller frames decoded at once
	// across every connection (default DefaultDecodeBudget; see
	// jsonrpc.Budget).
	DecodeBudget int64
	// MaxControlConnections bounds the open controller connections
	// (default controller.DefaultMaxConnections).
	MaxControlConnections int
	// Replica names this process among the provider replicas serving one
	// Incus project (1-32 of a-z, 0-9 and -); default a random id. It names
	// the relay lease this process keeps on the instances it relays to.
	// Replicas is how many replicas serve the project (default 1): each
	// keeps its share of a pool of ready spares.
	Replica  string
	Replicas int
	// NoCache turns the observation cache off: every read asks Incus.
	NoCache bool
	// CacheCorrection is the period of the cache's correcting full list
	// (targets.Config.CacheCorrection).
	CacheCorrection time.Duration
	// WarmBurstWindow and WarmShrinkAfter size the warm pools by demand
	// (targets.Config).
	WarmBurstWindow, WarmShrinkAfter time.Duration
	// WarmMemoryMax is targets.Config.WarmMemoryMax.
	WarmMemoryMax int64
	// IngressBase is the public ingress edge's base URL; nil serves no
	// public ingress (the capability is not advertised).
	IngressBase *ingressurl.Base
	// PeerWakes, on a cluster whose replicas forward to each other
	// (guest.PeerWakes of the dialer), has each powered-down target woken
	// by one replica; nil: each replica wakes the targets its uses find.
	PeerWakes *guest.PeerWaker
	// WakeTrace is the wake's trace hook (wake.Options.Trace): a
	// benchmark's view of each wake a data-route dial started.
	WakeTrace func(wake.Trace)
}

// DefaultDecodeBudget is the default decode budget: four messages of the
// protocol's largest size.
const DefaultDecodeBudget = 64 << 20

// Provider is the assembled service.
type Provider struct {
	Targets *targets.Service
	Relays  *relays.Registry
	Wake    *wake.Waker
	Routes  *routes.Handler
	Idle    *idle.Loop
	Control *controller.Handler
	// Ingress is the public ingress edge; nil without an IngressBase. It
	// is served on a listener of its own (Ingress.Server).
	Ingress *ingress.Edge

	log       *zap.Logger
	peerWakes *guest.PeerWaker
	handler   http.Handler
	cancel    context.CancelFunc
	ctx       context.Context
}

// New builds the provider. ctx bounds everything it serves: when it ends,
// controller connections and relays are closed with going-away frames.
func New(ctx context.Context, cfg Config) (*Provider, error) {
	if cfg.Incus == nil || cfg.Catalog == nil || cfg.Dialer == nil {
		return nil, errors.New("provider: an Incus client, a resolved catalog and a guest dialer are required")
	}
	log := cfg.Log
	if log == nil {
		log = zap.NewNop()
	}
	closeWait := cfg.RelayCloseWait
	if closeWait <= 0 {
		closeWait = 4 * time.Second
	}
	reg := relays.New(closeWait)
	var warmMetrics *targets.WarmMetrics
	var cacheMetrics *targets.CacheMetrics
	// Every replica serving a project reports what the whole project holds
	// (its targets, its pools): the project label lets a dashboard count
	// each once (max by project) however many replicas report it.
	var projectMetrics prometheus.Registerer
	if cfg.Metrics != nil {
		projectMetrics = prometheus.WrapRegistererWith(prometheus.Labels{"project": cfg.Incus.Project()}, cfg.Metrics)
		warmMetrics = targets.NewWarmMetrics(projectMetrics)
		cacheMetrics = targets.NewCacheMetrics(cfg.Metrics)
	}
	svc, err := targets.New(cfg.Incus, cfg.Catalog, cfg.Dialer, reg, log.Named("targets"), targets.Config{
		GracefulStop: cfg.GracefulStop, ReconcileInterval: cfg.ReconcileInterval, Replica: cfg.Replica,
		Replicas: cfg.Replicas, IngressBase: cfg.IngressBase, WarmMetrics: warmMetrics, CacheMetrics: cacheMetrics, NoCache: cfg.NoCache,
		CacheCorrection: cfg.CacheCorrection, WarmBurstWindow: cfg.WarmBurstWindow, WarmShrinkAfter: cfg.WarmShrinkAfter, WarmMemoryMax: cfg.WarmMemoryMax,
	})
	if err != nil {
		return nil, err
	}
	var (
		wakeMetrics  *wake.Metrics
		routeMetrics *routes.Metrics
		idleMetrics  *idle.Metrics
		ctrlMetrics  *controller.Metrics
		edgeMetrics  *ingress.Metrics
	)
	if cfg.Metrics != nil {
		if cfg.IngressBase != nil {
			edgeMetrics = ingress.NewMetrics(cfg.Metrics)
		}
		wakeMetrics = wake.NewMetrics(cfg.Metrics)
		routeMetrics = routes.NewMetrics(cfg.Metrics)
		idleMetrics = idle.NewMetrics(projectMetrics)
		ctrlMetrics = controller.NewMetrics(cfg.Metrics)
	}
	ctx, cancel := context.WithCancel(ctx)
	var elsewhere wake.Elsewhere
	if cfg.PeerWakes != nil {
		elsewhere = peerWakes{p: cfg.PeerWakes, log: log.Named("wake")}
	}
	wk, err := wake.New(ctx, wake.Options{Targets: svc, Dialer: cfg.Dialer, Relays: reg, Metrics: wakeMetrics,
		Log: log.Named("wake"), Trace: cfg.WakeTrace, Elsewhere: elsewhere})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("wake: %w", err)
	}
	rh, err := routes.New(ctx, routes.Options{
		Targets:     svc,
		Wake:        wk,
		Dialer:      cfg.Dialer,
		Relays:      reg,
		Credential:  cfg.Credential,
		Metrics:     routeMetrics,
		Log:         log.Named("routes"),
		IdleTimeout: cfg.RelayIdleTimeout,
		MaxHeld:     cfg.RouteMaxHeld,
		Prefix:      cfg.RoutePath,
	})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("data routes: %w", err)
	}
	var edge *ingress.Edge
	if cfg.IngressBase != nil {
		edge, err = ingress.New(ingress.Options{Targets: svc, Waker: wk, Dialer: cfg.Dialer, Relays: reg,
			Base: *cfg.IngressBase, Metrics: edgeMetrics, Log: log.Named("ingress"), AccessLog: cfg.AccessLog})
		if err != nil {
			cancel()
			return nil, fmt.Errorf("ingress edge: %w", err)
		}
	}
	loop := idle.New(idle.Config{Inventory: IdleInventory{Targets: svc}, Dialer: cfg.Dialer, Metrics: idleMetrics, Log: log.Named("idle")})
	budget := cfg.DecodeBudget
	if budget <= 0 {
		budget = DefaultDecodeBudget
	}
	ctrl := controller.NewHandler(ctx, controller.Options{
		Backend:        svc,
		Capabilities:   controller.Capabilities{Power: true, Ingress: cfg.IngressBase != nil},
		Credential:     cfg.Credential,
		MaxInFlight:    cfg.MaxInFlight,
		MaxConnections: cfg.MaxControlConnections,
		DecodeBudget:   jsonrpc.NewBudget(budget, jsonrpc.DefaultBudgetWait),
		Metrics:        ctrlMetrics,
		Log:            log.Named("controller"),
		Audit:          cfg.Audit,
	})
	mux := http.NewServeMux()
	// The contract allows any path for a controller URL (and a unix://
	// registration names none): every path outside the data routes serves
	// the controller plane.
	mux.Handle("/", ctrl)
	mux.Handle(rh.Prefix()+"/", rh)
	return &Provider{Targets: svc, Relays: reg, Wake: wk, Routes: rh, Idle: loop, Control: ctrl, Ingress: edge,
		log: log, handler: mux, cancel: cancel, ctx: ctx, peerWakes: cfg.PeerWakes}, nil
}

// Handler serves the data routes under their prefix and the controller
// plane on every other path.
func (p *Provider) Handler() http.Handler { return p.handler }

// Run runs the reconciler and the idle loop until ctx ends (or the
// provider's own context does), and returns once both have stopped.
func (p *Provider) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(p.ctx, cancel)
	defer stop()
	var wg sync.WaitGroup
	errc := make(chan error, 2)
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := p.Targets.Run(ctx); err != nil {
			errc <- fmt.Errorf("reconciler: %w", err)
			cancel()
		}
	}()
	go func() {
		defer wg.Done()
		if err := p.Idle.Run(ctx); err != nil {
			errc <- fmt.Errorf("idle loop: %w", err)
			cancel()
		}
	}()
	wg.Wait()
	close(errc)
	return <-errc
}

// Drain ends the controller plane gracefully: every connection answers
// the calls it took (each within its own method bound), refuses new ones
// as retryable, and goes away. It returns when every controller
// connection has ended, or ctx does; Stop then ends the rest (relays, the
// edge, the loops). The listeners are the caller's to close first.
func (p *Provider) Drain(ctx context.Context) {
	p.Control.BeginDrain()
	p.Control.Drain(ctx)
}

// Stop ends what the provider serves: controller connections and relays
// get their going-away closes. It returns once the relays' closes are out
// and every controller connection has ended, or ctx ends.
func (p *Provider) Stop(ctx context.Context) {
	p.cancel()
	if p.Ingress != nil {
		p.Ingress.Close()
	}
	select {
	case <-p.Routes.Closed():
	case <-ctx.Done():
	}
	p.Control.Drain(ctx)
}
