package conformance_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// flaw makes the fake wrong on purpose, to show the suite can fail.
type flaw int

const (
	correct flaw = iota
	// newTargetPerCreate hands out a fresh target on every create.
	newTargetPerCreate
	// ignoreOwners serves any target to whoever names its id.
	ignoreOwners
	// getCreates creates a target when target/get finds none.
	getCreates
	// closeForgets answers a repeated close with notFound.
	closeForgets
	// activeWithoutPower leaves power out of active observations.
	activeWithoutPower
	// ftpIngress reports an ingress endpoint that is not http or https.
	ftpIngress
	// unavailableOnce answers a provisioning target's first get with the
	// contract's retryable unavailable, as a provider whose Incus did not
	// answer in time does: no flaw, and the suite must ask again.
	unavailableOnce
	// createUnavailableOnce answers an owner's repeated create with
	// unavailable once, as a provider whose Incus did not answer the
	// owner's lookup in time: no flaw either.
	createUnavailableOnce
	// powerAnyState moves a target to a state its template does not offer.
	powerAnyState
	// powerNeverMoves answers setPower and never carries it out.
	powerNeverMoves
	// powerMovesClosing moves a closing target's power.
	powerMovesClosing
	// powerless serves no power: no flaw, and the controller does not
	// advertise it.
	powerless
	// closingWithoutID leaves targetId out of closing observations.
	closingWithoutID
	// deprecatedCreates creates targets from a deprecated template.
	deprecatedCreates
	// slowGet answers target/get after 300 ms.
	slowGet
	// templatesRepeated lists one templateId twice.
	templatesRepeated
	// ingressSticks keeps a target routed after ingress/remove.
	ingressSticks
	// ingressless serves no ingress: no flaw, and the controller does not
	// advertise it.
	ingressless
	// idleIgnoresRelays powers an idle target down with a relay open.
	idleIgnoresRelays
	// idleIgnoresProcesses counts idleness from the last use alone, as if
	// running processes did not hold the daemon's idle clock at zero.
	idleIgnoresProcesses
	// idleNever applies no idle policy.
	idleNever
	// idleCloseFails reports a target it closed for idleness as failed.
	idleCloseFails
	// idleClosesAtCreate closes a target whose policy closes at all as it
	// is created, before any idleness could have passed.
	idleClosesAtCreate
	// idlePausesAtCreate powers a target whose policy powers down at all
	// down as it is created, before any idleness could have passed.
	idlePausesAtCreate
	// activeAfterIdle is no flaw: a target turns active only once its
	// policy's power-down has fallen due, and is powered down as it does,
	// as a loaded provider's polls can first see it.
	activeAfterIdle
)

// fakeBackend is an in-memory controller.Backend: a target is provisioning
// for its first two observations, then active and running; a close makes it
// closing, and the next close or get removes it.
type fakeBackend struct {
	flaw  flaw
	route routeFlaw
	// ingressBase is the fake server's http:// URL (set by serve).
	ingressBase string

	mu      sync.Mutex
	next    int
	byOwner map[controller.Owner]*fakeTarget
	byID    map[string]*fakeTarget
}

type fakeTarget struct {
	id      string
	owner   controller.Owner
	phase   controller.Phase
	power   controller.Power // while active; running when empty
	moving  controller.Power // a setPower not carried out yet
	states  []controller.Power
	public  bool   // its template serves public ingress
	routed  string // its ingress endpoint while routed
	seen    int
	refused bool // unavailableOnce, createUnavailableOnce: it was answered unavailable once

	// The stand-in daemon's idle clock, and the relays open to it.
	idle      *idlepolicy.Policy
	lastUse   time.Time
	busyUntil time.Time // a process started with sleep runs until then
	relays    int
}

func newFake(f flaw) *fakeBackend {
	return &fakeBackend{flaw: f, byOwner: map[controller.Owner]*fakeTarget{}, byID: map[string]*fakeTarget{}}
}

var fakeTemplates = []controller.Template{
	{TemplateID: "old", DisplayName: "Retired template", Deprecated: true},
	{TemplateID: "small", DisplayName: "Small target", PowerStates: []controller.Power{controller.PowerRunning, controller.PowerStopped}},
	{TemplateID: "web", DisplayName: "Web target", PublicIngress: true},
}

func (f *fakeBackend) ListTemplates(context.Context, string) ([]controller.Template, error) {
	if f.flaw == templatesRepeated {
		return append(slices.Clone(fakeTemplates), fakeTemplates[1]), nil
	}
	return fakeTemplates, nil
}

func (f *fakeBackend) observe(t *fakeTarget, owner controller.Owner) controller.Observation {
	o := controller.Observation{TargetID: t.id, Owner: owner, Phase: t.phase}
	if t.phase == controller.PhaseClosing && f.flaw == closingWithoutID {
		o.TargetID = ""
	}
	if t.phase == controller.PhaseActive && f.flaw != activeWithoutPower {
		o.Power = controller.PowerRunning
		if t.power != "" {
			o.Power = t.power
		}
		if t.moving != "" {
			o.Message = "Moving to " + string(t.moving) + "."
		}
	}
	if t.routed != "" && (t.phase == controller.PhaseActive || t.phase == controller.PhaseClosing) {
		o.Ingress = &controller.Ingress{Endpoint: t.routed}
	}
	if t.phase == controller.PhaseActive && f.flaw == ftpIngress {
		o.Ingress = &controller.Ingress{Endpoint: "ftp://acorn.env.example.com"}
	}
	return o
}

func (f *fakeBackend) create(owner controller.Owner, tmpl *controller.Template) *fakeTarget {
	f.next++
	t := &fakeTarget{id: fmt.Sprintf("fake-%d", f.next), owner: owner, phase: controller.PhaseProvisioning}
	if tmpl != nil {
		t.states, t.public = tmpl.PowerStates, tmpl.PublicIngress
	}
	f.byOwner[owner] = t
	f.byID[t.id] = t
	return t
}

func (f *fakeBackend) remove(t *fakeTarget) {
	delete(f.byOwner, t.owner)
	delete(f.byID, t.id)
}

func (f *fakeBackend) CreateTarget(_ context.Context, p controller.CreateParams) (controller.Observation, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t := f.byOwner[p.Owner]; t != nil && f.flaw != newTargetPerCreate {
		if f.flaw == createUnavailableOnce && !t.refused {
			t.refused = true
			return controller.Observation{}, jsonrpc.Unavailable(150, "Incus did not answer while looking up the owner's target; retry shortly.")
		}
		return f.observe(t, p.Owner), nil
	}
	var tmpl *controller.Template
	for i := range fakeTemplates {
		if fakeTemplates[i].TemplateID == p.TemplateID {
			tmpl = &fakeTemplates[i]
		}
	}
	if tmpl == nil {
		return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "No template %q.", p.TemplateID)
	}
	if tmpl.Deprecated && f.flaw != deprecatedCreates {
		return controller.Observation{}, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "templateDeprecated", "The template %q is deprecated.", p.TemplateID)
	}
	t := f.create(p.Owner, tmpl)
	t.idle, t.lastUse = p.Idle, time.Now()
	if f.flaw == idleClosesAtCreate && p.Idle != nil && p.Idle.CloseAfterMs != nil {
		t.phase = controller.PhaseClosing
	}
	if f.flaw == idlePausesAtCreate && p.Idle != nil {
		if down, ok := dueDown(*p.Idle, t.states, time.Duration(math.MaxInt64)); ok {
			t.power = down
		}
	}
	return f.observe(t, p.Owner), nil
}

// idleFor is the stand-in daemon's env/getIdle: zero while a process
// runs, else the time since the last use or the last process's end.
func (t *fakeTarget) idleFor(now time.Time) time.Duration {
	if now.Before(t.busyUntil) {
		return 0
	}
	return now.Sub(later(t.lastUse, t.busyUntil))
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// runIdle is the fake's idle loop: every few milliseconds, an active
// target that relays no connection and whose policy's close is due is
// closed; a running one whose power-down is due is powered down (f.flaw
// bends the rules).
func (f *fakeBackend) runIdle(ctx context.Context) {
	if f.flaw == idleNever {
		return
	}
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			f.mu.Lock()
			for _, t := range f.byID {
				if t.idle == nil || t.phase != controller.PhaseActive {
					continue
				}
				if t.relays > 0 && f.flaw != idleIgnoresRelays {
					continue
				}
				idle := t.idleFor(now)
				if f.flaw == idleIgnoresProcesses {
					idle = now.Sub(t.lastUse)
				}
				if c := t.idle.CloseAfterMs; c != nil && uint64(idle.Milliseconds()) >= *c {
					t.phase, t.routed = controller.PhaseClosing, ""
					if f.flaw == idleCloseFails {
						t.phase = controller.PhaseFailed
					}
					continue
				}
				if t.power != "" && t.power != controller.PowerRunning {
					continue
				}
				if p, due := dueDown(*t.idle, t.states, idle); due {
					t.power, t.moving = p, ""
				}
			}
			f.mu.Unlock()
		}
	}
}

// dueDown is the power-down policy asks of a target idle for that long,
// among the states it offers.
func dueDown(policy idlepolicy.Policy, states []controller.Power, idle time.Duration) (controller.Power, bool) {
	ms := uint64(idle.Milliseconds())
	for _, s := range []struct {
		after *uint64
		power controller.Power
	}{{policy.StopAfterMs, controller.PowerStopped}, {policy.SuspendAfterMs, controller.PowerSuspended}, {policy.PauseAfterMs, controller.PowerPaused}} {
		if s.after != nil && ms >= *s.after && slices.Contains(states, s.power) {
			return s.power, true
		}
	}
	return "", false
}

// resolve finds the target a reference names; nil when there is none.
func (f *fakeBackend) resolve(ref controller.TargetRef) (*fakeTarget, error) {
	if ref.TargetID != "" {
		if t := f.byID[ref.TargetID]; t != nil {
			if t.owner != ref.Owner && f.flaw != ignoreOwners {
				return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "ownerMismatch", "The target %s is another owner's.", t.id)
			}
			return t, nil
		}
	}
	return f.byOwner[ref.Owner], nil
}

func (f *fakeBackend) GetTarget(_ context.Context, ref controller.TargetRef) (controller.Observation, error) {
	if f.flaw == slowGet {
		time.Sleep(300 * time.Millisecond)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.resolve(ref)
	if err != nil {
		return controller.Observation{}, err
	}
	if t == nil && ref.TargetID == "" && f.flaw == getCreates {
		t = f.create(ref.Owner, nil)
	}
	if t == nil || (ref.TargetID != "" && t.id != ref.TargetID) {
		return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "No target for this owner.")
	}
	if f.flaw == unavailableOnce && t.phase == controller.PhaseProvisioning && !t.refused {
		t.refused = true
		return controller.Observation{}, jsonrpc.Unavailable(150, "Incus did not answer in time; retry shortly.")
	}
	t.seen++
	if t.moving != "" && f.flaw != powerNeverMoves {
		t.power, t.moving = t.moving, ""
	}
	switch {
	case t.phase == controller.PhaseProvisioning && f.flaw == activeAfterIdle && t.idle != nil:
		if down, due := dueDown(*t.idle, t.states, t.idleFor(time.Now())); due {
			t.phase, t.power = controller.PhaseActive, down
		}
	case t.phase == controller.PhaseProvisioning && t.seen >= 2:
		t.phase = controller.PhaseActive
	case t.phase == controller.PhaseClosing:
		f.remove(t)
		t.phase = controller.PhaseClosed
	}
	return f.observe(t, ref.Owner), nil
}

func (f *fakeBackend) CloseTarget(_ context.Context, ref controller.TargetRef) (controller.Observation, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.resolve(ref)
	if err != nil {
		return controller.Observation{}, err
	}
	if t == nil {
		if f.flaw == closeForgets {
			return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "Nothing to close.")
		}
		return controller.Observation{Owner: ref.Owner, Phase: controller.PhaseClosed}, nil
	}
	if t.phase == controller.PhaseClosing {
		f.remove(t)
		t.phase = controller.PhaseClosed
	} else {
		t.phase = controller.PhaseClosing
	}
	t.routed = "" // a close takes public ingress away at once
	return f.observe(t, ref.Owner), nil
}

// held is the target ref names, or the error a method answers when there
// is none (f.mu held).
func (f *fakeBackend) held(ref controller.TargetRef) (*fakeTarget, error) {
	t, err := f.resolve(ref)
	if err != nil {
		return nil, err
	}
	if t == nil || (ref.TargetID != "" && t.id != ref.TargetID) {
		return nil, jsonrpc.Errorf(jsonrpc.KindNotFound, "No target for this owner.")
	}
	return t, nil
}

// SetPower records the move; the target's next observation by target/get
// carries it out.
func (f *fakeBackend) SetPower(_ context.Context, ref controller.TargetRef, p controller.Power) (controller.Observation, error) {
	if f.flaw == powerless {
		return controller.Observation{}, jsonrpc.CapabilityUnavailable("power", "Not served.")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.held(ref)
	if err != nil {
		return controller.Observation{}, err
	}
	if t.phase != controller.PhaseActive && f.flaw != powerMovesClosing {
		return controller.Observation{}, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "targetNotActive", "The target is %s.", t.phase)
	}
	if !slices.Contains(t.states, p) && f.flaw != powerAnyState {
		return controller.Observation{}, jsonrpc.InvalidParams("power", "The template does not offer %s.", p)
	}
	cur := t.power
	if cur == "" {
		cur = controller.PowerRunning
	}
	if p != cur && p != t.moving {
		t.moving = p
	}
	if t.phase != controller.PhaseActive {
		t.phase = controller.PhaseActive // the flaw: a closing target moved, and active again
	}
	return f.observe(t, ref.Owner), nil
}

// EnsureIngress routes a public-ingress target to an endpoint on the
// fake's own server, which answers 404 for every path: nothing is served
// behind a route here, and once it is removed the host plainly says so.
func (f *fakeBackend) EnsureIngress(_ context.Context, ref controller.TargetRef) (controller.Observation, error) {
	return f.ingress(ref, true)
}

func (f *fakeBackend) RemoveIngress(_ context.Context, ref controller.TargetRef) (controller.Observation, error) {
	return f.ingress(ref, false)
}

func (f *fakeBackend) ingress(ref controller.TargetRef, route bool) (controller.Observation, error) {
	if f.flaw == ingressless {
		return controller.Observation{}, jsonrpc.CapabilityUnavailable("ingress", "Not served.")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.held(ref)
	if err != nil {
		return controller.Observation{}, err
	}
	switch {
	case !route && f.flaw == ingressSticks:
	case !route:
		t.routed = ""
	case !t.public:
		return controller.Observation{}, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "ingressUnsupported", "The target's template serves no public ingress.")
	case t.phase == controller.PhaseActive:
		t.routed = f.ingressBase + "/unrouted/" + t.id
	}
	return f.observe(t, ref.Owner), nil
}

// live reports targets the fake still holds, for leak checks.
func (f *fakeBackend) live() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, t := range f.byID {
		out = append(out, t.id+" ("+string(t.phase)+")")
	}
	return out
}

// serve starts the controller endpoint over the fake on loopback and
// returns its ws:// URL.
func serve(t *testing.T, b controller.Backend, opts controller.Options) string {
	t.Helper()
	opts.Backend = b
	if f, ok := b.(*fakeBackend); ok {
		opts.Capabilities.Power = f.flaw != powerless
		opts.Capabilities.Ingress = f.flaw != ingressless
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	mux := http.NewServeMux()
	mux.Handle("/", controller.NewHandler(ctx, opts))
	if f, ok := b.(*fakeBackend); ok {
		idled := make(chan struct{})
		go func() {
			defer close(idled)
			f.runIdle(ctx)
		}()
		t.Cleanup(func() { cancel(); <-idled })
		mux.Handle("/routes/", &fakeRoutes{b: f, flaw: f.route, credential: opts.Credential})
		mux.Handle("/unrouted/", http.NotFoundHandler())
	}
	srv := httptest.NewServer(mux)
	if f, ok := b.(*fakeBackend); ok {
		f.mu.Lock()
		f.ingressBase = srv.URL
		f.mu.Unlock()
	}
	t.Cleanup(srv.Close)
	return "ws" + strings.TrimPrefix(srv.URL, "http") + "/control"
}

// serveUnix serves the endpoint on a unix socket and returns its unix:// URL.
func serveUnix(t *testing.T, b controller.Backend) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "lsconf")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	path := filepath.Join(dir, "control.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	mux := http.NewServeMux()
	mux.Handle("/control", controller.NewHandler(ctx, controller.Options{Backend: b}))
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		cancel()
		_ = srv.Close()
	})
	return "unix://" + path
}

// lenientProxy stands in front of a correct controller as a lenient one
// would read or answer: with rewrite, each client frame that encoding/json
// reads is passed on as encoding/json writes it back (a member named twice
// kept once, as its last; invalid UTF-8 and lone surrogates made U+FFFD);
// with echoMinusZero every answer to the id 0 says -0. It returns the
// proxy's ws:// URL.
func lenientProxy(t *testing.T, upstream string, rewrite, echoMinusZero bool) string {
	t.Helper()
	up := websocket.Upgrader{CheckOrigin: func(*http.Request) bool { return true }}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		header := http.Header{}
		if a := r.Header.Get("Authorization"); a != "" {
			header.Set("Authorization", a)
		}
		back, resp, err := websocket.DefaultDialer.DialContext(r.Context(), upstream, header)
		if resp != nil && resp.Body != nil {
			_ = resp.Body.Close()
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer back.Close()
		front, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer front.Close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				kind, data, err := back.ReadMessage()
				if err != nil {
					return
				}
				if echoMinusZero {
					data = bytes.Replace(data, []byte(`"id":0,`), []byte(`"id":-0,`), 1)
				}
				if front.WriteMessage(kind, data) != nil {
					return
				}
			}
		}()
		for {
			kind, data, err := front.ReadMessage()
			if err != nil {
				break
			}
			if rewrite && kind == websocket.TextMessage {
				dec := json.NewDecoder(bytes.NewReader(data))
				dec.UseNumber()
				var v any
				if dec.Decode(&v) == nil {
					if again, err := json.Marshal(v); err == nil {
						data = again
					}
				}
			}
			if back.WriteMessage(kind, data) != nil {
				break
			}
		}
		_ = back.Close()
		<-done
	}))
	t.Cleanup(srv.Close)
	return "ws" + strings.TrimPrefix(srv.URL, "http") + "/control"
}
