package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// TestLivePrometheus scrapes the shipped binary with a real Prometheus
// (Debian's, every second, with the shipped alert rules loaded) while a
// scripted workload runs: a create, three wakes from paused and one from
// stopped by data-route dials, two refusals, a close. Then what the
// workload made is read back the way the dashboard and the alerts read it:
// increase() over the whole run counts every event, the first included,
// because every series exists at zero before it; every alert expression
// and every dashboard query runs without an error; and the panels the
// workload exercised show it.
func TestLivePrometheus(t *testing.T) {
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		if os.Getenv(incustest.EnvRequire) == "1" {
			t.Fatalf("prometheus is not installed (make test installs Debian's): %v", err)
		}
		t.Skipf("prometheus is not installed: %v", err)
	}
	edge := freePort(t)
	// Incus through a proxy the workload cuts for an outage.
	fault := incustest.FaultProxy(t)
	c := startProvider(t, "INCUS_SOCKET="+fault.Socket(),
		"PROVIDER_INGRESS_LISTEN="+edge, "PROVIDER_INGRESS_BASE_URL=http://{label}.localhost:"+edge[strings.LastIndexByte(edge, ':')+1:])
	prom := startPrometheus(t, promBin, strings.TrimSuffix(strings.TrimPrefix(c.metrics, "http://"), "/metrics"))
	// The first scrape sees every series at zero.
	prom.await(t, "the provider scraped", `up{job="incus-provider"} == 1`, 30*time.Second)
	time.Sleep(2 * time.Second)

	ctl := c.controller(t)
	owner := controller.Owner{UniverseID: "u-prom", EnvironmentID: "env-1"}
	call := targetCaller(ctl)
	until := func(what string, cond func(controller.Observation) bool) controller.Observation {
		t.Helper()
		deadline := time.Now().Add(90 * time.Second)
		for {
			o, err := call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}})
			if err == nil && cond(o) {
				return o
			}
			if time.Now().After(deadline) {
				t.Fatalf("target never %s: %+v, %v", what, o, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if _, err := call("target/create", controller.CreateParams{Owner: owner, TemplateID: "dev-small"}); err != nil {
		t.Fatal(err)
	}
	o := until("active", func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
	})
	routeURL := "ws://" + c.listen + routes.Path("/routes", routes.Route{Owner: owner, TargetID: o.TargetID})
	wake := func(from controller.Power) {
		t.Helper()
		if _, err := call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: owner}, Power: from}); err != nil {
			t.Fatal(err)
		}
		until(string(from), func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == from && o.Message == ""
		})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		d, err := conformance.DialRoute(ctx, routeURL, c.credential)
		if err != nil || d.Conn == nil {
			t.Fatalf("waking dial from %s: %+v, %v", from, d.Refusal, err)
		}
		_ = d.Conn.Close()
	}
	for range 3 {
		wake(controller.PowerPaused)
	}
	wake(controller.PowerStopped)
	// An Incus outage: the socket refuses, every open connection is cut.
	// Each read of the target in it is answered unavailable (and counted
	// so), and everything works again once Incus is back.
	transport0 := prom.value(t, `sum(incus_provider_incus_requests_total{job="incus-provider",status="transport"})`)
	if err := fault.RefuseAll(true); err != nil {
		t.Fatal(err)
	}
	// The provider learns of the outage when its event stream ends, a
	// moment after the cut: until then its observation cache answers what
	// it last knew, as it may. The reads below are asked once it knows.
	for deadline := time.Now().Add(10 * time.Second); c.metric(t, "incus_provider_cache_confirmed") != 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			_ = fault.RefuseAll(false)
			t.Fatal("the observation cache still answers 10 s into an Incus outage")
		}
	}
	for range 2 {
		_, err := call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}})
		var e *jsonrpc.Error
		if !errors.As(err, &e) || e.Kind != jsonrpc.KindUnavailable {
			_ = fault.RefuseAll(false)
			t.Fatalf("target/get while Incus refuses: want unavailable, got %v", err)
		}
	}
	if err := fault.RefuseAll(false); err != nil {
		t.Fatal(err)
	}
	until("readable again after the outage", func(o controller.Observation) bool { return o.Phase == controller.PhaseActive })
	stranger := controller.Owner{UniverseID: "u-prom", EnvironmentID: "nobody"}
	for range 2 {
		if _, err := call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: stranger}}); err == nil {
			t.Fatal("a target/get for an owner with nothing was answered")
		}
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		o, err := call("target/close", controller.TargetParams{Target: controller.TargetRef{Owner: owner}})
		if err == nil && o.Phase == controller.PhaseClosed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not closed within 60 s: %+v, %v", o, err)
		}
	}
	// Two scrapes after the last event.
	time.Sleep(3 * time.Second)

	// What the workload made. Exactly, as the counters' rise over the run
	// (max minus min: the series existed at zero before the first event,
	// or the first would be lost); and as increase() reads it, which
	// extrapolates to the window's edges by up to half a scrape interval
	// on each side of a run of about 15 s.
	for _, w := range []struct {
		series string
		want   float64
	}{
		{`incus_provider_route_wake_duration_seconds_count{job="incus-provider",from="paused"}`, 3},
		{`incus_provider_route_wake_duration_seconds_count{job="incus-provider",from="stopped"}`, 1},
		{`incus_provider_controller_requests_total{job="incus-provider",method="target/create",kind="ok"}`, 1},
		{`incus_provider_controller_requests_total{job="incus-provider",method="target/get",kind="notFound"}`, 2},
		{`incus_provider_controller_requests_total{job="incus-provider",method="target/setPower",kind="ok"}`, 4},
		{`incus_provider_controller_requests_total{job="incus-provider",method="target/get",kind="unavailable"}`, 2},
	} {
		exact := fmt.Sprintf("sum(max_over_time(%s[10m]) - min_over_time(%s[10m]))", w.series, w.series)
		if got := prom.value(t, exact); got != w.want {
			t.Errorf("%s = %v, want %v", exact, got, w.want)
		}
		inc := fmt.Sprintf("sum(increase(%s[10m]))", w.series)
		if got := prom.value(t, inc); got < w.want || got > w.want*1.25+0.01 {
			t.Errorf("%s = %.3f, want %v (at most a quarter more, by extrapolation)", inc, got, w.want)
		}
	}
	// The outage's failed Incus calls: at least the two reads (the
	// reconciler and the idle loop may have tried too).
	if got := prom.value(t, `sum(incus_provider_incus_requests_total{job="incus-provider",status="transport"})`) - transport0; got < 2 {
		t.Errorf("Incus calls failed in transport during the outage: %v, want at least 2", got)
	}
	if got := prom.value(t, `sum(incus_provider_targets{job="incus-provider"})`); got != 0 {
		t.Errorf("incus_provider_targets sums to %v after the close, want 0", got)
	}
	if got := prom.value(t, `sum(increase(incus_provider_controller_requests_total{job="incus-provider",method="target/close",kind="ok"}[10m]))`); got < 1 {
		t.Errorf("no close counted (%v)", got)
	}

	// Every alert expression and every dashboard query runs, with the
	// dashboard's variables as Grafana would fill them for this job.
	fill := strings.NewReplacer(`$job`, `incus-provider`, `$instance`, `.+`, `$__rate_interval`, `1m`, `$__interval`, `1s`, `$__range`, `10m`)
	var empty []string
	exercised := map[string]bool{}
	for where, expr := range queries(t) {
		res := prom.query(t, fill.Replace(expr))
		if len(res) == 0 {
			empty = append(empty, where)
			continue
		}
		exercised[where] = true
	}
	sort.Strings(empty)
	t.Logf("%d queries ran; empty after this workload (nothing of theirs happened, or an alert that does not fire): %d", len(exercised)+len(empty), len(empty))
	for _, where := range []string{"panel Wakes by outcome #0", "panel Wake latency p50/p95 by starting power #0"} {
		if _, ok := queries(t)[where]; !ok {
			t.Errorf("the dashboard has no %s any more; update this test", where)
		} else if !exercised[where] {
			t.Errorf("%s shows nothing after four wakes", where)
		}
	}
	// The wake panels show all the wakes the workload made: their queries
	// over the whole run, rate times the window, add up to them (before
	// the series existed from zero, three wakes from paused read as two,
	// one from stopped as none).
	whole := strings.NewReplacer(`$job`, `incus-provider`, `$instance`, `.+`, `$__rate_interval`, `10m`)
	for _, from := range []struct {
		power string
		want  float64
	}{{"paused", 3}, {"stopped", 1}} {
		// The panel's own series, kept where from is this power.
		q := fmt.Sprintf(`sum((%s) and on (from) count by (from) (incus_provider_route_wake_duration_seconds_count{from=%q})) * 600`,
			whole.Replace(queries(t)["panel Wakes by outcome #0"]), from.power)
		if got := prom.value(t, q); got < from.want || got > from.want*1.25+0.01 {
			t.Errorf("panel Wakes by outcome over the run shows %.3f wakes from %s, want %v", got, from.power, from.want)
		}
	}
	// No alert fires on this healthy workload.
	if firing := prom.query(t, `ALERTS{alertstate="firing"}`); len(firing) > 0 {
		t.Errorf("alerts firing after a healthy workload: %v", firing)
	}
}

// targetCaller calls a target method on ctl, each call bounded by 30 s,
// and answers the observation.
func targetCaller(ctl *jsonrpc.Client) func(method string, params any) (controller.Observation, error) {
	return func(method string, params any) (controller.Observation, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var res controller.TargetResult
		err := ctl.Call(ctx, method, params, &res)
		return res.Target, err
	}
}

// controller opens a controller connection and runs its handshake.
func (c *child) controller(t *testing.T) *jsonrpc.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	ws, resp, err := websocket.DefaultDialer.DialContext(ctx, c.control, http.Header{"Authorization": {"Bearer " + c.credential}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		t.Fatalf("dial the controller: %v", err)
	}
	cl := jsonrpc.NewClient(ws)
	t.Cleanup(func() { _ = cl.Close() })
	if err := cl.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: controller.ProtocolVersion,
		ClientInfo: controller.BuildInfo{Name: "prometheus-live-test"}}, nil); err != nil {
		t.Fatalf("initialize: %v", err)
	}
	return cl
}

type promServer struct {
	base string // http://127.0.0.1:port
}

// startPrometheus runs Prometheus on loopback, scraping target every
// second as job incus-provider, with the shipped alert rules.
func startPrometheus(t *testing.T, bin, target string) *promServer {
	t.Helper()
	dir := t.TempDir()
	rules, err := filepath.Abs("../../deploy/prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%q]
scrape_configs:
  - job_name: incus-provider
    static_configs:
      - targets: [%q]
`, rules, target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	listen := freePort(t)
	cmd := exec.Command(bin, "--config.file="+filepath.Join(dir, "prometheus.yml"), "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+listen, "--log.level=warn")
	logf, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	_ = logf.Close()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			out, _ := os.ReadFile(filepath.Join(dir, "prometheus.log"))
			t.Logf("prometheus log:\n%s", out)
		}
	})
	p := &promServer{base: "http://" + listen}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(p.base + "/-/ready")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready within 30 s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type promSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

// query runs an instant query and fails the test on an error answer.
func (p *promServer) query(t *testing.T, q string) []promSample {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.base+"/api/v1/query?"+url.Values{"query": {q}}.Encode(), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("query %s: %v", q, err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	var out struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string          `json:"resultType"`
			Result     json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.Status != "success" {
		t.Fatalf("query %s: %s %s (%v)", q, out.Status, out.Error, err)
	}
	if out.Data.ResultType != "vector" {
		return []promSample{{}} // a scalar: one value
	}
	var vec []promSample
	if err := json.Unmarshal(out.Data.Result, &vec); err != nil {
		t.Fatalf("query %s: %v", q, err)
	}
	return vec
}

// value is the single value of a query (NaN when it has none).
func (p *promServer) value(t *testing.T, q string) float64 {
	t.Helper()
	vec := p.query(t, q)
	if len(vec) != 1 {
		return math.NaN()
	}
	s, _ := vec[0].Value[1].(string)
	var f float64
	if _, err := fmt.Sscan(s, &f); err != nil {
		return math.NaN()
	}
	return f
}

// await polls q until it returns something.
func (p *promServer) await(t *testing.T, what, q string, most time.Duration) {
	t.Helper()
	deadline := time.Now().Add(most)
	for len(p.query(t, q)) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s returned nothing within %s", what, q, most)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
