// Command createbench measures what a runtime waits for when it asks for an
// environment (issue 27), on the real Incus with the development guest, for
// one provider build or several in one run:
//
//   - create → active: from target/create to the first observation that
//     says active, asked the runtime's way (a provisioning answer is asked
//     again with target/get every 2 s);
//   - create → opened: on to the data route upgraded and the guest daemon's
//     initialize answered, the route dialled the runtime's way (a 503 is
//     dialled again after its Retry-After).
//
// Each build serves its own project from a templates file with a pool of
// stopped spares (warm: -pool, a fixed pool), a pool of frozen spares
// (warmState: frozen, for a build that has it) and a template without a
// pool: -owners owners one at a time from each (the pool refilled, untimed,
// before each pooled one), then -burst owners at once from each (the pool
// full first). Beside them, in the same run, Incus's own create and start
// of the same image, one at a time and -burst at once. With -timeline, a
// pool of frozen spares sized by demand (warm 2 to 24) meets a burst of 12,
// and its size is printed every second until it has shrunk back.
//
// Usage (as root: the provider's guest dialer enters the guests):
//
//	go build -o /tmp/new ./cmd/incus-provider
//	go run ./cmd/createbench -build new=/tmp/new -build old=/tmp/old [-timeline new]
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/routes"
)

type builds []string

func (b *builds) String() string     { return strings.Join(*b, ",") }
func (b *builds) Set(v string) error { *b = append(*b, v); return nil }

type options struct {
	socket, image, timeline string
	owners, burst, pool     int
	// only limits the templates measured (warm, ready, cold; empty: all).
	only string
	// trace prints every create's and get's answer, for finding where a
	// burst's time goes.
	trace bool
}

func main() {
	var bs builds
	var o options
	flag.Var(&bs, "build", "label=path of an incus-provider binary; repeat for several builds, measured in turns")
	flag.StringVar(&o.socket, "socket", "/var/lib/incus/unix.socket", "the Incus unix socket")
	flag.StringVar(&o.image, "image", "lightspeed-dev-guest", "the guest image alias")
	flag.IntVar(&o.owners, "owners", 20, "owners one at a time, per template")
	flag.IntVar(&o.burst, "burst", 40, "owners at once, per template")
	flag.BoolVar(&o.trace, "trace", false, "print each create's and get's answer with its time")
	flag.IntVar(&o.pool, "pool", 40, "the pooled template's warm (a build that refuses it is given its most, 32)")
	flag.StringVar(&o.timeline, "timeline", "", "the label of a build whose pool sized by demand is followed through a burst")
	incusOnly := flag.Bool("incus-only", false, "measure Incus alone, no build")
	flag.StringVar(&o.only, "only", "", "measure only these templates, comma-separated: warm (stopped spares), ready (frozen spares), cold")
	flag.Parse()
	if len(bs) == 0 && !*incusOnly {
		fmt.Fprintln(os.Stderr, "createbench: give at least one -build label=path")
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Minute)
	defer cancel()
	if err := run(ctx, bs, o); err != nil {
		fmt.Fprintln(os.Stderr, "createbench:", err)
		os.Exit(1)
	}
}

// row is one phase's figures.
type row struct {
	build, phase   string
	active, opened []time.Duration
	answeredActive int
	incus          bool
}

func run(ctx context.Context, bs builds, o options) error {
	root, err := incus.New(incus.Config{Socket: o.socket, CallTimeout: time.Minute})
	if err != nil {
		return err
	}
	defer root.Close()
	fp, err := root.GetImageAlias(ctx, o.image)
	if err != nil {
		return fmt.Errorf("image %s: %w", o.image, err)
	}
	var rows []row
	for _, b := range bs {
		label, bin, ok := strings.Cut(b, "=")
		if !ok {
			return fmt.Errorf("-build %q: want label=path", b)
		}
		rs, err := measureBuild(ctx, root, o, label, bin)
		rows = append(rows, rs...)
		if err != nil {
			return fmt.Errorf("build %s: %w", label, err)
		}
	}
	rs, err := measureIncus(ctx, root, o, fp)
	rows = append(rows, rs...)
	if err != nil {
		return fmt.Errorf("incus alone: %w", err)
	}
	report(rows, o)
	if o.timeline != "" {
		for _, b := range bs {
			if label, bin, _ := strings.Cut(b, "="); label == o.timeline {
				if err := timeline(ctx, root, o, bin); err != nil {
					return fmt.Errorf("timeline: %w", err)
				}
			}
		}
	}
	return nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// project makes a throwaway project and says how to remove it.
func project(ctx context.Context, root *incus.Client, prefix string) (*incus.Client, func(), error) {
	name := prefix + randomHex(4)
	if err := root.CreateProject(ctx, name, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		return nil, nil, err
	}
	return root.WithProject(name), func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if err := root.ForceDeleteProject(cctx, name); err != nil {
			fmt.Fprintf(os.Stderr, "createbench: removing project %s: %v\n", name, err)
		}
	}, nil
}

// served is one provider process.
type served struct {
	cmd                *exec.Cmd
	listen, metrics    string
	credential, logDir string
	trace              bool
}

func freeAddr() (string, error) {
	var lc net.ListenConfig
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	addr := l.Addr().String()
	return addr, l.Close()
}

func serve(ctx context.Context, bin, socket, project, templates string, extra ...string) (s *served, err error) {
	dir, err := os.MkdirTemp("", "createbench")
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil && (s == nil || s.cmd == nil || s.cmd.Process == nil) {
			_ = os.RemoveAll(dir) // a started process's stop removes it
		}
	}()
	s = &served{logDir: dir, credential: randomHex(16)}
	if err := os.WriteFile(filepath.Join(dir, "credential"), []byte(s.credential), 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "templates.yaml"), []byte(templates), 0o600); err != nil {
		return nil, err
	}
	if s.listen, err = freeAddr(); err != nil {
		return nil, err
	}
	if s.metrics, err = freeAddr(); err != nil {
		return nil, err
	}
	// Not bound to ctx: stop ends it, with a drain, on every path.
	s.cmd = exec.Command(bin) //nolint:noctx
	s.cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "PROVIDER_LISTEN=" + s.listen, "PROVIDER_METRICS_LISTEN=" + s.metrics,
		"PROVIDER_INGRESS_LISTEN=off", "PROVIDER_TEMPLATES=" + filepath.Join(dir, "templates.yaml"),
		"PROVIDER_CREDENTIAL_FILE=" + filepath.Join(dir, "credential"), "PROVIDER_GRACEFUL_STOP=2s",
		"INCUS_SOCKET=" + socket, "INCUS_PROJECT=" + project}, extra...)
	logf, err := os.Create(filepath.Join(dir, "provider.log"))
	if err != nil {
		return nil, err
	}
	s.cmd.Stderr = logf
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	_ = logf.Close()
	up := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(out)
		found := false
		for sc.Scan() {
			if !found && strings.HasPrefix(sc.Text(), "controller URL") {
				found = true
				up <- true
			}
		}
		if !found {
			up <- false
		}
	}()
	select {
	case ok := <-up:
		if !ok {
			log, _ := os.ReadFile(filepath.Join(dir, "provider.log"))
			s.stop() // reaps it, and removes its directory
			return nil, fmt.Errorf("the provider exited: %s", tail(string(log)))
		}
	case <-time.After(30 * time.Second):
		s.stop()
		return nil, errors.New("the provider did not serve in 30 s")
	case <-ctx.Done():
		s.stop()
		return nil, ctx.Err()
	}
	return s, nil
}

func (s *served) stop() {
	_ = s.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = s.cmd.Process.Kill()
		<-done
	}
	if s.trace {
		kept := s.logDir + ".log"
		if err := os.Rename(filepath.Join(s.logDir, "provider.log"), kept); err == nil {
			fmt.Fprintf(os.Stderr, "createbench: the provider's log is kept in %s\n", kept)
		}
	}
	_ = os.RemoveAll(s.logDir)
}

func tail(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-10):], "\n")
}

// connect opens and initializes a controller connection.
func (s *served) connect(ctx context.Context) (*jsonrpc.Client, error) {
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	ws, resp, err := d.DialContext(ctx, "ws://"+s.listen+"/control", http.Header{"Authorization": {"Bearer " + s.credential}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		return nil, err
	}
	c := jsonrpc.NewClient(ws)
	if err := c.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: 4, ClientInfo: controller.BuildInfo{Name: "createbench"}}, nil); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

// runtimeRecheck is how long the runtime waits before it asks again about
// a target that answered provisioning.
const runtimeRecheck = 2 * time.Second

// open asks for an owner's environment as the runtime does and times it.
func (s *served) open(ctx context.Context, c *jsonrpc.Client, owner controller.Owner, template string) (active, opened time.Duration, answeredActive bool, err error) {
	began := time.Now()
	call := func(method string, params any) (controller.Observation, error) {
		return callRetrying(ctx, c, method, params)
	}
	obs, err := call("target/create", controller.CreateParams{Owner: owner, TemplateID: template})
	if err != nil {
		return 0, 0, false, fmt.Errorf("create: %w", err)
	}
	answeredActive = obs.Phase == controller.PhaseActive
	trace := func(what string, o controller.Observation) {
		if s.trace {
			fmt.Fprintf(os.Stderr, "trace %s %6d ms %s %s id=%q %s\n", owner.EnvironmentID, time.Since(began).Milliseconds(), what, o.Phase, o.TargetID, o.Message)
		}
	}
	trace("create", obs)
	for deadline := time.Now().Add(3 * time.Minute); obs.Phase != controller.PhaseActive; {
		if obs.Phase != controller.PhaseProvisioning || time.Now().After(deadline) {
			return 0, 0, false, fmt.Errorf("create of %v observed %s: %s", owner, obs.Phase, obs.Message)
		}
		time.Sleep(runtimeRecheck)
		if obs, err = call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}}); err != nil {
			return 0, 0, false, fmt.Errorf("get: %w", err)
		}
		trace("get", obs)
	}
	active = time.Since(began)
	url := "ws://" + s.listen + routes.Path("/routes", routes.Route{Owner: owner, TargetID: obs.TargetID})
	for deadline := time.Now().Add(time.Minute); ; {
		d, err := conformance.RouteDialer{AsARuntime: true}.Dial(ctx, url, s.credential)
		if err == nil && d.Conn != nil {
			err = conformance.InitializeData(d.Conn, "createbench", 10*time.Second)
			_ = d.Conn.Close()
			if err != nil {
				return 0, 0, false, fmt.Errorf("initialize through the route: %w", err)
			}
			return active, time.Since(began), answeredActive, nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return 0, 0, false, fmt.Errorf("the route never opened: %w", err)
			}
			return 0, 0, false, fmt.Errorf("the route never opened: %+v", d.Refusal)
		}
		wait := 200 * time.Millisecond
		if d.Refusal != nil && d.Refusal.RetryAfter > 0 {
			wait = d.Refusal.RetryAfter
		}
		time.Sleep(wait)
	}
}

// callRetrying calls method as a runtime does: an unavailable or busy
// answer is asked again after its retryAfterMs, for a minute at most.
func callRetrying(ctx context.Context, c *jsonrpc.Client, method string, params any) (controller.Observation, error) {
	for deadline := time.Now().Add(time.Minute); ; {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		var res controller.TargetResult
		err := c.Call(cctx, method, params, &res)
		cancel()
		var e *jsonrpc.Error
		if !errors.As(err, &e) || (e.Kind != jsonrpc.KindUnavailable && e.Kind != jsonrpc.KindBusy) || time.Now().After(deadline) {
			return res.Target, err
		}
		wait := uint64(100)
		if e.RetryAfterMs != nil {
			wait = max(*e.RetryAfterMs, wait)
		}
		time.Sleep(time.Duration(wait) * time.Millisecond)
	}
}

// readyWarm counts the spares of a template's pool ready to hand out:
// stopped ones under warm- names, or, for the ready template, frozen ones
// under lsr- names.
func readyWarm(ctx context.Context, c *incus.Client, tmpl string) (int, error) {
	list, err := c.ListInstances(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, i := range list {
		if i.Config["user.lightspeed.warm"] == tmpl && i.Config["user.lightspeed.warm_ready_ms"] != "" && i.Config["user.lightspeed.warm_claim"] == "" &&
			(tmpl != "ready" || i.Status == incus.InstanceFrozen) {
			n++
		}
	}
	return n, nil
}

func awaitWarm(ctx context.Context, c *incus.Client, tmpl string, n int) error {
	for deadline := time.Now().Add(5 * time.Minute); ; {
		got, err := readyWarm(ctx, c, tmpl)
		if err == nil && got >= n {
			return nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("the pool never held %d ready: %w", n, err)
			}
			return fmt.Errorf("the pool never held %d ready (%d)", n, got)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// closeAll closes the owners' targets and waits until Incus holds none.
func (s *served) closeAll(ctx context.Context, c *jsonrpc.Client, inc *incus.Client, owners []controller.Owner) error {
	for _, o := range owners {
		if _, err := callRetrying(ctx, c, "target/close", controller.TargetParams{Target: controller.TargetRef{Owner: o}}); err != nil {
			return fmt.Errorf("close: %w", err)
		}
	}
	for deadline := time.Now().Add(5 * time.Minute); ; {
		list, err := inc.ListInstances(ctx)
		left := 0
		for _, i := range list {
			// Targets and stand-ins; a spare handed out carries its claim.
			if strings.HasPrefix(i.Name, "ls-") || strings.HasPrefix(i.Name, "lsr-") && i.Config["user.lightspeed.warm_claim"] != "" {
				left++
			}
		}
		if err == nil && left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("listing after closing: %w", err)
			}
			return fmt.Errorf("%d targets left after closing", left)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// templatesFile offers the templates named: a pool of stopped spares
// (warm), of frozen spares (ready) and of running ones (live), which a
// build before warmState refuses, and no pool (cold).
func templatesFile(image string, pool int, names []string) string {
	f := "templates:\n"
	for _, n := range names {
		state := ""
		switch n {
		case "ready":
			state = "    warmState: frozen\n"
		case "live":
			state = "    warmState: running\n"
		}
		warm := ""
		if n != "cold" {
			warm = fmt.Sprintf("    warm: %d\n", pool)
		}
		f += fmt.Sprintf(`  - templateId: %s
    displayName: %s
    powerStates: [running, paused, stopped]
    imageAlias: %s
`, n, n, image) + warm + state
	}
	return f
}

func measureBuild(ctx context.Context, root *incus.Client, o options, label, bin string) ([]row, error) {
	inc, drop, err := project(ctx, root, "lsbench-c-")
	if err != nil {
		return nil, err
	}
	defer drop()
	pool := o.pool
	only := func(ts []string) []string {
		if o.only == "" {
			return ts
		}
		return slices.DeleteFunc(ts, func(t string) bool { return !slices.Contains(strings.Split(o.only, ","), t) })
	}
	tmpls := only([]string{"warm", "ready", "live", "cold"})
	s, err := serve(ctx, bin, o.socket, inc.Project(), templatesFile(o.image, pool, tmpls))
	if err != nil {
		// A build without warmState.
		tmpls = only([]string{"warm", "cold"})
		s, err = serve(ctx, bin, o.socket, inc.Project(), templatesFile(o.image, pool, tmpls))
	}
	if err != nil && pool > 32 {
		pool = 32 // the most a build before issue 27 takes
		fmt.Fprintf(os.Stderr, "createbench: build %s refused a pool of %d; measuring it with %d\n", label, o.pool, pool)
		s, err = serve(ctx, bin, o.socket, inc.Project(), templatesFile(o.image, pool, tmpls))
	}
	if err != nil {
		return nil, err
	}
	defer s.stop()
	s.trace = o.trace
	conns := make([]*jsonrpc.Client, 4)
	for i := range conns {
		if conns[i], err = s.connect(ctx); err != nil {
			return nil, err
		}
		defer func() { _ = conns[i].Close() }()
	}
	var rows []row
	owner := func(phase string, i int) controller.Owner {
		return controller.Owner{UniverseID: "u-createbench", EnvironmentID: fmt.Sprintf("%s-%s-%d", label, phase, i)}
	}
	for _, tmpl := range tmpls {
		r := row{build: label, phase: fmt.Sprintf("one at a time, %s", phaseName(tmpl, pool))}
		var owners []controller.Owner
		for i := range o.owners {
			if tmpl != "cold" {
				if err := awaitWarm(ctx, inc, tmpl, pool); err != nil {
					return rows, err
				}
			}
			ow := owner("seq-"+tmpl, i)
			owners = append(owners, ow)
			a, op, aa, err := s.open(ctx, conns[0], ow, tmpl)
			if err != nil {
				return rows, err
			}
			r.active, r.opened = append(r.active, a), append(r.opened, op)
			if aa {
				r.answeredActive++
			}
		}
		rows = append(rows, r)
		fmt.Fprintf(os.Stderr, "createbench: %s, %s done\n", label, r.phase)
		if err := s.closeAll(ctx, conns[0], inc, owners); err != nil {
			return rows, err
		}
	}
	for _, tmpl := range tmpls {
		if tmpl != "cold" {
			if err := awaitWarm(ctx, inc, tmpl, pool); err != nil {
				return rows, err
			}
		}
		r := row{build: label, phase: fmt.Sprintf("%d at once, %s", o.burst, phaseName(tmpl, pool))}
		var owners []controller.Owner
		var mu sync.Mutex
		var wg sync.WaitGroup
		var firstErr error
		for i := range o.burst {
			ow := owner("burst-"+tmpl, i)
			owners = append(owners, ow)
			wg.Go(func() {
				a, op, aa, err := s.open(ctx, conns[i%len(conns)], ow, tmpl)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					firstErr = cmpErr(firstErr, err)
					return
				}
				r.active, r.opened = append(r.active, a), append(r.opened, op)
				if aa {
					r.answeredActive++
				}
			})
		}
		wg.Wait()
		rows = append(rows, r)
		if firstErr != nil {
			return rows, firstErr
		}
		fmt.Fprintf(os.Stderr, "createbench: %s, %s done\n", label, r.phase)
		if err := s.closeAll(ctx, conns[0], inc, owners); err != nil {
			return rows, err
		}
	}
	return rows, nil
}

func phaseName(tmpl string, pool int) string {
	switch tmpl {
	case "warm":
		return fmt.Sprintf("from a pool of %d stopped", pool)
	case "ready":
		return fmt.Sprintf("from a pool of %d frozen", pool)
	case "live":
		return fmt.Sprintf("from a pool of %d running", pool)
	}
	return "no pool"
}

func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// measureIncus times Incus's own create and start of the image, to Running.
func measureIncus(ctx context.Context, root *incus.Client, o options, fp string) ([]row, error) {
	inc, drop, err := project(ctx, root, "lsbench-i-")
	if err != nil {
		return nil, err
	}
	defer drop()
	one := func(name string) (time.Duration, error) {
		began := time.Now()
		op, err := inc.CreateInstance(ctx, incus.InstancesPost{Name: name, Source: incus.InstanceSource{Type: "image", Fingerprint: fp}, Start: true})
		if err == nil {
			_, err = inc.Wait(ctx, op)
		}
		return time.Since(began), err
	}
	seq := row{build: "Incus alone", phase: "create and start, one at a time", incus: true}
	for i := range o.owners {
		d, err := one(fmt.Sprintf("seq-%d", i))
		if err != nil {
			return nil, err
		}
		seq.active = append(seq.active, d)
	}
	burst := row{build: "Incus alone", phase: fmt.Sprintf("create and start, %d at once", o.burst), incus: true}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var firstErr error
	for i := range o.burst {
		wg.Go(func() {
			d, err := one(fmt.Sprintf("burst-%d", i))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				firstErr = cmpErr(firstErr, err)
				return
			}
			burst.active = append(burst.active, d)
		})
	}
	wg.Wait()
	if firstErr != nil {
		return []row{seq, burst}, firstErr
	}
	rows := []row{seq, burst}
	for _, design := range []handoutDesign{renameAndStart, standInAndUnfreeze} {
		rs, err := measureHandouts(ctx, inc, o, fp, design)
		rows = append(rows, rs...)
		if err != nil {
			return rows, err
		}
	}
	return rows, nil
}

// handoutDesign is one way to hand a spare out, as Incus calls alone.
type handoutDesign struct {
	name string
	// ready readies a spare (untimed): stopped, or started and frozen.
	ready func(ctx context.Context, inc *incus.Client, spare string) error
	// handout makes spare owner's (timed).
	handout func(ctx context.Context, inc *incus.Client, spare, owner string) error
}

func waitOp(ctx context.Context, inc *incus.Client, op *incus.Operation, err error) error {
	if err != nil {
		return err
	}
	_, err = inc.Wait(ctx, op)
	return err
}

// renameAndStart is today's hand-out: the stopped spare renamed to the
// owner's name (the lock), then started.
var renameAndStart = handoutDesign{
	name:  "rename+start a stopped spare",
	ready: func(context.Context, *incus.Client, string) error { return nil },
	handout: func(ctx context.Context, inc *incus.Client, spare, owner string) error {
		op, err := inc.RenameInstance(ctx, spare, owner)
		if err := waitOp(ctx, inc, op, err); err != nil {
			return err
		}
		op, err = inc.UpdateInstanceState(ctx, owner, incus.InstanceStatePut{Action: incus.ActionStart})
		return waitOp(ctx, inc, op, err)
	},
}

// standInAndUnfreeze is the hand-out docs/instant-handouts.md chooses: an
// empty stand-in at the owner's name (the lock) naming the spare, the
// claim written on the spare, the frozen spare unfrozen.
var standInAndUnfreeze = handoutDesign{
	name: "stand-in+claim+unfreeze a frozen spare",
	ready: func(ctx context.Context, inc *incus.Client, spare string) error {
		op, err := inc.UpdateInstanceState(ctx, spare, incus.InstanceStatePut{Action: incus.ActionStart})
		if err := waitOp(ctx, inc, op, err); err != nil {
			return err
		}
		op, err = inc.UpdateInstanceState(ctx, spare, incus.InstanceStatePut{Action: incus.ActionFreeze})
		return waitOp(ctx, inc, op, err)
	},
	handout: func(ctx context.Context, inc *incus.Client, spare, owner string) error {
		op, err := inc.CreateInstance(ctx, incus.InstancesPost{Name: owner, Source: incus.InstanceSource{Type: "none"},
			Config: map[string]string{"user.lightspeed.stand_in_for": spare}})
		if err := waitOp(ctx, inc, op, err); err != nil {
			return err
		}
		if err := inc.PatchInstanceConfig(ctx, spare, map[string]string{"user.lightspeed.claim": owner}); err != nil {
			return err
		}
		op, err = inc.UpdateInstanceState(ctx, spare, incus.InstanceStatePut{Action: incus.ActionUnfreeze})
		return waitOp(ctx, inc, op, err)
	},
}

// measureHandouts times a design's hand-outs, one at a time and -burst at
// once, each from a spare readied beforehand.
func measureHandouts(ctx context.Context, inc *incus.Client, o options, fp string, d handoutDesign) ([]row, error) {
	prepare := func(prefix string, n int) ([]string, error) {
		var spares []string
		var mu sync.Mutex
		var wg sync.WaitGroup
		var firstErr error
		sem := make(chan struct{}, 4)
		for i := range n {
			name := fmt.Sprintf("%s-spare-%d", prefix, i)
			spares = append(spares, name)
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				op, err := inc.CreateInstance(ctx, incus.InstancesPost{Name: name, Source: incus.InstanceSource{Type: "image", Fingerprint: fp}})
				err = waitOp(ctx, inc, op, err)
				if err == nil {
					err = d.ready(ctx, inc, name)
				}
				mu.Lock()
				firstErr = cmpErr(firstErr, err)
				mu.Unlock()
			})
		}
		wg.Wait()
		return spares, firstErr
	}
	key := map[string]string{"rename+start a stopped spare": "rs", "stand-in+claim+unfreeze a frozen spare": "su"}[d.name]
	seq := row{build: "Incus alone", phase: "hand-out, one at a time: " + d.name, incus: true}
	spares, err := prepare(key+"-seq", o.owners)
	if err != nil {
		return nil, err
	}
	for i, sp := range spares {
		began := time.Now()
		if err := d.handout(ctx, inc, sp, fmt.Sprintf("%s-seq-owner-%d", key, i)); err != nil {
			return nil, err
		}
		seq.active = append(seq.active, time.Since(began))
	}
	burst := row{build: "Incus alone", phase: fmt.Sprintf("hand-out, %d at once: %s", o.burst, d.name), incus: true}
	if spares, err = prepare(key+"-burst", o.burst); err != nil {
		return []row{seq}, err
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var firstErr error
	for i, sp := range spares {
		wg.Go(func() {
			began := time.Now()
			err := d.handout(ctx, inc, sp, fmt.Sprintf("%s-burst-owner-%d", key, i))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				firstErr = cmpErr(firstErr, err)
				return
			}
			burst.active = append(burst.active, time.Since(began))
		})
	}
	wg.Wait()
	return []row{seq, burst}, firstErr
}

func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[(len(s)-1)*p/100]
}

func ms(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 0, 64) + " ms"
}

var poolSize = regexp.MustCompile(`a pool of \d+`)

func report(rows []row, o options) {
	fmt.Printf("\n== create → active and create → opened, the runtime's way (re-check every %s, Retry-After honoured)\n", runtimeRecheck)
	fmt.Printf("%-12s %-62s %-8s %-32s %-32s %s\n", "build", "phase", "active", "create → active p50 / p95 / max", "create → opened p50 / p95 / max", "p50 vs the first build (active, opened)")
	// The first build's rows are the baseline of every other's, phase by
	// phase; a pool of frozen spares is set beside the first build's pool
	// of stopped ones, the design it replaces, when that build has none.
	base := map[string]row{}
	for _, r := range rows {
		if !r.incus && r.build == rows[0].build {
			base[r.phase] = r
		}
	}
	// Phases compare by shape: a pool's size may differ between builds
	// (an older one takes at most 32).
	shape := func(phase string) string { return poolSize.ReplaceAllString(phase, "a pool of N") }
	byShape := map[string]row{}
	for p, r := range base {
		byShape[shape(p)] = r
	}
	baseOf := func(phase string) (row, bool) {
		if b, ok := byShape[shape(phase)]; ok {
			return b, true
		}
		b, ok := byShape[shape(strings.Replace(phase, " frozen", " stopped", 1))]
		return b, ok
	}
	for _, r := range rows {
		answered := fmt.Sprintf("%d/%d", r.answeredActive, len(r.active))
		if r.incus {
			answered = "-"
		}
		opened := "-"
		if len(r.opened) > 0 {
			opened = fmt.Sprintf("%s / %s / %s", ms(pct(r.opened, 50)), ms(pct(r.opened, 95)), ms(pct(r.opened, 100)))
		}
		ratio := ""
		if !r.incus && r.build != rows[0].build {
			if b, ok := baseOf(r.phase); ok && len(b.active) > 0 {
				ratio = fmt.Sprintf("%.2f×, %.2f×", float64(pct(r.active, 50))/float64(pct(b.active, 50)), float64(pct(r.opened, 50))/float64(pct(b.opened, 50)))
			}
		}
		fmt.Printf("%-12s %-62s %-8s %-32s %-32s %s\n", r.build, r.phase, answered,
			fmt.Sprintf("%s / %s / %s", ms(pct(r.active, 50)), ms(pct(r.active, 95)), ms(pct(r.active, 100))), opened, ratio)
	}
	fmt.Println("(active: creates answered active at once; Incus alone: its own calls, to the last operation's end; a hand-out's spare readied, untimed, beforehand)")
	// The goals, for the last build measured.
	lastBuild := ""
	for _, r := range rows {
		if !r.incus {
			lastBuild = r.build
		}
	}
	// Its pool of frozen spares when it has one, else its stopped one.
	var seq, burst *row
	for _, kind := range []string{"frozen", "stopped"} {
		for i := range rows {
			r := &rows[i]
			if r.incus || r.build != lastBuild || !strings.HasSuffix(r.phase, " "+kind) {
				continue
			}
			if strings.HasPrefix(r.phase, "one at a time") {
				seq = r
			} else {
				burst = r
			}
		}
		if seq != nil && burst != nil {
			break
		}
	}
	if seq != nil && burst != nil {
		met := func(ok bool) string {
			if ok {
				return "met"
			}
			return "MISSED"
		}
		fmt.Printf("goals, build %s: %s, create → active p50 %s ≤ 100 ms: %s; %s, p50 %s ≤ 1 s and max %s ≤ 2 s: %s\n",
			lastBuild, seq.phase, ms(pct(seq.active, 50)), met(pct(seq.active, 50) <= 100*time.Millisecond),
			burst.phase, ms(pct(burst.active, 50)), ms(pct(burst.active, 100)),
			met(pct(burst.active, 50) <= time.Second && pct(burst.active, 100) <= 2*time.Second))
	}
}

// timeline follows a pool sized by demand through a burst and back.
func timeline(ctx context.Context, root *incus.Client, o options, bin string) error {
	inc, drop, err := project(ctx, root, "lsbench-t-")
	if err != nil {
		return err
	}
	defer drop()
	const shrink = 30 * time.Second
	tmpl := fmt.Sprintf(`templates:
  - templateId: ready
    displayName: a pool of frozen spares sized by demand
    powerStates: [running, paused, stopped]
    imageAlias: %s
    warm: 2
    warmMax: 24
    warmState: frozen
`, o.image)
	s, err := serve(ctx, bin, o.socket, inc.Project(), tmpl, "PROVIDER_WARM_SHRINK_AFTER="+shrink.String(), "PROVIDER_WARM_BURST_WINDOW=10s")
	if err != nil {
		return err
	}
	defer s.stop()
	c, err := s.connect(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	if err := awaitWarm(ctx, inc, "ready", 2); err != nil {
		return err
	}
	fmt.Printf("\n== a pool of frozen spares sized by demand (warm 2, warmMax 24, burst window 10s, shrink after %s): a burst of 12 creates at 0 s\n", shrink)
	fmt.Printf("%-8s %-8s %-8s\n", "time", "ready", "wanted")
	began := time.Now()
	// A row when the pool or its size changes.
	last := ""
	sample := func() {
		n, _ := readyWarm(ctx, inc, "ready")
		now := fmt.Sprintf("%-8d %-8s", n, scrape(s.metrics, `incus_provider_warm_wanted{`))
		if now != last {
			fmt.Printf("%-8s %s\n", fmt.Sprintf("%.0fs", time.Since(began).Seconds()), now)
			last = now
		}
	}
	sample()
	var owners []controller.Owner
	var wg sync.WaitGroup
	for i := range 12 {
		ow := controller.Owner{UniverseID: "u-createbench", EnvironmentID: fmt.Sprintf("timeline-%d", i)}
		owners = append(owners, ow)
		wg.Go(func() { _, _, _, _ = s.open(ctx, c, ow, "ready") })
	}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				sample()
			}
		}
	}()
	wg.Wait()
	// Until the pool is back at its minimum, and a little more.
	deadline := time.Now().Add(2*shrink + 2*time.Minute)
	for time.Now().Before(deadline) {
		n, _ := readyWarm(ctx, inc, "ready")
		if n == 2 && time.Since(began) > shrink {
			break
		}
		time.Sleep(time.Second)
	}
	time.Sleep(3 * time.Second)
	close(stop)
	<-sampled
	return s.closeAll(ctx, c, inc, owners)
}

// scrape reads one series' value from a /metrics exposition.
func scrape(addr, prefix string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return "?"
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "?"
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, prefix) {
			if i := strings.LastIndexByte(l, ' '); i > 0 {
				return l[i+1:]
			}
		}
	}
	return "?"
}
