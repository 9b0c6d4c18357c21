// Command getbench measures target/get (targets.Service.GetTarget): its
// latency (p50, p95) and the Incus requests each get costs, with the
// observation cache on and off in the same run, at a few targets and at
// many.
//
//	go run ./cmd/getbench [-fake 10,10000] [-real 20] [-gets 2000]
//
// The fake rows serve N instances from a fake Incus in a child process
// (this binary re-run with -serve-fake, over a unix socket): the instance
// list, single instance reads and an event stream that stays quiet, so
// the provider's own costs are measured, not the fake's. The real row
// creates N empty instances carrying targets' metadata in a throwaway
// project of the real Incus (INCUS_SOCKET, default /var/lib/incus/unix.socket),
// and removes the project afterwards.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle/idletest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
)

func main() {
	serveFake := flag.Int("serve-fake", 0, "internal: serve this many fake instances on -socket")
	socket := flag.String("socket", "", "internal: the fake's socket")
	fakes := flag.String("fake", "10,10000", "comma-separated target counts served by the fake Incus (empty: none)")
	real := flag.Int("real", 20, "targets on the real Incus (0: skip)")
	gets := flag.Int("gets", 2000, "gets measured per row")
	flag.Parse()
	var err error
	if *serveFake > 0 {
		err = runFake(*socket, *serveFake)
	} else {
		err = run(*fakes, *real, *gets)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "getbench: "+err.Error())
		os.Exit(1)
	}
}

func run(fakes string, real, gets int) error {
	if gets < 1 {
		return errors.New("-gets must be at least 1")
	}
	dir, err := os.MkdirTemp("", "getbench-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	catalog, err := benchCatalog(dir)
	if err != nil {
		return err
	}
	fmt.Printf("%-22s %-6s %10s %10s %14s %10s\n", "row", "cache", "p50", "p95", "Incus req/get", "heap")
	for _, f := range strings.Split(fakes, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return fmt.Errorf("-fake %q: want positive counts", fakes)
		}
		if err := fakeRow(dir, catalog, n, gets); err != nil {
			return err
		}
	}
	if real > 0 {
		return realRow(catalog, real, gets)
	}
	return nil
}

// fakeRow starts the fake Incus in a child process and measures both ways.
func fakeRow(dir string, catalog *templates.Catalog, n, gets int) error {
	sock := filepath.Join(dir, fmt.Sprintf("fake-%d.sock", n))
	self, err := os.Executable()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	child := exec.CommandContext(ctx, self, "-serve-fake", strconv.Itoa(n), "-socket", sock)
	child.Stderr = os.Stderr
	// The child ends when this end of its stdin closes, however this
	// process ends.
	stdin, err := child.StdinPipe()
	if err != nil {
		return err
	}
	if err := child.Start(); err != nil {
		return fmt.Errorf("start the fake Incus: %w", err)
	}
	defer func() { _ = stdin.Close(); _ = child.Wait() }()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("the fake Incus did not come up within a minute")
		}
	}
	owners := make([]controller.Owner, n)
	for i := range owners {
		owners[i] = fakeOwner(i)
	}
	label := fmt.Sprintf("fake, %d targets", n)
	for _, on := range []bool{false, true} {
		if err := measure(label, incus.Config{Socket: sock, CallTimeout: 30 * time.Second}, catalog, owners, gets, on); err != nil {
			return err
		}
	}
	return nil
}

// realRow makes n empty targets on the real Incus and measures both ways.
func realRow(catalog *templates.Catalog, n, gets int) error {
	socket := os.Getenv("INCUS_SOCKET")
	if socket == "" {
		socket = "/var/lib/incus/unix.socket"
	}
	root, err := incus.New(incus.Config{Socket: socket})
	if err != nil {
		return err
	}
	defer root.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var b [4]byte
	_, _ = rand.Read(b[:])
	project := "getbench-" + hex.EncodeToString(b[:])
	if err := root.CreateProject(ctx, project, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		return fmt.Errorf("create project %s: %w", project, err)
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer dcancel()
		// Instance by instance: a forced project delete also reaches for
		// the default profile, which a project without its own profiles
		// shares with the default project, and is refused.
		c := root.WithProject(project)
		if list, err := c.ListInstances(dctx); err == nil {
			for _, inst := range list {
				if op, err := c.DeleteInstance(dctx, inst.Name); err == nil {
					_, _ = c.Wait(dctx, op)
				}
			}
		}
		if err := root.DeleteProject(dctx, project); err != nil && !errors.Is(err, incus.ErrNotFound) {
			fmt.Fprintf(os.Stderr, "getbench: could not delete the project %s: %v\n", project, err)
		}
	}()
	c := root.WithProject(project)
	owners := make([]controller.Owner, n)
	for i := range owners {
		owners[i] = fakeOwner(i)
		op, err := c.CreateInstance(ctx, incus.InstancesPost{Name: targets.Name(owners[i]),
			Source: incus.InstanceSource{Type: "none"}, Config: targetConfig(i)})
		if err == nil {
			_, err = c.Wait(ctx, op)
		}
		if err != nil {
			return fmt.Errorf("create instance %d: %w", i, err)
		}
	}
	label := fmt.Sprintf("real Incus, %d targets", n)
	for _, on := range []bool{false, true} {
		if err := measure(label, incus.Config{Socket: socket, Project: project}, catalog, owners, gets, on); err != nil {
			return err
		}
	}
	return nil
}

// measure runs a service (reconciler and cache included) and times gets
// of owners taken in turn, counting every Incus request the process made
// meanwhile, the cache's and the reconciler's included.
func measure(label string, cfg incus.Config, catalog *templates.Catalog, owners []controller.Owner, gets int, cache bool) error {
	var calls atomic.Int64
	cfg.Observe = func(string, string, time.Duration) { calls.Add(1) }
	client, err := incus.New(cfg)
	if err != nil {
		return err
	}
	defer client.Close()
	fleet := idletest.NewFleet(idletest.Options{Pipes: true})
	defer fleet.Close()
	svc, err := targets.New(client, catalog, fleet, relays.New(0), zap.NewNop(), targets.Config{NoCache: !cache})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = svc.Run(ctx) }()
	defer func() { cancel(); <-done }()
	if cache {
		for deadline := time.Now().Add(2 * time.Minute); !svc.CacheConfirmed(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: the cache was not confirmed within 2 minutes", label)
			}
		}
	}
	// One get each way first, so that connections are up.
	if _, err := svc.GetTarget(ctx, controller.TargetRef{Owner: owners[0], TargetID: targets.Name(owners[0])}); err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	took := make([]time.Duration, gets)
	before := calls.Load()
	for i := range gets {
		o := owners[(i*7919)%len(owners)]
		start := time.Now()
		obs, err := svc.GetTarget(ctx, controller.TargetRef{Owner: o, TargetID: targets.Name(o)})
		took[i] = time.Since(start)
		if err != nil {
			return fmt.Errorf("%s: get: %w", label, err)
		}
		if obs.Phase != controller.PhaseActive {
			return fmt.Errorf("%s: get answered %s, want active (the fake instances no longer match targets' metadata)", label, obs.Phase)
		}
	}
	perGet := float64(calls.Load()-before) / float64(gets)
	slices.Sort(took)
	// The process's live heap with the service at rest: with the cache,
	// the instances it holds.
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Printf("%-22s %-6s %10s %10s %14.3f %6.1f MiB\n", label, map[bool]string{true: "on", false: "off"}[cache],
		fmtDur(took[len(took)/2]), fmtDur(took[len(took)*95/100]), perGet, float64(ms.HeapAlloc)/(1<<20))
	return nil
}

func fmtDur(d time.Duration) string { return fmt.Sprintf("%.1f µs", float64(d.Nanoseconds())/1000) }

func fakeOwner(i int) controller.Owner {
	return controller.Owner{UniverseID: "u-bench", EnvironmentID: fmt.Sprintf("env-%06d", i)}
}

const benchImage = "abababababababababababababababababababababababababababababababab"

// targetConfig is the metadata targets writes at create, of a target
// that booted (so that a stopped one reads as active, stopped).
func targetConfig(i int) map[string]string {
	created := time.Now().Add(-time.Hour)
	return map[string]string{
		"user.lightspeed.schema":        "1",
		"user.lightspeed.universe":      "u-bench",
		"user.lightspeed.environment":   fmt.Sprintf("env-%06d", i),
		"user.lightspeed.template":      "bench",
		"user.lightspeed.image":         benchImage,
		"user.lightspeed.daemon_port":   "19091",
		"user.lightspeed.created_at_ms": strconv.FormatInt(created.UnixMilli(), 10),
		"user.lightspeed.booted_at_ms":  strconv.FormatInt(created.UnixMilli()+1200, 10),
		"user.lightspeed.power":         "stopped",
	}
}

func benchCatalog(dir string) (*templates.Catalog, error) {
	path := filepath.Join(dir, "templates.yaml")
	body := `templates:
  - templateId: bench
    displayName: bench
    powerStates: [running, paused, stopped]
    imageFingerprint: ` + benchImage + `
`
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		return nil, err
	}
	return templates.Load(path)
}
