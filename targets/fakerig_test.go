package targets

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// fakeRig is one provider process's targets.Service on the in-process
// Incus fake, with the service's Incus traffic passing a tap that sees
// every busy refusal Incus gives it: a refusal the service retries
// quietly (want, patchIf) or turns into a kept request (SetPower) never
// reaches a caller, and the point of the turn is that there are none.
type fakeRig struct {
	t      *testing.T
	fake   *incusfake.Server
	tap    *busyTap
	client *incus.Client
	svc    *Service
	// stop ends svc's run; restart starts another process in its place.
	stop   func()
	cat    *templates.Catalog
	dialer guest.Dialer
	cfg    Config

	mu     sync.Mutex
	owners map[string]controller.Owner // by instance name
}

// fakeProject is the project the rig's service works in.
const fakeProject = incus.DefaultProject

// fakeFingerprint is the image every rig template is pinned to; the fake
// models no images, so nothing reads it back.
const fakeFingerprint = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// newFakeRig starts a fake, a tapped client on it and a running service.
// At cleanup the service stops first, then the rig checks that the fake
// holds exactly the owners' instances (checkInventory), then the fake
// closes.
func newFakeRig(t *testing.T, fcfg incusfake.Config, cfg Config) *fakeRig {
	t.Helper()
	return newFakeRigOf(t, fcfg, cfg, fakeCatalog(t), nopDialer{})
}

// newFakeRigOf is newFakeRig with its own catalog and guest dialer.
func newFakeRigOf(t *testing.T, fcfg incusfake.Config, cfg Config, cat *templates.Catalog, dialer guest.Dialer) *fakeRig {
	t.Helper()
	// A unix socket path holds at most 107 bytes, and t.TempDir's names
	// carry the test's.
	dir, err := os.MkdirTemp("", "lsf")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	fcfg.Dir = dir
	fake, err := incusfake.Start(fcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := fake.Close(); err != nil {
			t.Error(err)
		}
	})
	tap := startTap(t, fake.Socket(), filepath.Join(dir, "tap.sock"))
	client, err := incus.New(incus.Config{Socket: tap.socket, Project: fakeProject, CallTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	r := &fakeRig{t: t, fake: fake, tap: tap, client: client, owners: map[string]controller.Owner{}, cat: cat, dialer: dialer}
	t.Cleanup(r.checkInventory)
	if cfg.Replica == "" {
		cfg.Replica = "r-fake"
	}
	r.cfg = cfg
	r.svc, r.stop = r.process(cfg, nil)
	t.Cleanup(func() { r.stop() })
	return r
}

// process starts a service on the rig's client, as one more provider
// process would, with hook as its warm hook; stop ends it (once).
func (r *fakeRig) process(cfg Config, hook func(string) bool) (*Service, func()) {
	r.t.Helper()
	svc, err := New(r.client, r.cat, r.dialer, relays.New(0), zaptest.NewLogger(r.t), cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	svc.warmHook = hook
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = svc.Run(ctx)
	}()
	var once sync.Once
	return svc, func() { once.Do(func() { cancel(); <-done }) }
}

// restart stops the rig's process and starts another in its place, with
// the same configuration and hook.
func (r *fakeRig) restart(hook func(string) bool) {
	r.t.Helper()
	r.stop()
	r.svc, r.stop = r.process(r.cfg, hook)
}

// fakeDurations are the fake's operation times for tests that do not hold
// an operation open: long enough for concurrent calls to overlap one
// another's operations, short enough for dozens of owners in a second.
// The start time and the write delay are drawn from rng.
func fakeDurations(rng *rand.Rand) incusfake.Config {
	ms := func(lo, hi int) time.Duration { return time.Duration(lo+rng.IntN(hi-lo+1)) * time.Millisecond }
	return incusfake.Config{
		ApplyDelay: ms(5, 20),
		Durations: incusfake.Durations{
			Create: ms(30, 80), Start: ms(30, 80), Stop: 30 * time.Millisecond, ForcedStop: 10 * time.Millisecond,
			Freeze: 10 * time.Millisecond, Unfreeze: 10 * time.Millisecond, Restart: 50 * time.Millisecond,
			Rename: 10 * time.Millisecond, Delete: 10 * time.Millisecond,
		},
	}
}

// seeded is a random source whose seed the test prints, so that a failure
// can be replayed with INCUS_PROVIDER_FAKE_SEED.
func seeded(t *testing.T) *rand.Rand {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("INCUS_PROVIDER_FAKE_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("INCUS_PROVIDER_FAKE_SEED=%q: %v", v, err)
		}
		seed = n
	}
	t.Logf("seed %d (replay with INCUS_PROVIDER_FAKE_SEED=%d)", seed, seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// fakeCatalog is the t1 template of the real-Incus tests, pinned to a
// fingerprint the rig's resolver vouches for.
func fakeCatalog(t *testing.T) *templates.Catalog {
	return fakeCatalogOf(t, false)
}

// fakeCatalogOf is fakeCatalog with t1 deprecated or not.
func fakeCatalogOf(t *testing.T, deprecated bool) *templates.Catalog {
	t.Helper()
	body := `templates:
  - templateId: t1
    displayName: test guest
    powerStates: [running, paused, stopped]
    publicIngress: true
    ingressPort: 8080
    deprecated: ` + strconv.FormatBool(deprecated) + `
    imageFingerprint: ` + fakeFingerprint + "\n"
	return loadFakeCatalog(t, body)
}

// loadFakeCatalog loads a templates file's body, its images vouched for.
func loadFakeCatalog(t *testing.T, body string) *templates.Catalog {
	t.Helper()
	p := filepath.Join(t.TempDir(), "templates.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cat, err := templates.Load(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := cat.Resolve(context.Background(), fakeImages{}); err != nil {
		t.Fatal(err)
	}
	return cat
}

// fakeImages answers the catalog's image checks, which the fake does not model.
type fakeImages struct{}

func (fakeImages) GetImageAlias(context.Context, string) (string, error) { return fakeFingerprint, nil }
func (fakeImages) ImageExists(_ context.Context, fp string) (bool, error) {
	return fp == fakeFingerprint, nil
}

// nopDialer reaches no guest: these tests exercise targets' Incus side.
type nopDialer struct{}

func (nopDialer) DialContext(context.Context, guest.Target) (net.Conn, error) {
	return nil, errors.New("nopDialer: no guests in the fake")
}
func (nopDialer) Devices(guest.Target) map[string]map[string]string { return nil }
func (nopDialer) Forget(string)                                     {}
func (nopDialer) Name() string                                      { return guest.KindNetns }

// fakeOwner is the owner of the rig's i-th target.
func fakeOwner(env string) controller.Owner {
	return controller.Owner{UniverseID: "u-fake", EnvironmentID: env}
}

// expect records o as an owner whose one instance the fake must hold at
// the end of the test.
func (r *fakeRig) expect(o controller.Owner) string {
	name := Name(o)
	r.mu.Lock()
	r.owners[name] = o
	r.mu.Unlock()
	return name
}

// closed records that the test closed name's target: the inventory at
// the end then wants no instance of that name (checkInventory fails on
// one it does not expect).
func (r *fakeRig) closed(name string) {
	r.mu.Lock()
	delete(r.owners, name)
	r.mu.Unlock()
}

// seedTarget puts o's target in the fake as targets leaves one that ran
// and was last asked for power (empty: no request recorded), an hour ago.
func (r *fakeRig) seedTarget(o controller.Owner, status incus.InstanceStatus, power controller.Power) string {
	r.t.Helper()
	// A power-down the instance rests in is marked carried out, as this
	// provider leaves it (powerDone).
	atRest := (status == incus.InstanceFrozen && power == controller.PowerPaused) ||
		(status == incus.InstanceStopped && (power == controller.PowerStopped || power == controller.PowerSuspended))
	return r.seedTargetWith(o, status, power, atRest)
}

// seedTargetWith is seedTarget, with the power-down recorded as carried
// out when done (powerDone), whatever status Incus shows.
func (r *fakeRig) seedTargetWith(o controller.Owner, status incus.InstanceStatus, power controller.Power, done bool) string {
	r.t.Helper()
	name := r.expect(o)
	then := time.Now().Add(-time.Hour)
	config := map[string]string{
		keySchema: schemaVersion, keyUniverse: o.UniverseID, keyEnvironment: o.EnvironmentID,
		keyTemplate: "t1", keyImage: fakeFingerprint, keyDaemonPort: "7777",
		keyCreatedAt: msString(then), keyBooted: msString(then),
	}
	if power != "" {
		for k, v := range (Intent{Power: power, At: then, By: BySetPower}).config() {
			config[k] = v
		}
		if power != controller.PowerRunning {
			config[KeyIdleSince] = msString(then)
		}
	}
	if done {
		config[keyPowerDone] = msString(then)
	}
	if err := r.fake.Seed(fakeProject, incusfake.Seed{Name: name, Status: status, Config: config}); err != nil {
		r.t.Fatal(err)
	}
	return name
}

// instance reads name from the fake, failing the test when it is missing.
func (r *fakeRig) instance(name string) incusfake.Instance {
	r.t.Helper()
	v, ok := r.fake.Instance(fakeProject, name)
	if !ok {
		r.t.Fatalf("instance %s missing from the fake", name)
	}
	return v
}

// awaitFake waits, within d, for cond over the fake's state.
func (r *fakeRig) awaitFake(what string, d time.Duration, cond func() bool) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	if err := r.fake.Await(ctx, cond); err != nil {
		r.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// restsAt says the instance rests (no operation, no write pending) at
// status with power recorded as wanted.
func restsAt(v incusfake.Instance, status incus.InstanceStatus, power controller.Power) bool {
	return v.Status == status && v.HeldBy == "" && v.Config[keyPower] == string(power)
}

// checkInventory is the invariant every fake test ends on: one instance
// per owner the test made, each carrying its owner, and nothing else (no
// orphan, no copy, nothing without owner metadata).
func (r *fakeRig) checkInventory() {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[string]bool{}
	all := r.fake.Instances(fakeProject)
	byName := map[string]incus.Instance{}
	for _, v := range all {
		byName[v.Name] = incus.Instance{Name: v.Name, Config: v.Config, Status: v.Status}
	}
	for _, v := range all {
		inst := byName[v.Name]
		o, ok := ownerOf(&inst)
		key := v.Name
		if sn := standinOf(&inst); sn != "" {
			// A stand-in: it locks its owner's name for the spare it names,
			// which must be that owner's target (checked there).
			spare, held := byName[sn]
			if got, ours := ownerOf(&spare); !held || !ours || Name(got) != v.Name {
				r.t.Errorf("inventory: stand-in %s names %s, which is not its owner's target (config %v)", v.Name, sn, spare.Config)
			}
			continue
		}
		if isReadyName(v.Name) {
			if !ok {
				if recordOf(v.Config, fWarm).Warm != "" {
					continue // a spare in the pool, or one being made
				}
				r.t.Errorf("inventory: ready spare %s is neither in the pool nor anyone's (config %v)", v.Name, v.Config)
				continue
			}
			key = Name(o)
			if lock, locked := byName[key]; !locked || standinOf(&lock) != v.Name {
				r.t.Errorf("inventory: target %s of owner %+v is locked by no stand-in", v.Name, o)
			}
		}
		want, expected := r.owners[key]
		switch {
		case !ok:
			r.t.Errorf("inventory: instance %s carries no owner (config %v)", v.Name, v.Config)
		case !expected:
			r.t.Errorf("inventory: instance %s of owner %+v was never made by the test", v.Name, o)
		case o != want:
			r.t.Errorf("inventory: instance %s carries owner %+v, want %+v", v.Name, o, want)
		}
		if seen[key] {
			r.t.Errorf("inventory: owner %+v has two targets", o)
		}
		seen[key] = true
	}
	for name, o := range r.owners {
		if !seen[name] {
			r.t.Errorf("inventory: owner %+v has no instance %s", o, name)
		}
	}
}

// busyTap is a reverse proxy between the service's client and the fake
// that records every answer carrying Incus's busy refusal: a refused
// config write, or a state change's operation failing busy.
type busyTap struct {
	socket string
	mu     sync.Mutex
	busy   []string
}

func startTap(t *testing.T, upstream, socket string) *busyTap {
	t.Helper()
	tap := &busyTap{socket: socket}
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "incus"
		},
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", upstream)
		}},
		FlushInterval:  -1,
		ModifyResponse: tap.inspect,
		// A caller that gives up on a call is routine here, not news.
		ErrorLog: log.New(io.Discard, "", 0),
	}
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: proxy, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return tap
}

// inspect reads the answers that can carry a busy refusal: those of
// writes, and of operation waits (a state change refused busy is an
// operation that fails). Reads of instances and lists never do.
func (b *busyTap) inspect(resp *http.Response) error {
	req := resp.Request
	isWait := req.Method == http.MethodGet && strings.HasPrefix(req.URL.Path, "/1.0/operations/")
	if resp.StatusCode == http.StatusSwitchingProtocols || (req.Method == http.MethodGet && !isWait) {
		return nil
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(body))
	if err != nil {
		return err
	}
	if bytes.Contains(body, []byte("is busy running a")) {
		what := req.Method + " " + req.URL.Path
		if isWait {
			what += " (op " + path.Base(path.Dir(req.URL.Path)) + ")"
		}
		b.mu.Lock()
		b.busy = append(b.busy, what+": "+strings.TrimSpace(string(body)))
		b.mu.Unlock()
	}
	return nil
}

// refusals are the busy answers seen so far.
func (b *busyTap) refusals() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.busy...)
}

// history is the fake's applied writes to name, one a line, for a failure
// to show what happened to the instance and in which order.
func (r *fakeRig) history(name string) string {
	var b strings.Builder
	for _, w := range r.fake.Writes() {
		if w.Instance != name && w.OldName != name {
			continue
		}
		fmt.Fprintf(&b, "  #%d %s %s status=%s power=%s by=%s idle_since=%q\n", w.Seq, w.At.Format("15:04:05.000"),
			w.Kind, w.Status, w.Config[keyPower], w.Config[keyPowerBy], w.Config[KeyIdleSince])
	}
	return b.String()
}

// awaitCache polls, within d, for cond over what the service's observation
// cache answers for name (the fake tells of no change in the cache).
func (r *fakeRig) awaitCache(what, name string, d time.Duration, cond func(inst *incus.Instance, hit, confirmed bool) bool) {
	r.t.Helper()
	deadline := time.Now().Add(d)
	for !cond(r.cacheView(name)) {
		if time.Now().After(deadline) {
			r.t.Fatalf("waiting %s for %s in the observation cache", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// cacheView is what the service's observation cache would answer for
// name, and whether it is confirmed (answering at all).
func (r *fakeRig) cacheView(name string) (inst *incus.Instance, hit, confirmed bool) {
	c := r.svc.cache
	if c == nil {
		return nil, false, false
	}
	c.mu.Lock()
	confirmed = c.confirmed
	c.mu.Unlock()
	inst, hit = c.get(name)
	return inst, hit, confirmed
}

// wakeHeld starts a Wake of name by a use made at at, with the first call
// of method on path (relative to the instance's) held at Incus's door,
// and returns once the wake has reached it. The caller releases the hold
// (the returned fault) and reads the wake's answer from done.
func (r *fakeRig) wakeHeld(ctx context.Context, name, method, path string, at time.Time, relayable func()) (hold *incusfake.Injected, done <-chan error) {
	r.t.Helper()
	hold = r.fake.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: method, Path: "/1.0/instances/" + name + path, Times: 1})
	r.t.Cleanup(hold.Release)
	inst, _, err := r.client.GetInstance(ctx, name)
	if err != nil {
		r.t.Fatal(err)
	}
	answer := make(chan error, 1)
	go func() {
		_, err := r.svc.Wake(ctx, routeFor(inst), at, relayable)
		answer <- err
	}()
	select {
	case <-hold.Hit():
	case <-ctx.Done():
		r.t.Fatalf("the wake's %s %s never reached Incus", method, path)
	}
	return hold, answer
}
