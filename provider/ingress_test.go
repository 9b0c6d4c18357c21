package provider_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idle"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/provider"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// The public ingress edge, end to end on the real Incus: the methods
// through the controller plane, the requests through the edge's own
// listener to the dev guest's web app (port 8080).

func (r *rig) ensure(owner controller.Owner, id string) (controller.Observation, error) {
	return r.call(controller.MethodIngressEnsure, controller.TargetParams{Target: controller.TargetRef{Owner: owner, TargetID: id}})
}

func (r *rig) remove(owner controller.Owner, id string) (controller.Observation, error) {
	return r.call(controller.MethodIngressRemove, controller.TargetParams{Target: controller.TargetRef{Owner: owner, TargetID: id}})
}

// edgeClient reaches the edge whatever host a URL names: *.localhost is
// never looked up (no DNS query leaves the machine), every dial goes to the
// edge's loopback listener. Redirects are returned, not followed.
func (r *rig) edgeClient() *http.Client {
	addr := r.edge.Addr().String()
	return &http.Client{
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		}},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Timeout:       30 * time.Second,
	}
}

func (r *rig) edgeGet(endpoint, path string, header http.Header) (*http.Response, []byte) {
	r.t.Helper()
	req, err := http.NewRequest(http.MethodGet, endpoint+path, nil)
	if err != nil {
		r.t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := r.edgeClient().Do(req)
	if err != nil {
		r.t.Fatalf("GET %s%s: %v", endpoint, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		r.t.Fatalf("GET %s%s: reading the body: %v", endpoint, path, err)
	}
	return resp, body
}

func mustEndpoint(t *testing.T) func(controller.Observation, error) string {
	return func(o controller.Observation, err error) string {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if o.Ingress == nil || o.Ingress.Endpoint == "" {
			t.Fatalf("observation %+v carries no ingress endpoint", o)
		}
		return o.Ingress.Endpoint
	}
}

func wantRPC(t *testing.T, err error, kind jsonrpc.Kind, reason string) {
	t.Helper()
	var e *jsonrpc.Error
	if !errors.As(err, &e) || e.Kind != kind || (reason != "" && e.Reason != reason) {
		t.Fatalf("got %v, want %s (%s)", err, kind, reason)
	}
	if e.Message == "" {
		t.Fatal("a refusal without a sentence")
	}
}

func TestIngress(t *testing.T) {
	r := newRig(t, rigOptions{})
	web := r.create("ingress-web", "web")
	plain := r.create("ingress-plain", "t1")

	var endpoint string
	t.Run("ensure routes, is idempotent, and every observation carries the endpoint", func(t *testing.T) {
		endpoint = mustEndpoint(t)(r.ensure(web.Owner, web.TargetID))
		if again := mustEndpoint(t)(r.ensure(web.Owner, "")); again != endpoint {
			t.Fatalf("a second ensure answered %s, the first %s", again, endpoint)
		}
		if got := mustEndpoint(t)(r.get(web.Owner)); got != endpoint {
			t.Fatalf("target/get answers %s", got)
		}
		created, err := r.call("target/create", controller.CreateParams{Owner: web.Owner, TemplateID: "web"})
		if got := mustEndpoint(t)(created, err); got != endpoint {
			t.Fatalf("target/create answers %s", got)
		}
		u, err := url.Parse(endpoint)
		if err != nil {
			t.Fatal(err)
		}
		label, ok := r.base.Label(u.Host)
		if !ok || strings.Contains(label, web.TargetID) || strings.Contains(label, web.Owner.EnvironmentID) {
			t.Fatalf("endpoint %s: label %q from the target or owner", endpoint, label)
		}
		if o, err := r.get(plain.Owner); err != nil || o.Ingress != nil {
			t.Fatalf("an unrouted target observed %+v, %v", o, err)
		}
	})

	t.Run("the page, forwarding headers and redirects pass through", func(t *testing.T) {
		resp, body := r.edgeGet(endpoint, "/", nil)
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "Lightspeed dev guest") {
			t.Fatalf("GET / answered %d: %.200s", resp.StatusCode, body)
		}
		resp, body = r.edgeGet(endpoint, "/headers", http.Header{
			"X-Forwarded-For": {"203.0.113.9"}, "X-Forwarded-Host": {"evil.example"}, "X-Forwarded-Proto": {"https"},
			"Connection": {"X-Hop"}, "X-Hop": {"must not pass"},
		})
		var seen struct {
			Host    string              `json:"host"`
			Headers map[string][]string `json:"headers"`
		}
		if err := json.Unmarshal(body, &seen); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /headers answered %d: %.200s (%v)", resp.StatusCode, body, err)
		}
		u, _ := url.Parse(endpoint)
		h := http.Header(seen.Headers)
		if seen.Host != u.Host || h.Get("X-Forwarded-Host") != u.Host || h.Get("X-Forwarded-Proto") != "http" ||
			strings.Join(h.Values("X-Forwarded-For"), ",") != "127.0.0.1" || h.Get("X-Hop") != "" {
			t.Fatalf("the guest saw host %q and headers %v", seen.Host, seen.Headers)
		}
		resp, _ = r.edgeGet(endpoint, "/redirect", nil)
		if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/" {
			t.Fatalf("GET /redirect answered %d, Location %q", resp.StatusCode, resp.Header.Get("Location"))
		}
	})

	t.Run("server-sent events stream as they come", func(t *testing.T) {
		stream, cancel := r.openEvents(t, endpoint)
		defer cancel()
		// The stream stays open after its events: reading them proves
		// they were flushed, not buffered until the end.
		for i := 1; i <= 3; i++ {
			if got := stream(); got != fmt.Sprintf("data: event-%d", i) {
				t.Fatalf("event %d: %q", i, got)
			}
		}
	})

	t.Run("a WebSocket is relayed both ways", func(t *testing.T) {
		ws := r.edgeWebSocket(t, endpoint)
		defer ws.Close()
		for _, msg := range []string{"one", strings.Repeat("x", 100_000)} {
			if err := ws.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
				t.Fatal(err)
			}
			_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, got, err := ws.ReadMessage()
			if err != nil || string(got) != "echo: "+msg {
				t.Fatalf("echo of %d bytes: %d bytes, %v", len(msg), len(got), err)
			}
		}
	})

	t.Run("1 MiB each way", func(t *testing.T) {
		up := make([]byte, 1<<20)
		_, _ = rand.Read(up)
		resp, err := r.edgeClient().Post(endpoint+"/echo", "application/octet-stream", bytes.NewReader(up))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || !bytes.Equal(got, up) {
			t.Fatalf("the echo of 1 MiB came back as %d bytes (%v)", len(got), err)
		}
		for i := range 4 {
			resp, err := r.edgeClient().Post(endpoint+"/count", "application/octet-stream", bytes.NewReader(up))
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK || strings.TrimSpace(string(got)) != "1048576" {
				t.Fatalf("upload %d of 1 MiB: %d, counted %q (%v)", i, resp.StatusCode, got, err)
			}
		}
		resp, body := r.edgeGet(endpoint, "/bytes?n=1048576", nil)
		if resp.StatusCode != http.StatusOK || len(body) != 1<<20 {
			t.Fatalf("the 1 MiB download: %d, %d bytes", resp.StatusCode, len(body))
		}
	})

	t.Run("refusals", func(t *testing.T) {
		_, err := r.ensure(plain.Owner, plain.TargetID)
		wantRPC(t, err, jsonrpc.KindFailedPrecondition, "ingressUnsupported")
		nobody := controller.Owner{UniverseID: "u-provider", EnvironmentID: "ingress-nobody"}
		_, err = r.ensure(nobody, "")
		wantRPC(t, err, jsonrpc.KindNotFound, "")
		_, err = r.remove(nobody, "")
		wantRPC(t, err, jsonrpc.KindNotFound, "")
		// Another owner's target id: fenced on both methods.
		_, err = r.ensure(plain.Owner, web.TargetID)
		wantRPC(t, err, jsonrpc.KindFailedPrecondition, "ownerMismatch")
		_, err = r.remove(plain.Owner, web.TargetID)
		wantRPC(t, err, jsonrpc.KindFailedPrecondition, "ownerMismatch")
		if o, err := r.remove(plain.Owner, ""); err != nil || o.Ingress != nil {
			t.Fatalf("remove of a target never routed: %+v, %v", o, err)
		}
		// Hosts the edge does not route: 404 without any Incus call.
		for _, host := range []string{"http://nosuchlabelnosuchlabelxx.localhost", "http://example.com", "http://" + r.edge.Addr().String()} {
			if resp, _ := r.edgeGet(host, "/", nil); resp.StatusCode != http.StatusNotFound {
				t.Fatalf("%s answered %d", host, resp.StatusCode)
			}
		}
	})

	t.Run("remove stops routing and keeps the label", func(t *testing.T) {
		for range 2 {
			o, err := r.remove(web.Owner, web.TargetID)
			if err != nil || o.Ingress != nil {
				t.Fatalf("remove answered %+v, %v", o, err)
			}
		}
		if o, err := r.get(web.Owner); err != nil || o.Ingress != nil {
			t.Fatalf("after remove, target/get answers %+v, %v", o, err)
		}
		if resp, _ := r.edgeGet(endpoint, "/", nil); resp.StatusCode != http.StatusNotFound {
			t.Fatalf("a removed route answered %d", resp.StatusCode)
		}
		if again := mustEndpoint(t)(r.ensure(web.Owner, "")); again != endpoint {
			t.Fatalf("ensure after remove answered %s, before %s", again, endpoint)
		}
	})

	t.Run("wake on request from paused and from stopped", func(t *testing.T) {
		for _, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
			r.power(web, p)
			start := time.Now()
			resp, body := r.edgeGet(endpoint, "/", nil)
			took := time.Since(start)
			switch resp.StatusCode {
			case http.StatusOK:
			case http.StatusServiceUnavailable:
				// Within its hold the wake did not finish: the answer says so,
				// and the target wakes all the same.
				if resp.Header.Get("Retry-After") == "" || !strings.Contains(string(body), "waking") {
					t.Fatalf("from %s: 503 without Retry-After or the waking page: %v %.200s", p, resp.Header, body)
				}
				t.Logf("from %s: 503 after %s; asking again", p, took)
				resp = r.awaitServing(endpoint)
			}
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("from %s: the request answered %d", p, resp.StatusCode)
			}
			if took > 6*time.Second {
				t.Fatalf("from %s: the request was held %s, past the 5 s hold", p, took)
			}
			if st := r.status(web.TargetID); st != incus.InstanceRunning {
				t.Fatalf("from %s: Incus shows %s", p, st)
			}
			t.Logf("from %s: answered after %s", p, took)
		}
	})

	t.Run("no idle power-down under an open stream; an explicit one closes it", func(t *testing.T) {
		r.awaitServing(endpoint)
		stream, cancel := r.openEvents(t, endpoint)
		defer cancel()
		stream()
		inv := provider.IdleInventory{Targets: r.p.Targets}
		it, ok, err := inv.IdleTarget(r.ctx(), web.TargetID)
		if err != nil || !ok {
			t.Fatalf("IdleTarget: %v %v", ok, err)
		}
		if err := inv.IdleAct(r.ctx(), it, idlepolicy.ActionPause, time.Now(), time.Now()); !errors.Is(err, idle.ErrRelayOpen) {
			t.Fatalf("an idle pause under an ingress stream: %v", err)
		}
		if _, err := r.setPower(web.Owner, controller.PowerPaused); err != nil {
			t.Fatal(err)
		}
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			for stream() != "" {
			}
		}()
		select {
		case <-ended:
		case <-time.After(20 * time.Second):
			t.Fatal("the stream outlived an explicit pause")
		}
		r.until(web.Owner, "paused", 30*time.Second, func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused
		})
		r.power(web, controller.PowerRunning)
	})

	t.Run("a restarted provider finds the route on the instance", func(t *testing.T) {
		r2 := newRig(t, rigOptions{after: r})
		o := r2.until(web.Owner, "observed routed", 30*time.Second, func(o controller.Observation) bool { return o.Ingress != nil })
		u1, _ := url.Parse(endpoint)
		u2, _ := url.Parse(o.Ingress.Endpoint)
		l1, _ := r.base.Label(u1.Host)
		l2, _ := r2.base.Label(u2.Host)
		if l1 != l2 {
			t.Fatalf("the label changed across the restart: %s, then %s", endpoint, o.Ingress.Endpoint)
		}
		deadline := time.Now().Add(15 * time.Second)
		for {
			resp, _ := r2.edgeGet(o.Ingress.Endpoint, "/", nil)
			if resp.StatusCode == http.StatusOK {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the restarted edge answers %d", resp.StatusCode)
			}
			time.Sleep(200 * time.Millisecond)
		}
		r2.stop()
	})

	t.Run("close tears ingress down first", func(t *testing.T) {
		if _, err := r.closeTarget(web.Owner); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for {
			resp, _ := r.edgeGet(endpoint, "/", nil)
			if resp.StatusCode == http.StatusNotFound {
				break
			}
			if time.Since(start) > time.Second {
				t.Fatalf("a closed target's host still answers %d after %s", resp.StatusCode, time.Since(start))
			}
			time.Sleep(20 * time.Millisecond)
		}
		for deadline := time.Now().Add(60 * time.Second); ; {
			// An ensure meanwhile routes nothing: it observes the target
			// closing, without an endpoint, or (once it is gone) notFound.
			if o, err := r.ensure(web.Owner, ""); err == nil && (o.Phase != controller.PhaseClosing || o.Ingress != nil) {
				t.Fatalf("ingress/ensure on a closing target answered %+v", o)
			} else if err != nil {
				// notFound once it is gone; unavailable when Incus is slow.
				var rpcErr *jsonrpc.Error
				if !errors.As(err, &rpcErr) || rpcErr.Kind != jsonrpc.KindNotFound && rpcErr.Kind != jsonrpc.KindUnavailable {
					t.Fatalf("ingress/ensure on a closing target: %v", err)
				}
			}
			o, err := r.closeTarget(web.Owner)
			if err == nil && o.Phase == controller.PhaseClosed {
				break
			}
			if err == nil && o.Ingress != nil {
				t.Fatalf("a closing target observed with its endpoint: %+v", o)
			}
			if time.Now().After(deadline) {
				t.Fatalf("never closed: %+v, %v", o, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
}

// awaitServing asks for the page until it answers 200: a wake that a
// loaded Incus takes long over is answered 503 meanwhile.
func (r *rig) awaitServing(endpoint string) *http.Response {
	r.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, _ := r.edgeGet(endpoint, "/", nil)
		if resp.StatusCode == http.StatusOK || time.Now().After(deadline) {
			return resp
		}
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
			r.t.Fatalf("while the target wakes, the edge answers %d (Retry-After %q); want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// openEvents opens the guest's event stream through the edge and answers a
// reader of its data lines ("" once it ended).
func (r *rig) openEvents(t *testing.T, endpoint string) (next func() string, cancel func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"/events", nil)
	resp, err := r.edgeClient().Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		cancel()
		t.Fatalf("GET /events answered %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	lines := make(chan string)
	go func() {
		defer close(lines)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if l := sc.Text(); strings.HasPrefix(l, "data: ") {
				select {
				case lines <- l:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return func() string {
		select {
		case l := <-lines:
			return l
		case <-time.After(15 * time.Second):
			t.Error("no event within 15 s")
			return ""
		}
	}, cancel
}

func (r *rig) edgeWebSocket(t *testing.T, endpoint string) *websocket.Conn {
	t.Helper()
	addr := r.edge.Addr().String()
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, NetDialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var nd net.Dialer
		return nd.DialContext(ctx, "tcp", addr)
	}}
	u, _ := url.Parse(endpoint)
	ws, resp, err := d.Dial("ws://"+u.Host+"/ws", http.Header{"Origin": {endpoint}})
	if err != nil {
		status := 0
		if resp != nil {
			status = resp.StatusCode
		}
		t.Fatalf("WebSocket through the edge: %v (status %d)", err, status)
	}
	return ws
}

func TestIngressManyOwnersAtOnce(t *testing.T) {
	r := newRig(t, rigOptions{})
	const n = 12
	rts := make([]routes.Route, n)
	var wg sync.WaitGroup
	for i := range n {
		owner := controller.Owner{UniverseID: "u-provider", EnvironmentID: fmt.Sprintf("ingress-many-%d", i)}
		rts[i] = routes.Route{Owner: owner}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: "web"}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	endpoints := make([]string, n)
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Ensure as soon as the target exists, while it still boots:
			// the route waits for it.
			for deadline := time.Now().Add(2 * time.Minute); ; {
				o, err := r.ensure(rts[i].Owner, "")
				if err == nil && o.Ingress != nil {
					endpoints[i] = o.Ingress.Endpoint
					rts[i].TargetID = o.TargetID
					break
				}
				if time.Now().After(deadline) {
					errs <- fmt.Errorf("owner %d: ensure never routed: %+v, %w", i, o, err)
					return
				}
				time.Sleep(200 * time.Millisecond)
			}
			for deadline := time.Now().Add(2 * time.Minute); ; {
				resp, err := r.edgeClient().Get(endpoints[i] + "/headers")
				if err == nil {
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK && strings.Contains(string(body), strings.TrimPrefix(endpoints[i], "http://")) {
						return
					}
				}
				if time.Now().After(deadline) {
					errs <- fmt.Errorf("owner %d: %s never answered", i, endpoints[i])
					return
				}
				time.Sleep(200 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	seen := map[string]bool{}
	for _, e := range endpoints {
		if seen[e] {
			t.Fatalf("endpoint %s handed out twice", e)
		}
		seen[e] = true
	}
	owners := make([]controller.Owner, n)
	for i := range rts {
		owners[i] = rts[i].Owner
	}
	r.closeAll(owners...)
}
