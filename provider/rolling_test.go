package provider_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// rollingRelays is how many relays stay open through the restarts.
const rollingRelays = 20

// TestClusterRollingRestart restarts both replicas behind HAProxy, one
// after the other, as an upgrade does, while 20 relays are open and a
// steady stream of creates, gets and dials runs through the balancer as a
// runtime would drive it: every relay is told 1001 (going away) and its
// redial succeeds, and no call fails that a runtime's retry (of
// unavailable, and of a connection that broke) does not turn into
// success. Afterwards Incus holds one instance per owner.
func TestClusterRollingRestart(t *testing.T) {
	// The balancer checks /readyz every second and takes a replica out after
	// two failures: the drain delay covers that.
	r := newLBRigWith(t, "PROVIDER_DRAIN_DELAY=2s", "PROVIDER_DRAIN_TIMEOUT=20s")
	templates := []string{"on-lsm1", "on-lsm2", "on-lsm3"}
	owners := make([]controller.Owner, rollingRelays)
	var wg sync.WaitGroup
	errs := make(chan error, rollingRelays)
	for i := range owners {
		owners[i] = controller.Owner{UniverseID: "u-roll", EnvironmentID: fmt.Sprintf("relay-%d", i)}
		wg.Go(func() {
			if _, err := r.call("target/create", controller.CreateParams{Owner: owners[i], TemplateID: templates[i%3]}, 60*time.Second); err != nil {
				errs <- fmt.Errorf("create %v: %w", owners[i], err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	routeList := make([]routes.Route, len(owners))
	for i, o := range owners {
		routeList[i] = r.routeWhenRunning(o)
	}

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	// Each keeper holds one relay open, pinging as a runtime's session
	// does, and redials through the balancer when it is told 1001.
	keepers := make([]*relayKeeper, len(routeList))
	var kw sync.WaitGroup
	for i, rt := range routeList {
		k := &relayKeeper{r: r, route: rt}
		if err := k.dial(ctx); err != nil {
			t.Fatalf("relay %d: %v", i, err)
		}
		keepers[i] = k
		kw.Go(func() { k.keep(ctx) })
	}

	// The steady stream: a create of a new owner now and then, gets and
	// dials of the relayed targets, each retried as a runtime retries.
	var stream sync.WaitGroup
	var calls, streamFailures atomic.Int64
	var failMu sync.Mutex
	var failures []string
	fail := func(format string, a ...any) {
		streamFailures.Add(1)
		failMu.Lock()
		defer failMu.Unlock()
		failures = append(failures, fmt.Sprintf(format, a...))
	}
	stream.Go(func() {
		for n := 0; n < 1000 && ctx.Err() == nil; n++ {
			i := n % len(owners)
			if _, err := r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owners[i]}}, 60*time.Second); err != nil {
				fail("get %v: %v", owners[i], err)
			}
			calls.Add(1)
			if n%5 == 0 {
				o := controller.Owner{UniverseID: "u-roll", EnvironmentID: fmt.Sprintf("stream-%d", n)}
				if _, err := r.call("target/create", controller.CreateParams{Owner: o, TemplateID: templates[n%3]}, 60*time.Second); err != nil {
					fail("create %v: %v", o, err)
				}
				calls.Add(1)
			}
			if n%3 == 0 {
				if err := dialAsTheRuntime(ctx, r, routeList[i]); err != nil && ctx.Err() == nil {
					fail("dial %s: %v", routeList[i].TargetID, err)
				}
				calls.Add(1)
			}
			time.Sleep(100 * time.Millisecond)
		}
	})

	time.Sleep(3 * time.Second)
	for i := range r.replicas {
		began := time.Now()
		r.stop(i, syscall.SIGTERM)
		t.Logf("replica %s drained and exited in %v", r.replicas[i].id, time.Since(began).Round(time.Millisecond))
		r.start(i)
		r.awaitUp(i)
		t.Logf("replica %s serving again %v after its SIGTERM", r.replicas[i].id, time.Since(began).Round(time.Millisecond))
		time.Sleep(3 * time.Second)
	}
	// Every keeper ends on a relay that works.
	deadline := time.Now().Add(90 * time.Second)
	for _, k := range keepers {
		for !k.settled() && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
	}
	stop()
	stream.Wait()
	kw.Wait()

	t.Logf("%d calls and dials in the stream through both restarts; %d failed", calls.Load(), streamFailures.Load())
	for _, f := range failures {
		t.Error(f)
	}
	for i, k := range keepers {
		k.mu.Lock()
		t.Logf("relay %d (%s): %d going-away closes, %d redials, other ends %v", i, k.route.TargetID, k.goingAway, k.redials, k.others)
		switch {
		case k.goingAway == 0:
			t.Errorf("relay %d was never told 1001 although both replicas restarted", i)
		case len(k.others) > 0:
			t.Errorf("relay %d ended otherwise than with 1001: %v", i, k.others)
		case k.redialErr != nil:
			t.Errorf("relay %d's redial failed: %v", i, k.redialErr)
		}
		k.mu.Unlock()
	}

	// One instance per owner, and every owner's target observable.
	lctx, lcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer lcancel()
	list, err := r.client.ListInstances(lctx)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, inst := range list {
		seen[inst.Name]++
	}
	for _, o := range owners {
		if seen[targetsName(o)] != 1 {
			t.Errorf("%v: %d instances", o, seen[targetsName(o)])
		}
	}
}

// relayKeeper holds one relay through the restarts.
type relayKeeper struct {
	r     *lbRig
	route routes.Route

	mu        sync.Mutex
	ws        *websocket.Conn
	up        bool // on a relay that initialized and has not ended
	goingAway int
	redials   int
	others    []string // ends that were not 1001
	redialErr error
}

func (k *relayKeeper) settled() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.up || k.redialErr != nil || len(k.others) > 0
}

// dial opens the relay as a runtime does: through the balancer, waiting
// out a wake's hold, asking again on a retryable refusal, for up to a
// minute.
func (k *relayKeeper) dial(ctx context.Context) error {
	var last error
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline) && ctx.Err() == nil; time.Sleep(200 * time.Millisecond) {
		d, err := conformance.RouteDialer{AsARuntime: true}.Dial(ctx, k.r.routeURL(k.route), credential)
		if err != nil || d.Conn == nil {
			last = fmt.Errorf("dial: %+v, %w", d.Refusal, err)
			continue
		}
		if err := conformance.InitializeData(d.Conn, "rolling-test", 10*time.Second); err != nil {
			_ = d.Conn.Close()
			last = err
			continue
		}
		k.mu.Lock()
		k.ws, k.up = d.Conn, true
		k.mu.Unlock()
		return nil
	}
	if last == nil {
		last = ctx.Err()
	}
	return last
}

// keep reads the relay until ctx ends; a 1001 is counted and redialed,
// any other end recorded.
func (k *relayKeeper) keep(ctx context.Context) {
	ping := time.NewTicker(10 * time.Second)
	defer ping.Stop()
	for ctx.Err() == nil {
		k.mu.Lock()
		ws := k.ws
		k.mu.Unlock()
		ended := make(chan error, 1)
		go func() {
			for {
				_ = ws.SetReadDeadline(time.Now().Add(time.Minute))
				if _, _, err := ws.ReadMessage(); err != nil {
					ended <- err
					return
				}
			}
		}()
		var err error
	wait:
		for {
			select {
			case err = <-ended:
				break wait
			case <-ping.C:
				_ = ws.WriteControl(websocket.PingMessage, nil, time.Now().Add(5*time.Second))
			case <-ctx.Done():
				_ = ws.Close()
				<-ended
				return
			}
		}
		_ = ws.Close()
		k.mu.Lock()
		k.up = false
		if !websocket.IsCloseError(err, websocket.CloseGoingAway) {
			k.others = append(k.others, err.Error())
			k.mu.Unlock()
			return
		}
		k.goingAway++
		k.redials++
		k.mu.Unlock()
		if err := k.dial(ctx); err != nil {
			if !errors.Is(err, context.Canceled) {
				k.mu.Lock()
				k.redialErr = err
				k.mu.Unlock()
			}
			return
		}
	}
}

// dialAsTheRuntime opens and closes a data connection through the
// balancer as a runtime would, for up to a minute.
func dialAsTheRuntime(ctx context.Context, r *lbRig, rt routes.Route) error {
	var last error
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline) && ctx.Err() == nil; time.Sleep(200 * time.Millisecond) {
		d, err := conformance.RouteDialer{AsARuntime: true}.Dial(ctx, r.routeURL(rt), credential)
		if err != nil || d.Conn == nil {
			last = fmt.Errorf("%+v, %w", d.Refusal, err)
			continue
		}
		err = conformance.InitializeData(d.Conn, "rolling-stream", 10*time.Second)
		_ = d.Conn.Close()
		if err == nil {
			return nil
		}
		last = err
	}
	return last
}

// TestClusterReloadWithConnectionsOpen rotates the credential and the TLS
// certificate both replicas read, with SIGHUP, while relays and a
// controller connection are open through the balancer (which passes TLS
// through to the replicas): they stay open and working, a new connection
// is given the new certificate by either replica and needs the new
// credential, and the old credential is refused.
func TestClusterReloadWithConnectionsOpen(t *testing.T) {
	r := newLBRigOpts(t, lbOptions{tls: true})
	owners := []controller.Owner{{UniverseID: "u-hup", EnvironmentID: "a"}, {UniverseID: "u-hup", EnvironmentID: "b"}}
	var rts []routes.Route
	for i, o := range owners {
		rts = append(rts, r.runningRoute(o, []string{"on-lsm1", "on-lsm2"}[i]))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// served is the certificate a new handshake with addr is given.
	served := func(addr string) []byte {
		t.Helper()
		d := tls.Dialer{Config: rigTLS, NetDialer: &net.Dialer{Timeout: 10 * time.Second}}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			t.Fatalf("TLS dial %s: %v", addr, err)
		}
		defer conn.Close()
		return conn.(*tls.Conn).ConnectionState().PeerCertificates[0].Raw
	}
	installed := func() []byte {
		t.Helper()
		cert, err := tls.LoadX509KeyPair(filepath.Join(r.dir, "tls.crt"), filepath.Join(r.dir, "tls.key"))
		if err != nil {
			t.Fatal(err)
		}
		return cert.Certificate[0]
	}
	first := installed()
	for _, addr := range []string{r.replicas[0].addr, r.replicas[1].addr, r.lb} {
		if !bytes.Equal(served(addr), first) {
			t.Fatalf("%s does not serve the rig's certificate", addr)
		}
	}
	var relays []*websocket.Conn
	for _, rt := range rts {
		d, err := conformance.RouteDialer{AsARuntime: true, TLSConfig: rigTLS}.Dial(ctx, r.routeURL(rt), credential)
		if err != nil || d.Conn == nil {
			t.Fatalf("relay %s: %+v, %v", rt.TargetID, d.Refusal, err)
		}
		defer d.Conn.Close()
		initialize(t, d.Conn)
		relays = append(relays, d.Conn)
	}
	ctl, err := r.connectWith(ctx, credential)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()

	const rotated = "the-rotated-credential-of-the-replicas-0123"
	if err := os.WriteFile(filepath.Join(r.dir, "credential"), []byte(rotated+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r.writeCert("tls")
	second := installed()
	for i, rep := range r.replicas {
		if err := rep.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		r.awaitLog(i, "SIGHUP: credential reloaded")
		r.awaitLog(i, "SIGHUP: TLS certificate reloaded")
	}
	// Each replica, and the balancer whichever it picks, give the new one.
	for _, addr := range []string{r.replicas[0].addr, r.replicas[1].addr, r.lb, r.lb} {
		if !bytes.Equal(served(addr), second) {
			t.Errorf("%s serves another certificate than the one reloaded", addr)
		}
	}

	// What was open stays open and answers.
	for i, ws := range relays {
		// A second initialize is refused, but answered: through the relay,
		// by the guest's daemon.
		if err := conformance.InitializeData(ws, "hup-test", 10*time.Second); err == nil || !strings.Contains(err.Error(), "already") {
			t.Errorf("relay %d after the reload: %v, want the daemon's refusal of a second initialize", i, err)
		}
	}
	if _, err := callOn(ctl, "target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owners[0]}}); err != nil {
		t.Errorf("the controller connection opened before the reload: %v", err)
	}
	// New connections, through either replica: the new credential only.
	for range 4 {
		c, err := r.connectWith(ctx, rotated)
		if err != nil {
			t.Fatalf("a connection with the rotated credential: %v", err)
		}
		_ = c.Close()
		if c, err := r.connectWith(ctx, credential); err == nil {
			_ = c.Close()
			t.Fatal("the old credential still opens a connection")
		}
	}
	if d, err := (conformance.RouteDialer{TLSConfig: rigTLS}).Dial(ctx, r.routeURL(rts[0]), credential); err == nil && d.Conn != nil {
		_ = d.Conn.Close()
		t.Fatal("the old credential still opens a data route")
	} else if d.Status != http.StatusUnauthorized {
		t.Fatalf("a data route with the old credential: HTTP %d, %v; want 401", d.Status, err)
	}
}

// TestClusterPeerSecretsRotate rotates the replicas' forwarding secret with
// SIGHUP, one replica at a time at each step (the new secret accepted
// beside the old, then proving, then alone): every dial of a guest on the
// other replica's member is forwarded throughout, none falls back to exec.
func TestClusterPeerSecretsRotate(t *testing.T) {
	r := newLBRig(t)
	type leg struct {
		via    int // the replica dialled
		member string
		route  routes.Route
	}
	var legs []leg
	for i, m := range []string{"lsm2", "lsm1"} {
		o := controller.Owner{UniverseID: "u-peer", EnvironmentID: m}
		// Replica i runs on the other member: its dials of this guest are
		// forwarded to the replica on m.
		legs = append(legs, leg{via: i, member: m, route: r.runningRoute(o, "on-"+m)})
	}
	forwarded := func(l leg, outcome string) float64 {
		return r.scrape(l.via, "incus_provider_peer_dials_total", map[string]string{"member": l.member, "outcome": outcome})
	}
	check := func(step string) {
		t.Helper()
		for _, l := range legs {
			ok0, fb0 := forwarded(l, "forwarded"), forwarded(l, "fallback")
			if err := r.dialVia(l.via, l.route); err != nil {
				t.Fatalf("%s: dial of the guest on %s through %s: %v", step, l.member, r.replicas[l.via].id, err)
			}
			// The relay's dial and the readiness probe's, when the
			// replica has not seen the daemon answer yet: one or two.
			if ok, fb := forwarded(l, "forwarded"), forwarded(l, "fallback"); ok <= ok0 || fb != fb0 {
				t.Fatalf("%s: through %s to %s, forwarded %v -> %v, fallback %v -> %v", step, r.replicas[l.via].id, l.member, ok0, ok, fb0, fb)
			}
		}
	}
	check("before")
	file := filepath.Join(r.dir, "peer.secret")
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	oldS, newS := strings.TrimSpace(string(raw)), peerSecret(t)
	hups := 0
	for _, content := range []string{oldS + "\n" + newS, newS + "\n" + oldS, newS} {
		if err := os.WriteFile(file, []byte(content+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		hups++
		for i, rep := range r.replicas {
			if err := rep.cmd.Process.Signal(syscall.SIGHUP); err != nil {
				t.Fatal(err)
			}
			r.awaitLogged(i, "SIGHUP: peer secrets reloaded", hups)
			check(fmt.Sprintf("file %d of 3, after %s's reload", hups, rep.id))
		}
	}
}

// runningRoute creates the owner's target from template through the
// balancer and answers its data route once it is active and running.
func (r *lbRig) runningRoute(o controller.Owner, template string) routes.Route {
	r.t.Helper()
	if _, err := r.call("target/create", controller.CreateParams{Owner: o, TemplateID: template}, 60*time.Second); err != nil {
		r.t.Fatal(err)
	}
	return r.routeWhenRunning(o)
}

// routeWhenRunning waits until the owner's target is active and running
// and answers its data route.
func (r *lbRig) routeWhenRunning(o controller.Owner) routes.Route {
	r.t.Helper()
	r.until(o, "active", 120*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
	})
	got, err := r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: o}}, 30*time.Second)
	if err != nil {
		r.t.Fatal(err)
	}
	return routeOf(o, got.TargetID)
}
