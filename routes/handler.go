package routes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/wake"
)

// Targets is what the data routes ask of the targets: *targets.Service.
type Targets interface {
	// ResolveRoute fences the route and reads the target (see
	// targets.Service.ResolveRoute).
	ResolveRoute(ctx context.Context, owner controller.Owner, targetID string) (targets.Route, error)
	// PowerDownPending says a power-down asked before at, recorded or
	// kept until Incus takes it, is not carried out yet: a dial made at
	// at replaces it through the wake.
	PowerDownPending(r targets.Route, at time.Time) bool
}

var _ Targets = (*targets.Service)(nil)

// Options configure the data routes. Zero values take the defaults.
type Options struct {
	Targets Targets
	// Wake is the process's one wake of each target, shared with the
	// public ingress: a dial that finds its target powered down joins it.
	Wake   *wake.Waker
	Dialer guest.Dialer
	// Relays is the process's relay registry, shared with the targets:
	// every dial and relay is entered in it.
	Relays     *relays.Registry
	Credential bearer.Credential
	Metrics    *Metrics
	Log        *zap.Logger
	// Prefix is the path data routes are served under (DefaultPrefix).
	Prefix string
	// Hold bounds a dial from its arrival to its upgrade or refusal
	// (default and most: MaxHold).
	Hold time.Duration
	// IdleTimeout closes a relay that carried no frame for this long
	// (default and least: MinIdleTimeout).
	IdleTimeout time.Duration
	// MaxHeld caps the dials held at once while targets wake (default 256).
	MaxHeld int

	// maxMessage overrides the message limit (tests only).
	maxMessage uint64
}

// DefaultMaxHeld is the default cap on dials held at once.
const DefaultMaxHeld = 256

// holdMargin is kept back from the hold for writing the answer, so that a
// refusal is never later than the hold bound.
const holdMargin = 100 * time.Millisecond

// Handler serves the data routes.
type Handler struct {
	opts    Options
	ctx     context.Context
	log     *zap.Logger
	metrics *Metrics
	reg     *relays.Registry
	wake    *wake.Waker
	guarded http.Handler
	relay   relayConfig
	// closed is closed once every relay got its going-away close at shutdown.
	closed chan struct{}

	held atomic.Int64
}

// New checks the options and builds the handler. ctx bounds everything it
// serves: when it ends, every relay is closed with a going-away frame.
func New(ctx context.Context, opts Options) (*Handler, error) {
	if opts.Targets == nil || opts.Wake == nil || opts.Dialer == nil || opts.Relays == nil {
		return nil, errors.New("routes: Targets, Wake, Dialer and Relays are required")
	}
	if opts.Prefix == "" {
		opts.Prefix = DefaultPrefix
	}
	if opts.Prefix[0] != '/' || opts.Prefix[len(opts.Prefix)-1] == '/' {
		return nil, fmt.Errorf("routes: prefix %q must start with / and not end with one", opts.Prefix)
	}
	switch {
	case opts.Hold == 0:
		opts.Hold = MaxHold
	case opts.Hold < 4*holdMargin || opts.Hold > MaxHold:
		return nil, fmt.Errorf("routes: hold %s is outside %s to %s", opts.Hold, 4*holdMargin, MaxHold)
	}
	switch {
	case opts.IdleTimeout == 0:
		opts.IdleTimeout = MinIdleTimeout
	case opts.IdleTimeout < MinIdleTimeout:
		return nil, fmt.Errorf("routes: relay idle timeout %s is below the protocol's floor of %s", opts.IdleTimeout, MinIdleTimeout)
	}
	if opts.MaxHeld <= 0 {
		opts.MaxHeld = DefaultMaxHeld
	}
	opts.Metrics.setHeldMax(opts.MaxHeld)
	if opts.Log == nil {
		opts.Log = zap.NewNop()
	}
	if opts.maxMessage == 0 {
		opts.maxMessage = jsonrpc.MaxMessageBytes
	}
	h := &Handler{
		opts:    opts,
		ctx:     ctx,
		log:     opts.Log,
		metrics: opts.Metrics,
		wake:    opts.Wake,
		relay: relayConfig{
			maxMessage: opts.maxMessage,
			idle:       opts.IdleTimeout,
			closeWait:  3 * time.Second,
			lockWait:   time.Second,
		},
	}
	h.reg = opts.Relays
	h.guarded = opts.Credential.Require(http.HandlerFunc(h.serve), func(*http.Request) {
		h.metrics.dial(OutcomeUnauthorized, 0)
	})
	h.closed = make(chan struct{})
	context.AfterFunc(ctx, func() {
		defer close(h.closed)
		h.reg.CloseEvery("the provider is shutting down", "shutdown")
	})
	return h, nil
}

// Closed is closed once the context given to New has ended and every relay
// open then has been sent its going-away close: a process waits on it before
// it exits, so the close frames are not lost to the exit.
func (h *Handler) Closed() <-chan struct{} { return h.closed }

// Prefix is the path the routes are served under.
func (h *Handler) Prefix() string { return h.opts.Prefix }

// ServeHTTP checks the credential (401 before anything else), then serves
// the route.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.guarded.ServeHTTP(w, r) }

func plainError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Cache-Control", "no-store")
	http.Error(w, msg, status)
}

func (h *Handler) serve(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	route, err := ParsePath(h.opts.Prefix, r.URL.EscapedPath())
	if err != nil {
		var pe *PathError
		errors.As(err, &pe)
		h.metrics.dial(OutcomeMalformed, time.Since(arrived))
		plainError(w, pe.Status, pe.Message)
		return
	}
	if status, msg := upgradeProblem(r); status != 0 {
		if status == http.StatusUpgradeRequired {
			w.Header().Set("Sec-WebSocket-Version", "13")
		}
		h.metrics.dial(OutcomeMalformed, time.Since(arrived))
		plainError(w, status, msg)
		return
	}
	ctx, cancel := context.WithDeadline(r.Context(), arrived.Add(h.opts.Hold-holdMargin))
	defer cancel()
	stop := context.AfterFunc(h.ctx, cancel)
	defer stop()

	link, ref, outcome := h.connect(ctx, route, arrived)
	if ref != nil {
		if r.Context().Err() != nil {
			outcome = OutcomeAborted
		}
		h.metrics.dial(outcome, time.Since(arrived))
		h.log.Debug("data route refused", zap.String("target", route.TargetID), zap.String("outcome", outcome),
			zap.String("state", string(ref.State)), zap.Duration("after", time.Since(arrived)))
		writeRefusal(w, ref)
		return
	}
	conn, early, err := acceptClient(w, r, arrived.Add(h.opts.Hold))
	if err != nil {
		link.close()
		h.metrics.dial(OutcomeAborted, time.Since(arrived))
		h.wake.Report(link.trace)
		return
	}
	if link.trace != nil {
		link.trace.Upgraded = time.Now()
	}
	rl := newRelay(link.instance, conn, link.conn, early, link.early, h.relay, h.metrics, func(rl *Relay) {
		if h.reg.Remove(rl.instance, rl) {
			h.metrics.relayClosed(rl.Reason())
		}
	})
	link.tk.Adopt(rl)
	h.metrics.relayOpened()
	h.metrics.dial(OutcomeUpgraded, time.Since(arrived))
	rl.start()
	h.wake.Report(link.trace)
	// The relay runs on its own goroutines: returning here lets the HTTP
	// server free this request's state, which an idle relay does not need.
}

// guestLink is an open WebSocket to a guest daemon, ready to relay.
type guestLink struct {
	instance string
	conn     net.Conn
	early    []byte
	tk       *relays.Ticket
	// trace is the flight's, when this dial started it and reports it.
	trace *wake.Trace
}

func (l *guestLink) close() {
	_ = l.conn.Close()
	l.tk.Leave()
}

// connect fences the route, wakes the target when it must, and opens the
// provider's WebSocket to its daemon; or it answers why not.
func (h *Handler) connect(ctx context.Context, route Route, arrived time.Time) (*guestLink, *wake.Refusal, string) {
	var (
		rt targets.Route
		tk *relays.Ticket
	)
	reread := false
	for tk == nil {
		var err error
		rt, err = h.opts.Targets.ResolveRoute(ctx, route.Owner, route.TargetID)
		if errors.Is(err, targets.ErrRouteGone) && route.TargetID == targets.Name(route.Owner) {
			// The owner's target is gone (closed): forget what was proved of it.
			h.wake.Gone(route.TargetID)
		}
		if ref, outcome := h.fenceRefusal(ctx, err, route.TargetID); ref != nil {
			return nil, ref, outcome
		}
		if !reread && !running(rt) && h.wake.Ready(rt.Name) {
			// Powered down, says the read, yet a wake proved the daemon
			// ready since the last power change this process saw: the
			// read is most likely older than that wake (a dial that came
			// with others, just after their wake), whose action made the
			// next read ask Incus. Read once more rather than wake again.
			reread = true
			continue
		}
		h.wake.Seen(rt.Name, rt.Observation.Phase == controller.PhaseActive && !running(rt))
		if ref, outcome := terminal(rt.Observation); ref != nil {
			return nil, ref, outcome
		}
		var quiet <-chan struct{}
		if tk, quiet = h.reg.Enter(rt.Name, arrived); tk != nil {
			break
		}
		// A power-down holds the target; wait for it, then look again.
		if !h.hold() {
			return nil, refuse(wake.StateWaking, time.Second), OutcomeShed
		}
		select {
		case <-quiet:
			h.unhold()
		case <-ctx.Done():
			h.unhold()
			return nil, refuse(wake.StateWaking, 2*time.Second), OutcomeWaking
		}
	}

	// A dial is a request for running: one that finds a power-down still
	// pending goes through the wake, which replaces it.
	downPending := h.opts.Targets.PowerDownPending(rt, arrived)
	if running(rt) && !downPending {
		if h.wake.Ready(rt.Name) {
			link, err := h.openGuest(ctx, rt, tk, nil)
			if err == nil {
				return link, nil, ""
			}
			h.log.Debug("a daemon proved ready did not take the relay; probing again", zap.String("instance", rt.Name), zap.Error(err))
			h.wake.Unready(rt.Name)
		}
	} else {
		h.wake.Unready(rt.Name)
	}

	if !h.hold() {
		f, _ := h.wake.Join(rt, arrived, false) // the wake starts all the same
		tk.Leave()
		ref := f.RefusalNow()
		return nil, &wake.Refusal{State: ref.State, RetryAfter: time.Second}, OutcomeShed
	}
	f, started := h.wake.Join(rt, arrived, true)
	select {
	case <-f.Settled():
		h.unhold()
	case <-ctx.Done():
		h.unhold()
		tk.Leave()
		if started {
			h.wake.Report(f.GiveUpTrace())
		}
		ref := f.RefusalNow()
		return nil, ref, outcomeOf(ref)
	}
	if ref := f.Result(); ref != nil {
		tk.Leave()
		return nil, ref, outcomeOf(ref)
	}
	var tr *wake.Trace
	if started {
		tr = f.Trace() // the flight is over: the trace is this dial's to report
	}
	link, err := h.openGuest(ctx, rt, tk, tr)
	if err != nil {
		h.wake.Report(tr)
		h.wake.Unready(rt.Name)
		tk.Leave()
		h.log.Debug("the daemon answered the probe but not the relay", zap.String("instance", rt.Name), zap.Error(err))
		return nil, refuse(wake.StateBooting, time.Second), OutcomeBooting
	}
	return link, nil, ""
}

func (h *Handler) hold() bool {
	if h.held.Add(1) > int64(h.opts.MaxHeld) {
		h.held.Add(-1)
		return false
	}
	h.metrics.heldAdd(1)
	return true
}

func (h *Handler) unhold() {
	h.held.Add(-1)
	h.metrics.heldAdd(-1)
}

// fenceRefusal turns a failed fence into its answer.
func (h *Handler) fenceRefusal(ctx context.Context, err error, instance string) (*wake.Refusal, string) {
	switch {
	case err == nil:
		return nil, ""
	case errors.Is(err, targets.ErrRouteOwner):
		return refuse(wake.StateGone, 0), OutcomeRefusedOwner
	case errors.Is(err, targets.ErrRouteGone):
		return refuse(wake.StateGone, 0), OutcomeGone
	}
	if ctx.Err() == nil {
		h.log.Warn("data route: Incus did not answer the fence", zap.Error(err))
	}
	if h.wake.LastDown(instance) {
		return refuse(wake.StateWaking, 2*time.Second), OutcomeUnavailable
	}
	return refuse(wake.StateBooting, 2*time.Second), OutcomeUnavailable
}

// terminal answers the phases no wait can change (wake.Terminal), and
// names the dial's outcome: a phase Incus cannot tell is its unavailability.
func terminal(o controller.Observation) (*wake.Refusal, string) {
	ref := wake.Terminal(o)
	switch {
	case ref == nil:
		return nil, ""
	case o.Phase == controller.PhaseUnknown:
		return ref, OutcomeUnavailable
	}
	return ref, outcomeOf(ref)
}

func outcomeOf(r *wake.Refusal) string {
	switch r.State {
	case wake.StateWaking:
		return OutcomeWaking
	case wake.StateBooting:
		return OutcomeBooting
	case wake.StateGone:
		return OutcomeGone
	case wake.StateFailed:
		return OutcomeFailed
	}
	return string(r.State)
}

// running says whether Incus shows the target's processes running (not
// frozen, not in a transition).
func running(r targets.Route) bool { return r.State == targets.RouteRunning }

// openGuest opens the provider's WebSocket to the target's daemon.
// A trace, when given, gets the dial's and the handshake's times.
func (h *Handler) openGuest(ctx context.Context, r targets.Route, tk *relays.Ticket, tr *wake.Trace) (*guestLink, error) {
	if tr != nil {
		tr.GuestDialStart = time.Now()
	}
	conn, err := h.opts.Dialer.DialContext(ctx, r.Daemon)
	if err != nil {
		return nil, err
	}
	if tr != nil {
		tr.GuestDialed = time.Now()
	}
	early, err := dialGuestWebSocket(ctx, conn)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	if tr != nil {
		tr.GuestUpgraded = time.Now()
	}
	return &guestLink{instance: r.Name, conn: conn, early: early, tk: tk, trace: tr}, nil
}
