// Command ingressbench measures the public ingress edge on the real Incus
// with the development guest's web app, in one run, and prints a table:
//
//   - small GETs (64-byte answers on a kept-alive connection): latency
//     through the edge versus a direct HTTP connection into the guest's
//     network namespace (the provider's own GuestDialer to the app's port),
//     p50 and p95, and the edge/direct ratio (goal ≤ 1.3×);
//   - 1 MiB bodies each way (downloads of /bytes, uploads to /count):
//     throughput through the edge versus direct (goal ≥ 0.9×);
//   - a 1 GiB download through the edge: throughput, and the process's
//     resident set before and at its peak (goal: flat);
//   - wake on request: the first GET after a pause and after a stop, p50
//     and p95 over -wakes each, and how many were answered 200 at once;
//   - -flood requests per second of random unknown hosts for -flood-for:
//     the Incus calls the provider made meanwhile (goal: none), and the
//     small-GET latency of the known host under the flood.
//
// With -peers (issue 29), the small GETs (p50 and p99), the 1 MiB bodies
// and the large download (with the proxy's resident set) are measured on
// direct, the byte relay, the edge and three peers, nginx, HAProxy and
// Caddy, each a reverse proxy started by this process in front of the
// byte relay, and so are -conns clients kept alive sending small GETs for
// -conns-for; the table sets each row beside the best peer (peers.go,
// peerbench.go; deploy/dev/ingresspeers.sh installs the peers and runs it).
//
// The provider runs in this process (provider.New, the edge on a loopback
// listener of its own). The small GETs and the 1 MiB bodies are sent from
// a child process of this binary (-client process, the default), as a real
// client is never in the edge's process; -client inline sends them from
// this one, the shape of earlier runs. -procs sets this process's
// GOMAXPROCS. It needs root (the netns GuestDialer), a running
// Incus and the development guest image (deploy/guest/build-image.sh). It
// works in an Incus project of its own, lsbench-<random>, and removes it
// at the end, also on an error or Ctrl-C. Everything it dials is on
// loopback or inside the guest's network namespace: *.localhost hosts are
// never looked up.
//
// Usage:
//
//	go build -o bin/ingressbench ./cmd/ingressbench
//	sudo bin/ingressbench [-image lightspeed-dev-guest] [-gets 2000] [-mib 64] [-gib 1] [-wakes 10] [-flood 1000] [-flood-for 3s] [-client process|inline] [-procs N]
//	sudo bin/ingressbench -peers -wakes 0 -flood 0 [-gets 1000] [-mib 64] [-gib 1] [-conns 1000] [-conns-for 5s] [-rounds 2] [-procs N] [-cpuprofile FILE]
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
)

type config struct {
	socket, image    string
	gets, mib, wakes int
	gib              int
	flood            int
	floodFor         time.Duration
	cpuprofile       string
	client           string
	procs            int
	peers            bool
	conns, rounds    int
	connsFor         time.Duration
}

func main() {
	var cfg config
	flag.StringVar(&cfg.socket, "socket", "/var/lib/incus/unix.socket", "the Incus unix socket")
	flag.StringVar(&cfg.image, "image", "lightspeed-dev-guest", "the dev guest image alias")
	flag.IntVar(&cfg.gets, "gets", 2000, "small GETs each way measured")
	flag.IntVar(&cfg.mib, "mib", 64, "1 MiB bodies each way measured")
	flag.IntVar(&cfg.gib, "gib", 1, "GiB of the large download (0 skips it)")
	flag.IntVar(&cfg.wakes, "wakes", 10, "wakes on request from paused and from stopped")
	flag.IntVar(&cfg.flood, "flood", 1000, "unknown-host requests per second")
	flag.DurationVar(&cfg.floodFor, "flood-for", 3*time.Second, "how long the unknown-host flood lasts")
	flag.StringVar(&cfg.cpuprofile, "cpuprofile", "", "write a CPU profile of the small GETs and the 1 MiB bodies to this file (of the edge alone with -client process)")
	flag.StringVar(&cfg.client, "client", "process", "where the small GETs and 1 MiB bodies are sent from: process (a process of their own) or inline (this one)")
	flag.IntVar(&cfg.procs, "procs", 0, "GOMAXPROCS of this process, the edge's (0 keeps Go's default; the client process keeps its own)")
	flag.BoolVar(&cfg.peers, "peers", false, "measure direct, the byte relay, the edge, nginx, HAProxy and Caddy in turns (issue 29) instead of edge / direct / byte relay")
	flag.IntVar(&cfg.conns, "conns", 1000, "with -peers: concurrent kept-alive clients (0 skips them)")
	flag.DurationVar(&cfg.connsFor, "conns-for", 5*time.Second, "with -peers: how long the concurrent clients send")
	flag.IntVar(&cfg.rounds, "rounds", 2, "with -peers: rounds of the large download and of the concurrent clients, each path once a round")
	clientJobArg := flag.String("client-job", "", "internal: run as the measuring client process of this job")
	peerJobArg := flag.String("peer-job", "", "internal: run as the measuring client process of this peer-comparison phase")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *clientJobArg != "" {
		if err := runClient(ctx, *clientJobArg); err != nil {
			fmt.Fprintln(os.Stderr, "ingressbench client:", err)
			os.Exit(1)
		}
		return
	}
	if *peerJobArg != "" {
		if err := runPeerJob(ctx, *peerJobArg); err != nil {
			fmt.Fprintln(os.Stderr, "ingressbench client:", err)
			os.Exit(1)
		}
		return
	}
	if cfg.procs > 0 {
		runtime.GOMAXPROCS(cfg.procs)
	}
	if cfg.client != "process" && cfg.client != "inline" {
		fmt.Fprintf(os.Stderr, "ingressbench: -client is process or inline, not %q\n", cfg.client)
		os.Exit(2)
	}
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "ingressbench:", err)
		os.Exit(1)
	}
}

func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "ingressbench: "+format+"\n", args...)
}

func run(ctx context.Context, cfg config) error {
	var incusCalls atomic.Int64
	root, err := incus.New(incus.Config{Socket: cfg.socket})
	if err != nil {
		return fmt.Errorf("incus client: %w", err)
	}
	defer root.Close()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := root.GetImageAlias(sctx, cfg.image); err != nil {
		return fmt.Errorf("image alias %q (build it with deploy/guest/build-image.sh): %w", cfg.image, err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	project := "lsbench-" + hex.EncodeToString(b[:])
	if err := root.CreateProject(sctx, project, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		return fmt.Errorf("create project %s: %w", project, err)
	}
	defer removeProject(root, project)
	client, err := incus.New(incus.Config{Socket: cfg.socket, Project: project,
		Observe: func(string, string, time.Duration) { incusCalls.Add(1) }})
	if err != nil {
		return fmt.Errorf("incus client: %w", err)
	}
	defer client.Close()

	work, err := os.MkdirTemp("", "ingressbench-")
	if err != nil {
		return fmt.Errorf("temporary directory: %w", err)
	}
	defer func() { _ = os.RemoveAll(work) }()
	tmplPath := filepath.Join(work, "templates.yaml")
	if err := os.WriteFile(tmplPath, []byte(fmt.Sprintf(`templates:
  - templateId: bench
    displayName: ingressbench guest
    powerStates: [running, paused, stopped]
    publicIngress: true
    ingressPort: 8080
    imageAlias: %s
`, cfg.image)), 0o600); err != nil {
		return fmt.Errorf("write templates: %w", err)
	}
	catalog, err := templates.Load(tmplPath)
	if err != nil {
		return err
	}
	if err := catalog.Resolve(sctx, client); err != nil {
		return fmt.Errorf("resolve templates: %w", err)
	}
	dialer, err := guest.New(guest.KindNetns, guest.Options{Lookup: client.InitPID, SocketDir: work})
	if err != nil {
		return fmt.Errorf("netns dialer: %w", err)
	}
	var lc net.ListenConfig
	edgeLn, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("edge listener: %w", err)
	}
	base, err := ingressurl.Parse("http://{label}.localhost:" + strconv.Itoa(edgeLn.Addr().(*net.TCPAddr).Port))
	if err != nil {
		return fmt.Errorf("edge base: %w", err)
	}
	pctx, pcancel := context.WithCancel(ctx)
	defer pcancel()
	p, err := provider.New(pctx, provider.Config{Incus: client, Catalog: catalog, Dialer: dialer, IngressBase: &base,
		GracefulStop: 2 * time.Second, ReconcileInterval: 10 * time.Second})
	if err != nil {
		return fmt.Errorf("provider: %w", err)
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = p.Run(pctx) }()
	edgeSrv := p.Ingress.Server(nil)
	go func() { defer wg.Done(); _ = edgeSrv.Serve(edgeLn) }()
	defer func() {
		_ = edgeSrv.Close()
		stopCtx, c := context.WithTimeout(context.Background(), 10*time.Second)
		p.Stop(stopCtx)
		c()
		pcancel()
		wg.Wait()
	}()

	owner := controller.Owner{UniverseID: "u-bench", EnvironmentID: "ingressbench"}
	ref := controller.TargetRef{Owner: owner}
	progress("creating the target in %s", project)
	if _, err := p.Targets.CreateTarget(ctx, controller.CreateParams{Owner: owner, TemplateID: "bench"}); err != nil {
		return fmt.Errorf("create: %w", err)
	}
	if err := settle(ctx, p, ref, controller.PowerRunning); err != nil {
		return err
	}
	o, err := p.Targets.EnsureIngress(ctx, ref)
	if err != nil || o.Ingress == nil {
		return fmt.Errorf("ingress/ensure: %+v, %w", o, err)
	}
	endpoint := o.Ingress.Endpoint
	name := targets.Name(owner)

	// The floor of any second hop: a byte relay that parses nothing, on
	// its own loopback listener, to the app through the same GuestDialer.
	// io.Copy between the two sockets splices, so it copies nothing in
	// user space either.
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("byte relay listener: %w", err)
	}
	relayLn := &trackedListener{Listener: ln, conns: map[net.Conn]struct{}{}}
	var rwg sync.WaitGroup
	rctx, rcancel := context.WithCancel(ctx)
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		byteRelay(rctx, relayLn, func(ctx context.Context) (net.Conn, error) {
			return dialer.DialContext(ctx, guest.Target{Instance: name, Port: 8080})
		})
	}()
	defer func() { rcancel(); _ = relayLn.Close(); rwg.Wait() }()
	job := clientJob{Edge: edgeLn.Addr().String(), Relay: relayLn.Addr().String(), Instance: name,
		Endpoint: endpoint, Gets: cfg.gets, MiB: cfg.mib}
	edge, direct, floor := clients(job, dialer)
	// The direct client names the same host, so the app answers alike.
	if err := waitOK(ctx, edge, endpoint+"/"); err != nil {
		return err
	}
	var rows [][]string
	row := func(cells ...string) { rows = append(rows, cells) }
	if cfg.peers {
		pid, err := client.InitPID(ctx, name)
		if err != nil {
			return fmt.Errorf("the guest's init PID: %w", err)
		}
		if err := runPeers(ctx, cfg, peerSetup{edge: edgeLn.Addr().String(), relay: relayLn.Addr().String(),
			instance: name, pid: pid, endpoint: endpoint, work: work, resetRelay: relayLn.closeAll}); err != nil {
			return err
		}
	} else if err := measureEdge(ctx, cfg, client, job, name, endpoint, edge, direct, floor, row); err != nil {
		return err
	}

	for _, from := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		if cfg.wakes == 0 {
			break
		}
		progress("wake on request from %s", from)
		var ds []time.Duration
		first := 0
		for range cfg.wakes {
			if _, err := p.Targets.SetPower(ctx, ref, from); err != nil {
				return fmt.Errorf("setPower %s: %w", from, err)
			}
			if err := settle(ctx, p, ref, from); err != nil {
				return err
			}
			edge.CloseIdleConnections()
			start := time.Now()
			status, err := get(ctx, edge, endpoint+"/")
			if err != nil {
				return err
			}
			if status == http.StatusOK {
				first++
			} else if err := waitOK(ctx, edge, endpoint+"/"); err != nil {
				return err
			}
			ds = append(ds, time.Since(start))
		}
		w50, w95 := quantiles(ds)
		row("wake on request from "+string(from)+" p50 / p95", fmtDur(w50)+" / "+fmtDur(w95),
			fmt.Sprintf("%d of %d answered 200 at once", first, cfg.wakes))
	}

	if cfg.flood > 0 {
		progress("%d unknown hosts a second for %s", cfg.flood, cfg.floodFor)
		flood := clientTo(func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", edgeLn.Addr().String())
		})
		// What the provider asks of Incus anyway (reconcile passes, relay
		// leases) in a window as long as the flood's, without it.
		quietBefore := incusCalls.Load()
		if !clock.Sleep(ctx, cfg.floodFor) {
			return ctx.Err()
		}
		quiet := incusCalls.Load() - quietBefore
		fctx, fcancel := context.WithTimeout(ctx, cfg.floodFor)
		callsBefore := incusCalls.Load()
		var sent, notFound atomic.Int64
		var fwg sync.WaitGroup
		fwg.Add(1)
		go func() {
			defer fwg.Done()
			t := time.NewTicker(time.Second / time.Duration(cfg.flood))
			defer t.Stop()
			sem := make(chan struct{}, 64)
			for {
				select {
				case <-fctx.Done():
					return
				case <-t.C:
				}
				select {
				case sem <- struct{}{}:
				default:
					continue // the flood does not queue behind itself
				}
				fwg.Add(1)
				go func() {
					defer fwg.Done()
					defer func() { <-sem }()
					sent.Add(1)
					if s, err := get(fctx, flood, "http://"+ingressurl.NewLabel()+".localhost/"); err == nil && s == http.StatusNotFound {
						notFound.Add(1)
					}
				}()
			}
		}()
		k50, k95, err := latencies(fctx, edge, endpoint+"/bytes?n=64", 1<<30)
		fwg.Wait()
		fcancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		calls := incusCalls.Load() - callsBefore
		row(fmt.Sprintf("unknown hosts sent / answered 404 in %s", cfg.floodFor), fmt.Sprintf("%d / %d", sent.Load(), notFound.Load()), "")
		row("Incus calls in as long a window without, and with the flood", fmt.Sprintf("%d, %d", quiet, calls), goal(calls <= quiet+3, "no more than without (± a reconcile pass)"))
		row("known-host small GET p50 / p95 under the flood", fmtDur(k50)+" / "+fmtDur(k95), "")
	}

	if _, err := p.Targets.CloseTarget(ctx, ref); err != nil {
		progress("close: %v", err)
	}
	if len(rows) == 0 {
		return nil
	}
	if cfg.peers {
		fmt.Println()
	}
	fmt.Printf("ingressbench, %s, load average %s\n\n", time.Now().UTC().Format(time.RFC3339), loadAverage())
	fmt.Println("| measure | result | goal |")
	fmt.Println("| --- | --- | --- |")
	for _, r := range rows {
		fmt.Printf("| %s |\n", strings.Join(r, " | "))
	}
	return nil
}

// measureEdge is the edge against direct and the byte relay: small GETs,
// 1 MiB bodies, the large download (the rows before -peers).
func measureEdge(ctx context.Context, cfg config, client *incus.Client, job clientJob, name, endpoint string,
	edge, direct, floor *http.Client, row func(...string)) error {
	var err error
	// Edge and direct take turns, request by request, so that a machine
	// whose load changes during the run weighs on both alike.
	if cfg.cpuprofile != "" {
		stop, err := startProfile(cfg.cpuprofile)
		if err != nil {
			return err
		}
		defer stop()
	}
	var res clientResult
	if cfg.client == "process" {
		pid, err := client.InitPID(ctx, name)
		if err != nil {
			return fmt.Errorf("the guest's init PID: %w", err)
		}
		job.PID = pid
		res, err = measureApart(ctx, job)
		if err != nil {
			return err
		}
	} else if res, err = measure(ctx, job, edge, direct, floor); err != nil {
		return err
	}
	row("client; the edge process's GOMAXPROCS", fmt.Sprintf("%s; %d", cfg.client, runtime.GOMAXPROCS(0)), "")
	lat := res.Get
	e50, e95 := quantiles(lat[0])
	d50, d95 := quantiles(lat[1])
	f50, f95 := quantiles(lat[2])
	ratio := float64(e50) / float64(d50)
	row("small GET p50 / p95, edge", fmtDur(e50)+" / "+fmtDur(e95), "")
	row("small GET p50 / p95, direct", fmtDur(d50)+" / "+fmtDur(d95), "")
	row("small GET p50 / p95, byte relay", fmtDur(f50)+" / "+fmtDur(f95), "")
	row("small GET p50 ratio edge/direct", fmt.Sprintf("%.2f×", ratio), goal(ratio <= 1.3, "≤ 1.3×"))
	row("small GET p50 ratio byte relay/direct, edge/byte relay",
		fmt.Sprintf("%.2f×, %.2f×", float64(f50)/float64(d50), float64(e50)/float64(f50)), "")

	for i, took := range [][][]time.Duration{res.Download, res.Upload} {
		dir := []string{"download", "upload"}[i]
		et, dt, ft := mbps(took[0]), mbps(took[1]), mbps(took[2])
		row("1 MiB "+dir+", edge / direct / byte relay", fmt.Sprintf("%.0f / %.0f / %.0f MB/s", et, dt, ft), "")
		row("1 MiB "+dir+" ratio edge/direct", fmt.Sprintf("%.2f×", et/dt), goal(et/dt >= 0.9, "≥ 0.9×"))
		row("1 MiB "+dir+" ratio byte relay/direct, edge/byte relay", fmt.Sprintf("%.2f×, %.2f×", ft/dt, et/ft), "")
	}

	if cfg.gib > 0 {
		progress("%d GiB download", cfg.gib)
		n := int64(cfg.gib) << 30
		var got int64
		var took time.Duration
		before, peak, err := peakDuring(rss, func() error {
			start := time.Now()
			var err error
			got, err = download(ctx, edge, fmt.Sprintf("%s/bytes?n=%d", endpoint, n))
			took = time.Since(start)
			return err
		})
		if err != nil || got != n {
			return fmt.Errorf("the %d GiB download: %d bytes, %w", cfg.gib, got, err)
		}
		growth := peak - before
		row(fmt.Sprintf("%d GiB download through the edge", cfg.gib), fmt.Sprintf("%.0f MB/s", float64(n)/took.Seconds()/1e6), "")
		row("resident set before / peak", fmt.Sprintf("%d / %d MiB", before>>20, peak>>20), goal(growth < 32<<20, "flat (< 32 MiB growth)"))
	}

	return nil
}

func goal(met bool, what string) string {
	if met {
		return what + ": met"
	}
	return what + ": MISSED"
}

// byteRelay serves ln until ctx ends: each connection is carried to a
// connection of its own from dial, byte for byte both ways.
func byteRelay(ctx context.Context, ln net.Listener, dial func(context.Context) (net.Conn, error)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			up, err := dial(ctx)
			if err != nil {
				return
			}
			defer up.Close()
			stop := context.AfterFunc(ctx, func() { _ = c.Close(); _ = up.Close() })
			defer stop()
			// The copies take the bare TCP connection, which splices; a
			// wrapper (trackedConn) would hide it.
			raw := c
			if t, ok := c.(*trackedConn); ok {
				raw = t.Conn
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				_, _ = io.Copy(up, raw)
				if tc, ok := up.(interface{ CloseWrite() error }); ok {
					_ = tc.CloseWrite()
				}
			}()
			_, _ = io.Copy(raw, up)
			_ = c.Close()
			<-done
		}()
	}
}

func clientTo(dial func(context.Context) (net.Conn, error)) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			DialContext:         func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) },
			MaxIdleConnsPerHost: 64,
			DisableCompression:  true,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Timeout:       10 * time.Minute,
	}
}

func get(ctx context.Context, c *http.Client, u string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, fmt.Errorf("request %s: %w", u, err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", u, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

func download(ctx context.Context, c *http.Client, u string) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, fmt.Errorf("request %s: %w", u, err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", u, err)
	}
	defer func() { _ = resp.Body.Close() }()
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil {
		return n, fmt.Errorf("read %s: %w", u, err)
	}
	return n, nil
}

func waitOK(ctx context.Context, c *http.Client, u string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		if s, err := get(ctx, c, u); err == nil && s == http.StatusOK {
			return nil
		}
		if !clock.Sleep(ctx, 100*time.Millisecond) {
			return fmt.Errorf("%s never answered 200: %w", u, ctx.Err())
		}
	}
}

// latencies runs n GETs one after another (or until ctx ends) on one
// kept-alive connection and answers their p50 and p95.
func latencies(ctx context.Context, c *http.Client, u string, n int) (time.Duration, time.Duration, error) {
	var ds []time.Duration
	for i := 0; i < n && ctx.Err() == nil; i++ {
		start := time.Now()
		s, err := get(ctx, c, u)
		if err != nil {
			if ctx.Err() != nil && len(ds) > 0 {
				break
			}
			return 0, 0, err
		}
		if s != http.StatusOK {
			return 0, 0, fmt.Errorf("GET %s answered %d", u, s)
		}
		ds = append(ds, time.Since(start))
	}
	if len(ds) == 0 {
		return 0, 0, fmt.Errorf("no GET of %s finished: %w", u, ctx.Err())
	}
	p50, p95 := quantiles(ds)
	return p50, p95, nil
}

// interleaved runs op n times on each client in turn and answers each
// client's durations.
func interleaved(n int, op func(*http.Client) error, clients ...*http.Client) ([][]time.Duration, error) {
	out := make([][]time.Duration, len(clients))
	for range n {
		for i, c := range clients {
			start := time.Now()
			if err := op(c); err != nil {
				return nil, fmt.Errorf("%s: %w", []string{"edge", "direct", "byte relay"}[min(i, 2)], err)
			}
			out[i] = append(out[i], time.Since(start))
		}
	}
	return out, nil
}

// mbps is the throughput of 1 MiB moved in each of ds.
func mbps(ds []time.Duration) float64 {
	var total time.Duration
	for _, d := range ds {
		total += d
	}
	return float64(len(ds)) * (1 << 20) / total.Seconds() / 1e6
}

var mib = bytes.Repeat([]byte("y"), 1<<20)

// moveMiB downloads 1 MiB from /bytes, or uploads 1 MiB to /count.
func moveMiB(ctx context.Context, c *http.Client, endpoint, dir string) error {
	var req *http.Request
	var err error
	if dir == "download" {
		req, err = http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"/bytes?n=1048576", nil)
	} else {
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, endpoint+"/count", bytes.NewReader(mib))
	}
	if err != nil {
		return fmt.Errorf("request: %w", err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	var n int64
	var answer []byte
	if dir == "download" {
		n, err = io.CopyBuffer(io.Discard, struct{ io.Reader }{resp.Body}, answerBuf)
	} else {
		answer, err = io.ReadAll(io.LimitReader(resp.Body, 64))
	}
	_ = resp.Body.Close()
	switch {
	case err != nil:
		return fmt.Errorf("%s: reading the answer: %w", dir, err)
	case dir == "download" && n != 1<<20:
		return fmt.Errorf("download: %d bytes", n)
	case dir == "upload" && strings.TrimSpace(string(answer)) != "1048576":
		return fmt.Errorf("upload: answered %d, the app counted %q", resp.StatusCode, answer)
	}
	return nil
}

// answerBuf is the one buffer every download is read into (the phases run
// one request at a time). io.ReadAll grew a fresh buffer for each 1 MiB
// answer: in a profile of this benchmark, zeroing those buffers and
// collecting them took half the process's CPU, on the same two cores as
// the edge it measures, so the client, not the path, set the download
// figures (about 200 MB/s each way). The struct hides the body's WriteTo,
// so that the copy reads through this buffer.
var answerBuf = make([]byte, 256<<10)

func quantiles(ds []time.Duration) (time.Duration, time.Duration) {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2], s[min(len(s)-1, len(s)*95/100)]
}

func fmtDur(d time.Duration) string {
	if d < time.Millisecond {
		return fmt.Sprintf("%.0f µs", float64(d)/1e3)
	}
	return fmt.Sprintf("%.1f ms", float64(d)/1e6)
}

// settle waits until the target is active at power with nothing under way.
func settle(ctx context.Context, p *provider.Provider, ref controller.TargetRef, power controller.Power) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for {
		o, err := p.Targets.GetTarget(ctx, ref)
		if err == nil && o.Phase == controller.PhaseActive && o.Power == power && o.Message == "" {
			return nil
		}
		if !clock.Sleep(ctx, 50*time.Millisecond) {
			return fmt.Errorf("the target never settled at %s: last %+v, %w", power, o, err)
		}
	}
}

// rss is the process's resident set in bytes (0 when unknown).
func rss() int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize())
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "unknown"
}

// removeProject deletes the project with everything in it, in the one
// call the server offers for that (instances are killed first).
func removeProject(root *incus.Client, project string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := root.ForceDeleteProject(ctx, project); err != nil && !errors.Is(err, incus.ErrNotFound) {
		progress("could not delete the project %s: %v", project, err)
	}
}

// startProfile writes a CPU profile of the process (the provider's edge,
// the clients and the direct path alike) until its stop is called.
func startProfile(path string) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); _ = f.Close() }, nil
}
