package provider_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

// TestClusterEdgeThroughTheBalancer: two replicas serve the public edge
// under one base URL behind HAProxy, with no reconcile pass in the test
// (every replica's index follows Incus's events). A route ensured for a
// guest on lsm3, a member no replica runs on, is served by each replica's
// own edge, and through the balancer; a remove and a close stop it on both
// replicas. How long the replicas take to agree is logged (the issue's
// bound is 1 s); the test bounds it at 10 s, far below a pass's hour, so
// that a loaded machine cannot fail it and the old index, which waited for
// a pass, does.
func TestClusterEdgeThroughTheBalancer(t *testing.T) {
	r := newLBRigOpts(t, lbOptions{edge: true, env: []string{"PROVIDER_RECONCILE_INTERVAL=1h"}, templates: webOnLsm3})
	for i := range r.replicas {
		r.awaitFollowing(i)
	}
	ref, endpoint := r.ingressOnLsm3(controller.Owner{UniverseID: "u-edge", EnvironmentID: "web"})
	u, err := url.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	// get asks the edge at addr for the endpoint's page, on a connection
	// of its own; *.localhost is never looked up.
	get := func(addr string) (int, string) {
		t.Helper()
		client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "tcp", addr)
			}}}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"/", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("GET %s through %s: %v", endpoint, addr, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if !strings.HasSuffix(u.Host, ":"+portOf(t, r.edge)) {
		t.Fatalf("the endpoint %s is not the balancer's edge %s", endpoint, r.edge)
	}
	// agree waits until both replicas' edges answer want for the
	// endpoint: the replica that answered the change at once, the other
	// once Incus's event reaches it.
	agree := func(what string, want int) {
		t.Helper()
		began := time.Now()
		for _, rep := range r.replicas {
			for {
				code, _ := get(rep.edge)
				if code == want {
					break
				}
				if time.Since(began) > 10*time.Second {
					t.Fatalf("%s: replica %s's edge still answered %d 10 s later; its /readyz:\n%s", what, rep.id, code, r.readyz(slices.Index(r.replicas[:], rep)))
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		t.Logf("%s: both replicas' edges answer %d after %s", what, want, time.Since(began).Round(time.Millisecond))
	}
	served := func(what string) { agree(what, http.StatusOK) }
	gone := func(what string) { agree(what, http.StatusNotFound) }
	served("ensure")
	for range 4 {
		if code, body := get(r.edge); code != http.StatusOK || body == "" {
			t.Fatalf("through the balancer: %d %q", code, body)
		}
	}
	if _, err := r.call(controller.MethodIngressRemove, ref, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	gone("remove")
	if _, err := r.call(controller.MethodIngressEnsure, ref, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	served("ensure again")
	if _, err := r.call(controller.MethodTargetClose, ref, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	gone("close")
}

// webOnLsm3 is a template of the dev guest's web app on lsm3, the member no
// replica of the rig runs on.
const webOnLsm3 = `  - templateId: web-lsm3
    displayName: the dev guest's web app on lsm3
    powerStates: [running, paused, stopped]
    publicIngress: true
    ingressPort: 8080
    imageAlias: {{image}}
    placement: lsm3
`

// ingressOnLsm3 creates o's target from webOnLsm3, waits until it runs and
// routes public ingress to it: its reference and its endpoint.
func (r *lbRig) ingressOnLsm3(o controller.Owner) (controller.TargetParams, string) {
	r.t.Helper()
	rt := r.runningRoute(o, "web-lsm3")
	ref := controller.TargetParams{Target: controller.TargetRef{Owner: o, TargetID: rt.TargetID}}
	obs, err := r.call(controller.MethodIngressEnsure, ref, 30*time.Second)
	if err != nil || obs.Ingress == nil {
		r.t.Fatalf("ensure: %+v, %v", obs, err)
	}
	return ref, obs.Ingress.Endpoint
}

func portOf(t *testing.T, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return port
}
