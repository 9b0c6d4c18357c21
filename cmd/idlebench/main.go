// Command idlebench measures the idle loop at scale: it stands up N fake
// guest daemons (default 10,000, package idle/idletest) and a fake Incus
// that lists N running targets, in a process of their own, then runs the
// idle loop's own code (idle.Loop over targets.Service, through
// provider.IdleInventory as the provider wires them, with its default
// configuration) with only the dialer pointed at the fake daemons, and
// reports how long a full pass over every target takes, how much CPU this
// process uses as a fraction of one core (getrusage: user + system) and its
// peak RSS: what a provider at that scale holds, the fakes not included
// (their own CPU and RSS are printed apart).
//
// Usage:
//
//	go run ./cmd/idlebench [-targets 10000] [-duration 90s] [-max-interval 10s] [-in-process [-socketpairs]]
//
// A pass starts with the targets running at that moment and ends when each
// has been probed (env/getIdle) once. The first pass includes every
// target's dial and data-plane handshake, spread over the loop's start-up
// spread; later passes reuse the sessions. Each session is a unix
// connection to the fakes' process (which needs a file descriptor limit
// above the targets); with -in-process the fakes run here, over in-memory
// pipes or unix socketpairs, and the figures include them.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idle/idletest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/fakeincus"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
)

func main() {
	if dir := os.Getenv(envFakesDir); dir != "" {
		n, _ := strconv.Atoi(os.Getenv(envFakesTargets))
		if err := runFakes(dir, n); err != nil {
			fmt.Fprintln(os.Stderr, "idlebench fakes: "+err.Error())
			os.Exit(1)
		}
		return
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "idlebench: "+err.Error())
		os.Exit(1)
	}
}

type options struct {
	targets  int
	duration time.Duration
	pipes    bool
	inProc   bool
	probes   int
	interval time.Duration
	refresh  time.Duration
	spread   time.Duration
	verbose  bool
	profile  string
	heap     string
	cache    bool
	correct  time.Duration
}

func run() error {
	var o options
	flag.IntVar(&o.targets, "targets", 10000, "fake targets (and daemons) to stand up")
	flag.DurationVar(&o.duration, "duration", 90*time.Second, "how long to measure after the first pass")
	flag.BoolVar(&o.inProc, "in-process", false, "run the fake daemons and the fake Incus in this process (the figures then include them) instead of a process of their own")
	socketpairs := flag.Bool("socketpairs", false, "with -in-process: connect over unix socketpairs (two descriptors per target) instead of in-memory pipes")
	flag.IntVar(&o.probes, "max-probes", 0, "idle.Config.MaxProbes (0: the loop's default)")
	flag.DurationVar(&o.interval, "max-interval", 0, "idle.Config.MaxInterval (0: the loop's default)")
	flag.DurationVar(&o.refresh, "refresh", 0, "idle.Config.RefreshInterval (0: the loop's default)")
	flag.DurationVar(&o.spread, "start-spread", 0, "idle.Config.StartSpread (0: the loop's default)")
	flag.BoolVar(&o.verbose, "v", false, "log the loop's warnings")
	flag.StringVar(&o.profile, "cpuprofile", "", "write a CPU profile of the steady window to this file")
	flag.StringVar(&o.heap, "memprofile", "", "write a heap profile at the end of the steady window to this file")
	flag.BoolVar(&o.cache, "cache", true, "run the observation cache (the provider's default): the inventory is read from it once it is confirmed; -cache=false lists Incus every reconcile interval")
	flag.DurationVar(&o.correct, "correction", 0, "targets.Config.CacheCorrection, the cache's correcting full list (0: the service's default)")
	flag.Parse()
	o.pipes = !*socketpairs
	if o.targets < 1 {
		return errors.New("-targets must be at least 1")
	}
	if !o.inProc {
		if err := raiseFileLimit(uint64(o.targets + 4096)); err != nil {
			return err
		}
	} else if !o.pipes {
		if err := raiseFileLimit(uint64(2*o.targets + 4096)); err != nil {
			fmt.Printf("note: %v; using in-memory pipes instead of socketpairs\n", err)
			o.pipes = true
		}
	}
	dir, err := os.MkdirTemp("", "idlebench-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()

	setupStart := time.Now()
	var (
		dialer    guest.Dialer
		dials     func() int64
		fakes     *fakesProc
		listBytes int
		setupKind string
	)
	if o.inProc {
		fleet := idletest.NewFleet(idletest.Options{Pipes: o.pipes})
		defer fleet.Close()
		names := benchNames(o.targets)
		for _, name := range names {
			fleet.Add(name)
		}
		fakeIncus, err := serveFakeIncus(filepath.Join(dir, "incus.sock"), names)
		if err != nil {
			return err
		}
		defer func() { _ = fakeIncus.Close() }()
		dialer, dials, listBytes = fleet, fleet.Dials.Load, fakeIncus.ListBytes
		setupKind = map[bool]string{true: "in this process, in-memory pipes", false: "in this process, unix socketpairs"}[o.pipes]
	} else {
		p, err := startFakes(context.Background(), dir, o.targets)
		if err != nil {
			return err
		}
		defer p.stop()
		rf := &remoteFleet{socket: filepath.Join(dir, "daemons.sock")}
		fakes, dialer, dials, listBytes = p, rf, rf.dials.Load, p.size
		setupKind = fmt.Sprintf("in a process of their own (pid %d), one unix connection per session", p.cmd.Process.Pid)
	}
	catalog, err := benchCatalog(dir)
	if err != nil {
		return err
	}
	client, err := incus.New(incus.Config{Socket: filepath.Join(dir, "incus.sock"), CallTimeout: 30 * time.Second})
	if err != nil {
		return err
	}
	log := zap.NewNop()
	if o.verbose {
		log, _ = zap.NewDevelopment(zap.IncreaseLevel(zap.WarnLevel))
	}
	svc, err := targets.New(client, catalog, dialer, relays.New(0), log, targets.Config{
		NoCache: !o.cache, CacheCorrection: o.correct})
	if err != nil {
		return err
	}
	// The service runs as in the provider (reconciler, leases, and the
	// cache when on), so its costs at this scale are in the figures.
	svcCtx, svcStop := context.WithCancel(context.Background())
	svcDone := make(chan error, 1)
	go func() { svcDone <- svc.Run(svcCtx) }()
	defer func() {
		svcStop()
		if err := <-svcDone; err != nil {
			fmt.Fprintln(os.Stderr, "idlebench: the service: "+err.Error())
		}
	}()
	if o.cache {
		for !svc.CacheConfirmed() {
			if time.Since(setupStart) > 2*time.Minute {
				return errors.New("the observation cache was not confirmed within 2 minutes")
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// The inventory must see every target with its policy, or the bench
	// measures nothing.
	listed, err := svc.IdleTargets(context.Background())
	if err != nil {
		return fmt.Errorf("listing the fake targets: %w", err)
	}
	withPolicy := 0
	for _, t := range listed {
		if t.Phase == controller.PhaseActive && t.Power == controller.PowerRunning && t.Policy != nil {
			withPolicy++
		}
	}
	if withPolicy != o.targets {
		return fmt.Errorf("the inventory lists %d running targets with a policy, want %d (the fake instances no longer match targets' metadata)", withPolicy, o.targets)
	}
	fmt.Printf("setup: %d fake daemons and a fake Incus listing %d targets (%s; listing %d KiB) in %v\n",
		o.targets, o.targets, setupKind, listBytes/1024, time.Since(setupStart).Round(time.Millisecond))
	if o.cache {
		fmt.Printf("observation cache: on and confirmed, correcting list every %s\n", cmp.Or(o.correct, targets.DefaultCacheCorrection))
	} else {
		fmt.Println("observation cache: off; the inventory lists Incus")
	}

	reg := prometheus.NewRegistry()
	loop := idle.New(idle.Config{
		Inventory:       provider.IdleInventory{Targets: svc},
		Dialer:          dialer,
		Metrics:         idle.NewMetrics(reg),
		Log:             log,
		MaxProbes:       o.probes,
		MaxInterval:     o.interval,
		RefreshInterval: o.refresh,
		StartSpread:     o.spread,
	})
	runtime.GC()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	cpu0, wall0 := cpuTime(), time.Now()
	fakesCPU := func() time.Duration {
		if fakes == nil {
			return 0
		}
		return fakes.cpu()
	}
	fcpu0 := fakesCPU()
	go func() { done <- loop.Run(ctx) }()

	// The first pass: every target dialled, handshaken and probed once.
	var passes []time.Duration
	var seen uint64
	sample := func() {
		if s := loop.Stats(); s.Passes > seen {
			seen = s.Passes
			passes = append(passes, s.LastPass)
		}
	}
	for seen == 0 {
		time.Sleep(50 * time.Millisecond)
		sample()
		if time.Since(wall0) > 5*time.Minute {
			cancel()
			return errors.New("no full pass within 5 minutes")
		}
	}
	cpu1, wall1, fcpu1 := cpuTime(), time.Now(), fakesCPU()
	first := loop.Stats()
	fmt.Printf("first pass:  %7.2f s wall (includes %d dials and handshakes), CPU %.3f of one core over %.1f s since start\n",
		passes[0].Seconds(), dials(), (cpu1-cpu0).Seconds()/wall1.Sub(wall0).Seconds(), wall1.Sub(wall0).Seconds())

	// Steady state: sessions kept, each target on its own clock.
	if o.profile != "" {
		f, err := os.Create(o.profile)
		if err != nil {
			cancel()
			return err
		}
		defer func() { _ = f.Close() }()
		if err := pprof.StartCPUProfile(f); err != nil {
			cancel()
			return err
		}
		defer pprof.StopCPUProfile() // on an early return
	}
	passes = passes[:0]
	end := wall1.Add(o.duration)
	for time.Now().Before(end) {
		time.Sleep(50 * time.Millisecond)
		sample()
	}
	cpu2, wall2, fcpu2 := cpuTime(), time.Now(), fakesCPU()
	if o.profile != "" {
		// The window alone: closing 10,000 sessions at the stop is not
		// steady probing.
		pprof.StopCPUProfile()
	}
	if o.heap != "" {
		if err := writeHeapProfile(o.heap); err != nil {
			cancel()
			return err
		}
	}
	st := loop.Stats()
	cancel()
	if err := <-done; err != nil {
		return err
	}
	probes := st.ProbesOK + st.ProbesFailed - first.ProbesOK - first.ProbesFailed
	steadyWall := wall2.Sub(wall1).Seconds()
	fmt.Printf("steady:      %d passes in %.0f s: %s\n", len(passes), steadyWall, describe(passes))
	fmt.Printf("             %d probes (%.0f/s), %d failed, %d sessions open, %d redials after the first pass, %d actions\n",
		probes, float64(probes)/steadyWall, st.ProbesFailed, st.Sessions, dials()-int64(o.targets), st.Actions)
	fmt.Printf("             CPU %.3f of one core (%.2f s user+system over %.1f s)\n",
		(cpu2-cpu1).Seconds()/steadyWall, (cpu2 - cpu1).Seconds(), steadyWall)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Printf("overall:     CPU %.3f of one core over %.1f s; peak RSS %s, now %s (Go heap in use %d MiB, stacks %d MiB); %d goroutines before the loop stopped\n",
		(cpu2-cpu0).Seconds()/wall2.Sub(wall0).Seconds(), wall2.Sub(wall0).Seconds(), peakRSS(), rssNow(), ms.HeapInuse>>20, ms.StackInuse>>20, runtime.NumGoroutine())
	if fakes != nil {
		fmt.Printf("fakes:       CPU %.3f of one core steady, %.3f in the first pass; peak RSS %s (not counted above)\n",
			(fcpu2-fcpu1).Seconds()/steadyWall, (fcpu1-fcpu0).Seconds()/wall1.Sub(wall0).Seconds(), fakes.rss())
	}
	if len(passes) == 0 {
		return errors.New("no full pass completed in the steady window; lengthen -duration")
	}
	worst := passes[0]
	for _, p := range passes {
		worst = max(worst, p)
	}
	// Issue 11's goals: a full pass within 10 s, under a tenth of a core,
	// provider RSS within 200 MiB (only meaningful with the fakes apart).
	frac := (cpu2 - cpu1).Seconds() / steadyWall
	peak := peakRSSBytes("/proc/self/status")
	fmt.Printf("goals:       slowest pass %.2f s (≤ 10 s: %s), steady CPU %.3f of one core (< 0.10: %s), peak RSS %d MiB (≤ 200 MiB: %s)\n",
		worst.Seconds(), verdict(worst <= 10*time.Second), frac, verdict(frac < 0.10), peak>>20, verdict(!o.inProc && peak <= 200<<20))
	return nil
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

func rssNow() string {
	raw, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			fields := strings.Fields(v)
			if kb, err := strconv.Atoi(fields[0]); err == nil {
				return fmt.Sprintf("%d MiB", kb/1024)
			}
		}
	}
	return "unknown"
}

func describe(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	lo, hi, sum := ds[0], ds[0], time.Duration(0)
	for _, d := range ds {
		lo, hi, sum = min(lo, d), max(hi, d), sum+d
	}
	return fmt.Sprintf("min %.2f s, mean %.2f s, max %.2f s", lo.Seconds(), (sum / time.Duration(len(ds))).Seconds(), hi.Seconds())
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func peakRSS() string { return peakRSSOf("/proc/self/status") }

func peakRSSOf(status string) string {
	b := peakRSSBytes(status)
	if b == 0 {
		return "unknown"
	}
	return fmt.Sprintf("%d MiB", b>>20)
}

// peakRSSBytes reads VmHWM from a /proc status file; 0 when unknown.
func peakRSSBytes(status string) uint64 {
	raw, err := os.ReadFile(status)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			fields := strings.Fields(v)
			if kb, err := strconv.ParseUint(fields[0], 10, 64); err == nil {
				return kb << 10
			}
		}
	}
	return 0
}

// raiseFileLimit makes room for two descriptors per socketpair connection.
func raiseFileLimit(want uint64) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	if lim.Cur >= want {
		return nil
	}
	next := syscall.Rlimit{Cur: want, Max: max(lim.Max, want)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &next); err != nil {
		return fmt.Errorf("the file descriptor limit is %d and cannot be raised to %d: %w", lim.Cur, want, err)
	}
	return nil
}

// benchPolicy never comes due during a run: the bench measures probing.
const benchPolicy = `{"pauseAfterMs":3600000,"stopAfterMs":7200000,"closeAfterMs":86400000}`

func benchCatalog(dir string) (*templates.Catalog, error) {
	path := filepath.Join(dir, "templates.yaml")
	body := `templates:
  - templateId: bench
    displayName: bench
    powerStates: [running, paused, stopped]
    idle: ` + benchPolicy + `
    imageFingerprint: ` + strings.Repeat("ab", 32) + `
`
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		return nil, err
	}
	return templates.Load(path)
}

// serveFakeIncus serves the named instances (internal/fakeincus), running,
// carrying the metadata targets writes at create, in the shape (and about
// the size) Incus 6.0 gives a container.
func serveFakeIncus(socket string, names []string) (*fakeincus.Server, error) {
	created := time.Now().Add(-time.Hour).UTC()
	list := make([]json.RawMessage, len(names))
	for i, name := range names {
		config := map[string]string{
			"image.architecture":              "x86_64",
			"image.description":               "Lightspeed development guest",
			"image.os":                        "busybox",
			"image.release":                   "1",
			"limits.cpu":                      "1",
			"limits.memory":                   "268435456B",
			"volatile.base_image":             strings.Repeat("ab", 32),
			"volatile.cloud-init.instance-id": "2e1c6b3c-6f0e-4d1f-9c39-" + fmt.Sprintf("%012d", i),
			"volatile.idmap.base":             "0",
			"volatile.idmap.current":          `[{"Isuid":true,"Isgid":false,"Hostid":1000000,"Nsid":0,"Maprange":1000000000},{"Isuid":false,"Isgid":true,"Hostid":1000000,"Nsid":0,"Maprange":1000000000}]`,
			"volatile.idmap.next":             `[{"Isuid":true,"Isgid":false,"Hostid":1000000,"Nsid":0,"Maprange":1000000000},{"Isuid":false,"Isgid":true,"Hostid":1000000,"Nsid":0,"Maprange":1000000000}]`,
			"volatile.last_state.idmap":       "[]",
			"volatile.last_state.power":       "RUNNING",
			"volatile.uuid":                   "8f0c1e7e-2b7a-4a43-9c55-" + fmt.Sprintf("%012d", i),
			"volatile.uuid.generation":        "8f0c1e7e-2b7a-4a43-9c55-" + fmt.Sprintf("%012d", i),
			"user.lightspeed.schema":          "1",
			"user.lightspeed.universe":        "u-bench",
			"user.lightspeed.environment":     fmt.Sprintf("env-%06d", i),
			"user.lightspeed.template":        "bench",
			"user.lightspeed.image":           strings.Repeat("ab", 32),
			"user.lightspeed.daemon_port":     "19091",
			"user.lightspeed.created_at_ms":   strconv.FormatInt(created.UnixMilli(), 10),
			"user.lightspeed.booted_at_ms":    strconv.FormatInt(created.UnixMilli()+1200, 10),
			"user.lightspeed.idle":            benchPolicy,
		}
		raw, err := fakeincus.Instance(name, true, config, created)
		if err != nil {
			return nil, err
		}
		list[i] = raw
	}
	return fakeincus.Serve(socket, list)
}

func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	runtime.GC()
	return pprof.WriteHeapProfile(f)
}
