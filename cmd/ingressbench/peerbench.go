package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// peerSetup is what the peer comparison needs of the run.
type peerSetup struct {
	edge, relay string // loopback listeners
	instance    string
	pid         int // the guest's init PID
	endpoint    string
	work        string
	// resetRelay closes every connection the byte relay carries, with
	// its connection into the guest.
	resetRelay func()
}

// pathRun is one path's figures over the comparison.
type pathRun struct {
	benchPath
	peer                     *peer // nil for direct, the byte relay, the edge
	get, down, up            []time.Duration
	largeBytes               int64
	largeTook                time.Duration
	rssBefore, rssPeak       int64 // of the large download's turn that grew most
	connsRSSPeak             int64
	requests, errs           int64
	elapsed                  time.Duration
	lat                      []time.Duration
	connected, connsRounds   int
	largeFailed, connsFailed int // turns that failed (counted, not fatal)
}

// rssOf samples the path's proxy's resident set: the peer's processes, or
// this process for the edge and the byte relay; 0 for direct.
func (r *pathRun) rssOf() int64 {
	switch {
	case r.peer != nil:
		return vmRSS(r.peer.pids())
	case r.Addr != "":
		return rss()
	}
	return 0
}

// sampled runs fn while it samples r's resident set every 50 ms; it
// answers the set before fn and the peak during it.
func (r *pathRun) sampled(fn func() error) (before, peak int64, err error) {
	if r.peer == nil && r.Addr != "" {
		// This process: what the turns before left for the collector
		// (1,000 clients' buffers) is not this turn's.
		debug.FreeOSMemory()
	}
	return peakDuring(r.rssOf, fn)
}

// peakDuring runs fn while it samples a resident set every 50 ms; it
// answers the set before fn and the peak during it.
func peakDuring(rss func() int64, fn func() error) (before, peak int64, err error) {
	before = rss()
	var top atomic.Int64
	top.Store(before)
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if v := rss(); v > top.Load() {
					top.Store(v)
				}
			}
		}
	}()
	err = fn()
	close(done)
	<-stopped
	if v := rss(); v > top.Load() {
		top.Store(v)
	}
	return before, top.Load(), err
}

// runPeers measures direct, the byte relay, the edge and each peer in one
// run, in turns, and prints the table.
func runPeers(ctx context.Context, cfg config, s peerSetup) error {
	if err := raiseFileLimit(); err != nil {
		return err
	}
	workers := runtime.GOMAXPROCS(0)
	runs := []*pathRun{
		{benchPath: benchPath{Name: "direct"}},
		{benchPath: benchPath{Name: "byte relay", Addr: s.relay}},
		{benchPath: benchPath{Name: "edge", Addr: s.edge}},
	}
	var peers []*peer
	defer func() {
		for _, p := range peers {
			p.stop()
		}
	}()
	for _, name := range peerNames {
		p := startPeer(ctx, name, s.work, s.relay, workers)
		peers = append(peers, p)
		if p.status == "" {
			// The peer serves only once its upstream answers through it.
			if err := waitOK(ctx, clientTo(peerJob{}.dial(benchPath{Addr: p.addr})), s.endpoint+"/"); err != nil {
				p.status, p.detail = "failed", err.Error()
				p.stop()
			}
		}
		if p.status != "" {
			progress("%s: %s %s", name, p.status, p.detail)
			continue
		}
		progress("%s serving on %s (%d processes)", name, p.addr, len(p.pids()))
		runs = append(runs, &pathRun{benchPath: benchPath{Name: name, Addr: p.addr}, peer: p})
	}
	paths := make([]benchPath, len(runs))
	for i, r := range runs {
		paths[i] = r.benchPath
	}
	base := peerJob{Instance: s.instance, PID: s.pid, Endpoint: s.endpoint}

	job := base
	job.Phase, job.Paths, job.Gets, job.MiB = "turns", paths, cfg.gets, cfg.mib
	var tr peerResult
	if err := childJSON(ctx, "-peer-job", job, &tr); err != nil {
		return err
	}
	if len(tr.Get) != len(runs) || len(tr.Download) != len(runs) || len(tr.Upload) != len(runs) {
		return fmt.Errorf("the measuring client's result lacks a path")
	}
	for i, r := range runs {
		r.get, r.down, r.up = tr.Get[i], tr.Download[i], tr.Upload[i]
	}
	s.resetRelay()

	// The large downloads and the 1,000 clients take one path at a time;
	// -rounds rounds, each starting one path further on.
	for round := range cfg.rounds {
		for k := range runs {
			r := runs[(round+k)%len(runs)]
			if cfg.gib <= 0 {
				break
			}
			progress("round %d of %d: %d GiB download, %s", round+1, cfg.rounds, cfg.gib, r.Name)
			job := base
			job.Phase, job.Paths, job.Bytes = "large", []benchPath{r.benchPath}, int64(cfg.gib)<<30
			var lr peerResult
			before, peak, err := r.sampled(func() error { return childJSON(ctx, "-peer-job", job, &lr) })
			s.resetRelay()
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				progress("%s: the large download failed: %v", r.Name, err)
				r.largeFailed++
				continue
			}
			r.largeBytes += job.Bytes
			r.largeTook += lr.Took
			if r.rssPeak == 0 || peak-before > r.rssPeak-r.rssBefore {
				r.rssBefore, r.rssPeak = before, peak
			}
		}
		for k := range runs {
			r := runs[(round+k)%len(runs)]
			if cfg.conns <= 0 {
				break
			}
			progress("round %d of %d: %d clients for %s, %s", round+1, cfg.rounds, cfg.conns, cfg.connsFor, r.Name)
			job := base
			job.Phase, job.Paths, job.Conns, job.For = "conns", []benchPath{r.benchPath}, cfg.conns, cfg.connsFor
			var cr peerResult
			stopProfile := func() {}
			if cfg.cpuprofile != "" && r.Name == "edge" && round == 0 {
				f, err := os.Create(cfg.cpuprofile)
				if err != nil {
					return fmt.Errorf("cpu profile: %w", err)
				}
				if err := pprof.StartCPUProfile(f); err != nil {
					_ = f.Close()
					return fmt.Errorf("cpu profile: %w", err)
				}
				stopProfile = func() { pprof.StopCPUProfile(); _ = f.Close() }
			}
			_, peak, err := r.sampled(func() error { return childJSON(ctx, "-peer-job", job, &cr) })
			stopProfile()
			s.resetRelay()
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				progress("%s: the %d clients failed: %v", r.Name, cfg.conns, err)
				r.connsFailed++
				continue
			}
			r.requests += cr.Requests
			r.errs += cr.Errors
			r.elapsed += cr.Elapsed
			r.lat = append(r.lat, cr.Lat...)
			r.connected += cr.Conns
			r.connsRounds++
			r.connsRSSPeak = max(r.connsRSSPeak, peak)
		}
	}

	printPeerTable(cfg, workers, runs, peers)
	return nil
}

// row kinds: lower is better (latency, memory) or higher (throughput).
const (
	lower = iota
	higher
)

func printPeerTable(cfg config, workers int, runs []*pathRun, peers []*peer) {
	names := []string{"direct", "byte relay", "edge"}
	names = append(names, peerNames...)
	byName := map[string]*pathRun{}
	for _, r := range runs {
		byName[r.Name] = r
	}
	status := map[string]string{}
	for _, p := range peers {
		status[p.name] = p.status
	}
	fmt.Printf("ingressbench -peers, %s, load average %s; %d CPUs; the edge's process GOMAXPROCS %d, and as many workers for each peer "+
		"(nginx worker_processes, HAProxy nbthread, Caddy GOMAXPROCS); every peer proxies to the byte relay, in this process\n\n",
		time.Now().UTC().Format(time.RFC3339), loadAverage(), runtime.NumCPU(), workers)
	fmt.Printf("| measure | %s | best peer | edge / best peer | goal |\n", strings.Join(names, " | "))
	fmt.Printf("|%s\n", strings.Repeat(" --- |", len(names)+4))

	type metric struct {
		label string
		kind  int
		value func(*pathRun) (float64, bool)
		cell  func(*pathRun, float64) string
	}
	// failed is how many of r's turns of the phase m.label names failed.
	failed := func(label string, r *pathRun) int {
		switch {
		case strings.Contains(label, "GiB") || strings.Contains(label, "large download"):
			return r.largeFailed
		case strings.Contains(label, "clients"):
			return r.connsFailed
		}
		return 0
	}
	dur := func(v float64) string { return fmtDur(time.Duration(v)) }
	quant := func(ds []time.Duration, q int) (float64, bool) {
		if len(ds) == 0 {
			return 0, false
		}
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[min(len(s)-1, len(s)*q/100)]), true
	}
	mbpsOf := func(ds []time.Duration) (float64, bool) {
		if len(ds) == 0 {
			return 0, false
		}
		return mbps(ds), true
	}
	mb := func(_ *pathRun, v float64) string { return fmt.Sprintf("%.0f MB/s", v) }
	metrics := []metric{
		{fmt.Sprintf("small GET p50 (%d each, kept alive)", cfg.gets), lower,
			func(r *pathRun) (float64, bool) { return quant(r.get, 50) }, func(_ *pathRun, v float64) string { return dur(v) }},
		{"small GET p99", lower,
			func(r *pathRun) (float64, bool) { return quant(r.get, 99) }, func(_ *pathRun, v float64) string { return dur(v) }},
		{fmt.Sprintf("1 MiB download (%d each)", cfg.mib), higher, func(r *pathRun) (float64, bool) { return mbpsOf(r.down) }, mb},
		{fmt.Sprintf("1 MiB upload (%d each)", cfg.mib), higher, func(r *pathRun) (float64, bool) { return mbpsOf(r.up) }, mb},
	}
	if cfg.gib > 0 {
		metrics = append(metrics,
			metric{fmt.Sprintf("%d GiB download (%d round(s))", cfg.gib, cfg.rounds), higher, func(r *pathRun) (float64, bool) {
				if r.largeTook == 0 {
					return 0, false
				}
				return float64(r.largeBytes) / r.largeTook.Seconds() / 1e6, true
			}, mb},
			metric{"proxy RSS before / peak of the large download", lower, func(r *pathRun) (float64, bool) {
				if r.Addr == "" || r.largeTook == 0 {
					return 0, false
				}
				return float64(r.rssPeak), true
			}, func(r *pathRun, v float64) string { return fmt.Sprintf("%d / %d MiB", r.rssBefore>>20, int64(v)>>20) }})
	}
	if cfg.conns > 0 {
		connected := func(r *pathRun) string {
			if r.connsRounds == 0 {
				return ""
			}
			s := ""
			if c := r.connected / r.connsRounds; c < cfg.conns {
				s = fmt.Sprintf(" (%d connected)", c)
			}
			if r.errs > 0 {
				s += fmt.Sprintf(" (%d errors)", r.errs)
			}
			return s
		}
		metrics = append(metrics,
			metric{fmt.Sprintf("%d clients kept alive, small GETs for %s (%d round(s)): requests/s", cfg.conns, cfg.connsFor, cfg.rounds), higher,
				func(r *pathRun) (float64, bool) {
					if r.elapsed == 0 {
						return 0, false
					}
					return float64(r.requests) / r.elapsed.Seconds(), true
				}, func(r *pathRun, v float64) string { return fmt.Sprintf("%.0f/s%s", v, connected(r)) }},
			metric{fmt.Sprintf("%d clients: p50", cfg.conns), lower,
				func(r *pathRun) (float64, bool) { return quant(r.lat, 50) }, func(_ *pathRun, v float64) string { return dur(v) }},
			metric{fmt.Sprintf("%d clients: p99", cfg.conns), lower,
				func(r *pathRun) (float64, bool) { return quant(r.lat, 99) }, func(_ *pathRun, v float64) string { return dur(v) }},
			metric{fmt.Sprintf("%d clients: proxy RSS peak", cfg.conns), lower, func(r *pathRun) (float64, bool) {
				if r.Addr == "" || r.connsRounds == 0 {
					return 0, false
				}
				return float64(r.connsRSSPeak), true
			}, func(_ *pathRun, v float64) string { return fmt.Sprintf("%d MiB", int64(v)>>20) }},
		)
	}
	var behind []string
	for _, m := range metrics {
		cells := make([]string, 0, len(names)+3)
		bestName, best, haveBest := "", 0.0, false
		for _, n := range names {
			r := byName[n]
			if r == nil {
				if st := status[n]; st != "" {
					cells = append(cells, st)
				} else {
					cells = append(cells, "n/a")
				}
				continue
			}
			v, ok := m.value(r)
			if !ok {
				if failed(m.label, r) > 0 {
					cells = append(cells, "failed")
				} else {
					cells = append(cells, "n/a")
				}
				continue
			}
			cell := m.cell(r, v)
			if f := failed(m.label, r); f > 0 {
				cell += fmt.Sprintf(" (%d turn(s) failed)", f)
			}
			cells = append(cells, cell)
			if r.peer == nil {
				continue
			}
			if !haveBest || (m.kind == lower && v < best) || (m.kind == higher && v > best) {
				bestName, best, haveBest = n, v, true
			}
		}
		edge := byName["edge"]
		ev, eok := m.value(edge)
		memory := strings.Contains(m.label, "RSS")
		switch {
		case !haveBest || !eok:
			cells = append(cells, "no peer", "", "")
		default:
			ratio := ev / best
			met := ratio <= 1
			want := "≤ 1× (at or below)"
			if m.kind == higher {
				met, want = ratio >= 1, "≥ 1× (at or above)"
			}
			g := goal(met, want)
			if memory {
				// The edge's figure is the whole bench process (the
				// provider, the byte relay the peers use): reported, no goal.
				g = "reported (the edge's is this whole process)"
			} else if !met {
				behind = append(behind, fmt.Sprintf("%s: %.2f× %s", m.label, ratio, bestName))
			}
			cells = append(cells, bestName, fmt.Sprintf("%.2f×", ratio), g)
		}
		fmt.Printf("| %s | %s |\n", m.label, strings.Join(cells, " | "))
	}
	if len(behind) > 0 {
		fmt.Printf("\nThe edge is behind the best peer on: %s.\n", strings.Join(behind, "; "))
	} else {
		fmt.Printf("\nThe edge is at or ahead of the best peer on every row.\n")
	}
	if cfg.cpuprofile != "" {
		fmt.Printf("CPU profile of this process during the edge's first %d-client turn: %s\n", cfg.conns, cfg.cpuprofile)
	}
}
