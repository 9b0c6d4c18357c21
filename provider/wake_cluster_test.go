package provider_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// TestClusterOneWakeAcrossReplicas: data-route dials and public ingress
// requests of one paused target arrive at both replicas at once, and the
// target is woken once: by the replica on its member (lsm2's, for a guest
// there) or, for a guest on lsm3 where no replica runs, by the one replica
// both choose; the other hands its flight to that one over the peer hop
// (incus_provider_route_wake_duration_seconds counts it "elsewhere").
// Incus sends one instance-resumed a round. Every use is served. With the
// waking replica killed, the other wakes the target itself. A wake sent
// over the hop naming another owner wakes nothing.
func TestClusterOneWakeAcrossReplicas(t *testing.T) {
	r := newLBRigOpts(t, lbOptions{edge: true, templates: webOnLsm3})
	onLsm3 := controller.Owner{UniverseID: "u-onewake", EnvironmentID: "web"}
	onLsm2 := controller.Owner{UniverseID: "u-onewake", EnvironmentID: "dial"}
	_, endpoint := r.ingressOnLsm3(onLsm3)
	route3 := r.routeWhenRunning(onLsm3)
	route2 := r.runningRoute(onLsm2, "on-lsm2")
	lsm2 := -1
	for i, rep := range r.replicas {
		if rep.member == "lsm2" {
			lsm2 = i
		}
	}
	if lsm2 < 0 {
		t.Fatal("no replica runs on lsm2")
	}
	wakes := func(i int, outcome string) float64 {
		return r.scrape(i, "incus_provider_route_wake_duration_seconds_count", map[string]string{"from": "paused", "outcome": outcome})
	}
	get := func(i int) error {
		client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "tcp", r.replicas[i].edge)
			}}}
		resp, err := client.Get(endpoint + "/")
		if err != nil {
			return err
		}
		defer func() { _ = resp.Body.Close() }()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	dial := func(i int, route routes.Route) error {
		d, err := conformance.DialRoute(context.Background(), "ws://"+r.replicas[i].addr+routes.Path("/routes", route), credential)
		if err != nil {
			return err
		}
		if d.Conn == nil {
			return fmt.Errorf("refused: %+v after %s", d.Refusal, d.Elapsed)
		}
		defer func() { _ = d.Conn.Close() }()
		initialize(t, d.Conn)
		return nil
	}
	for _, c := range []struct {
		owner controller.Owner
		route routes.Route
		web   bool
	}{{onLsm3, route3, true}, {onLsm2, route2, false}} {
		for round := range 3 {
			what := fmt.Sprintf("%s, round %d", c.route.TargetID, round+1)
			if _, err := r.call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: c.owner}, Power: controller.PowerPaused}, 30*time.Second); err != nil {
				t.Fatal(err)
			}
			r.until(c.owner, "paused", 30*time.Second, func(o controller.Observation) bool {
				return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
			})
			events := watchLifecycle(t, r.client, c.route.TargetID)
			var ready, elsewhere [2]float64
			for i := range r.replicas {
				ready[i], elsewhere[i] = wakes(i, "ready"), wakes(i, "elsewhere")
			}
			var wg sync.WaitGroup
			errs := make(chan error, 16)
			began := time.Now()
			for k := range 8 {
				i := k % 2
				wg.Go(func() {
					if err := dial(i, c.route); err != nil {
						errs <- fmt.Errorf("dial through replica %s: %w", r.replicas[i].id, err)
					}
				})
				if c.web {
					wg.Go(func() {
						if err := get(i); err != nil {
							errs <- fmt.Errorf("ingress through replica %s: %w", r.replicas[i].id, err)
						}
					})
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatalf("%s: %v", what, err)
			}
			took := time.Since(began)
			var woke []int
			for i := range r.replicas {
				ready[i] = wakes(i, "ready") - ready[i]
				elsewhere[i] = wakes(i, "elsewhere") - elsewhere[i]
				if ready[i] > 0 {
					woke = append(woke, i)
				}
			}
			t.Logf("%s: every use served in %s; wakes by replica (own, handed): %s %v/%v, %s %v/%v", what, took.Round(time.Millisecond),
				r.replicas[0].id, ready[0], elsewhere[0], r.replicas[1].id, ready[1], elsewhere[1])
			if len(woke) != 1 || ready[woke[0]] != 1 {
				t.Fatalf("%s: the replicas flew %v wakes of their own, want one replica's one", what, ready)
			}
			if !c.web && woke[0] != lsm2 {
				t.Fatalf("%s: replica %s woke a guest on lsm2, want lsm2's own replica", what, r.replicas[woke[0]].id)
			}
			if other := 1 - woke[0]; ready[other] != 0 {
				t.Fatalf("%s: replica %s woke the target too", what, r.replicas[other].id)
			}
			// A second unfreeze would show as a second resume: the
			// events are awaited for 3 s after every use was served.
			ev := events(3*time.Second, func(by map[string]int) bool { return by["instance-resumed"] > 1 })
			if ev["instance-resumed"] != 1 {
				t.Fatalf("%s: Incus resumed the target %d times (events %v), want once", what, ev["instance-resumed"], ev)
			}
		}
	}

	// A wake that names another owner, sent over the hop with the
	// replicas' secret as a replica on lsm3 would send it, is answered
	// gone, and the target stays paused: the waking replica checks the
	// owner as for its own uses.
	if _, err := r.call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: onLsm2}, Power: controller.PowerPaused}, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	r.until(onLsm2, "paused", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
	})
	secret, err := os.ReadFile(filepath.Join(r.dir, "peer.secret"))
	if err != nil {
		t.Fatal(err)
	}
	fail := func(context.Context, string, []string) (net.Conn, error) { return nil, errors.New("not in this test") }
	asLsm3, err := guest.New(guest.KindMember, guest.Options{Member: "lsm3", PeerSecret: bytes.TrimSpace(secret), Exec: fail,
		Lookup: func(context.Context, string) (int, error) { return 0, errors.New("not in this test") },
		Peers:  map[string]string{r.replicas[0].member: r.replicas[0].peer, r.replicas[1].member: r.replicas[1].peer}})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	a, err := guest.PeerWakes(asLsm3).Wake(wctx, "lsm2", guest.WakeRequest{Instance: route2.TargetID, Universe: "u-onewake", Environment: "someone-else"})
	wcancel()
	if err != nil || a.Ready || a.State != "gone" {
		t.Fatalf("a wake of %s naming another owner: %+v, %v; want it answered gone", route2.TargetID, a, err)
	}
	time.Sleep(time.Second)
	if inst, _, err := r.client.GetInstance(context.Background(), route2.TargetID); err != nil || inst.Status != incus.InstanceFrozen {
		t.Fatalf("after a wake naming another owner, %s is %v (%v), want Frozen", route2.TargetID, inst, err)
	}

	// The waking replica of the guest on lsm2 killed: the other one's
	// dials find no one to hand the wake to, wake the target themselves
	// and are served (through exec, its member's replica being dead).
	other := 1 - lsm2
	r.stop(lsm2, syscall.SIGKILL)
	before := wakes(other, "ready")
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			if err := dial(other, route2); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a dial through replica %s with the waking replica dead: %v", r.replicas[other].id, err)
	}
	if got := wakes(other, "ready") - before; got != 1 {
		t.Fatalf("replica %s flew %v wakes of its own for 4 dials with the waking replica dead, want 1", r.replicas[other].id, got)
	}
	r.start(lsm2)
	r.awaitUp(lsm2)
}

// webIdleOnLsm3 is webOnLsm3 with an idle policy: paused after 1.5 s idle.
const webIdleOnLsm3 = `  - templateId: web-idle-lsm3
    displayName: the dev guest's web app on lsm3, paused after 1.5 s idle
    powerStates: [running, paused, stopped]
    idle: {pauseAfterMs: 1500}
    publicIngress: true
    ingressPort: 8080
    imageAlias: {{image}}
    placement: lsm3
`

// TestClusterIngressKeepsATargetAwakeOnEveryReplica: an open public
// ingress connection (a server-sent event stream, silent once its events
// are sent) through one replica's edge keeps its target awake, though its
// daemon reports idle, for the idle loops of both replicas: the replica
// holding the connection counts it as a relay, and the other reads that
// replica's relay lease on the instance. Once the stream is closed the
// target is paused by idle; that it is, and how soon, shows the hold was
// long enough to matter.
func TestClusterIngressKeepsATargetAwakeOnEveryReplica(t *testing.T) {
	r := newLBRigOpts(t, lbOptions{edge: true, templates: webIdleOnLsm3})
	owner := controller.Owner{UniverseID: "u-awake", EnvironmentID: "web"}
	rt := r.runningRoute(owner, "web-idle-lsm3")
	obs, err := r.call(controller.MethodIngressEnsure, controller.TargetParams{Target: controller.TargetRef{Owner: owner, TargetID: rt.TargetID}}, 30*time.Second)
	if err != nil || obs.Ingress == nil {
		t.Fatalf("ensure: %+v, %v", obs, err)
	}
	events := watchLifecycle(t, r.client, rt.TargetID)
	// The stream through replica 1's edge; a page load wakes the target
	// if idle paused it first.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", r.replicas[0].edge)
		}}}
	// The ensure was answered by either replica; the other's edge learns
	// the route from Incus's event, within the bound the edge tests keep.
	var resp *http.Response
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, obs.Ingress.Endpoint+"/events", nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp, err = client.Do(req); err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode == http.StatusOK {
			break
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound || time.Now().After(deadline) {
			t.Fatalf("GET /events through replica %s's edge: %s", r.replicas[0].id, resp.Status)
		}
	}
	done := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if sc.Text() == "data: done" {
				done <- nil
				break
			}
		}
		// Held until the test closes it; an end before is a cut.
		_, err := io.Copy(io.Discard, resp.Body)
		if err == nil {
			err = io.EOF
		}
		done <- fmt.Errorf("the stream ended: %w", err)
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the stream's events did not all come within 30 s")
	}
	// Held for ten times the idle policy's 1.5 s; the daemon reports idle
	// all along (nothing reaches it).
	const hold = 15 * time.Second
	held := time.Now()
	select {
	case err := <-done:
		t.Fatalf("the stream was cut %s into the hold: %v", time.Since(held).Round(time.Millisecond), err)
	case <-time.After(hold):
	}
	ev := events(time.Second, func(map[string]int) bool { return false })
	if ev["instance-paused"] != 0 || ev["instance-stopped"] != 0 {
		t.Fatalf("the target was powered down while an ingress stream through replica %s was open (events %v)", r.replicas[0].id, ev)
	}
	for i := range r.replicas {
		o, err := r.callAt(r.replicas[i].addr, "target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owner}}, 10*time.Second)
		if err != nil || o.Power != controller.PowerRunning {
			t.Fatalf("replica %s observes %+v, %v after the hold, want running", r.replicas[i].id, o, err)
		}
	}
	// Closed: idle pauses it.
	events = watchLifecycle(t, r.client, rt.TargetID)
	cancel()
	_ = resp.Body.Close()
	closed := time.Now()
	r.until(owner, "paused by idle", 60*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused
	})
	ev = events(10*time.Second, func(by map[string]int) bool { return by["instance-paused"] > 0 })
	t.Logf("held %s through replica %s's edge with no power-down; closed, paused by idle %s later (events %v)",
		hold, r.replicas[0].id, time.Since(closed).Round(time.Millisecond), ev)
	if ev["instance-paused"] != 1 {
		t.Fatalf("paused %d times after the stream closed, want once", ev["instance-paused"])
	}
}
