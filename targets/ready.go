package targets

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"regexp"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// Ready spares: a template with warmState frozen or running keeps its
// spares started, and hands one out with no start and no rename (see
// docs/instant-handouts.md for the measurements behind the choice).
//
// A spare is created under a name of its own (lsr- and 20 random hex
// digits), started, and frozen (or left running); it records its template,
// its recipe and the replica that made it. Only that replica hands it out:
// a claim is an ETag-conditional PATCH, and Incus checks the ETag before it
// applies a write, not with it, so two replicas could both claim one spare.
// Within the replica, one hand-out at a time holds a spare (readyPool.take)
// and one writer at a time writes it (owned).
//
// The owner's lock stays the instance at the owner's name. A hand-out, under
// the owner's lock:
//
//  1. creates a stand-in there: an empty instance (source none, never
//     started) that records the owner and names the spare. Incus creates a
//     name at most once, so a cold create or another hand-out for the owner
//     that holds the name first makes this one fail, and the spare stays in
//     the pool;
//  2. claims the spare: the owner's metadata, the claim (the owner's name,
//     where the stand-in is) and the booted mark, the pool's keys taken off;
//  3. unfreezes it (a running spare needs nothing).
//
// The spare is then the owner's target, and its name the target's id. A
// lookup by owner reads the owner's name and follows a stand-in to its spare
// (follow): one more read of the observation cache.
//
// A kill between any two steps leaves one of these, each with one repair:
//
//   - a stand-in whose spare is unclaimed: the owner's next create claims
//     it (when this replica made it), or, once its hand-out's budget has
//     passed, deletes the stand-in and hands out another;
//   - a stand-in whose spare is gone, or claimed for another owner: the
//     stand-in is deleted (by the owner's create or close, or the survey);
//   - a claimed spare under no stand-in naming it: the survey closes it
//     once its claimant's budget has passed;
//   - a frozen spare claimed: the target is active and paused, with running
//     as its intent, and the reconciler unfreezes it.
//
// A close closes the spare and then deletes the stand-in, so closed still
// means nothing is left.

// readyPrefix starts every ready spare's name; readyPattern is the whole.
const readyPrefix = "lsr-"

var readyPattern = regexp.MustCompile(`^lsr-[0-9a-f]{20}$`)

// isReadyName says a name is a ready spare's, handed out or not.
func isReadyName(name string) bool { return readyPattern.MatchString(name) }

// newReadyName is a fresh spare's name: 80 random bits, as many as an
// owner's name has.
func newReadyName() string {
	b := make([]byte, 10)
	_, _ = rand.Read(b)
	return readyPrefix + hex.EncodeToString(b)
}

// standinOf is the spare a stand-in names ("": inst is no stand-in).
func standinOf(inst *incus.Instance) string { return recordOf(inst.Config, fStandin).Standin }

// readyPool is this replica's ready spares.
type readyPool struct {
	mu sync.Mutex
	// spares are the ready, unclaimed spares this replica made, by name.
	spares map[string]readySpare
	// filling are the spares this process is creating, by name.
	filling map[string]*templates.Template
	// taken are the spares a hand-out of this process holds.
	taken map[string]bool
	// named are the spares a stand-in named at the last survey: none is
	// handed out again until a survey finds it unnamed.
	named map[string]bool
	// met: a survey has listed a ready spare or a stand-in.
	met bool
	// left are the spares that left the pool through this process (handed
	// out, or found unusable), and when: a listing older than that still
	// shows them unclaimed, and a survey must not put them back.
	left map[string]time.Time
	// deferred is since when the refill has waited for hand-outs to end.
	deferred time.Time
}

// readyRefillPatience bounds how long the refill waits for hand-outs to
// end: under a steady stream of them, it refills anyway.
const readyRefillPatience = 3 * time.Second

type readySpare struct {
	template string
	member   string
}

func (p *readyPool) init() {
	p.spares, p.filling, p.taken, p.named = map[string]readySpare{}, map[string]*templates.Template{}, map[string]bool{}, map[string]bool{}
	p.left = map[string]time.Time{}
}

// consume takes a spare out of the pool for good; p.mu held.
func (p *readyPool) consume(name string) {
	delete(p.spares, name)
	p.left[name] = time.Now()
}

// take holds one ready spare of t for a hand-out; release gives it back
// (consumed: gone from the pool whatever the hand-out did with it).
func (p *readyPool) take(t *templates.Template) (name string, sp readySpare, release func(consumed bool), ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for n, sp := range p.spares {
		if sp.template != t.Wire.TemplateID || p.taken[n] || p.named[n] {
			continue
		}
		p.taken[n] = true
		return n, sp, p.releaser(n), true
	}
	return "", readySpare{}, nil, false
}

// releaser gives a held spare back; consumed takes it out of the pool.
func (p *readyPool) releaser(name string) func(consumed bool) {
	return func(consumed bool) {
		p.mu.Lock()
		delete(p.taken, name)
		if consumed {
			p.consume(name)
		}
		p.mu.Unlock()
	}
}

// count is how many spares of t are ready or being created.
func (p *readyPool) count(t *templates.Template) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for name, sp := range p.spares {
		if sp.template == t.Wire.TemplateID && !p.taken[name] {
			n++
		}
	}
	for _, ft := range p.filling {
		if ft.Wire.TemplateID == t.Wire.TemplateID {
			n++
		}
	}
	return n
}

// readyOffered says a template of the catalog keeps ready spares.
func (s *Service) readyOffered() bool {
	for _, t := range s.catalog.Load().All() {
		if t.Ready() {
			return true
		}
	}
	return false
}

// handoutReady gives the owner's name one ready spare of t: the stand-in,
// the claim and the unfreeze. The caller holds the owner's lock and has
// seen nothing at name. On warmHit, inst is the spare now the owner's
// target, as the hand-out wrote it.
func (s *Service) handoutReady(ctx context.Context, name string, p controller.CreateParams, t *templates.Template) (r handoutResult, inst *incus.Instance) {
	if !t.Ready() {
		return warmMiss, nil
	}
	owner, err := s.ownerChange(p, t)
	if err != nil {
		return warmMiss, nil
	}
	for tries := 0; tries < 3 && answerWait(ctx, time.Second) >= 200*time.Millisecond; tries++ {
		sn, sp, release, ok := s.ready.take(t)
		if !ok {
			break
		}
		began := s.now()
		r, consumed, inst := s.handoutReadyOne(ctx, name, sn, sp, owner, t)
		release(consumed)
		s.warm.kick()
		if r == warmHit {
			s.warmMetrics().handedOut(t.Wire.TemplateID, s.now().Sub(began))
			return r, inst
		}
		if r != warmMiss {
			return r, nil
		}
	}
	return warmMiss, nil
}

// handoutReadyOne tries one spare. consumed: the spare left the pool (it
// is claimed, gone, or its fate is unknown).
func (s *Service) handoutReadyOne(ctx context.Context, name, sn string, sp readySpare, owner change, t *templates.Template) (r handoutResult, consumed bool, inst *incus.Instance) {
	lock := change{keys: fSchema | fOwner | fStandin | fTemplate | fWarmClaimAt,
		to: record{Schema: schemaVersion, Owner: owner.to.Owner, Standin: sn, Template: t.Wire.TemplateID, WarmClaimAt: s.now()}}
	req := incus.InstancesPost{Name: name, Type: t.InstanceType, Source: incus.InstanceSource{Type: "none"},
		Config: lock.config(), Profiles: t.Profiles, Target: sp.member}
	if s.warmHook != nil && s.warmHook("taken") {
		return warmCrashed, false, nil
	}
	op, err := s.incus.CreateInstance(ctx, req)
	if err == nil {
		if s.warmHook != nil && s.warmHook("standin-sent") {
			return warmCrashed, true, nil
		}
		_, err = s.wait(ctx, op, answerWait(ctx, 2*time.Second))
	}
	s.listingChanged()
	if err != nil {
		at, lerr := s.lookup(ctx, name)
		switch {
		case lerr == nil && at != nil && standinOf(at) == sn:
			// It landed after all.
		case lerr == nil && at != nil:
			// Another create holds the owner's name: its answer is the
			// owner's, and the spare stays in the pool.
			return warmLost, false, nil
		case lerr == nil && errors.Is(err, incus.ErrConflict):
			return warmLost, false, nil
		default:
			// Its fate is unknown: should it land, it names this spare,
			// which therefore leaves the pool until a survey finds it
			// unnamed.
			s.logRetry("creating a stand-in at the owner's name failed", err, zap.String("instance", name), zap.String("spare", sn))
			s.ready.mu.Lock()
			s.ready.named[sn] = true
			s.ready.mu.Unlock()
			return warmMiss, false, nil
		}
	}
	if s.warmHook != nil && s.warmHook("standin") {
		return warmCrashed, true, nil
	}
	r, inst = s.claimReady(ctx, name, sn, owner, t)
	return r, true, inst
}

// claimReady claims a spare named by the stand-in at name and unfreezes it
// (steps 2 and 3). A claim refused leaves the stand-in to be deleted.
func (s *Service) claimReady(ctx context.Context, name, sn string, owner change, t *templates.Template) (handoutResult, *incus.Instance) {
	// The spare as the observation cache holds it, written without an
	// ETag: only this replica claims its spares, one hand-out at a time
	// holds each (take, hold), one writer at a time writes it (owned), and
	// the survey deletes one only while holding it. Without the cache, it
	// is read, and the write is conditional on that read.
	var w *incus.Instance
	var etag string
	var err error
	if s.cache != nil {
		if inst, hit := s.cache.get(sn); hit && inst != nil {
			w = inst
		}
	}
	if w == nil {
		w, etag, err = s.incus.GetInstance(ctx, sn)
	}
	if err != nil || !s.claimable(w, t) {
		s.dropStandin(ctx, name, sn)
		return warmMiss, nil
	}
	claim := owner
	claim.keys |= fPool | fWarmMaker | fWarmClaim | fWarmClaimAt | fBooted
	claim.to.WarmClaim, claim.to.WarmClaimAt, claim.to.Booted = name, s.now(), s.now()
	err = s.owned(ctx, sn, func(ctx context.Context) error {
		return s.incus.PatchInstanceConfigIf(ctx, sn, claim.config(), etag)
	})
	s.listingChanged()
	if err != nil {
		// Refused (412: a write came first) or unknown: what the spare
		// carries now decides.
		if now, lerr := s.lookupIncus(ctx, sn); lerr == nil && now != nil && claimOf(now) == name {
			err = nil
		}
	}
	if err != nil {
		s.logRetry("claiming a ready spare failed", err, zap.String("instance", name), zap.String("spare", sn))
		s.dropStandin(ctx, name, sn)
		return warmMiss, nil
	}
	if s.warmHook != nil && s.warmHook("claimed") {
		return warmCrashed, nil
	}
	s.changes.note(sn)
	// What Incus holds now, as this hand-out wrote it: the create's
	// answer needs no read of its own.
	now := *w
	now.Config = maps.Clone(w.Config)
	claim.applyTo(now.Config)
	s.log.Info("handed out a ready spare", zap.String("instance", name), zap.String("target", sn))
	if w.Status == incus.InstanceFrozen {
		if err := s.act(ctx, sn, incus.InstanceStatePut{Action: incus.ActionUnfreeze}, answerWait(ctx, 2*time.Second)); err != nil {
			// Still frozen, its intent running: the reconciler unfreezes it,
			// and the answer says it is on its way there.
			s.own.kick(sn)
			return warmHit, &now
		}
		now.Status = incus.InstanceRunning
	}
	return warmHit, &now
}

// claimable says a spare can be claimed for a template's hand-out by this
// replica: one of its ready spares, unclaimed, built from the template's
// recipe with this process's guest devices, frozen or running.
func (s *Service) claimable(w *incus.Instance, t *templates.Template) bool {
	if !isReadyName(w.Name) || (w.Status != incus.InstanceFrozen && w.Status != incus.InstanceRunning) {
		return false
	}
	r := recordOf(w.Config, fPool|fWarmClaim|fWarmMaker|fOwner)
	return r.Warm == t.Wire.TemplateID && r.WarmRecipe == s.readyRecipe(t) && r.has(fWarmReady) &&
		r.WarmClaim == "" && r.WarmMaker == s.cfg.Replica && !r.has(fOwner)
}

// readyRecipe digests what a ready spare of t is built from: the
// template's recipe and the guest dialer's devices. A spare is started
// with its devices, which a claim does not change, so one built for
// another dialer (or another socket directory) is rebuilt, never handed
// out: its owner's data routes could not reach it (LXD's lane met one, a
// spare made by a netns process handed out by a proxy one). The devices
// are digested as they are for a placeholder name: each spare's own
// devices are named for it.
func (s *Service) readyRecipe(t *templates.Template) string {
	req := readyRequest("", t)
	maps.Copy(req.Devices, s.dialer.Devices(guest.Target{Instance: readyPrefix + "00000000000000000000", Port: t.DaemonPort}))
	return recipeOf(req)
}

// dropStandin deletes the stand-in at name if it still names sn.
func (s *Service) dropStandin(ctx context.Context, name, sn string) {
	at, err := s.lookupIncus(ctx, name)
	if err != nil || at == nil || standinOf(at) != sn {
		return
	}
	err = s.owned(ctx, name, func(ctx context.Context) error {
		op, err := s.incus.DeleteInstance(ctx, name)
		if err == nil {
			_, err = s.wait(ctx, op, 30*time.Second)
		}
		return err
	})
	s.listingChanged()
	s.changes.note(name)
	if err != nil && !errors.Is(err, incus.ErrNotFound) && ctx.Err() == nil {
		s.logRetry("deleting a stand-in failed; the survey retries", err, zap.String("instance", name), zap.String("spare", sn))
	}
}

// standin is what follow found at an owner's name.
type standin int

const (
	// noStandin: the instance at the name is the target itself (or none).
	noStandin standin = iota
	// standinHeld: the stand-in's spare is the owner's target.
	standinHeld
	// standinPending: its spare is not claimed yet; a hand-out may be
	// under way (this replica's, or another's within its budget).
	standinPending
	// standinStale: its spare is gone, another's, or its hand-out's
	// budget has passed: the stand-in is deleted.
	standinStale
)

// follow reads what the owner's name holds through a stand-in: the spare
// that is the owner's target when the stand-in names one claimed for it.
func (s *Service) follow(ctx context.Context, owner controller.Owner, at *incus.Instance,
	read func(context.Context, string) (*incus.Instance, error)) (*incus.Instance, standin, error) {
	if at == nil {
		return nil, noStandin, nil
	}
	sn := standinOf(at)
	if sn == "" {
		return at, noStandin, nil
	}
	spare, err := read(ctx, sn)
	if err != nil {
		return nil, standinPending, err
	}
	if spare != nil {
		if got, ok := ownerOf(spare); ok && got == owner {
			return spare, standinHeld, nil
		}
		if claimOf(spare) == "" && s.now().Sub(recordOf(at.Config, fWarmClaimAt).WarmClaimAt) < s.retireGrace() {
			return nil, standinPending, nil
		}
	}
	return nil, standinStale, nil
}

// atOwnersName reads the owner's name from Incus and follows a stand-in
// there: at is what the name holds, target the owner's target when there
// is one (the instance itself, or the spare its stand-in names).
func (s *Service) atOwnersName(ctx context.Context, name string, owner controller.Owner) (at, target *incus.Instance, st standin, err error) {
	if at, err = s.lookup(ctx, name); err != nil {
		return nil, nil, noStandin, err
	}
	target, st, err = s.follow(ctx, owner, at, s.lookup)
	return at, target, st, err
}

// resumeReady settles the stand-in found at the owner's name, under the
// owner's lock: a spare of this replica's left unclaimed is claimed now; a
// stale stand-in is deleted. It answers the owner's target when there is
// one, and busy while another replica's hand-out may still claim.
func (s *Service) resumeReady(ctx context.Context, name string, at *incus.Instance, p controller.CreateParams) (*incus.Instance, handoutResult) {
	spare, st, err := s.follow(ctx, p.Owner, at, s.lookup)
	switch {
	case err != nil:
		return nil, warmBusy
	case st == standinHeld:
		return spare, warmHit
	case st == standinPending:
		sn := standinOf(at)
		tmpl, ok := s.catalog.Load().Get(recordOf(at.Config, fTemplate).Template)
		if !ok {
			return nil, warmBusy
		}
		release, mine := s.ready.hold(sn)
		if !mine {
			return nil, warmBusy
		}
		defer release(true)
		w, lerr := s.lookup(ctx, sn)
		if lerr != nil || w == nil || !s.claimable(w, tmpl) {
			return nil, warmBusy // another replica's: its hand-out, or the stand-in's age, settles it
		}
		owner, err := s.ownerChange(p, tmpl)
		if err != nil {
			return nil, warmBusy
		}
		s.log.Info("resuming a hand-out an earlier claimant left", zap.String("instance", name), zap.String("spare", sn))
		r, got := s.claimReady(ctx, name, sn, owner, tmpl)
		if r != warmHit {
			return nil, r
		}
		return got, warmHit
	}
	s.dropStandin(ctx, name, standinOf(at))
	return nil, warmMiss
}

// hold takes a spare for a resumed hand-out, unless a hand-out of this
// process holds it already.
func (p *readyPool) hold(name string) (release func(consumed bool), ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.taken[name] {
		return nil, false
	}
	p.taken[name] = true
	return p.releaser(name), true
}

// readyRequest is the create of a ready spare of t: the template's
// recipe, started (readyCreate adds the guest dialer's devices, named for
// the spare).
func readyRequest(name string, t *templates.Template) incus.InstancesPost {
	req := templateRequest(name, t)
	req.Start = true
	return req
}

// readyFill starts creates of this replica's spares, up to its share of
// each pool's size, within the bound on creates in flight and the memory
// ceiling.
func (s *Service) readyFill(held map[string]int64, heldBack map[string]int) {
	now := s.now()
	// A refill's creates and starts would slow a burst of hand-outs (each
	// is Incus writes too): the refill waits while hand-outs run (each
	// one's end kicks it), for readyRefillPatience at most.
	s.ready.mu.Lock()
	busy := len(s.ready.taken) > 0
	switch {
	case !busy:
		s.ready.deferred = time.Time{}
	case s.ready.deferred.IsZero():
		s.ready.deferred = now
	}
	wait := busy && now.Sub(s.ready.deferred) < readyRefillPatience
	s.ready.mu.Unlock()
	if wait {
		return
	}
	for _, t := range s.catalog.Load().All() {
		if !t.Ready() || t.Wire.Deprecated {
			continue
		}
		s.warm.mu.Lock()
		backoff := now.Before(s.warm.retryAt[t.Wire.TemplateID])
		s.warm.mu.Unlock()
		if backoff {
			continue
		}
		for have, want := s.ready.count(t), s.readyShare(s.warmSize(t, now)); have < want; have++ {
			if !s.warmFits(t, held) {
				heldBack[t.Wire.TemplateID]++
				break
			}
			select {
			case s.warm.sem <- struct{}{}:
			default:
				return
			}
			name := newReadyName()
			s.ready.mu.Lock()
			s.ready.filling[name] = t
			s.ready.mu.Unlock()
			held[memberOf(t.Placement)] += warmMemory(t)
			if !s.own.spawn(func(ctx context.Context) { s.readyCreate(ctx, name, t) }) {
				<-s.warm.sem
				s.ready.mu.Lock()
				delete(s.ready.filling, name)
				s.ready.mu.Unlock()
				return
			}
		}
	}
}

// readyShare is this replica's part of a pool of size n: the replicas that
// share the project split it, each rounding up.
func (s *Service) readyShare(n int) int {
	r := max(s.cfg.Replicas, 1)
	return (n + r - 1) / r
}

// readyCreate creates one spare, starts it, waits for its daemon to
// listen, freezes it when the template says so, and marks it ready.
func (s *Service) readyCreate(ctx context.Context, name string, t *templates.Template) {
	id, began := t.Wire.TemplateID, s.now()
	ok := false
	member := memberOf(t.Placement)
	defer func() {
		s.ready.mu.Lock()
		delete(s.ready.filling, name)
		if ok {
			s.ready.spares[name] = readySpare{template: id, member: member}
		}
		s.ready.mu.Unlock()
		s.refillDone(id, began, ok, ok, !ok && ctx.Err() == nil)
	}()
	req := readyRequest(name, t)
	maps.Copy(req.Config, change{keys: fWarm | fWarmRecipe | fWarmMaker,
		to: record{Warm: id, WarmRecipe: s.readyRecipe(t), WarmMaker: s.cfg.Replica}}.config())
	maps.Copy(req.Devices, s.dialer.Devices(guest.Target{Instance: name, Port: t.DaemonPort}))
	op, err := s.incus.CreateInstance(ctx, req)
	if err == nil {
		_, err = s.wait(ctx, op, 5*time.Minute)
	}
	s.listingChanged()
	if err == nil {
		err = s.awaitRunning(ctx, name)
	}
	if err == nil {
		location := ""
		if inst, lerr := s.lookupIncus(ctx, name); lerr == nil && inst != nil && inst.Location != "" {
			location, member = inst.Location, memberOf(inst.Location)
		}
		s.awaitDaemon(ctx, guest.Target{Instance: name, Port: t.DaemonPort, Location: location})
		if t.WarmState == templates.WarmFrozen {
			err = s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionFreeze}, time.Minute)
		}
	}
	if err == nil {
		err = s.patch(ctx, name, change{keys: fWarmReady, to: record{WarmReady: s.now()}}.config())
	}
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("warm pool: creating a ready spare failed; backing off", zap.String("template", id), zap.String("instance", name), zap.Error(err))
		}
		// Left without its ready mark: the survey deletes it.
		return
	}
	ok = true
}

// awaitRunning waits, bounded, until a new spare runs with no operation
// on it. LXD ends a create's operation before the start it asked for has
// brought the container up (and refuses a freeze meanwhile: "The container
// isn't running"); a spare found stopped with nothing on it is started.
func (s *Service) awaitRunning(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		if _, err := s.settled(ctx, name); err != nil {
			return err
		}
		inst, err := s.lookupIncus(ctx, name)
		switch {
		case err != nil:
			return err
		case inst == nil:
			return fmt.Errorf("spare %s: %w", name, incus.ErrNotFound)
		case inst.Status == incus.InstanceRunning:
			if op, err := s.operationOn(ctx, name); err != nil || op == nil {
				return err
			}
		case inst.Status == incus.InstanceStopped:
			if err := s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionStart}, time.Minute); err != nil && !errors.Is(err, incus.ErrBusy) {
				return err
			}
		}
		if !clock.Sleep(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// readyDaemonWait bounds how long a new spare's daemon may take to listen
// before the spare is frozen anyway (its owner's first dial then waits for
// it, as after any start).
const readyDaemonWait = 20 * time.Second

// awaitDaemon waits, bounded, until a stream to the guest's daemon opens:
// a spare frozen before its daemon listens would make its owner wait for
// the rest of a boot.
func (s *Service) awaitDaemon(ctx context.Context, target guest.Target) {
	wctx, cancel := context.WithTimeout(ctx, readyDaemonWait)
	defer cancel()
	began := time.Now()
	var err error
	for wctx.Err() == nil {
		dctx, dcancel := context.WithTimeout(wctx, time.Second)
		var c net.Conn
		c, err = s.dialer.DialContext(dctx, target)
		dcancel()
		if err == nil {
			_ = c.Close()
			return
		}
		if !clock.Sleep(wctx, 100*time.Millisecond) {
			break
		}
	}
	if ctx.Err() == nil {
		s.log.Info("a ready spare's daemon did not take a stream in time; the spare is readied anyway", zap.String("instance", target.Instance),
			zap.Duration("waited", time.Since(began)), zap.Error(err))
	}
}

// Replica liveness, for the spares a replica leaves behind: each replica
// that keeps ready spares writes when its word lapses on the project
// (keyReplicaPrefix and its id), at every survey. A spare whose maker's
// word has lapsed, unclaimed and named by no stand-in, is deleted: never
// adopted, since its maker may be alive after all and handing it out.
// (replicaWordSurveys is how long a replica's word stands: several surveys.)
const replicaWordSurveys = 4

// readyAbandoned is how old another replica's spare must be before its
// lapsed word gets it deleted: far beyond the longest a spare takes to be
// made (an image unpacked on a busy member, and the wait for its daemon),
// so that a word missed once (a project write that lost its race) never
// deletes a spare its maker is still making.
const readyAbandoned = 5 * time.Minute

// readySurvey settles the ready spares and stand-ins of one listing: it
// notes this replica's ready spares, deletes what no one can hand out or
// use, and closes a claimed spare that no stand-in locks.
func (s *Service) readySurvey(ctx context.Context, list []incus.Instance) {
	offered := s.readyOffered()
	byName := make(map[string]*incus.Instance, len(list))
	var spares, standins []*incus.Instance
	for i := range list {
		inst := &list[i]
		byName[inst.Name] = inst
		switch {
		case isReadyName(inst.Name):
			spares = append(spares, inst)
		case isOwnerName(inst.Name) && standinOf(inst) != "":
			standins = append(standins, inst)
		}
	}
	if !offered && len(spares) == 0 && len(standins) == 0 {
		return
	}
	now := s.now()
	alive := s.replicasAlive(ctx, offered)
	named := map[string]bool{}
	var dropStandins [][2]string
	for _, at := range standins {
		sn := standinOf(at)
		named[sn] = true
		spare := byName[sn]
		age := now.Sub(recordOf(at.Config, fWarmClaimAt).WarmClaimAt)
		switch {
		case spare == nil && age >= s.retireGrace():
			dropStandins = append(dropStandins, [2]string{at.Name, sn})
		case spare != nil && claimOf(spare) != "" && claimOf(spare) != at.Name:
			dropStandins = append(dropStandins, [2]string{at.Name, sn})
		case spare != nil && claimOf(spare) == "" && age >= s.retireGrace():
			dropStandins = append(dropStandins, [2]string{at.Name, sn})
		}
	}
	mine := map[string]readySpare{}
	// Each template's recipe once per survey, not once per spare.
	recipe := map[string]string{}
	recipes := func(t *templates.Template) string {
		r, ok := recipe[t.Wire.TemplateID]
		if !ok {
			r = s.readyRecipe(t)
			recipe[t.Wire.TemplateID] = r
		}
		return r
	}
	var drop, unlocked []string
	s.ready.mu.Lock()
	for _, w := range spares {
		r := recordOf(w.Config, fPool|fWarmClaim|fWarmClaimAt|fWarmMaker|fClosing)
		if r.WarmClaim != "" {
			// A target. Locked by the stand-in at its claim, unless its
			// claimant stopped between the two (or a close deleted the
			// stand-in first): past the claimant's budget, it is closed.
			lock := byName[r.WarmClaim]
			if !r.has(fClosing) && (lock == nil || standinOf(lock) != w.Name) && now.Sub(r.WarmClaimAt) >= s.retireGrace() {
				unlocked = append(unlocked, w.Name)
			}
			continue
		}
		if s.ready.taken[w.Name] || s.ready.filling[w.Name] != nil {
			continue
		}
		t, ok := s.catalog.Load().Get(r.Warm)
		current := ok && t.Ready() && !t.Wire.Deprecated && r.WarmRecipe == recipes(t)
		_, left := s.ready.left[w.Name]
		switch {
		case left:
			// Handed out or found unusable since this listing was taken.
		case r.WarmMaker == s.cfg.Replica && current && r.has(fWarmReady) && !named[w.Name]:
			mine[w.Name] = readySpare{template: r.Warm, member: memberOf(w.Location)}
		case named[w.Name]:
			// A stand-in names it: its hand-out settles it first.
		case r.WarmMaker == s.cfg.Replica && !r.has(fWarmReady):
			// Still being made, by a process of this replica that ended
			// (this one's creates are in filling): unfinished, deleted.
			if now.Sub(w.CreatedAt) >= s.retireGrace() {
				drop = append(drop, w.Name)
			}
		case r.WarmMaker == s.cfg.Replica:
			drop = append(drop, w.Name) // built from another recipe, or no longer offered
		case alive != nil && !alive[r.WarmMaker] && now.Sub(w.CreatedAt) >= readyAbandoned:
			drop = append(drop, w.Name) // its maker's word lapsed
			s.log.Info("deleting a ready spare whose maker's word has lapsed", zap.String("instance", w.Name), zap.String("maker", r.WarmMaker))
		}
	}
	// Surplus: above this replica's share of the size wanted, the spares
	// ready longest go first once the pool has shrunk for a whole period.
	for _, t := range s.catalog.Load().All() {
		if !t.Ready() {
			continue
		}
		n := 0
		for _, sp := range mine {
			if sp.template == t.Wire.TemplateID {
				n++
			}
		}
		for name, sp := range mine {
			if n <= s.readyShare(s.warmSize(t, now)) {
				break
			}
			if sp.template == t.Wire.TemplateID {
				if w := byName[name]; now.Sub(recordOf(w.Config, fWarmReady).WarmReady) >= s.cfg.WarmShrinkAfter {
					delete(mine, name)
					drop = append(drop, name)
					n--
				}
			}
		}
	}
	for n, sp := range s.ready.spares {
		if _, listed := byName[n]; !listed {
			// Made since the listing was taken, most likely; one deleted
			// meanwhile fails its hand-out's read and leaves then.
			mine[n] = sp
		}
	}
	for n, at := range s.ready.left {
		if now.Sub(at) > time.Minute {
			delete(s.ready.left, n)
		}
	}
	s.ready.spares, s.ready.named = mine, named
	s.ready.met = s.ready.met || len(spares) > 0 || len(standins) > 0
	s.ready.mu.Unlock()
	for _, d := range dropStandins {
		s.dropStandin(ctx, d[0], d[1])
	}
	for _, name := range drop {
		s.deleteSpare(ctx, name)
	}
	for _, name := range unlocked {
		s.log.Warn("closing a ready spare claimed under no stand-in: its hand-out stopped between its steps", zap.String("instance", name))
		if err := s.patch(ctx, name, change{keys: fClosing, to: record{Closing: s.now()}}.config()); err == nil {
			s.own.kick(name)
		}
	}
	s.warmGauge()
}

// deleteSpare deletes an unclaimed spare, unless a hand-out holds it or a
// claim landed on it since the listing.
func (s *Service) deleteSpare(ctx context.Context, name string) {
	release, ok := s.ready.hold(name)
	if !ok {
		return
	}
	defer release(true)
	err := s.owned(ctx, name, func(ctx context.Context) error {
		w, _, err := s.incus.GetInstance(ctx, name)
		if err != nil {
			return err
		}
		if claimOf(w) != "" {
			return nil
		}
		if w.Status != incus.InstanceStopped {
			op, err := s.incus.UpdateInstanceState(ctx, name, incus.InstanceStatePut{Action: incus.ActionStop, Force: true})
			if err == nil {
				_, err = s.wait(ctx, op, time.Minute)
			}
			if err != nil && !isAlreadyStopped(err) {
				return err
			}
		}
		op, err := s.incus.DeleteInstance(ctx, name)
		if err == nil {
			_, err = s.wait(ctx, op, time.Minute)
		}
		return err
	})
	s.listingChanged()
	guest.Removed(s.dialer, name)
	if err != nil && !errors.Is(err, incus.ErrNotFound) && ctx.Err() == nil {
		s.logRetry("deleting a ready spare failed; the survey retries", err, zap.String("instance", name))
	}
}

// replicasAlive writes this replica's word (when it keeps spares) and reads
// every replica's: the ids whose word stands. nil: unknown.
func (s *Service) replicasAlive(ctx context.Context, keeps bool) map[string]bool {
	now := s.now()
	var words map[string]time.Time
	if keeps {
		until := now.Add(replicaWordSurveys * s.cfg.ReconcileInterval)
		err := s.editProject(ctx, func(c map[string]string) bool {
			words = replicaWords(c)
			putReplicaWord(c, s.cfg.Replica, until, now.Add(-time.Hour))
			return true
		})
		if err != nil {
			words = nil
		}
	}
	if words == nil {
		p, err := s.incus.GetProject(ctx, s.projectName())
		if err != nil {
			// Unknown: no spare is deleted for its maker's sake this round.
			return nil
		}
		words = replicaWords(p.Config)
	}
	alive := map[string]bool{s.cfg.Replica: true}
	for id, until := range words {
		if until.After(now) {
			alive[id] = true
		}
	}
	return alive
}

// readyGauge adds this replica's ready spares to sizes.
func (s *Service) readyGauge(sizes map[string]int) {
	s.ready.mu.Lock()
	defer s.ready.mu.Unlock()
	for n, sp := range s.ready.spares {
		if !s.ready.taken[n] {
			if _, ok := sizes[sp.template]; ok {
				sizes[sp.template]++
			}
		}
	}
}

// readyMemoryHeld adds the memory of this replica's spares, ready or being
// made, per member.
func (s *Service) readyMemoryHeld(held map[string]int64) {
	cat := s.catalog.Load()
	s.ready.mu.Lock()
	defer s.ready.mu.Unlock()
	for _, sp := range s.ready.spares {
		if t, ok := cat.Get(sp.template); ok {
			held[sp.member] += warmMemory(t)
		}
	}
	for _, t := range s.ready.filling {
		held[memberOf(t.Placement)] += warmMemory(t)
	}
}

// seen says this process has met a ready spare or a stand-in: a catalog
// that no longer offers one may still have targets handed out from one.
func (p *readyPool) seen() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.met
}

// closeStandin settles, for a close that found no target, a stand-in at the
// owner's name: one whose spare is not the owner's target and whose
// hand-out no one can still finish (stale, or this replica's own with no
// hand-out of this process holding it) is deleted. dropped: it was, and
// the close looks again. The caller holds the owner's lock.
func (s *Service) closeStandin(ctx context.Context, name string, owner controller.Owner) (dropped bool, err error) {
	if !s.readyOffered() && !s.ready.seen() {
		return false, nil
	}
	at, _, st, err := s.atOwnersName(ctx, name, owner)
	if err != nil || at == nil || st == noStandin || st == standinHeld {
		return false, err
	}
	sn := standinOf(at)
	if st == standinPending {
		release, ok := s.ready.hold(sn)
		if !ok {
			return false, nil // this process's hand-out is under way: the close waits for it
		}
		defer release(false)
		w, err := s.lookupIncus(ctx, sn)
		if err != nil {
			return false, err
		}
		if w != nil && recordOf(w.Config, fWarmMaker).WarmMaker != s.cfg.Replica {
			return false, nil // another replica's hand-out may still claim it
		}
	}
	s.dropStandin(ctx, name, sn)
	after, err := s.lookupIncus(ctx, name)
	return err == nil && after == nil, err
}
