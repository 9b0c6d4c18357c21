package main

import (
	"github.com/lightspeed-dev/incus-provider/internal/clusterenv"

	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// clusterProjectPrefix starts the cluster run's project: LXC names a
// container's cgroup after its project and name on the whole host, which
// the rig shares with the ordinary daemon, and the rig's teardown sweeps
// this prefix (internal/incustest.ClusterProjectPrefix).
const clusterProjectPrefix = "lsc-"

// clusterRig is the part of the rig's settings file the benchmark uses.
type clusterRig struct {
	urls                           []string
	members                        []string
	clientCert, clientKey, srvCert string
}

// readClusterRig reads the rig's settings (internal/clusterenv).
func readClusterRig(path string) (*clusterRig, error) {
	st, err := clusterenv.Read(path)
	if err != nil {
		return nil, err
	}
	return &clusterRig{urls: st.URLs, members: st.Members, clientCert: st.ClientCert, clientKey: st.ClientKey, srvCert: st.ServerCert}, nil
}

// pickMembers checks -member and -remote against the rig.
func pickMembers(cfg benchConfig, rig *clusterRig) (local, remote string, err error) {
	if len(rig.members) < 2 {
		return "", "", errors.New("the cluster has one member: there is no remote target to measure")
	}
	local, remote = cfg.member, cfg.remote
	if !slices.Contains(rig.members, local) {
		return "", "", fmt.Errorf("-member %q is not a member of the cluster (%s)", local, strings.Join(rig.members, ", "))
	}
	if remote == "" {
		for _, m := range rig.members {
			if m != local {
				remote = m
			}
		}
	}
	if !slices.Contains(rig.members, remote) || remote == local {
		return "", "", fmt.Errorf("-remote %q must be a member of the cluster other than -member %q", remote, local)
	}
	return local, remote, nil
}

func runCluster(ctx context.Context, cfg benchConfig) error {
	if os.Geteuid() != 0 {
		return errors.New("run as root: the netns GuestDialer enters the local member's guests' network namespaces")
	}
	rig, err := readClusterRig(cfg.cluster)
	if err != nil {
		return err
	}
	localMember, remoteMember, err := pickMembers(cfg, rig)
	if err != nil {
		return err
	}
	icfg := incus.Config{URLs: rig.urls, ClientCert: rig.clientCert, ClientKey: rig.clientKey, ServerCert: rig.srvCert, CallTimeout: 30 * time.Second}
	root, err := incus.New(icfg)
	if err != nil {
		return fmt.Errorf("cluster client: %w", err)
	}
	defer root.Close()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	srv, err := root.GetServer(sctx)
	if err != nil {
		return fmt.Errorf("the cluster at %s does not answer: %w", strings.Join(rig.urls, ","), err)
	}
	if !srv.Environment.ServerClustered {
		return fmt.Errorf("%s is not a cluster", strings.Join(rig.urls, ","))
	}
	fp, err := root.GetImageAlias(sctx, cfg.image)
	if err != nil {
		return fmt.Errorf("image alias %q on the cluster (deploy/dev/incus-cluster-up.sh imports it): %w", cfg.image, err)
	}

	project := clusterProjectPrefix + randomHex(4)
	if err := root.CreateProject(sctx, project, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		return fmt.Errorf("create project %s: %w", project, err)
	}
	defer removeProject(root, project)
	icfg.Project = project
	client, err := incus.New(icfg)
	if err != nil {
		return fmt.Errorf("cluster client: %w", err)
	}
	defer client.Close()

	work, err := os.MkdirTemp("", "routebench-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(work) }()
	var tmpl strings.Builder
	tmpl.WriteString("templates:\n")
	for _, m := range rig.members {
		fmt.Fprintf(&tmpl, "  - templateId: bench-%s\n    displayName: routebench guest on %s\n    powerStates: [running, paused, stopped]\n    imageAlias: %s\n    placement: %s\n",
			m, m, cfg.image, m)
	}
	tmplPath := filepath.Join(work, "templates.yaml")
	if err := os.WriteFile(tmplPath, []byte(tmpl.String()), 0o600); err != nil {
		return err
	}
	credential := randomHex(16)
	childEnv := []string{"ROUTEBENCH_INCUS_URLS=" + strings.Join(rig.urls, ","),
		"ROUTEBENCH_INCUS_CLIENT_CERT=" + rig.clientCert, "ROUTEBENCH_INCUS_CLIENT_KEY=" + rig.clientKey,
		"ROUTEBENCH_INCUS_SERVER_CERT=" + rig.srvCert,
		"ROUTEBENCH_PROJECT=" + project, "ROUTEBENCH_TEMPLATES=" + tmplPath, "ROUTEBENCH_CREDENTIAL=" + credential}
	var peers map[string]string
	var secret []byte
	var peerControl string
	remoteWay := "exec"
	if cfg.lb != "" && !cfg.forward {
		return errors.New("-lb needs -forward: the load balancer is put in front of the two provider processes")
	}
	if cfg.forward {
		// A second provider process stands for the replica on the remote
		// member and serves its guests to the first.
		secret = []byte(randomHex(32))
		secretPath := filepath.Join(work, "peer.secret")
		if err := os.WriteFile(secretPath, secret, 0o600); err != nil {
			return err
		}
		peerAddr, err := freeLoopback(ctx)
		if err != nil {
			return err
		}
		peer, peerCtl, err := startChild(ctx, append(childEnv[:len(childEnv):len(childEnv)], "ROUTEBENCH_MEMBER="+remoteMember,
			"ROUTEBENCH_PEER_LISTEN="+peerAddr, "ROUTEBENCH_PEER_SECRET="+secretPath))
		if err != nil {
			return fmt.Errorf("the peer replica on %s: %w", remoteMember, err)
		}
		defer peer.stop()
		peers = map[string]string{remoteMember: peerAddr}
		childEnv = append(childEnv, "ROUTEBENCH_PEERS="+remoteMember+"="+peerAddr, "ROUTEBENCH_PEER_SECRET="+secretPath)
		remoteWay = "forwarded through " + remoteMember + "'s replica"
		peerControl = peerCtl
	}
	child, addr, err := startChild(ctx, append(childEnv, "ROUTEBENCH_MEMBER="+localMember))
	if err != nil {
		return err
	}
	defer child.stop()

	loadBefore := loadAverage()
	// The benchmark's direct path is the provider's own kind of dialer,
	// over its own HTTPS connections to the cluster.
	dialer, err := guest.New(guest.KindMember, guest.Options{Lookup: client.InitPID, Member: localMember,
		Located: client.LocatedInitPID, Peers: peers, PeerSecret: secret,
		Exec: func(ctx context.Context, instance string, argv []string) (net.Conn, error) {
			return client.ExecStream(ctx, instance, argv)
		}})
	if err != nil {
		return err
	}
	s := &session{cfg: cfg, addr: addr, credential: credential, incus: client, dialer: dialer}
	logf("Incus %s cluster %s, image %s (%.12s), project %s, provider on %s at %s",
		srv.Environment.ServerVersion, strings.Join(rig.members, ","), cfg.image, fp, project, localMember, addr)
	if err := s.connect(ctx); err != nil {
		return err
	}
	defer s.close()
	creator := s
	s.through = "one provider"
	if cfg.lb != "" {
		lbAddr, stopLB, err := startHAProxy(ctx, cfg.lb, work, addr, peerControl)
		if err != nil {
			return err
		}
		defer stopLB()
		creator = &session{cfg: cfg, addr: lbAddr, credential: credential, incus: client, dialer: dialer, connPerOwner: true,
			through: "HAProxy (" + cfg.lb + ") in front of both provider processes, a connection per owner"}
		if err := creator.connect(ctx); err != nil {
			return fmt.Errorf("through the load balancer: %w", err)
		}
		defer creator.close()
	}
	local := &bench{session: s, template: "bench-" + localMember, label: fmt.Sprintf("local (%s, netns)", localMember)}
	remote := &bench{session: s, template: "bench-" + remoteMember, label: fmt.Sprintf("remote (%s, %s)", remoteMember, remoteWay)}
	for _, b := range []*bench{local, remote} {
		err := b.create(ctx)
		defer b.tearDown()
		if err != nil {
			return fmt.Errorf("%s: %w", b.label, err)
		}
	}
	for _, b := range []*bench{local, remote} {
		want := localMember
		if b == remote {
			want = remoteMember
		}
		if b.location != want {
			return fmt.Errorf("%s: the instance is on %q", b.label, b.location)
		}
	}
	rep, err := measureCluster(ctx, local, remote, creator, rig.members)
	if err != nil {
		return err
	}
	rep.header = fmt.Sprintf("Incus %s cluster of %d members (%s) on loopback, image %s (%.12s), provider on %s over HTTPS to every member, GuestDialer member (netns on %s, %s for %s), %d CPUs, load average %s at the start, %s at the end",
		srv.Environment.ServerVersion, len(rig.members), strings.Join(rig.members, ", "), cfg.image, fp, localMember, localMember, remoteWay, remoteMember, numCPU(), loadBefore, loadAverage())
	rep.print(os.Stdout)
	return nil
}

// clusterReport is a cluster run: each figure for both targets.
type clusterReport struct {
	header        string
	local, remote *report
	localLabel    string
	remoteLabel   string
	dials         map[*report]dialResult
	creates       createResult
	// createsThrough says what the creates went through.
	createsThrough string
	idleRelays     int
}

// dialResult is the anatomy of the benchmark's own dials to a daemon:
// the GuestDialer's dial (for exec: ExecStream, the POST and the four
// websockets), then the daemon's WebSocket handshake over it (for exec:
// nc starting in the guest and connecting, then the handshake).
type dialResult struct {
	dial, upgraded []time.Duration
}

func measureCluster(ctx context.Context, local, remote *bench, creator *session, members []string) (*clusterReport, error) {
	cr := &clusterReport{local: &report{}, remote: &report{}, localLabel: local.label, remoteLabel: remote.label,
		dials: map[*report]dialResult{}, idleRelays: local.cfg.idleRelays}
	pairs := []struct {
		b   *bench
		rep *report
	}{{local, cr.local}, {remote, cr.remote}}
	for _, p := range pairs {
		if err := p.b.warmUp(ctx); err != nil {
			return nil, fmt.Errorf("%s: %w", p.b.label, err)
		}
	}
	for _, p := range pairs {
		d, err := p.b.measureDials(ctx, 30)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p.b.label, err)
		}
		cr.dials[p.rep] = d
	}
	// Each figure for both targets back to back, so that the machine's
	// other load falls alike on both.
	for _, p := range pairs {
		c, err := p.b.measureCycles(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p.b.label, err)
		}
		p.rep.cycles = c
	}
	for _, from := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
		for _, p := range pairs {
			w, err := p.b.measureWakes(ctx, from)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", p.b.label, err)
			}
			p.rep.wakes = append(p.rep.wakes, w)
		}
	}
	bs, reps := []*bench{local, remote}, []*report{cr.local, cr.remote}
	if err := measureRTT(ctx, bs, reps); err != nil {
		return nil, err
	}
	if err := measureThroughput(ctx, bs, reps); err != nil {
		return nil, err
	}
	if local.cfg.idleRelays > 0 {
		for _, p := range pairs {
			if err := p.b.measureMemory(ctx, p.rep); err != nil {
				return nil, fmt.Errorf("%s: %w", p.b.label, err)
			}
		}
	}
	c, err := creator.measureCreates(ctx, members)
	if err != nil {
		return nil, err
	}
	cr.creates = c
	cr.createsThrough = creator.through
	return cr, nil
}

// warmUp proves the route with one dial and an initialize.
func (b *bench) warmUp(ctx context.Context) error {
	ws, _, why, err := b.dialRoute(ctx, 64<<10)
	if err != nil {
		return fmt.Errorf("first dial: %w", err)
	}
	if ws == nil {
		return fmt.Errorf("first dial refused: %s", why)
	}
	defer closeWS(ws)
	return initializeData(ws)
}

// measureDials times n of the benchmark's own dials to the running
// target's daemon, each closed before the next.
func (b *bench) measureDials(ctx context.Context, n int) (dialResult, error) {
	b.logf("measuring %d direct dials", n)
	var r dialResult
	for i := 0; i < n; i++ {
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		start := time.Now()
		conn, err := b.dialer.DialContext(dctx, guest.Target{Instance: b.targetID, Port: guest.DefaultPort, Location: b.location})
		if err != nil {
			cancel()
			return r, err
		}
		dialed := time.Since(start)
		ws, err := wsOver(dctx, conn)
		upgraded := time.Since(start)
		cancel()
		if err != nil {
			return r, err
		}
		_ = ws.Close()
		r.dial = append(r.dial, dialed)
		r.upgraded = append(r.upgraded, upgraded)
	}
	return r, nil
}

// createResult is create → active for many owners at once, then close →
// closed for all of them at once.
type createResult struct {
	owners    int
	templates []string
	toActive  []time.Duration
	byMember  map[string][]time.Duration
	toClosed  []time.Duration
	// wall is from the first create sent to the last owner active.
	wall time.Duration
	// retried counts creates answered unavailable or busy and asked again.
	retried  int
	failures []string
}

// measureCreates creates cfg.owners owners at once through the controller
// plane, template i placed on members[i % len], polls each until active
// (every 20 ms, as the runtime would), checks where Incus put each, and
// closes them all at once, also when the measurement fails.
func (s *session) measureCreates(ctx context.Context, members []string) (res createResult, err error) {
	n := s.cfg.owners
	res = createResult{owners: n, byMember: map[string][]time.Duration{}}
	for _, m := range members {
		res.templates = append(res.templates, "bench-"+m)
	}
	if n <= 0 {
		return res, nil
	}
	logf("creating %d owners at once over %s", n, strings.Join(members, ", "))
	owners := make([]controller.Owner, n)
	tag := randomHex(3)
	for i := range owners {
		owners[i] = controller.Owner{UniverseID: "u-routebench", EnvironmentID: fmt.Sprintf("env-create-%s-%02d", tag, i)}
	}
	defer func() {
		if c, err := s.closeAll(owners); err == nil {
			res.toClosed = c
		} else {
			logf("closing the create owners: %v", err)
		}
	}()

	cctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	toActive := make([]time.Duration, n)
	ids := make([]string, n)
	errs := make([]error, n)
	retries := make([]int, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range owners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			on := s
			if s.connPerOwner {
				own := &session{cfg: s.cfg, addr: s.addr, credential: s.credential}
				if err := own.connect(cctx); err != nil {
					errs[i] = err
					return
				}
				defer own.close()
				on = own
			}
			// An unavailable or busy answer is asked again after its
			// retryAfterMs, as the runtime would; the clock runs from the
			// first ask.
			for {
				var r controller.TargetResult
				err := on.ctrl.Call(cctx, "target/create", controller.CreateParams{Owner: owners[i], TemplateID: res.templates[i%len(members)]}, &r)
				if err == nil {
					break
				}
				var rpcErr *jsonrpc.Error
				if !errors.As(err, &rpcErr) || (rpcErr.Kind != jsonrpc.KindUnavailable && rpcErr.Kind != jsonrpc.KindBusy) {
					errs[i] = fmt.Errorf("target/create: %w", err)
					return
				}
				retries[i]++
				wait := 500 * time.Millisecond
				if rpcErr.RetryAfterMs != nil {
					wait = time.Duration(*rpcErr.RetryAfterMs) * time.Millisecond
				}
				if !clock.Sleep(cctx, wait) {
					errs[i] = fmt.Errorf("target/create: %w", err)
					return
				}
			}
			for {
				o, err := on.getOwner(cctx, owners[i])
				if err == nil && o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == "" {
					toActive[i], ids[i] = time.Since(start), o.TargetID
					return
				}
				if err == nil && (o.Phase == controller.PhaseFailed || o.Phase == controller.PhaseClosed) {
					errs[i] = fmt.Errorf("observed %s: %s", o.Phase, o.Message)
					return
				}
				if !clock.Sleep(cctx, 20*time.Millisecond) {
					errs[i] = fmt.Errorf("not active within 3 min: last %+v", o)
					if err != nil {
						errs[i] = fmt.Errorf("not active within 3 min: %w", err)
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, r := range retries {
		res.retried += r
	}
	for i, e := range errs {
		if e != nil {
			res.failures = append(res.failures, fmt.Sprintf("owner %d (%s): %v", i, res.templates[i%len(members)], e))
			continue
		}
		res.toActive = append(res.toActive, toActive[i])
		res.wall = max(res.wall, toActive[i])
		inst, _, err := s.incus.GetInstance(cctx, ids[i])
		if err != nil {
			return res, fmt.Errorf("owner %d: %w", i, err)
		}
		if want := members[i%len(members)]; inst.Location != want {
			res.failures = append(res.failures, fmt.Sprintf("owner %d: template %s placed on %q", i, res.templates[i%len(members)], inst.Location))
		}
		res.byMember[inst.Location] = append(res.byMember[inst.Location], toActive[i])
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

// closeAll closes every owner at once, polling target/close every 20 ms
// until closed, and returns each close → closed time. Bounded by its own
// two minutes: it runs on the way out, also after Ctrl-C.
func (s *session) closeAll(owners []controller.Owner) ([]time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	took := make([]time.Duration, len(owners))
	errs := make([]error, len(owners))
	var wg sync.WaitGroup
	start := time.Now()
	for i := range owners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var r controller.TargetResult
				err := s.ctrl.Call(ctx, "target/close", controller.TargetParams{Target: controller.TargetRef{Owner: owners[i]}}, &r)
				if err == nil && r.Target.Phase == controller.PhaseClosed {
					took[i] = time.Since(start)
					return
				}
				if errors.Is(err, jsonrpc.ErrClosed) {
					errs[i] = err
					return
				}
				if !clock.Sleep(ctx, 20*time.Millisecond) {
					errs[i] = errors.New("not closed within 2 min")
					if err != nil {
						errs[i] = fmt.Errorf("not closed within 2 min: %w", err)
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	return took, errors.Join(errs...)
}

func (s *session) getOwner(ctx context.Context, o controller.Owner) (controller.Observation, error) {
	var res controller.TargetResult
	err := s.ctrl.Call(ctx, "target/get", controller.TargetParams{Target: controller.TargetRef{Owner: o}}, &res)
	return res.Target, err
}

// freeLoopback is a loopback address nothing listens on just now.
func freeLoopback(ctx context.Context) (string, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer func() { _ = ln.Close() }()
	return ln.Addr().String(), nil
}

// startHAProxy runs HAProxy with the shipped configuration in front of the
// two provider processes (their /readyz answers the health checks) and
// waits until it routes to both.
func startHAProxy(ctx context.Context, config, work, replica1, replica2 string) (string, func(), error) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return "", nil, fmt.Errorf("-lb: haproxy is not installed (apt-get install haproxy): %w", err)
	}
	lbAddr, err := freeLoopback(ctx)
	if err != nil {
		return "", nil, err
	}
	_, p1, _ := net.SplitHostPort(replica1)
	_, p2, _ := net.SplitHostPort(replica2)
	cmd := exec.CommandContext(context.WithoutCancel(ctx), bin, "-db", "-f", config)
	cmd.Env = append(os.Environ(), "LB_LISTEN="+lbAddr, "REPLICA1="+replica1, "REPLICA2="+replica2,
		"REPLICA1_CHECK_PORT="+p1, "REPLICA2_CHECK_PORT="+p2)
	logFile, err := os.Create(filepath.Join(work, "haproxy.log"))
	if err != nil {
		return "", nil, err
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return "", nil, fmt.Errorf("start haproxy: %w", err)
	}
	_ = logFile.Close()
	stop := func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	// Health checks every second, two to rise: both replicas are up after
	// about 2 s.
	if !clock.Sleep(ctx, 3*time.Second) {
		stop()
		return "", nil, ctx.Err()
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", lbAddr)
	if err != nil {
		out, _ := os.ReadFile(filepath.Join(work, "haproxy.log"))
		stop()
		return "", nil, fmt.Errorf("haproxy does not listen on %s: %w\n%s", lbAddr, err, out)
	}
	_ = c.Close()
	logf2, _ := os.ReadFile(filepath.Join(work, "haproxy.log"))
	logf("HAProxy on %s in front of %s and %s", lbAddr, replica1, replica2)
	_ = logf2
	return lbAddr, stop, nil
}
