// Command incus-provider serves Lightspeed's controller plane on Incus: see
// docs/configuration.md for its configuration.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/serve"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
)

func main() {
	if code, done := handleArgs(os.Args[1:], os.Stdout, os.Stderr); done {
		os.Exit(code)
	}
	cfg, err := loadConfig(os.Environ())
	if err != nil {
		printRefusals(os.Stderr, "incus-provider: ", err)
		os.Exit(exitBadSetting)
	}
	log, level, err := newLogger(cfg.LogLevel)
	if err != nil {
		fmt.Fprintln(os.Stderr, "incus-provider: "+err.Error())
		os.Exit(exitBadSetting)
	}
	if cfg.memoryLimitBytes > 0 {
		// A soft limit: the collector works harder as the heap nears it,
		// so garbage from large frames is returned before it piles up.
		debug.SetMemoryLimit(cfg.memoryLimitBytes)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, log, level); err != nil {
		_ = log.Sync()
		// One sentence, once: the JSON log would repeat it with a stack.
		fmt.Fprintln(os.Stderr, "incus-provider: "+err.Error())
		stop()
		os.Exit(exitCode(err))
	}
	_ = log.Sync()
}

// switchedLog is the named logger when its setting is on, else nil. Its
// lines are info: they stay at every level but warn and error, where an
// operator asked for problems alone.
func switchedLog(setting string, log *zap.Logger, name string) *zap.Logger {
	if setting != "on" {
		return nil
	}
	return log.Named(name)
}

// newLogger builds the JSON logger at level; the level it answers is the
// one a SIGHUP changes in place.
func newLogger(level string) (*zap.Logger, zap.AtomicLevel, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, zap.AtomicLevel{}, fmt.Errorf("PROVIDER_LOG_LEVEL=%q is not valid: %w", level, err)
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(lvl)
	zc.Sampling = nil
	// An error log is an operator's sentence, not a defect report.
	zc.DisableStacktrace = true
	zc.EncoderConfig.TimeKey = "time"
	zc.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	l, err := zc.Build()
	if err != nil {
		return nil, zap.AtomicLevel{}, fmt.Errorf("build logger: %w", err)
	}
	return l, zc.Level, nil
}

func run(ctx context.Context, cfg config, log *zap.Logger, level zap.AtomicLevel) error {
	// The files the settings name were read by loadConfig, before
	// anything here touches Incus.
	credential := cfg.credential
	rl := &reloader{cfg: cfg, log: log, credential: credential, level: level}
	if cfg.tlsCert != nil {
		rl.cert.Store(cfg.tlsCert)
	}
	if cfg.edgeCert != nil {
		rl.edgeCert.Store(cfg.edgeCert)
	}
	// From here a SIGHUP is a reload, never the default (the end of the
	// process); one that comes before serving is taken once serving.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	incusMetrics := newIncusMetrics(reg)

	ic := cfg.incusConfig()
	ic.Observe, ic.ObserveEndpoint = incusMetrics.observe, incusMetrics.observeEndpoint
	client, err := incus.New(ic)
	if err != nil {
		return badSetting(fmt.Errorf("incus client: %w", err))
	}
	watchEndpoints(reg, client)
	incusMetrics.watchAttempts(client)
	registerBuildInfo(reg)
	registerLimits(reg, cfg)
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	server, err := client.GetServer(startCtx)
	if err != nil {
		return fmt.Errorf("incus is not reachable (%s): %w", incusWhere(cfg), err)
	}
	if err := checkProject(startCtx, client, cfg); err != nil {
		return err
	}
	catalog, err := loadCatalog(startCtx, cfg, client, server)
	if err != nil {
		return err
	}
	if server.Environment.ServerClustered && len(cfg.incusURLs) > 1 {
		// Which endpoint is which member: calls about an instance go
		// first to the member that holds it (incus/affinity.go).
		if _, err := client.ListClusterMembers(startCtx); err != nil {
			return fmt.Errorf("incus cluster members (%s): %w", incusWhere(cfg), err)
		}
	}
	rl.client, rl.server = client, server
	rl.catalog.Store(catalog)
	cancel()

	kind, member := guestDialerFor(cfg, server)
	if err := checkSeesIncus(cfg, server, kind); err != nil {
		return err
	}
	if len(cfg.peers) > 0 && kind != guest.KindMember {
		return fmt.Errorf("PROVIDER_PEERS=%q: forwarding to other members' replicas needs the member dialer (a cluster, with PROVIDER_INCUS_MEMBER set), and this replica uses %s", cfg.Peers, kind)
	}
	// One set of forwarding secrets for the dialer and the peer server,
	// which SIGHUP replaces; nil when the replicas do not forward.
	var peerSecrets *guest.PeerSecrets
	if cfg.peerSecrets != nil {
		if peerSecrets, err = guest.NewPeerSecrets(cfg.peerSecrets); err != nil {
			return badSetting(fmt.Errorf("PROVIDER_PEER_SECRET_FILE=%q: %w", cfg.PeerSecretFile, err))
		}
		rl.peerSecrets = peerSecrets
	}
	peerMx := newPeerMetrics(reg, cfg.peers)
	peerLog := &peerLog{log: log.Named("peers")}
	dialer, err := guest.New(kind, guest.Options{
		Lookup: client.InitPID, SocketDir: cfg.GuestSocketDir, Member: member,
		Located: client.LocatedInitPID,
		Exec: func(ctx context.Context, instance string, argv []string) (net.Conn, error) {
			return client.ExecStream(ctx, instance, argv)
		},
		Peers: cfg.peers, PeerSecrets: peerSecrets, ObserveForward: peerLog.client(peerMx),
	})
	if err != nil {
		return badSetting(fmt.Errorf("PROVIDER_GUEST_DIALER=%q: %w", cfg.GuestDialer, err))
	}
	log.Info("guest dialer", zap.String("kind", kind), zap.String("member", member), zap.Bool("clustered", server.Environment.ServerClustered))

	if cfg.Replica == "" {
		cfg.Replica = defaultReplica(cfg.Listen)
	}
	// The service's own context outlives the signal: on SIGTERM the drain
	// below decides when each part ends (Stop cancels it), so that a
	// connection is not cut while the drain still serves it.
	srvCtx, cancelServe := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelServe()
	prov, err := provider.New(srvCtx, provider.Config{
		Incus: client, Catalog: catalog, Dialer: dialer, Credential: credential, Log: log, Metrics: reg,
		GracefulStop: cfg.GracefulStop, ReconcileInterval: cfg.ReconcileInterval, MaxInFlight: cfg.MaxInFlight,
		RelayIdleTimeout: cfg.RelayIdleTimeout, RouteMaxHeld: cfg.RouteMaxHeld, RoutePath: cfg.RoutePath,
		DecodeBudget: cfg.decodeBudgetBytes, MaxControlConnections: cfg.MaxControl, Replica: cfg.Replica,
		Replicas:    replicaCount(member, cfg.peers),
		IngressBase: cfg.ingressBase, NoCache: !cfg.cacheOn, CacheCorrection: cfg.CacheCorrection,
		WarmBurstWindow: cfg.WarmBurstWindow, WarmShrinkAfter: cfg.WarmShrinkAfter, WarmMemoryMax: cfg.warmMemoryMaxBytes,
		Audit: switchedLog(cfg.AuditLog, log, "audit"), AccessLog: switchedLog(cfg.AccessLog, log, "access"),
		PeerWakes: guest.PeerWakes(dialer),
	})
	if err != nil {
		return err
	}
	// The listener's own hardening: a ceiling on open connections, HTTP
	// timeouts that spare upgraded WebSockets, request bodies refused unread.
	serveOpts := serve.Options{MaxConnections: cfg.MaxConnections, Metrics: serve.NewMetrics(reg), Log: log.Named("listener"), PlainHTTP: cfg.TLSCert == ""}
	if cfg.TLSCert != "" {
		serveOpts.TLS = rl.tlsConfig() // past the ceiling, a dial is answered 503 over TLS too
	}
	main := serve.Server(prov.Handler(), serveOpts, log.Named("http"))
	rawLn, scheme, err := listen(ctx, cfg)
	if err != nil {
		return err
	}
	ln := serve.Listener(rawLn, serveOpts)
	rl.targets = prov.Targets
	if cfg.TLSCert != "" {
		main.TLSConfig = rl.tlsConfig()
		// HTTP/1.1 alone in ALPN: a WebSocket opens by an HTTP/1.1
		// upgrade, and a client that offers h2 first would be given it
		// and could not upgrade (net/http offers h2 on TLS by default).
		main.Protocols = new(http.Protocols)
		main.Protocols.SetHTTP1(true)
	}

	// The second listener serves the same handler on TCP, so that a
	// controller on a unix socket still has a data route base a runtime
	// can dial; it shares the first one's hardening and TLS.
	var routeSrv *http.Server
	var routeLn net.Listener
	if cfg.RouteListen != "" {
		var lc net.ListenConfig
		raw, err := lc.Listen(ctx, "tcp", cfg.RouteListen)
		if err != nil {
			return bindError(fmt.Errorf("PROVIDER_ROUTE_LISTEN=%q cannot be bound: %w", cfg.RouteListen, err))
		}
		routeLn = serve.Listener(raw, serveOpts)
		routeSrv = serve.Server(prov.Handler(), serveOpts, log.Named("http"))
		routeSrv.TLSConfig, routeSrv.Protocols = main.TLSConfig, main.Protocols
	}

	var wg sync.WaitGroup
	var draining atomic.Bool // set on SIGTERM: /readyz answers 503 from then on
	errc := make(chan error, 5)
	if cfg.PeerListen != "off" {
		servePeer, err := servePeers(srvCtx, cfg, member, client, peerSecrets, peerMx, peerLog, prov.WakeForPeer)
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := servePeer(); err != nil {
				errc <- err
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		var err error
		if cfg.TLSCert != "" {
			err = main.ServeTLS(ln, "", "") // the certificate comes from TLSConfig
		} else {
			err = main.Serve(ln)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("controller listener: %w", err)
		}
	}()
	if routeSrv != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if cfg.TLSCert != "" {
				err = routeSrv.ServeTLS(routeLn, "", "")
			} else {
				err = routeSrv.Serve(routeLn)
			}
			if err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("route listener: %w", err)
			}
		}()
	}
	var metricsSrv *http.Server
	if cfg.MetricsListen != "off" {
		mmux := http.NewServeMux()
		mmux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		mmux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
		mmux.HandleFunc("/readyz", readyz(client, rl.catalog.Load, reachOf(kind, member, cfg.peers), server.Environment.ServerClustered, dialer,
			cacheStateOf(cfg.cacheOn, prov.Targets.CacheConfirmed), draining.Load))
		metricsSrv = &http.Server{Addr: cfg.MetricsListen, Handler: mmux, ReadHeaderTimeout: 10 * time.Second}
		var lc net.ListenConfig
		mln, err := lc.Listen(ctx, "tcp", cfg.MetricsListen)
		if err != nil {
			return bindError(fmt.Errorf("PROVIDER_METRICS_LISTEN=%q cannot be bound: %w", cfg.MetricsListen, err))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := metricsSrv.Serve(mln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("metrics listener: %w", err)
			}
		}()
	}

	var edgeSrv *http.Server
	if prov.Ingress != nil {
		edgeSrv = prov.Ingress.Server(log.Named("ingress-http"))
		var lc net.ListenConfig
		rawEdge, err := lc.Listen(ctx, "tcp", cfg.IngressListen)
		if err != nil {
			return fmt.Errorf("PROVIDER_INGRESS_LISTEN=%q cannot be bound: %w", cfg.IngressListen, err)
		}
		// The same ceiling on open connections as the controller's listener,
		// counted on its own.
		eln := serve.Listener(rawEdge, serve.Options{MaxConnections: cfg.MaxConnections, Log: log.Named("ingress-listener"), PlainHTTP: cfg.IngressTLSCert == ""})
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if cfg.IngressTLSCert != "" {
				// TLS brings HTTP/2 with it (ALPN h2, then http/1.1); the
				// certificate is whichever SIGHUP loaded last.
				edgeSrv.TLSConfig = rl.edgeTLSConfig()
				err = edgeSrv.ServeTLS(eln, "", "")
			} else {
				err = edgeSrv.Serve(eln)
			}
			if err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("ingress listener: %w", err)
			}
		}()
		log.Info("public ingress edge", zap.String("listen", cfg.IngressListen), zap.String("base", cfg.ingressBase.String()))
	}

	// Only now that every listener is bound does the provider act on
	// Incus (the reconciler, warm pools, the idle loop): a start that
	// fails on an address changes nothing there.
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := prov.Run(srvCtx); err != nil {
			errc <- err
		}
	}()

	ids := templateIDs(catalog)
	url := controlURL(cfg, scheme)
	routeBase := routeBaseURL(cfg, scheme)
	if routeBase == "" {
		log.Warn("the controller listens on a unix socket and PROVIDER_ROUTE_LISTEN is unset: no runtime can dial a data route; set PROVIDER_ROUTE_LISTEN, and register its ws:// or wss:// base with the provider")
	}
	log.Info("incus-provider is serving", zap.String("controller", url), zap.String("dataRouteBase", routeBase), zap.Strings("templates", ids),
		zap.String("guestDialer", dialer.Name()), zap.String("peerListen", cfg.PeerListen), zap.Int("peers", len(cfg.peers)), zap.String("incusProject", cfg.IncusProject), zap.String("replica", cfg.Replica),
		zap.Bool("credential", credential.Enabled()), zap.String("metrics", cfg.MetricsListen),
		zap.String("memoryLimit", cfg.MemoryLimit), zap.String("decodeBudget", cfg.DecodeBudget),
		zap.Int("maxConnections", cfg.MaxConnections), zap.Int("maxControlConnections", cfg.MaxControl))
	warnIfFewFiles(log, cfg.MaxConnections)
	fmt.Printf("controller URL: %s\n", url)
	if routeBase != "" {
		fmt.Printf("data route base: %s\n", routeBase)
	}
	fmt.Printf("templates: %s\n", strings.Join(ids, ", "))
	if prov.Ingress != nil {
		fmt.Printf("public ingress: %s (edge on %s)\n", cfg.ingressBase, cfg.IngressListen)
	}

	wg.Add(1)
	go func() {
		defer wg.Done()
		rl.watch(srvCtx, hup)
	}()

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	}
	// The drain: readiness first, so a load balancer sends new
	// connections elsewhere while this process still serves them; then
	// the listeners close and the controller plane answers what it took
	// and goes away; then everything else ends (below).
	draining.Store(true)
	if runErr == nil && cfg.DrainDelay > 0 {
		log.Info("draining: /readyz answers 503; serving on until the load balancer has seen it", zap.Duration("delay", cfg.DrainDelay))
		time.Sleep(cfg.DrainDelay)
	}
	drainStart := time.Now()
	drainCtx, cancelDrain := context.WithTimeout(context.Background(), cfg.DrainTimeout)
	defer cancelDrain()
	_ = main.Shutdown(drainCtx)
	if routeSrv != nil {
		_ = routeSrv.Shutdown(drainCtx)
	}
	prov.Drain(drainCtx)
	log.Info("drained the controller plane: calls in flight answered, connections gone away",
		zap.Duration("took", time.Since(drainStart)), zap.Bool("timedOut", drainCtx.Err() != nil))
	log.Info("shutting down")
	shutdownCtx, cancelShutdown := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancelShutdown()
	if metricsSrv != nil {
		_ = metricsSrv.Shutdown(shutdownCtx)
	}
	edgeDone := make(chan struct{})
	go func() {
		defer close(edgeDone)
		if edgeSrv != nil {
			// A stream never goes idle by itself: the provider's stop
			// below closes every upstream connection, which ends it.
			_ = edgeSrv.Shutdown(shutdownCtx)
		}
	}()
	// Ends WebSocket connections (hijacked, so Shutdown does not), the
	// reconciler and the idle loop; waits for the relays' going-away closes.
	prov.Stop(shutdownCtx)
	<-edgeDone
	cancelServe()
	wg.Wait()
	return runErr
}

// guestDialerFor resolves PROVIDER_GUEST_DIALER=auto and the member this
// process runs on. A standalone server's guests are all local (netns). On a
// cluster, guests on this process's own member are dialled through netns
// and the rest through exec; the member is PROVIDER_INCUS_MEMBER, or, when
// the provider talks to its own member's unix socket, that member's name.
// Over HTTPS with no member named, no guest is taken for local: exec for all.
func guestDialerFor(cfg config, server *incus.Server) (kind, member string) {
	member = cfg.IncusMember
	if member == "" && cfg.IncusURL == "" && server.Environment.ServerClustered {
		member = server.Environment.ServerName
	}
	kind = cfg.GuestDialer
	if kind != "auto" {
		return kind, member
	}
	switch {
	case !server.Environment.ServerClustered:
		return guest.KindNetns, member
	case member != "":
		return guest.KindMember, member
	default:
		return guest.KindExec, member
	}
}

// defaultReplica names this process from its host and listen port: stable
// across restarts (so a restarted replica knows its own leases) and
// different for replicas on one host, which listen on different ports.
func defaultReplica(listen string) string {
	host, _ := os.Hostname()
	var b strings.Builder
	for _, r := range strings.ToLower(host) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		case b.Len() > 0:
			b.WriteByte('-')
		}
	}
	var port string
	if path, ok := strings.CutPrefix(listen, "unix:"); ok {
		// A socket's path, not a port, tells replicas on one host apart;
		// it can be as long as a path is, so it is named by a digest.
		sum := sha256.Sum256([]byte(path))
		port = "u" + hex.EncodeToString(sum[:4])
	} else if _, p, err := net.SplitHostPort(listen); err == nil {
		port = p
	}
	name := strings.Trim(b.String(), "-")
	if most := 32 - len(port) - 1; len(name) > most {
		name = strings.Trim(name[:max(most, 0)], "-")
	}
	if name == "" {
		name = "provider"
	}
	if id := name + "-" + port; targets.ValidReplica(id) {
		return id
	}
	return targets.RandomReplica()
}

// reachOf says in a line how guests are reached, for /readyz.
func reachOf(kind, member string, peers map[string]string) string {
	switch kind {
	case guest.KindMember:
		var through []string
		for m := range peers {
			if m != member {
				through = append(through, m)
			}
		}
		if len(through) == 0 {
			return "netns on member " + member + ", exec on every other member"
		}
		sort.Strings(through)
		return "netns on member " + member + ", through the replicas of " + strings.Join(through, ", ") + " on theirs (exec while one is unreachable), exec on every other member"
	case guest.KindExec:
		return "exec through the Incus API, on every member"
	default:
		return kind
	}
}

func incusWhere(cfg config) string {
	if cfg.IncusURL != "" {
		return "INCUS_URL=" + cfg.IncusURL
	}
	return "INCUS_SOCKET=" + cfg.IncusSocket
}

func listen(ctx context.Context, cfg config) (net.Listener, string, error) {
	var lc net.ListenConfig
	if path, ok := strings.CutPrefix(cfg.Listen, "unix:"); ok {
		if fi, err := os.Lstat(path); err == nil && fi.Mode()&fs.ModeSocket != 0 {
			_ = os.Remove(path) // a stale socket from an earlier run
		}
		ln, err := lc.Listen(ctx, "unix", path)
		if err != nil {
			return nil, "", bindError(fmt.Errorf("PROVIDER_LISTEN=%q cannot be bound: %w", cfg.Listen, err))
		}
		if err := os.Chmod(path, 0o660); err != nil {
			return nil, "", fmt.Errorf("PROVIDER_LISTEN=%q: restrict socket permissions: %w", cfg.Listen, err)
		}
		return ln, "unix", nil
	}
	ln, err := lc.Listen(ctx, "tcp", cfg.Listen)
	if err != nil {
		return nil, "", bindError(fmt.Errorf("PROVIDER_LISTEN=%q cannot be bound: %w", cfg.Listen, err))
	}
	if cfg.TLSCert != "" {
		return ln, "wss", nil
	}
	return ln, "ws", nil
}

func controlURL(cfg config, scheme string) string {
	if scheme == "unix" {
		return "unix://" + strings.TrimPrefix(cfg.Listen, "unix:")
	}
	return scheme + "://" + cfg.Listen + "/control"
}

// routeBaseURL is the data route base to register the provider with: the
// route listener's, else the controller listener's when it is TCP; empty
// when a runtime cannot dial one (a unix socket alone).
func routeBaseURL(cfg config, scheme string) string {
	wsScheme := "ws"
	if cfg.TLSCert != "" {
		wsScheme = "wss"
	}
	switch {
	case cfg.RouteListen != "":
		return wsScheme + "://" + cfg.RouteListen + cfg.RoutePath
	case scheme == "unix":
		return ""
	}
	return scheme + "://" + cfg.Listen + cfg.RoutePath
}

// readyz answers 200 while this process serves and 503 once it drains
// (SIGTERM): a load balancer takes a replica out for that alone. What
// Incus does is reported, not judged: an Incus that does not answer, or a
// template whose image is gone, is the same for every replica, and taking
// them all out of the balancer at once would turn typed, retryable
// answers (unavailable, and the alerts on Incus) into refused
// connections. The body says all of it; with several Incus endpoints it
// lists what the client knows of each, so an operator sees which members
// this replica can reach.
func readyz(client *incus.Client, catalogNow func() *templates.Catalog, reach string, clustered bool, dialer guest.Dialer, cacheState func() string, draining func() bool) http.HandlerFunc {
	report := &incusReport{client: client, catalogNow: catalogNow, clustered: clustered}
	return func(w http.ResponseWriter, r *http.Request) {
		status, verdict := http.StatusOK, "ok"
		if draining() {
			status, verdict = http.StatusServiceUnavailable, "draining: the process is stopping; new connections belong to other replicas"
		}
		incusLine, memberLines := report.lines(r.Context())
		body := verdict + "\n" + incusLine + "\n"
		if eps := client.Endpoints(); len(eps) > 1 {
			body += endpointLines(eps, time.Now())
		}
		body += "guests: " + reach + "\n" + peerLines(dialer)
		body += "observation cache: " + cacheState() + "\n"
		body += memberLines
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}
}

// readyzIncusEvery is how old /readyz's report of Incus may be. A load
// balancer checks every replica every second or so and reads only the
// status, which Incus does not decide: asked afresh each time, the report
// cost Incus a server GET, one image GET per template and, on a cluster, a
// member list, a second, per balancer and replica.
const readyzIncusEvery = 5 * time.Second

// incusReport is /readyz's lines about Incus, asked at most once per
// readyzIncusEvery, one asking at a time.
type incusReport struct {
	client     *incus.Client
	catalogNow func() *templates.Catalog
	clustered  bool

	mu             sync.Mutex
	at             time.Time
	incus, members string
}

func (r *incusReport) lines(ctx context.Context) (incusLine, memberLines string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.at.IsZero() && time.Since(r.at) < readyzIncusEvery {
		return r.incus, r.members
	}
	// Not the request's own context: the report is kept for the requests
	// after it, and a checker that hangs up must not leave "unreachable"
	// there for readyzIncusEvery.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Second)
	defer cancel()
	incusOK := true
	r.incus, r.members = "incus: ok", ""
	if _, err := r.client.GetServer(ctx); err != nil {
		incusOK, r.incus = false, "incus: unreachable; calls that need it answer unavailable"
	} else {
		for _, t := range r.catalogNow().All() {
			if _, err := r.client.GetImage(ctx, t.Fingerprint); err != nil {
				r.incus = "incus: ok; template " + t.Wire.TemplateID + ": image missing"
				break
			}
		}
	}
	if r.clustered && incusOK {
		// What Incus says of each member: a guest on one that is not
		// online is observed unknown until it is back.
		if members, err := r.client.ListClusterMembers(ctx); err == nil {
			for _, m := range members {
				r.members += "member " + m.ServerName + ": " + m.Status + "\n"
			}
		}
	}
	r.at = time.Now()
	return r.incus, r.members
}

// cacheStateOf says in words whether reads are answered from the
// observation cache. An unconfirmed cache is not a reason to be unready:
// reads then go to Incus, slower but as exact.
func cacheStateOf(on bool, confirmed func() bool) func() string {
	return func() string {
		switch {
		case !on:
			return "off (PROVIDER_OBSERVATION_CACHE=off); every read asks Incus"
		case confirmed():
			return "confirmed; reads are answered from it"
		default:
			return "not confirmed (the event stream is down or not yet listed); reads ask Incus"
		}
	}
}

// endpointLines is one line per Incus endpoint: up, or down since when,
// after how many failures in a row, and the last error.
func endpointLines(eps []incus.EndpointState, now time.Time) string {
	var b strings.Builder
	for _, ep := range eps {
		if ep.Healthy {
			fmt.Fprintf(&b, "incus endpoint %s: up\n", ep.URL)
			continue
		}
		fmt.Fprintf(&b, "incus endpoint %s: down since %s (%s ago, %d failures in a row, retried after %s): %s\n",
			ep.URL, ep.DownSince.UTC().Format(time.RFC3339), now.Sub(ep.DownSince).Round(time.Second),
			ep.Failures, ep.RetryAt.UTC().Format(time.RFC3339), ep.LastError)
	}
	return b.String()
}

// warnIfFewFiles says so when the open-file limit is below the connection
// ceiling (and what else the provider holds open): past it, accept fails
// rather than the ceiling refusing. Go raises the soft limit to the hard one
// at start; the systemd unit sets LimitNOFILE.
func warnIfFewFiles(log *zap.Logger, maxConnections int) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return
	}
	if want := uint64(maxConnections) + 1024; lim.Cur < want {
		log.Warn("the open-file limit is below PROVIDER_MAX_CONNECTIONS and what the provider holds besides; raise it (LimitNOFILE) or lower the ceiling",
			zap.Uint64("openFileLimit", lim.Cur), zap.Int("maxConnections", maxConnections))
	}
}

// replicaCount is how many replicas serve the project: the members named in
// PROVIDER_PEERS and this replica's own (which the list may name too).
func replicaCount(member string, peers map[string]string) int {
	n := len(peers)
	if _, named := peers[member]; !named || member == "" {
		n++
	}
	return n
}
