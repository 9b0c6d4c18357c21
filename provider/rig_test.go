package provider_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/testrig"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/routes"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// These tests run the provider as it ships (provider.New, served over
// HTTP on loopback) against the real Incus on this machine, with the
// development guest image, in a throwaway project, and drive it from
// outside as the runtime does: the controller plane over a WebSocket, the
// data routes with the bearer credential. They skip without Incus (fail
// with INCUS_PROVIDER_REQUIRE_INCUS=1).

const credential = "provider-test-credential"

const testTemplates = `templates:
  - templateId: t1
    displayName: test guest
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
  - templateId: idle-pause
    displayName: test guest paused after 1.5 s idle
    powerStates: [running, paused, stopped]
    idle: {pauseAfterMs: 1500}
    imageAlias: {{image}}
  - templateId: wrongport
    displayName: a guest whose daemon is not where the template says
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    daemonPort: 19999
  - templateId: web
    displayName: test guest with its web app on public ingress
    powerStates: [running, paused, stopped]
    publicIngress: true
    ingressPort: 8080
    imageAlias: {{image}}
`

type rig struct {
	t *testing.T
	// client reads Incus for the checks; the provider may be given another
	// way to Incus (one that injects faults).
	client  *incus.Client
	catalog *templates.Catalog
	p       *provider.Provider
	srv     *httptest.Server
	metrics *prometheus.Registry
	ctl     *jsonrpc.Client
	stop    func()
	replica string
	dialer  guest.Dialer
	// edge is the public ingress edge's listener; base its public base
	// (http://{label}.localhost:<its port>).
	edge net.Listener
	base ingressurl.Base
}

type rigOptions struct {
	// providerIncus, when set, is the provider's own client (the same
	// project as the checks').
	providerIncus func(project string) *incus.Client
	// after, when set, is an earlier provider's rig: the new provider
	// serves the same Incus project, as a restarted process would.
	after *rig
	// cluster, when set, puts the provider on the cluster rig, as a
	// provider running on its first member would be: HTTPS to the
	// cluster, clusterTemplates, netns for that member's guests and exec
	// for the others'.
	cluster *incustest.ClusterRig
	// member is the cluster member the provider runs on (default the
	// first); with after, a second replica on another member.
	member string
	// templates and image replace testTemplates and the dev guest image
	// on a single host (the production-shaped image's test).
	templates, image string
	// dialer, when set, is the guest dialer's kind on a single host,
	// whatever INCUS_PROVIDER_TEST_DIALER says.
	dialer string
	// cacheCorrection, when set, is the observation cache's correcting
	// list period: a long one shows that what a test observes does not
	// wait for it.
	cacheCorrection time.Duration
}

func (o rigOptions) memberOr(def string) string {
	if o.member != "" {
		return o.member
	}
	return def
}

func newRig(t *testing.T, o rigOptions) *rig {
	t.Helper()
	var client *incus.Client
	var catalog *templates.Catalog
	var dialer guest.Dialer
	switch {
	case o.after != nil:
		client, catalog = o.after.client, o.after.catalog
		if o.cluster != nil {
			dialer = newMemberDialer(t, o.memberOr(o.cluster.Members[0]), client)
		}
	case o.cluster != nil:
		client = o.cluster.Client(t)
		catalog = testrig.Catalog(t, client, incustest.DefaultImage, clusterTemplates)
		dialer = newMemberDialer(t, o.memberOr(o.cluster.Members[0]), client)
	case o.templates != "":
		client = incustest.Client(t)
		catalog = testrig.Catalog(t, client, o.image, o.templates)
	default:
		client = incustest.Client(t)
		catalog = testrig.Catalog(t, client, incustest.Image(t), testTemplates)
	}
	pc := client
	if o.providerIncus != nil {
		pc = o.providerIncus(client.Project())
	}
	if dialer == nil && o.dialer != "" {
		dialer = testrig.GuestDialerOf(t, client, o.dialer)
	}
	if dialer == nil {
		dialer = testrig.GuestDialer(t, client)
	}
	reg := prometheus.NewRegistry()
	edgeLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base, err := ingressurl.Parse("http://{label}.localhost:" + strconv.Itoa(edgeLn.Addr().(*net.TCPAddr).Port))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	// A provider after an earlier one is that one restarted, under its
	// name; a second replica on the cluster is another.
	replica := targets.RandomReplica()
	if o.after != nil && o.cluster == nil {
		replica = o.after.replica
	}
	p, err := provider.New(ctx, provider.Config{Incus: pc, Catalog: catalog, Dialer: dialer,
		Credential: bearer.New(credential), Log: zaptest.NewLogger(t).With(zap.String("replica", replica)), Metrics: reg,
		GracefulStop: 2 * time.Second, ReconcileInterval: time.Second, Replica: replica, IngressBase: &base,
		CacheCorrection: o.cacheCorrection})
	if err != nil {
		cancel()
		_ = edgeLn.Close()
		t.Fatal(err)
	}
	edgeSrv := p.Ingress.Server(nil)
	edgeDone := make(chan struct{})
	go func() { defer close(edgeDone); _ = edgeSrv.Serve(edgeLn) }()
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	srv := httptest.NewServer(p.Handler())
	r := &rig{t: t, client: client, catalog: catalog, p: p, srv: srv, metrics: reg, replica: replica, dialer: dialer, edge: edgeLn, base: base}
	var once bool
	r.stop = func() {
		if once {
			return
		}
		once = true
		if r.ctl != nil {
			_ = r.ctl.Close()
		}
		srv.Close()
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = edgeSrv.Close()
		<-edgeDone
		p.Stop(sctx)
		scancel()
		cancel()
		<-done
	}
	t.Cleanup(r.stop)
	r.ctl = r.connect()
	return r
}

// connect opens a controller connection and runs its handshake.
func (r *rig) connect() *jsonrpc.Client {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h := http.Header{"Authorization": {"Bearer " + credential}}
	ws, _, err := websocket.DefaultDialer.DialContext(ctx, "ws://"+r.srv.Listener.Addr().String()+"/control", h)
	if err != nil {
		r.t.Fatalf("dial /control: %v", err)
	}
	c := jsonrpc.NewClient(ws)
	var res controller.InitializeResult
	if err := c.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: 4,
		ClientInfo: controller.BuildInfo{Name: "provider-test"}}, &res); err != nil {
		r.t.Fatalf("initialize: %v", err)
	}
	if !res.Capabilities.Power || !res.Capabilities.Ingress {
		r.t.Fatalf("the provider advertises %+v, want power and ingress", res.Capabilities)
	}
	return c
}

func (r *rig) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	r.t.Cleanup(cancel)
	return ctx
}

// call runs one controller method and answers the observation.
func (r *rig) call(method string, params any) (controller.Observation, error) {
	return callOn(r.ctl, method, params)
}

// callOn runs one controller method on the connection c.
func callOn(c *jsonrpc.Client, method string, params any) (controller.Observation, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var res controller.TargetResult
	err := c.Call(ctx, method, params, &res)
	return res.Target, err
}

func (r *rig) get(owner controller.Owner) (controller.Observation, error) {
	return r.call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}})
}

func (r *rig) setPower(owner controller.Owner, p controller.Power) (controller.Observation, error) {
	return r.call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: owner}, Power: p})
}

func (r *rig) closeTarget(owner controller.Owner) (controller.Observation, error) {
	return r.call("target/close", controller.TargetParams{Target: controller.TargetRef{Owner: owner}})
}

// create makes a target through the controller plane and waits until it runs.
func (r *rig) create(env, template string) routes.Route {
	r.t.Helper()
	owner := controller.Owner{UniverseID: "u-provider", EnvironmentID: env}
	if _, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: template}); err != nil {
		r.t.Fatal(err)
	}
	o := r.until(owner, "active and running", 90*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
	})
	return routes.Route{Owner: owner, TargetID: o.TargetID}
}

func (r *rig) until(owner controller.Owner, what string, most time.Duration, cond func(controller.Observation) bool) controller.Observation {
	r.t.Helper()
	deadline := time.Now().Add(most)
	for {
		o, err := r.get(owner)
		if err == nil && cond(o) {
			return o
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("target never %s within %s: last %+v, %v", what, most, o, err)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// power moves the target and waits until Incus shows it there, settled.
func (r *rig) power(route routes.Route, p controller.Power) {
	r.t.Helper()
	if _, err := r.setPower(route.Owner, p); err != nil {
		r.t.Fatal(err)
	}
	r.until(route.Owner, "at "+string(p), 60*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == p && o.Message == ""
	})
}

func (r *rig) status(name string) incus.InstanceStatus {
	r.t.Helper()
	inst, _, err := r.client.GetInstance(r.ctx(), name)
	if err != nil {
		r.t.Fatal(err)
	}
	return inst.Status
}

func (r *rig) url(route routes.Route) string {
	return "ws://" + r.srv.Listener.Addr().String() + routes.Path("/routes", route)
}

// dial dials the route with the conformance package's helper, which checks
// the hold bound and the typed refusal.
func (r *rig) dial(route routes.Route) conformance.RouteDial {
	r.t.Helper()
	d, err := conformance.DialRoute(context.Background(), r.url(route), credential)
	if err != nil {
		r.t.Fatalf("DialRoute: %v", err)
	}
	if d.Conn != nil {
		r.t.Cleanup(func() { d.Conn.Close() })
	}
	return d
}

// dialAsTheRuntime dials route until it is upgraded, honouring a 503's
// Retry-After as the runtime does, for up to two minutes; any other
// refusal is an error. redials is how many refusals came first.
func (r *rig) dialAsTheRuntime(route routes.Route) (conn *websocket.Conn, redials int, err error) {
	// A runtime dials again for as long as it is told to retry; the test
	// bounds that by time, not by count, since how many 5 s holds a
	// loaded Incus needs is the load's, not the provider's.
	giveUp := time.Now().Add(2 * time.Minute)
	for redials = 0; ; redials++ {
		d, err := conformance.RouteDialer{AsARuntime: true}.Dial(context.Background(), r.url(route), credential)
		if err != nil {
			return nil, redials, err
		}
		if d.Conn != nil {
			return d.Conn, redials, nil
		}
		if time.Now().After(giveUp) || d.Refusal == nil || d.Refusal.Status != 503 {
			return nil, redials, fmt.Errorf("refused: %+v after %s (%d redials)", d.Refusal, d.Elapsed, redials)
		}
		time.Sleep(d.Refusal.RetryAfter)
	}
}

func (r *rig) mustUpgrade(route routes.Route) *websocket.Conn {
	r.t.Helper()
	d := r.dial(route)
	if d.Conn == nil {
		r.t.Fatalf("route refused: %+v after %s", d.Refusal, d.Elapsed)
	}
	initialize(r.t, d.Conn)
	return d.Conn
}

// upgradeAsARuntime dials route as a runtime does: a dial refused as
// still waking or booting (the 5 s hold ran out, as a start under a loaded
// machine's lanes may) is dialled again after its Retry-After, up to five
// times. Any other refusal fails the test.
func (r *rig) upgradeAsARuntime(route routes.Route) *websocket.Conn {
	r.t.Helper()
	for try := 1; ; try++ {
		d, err := conformance.RouteDialer{AsARuntime: true}.Dial(context.Background(), r.url(route), credential)
		if err != nil {
			r.t.Fatalf("dial %d: %v", try, err)
		}
		if d.Conn != nil {
			r.t.Cleanup(func() { d.Conn.Close() })
			initialize(r.t, d.Conn)
			return d.Conn
		}
		if try == 5 || d.Refusal == nil || (d.Refusal.State != string(wake.StateBooting) && d.Refusal.State != string(wake.StateWaking)) {
			r.t.Fatalf("route refused: %+v after %s (dial %d)", d.Refusal, d.Elapsed, try)
		}
		r.t.Logf("dial %d refused %+v after %s; dialling again after its Retry-After, as a runtime does", try, d.Refusal, d.Elapsed)
		time.Sleep(max(d.Refusal.RetryAfter, 100*time.Millisecond))
	}
}

// wakes counts the wakes the data routes finished, by the provider's own
// metric.
func (r *rig) wakes() int {
	r.t.Helper()
	n := 0
	for _, c := range r.flights() {
		n += c
	}
	return n
}

// counter sums a counter's series whose labels include all of want.
func (r *rig) counter(name string, want map[string]string) float64 {
	r.t.Helper()
	var v float64
	for _, m := range r.series(name, want) {
		v += m.GetCounter().GetValue()
	}
	return v
}

// series are the provider's samples of the metric name whose labels
// include all of want.
func (r *rig) series(name string, want map[string]string) []*dto.Metric {
	r.t.Helper()
	mfs, err := r.metrics.Gather()
	if err != nil {
		r.t.Fatal(err)
	}
	var out []*dto.Metric
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				found := false
				for _, l := range m.GetLabel() {
					if l.GetName() == k && l.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			out = append(out, m)
		}
	}
	return out
}

// initialize runs the data-plane handshake through the relay, leaving the
// connection to the test.
func initialize(t testing.TB, ws *websocket.Conn) {
	t.Helper()
	if err := conformance.InitializeData(ws, "provider-test", 10*time.Second); err != nil {
		t.Fatalf("through the relay: %v", err)
	}
}

// awaitGoingAway reads until the server closes the connection, which must
// be with a going-away close.
func awaitGoingAway(t testing.TB, ws *websocket.Conn) {
	t.Helper()
	// The close follows the power request's record, which a starved Incus
	// can leave unanswered for seconds (measured beside stress-ng: every
	// PATCH unanswered for over 15 s); the provider retries meanwhile.
	_ = ws.SetReadDeadline(time.Now().Add(60 * time.Second))
	for {
		_, _, err := ws.ReadMessage()
		if err == nil {
			continue
		}
		if !websocket.IsCloseError(err, websocket.CloseGoingAway) {
			t.Fatalf("the client got %v, want a going-away close", err)
		}
		return
	}
}

// testSeed is PROVIDER_TEST_SEED when set (to replay a run), else the clock.
func testSeed(t *testing.T) int64 {
	t.Helper()
	if v := os.Getenv("PROVIDER_TEST_SEED"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("PROVIDER_TEST_SEED=%q is not a number", v)
		}
		return n
	}
	return time.Now().UnixNano()
}

func routeOf(owner controller.Owner, id string) routes.Route {
	return routes.Route{Owner: owner, TargetID: id}
}

// closeEach closes every owner's target, as the runtime does: until closed.
func (r *rig) closeEach(owners ...controller.Owner) {
	r.t.Helper()
	for _, o := range owners {
		deadline := time.Now().Add(90 * time.Second)
		for {
			got, err := r.closeTarget(o)
			if err == nil && got.Phase == controller.PhaseClosed {
				break
			}
			if time.Now().After(deadline) {
				r.t.Fatalf("%s never closed: %+v %v", o.EnvironmentID, got, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}

// closeAll closes every owner's target, as the runtime does (until closed),
// and checks nothing is left in Incus.
func (r *rig) closeAll(owners ...controller.Owner) {
	r.t.Helper()
	r.closeEach(owners...)
	list, err := r.client.ListInstances(r.ctx())
	if err != nil {
		r.t.Fatal(err)
	}
	if len(list) != 0 {
		r.t.Fatalf("%d instances left after every owner closed", len(list))
	}
}
