package conformance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// check is one named check of the suite, with the contract's words it
// enforces.
type check struct {
	name string
	rule string
	run  func(ctx context.Context, r *checkRun)
}

// alongside names the checks that mostly wait on the provider's clock:
// each starts with the run and is joined at its place in the list, so its
// waiting overlaps the checks before it. They must not disturb the others:
// each uses owners of its own, as every check does.
var alongside = map[string]bool{"idle-obligations": true, "idle-close": true}

// CheckRule is the contract's section and sentence a check enforces;
// empty for a name that is no check.
func CheckRule(name string) string {
	for _, c := range checks {
		if c.name == name {
			return c.rule
		}
	}
	return ""
}

// CheckNames lists the suite's checks in the order they run.
func CheckNames() []string {
	names := make([]string, len(checks))
	for i, c := range checks {
		names[i] = c.name
	}
	return names
}

// Run runs the suite's checks against cfg.URL, one after another (those
// that run alongside beside them), and returns one Result per check, in
// the list's order. An invalid configuration yields a single
// failed Result named "config".
func Run(ctx context.Context, cfg Config) []Result {
	s, err := newSuite(cfg)
	if err != nil {
		return []Result{{Name: "config", Detail: err.Error()}}
	}
	var out []Result
	early := s.startAlongside(ctx)
	for _, c := range s.selected() {
		if res, ok := early[c.name]; ok {
			out = append(out, <-res)
			continue
		}
		out = append(out, s.run(ctx, c))
	}
	return out
}

// startAlongside starts the selected checks that run alongside the others;
// each sends its one result, which the caller must receive.
func (s *suite) startAlongside(ctx context.Context) map[string]chan Result {
	early := map[string]chan Result{}
	for _, c := range s.selected() {
		if alongside[c.name] {
			res := make(chan Result, 1)
			early[c.name] = res
			go func() { res <- s.run(ctx, c) }()
		}
	}
	return early
}

// RunT runs the suite's checks as subtests of t, each named after its
// check: a failed check fails its subtest, a skipped one skips it.
func RunT(t *testing.T, cfg Config) {
	t.Helper()
	s, err := newSuite(cfg)
	if err != nil {
		t.Fatalf("conformance: %v", err)
	}
	early := s.startAlongside(t.Context())
	for _, c := range s.selected() {
		t.Run(c.name, func(t *testing.T) {
			var res Result
			if ch, ok := early[c.name]; ok {
				res = <-ch
			} else {
				res = s.run(t.Context(), c)
			}
			switch {
			case res.Skipped:
				t.Skip(res.Detail)
			case !res.Passed:
				t.Fatal(res.Detail)
			default:
				t.Log(res.Detail)
			}
		})
	}
}

// suite is one run: its configuration, the owners it invents and the error
// answers it has seen.
type suite struct {
	cfg   Config
	runID string
	seq   atomic.Int64
	errs  errorLog
	slow  slowest

	tmplMu sync.Mutex
	tmpl   *templateChoice
}

func newSuite(cfg Config) (*suite, error) {
	cfg, err := cfg.normalized()
	if err != nil {
		return nil, err
	}
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("draw a run id: %w", err)
	}
	return &suite{cfg: cfg, runID: hex.EncodeToString(b[:])}, nil
}

func (s *suite) selected() []check {
	if len(s.cfg.Checks) == 0 {
		return checks
	}
	var out []check
	for _, c := range checks {
		if slices.Contains(s.cfg.Checks, c.name) {
			out = append(out, c)
		}
	}
	return out
}

// errorLog keeps every error answer the run received and what was wrong
// with each one that did not conform.
type errorLog struct {
	mu       sync.Mutex
	seen     int
	problems []string
}

func (l *errorLog) add(check, method, problem string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seen++
	if problem != "" {
		l.problems = append(l.problems, fmt.Sprintf("%s answered in check %s: %s", method, check, problem))
	}
}

func (l *errorLog) snapshot() (int, []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.seen, slices.Clone(l.problems)
}

// slowest keeps the longest a request of the run waited for its answer,
// over every check's sequential round trips.
type slowest struct {
	mu     sync.Mutex
	took   time.Duration
	method string
	check  string
	count  int
}

func (l *slowest) add(check, method string, took time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.count++
	if took > l.took {
		l.took, l.method, l.check = took, method, check
	}
}

func (l *slowest) snapshot() (time.Duration, string, string, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.took, l.method, l.check, l.count
}

// abort ends a check early; the runner recovers it.
type abort struct{}

// checkRun is one check in progress.
type checkRun struct {
	s        *suite
	name     string
	failures []string
	notes    []string
	skipped  string
	owners   []controller.Owner
}

func (s *suite) run(ctx context.Context, c check) Result {
	r := &checkRun{s: s, name: c.name}
	func() {
		defer func() {
			if p := recover(); p != nil {
				if _, ok := p.(abort); !ok {
					r.failures = append(r.failures, fmt.Sprintf("the check panicked: %v\n%s", p, debug.Stack()))
				}
			}
		}()
		c.run(ctx, r)
	}()
	r.cleanup(ctx)
	res := Result{Name: c.name, Rule: c.rule}
	switch {
	case len(r.failures) > 0:
		res.Detail = strings.Join(r.failures, "; ")
	case r.skipped != "":
		res.Skipped, res.Detail = true, r.skipped
	default:
		res.Passed, res.Detail = true, strings.Join(r.notes, "; ")
	}
	return res
}

// failf records a failure and lets the check go on.
func (r *checkRun) failf(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}

// fatalf records a failure and ends the check (its cleanup still runs).
func (r *checkRun) fatalf(format string, args ...any) {
	r.failf(format, args...)
	panic(abort{})
}

// skipf ends the check as skipped.
func (r *checkRun) skipf(format string, args ...any) {
	r.skipped = fmt.Sprintf(format, args...)
	panic(abort{})
}

func (r *checkRun) notef(format string, args ...any) {
	r.notes = append(r.notes, fmt.Sprintf(format, args...))
}

// recommendf notes what the contract does not require but a careful
// provider does; it never fails the check.
func (r *checkRun) recommendf(format string, args ...any) {
	r.notes = append(r.notes, "RECOMMENDATION (not required by the contract): "+fmt.Sprintf(format, args...))
}

// owner invents an owner no earlier run used and registers it for cleanup.
func (r *checkRun) owner(label string) controller.Owner {
	o := controller.Owner{
		UniverseID:    r.s.cfg.UniverseID,
		EnvironmentID: fmt.Sprintf("lsconf-%s-%s-%d", r.s.runID, label, r.s.seq.Add(1)),
	}
	r.owners = append(r.owners, o)
	return o
}

// adopt registers an owner the check built itself for cleanup.
func (r *checkRun) adopt(o controller.Owner) controller.Owner {
	r.owners = append(r.owners, o)
	return o
}

// cleanup closes every owner the check used, on a connection of its own,
// until the controller answers closed. It runs even when the check failed
// or its context ended.
func (r *checkRun) cleanup(ctx context.Context) {
	if len(r.owners) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.s.cfg.SettleTimeout+r.s.cfg.Timeout)
	defer cancel()
	c, _, err := r.s.open(ctx, r.name+"/cleanup")
	if err != nil {
		r.failf("cleanup could not reach the controller to close %d owners: %v", len(r.owners), err)
		return
	}
	defer func() { c.close() }()
	for _, o := range r.owners {
		if _, err := r.s.closeUntilClosed(ctx, c, controller.TargetRef{Owner: o}); err != nil {
			r.failf("cleanup of owner %s: %v", o.EnvironmentID, err)
			var rpcErr *jsonrpc.Error
			if !errors.As(err, &rpcErr) {
				// The connection may be gone: one more try on a new one.
				c.close()
				fresh, _, err := r.s.open(ctx, r.name+"/cleanup")
				if err != nil {
					r.failf("cleanup could not reconnect: %v", err)
					return
				}
				c = fresh
			}
		}
	}
}

// mustOpen opens an initialized connection or ends the check.
func (r *checkRun) mustOpen(ctx context.Context) (*conn, controller.InitializeResult) {
	c, init, err := r.s.open(ctx, r.name)
	if err != nil {
		r.fatalf("cannot open an initialized connection: %v", err)
	}
	return c, init
}

// mustConnect opens a connection without initialize or ends the check.
func (r *checkRun) mustConnect(ctx context.Context) *conn {
	c, err := r.s.connect(ctx, r.name)
	if err != nil {
		r.fatalf("cannot connect: %v", err)
	}
	return c
}

// rt is a round trip that ends the check when the transport fails.
func (r *checkRun) rt(ctx context.Context, c *conn, what, method string, params any) *frame {
	f, err := c.roundTrip(ctx, method, params)
	if err != nil {
		r.fatalf("%s: %v", what, err)
	}
	return f
}

// wantError requires an error answer of kind, recording a failure when the
// answer was something else.
func (r *checkRun) wantError(f *frame, kind jsonrpc.Kind, what string) {
	// The failure, if any, is recorded; this caller checks nothing more of
	// the error.
	_ = r.errorAnswer(f, kind, what)
}

// errorAnswer requires an error answer of kind; it returns the error, for
// the caller to check more of it, or nil (after recording the failure) when
// the answer was something else.
func (r *checkRun) errorAnswer(f *frame, kind jsonrpc.Kind, what string) *jsonrpc.Error {
	if f.rpcErr == nil {
		r.failf("%s: want a %s error, got %s", what, kind, f)
		return nil
	}
	if f.rpcErr.Kind != kind {
		r.failf("%s: want a %s error, got %s", what, kind, describeErr(f.rpcErr))
		return nil
	}
	return f.rpcErr
}

// wantInvalidParams requires invalidParams naming one of fields.
func (r *checkRun) wantInvalidParams(f *frame, what string, fields ...string) {
	e := r.errorAnswer(f, jsonrpc.KindInvalidParams, what)
	if e == nil {
		return
	}
	if !slices.Contains(fields, e.Field) {
		r.failf("%s: invalidParams names field %q, want %s", what, e.Field, strings.Join(quoteAll(fields), " or "))
	}
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = fmt.Sprintf("%q", s)
	}
	return out
}

// callTarget calls a target method and decodes its observation strictly;
// it also requires the owner to be echoed.
func (s *suite) callTarget(ctx context.Context, c *conn, method string, params any, owner controller.Owner) (controller.Observation, error) {
	var res controller.TargetResult
	if err := c.call(ctx, method, params, &res); err != nil {
		return controller.Observation{}, err
	}
	if res.Target.Owner != owner {
		return res.Target, fmt.Errorf("%s answered an observation of owner %s/%s, not the requested %s/%s",
			method, res.Target.Owner.UniverseID, res.Target.Owner.EnvironmentID, owner.UniverseID, owner.EnvironmentID)
	}
	if in := res.Target.Ingress; in != nil {
		if u, err := url.Parse(in.Endpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return res.Target, fmt.Errorf("%s answered ingress.endpoint %q, which is not an http or https URL", method, clip(in.Endpoint, 100))
		}
	}
	return res.Target, nil
}

// mustTarget is callTarget that ends the check on any error.
//
// The contract's retryable unavailable is asked again after its
// retryAfterMs, within the settle timeout, as the runtime asks it again:
// a provider whose Incus did not answer in time has no flaw (the LXD lane
// met one on a repeated create).
func (r *checkRun) mustTarget(ctx context.Context, c *conn, what, method string, params any, owner controller.Owner) controller.Observation {
	deadline := time.Now().Add(r.s.cfg.SettleTimeout)
	for {
		obs, err := r.s.callTarget(ctx, c, method, params, owner)
		if after, ok := retryable(err); ok && time.Now().Add(after).Before(deadline) {
			if err := sleep(ctx, max(after, r.s.cfg.PollInterval)); err != nil {
				r.fatalf("%s: %v", what, err)
			}
			continue
		}
		if err != nil {
			r.fatalf("%s: %s", what, describeErr(err))
		}
		return obs
	}
}

func getParams(ref controller.TargetRef) controller.TargetParams {
	return controller.TargetParams{Target: ref}
}

// closeUntilClosed sends target/close until it answers closed, as the
// runtime does, and returns the closed observation. Every answer must be
// closing or closed.
func (s *suite) closeUntilClosed(ctx context.Context, c *conn, ref controller.TargetRef) (controller.Observation, error) {
	deadline := time.Now().Add(s.cfg.SettleTimeout)
	for {
		obs, err := s.callTarget(ctx, c, controller.MethodTargetClose, getParams(ref), ref.Owner)
		if err != nil {
			return obs, err
		}
		switch obs.Phase {
		case controller.PhaseClosed:
			return obs, nil
		case controller.PhaseClosing:
		default:
			return obs, fmt.Errorf("target/close answered phase %s; a close answers closing or closed", obs.Phase)
		}
		if time.Now().After(deadline) {
			return obs, fmt.Errorf("target/close still answers closing after %s", s.cfg.SettleTimeout)
		}
		if err := sleep(ctx, s.cfg.PollInterval); err != nil {
			return obs, err
		}
	}
}

// retryable says err is the contract's retryable unavailable, carrying
// its retryAfterMs, and how long it asks the caller to wait.
func retryable(err error) (time.Duration, bool) {
	var e *jsonrpc.Error
	if !errors.As(err, &e) || e.Kind != jsonrpc.KindUnavailable || e.RetryAfterMs == nil {
		return 0, false
	}
	// A minute at most: a longer wait would outlast any settle timeout.
	return time.Duration(min(*e.RetryAfterMs, 60_000)) * time.Millisecond, true
}

// waitActive follows target/get until the owner's target is active, and
// checks every observation on the way: strictly decoded, the owner echoed,
// the same target id, and no phase a healthy create never passes through.
func (r *checkRun) waitActive(ctx context.Context, c *conn, ref controller.TargetRef, targetID string) controller.Observation {
	obs, _ := r.waitActiveOr(ctx, c, ref, targetID, false)
	return obs
}

// waitActiveOr is waitActive for a target its provider may close on its
// own soon after it is active (an idle policy's short closeAfterMs): with
// closes, a close (closing, closed or notFound) seen before any poll saw
// it active ends the wait too, and closed says so. A poll answered slowly
// by a loaded provider can miss an active phase of two seconds whole.
func (r *checkRun) waitActiveOr(ctx context.Context, c *conn, ref controller.TargetRef, targetID string, closes bool) (_ controller.Observation, closed bool) {
	deadline := time.Now().Add(r.s.cfg.SettleTimeout)
	polls := 0
	for {
		polls++
		obs, err := r.s.callTarget(ctx, c, controller.MethodTargetGet, getParams(ref), ref.Owner)
		if rpcErr := (*jsonrpc.Error)(nil); closes && errors.As(err, &rpcErr) && rpcErr.Kind == jsonrpc.KindNotFound {
			return controller.Observation{}, true
		}
		if after, ok := retryable(err); ok && time.Now().Add(after).Before(deadline) {
			// The contract's unavailable is retryable, after its
			// retryAfterMs: the runtime asks again, and so does this poll.
			if err := sleep(ctx, max(after, r.s.cfg.PollInterval)); err != nil {
				r.fatalf("waiting for active: %v", err)
			}
			continue
		}
		if err != nil {
			r.fatalf("target/get while waiting for the target to become active (poll %d): %s", polls, describeErr(err))
		}
		if targetID != "" && obs.TargetID != "" && obs.TargetID != targetID {
			r.fatalf("target/get observed target id %q, but target/create answered %q", obs.TargetID, targetID)
		}
		switch obs.Phase {
		case controller.PhaseActive:
			if obs.TargetID == "" {
				r.fatalf("an active observation carries no targetId")
			}
			return obs, false
		case controller.PhaseProvisioning, controller.PhaseUnknown:
		case controller.PhaseClosing, controller.PhaseClosed:
			if closes {
				return obs, true
			}
			r.fatalf("the target went %s while it was being created (message: %q)", obs.Phase, obs.Message)
		default:
			r.fatalf("the target went %s while it was being created (message: %q)", obs.Phase, obs.Message)
		}
		if time.Now().After(deadline) {
			r.fatalf("the target is still %s after %s of polling target/get (%d polls; message %q)", obs.Phase, r.s.cfg.SettleTimeout, polls, obs.Message)
		}
		if err := sleep(ctx, r.s.cfg.PollInterval); err != nil {
			r.fatalf("waiting for active: %v", err)
		}
	}
}

// createActive creates a target for a new owner and waits until it is active.
func (r *checkRun) createActive(ctx context.Context, c *conn, label string) (controller.Owner, controller.Observation) {
	return r.createActiveFrom(ctx, c, label, r.template(ctx).id)
}

// createActiveFrom is createActive from the named template.
func (r *checkRun) createActiveFrom(ctx context.Context, c *conn, label, templateID string) (controller.Owner, controller.Observation) {
	return r.createActiveAs(ctx, c, r.owner(label), templateID)
}

// createActiveAs is createActive for an owner the check registered.
func (r *checkRun) createActiveAs(ctx context.Context, c *conn, owner controller.Owner, templateID string) (controller.Owner, controller.Observation) {
	first := r.mustTarget(ctx, c, "target/create", controller.MethodTargetCreate,
		controller.CreateParams{Owner: owner, TemplateID: templateID}, owner)
	obs := r.waitActive(ctx, c, controller.TargetRef{Owner: owner}, first.TargetID)
	return owner, obs
}

// sleep is clock.Sleep for the suite's polls, which end with the
// context's error.
func sleep(ctx context.Context, d time.Duration) error {
	if !clock.Sleep(ctx, d) {
		return ctx.Err()
	}
	return nil
}

// templateChoice is the template the suite creates targets from, and a
// deprecated one when template/list offers any.
type templateChoice struct {
	id         string
	deprecated string
	// powerStates are the states id's template offers target/setPower.
	powerStates []controller.Power
	// ingress serves public ingress and private does not (both not
	// deprecated); empty when template/list offers none.
	ingress, private string
}

// template picks the template once per run: the configured one, or the
// first non-deprecated one template/list offers. It ends the check when
// there is none.
func (r *checkRun) template(ctx context.Context) templateChoice {
	t, err := r.s.template(ctx)
	if err != nil {
		r.fatalf("cannot choose a template: %v", err)
	}
	return t
}

func (s *suite) template(ctx context.Context) (templateChoice, error) {
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	if s.tmpl != nil {
		return *s.tmpl, nil
	}
	c, _, err := s.open(ctx, "template")
	if err != nil {
		return templateChoice{}, err
	}
	defer c.close()
	var list controller.TemplateListResult
	if err := c.call(ctx, controller.MethodTemplateList, controller.TemplateListParams{UniverseID: s.cfg.UniverseID}, &list); err != nil {
		return templateChoice{}, fmt.Errorf("template/list: %s", describeErr(err))
	}
	var choice templateChoice
	for _, t := range list.Templates {
		if t.Deprecated && choice.deprecated == "" {
			choice.deprecated = t.TemplateID
		}
		if !t.Deprecated && t.PublicIngress && choice.ingress == "" {
			choice.ingress = t.TemplateID
		}
		if !t.Deprecated && !t.PublicIngress && choice.private == "" {
			choice.private = t.TemplateID
		}
		if s.cfg.TemplateID != "" {
			if t.TemplateID == s.cfg.TemplateID {
				if t.Deprecated {
					return templateChoice{}, fmt.Errorf("the template %q is deprecated and creates no targets; name another", t.TemplateID)
				}
				choice.id, choice.powerStates = t.TemplateID, t.PowerStates
			}
		} else if !t.Deprecated && choice.id == "" {
			choice.id, choice.powerStates = t.TemplateID, t.PowerStates
		}
	}
	if choice.id == "" {
		if s.cfg.TemplateID != "" {
			return templateChoice{}, fmt.Errorf("template/list for universe %s does not offer the template %q", s.cfg.UniverseID, s.cfg.TemplateID)
		}
		return templateChoice{}, fmt.Errorf("template/list for universe %s offers no template that is not deprecated", s.cfg.UniverseID)
	}
	s.tmpl = &choice
	return choice, nil
}
