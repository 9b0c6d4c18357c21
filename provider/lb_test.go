package provider_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/loopback"
	"github.com/lightspeed-dev/incus-provider/routes"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// lbRig is two provider binaries on the cluster rig, as replicas on
// members lsm1 and lsm2, behind HAProxy with the shipped configuration.
type lbRig struct {
	t        *testing.T
	bin, dir string
	client   *incus.Client
	cl       *incustest.ClusterRig
	lb       string
	replicas [2]*lbReplica
	haproxy  *exec.Cmd
	env      []string // added to every replica's settings
	// edge is the balancer's edge listener ("" without one).
	edge string
	// scheme is the replicas' and so the balancer's: ws, or wss when they
	// serve TLS.
	scheme string
	// edgeScheme is the edge's: http, or https when the replicas' edges
	// serve TLS.
	edgeScheme string
}

type lbReplica struct {
	// peer is where the replica serves its member's guests to the other
	// (PROVIDER_PEER_LISTEN); edge its ingress edge ("" without one).
	id, member, addr, metrics, peer, edge string
	cmd                                   *exec.Cmd
}

func newLBRig(t *testing.T) *lbRig { return newLBRigWith(t) }

// newLBRigWith is newLBRig with settings of the test's added to every
// replica's.
func newLBRigWith(t *testing.T, env ...string) *lbRig {
	t.Helper()
	return newLBRigOpts(t, lbOptions{env: env})
}

// lbOptions are what a test changes of the rig.
type lbOptions struct {
	// env is added to every replica's settings.
	env []string
	// templates (YAML list items) are added to the replicas' file.
	templates string
	// tls: the replicas serve TLS (the rig's own certificate, in dir's
	// tls.crt and tls.key) and HAProxy passes it through
	// (deploy/haproxy/incus-provider-tls.cfg).
	tls bool
	// edge: every replica serves the public ingress edge under the one
	// base URL HAProxy answers (deploy/haproxy/incus-provider-edge.cfg).
	edge bool
	// edgeTLS: the edge as with edge, served over TLS by the replicas (the
	// rig's own certificate, in dir's edge.crt and edge.key) and passed
	// through by HAProxy (deploy/haproxy/incus-provider-edge-tls.cfg).
	edgeTLS bool
}

func newLBRigOpts(t *testing.T, o lbOptions) *lbRig {
	t.Helper()
	cl := incustest.Cluster(t)
	haproxy, err := exec.LookPath("haproxy")
	if err != nil {
		if os.Getenv(incustest.EnvRequireCluster) == "1" {
			t.Fatalf("haproxy is not installed (make test installs it): %v", err)
		}
		t.Skipf("haproxy is not installed: %v", err)
	}
	r := &lbRig{t: t, bin: buildProvider(t), dir: t.TempDir(), client: cl.Client(t), cl: cl, lb: loopback.FreeAddr(t), env: o.env, scheme: "ws"}
	o.edge = o.edge || o.edgeTLS
	if o.edgeTLS {
		r.edgeScheme = "https"
		r.writeCert("edge")
		r.env = append(r.env, "PROVIDER_INGRESS_TLS_CERT="+filepath.Join(r.dir, "edge.crt"), "PROVIDER_INGRESS_TLS_KEY="+filepath.Join(r.dir, "edge.key"))
	}
	lbConfig := "../deploy/haproxy/incus-provider.cfg"
	if o.tls {
		r.scheme, lbConfig = "wss", "../deploy/haproxy/incus-provider-tls.cfg"
		r.writeCert("tls")
		r.env = append(r.env, "PROVIDER_TLS_CERT="+filepath.Join(r.dir, "tls.crt"), "PROVIDER_TLS_KEY="+filepath.Join(r.dir, "tls.key"))
	}
	if err := os.WriteFile(filepath.Join(r.dir, "credential"), []byte(credential), 0o600); err != nil {
		t.Fatal(err)
	}
	tmpl := strings.ReplaceAll(clusterTemplates+o.templates, "{{image}}", incustest.DefaultImage)
	if err := os.WriteFile(filepath.Join(r.dir, "templates.yaml"), []byte(tmpl), 0o600); err != nil {
		t.Fatal(err)
	}
	// The replicas' shared forwarding secret, as an operator would make it.
	if err := os.WriteFile(filepath.Join(r.dir, "peer.secret"), []byte(peerSecret(t)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A failure here has shown up only in CI, where the logs go with the
	// test's directory: the end of each is printed with the failure.
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, name := range []string{"lbr1.log", "lbr2.log", "haproxy.log"} {
			out, err := os.ReadFile(filepath.Join(r.dir, name))
			if err != nil {
				t.Logf("%s: %v", name, err)
				continue
			}
			lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
			t.Logf("the last %d lines of %s:\n%s", min(len(lines), 60), name, strings.Join(lines[max(0, len(lines)-60):], "\n"))
		}
	})
	for i, m := range []string{"lsm1", "lsm2"} {
		r.replicas[i] = &lbReplica{id: fmt.Sprintf("lbr%d", i+1), member: m, addr: loopback.FreeAddr(t), metrics: loopback.FreeAddr(t), peer: loopback.FreeAddr(t)}
		if o.edge {
			r.replicas[i].edge = loopback.FreeAddr(t)
		}
	}
	lbArgs := []string{"-db", "-f", lbConfig}
	var edgeEnv []string
	if o.edge {
		r.edge = loopback.FreeAddr(t)
		edgeConfig := "../deploy/haproxy/incus-provider-edge.cfg"
		if o.edgeTLS {
			edgeConfig = "../deploy/haproxy/incus-provider-edge-tls.cfg"
		}
		lbArgs = append(lbArgs, "-f", edgeConfig)
		edgeEnv = []string{"EDGE_LISTEN=" + r.edge, "REPLICA1_EDGE=" + r.replicas[0].edge, "REPLICA2_EDGE=" + r.replicas[1].edge}
	}
	for i := range r.replicas {
		r.start(i)
	}
	_, p1, _ := net.SplitHostPort(r.replicas[0].metrics)
	_, p2, _ := net.SplitHostPort(r.replicas[1].metrics)
	cmd := exec.Command(haproxy, lbArgs...)
	cmd.Env = append(os.Environ(), "LB_LISTEN="+r.lb, "REPLICA1="+r.replicas[0].addr, "REPLICA2="+r.replicas[1].addr,
		"REPLICA1_CHECK_PORT="+p1, "REPLICA2_CHECK_PORT="+p2)
	cmd.Env = append(cmd.Env, edgeEnv...)
	logf, err := os.Create(filepath.Join(r.dir, "haproxy.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	_ = logf.Close()
	r.haproxy = cmd
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		for i := range r.replicas {
			r.stop(i, syscall.SIGTERM)
		}
	})
	r.awaitUp(0)
	r.awaitUp(1)
	return r
}

func (r *lbRig) start(i int) {
	r.t.Helper()
	rep := r.replicas[i]
	logf, err := os.OpenFile(filepath.Join(r.dir, rep.id+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		r.t.Fatal(err)
	}
	cmd := exec.Command(r.bin)
	cmd.Env = r.replicaEnv(i)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	_ = logf.Close()
	rep.cmd = cmd
}

// replicaEnv is replica i's environment: its settings, as a unit's
// environment file would give them, and nothing else of the test's.
func (r *lbRig) replicaEnv(i int) []string {
	rep := r.replicas[i]
	ingress := []string{"PROVIDER_INGRESS_LISTEN=off"}
	if rep.edge != "" {
		_, port, _ := net.SplitHostPort(r.edge)
		scheme := r.edgeScheme
		if scheme == "" {
			scheme = "http"
		}
		ingress = []string{"PROVIDER_INGRESS_LISTEN=" + rep.edge, "PROVIDER_INGRESS_BASE_URL=" + scheme + "://{label}.localhost:" + port}
	}
	env := append(childEnv(), ingress...)
	env = append(env,
		"PROVIDER_LISTEN="+rep.addr, "PROVIDER_METRICS_LISTEN="+rep.metrics, "PROVIDER_REPLICA_ID="+rep.id,
		"PROVIDER_TEMPLATES="+filepath.Join(r.dir, "templates.yaml"), "PROVIDER_CREDENTIAL_FILE="+filepath.Join(r.dir, "credential"),
		"INCUS_URL="+strings.Join(r.cl.URLs, ","), "INCUS_CLIENT_CERT="+r.cl.Config.ClientCert,
		"INCUS_CLIENT_KEY="+r.cl.Config.ClientKey, "INCUS_SERVER_CERT="+r.cl.Config.ServerCert,
		"INCUS_PROJECT="+r.client.Project(), "PROVIDER_INCUS_MEMBER="+rep.member,
		"PROVIDER_GRACEFUL_STOP=2s", "PROVIDER_RECONCILE_INTERVAL=1s",
		// One peer list for both, as one environment file would give it.
		"PROVIDER_PEER_LISTEN="+rep.peer, "PROVIDER_PEER_SECRET_FILE="+filepath.Join(r.dir, "peer.secret"),
		"PROVIDER_PEERS="+r.replicas[0].member+"="+r.replicas[0].peer+","+r.replicas[1].member+"="+r.replicas[1].peer)
	return append(env, r.env...)
}

func (r *lbRig) stop(i int, sig syscall.Signal) {
	rep := r.replicas[i]
	if rep.cmd == nil {
		return
	}
	_ = rep.cmd.Process.Signal(sig)
	_ = rep.cmd.Wait()
	rep.cmd = nil
}

// awaitLog waits until the replica's log says what.
func (r *lbRig) awaitLog(i int, what string) { r.awaitLogged(i, what, 1) }

// awaitLogged waits until the replica's log says what n times.
func (r *lbRig) awaitLogged(i int, what string, n int) {
	r.t.Helper()
	path := filepath.Join(r.dir, r.replicas[i].id+".log")
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if out, err := os.ReadFile(path); err == nil && strings.Count(string(out), what) >= n {
			return
		}
	}
	r.t.Fatalf("replica %s did not log %q %d times", r.replicas[i].id, what, n)
}

// awaitUp waits until the replica's /readyz answers 200.
func (r *lbRig) awaitUp(i int) {
	r.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + r.replicas[i].metrics + "/readyz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(filepath.Join(r.dir, r.replicas[i].id+".log"))
			r.t.Fatalf("replica %s not ready in 30 s: %v\n%s", r.replicas[i].id, err, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// awaitFollowing waits, bounded, until replica i's observation cache is
// confirmed: it follows Incus's events, which is how it learns another
// replica's writes. A replica serves before that (reads then ask Incus),
// so a test of what reaches it by events waits for it first.
func (r *lbRig) awaitFollowing(i int) {
	r.t.Helper()
	began := time.Now()
	for r.scrape(i, "incus_provider_cache_confirmed", nil) != 1 {
		if time.Since(began) > 30*time.Second {
			r.t.Fatalf("replica %s's observation cache not confirmed 30 s after it was ready:\n%s", r.replicas[i].id, r.readyz(i))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(began); took > time.Second {
		r.t.Logf("replica %s's observation cache confirmed %s after it was ready", r.replicas[i].id, took.Round(time.Millisecond))
	}
}

// connectWith opens a controller connection through the load balancer,
// presenting secret as the credential.
func (r *lbRig) connectWith(ctx context.Context, secret string) (*jsonrpc.Client, error) {
	return r.connectTo(ctx, r.lb, secret)
}

// connectTo opens a controller connection to addr: the balancer, or one
// replica.
func (r *lbRig) connectTo(ctx context.Context, addr, secret string) (*jsonrpc.Client, error) {
	d := websocket.Dialer{HandshakeTimeout: 5 * time.Second, TLSClientConfig: rigTLS}
	ws, resp, err := d.DialContext(ctx, r.scheme+"://"+addr+"/control", http.Header{"Authorization": {"Bearer " + secret}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		return nil, err
	}
	c := jsonrpc.NewClient(ws)
	if err := c.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: 4,
		ClientInfo: controller.BuildInfo{Name: "lb-test"}}, nil); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

// call runs one method on a fresh connection through the balancer, retrying
// what a client retries (unavailable, a connection that broke) for up to
// most.
func (r *lbRig) call(method string, params any, most time.Duration) (controller.Observation, error) {
	return r.callAt(r.lb, method, params, most)
}

// callAt is call on a connection to addr: the balancer, or one replica.
func (r *lbRig) callAt(addr, method string, params any, most time.Duration) (controller.Observation, error) {
	deadline := time.Now().Add(most)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := r.connectTo(ctx, addr, credential)
		var o controller.Observation
		if err == nil {
			o, err = callOn(c, method, params)
			_ = c.Close()
		}
		cancel()
		// Retried: unavailable, and a connection that broke (no answer).
		retryable := isUnavailable(err) || !isRPCError(err)
		if err == nil || !retryable || time.Now().After(deadline) {
			return o, err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func isRPCError(err error) bool {
	var e *jsonrpc.Error
	return errors.As(err, &e)
}

func (r *lbRig) until(owner controller.Owner, what string, most time.Duration, cond func(controller.Observation) bool) {
	r.t.Helper()
	deadline := time.Now().Add(most)
	for {
		o, err := r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}}, 5*time.Second)
		if err == nil && cond(o) {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("target never %s within %s through the balancer: %+v, %v", what, most, o, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (r *lbRig) routeURL(route routes.Route) string {
	return r.scheme + "://" + r.lb + routes.Path("/routes", route)
}

// relayHolder says which replica's lease is on the instance (-1: none).
func (r *lbRig) relayHolder(name string) int {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	inst, _, err := r.client.GetInstance(ctx, name)
	if err != nil {
		r.t.Fatal(err)
	}
	for i, rep := range r.replicas {
		if inst.Config["user.lightspeed.relays."+rep.id] != "" {
			return i
		}
	}
	return -1
}

// TestClusterReplicasBehindHAProxy drives two provider binaries behind
// HAProxy from outside: concurrent creates for each owner over separate
// connections (one instance each); a relay whose replica is SIGKILLed (the
// client's redial through the balancer succeeds, through the other); a
// wake whose replica is SIGKILLed at once (the redial succeeds and the
// target ends running, finished by the replica left).
func TestClusterReplicasBehindHAProxy(t *testing.T) {
	r := newLBRig(t)
	const owners = 6
	var wg sync.WaitGroup
	errs := make(chan error, owners*2)
	for i := range owners {
		owner := controller.Owner{UniverseID: "u-lb", EnvironmentID: fmt.Sprintf("env-%d", i)}
		tmpl := []string{"on-lsm1", "on-lsm2", "on-lsm3"}[i%3]
		for range 2 {
			wg.Go(func() {
				if _, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: tmpl}, 30*time.Second); err != nil {
					errs <- err
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("create through the balancer: %v", err)
	}
	for i := range owners {
		owner := controller.Owner{UniverseID: "u-lb", EnvironmentID: fmt.Sprintf("env-%d", i)}
		r.until(owner, "active", 90*time.Second, func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
		})
	}
	if list := r.instances(); len(list) != owners {
		t.Fatalf("%d instances for %d owners", len(list), owners)
	}

	// A replica killed mid-relay.
	owner := controller.Owner{UniverseID: "u-lb", EnvironmentID: "env-1"}
	o, err := r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}}, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	route := routeOf(owner, o.TargetID)
	d, err := conformance.DialRoute(context.Background(), r.routeURL(route), credential)
	if err != nil || d.Conn == nil {
		t.Fatalf("dial through the balancer: %+v, %v", d.Refusal, err)
	}
	initialize(t, d.Conn)
	holder := -1
	for deadline := time.Now().Add(5 * time.Second); holder < 0 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		holder = r.relayHolder(route.TargetID)
	}
	if holder < 0 {
		t.Fatal("no replica's relay lease on the instance 5 s after the relay opened")
	}
	r.stop(holder, syscall.SIGKILL)
	_ = d.Conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := d.Conn.ReadMessage(); err == nil {
		t.Fatal("the relay of a killed replica still delivered a message")
	}
	_ = d.Conn.Close()
	start := time.Now()
	redialed := false
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		d, err := conformance.DialRoute(context.Background(), r.routeURL(route), credential)
		if err == nil && d.Conn != nil {
			initialize(t, d.Conn)
			_ = d.Conn.Close()
			redialed = true
			break
		}
	}
	if !redialed {
		t.Fatal("no redial through the balancer succeeded within 15 s of the relaying replica's death")
	}
	t.Logf("replica %s killed mid-relay: a redial through the balancer relayed again after %s", r.replicas[holder].id, time.Since(start))
	r.start(holder)
	r.awaitUp(holder)

	// A replica killed mid-wake: the dial's request for running is on the
	// instance, and the replica left carries it out.
	if _, err := r.call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: owner}, Power: controller.PowerPaused}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	r.until(owner, "paused", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
	})
	// The waking dial goes to replica 0 itself, so that the replica killed
	// is the one waking the target.
	victim := 0
	dialed := make(chan struct{})
	go func() {
		defer close(dialed)
		d, err := conformance.DialRoute(context.Background(), "ws://"+r.replicas[victim].addr+routes.Path("/routes", route), credential)
		if err == nil && d.Conn != nil {
			_ = d.Conn.Close()
		}
	}()
	// Killed the moment its dial's request for running is on the instance,
	// before (most likely) it carried it out.
	var inst *incus.Instance
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		kctx, kcancel := context.WithTimeout(context.Background(), 5*time.Second)
		inst, _, err = r.client.GetInstance(kctx, route.TargetID)
		kcancel()
		if err != nil {
			t.Fatal(err)
		}
		if inst.Config["user.lightspeed.power"] == "running" && inst.Config["user.lightspeed.power_by"] == "use" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the waking dial's request for running never reached the instance: %v", inst.Config)
		}
	}
	r.stop(victim, syscall.SIGKILL)
	<-dialed
	t.Logf("replica %s killed mid-wake, with the instance %s and running requested by use", r.replicas[victim].id, inst.Status)
	// Without any new dial: the replica left carries the request out.
	start = time.Now()
	r.until(owner, "running again", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning
	})
	t.Logf("the replica left carried the dead one's wake out %s after its death", time.Since(start))
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		d, err := conformance.DialRoute(context.Background(), r.routeURL(route), credential)
		if err == nil && d.Conn != nil {
			initialize(t, d.Conn)
			_ = d.Conn.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no dial through the balancer relayed within 20 s of a replica's death mid-wake: %+v, %v", d.Refusal, err)
		}
	}
	r.start(victim)
	r.awaitUp(victim)
}

// TestClusterIdleActionOnceAcrossReplicas: an idle target served by two
// replica binaries is paused once (one Incus pause, whichever replica
// decides), and when the replica whose idle request is on the instance is
// SIGKILLed right then, the other carries it out.
func TestClusterIdleActionOnceAcrossReplicas(t *testing.T) {
	r := newLBRig(t)
	owner := controller.Owner{UniverseID: "u-lb", EnvironmentID: "env-idle"}
	events := watchLifecycle(t, r.client, targetsName(owner))
	if _, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: "idle-lsm3"}, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	// The moment an idle request is on the instance, kill its replica.
	var by string
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		inst, _, err := r.client.GetInstance(ctx, targetsName(owner))
		cancel()
		if err == nil && inst.Config["user.lightspeed.power_by"] == "idle" {
			by = string(inst.Status)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no idle request within 60 s: %v", err)
		}
	}
	// Which replica asked is not recorded; kill one, at random by seed.
	victim := int(testSeed(t) % 2)
	r.stop(victim, syscall.SIGKILL)
	r.until(owner, "paused by idle", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
	})
	time.Sleep(3 * time.Second) // long enough for a second pause, were there one
	// The pause was observed, so its event is on its way: awaited.
	ev := events(30*time.Second, func(by map[string]int) bool { return by["instance-paused"] > 0 })
	t.Logf("idle request on the instance (then %s); replica %s SIGKILLed; Incus events %v", by, r.replicas[victim].id, ev)
	if ev["instance-paused"] != 1 {
		t.Fatalf("the idle pause happened %d times in Incus, want once", ev["instance-paused"])
	}
	r.start(victim)
	r.awaitUp(victim)
}

func targetsName(o controller.Owner) string { return targets.Name(o) }

// rigTLS is how the tests reach replicas that serve TLS: the rig's own
// self-signed certificates, on loopback, with nothing to verify them by.
var rigTLS = &tls.Config{InsecureSkipVerify: true} //nolint:gosec

// writeCert writes a new self-signed certificate for loopback, and its
// key, to dir's name.crt and name.key (over what was there).
func (r *lbRig) writeCert(name string) {
	r.t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		r.t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		r.t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "lb-rig"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		r.t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		r.t.Fatal(err)
	}
	// The key first: a replica reloading between the two writes is
	// refused the mismatched pair and keeps the one in force.
	for _, f := range []struct {
		ext, kind string
		der       []byte
	}{{"key", "EC PRIVATE KEY", kder}, {"crt", "CERTIFICATE", der}} {
		path := filepath.Join(r.dir, name+"."+f.ext)
		if err := os.WriteFile(path+".new", pem.EncodeToMemory(&pem.Block{Type: f.kind, Bytes: f.der}), 0o600); err != nil {
			r.t.Fatal(err)
		}
		if err := os.Rename(path+".new", path); err != nil {
			r.t.Fatal(err)
		}
	}
}

func peerSecret(t *testing.T) string {
	t.Helper()
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// scrape reads one sample from a replica's /metrics: the series called
// name whose labels include every pair of want (-1 when there is none).
func (r *lbRig) scrape(i int, name string, want map[string]string) float64 {
	r.t.Helper()
	resp, err := http.Get("http://" + r.replicas[i].metrics + "/metrics")
	if err != nil {
		r.t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		r.t.Fatal(err)
	}
lines:
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		for k, v := range want {
			if !strings.Contains(line, k+"=\""+v+"\"") {
				continue lines
			}
		}
		f, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			r.t.Fatalf("metrics line %q: %v", line, err)
		}
		return f
	}
	return -1
}

// instances lists the rig's project in Incus, bounded: what the tests
// check their invariants against.
func (r *lbRig) instances() []incus.Instance {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := r.client.ListInstances(ctx)
	if err != nil {
		r.t.Fatalf("listing the rig's instances: %v", err)
	}
	return list
}

// readyz is a replica's /readyz body.
func (r *lbRig) readyz(i int) string {
	r.t.Helper()
	resp, err := http.Get("http://" + r.replicas[i].metrics + "/readyz")
	if err != nil {
		r.t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}

// dialVia opens a data route through replica i itself (not the balancer)
// and checks the daemon answers on it.
func (r *lbRig) dialVia(i int, route routes.Route) error {
	d, err := conformance.DialRoute(context.Background(), "ws://"+r.replicas[i].addr+routes.Path("/routes", route), credential)
	if err != nil {
		return err
	}
	if d.Conn == nil {
		return fmt.Errorf("refused: %+v", d.Refusal)
	}
	defer func() { _ = d.Conn.Close() }()
	initialize(r.t, d.Conn)
	return nil
}

// TestClusterForwardedDials: a replica reaches a guest on another member
// through the replica of that member (PROVIDER_PEERS), for a running
// target and for a wake from paused; when that replica dies, its relays
// end and a redial reaches the guest through exec; when it is back, dials
// go through it again. A member without a replica is reached through exec.
func TestClusterForwardedDials(t *testing.T) {
	r := newLBRig(t)
	onLsm2 := controller.Owner{UniverseID: "u-fwd", EnvironmentID: "on-lsm2"}
	onLsm3 := controller.Owner{UniverseID: "u-fwd", EnvironmentID: "on-lsm3"}
	for owner, tmpl := range map[controller.Owner]string{onLsm2: "on-lsm2", onLsm3: "on-lsm3"} {
		if _, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: tmpl}, 30*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	routeOfOwner := func(owner controller.Owner) routes.Route {
		r.until(owner, "active", 90*time.Second, func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
		})
		o, err := r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}}, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return routeOf(owner, o.TargetID)
	}
	route2, route3 := routeOfOwner(onLsm2), routeOfOwner(onLsm3)
	fwd := map[string]string{"member": "lsm2", "outcome": "forwarded"}
	before := r.scrape(0, "incus_provider_peer_dials_total", fwd)
	if before < 0 {
		t.Fatal("replica 1 exports no forwarded-dial series for lsm2 before its first dial")
	}
	if err := r.dialVia(0, route2); err != nil {
		t.Fatalf("a dial through replica 1 (lsm1) of a guest on lsm2: %v", err)
	}
	if got := r.scrape(0, "incus_provider_peer_dials_total", fwd); got <= before {
		t.Fatalf("the dial of a guest on lsm2 was not forwarded to lsm2's replica (%v then %v):\n%s", before, got, r.readyz(0))
	}
	if got := r.scrape(1, "incus_provider_peer_served_total", map[string]string{"outcome": "forwarded"}); got < 1 {
		t.Fatalf("lsm2's replica served %v forwarded dials", got)
	}
	if err := r.dialVia(0, route3); err != nil {
		t.Fatalf("a dial through replica 1 of a guest on lsm3 (no replica there): %v", err)
	}
	if got := r.scrape(0, "incus_provider_peer_dials_total", map[string]string{"member": "lsm3", "outcome": "no_peer"}); got < 1 {
		t.Fatalf("the dial of a guest on lsm3 was not counted as no_peer: %v", got)
	}

	// A wake from paused through replica 1, forwarded.
	if _, err := r.call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: onLsm2}, Power: controller.PowerPaused}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	r.until(onLsm2, "paused", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
	})
	before = r.scrape(0, "incus_provider_peer_dials_total", fwd)
	start := time.Now()
	if err := r.dialVia(0, route2); err != nil {
		t.Fatalf("a waking dial through replica 1 of a paused guest on lsm2: %v", err)
	}
	t.Logf("paused guest on lsm2 woken and relayed through replica 1 in %s", time.Since(start))
	if got := r.scrape(0, "incus_provider_peer_dials_total", fwd); got <= before {
		t.Fatalf("the waking dial was not forwarded (%v then %v)", before, got)
	}

	// lsm2's replica dies under a relay it carries.
	d, err := conformance.DialRoute(context.Background(), "ws://"+r.replicas[0].addr+routes.Path("/routes", route2), credential)
	if err != nil || d.Conn == nil {
		t.Fatalf("dial: %+v, %v", d.Refusal, err)
	}
	initialize(t, d.Conn)
	r.stop(1, syscall.SIGKILL)
	_ = d.Conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	if _, _, err := d.Conn.ReadMessage(); err == nil {
		t.Fatal("a relay through a killed peer replica still delivered a message")
	}
	_ = d.Conn.Close()
	fb := map[string]string{"member": "lsm2", "outcome": "fallback"}
	before = r.scrape(0, "incus_provider_peer_dials_total", fb)
	if err := r.dialVia(0, route2); err != nil {
		t.Fatalf("a redial with lsm2's replica dead: %v", err)
	}
	if got := r.scrape(0, "incus_provider_peer_dials_total", fb); got <= before {
		t.Fatalf("the redial did not fall back to exec (%v then %v)", before, got)
	}
	if body := r.readyz(0); !strings.Contains(body, "peer lsm2 at "+r.replicas[1].peer+": unreachable") {
		t.Fatalf("/readyz does not say lsm2's replica is unreachable:\n%s", body)
	}

	// Back: dials are forwarded again once the peer is tried again.
	r.start(1)
	r.awaitUp(1)
	before = r.scrape(0, "incus_provider_peer_dials_total", fwd)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		if err := r.dialVia(0, route2); err != nil {
			t.Fatal(err)
		}
		if r.scrape(0, "incus_provider_peer_dials_total", fwd) > before {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dials not forwarded again within 20 s of lsm2's replica coming back:\n%s", r.readyz(0))
		}
	}
}
