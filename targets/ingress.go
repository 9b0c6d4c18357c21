package targets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// Public ingress state is on the instance like every other intent (the
// record's Ingress fields). The label is drawn once, at the first ensure,
// and kept for the target's life (a remove keeps it), so a target's
// endpoint never changes. It is not secret from the guest, which may well
// want to know its own public URL. The port is the guest port the edge
// reaches, taken from the template at the ensure, so a route does not
// change under a target when the templates file does.

// IngressRoute is where the edge sends a routed label's requests.
type IngressRoute struct {
	Instance string
	Owner    controller.Owner
	Port     int
	// Location is the cluster member that holds the instance, for the
	// GuestDialer ("" or "none" on a standalone Incus).
	Location string
}

// ingressOf reads a routed target's route off its instance; ok is false
// unless it is routed, ours, and not closing.
func ingressOf(inst *incus.Instance) (label string, r IngressRoute, ok bool) {
	// Most instances are not routed: that is read first, alone.
	if !recordOf(inst.Config, fIngressRouted).IngressRouted {
		return "", IngressRoute{}, false
	}
	rec := recordOf(inst.Config, fClosing|fIngressLabel|fIngressPort|fOwned)
	if rec.has(fClosing) {
		return "", IngressRoute{}, false
	}
	owner, ours := rec.owner(inst.Name)
	if !ours || !ingressurl.Valid(rec.IngressLabel) || rec.IngressPort == 0 {
		return "", IngressRoute{}, false
	}
	return rec.IngressLabel, IngressRoute{Instance: inst.Name, Owner: owner, Port: rec.IngressPort, Location: inst.Location}, true
}

// ingressIndex is the edge's map of labels to routes, kept in memory so
// that a request costs no Incus call. This process changes it on every
// ensure, remove and close at once; a reconcile pass rebuilds it from
// Incus's list (which is how a restart, or another replica's change, is
// learnt), except for names this process changed after that list was asked
// for, and names the list itself says it may show from before a change
// (the observation cache's entries whose re-read has not landed): either
// may predate this process's own write, and would undo it until the next
// pass.
type ingressIndex struct {
	mu      sync.RWMutex
	byLabel map[string]IngressRoute
	labelOf map[string]string // instance → its routed label
	seq     uint64
	changed map[string]uint64 // instance → seq of the last change known apart from a list
	// wrote is when this process last began a write of each instance's
	// route (ensure, remove): a cached record read before then may
	// predate that write, and is not taken over it (see observe).
	wrote map[string]time.Time
}

func (x *ingressIndex) init() {
	x.byLabel, x.labelOf, x.changed = map[string]IngressRoute{}, map[string]string{}, map[string]uint64{}
	x.wrote = map[string]time.Time{}
}

func (x *ingressIndex) lookup(label string) (IngressRoute, bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	r, ok := x.byLabel[label]
	return r, ok
}

// mark is the sequence a list about to be asked for is compared with.
func (x *ingressIndex) mark() uint64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.seq
}

func (x *ingressIndex) dropLocked(name string) {
	if l, ok := x.labelOf[name]; ok {
		delete(x.byLabel, l)
		delete(x.labelOf, name)
	}
}

func (x *ingressIndex) put(label string, r IngressRoute) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.seq++
	x.changed[r.Instance] = x.seq
	x.dropLocked(r.Instance)
	x.byLabel[label], x.labelOf[r.Instance] = r, label
}

func (x *ingressIndex) drop(name string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.seq++
	x.changed[name] = x.seq
	x.dropLocked(name)
}

// wrote records that a write of name's route began at began: see observe.
func (x *ingressIndex) writing(name string, began time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.wrote[name] = began
}

// closing takes name's route out as this process is about to record a
// close: the edge answers 404 from now on, and a cached record read before
// the write (still routed) does not put the route back.
func (x *ingressIndex) closing(name string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.seq++
	x.changed[name] = x.seq
	x.wrote[name] = time.Now()
	x.dropLocked(name)
}

// wroteKept bounds how long a write's start is kept: a re-read begun
// after it comes within milliseconds.
const wroteKept = time.Minute

// observe takes what the cache read of an instance, in a read begun at
// readAt (inst nil: gone), as its route. A record read before this process
// began its own last write of the route may predate that write and is not
// taken; any read begun after it shows the write (Incus answered it
// applied) or a later one, another replica's included, and the write's
// own event brings such a read. Like a change of this process's, it
// outranks a list asked for before it.
func (x *ingressIndex) observe(name string, inst *incus.Instance, readAt time.Time) {
	label, r, routed := "", IngressRoute{}, false
	if inst != nil {
		label, r, routed = ingressOf(inst)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if at, ok := x.wrote[name]; ok && inst != nil {
		if readAt.Before(at) {
			return
		}
		delete(x.wrote, name)
	}
	if was, ok := x.labelOf[name]; ok == routed && was == label && x.byLabel[was] == r {
		return // no news
	}
	if other, taken := x.byLabel[label]; routed && taken && other.Instance != name {
		return // a label copied onto another instance: the first keeps it
	}
	x.seq++
	x.changed[name] = x.seq
	x.dropLocked(name)
	if routed {
		x.byLabel[label], x.labelOf[name] = r, label
	}
}

// rebuild replaces what the list shows, for every name this process has
// not changed since mark answered since and that is not stale in it.
func (x *ingressIndex) rebuild(list []incus.Instance, since uint64, stale map[string]bool) {
	routes := map[string]IngressRoute{}
	for i := range list {
		if label, r, ok := ingressOf(&list[i]); ok {
			routes[label] = r
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	fresh := func(name string) bool { return x.changed[name] > since || stale[name] }
	for name := range x.labelOf {
		if !fresh(name) {
			x.dropLocked(name)
		}
	}
	for label, r := range routes {
		if fresh(r.Instance) {
			continue
		}
		if other, taken := x.byLabel[label]; taken && other.Instance != r.Instance {
			continue // a label copied onto another instance: the first keeps it
		}
		x.byLabel[label], x.labelOf[r.Instance] = r, label
	}
	for name, at := range x.changed {
		if at <= since && !stale[name] {
			delete(x.changed, name)
		}
	}
	for name, at := range x.wrote {
		if time.Since(at) >= wroteKept {
			delete(x.wrote, name)
		}
	}
}

// IngressEnabled says whether this service routes public ingress (an edge
// base is configured).
func (s *Service) IngressEnabled() bool { return s.cfg.IngressBase != nil }

// IngressLookup is the edge's host-to-target map: the route of a routed
// label, from memory alone.
func (s *Service) IngressLookup(label string) (IngressRoute, bool) { return s.ingress.lookup(label) }

// refreshIngress rebuilds the index from a list asked for after since, in
// which the stale names may show an older state.
func (s *Service) refreshIngress(list []incus.Instance, since uint64, stale map[string]bool) {
	if s.IngressEnabled() {
		s.ingress.rebuild(list, since, stale)
	}
}

// followIngress keeps the edge's index true to what the observation cache
// learns of each instance between reconcile passes, so that another
// replica's ensure, remove or close reaches this replica's edge as soon as
// Incus's event does, not at the next pass.
func (s *Service) followIngress(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case name := <-s.ingressChanges.ch():
			// Not known: the entry waits for its re-read (which tells
			// again) or the cache is unconfirmed (its next list and the
			// passes rebuild the index).
			if inst, readAt, known := s.cache.peek(name); known {
				s.ingress.observe(name, inst, readAt)
			}
		}
	}
}

// withIngress adds the endpoint to the observation of a routed target.
func (s *Service) withIngress(inst *incus.Instance, o controller.Observation) controller.Observation {
	if !s.IngressEnabled() || o.Phase == controller.PhaseClosing || o.Phase == controller.PhaseClosed {
		return o
	}
	if label, _, ok := ingressOf(inst); ok {
		o.Ingress = &controller.Ingress{Endpoint: s.cfg.IngressBase.Endpoint(label)}
	}
	return o
}

// EnsureIngress routes the template's public ingress to the target, with
// the label it keeps for life. Idempotent: a routed target is observed.
func (s *Service) EnsureIngress(ctx context.Context, ref controller.TargetRef) (controller.Observation, error) {
	return s.changeIngress(ctx, ref, true)
}

// RemoveIngress stops routing public ingress to a target that stays; its
// label is kept, so a later ensure answers the same endpoint. Idempotent.
func (s *Service) RemoveIngress(ctx context.Context, ref controller.TargetRef) (controller.Observation, error) {
	return s.changeIngress(ctx, ref, false)
}

func (s *Service) changeIngress(ctx context.Context, ref controller.TargetRef, route bool) (controller.Observation, error) {
	if !s.IngressEnabled() {
		return controller.Observation{}, jsonrpc.CapabilityUnavailable("ingress", "This provider serves no public ingress: no edge is configured.")
	}
	ctx, cancel := s.budget(ctx)
	defer cancel()
	name, inst, err := s.resolveWith(ctx, ref, s.readFor(ref.Owner))
	if err != nil {
		return controller.Observation{}, err
	}
	if inst == nil {
		return controller.Observation{}, notHeld()
	}
	unlock, err := s.lockTarget(ctx, name)
	if err != nil {
		return controller.Observation{}, err
	}
	defer unlock()
	s.ingress.writing(name, time.Now())
	cur, err := s.patchIf(ctx, name, func(cur *incus.Instance) (change, error) {
		if unreadable(cur) {
			return change{}, jsonrpc.Unavailable(retryAfter, "Incus cannot read this target now (its cluster member does not answer); retry shortly.")
		}
		if err := checkOwned(cur, ref.Owner); err != nil {
			return change{}, err
		}
		if StateOf(cur).Phase == controller.PhaseClosing {
			// The target still exists, so notFound (final for the
			// runtime) would be untrue; nothing is routed to it, and the
			// observation says why: it is closing, without an endpoint.
			return change{}, nil
		}
		rec := recordOf(cur.Config, fTemplate|fIngressLabel|fIngressRouted|fIngressPort)
		if !route {
			if !rec.has(fIngressRouted) {
				return change{}, nil
			}
			return change{keys: fIngressRouted}, nil // to not routed: removed
		}
		tmpl, ok := s.catalog.Load().Get(rec.Template)
		if !ok || !tmpl.Wire.PublicIngress {
			return change{}, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "ingressUnsupported",
				"The target's template %q does not serve public ingress; template/list says which do (publicIngress).", rec.Template)
		}
		var set change
		if !ingressurl.Valid(rec.IngressLabel) {
			set.keys |= fIngressLabel
			set.to.IngressLabel = ingressurl.NewLabel()
		}
		if !rec.IngressRouted {
			set.keys |= fIngressRouted
			set.to.IngressRouted = true
		}
		if rec.IngressPort != tmpl.IngressPort {
			set.keys |= fIngressPort
			set.to.IngressPort = tmpl.IngressPort
		}
		return set, nil
	})
	switch {
	case errors.Is(err, errGone):
		return controller.Observation{}, notHeld()
	case err != nil:
		var rpcErr *jsonrpc.Error
		if errors.As(err, &rpcErr) {
			return controller.Observation{}, err
		}
		return controller.Observation{}, s.incusError("recording public ingress", err)
	}
	if label, r, ok := ingressOf(cur); ok {
		s.ingress.put(label, r)
	} else {
		s.ingress.drop(name)
	}
	return s.observe(cur, ref.Owner), nil
}

// patchIf writes the change decide answers (empty: nothing to write) to the
// instance as read, conditional on its ETag, reading again when another
// writer came first. It answers the instance as written. The reads and the
// write hold the instance's turn (owner.go).
func (s *Service) patchIf(ctx context.Context, name string, decide func(*incus.Instance) (change, error)) (*incus.Instance, error) {
	var inst *incus.Instance
	err := s.owned(ctx, name, func(ctx context.Context) error {
		var err error
		inst, err = s.patchIfHeld(ctx, name, decide)
		return err
	})
	return inst, err
}

func (s *Service) patchIfHeld(ctx context.Context, name string, decide func(*incus.Instance) (change, error)) (*incus.Instance, error) {
	for attempt := 0; ; attempt++ {
		inst, etag, err := s.incus.GetInstance(ctx, name)
		if errors.Is(err, incus.ErrNotFound) {
			return nil, errGone
		}
		if err != nil {
			return nil, err
		}
		c, err := decide(inst)
		if err != nil || c.empty() {
			return inst, err
		}
		set := c.config()
		err = s.incus.PatchInstanceConfigIf(ctx, name, set, etag)
		s.listingChanged()
		if err == nil {
			written := *inst
			written.Config = maps.Clone(inst.Config)
			applyPatch(written.Config, set)
			return &written, nil
		}
		// Another writer came first (or Incus rewrote volatile keys), or an
		// operation holds the instance: read again shortly, within ctx.
		if (!errors.Is(err, incus.ErrPreconditionFailed) && !errors.Is(err, incus.ErrBusy)) || attempt >= 12 {
			return nil, fmt.Errorf("write %d config keys: %w", len(set), err)
		}
		if !clock.Sleep(ctx, min(5*time.Millisecond<<attempt, 200*time.Millisecond)) {
			return nil, fmt.Errorf("write %d config keys: %w", len(set), ctx.Err())
		}
	}
}
