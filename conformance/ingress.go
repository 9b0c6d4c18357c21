package conformance

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// checkIngress: with ingress advertised, ensure routes a public-ingress
// template's target and is idempotent, every observation carries the
// endpoint exactly while routed, remove stops it and is idempotent, both
// methods are fenced and answer notFound for an owner with nothing, a
// template without public ingress is ingressUnsupported. A host that
// answers something else than 404 once unrouted is reported as a
// recommendation: the contract says the route stops, not what answers.
func checkIngress(ctx context.Context, r *checkRun) {
	c, init := r.mustOpen(ctx)
	defer c.close()
	if !init.Capabilities.Ingress {
		r.skipf("the controller does not advertise ingress")
		return
	}
	tmpl := r.template(ctx)
	if tmpl.ingress == "" {
		r.skipf("template/list offers no template with publicIngress that is not deprecated")
		return
	}
	nobody := r.owner("ingress-nobody")
	for _, m := range []string{controller.MethodIngressEnsure, controller.MethodIngressRemove} {
		what := m + " for an owner that holds no target"
		r.wantError(r.rt(ctx, c, what, m, getParams(controller.TargetRef{Owner: nobody})), jsonrpc.KindNotFound, what)
	}

	owner, active := r.createActiveFrom(ctx, c, "ingress", tmpl.ingress)
	id := active.TargetID
	ref := controller.TargetRef{Owner: owner, TargetID: id}
	if active.Ingress != nil {
		r.failf("a target never routed is observed with ingress endpoint %s", active.Ingress.Endpoint)
	}
	endpointOf := func(what string, o controller.Observation) string {
		if o.Ingress == nil {
			r.fatalf("%s: the observation of a routed target carries no ingress.endpoint (%s)", what, summary(o))
		}
		return o.Ingress.Endpoint
	}
	endpoint := endpointOf("ingress/ensure", r.mustTarget(ctx, c, "ingress/ensure", controller.MethodIngressEnsure, getParams(ref), owner))
	for _, call := range []struct{ what, method string }{
		{"a second ingress/ensure", controller.MethodIngressEnsure},
		{"target/get of a routed target", controller.MethodTargetGet},
	} {
		if got := endpointOf(call.what, r.mustTarget(ctx, c, call.what, call.method, getParams(ref), owner)); got != endpoint {
			r.failf("%s answered endpoint %s, the ensure %s", call.what, got, endpoint)
		}
	}

	stranger := r.owner("ingress-stranger")
	for _, m := range []string{controller.MethodIngressEnsure, controller.MethodIngressRemove} {
		what := m + " by another owner naming this target's id"
		f := r.rt(ctx, c, what, m, getParams(controller.TargetRef{Owner: stranger, TargetID: id}))
		if e := r.errorAnswer(f, jsonrpc.KindFailedPrecondition, what); e != nil && e.Reason != "ownerMismatch" {
			r.failf("%s: failedPrecondition with reason %q, want ownerMismatch", what, e.Reason)
		}
	}

	for i := 1; i <= 2; i++ {
		what := fmt.Sprintf("ingress/remove %d", i)
		if o := r.mustTarget(ctx, c, what, controller.MethodIngressRemove, getParams(ref), owner); o.Ingress != nil {
			r.failf("%s answered ingress endpoint %s; want none once removed", what, o.Ingress.Endpoint)
		}
	}
	if o := r.mustTarget(ctx, c, "target/get after ingress/remove", controller.MethodTargetGet, getParams(ref), owner); o.Ingress != nil {
		r.failf("target/get after ingress/remove observes endpoint %s", o.Ingress.Endpoint)
	}
	r.wantHostGone(ctx, endpoint, "after ingress/remove")
	endpoint = endpointOf("ingress/ensure after remove", r.mustTarget(ctx, c, "ingress/ensure after remove", controller.MethodIngressEnsure, getParams(ref), owner))

	if tmpl.private != "" {
		pOwner, pActive := r.createActiveFrom(ctx, c, "ingress-private", tmpl.private)
		what := "ingress/ensure of a target whose template has no public ingress"
		f := r.rt(ctx, c, what, controller.MethodIngressEnsure, getParams(controller.TargetRef{Owner: pOwner, TargetID: pActive.TargetID}))
		if e := r.errorAnswer(f, jsonrpc.KindFailedPrecondition, what); e != nil && e.Reason != "ingressUnsupported" {
			r.failf("%s: failedPrecondition with reason %q, want ingressUnsupported", what, e.Reason)
		}
	}

	closing, err := r.s.closeUntilClosed(ctx, c, controller.TargetRef{Owner: owner})
	if err != nil {
		r.fatalf("closing the routed target: %s", describeErr(err))
	}
	if closing.Ingress != nil {
		r.failf("a closed target is observed with ingress endpoint %s", closing.Ingress.Endpoint)
	}
	r.wantHostGone(ctx, endpoint, "after target/close")
	r.notef("target %s routed at %s; ensure and remove idempotent and fenced", id, endpoint)
}

// wantHostGone asks the endpoint until it answers 404, for at most 2 s,
// and otherwise records a recommendation, not a failure: the contract
// says that ingress/remove and target/close stop the route, and a black
// box cannot tell a guest's answer from the provider's, but a 404 says
// plainly that nothing is routed there any more. A *.localhost host is
// dialled on loopback, as a browser does, without a DNS query.
func (r *checkRun) wantHostGone(ctx context.Context, endpoint, when string) {
	u, err := url.Parse(endpoint)
	if err != nil {
		r.failf("endpoint %q is not a URL: %v", endpoint, err)
		return
	}
	client := &http.Client{
		Timeout: r.s.cfg.Timeout,
		Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, port, err := net.SplitHostPort(addr)
			if err == nil && (host == "localhost" || strings.HasSuffix(host, ".localhost")) {
				addr = net.JoinHostPort("127.0.0.1", port)
			}
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	defer client.CloseIdleConnections()
	deadline := time.Now().Add(2 * time.Second)
	for {
		status, err := get(ctx, client, u.String())
		if err == nil && status == http.StatusNotFound {
			r.notef("404 %s", when)
			return
		}
		if time.Now().After(deadline) {
			if err != nil {
				r.recommendf("the endpoint %s %s: %v; a 404 would say that nothing is routed there any more", endpoint, when, err)
			} else {
				r.recommendf("the endpoint %s %s answers %d; a 404 would say that nothing is routed there any more", endpoint, when, status)
			}
			return
		}
		if sleep(ctx, 100*time.Millisecond) != nil {
			return
		}
	}
}

func get(ctx context.Context, client *http.Client, u string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, fmt.Errorf("build a GET of %s: %w", u, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", u, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}
