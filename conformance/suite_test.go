package conformance_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
)

// fast keeps the suite's waits short against the in-memory fake.
func fast(url string) conformance.Config {
	// Timeout is a bound, not an expectation: a 16 MiB message through a
	// strict decoder under -race beside a loaded machine's other lanes
	// took over 10 s (response-limit, beside stress-ng).
	// The fake's idle loop acts within milliseconds; a second of grace
	// keeps a wrong one's power-down well inside the windows.
	return conformance.Config{URL: url, Timeout: 2 * time.Minute, SettleTimeout: 5 * time.Second, PollInterval: 10 * time.Millisecond,
		IdleAfter: 100 * time.Millisecond, IdleGrace: time.Second}
}

// Every check passes against a correct controller but two that have
// nothing to check on it, and which say so: credential (it runs without
// one; TestSuitePassesWithACredential runs it) and capability-unavailable
// (it advertises power and ingress; TestSuiteWithoutPower runs it). They
// are asserted skipped, not left to skip the test.
func TestSuitePassesAgainstACorrectController(t *testing.T) {
	fake := newFake(correct)
	results := conformance.Run(t.Context(), fast(serve(t, fake, controller.Options{})))
	if len(results) != len(conformance.CheckNames()) {
		t.Fatalf("%d results for %d checks", len(results), len(conformance.CheckNames()))
	}
	for _, r := range results {
		wantSkip := r.Name == "credential" || r.Name == "capability-unavailable"
		switch {
		case wantSkip && !r.Skipped:
			t.Errorf("%s: want it skipped, with nothing to check here", r)
		case !wantSkip && !r.Passed:
			t.Errorf("%s", r)
		default:
			t.Logf("%s", r)
		}
	}
	if live := fake.live(); len(live) > 0 {
		t.Errorf("the suite left targets behind: %v", live)
	}
}

// A provider answers unavailable, with its retryAfterMs, while Incus does
// not answer in time: retryable by the contract, so a suite polling a
// create towards active asks again rather than failing it.
func TestSuiteRetriesAnUnavailableGet(t *testing.T) {
	for _, f := range []flaw{unavailableOnce, createUnavailableOnce} {
		cfg := fast(serve(t, newFake(f), controller.Options{}))
		cfg.Checks = []string{"create-idempotency"}
		for _, r := range conformance.Run(t.Context(), cfg) {
			if r.Failed() {
				t.Fatalf("%s failed on a retryable answer: %s", r.Name, r.Detail)
			}
		}
	}
}

// A target first seen active already powered down by its policy, its
// threshold passed since the create was sent (a loaded provider's polls),
// passes idle-obligations: the route's dial wakes it for the windows. The
// same power-down before the threshold fails ("an idle power-down before
// any idleness" in TestSuiteFailsAgainstWrongControllers).
func TestIdleObligationsAcceptAPowerDownSeenFirst(t *testing.T) {
	cfg := fast(serve(t, newFake(activeAfterIdle), controller.Options{}))
	cfg.Checks = []string{"idle-obligations"}
	results := conformance.Run(t.Context(), cfg)
	if len(results) != 1 || !results[0].Passed {
		t.Fatalf("want idle-obligations passed, got %v", results)
	}
	if !strings.Contains(results[0].Detail, "first seen active") {
		t.Errorf("the check did not meet the target powered down first: %s", results[0].Detail)
	}
}

// A controller that does not advertise power is not asked to move
// anything, and must refuse target/setPower as capabilityUnavailable.
func TestSuiteWithoutPower(t *testing.T) {
	cfg := fast(serve(t, newFake(powerless), controller.Options{}))
	cfg.Checks = []string{"set-power", "capability-unavailable"}
	results := conformance.Run(t.Context(), cfg)
	if len(results) != 2 || !results[0].Skipped || !results[1].Passed || !strings.Contains(results[1].Detail, "target/setPower") {
		t.Fatalf("want set-power skipped and capability-unavailable passed on target/setPower: %v", results)
	}
}

func TestSuitePassesWithACredential(t *testing.T) {
	fake := newFake(correct)
	cfg := fast(serve(t, fake, controller.Options{Credential: bearer.New("s3cret-conformance")}))
	cfg.Credential = "s3cret-conformance"
	results := conformance.Run(t.Context(), cfg)
	for _, r := range results {
		// The fake advertises power and ingress: nothing is unavailable.
		if !r.Passed && (!r.Skipped || r.Name != "capability-unavailable") {
			t.Errorf("%s", r)
		}
	}
	if !slices.ContainsFunc(results, func(r conformance.Result) bool { return r.Name == "credential" && r.Passed }) {
		t.Errorf("the credential check did not run and pass: %v", results)
	}
}

func TestSuiteOverAUnixSocket(t *testing.T) {
	cfg := fast(serveUnix(t, newFake(correct)))
	cfg.Checks = []string{"handshake", "framing", "create-idempotency", "close-by-owner"}
	results := conformance.Run(t.Context(), cfg)
	if len(results) != len(cfg.Checks) {
		t.Fatalf("ran %d checks, want %d: %v", len(results), len(cfg.Checks), results)
	}
	for _, r := range results {
		if !r.Passed {
			t.Errorf("%s", r)
		}
	}
}

func TestCredentialCheckFailsWhenTheControllerTakesAnyone(t *testing.T) {
	cfg := fast(serve(t, newFake(correct), controller.Options{}))
	cfg.Credential = "the provider ignores this"
	cfg.Checks = []string{"credential"}
	wantFailure(t, conformance.Run(t.Context(), cfg), "credential", "want HTTP 401")
}

// Each deliberately wrong controller must fail the check that covers its
// flaw, so the suite provably can fail.
func TestSuiteFailsAgainstWrongControllers(t *testing.T) {
	cases := []struct {
		name  string
		flaw  flaw
		check string
		says  string
	}{
		{"a new target per create", newTargetPerCreate, "create-idempotency", "answered target id"},
		{"owners ignored", ignoreOwners, "owner-fencing", "want a failedPrecondition error"},
		{"target/get creates", getCreates, "pure-get", "want a notFound error"},
		{"a repeated close answers notFound", closeForgets, "close-by-owner", "target/close repeated"},
		{"an active observation without power", activeWithoutPower, "create-idempotency", "power: must be present exactly when phase is active"},
		{"an ftp ingress endpoint", ftpIngress, "pure-get", "http or https URL"},
		{"a deprecated template creates", deprecatedCreates, "create-idempotency", "for an owner with nothing: want a failedPrecondition error"},
		{"a templateId listed twice", templatesRepeated, "template-list", "repeats the templateId"},
		{"ingress kept after remove", ingressSticks, "ingress", "want none once removed"},
		{"a closing observation without targetId", closingWithoutID, "close-by-owner", "targetId: must be present unless phase is provisioning or closed"},
		{"a power the template does not offer", powerAnyState, "set-power", "which the template's powerStates [running stopped] do not offer: want a invalidParams error"},
		{"a setPower never carried out", powerNeverMoves, "set-power", "target/setPower stopped: target/get still observes"},
		{"a closing target moved", powerMovesClosing, "set-power", "of a target whose close answered closing: answered a result"},
		{"another owner's setPower", ignoreOwners, "set-power", "target/setPower by another owner naming this target's id: want a failedPrecondition error"},
		{"powered down with a relay open", idleIgnoresRelays, "idle-obligations", `power "stopped" while its data route relayed a connection (obligation 4`},
		{"powered down while a process runs", idleIgnoresProcesses, "idle-obligations", `power "stopped" after its relay closed, while a process it started ran (obligation 3`},
		{"no idle policy applied", idleNever, "idle-obligations", "the provider does not apply the idle policy"},
		{"no idle close", idleNever, "idle-close", "the provider does not apply the idle policy"},
		{"an idle close reported failed", idleCloseFails, "idle-close", "phase failed power \"\" after an idle close fell due"},
		{"an idle close before any idleness", idleClosesAtCreate, "idle-close", "after its create was sent, before its policy's"},
		{"an idle power-down before any idleness", idlePausesAtCreate, "idle-obligations", "before its policy's"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fast(serve(t, newFake(tc.flaw), controller.Options{}))
			cfg.Checks = []string{tc.check}
			wantFailure(t, conformance.Run(t.Context(), cfg), tc.check, tc.says)
		})
	}
}

// A controller that reads envelopes leniently fails strict-envelope on
// each way it gives in, and only then: the same controller read strictly
// passes it (TestSuitePassesAgainstACorrectController).
func TestStrictEnvelopeFailsAgainstALenientController(t *testing.T) {
	for _, tc := range []struct {
		name          string
		echoMinusZero bool
		says          string
	}{
		{"a member named twice", false, "an id sent twice: answered a result"},
		{"a params member named twice", false, "a params member sent twice: answered a result"},
		{"a lone surrogate", false, "an id holding a lone UTF-16 surrogate: answered a result"},
		{"invalid UTF-8", false, "an id holding invalid UTF-8: answered a result"},
		{"the id -0 echoed", true, "the id -0 was answered with id -0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fast(lenientProxy(t, serve(t, newFake(correct), controller.Options{}), !tc.echoMinusZero, tc.echoMinusZero))
			cfg.Checks = []string{"strict-envelope"}
			wantFailure(t, conformance.Run(t.Context(), cfg), "strict-envelope", tc.says)
		})
	}
}

// A controller that breaks a wire rule fails the check of that rule; the
// proxy without flaws passes each (so the proxy itself breaks nothing).
func TestWireChecksFailAgainstWrongControllers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flaws wireFlaws
		check string
		says  string
		// backend is the controller's own switch behind the proxy (none:
		// correct).
		backend flaw
	}{
		{"fragmented answers", wireFlaws{fragment: true}, "one-frame", "came as 49 frames (text without FIN of 4096 bytes, continuation without FIN", correct},
		{"a 1 MiB read limit", wireFlaws{readLimit: 1 << 20}, "message-limit", "a request of exactly 16777216 bytes (16 MiB, the message limit) was not answered", correct},
		{"busy past 4 requests", wireFlaws{busyAfter: 4}, "pipelining", "template/list 4 of 16 in flight answered busy", correct},
		{"no pong", wireFlaws{noPong: true}, "ping", "no pong to a ping sent", correct},
		{"a second initialize accepted", wireFlaws{secondInitialize: true}, "handshake", "a second initialize: want a invalidRequest error", correct},
		{"an answer over 16 MiB", wireFlaws{oversize: true}, "response-limit", "was answered with a message over the 16 MiB limit", correct},
		{"ids neither integer nor string taken", wireFlaws{oddIDs: true}, "strict-envelope", "a fractional id: answered a result", correct},
		{"notifications answered", wireFlaws{answerNotifications: true}, "framing", "after a notification (it must not be answered) the connection no longer serves", correct},
		{"invalidParams without field", wireFlaws{fieldlessInvalidParams: true}, "strict-params", "invalidParams names field \"\"", correct},
		{"notFound with the code -32000", wireFlaws{wrongErrorCode: true}, "error-answers", "code: is -32000, but kind notFound has code -32004", correct},
		{"setPower unknown where power is not advertised", wireFlaws{unknownSetPower: true}, "capability-unavailable", "want a capabilityUnavailable error", powerless},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fast(flawProxy(t, serve(t, newFake(tc.backend), controller.Options{}), tc.flaws))
			// A bound, not an expectation: 16 MiB through the proxy and
			// a strict decoder takes seconds under -race on a busy machine.
			cfg.Timeout = time.Minute
			cfg.Checks = []string{tc.check}
			wantFailure(t, conformance.Run(t.Context(), cfg), tc.check, tc.says)
			if tc.flaws.readLimit > 0 {
				// 16 MiB twice through a strict decoder under -race takes
				// half a minute; the check passes against the controller
				// itself in TestSuitePassesAgainstACorrectController.
				return
			}
			cfg.URL = flawProxy(t, serve(t, newFake(tc.backend), controller.Options{}), wireFlaws{})
			if res := conformance.Run(t.Context(), cfg); len(res) != 1 || !res[0].Passed {
				t.Fatalf("the proxy without flaws fails %s: %v", tc.check, res)
			}
		})
	}
}

// A provider whose data routes break a rule fails the check of that rule.
func TestRouteChecksFailAgainstWrongRoutes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flaw  routeFlaw
		check string
		says  string
	}{
		{"routes ignore owners", routeIgnoresOwner, "data-route", "upgraded; a route whose owner does not own the target is refused"},
		{"routes take anyone", routeNoCredential, "data-route", "dialed without a credential answered HTTP 101; want 401"},
		{"segments not percent-decoded", routeRawSegments, "data-route", "answered HTTP 410 (gone); only a 503 may succeed later"},
		{"a 404 once closed", routeGoneAs404, "data-route", "the route of a closed target: "},
		{"no pongs relayed", routeNoPongs, "data-route", "got no pong"},
		{"no wake", routeNoWake, "route-wake", "the data route still refuses (waking, Retry-After 1s)"},
		{"a 503 without Retry-After", routeNoRetryAfter, "route-wake", "a 503 carries 0 Retry-After headers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := newFake(correct)
			fake.route = tc.flaw
			cfg := fast(serve(t, fake, controller.Options{Credential: bearer.New("s3cret-routes")}))
			cfg.Credential = "s3cret-routes"
			cfg.Checks = []string{tc.check}
			wantFailure(t, conformance.Run(t.Context(), cfg), tc.check, tc.says)
		})
	}
}

// A controller whose answers come later than the bound fails bounded-calls.
func TestBoundedCallsFailsAgainstASlowController(t *testing.T) {
	cfg := fast(serve(t, newFake(slowGet), controller.Options{}))
	cfg.AnswerBound = 200 * time.Millisecond
	cfg.Checks = []string{"pure-get", "bounded-calls"}
	wantFailure(t, conformance.Run(t.Context(), cfg), "bounded-calls", "target/get (in check pure-get) answered after")
}

func wantFailure(t *testing.T, results []conformance.Result, check, says string) {
	t.Helper()
	for _, r := range results {
		if r.Name != check {
			continue
		}
		if !r.Failed() {
			t.Fatalf("check %s did not fail: %s", check, r)
		}
		if !strings.Contains(r.Detail, says) {
			t.Fatalf("check %s failed, but its detail does not say %q: %s", check, says, r.Detail)
		}
		return
	}
	t.Fatalf("check %s did not run: %v", check, results)
}

func TestRunRefusesABadConfig(t *testing.T) {
	for _, cfg := range []conformance.Config{
		{},
		{URL: "http://127.0.0.1:1/control"},
		{URL: "unix://relative/path"},
		{URL: "ws://127.0.0.1:1/control", UniverseID: "not a universe id"},
		{URL: "ws://127.0.0.1:1/control", Checks: []string{"no-such-check"}},
		{URL: "ws://127.0.0.1:1/control", RouteBase: "http://127.0.0.1:1/routes"},
		{URL: "ws://127.0.0.1:1/control", RouteBase: "WS://127.0.0.1:1/routes"},
		{URL: "ws://127.0.0.1:1/control", RouteBase: "ws://127.0.0.1:1/routes/"},
		{URL: "ws://127.0.0.1:1/control", RouteBase: "ws://user@127.0.0.1:1/routes"},
		{URL: "ws://127.0.0.1:1/control", RouteBase: "ws://127.0.0.1:1/routes?a=b"},
		{URL: "ws://127.0.0.1:1/control", RouteBase: "ws:///routes"},
		{URL: "wss://127.0.0.1:1/control", RouteBase: "ws://127.0.0.1:1/routes"},
	} {
		results := conformance.Run(context.Background(), cfg)
		if len(results) != 1 || results[0].Name != "config" || !results[0].Failed() {
			t.Errorf("Run(%+v) = %v, want one failed config result", cfg, results)
		}
	}
}

func TestUnreachableControllerFailsEveryCheck(t *testing.T) {
	// Nothing listens on port 1 of the loopback address.
	cfg := fast("ws://127.0.0.1:1/control")
	cfg.Timeout = 2 * time.Second
	for _, r := range conformance.Run(t.Context(), cfg) {
		if r.Name == "credential" {
			continue // skipped: no credential is configured
		}
		if !r.Failed() {
			t.Errorf("%s passed against an unreachable controller", r)
		}
	}
}

func TestSummary(t *testing.T) {
	results := []conformance.Result{{Name: "a", Passed: true}, {Name: "b"}, {Name: "c", Skipped: true, Detail: "why"}}
	if got, want := conformance.Summary(results), "1 passed, 1 failed, 1 skipped"; got != want {
		t.Errorf("Summary = %q, want %q", got, want)
	}
	if got, want := conformance.Summary(results[:2]), "1 passed, 1 failed"; got != want {
		t.Errorf("Summary = %q, want %q", got, want)
	}
	if got, want := results[2].String(), "SKIP c: why"; got != want {
		t.Errorf("String = %q, want %q", got, want)
	}
}
