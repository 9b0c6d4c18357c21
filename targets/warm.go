package targets

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"maps"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// Warm pools. A template with warm: N keeps N instances created ahead,
// stopped and never started, under slot names warm-<template digest>-<slot>
// that Name can never produce (it always answers ls- and hex digits). A
// warm instance carries the template it was built for, a digest of its
// recipe and, once its create finished, a ready mark; it has no owner
// metadata, so nothing that looks for targets (listing, idle loop, gauge,
// reconciler) ever takes it for one.
//
// Stopped, not started: Incus renames only a stopped instance, so a started
// warm instance would have to be stopped before its hand-out (measured on
// the dev image: a forced stop 640 ms, a start 150 ms, a rename 45 ms), and
// its guest daemon would have run, and may have made an identity, before
// any owner existed; the contract forbids handing such a state on.
//
// A hand-out (target/create of a new owner, under the owner's lock):
//
//  1. claim: one ETag-conditional PATCH writes the owner's metadata and the
//     claim (the owner's name) onto a ready warm instance and takes the
//     pool's keys off; of several claimants of one instance, the first
//     write wins and the others are refused (412) and try another.
//  2. rename the warm instance to the owner's name. Incus refuses a name
//     in use, so the owner's name is still the lock: a normal create, or
//     another replica's hand-out, that holds the name first makes the
//     rename fail, and then the claimed instance is deleted (it carries
//     this owner's ids, so it never returns to the pool). Two renames to
//     one name settle cleanly (8 of 8 concurrent pairs with the incus
//     CLI). A rename and a create of one name do not always: Incus 6.0.4
//     renames the volume before the record and keeps the volume's rename
//     when the record's fails, so a create landing in between leaves the
//     name with a volume and no instance, and every later create of it
//     fails (2 of 6 concurrent pairs). The hand-out holds its rename back
//     while a task is on the name (renameClaimed), for a create from a
//     process that stages none; this provider's own creates, while pools
//     exist, are renames too (see staged.go).
//  3. nothing more: the instance is the owner's target (the claim stays on
//     it as the record of its hand-out), and the reconciler starts it like
//     any created one.
//
// A crash after 1 leaves a claimed warm instance that is neither in the
// pool nor a target: the pool's survey resumes the hand-out once the
// claimant's method budget has passed, and so does the owner's create
// should it come first (see resumeHandout). A claimed instance is deleted
// only once another instance holds the owner's name, where no rename can
// land: deleting one under a slow claimant's rename wrecks the name (see
// warmSurvey). A crash after 2 leaves the owner's whole target. Either way the owner's name ends on exactly one instance. Should two
// claims of one instance both have landed (replicas racing inside Incus's
// ETag check), the instance at an owner's name may carry the other owner's
// metadata: that unfinished hand-out belongs to whoever's name it has, and
// the owner's create (or close) finishes it (see unfinishedHandout).
//
// Refill: each slot is a name, so the pool is filled by creating missing
// slots, and replicas racing for a slot are settled by Incus's name lock:
// the pool never holds more than N, whatever the number of replicas.
// warmPrefix starts every pool name. A warm instance's record carries the
// template it was built for (Warm), the digest of what it was built from
// (WarmRecipe: a template whose image or resources changed no longer hands
// it out), when Incus finished creating it (WarmReady), and, once claimed,
// the owner's name a hand-out renames it to (WarmClaim, at WarmClaimAt).
const warmPrefix = "warm-"

// errCrashed is what a test's hook returns where a crash would stop a step.
var errCrashed = errors.New("stopped by a test's hook")

// warmCreates bounds the pool's creates in flight across all templates:
// on a dir pool a create is mostly disk writes, which the owners' own
// creates share.
const warmCreates = 2

// warmRefillDelay is how long a refill waits after a hand-out, so the
// target handed out starts before the pool's create competes with it.
const warmRefillDelay = time.Second

// warmName is the name of one slot of a template's pool.
func warmName(templateID string, slot int) string {
	return warmStem(templateID) + "-" + strconv.Itoa(slot)
}

// warmStem is what every pool name of a template starts with.
func warmStem(templateID string) string {
	h := sha256.Sum256([]byte("lightspeed/warm/" + templateID))
	return warmPrefix + hex.EncodeToString(h[:warmStemBytes])
}

// warmStemBytes is the digest bytes in a stem; warmStemLen its length.
const (
	warmStemBytes = 6
	warmStemLen   = len(warmPrefix) + 2*warmStemBytes
)

// isWarmName says a name is one of the pool's, of any template.
func isWarmName(name string) bool { return strings.HasPrefix(name, warmPrefix) }

// handoutPending says a warm instance is claimed for name: its claimant
// (this process or another, alive or not) or the pool's survey renames it
// there, since none is deleted while the owner's name is free (see
// warmSurvey), and Incus lists that rename as an operation on the warm
// name only. A close must not answer closed before the rename lands.
func (s *Service) handoutPending(ctx context.Context, name string) (bool, error) {
	claimed, err := s.claimsFor(ctx, name, false)
	return len(claimed) > 0, err
}

// unfinishedHandout says an instance under an owner's name came from the
// pool and does not carry that owner's metadata: a hand-out that has not
// finished. It belongs to the owner whose name it has; it is never anyone
// else's target, and never an orphan.
func unfinishedHandout(inst *incus.Instance) bool {
	if !isOwnerName(inst.Name) {
		return false
	}
	if r := recordOf(inst.Config, fWarm|fWarmClaim); r.Warm == "" && r.WarmClaim == "" {
		return false
	}
	_, ok := ownerOf(inst)
	return !ok
}

// claimOf is the owner's name a warm instance is claimed for ("": none).
func claimOf(w *incus.Instance) string { return recordOf(w.Config, fWarmClaim).WarmClaim }

// recipeOf digests what a template's instances are built from, apart from
// the owner and the name.
func recipeOf(req incus.InstancesPost) string {
	config := map[string]string{}
	for k, v := range req.Config {
		if !strings.HasPrefix(k, "user.") {
			config[k] = v
		}
	}
	raw, _ := json.Marshal(struct {
		Type, Image, Target string
		Config              map[string]string
		Devices             map[string]map[string]string
		Profiles            []string
	}{req.Type, req.Source.Fingerprint, req.Target, config, req.Devices, req.Profiles})
	h := sha256.Sum256(raw)
	return hex.EncodeToString(h[:8])
}

// warmPool is this process's view of the pools.
type warmPool struct {
	mu sync.Mutex
	// known are the warm instances believed to exist, and whether each
	// is ready, from the last listing and this process's own changes.
	known map[string]bool
	// filling are the slots this process is creating.
	filling map[string]bool
	// taken are the warm instances a create of this process is handing
	// out: no two of its creates claim the same one.
	taken map[string]bool
	// resuming are the claimed ones whose hand-out the survey is
	// finishing (see resumeClaim).
	resuming map[string]bool
	// resumeAfter backs off the survey's resume of a claimed instance
	// whose hand-out did not finish: a name Incus has wrecked (a volume
	// and no instance) refuses every rename, for as long as no operator
	// mends it, and each try is a rename, a read and a warning.
	resumeAfter map[string]resumeRetry
	// renaming counts the renames this process has under way, by the
	// owner's name they go to: while one runs, neither name may read as
	// the instance's (the cache can drop the warm name first), and a get
	// must still answer provisioning.
	renaming map[string]int
	// retryAt backs a template's refill off after Incus refused it.
	retryAt map[string]time.Time
	delay   map[string]time.Duration
	kickc   chan struct{}
	sem     chan struct{}
	// demand sizes each pool (see warmsize.go).
	demand demand
	// where is the cluster member each warm instance is on, as last
	// listed ("" on a standalone Incus), for the memory ceiling.
	where map[string]string
	// surveyed: a survey has listed the project once; seen: the last one
	// found warm instances. Without a pool in the catalog and none seen,
	// a survey has nothing to do and does not list.
	surveyed, seen bool
}

func (p *warmPool) init() {
	p.known, p.filling, p.taken, p.resuming = map[string]bool{}, map[string]bool{}, map[string]bool{}, map[string]bool{}
	p.renaming = map[string]int{}
	p.where = map[string]string{}
	p.resumeAfter = map[string]resumeRetry{}
	p.retryAt, p.delay = map[string]time.Time{}, map[string]time.Duration{}
	p.kickc = make(chan struct{}, 1)
	p.sem = make(chan struct{}, warmCreates)
}

// resumeRetry is when a claimed instance's hand-out is resumed next, after
// fails tries that did not finish it.
type resumeRetry struct {
	fails int
	next  time.Time
}

// resumeBackoffMost bounds the wait between resumes of one claim: a name
// an operator mended is taken within it.
const resumeBackoffMost = 5 * time.Minute

// resumed records how a resume of wn ended. One that settled the claim
// clears its backoff. After one that did not, the next survey tries again
// (most such are an operation that was still on the instance), the one
// after waits an interval, and each wait after is twice the last.
func (p *warmPool) resumed(wn string, settled bool, now time.Time, interval time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if settled {
		delete(p.resumeAfter, wn)
		return
	}
	r := p.resumeAfter[wn]
	r.fails++
	var wait time.Duration
	if r.fails > 1 {
		wait = min(interval<<min(r.fails-2, 20), resumeBackoffMost) // the shift bounded short of overflow
	}
	r.next = now.Add(wait)
	p.resumeAfter[wn] = r
}

func (p *warmPool) kick() {
	select {
	case p.kickc <- struct{}{}:
	default:
	}
}

// take marks one ready warm instance of a template, not tried yet, as
// being handed out by the caller, chosen at random (claimants on several
// replicas then rarely pick the same one); ok is false when there is none.
// release gives it back.
func (p *warmPool) take(t *templates.Template, tried map[string]bool) (name string, release func(), ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var names []string
	for slot := range t.WarmMax { // a spare above the size wanted too, before it is deleted
		n := warmName(t.Wire.TemplateID, slot)
		if p.known[n] && !p.taken[n] && !p.filling[n] && !tried[n] {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return "", nil, false
	}
	name = names[rand.IntN(len(names))]
	p.taken[name] = true
	return name, p.releaser(name), true
}

// hold marks a warm instance as this process's own to rename (no survey
// resumes it, no other create of this process claims it) until release.
func (p *warmPool) hold(name string) (release func()) {
	p.mu.Lock()
	p.taken[name] = true
	p.mu.Unlock()
	return p.releaser(name)
}

// tryHold is hold, unless the name is held already.
func (p *warmPool) tryHold(name string) (release func(), ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.taken[name] {
		return nil, false
	}
	p.taken[name] = true
	return p.releaser(name), true
}

func (p *warmPool) releaser(name string) func() {
	return func() {
		p.mu.Lock()
		delete(p.taken, name)
		p.mu.Unlock()
	}
}

func (p *warmPool) forget(name string) {
	p.mu.Lock()
	delete(p.known, name)
	p.mu.Unlock()
}

// handoutResult is what a hand-out did.
type handoutResult int

const (
	// warmMiss: no warm instance could be handed out; nothing changed at
	// the owner's name.
	warmMiss handoutResult = iota
	// warmHit: a warm instance is now at the owner's name (or its rename
	// is under way).
	warmHit
	// warmLost: the owner's name was taken by another create meanwhile.
	warmLost
	// warmCrashed: a test's hook stopped the hand-out where a crash
	// would, and nothing more may be written.
	warmCrashed
	// warmRenaming: a warm instance is claimed for the owner and Incus is
	// renaming it there; the target starts once it lands (followRename).
	warmRenaming
	// warmBusy: an earlier claimant's rename to the owner's name is still
	// under way, or a task on the owner's name holds the rename back; the
	// create answers without an id, and the claim is resumed after.
	warmBusy
)

// handout gives the owner's name one ready warm instance of the template.
// The caller holds the owner's lock and has seen no instance at name.
func (s *Service) handout(ctx context.Context, name string, p controller.CreateParams, t *templates.Template) handoutResult {
	if !t.Stopped() {
		return warmMiss
	}
	owner, err := s.ownerChange(p, t)
	if err != nil {
		return warmMiss
	}
	recipe := recipeOf(templateRequest("", t))
	tried := map[string]bool{}
	for answerWait(ctx, time.Second) >= 200*time.Millisecond { // else too little is left of the budget: create as usual
		wn, release, ok := s.warm.take(t, tried)
		if !ok {
			break
		}
		tried[wn] = true
		began := s.now()
		r := s.handoutOne(ctx, name, wn, owner, recipe, t)
		release()
		if r == warmHit || r == warmRenaming {
			s.warmMetrics().handedOut(t.Wire.TemplateID, s.now().Sub(began))
		}
		if r != warmMiss {
			return r
		}
	}
	return warmMiss
}

// handoutOne tries one warm instance: claim, then rename (see the top of
// this file).
func (s *Service) handoutOne(ctx context.Context, name, wn string, owner change, recipe string, t *templates.Template) handoutResult {
	w, etag, err := s.incus.GetInstance(ctx, wn)
	if errors.Is(err, incus.ErrNotFound) {
		s.warm.forget(wn)
		return warmMiss
	}
	if err != nil || !handable(w, t.Wire.TemplateID, recipe) {
		return warmMiss
	}
	if s.warmHook != nil && s.warmHook("read") {
		return warmCrashed
	}
	claim := owner
	claim.keys |= fPool | fWarmClaim | fWarmClaimAt // the pool's keys to none: removed
	claim.to.WarmClaim, claim.to.WarmClaimAt = name, s.now()
	devices := s.dialer.Devices(guest.Target{Instance: name, Port: t.DaemonPort})
	err = s.owned(ctx, wn, func(ctx context.Context) error {
		return s.incus.PatchInstanceIf(ctx, wn, claim.config(), devices, etag)
	})
	s.listingChanged()
	s.warm.forget(wn) // claimed, refused or unknown: not handable any more as far as this process knows
	s.warm.kick()
	if err != nil {
		// Another claimant came first (412), an operation holds it, or the
		// write's fate is unknown: a claim that landed unseen is resumed
		// by the pool's survey, or deleted once the name is another's.
		return warmMiss
	}
	if s.warmHook != nil && s.warmHook("claimed") {
		return warmCrashed
	}
	return s.renameClaimed(ctx, name, wn)
}

// renameClaimed renames a warm instance claimed for name to name (step 2).
func (s *Service) renameClaimed(ctx context.Context, name, wn string) handoutResult {
	// Incus 6.0 renames the volume before the instance record and does not
	// undo it when the record's rename fails: a create of the name landing
	// in between leaves the owner's name with a volume and no instance,
	// refusing every later create of it (measured: 2 of 6 concurrent
	// rename/create pairs with the incus CLI). A create under way on the
	// name is let through first; the claim waits, and is resumed or
	// deleted once it ended (see resumeClaim). Only a create from a
	// process that does not stage its creates (see staged.go) can be on
	// the name.
	if op, err := s.operationOn(ctx, name); err != nil || op != nil {
		return warmBusy
	}
	s.warm.mu.Lock()
	s.warm.renaming[name]++
	s.warm.mu.Unlock()
	defer func() {
		s.warm.mu.Lock()
		if s.warm.renaming[name]--; s.warm.renaming[name] <= 0 {
			delete(s.warm.renaming, name)
		}
		s.warm.mu.Unlock()
	}()
	var sent *incus.Operation
	err := s.owned(ctx, wn, func(ctx context.Context) error {
		op, err := s.incus.RenameInstance(ctx, wn, name)
		if err == nil {
			sent = op
			if s.warmHook != nil && s.warmHook("rename-sent") {
				return errCrashed
			}
			_, err = s.wait(ctx, op, answerWait(ctx, 2*time.Second))
		}
		return err
	})
	s.listingChanged()
	switch {
	case errors.Is(err, errCrashed):
		return warmCrashed
	case sent != nil && errors.Is(err, context.DeadlineExceeded) && s.followRename(name, wn, sent):
		// Incus took the rename and is still at it (40 at once take
		// seconds): the owner's create answers provisioning, and the
		// target starts the moment the rename lands, not when the runtime
		// asks again.
		return warmRenaming
	case err == nil:
	case errors.Is(err, incus.ErrConflict):
		// The owner's name is held by another create: this claimed
		// instance carries the owner's ids and never returns to the pool.
		s.discardWarm(wn, name)
		return warmLost
	default:
		// Gone (another claimant renamed it), refused, or the rename's
		// fate is unknown: what is at the owner's name now decides.
		if at, lerr := s.lookup(ctx, name); lerr == nil && at != nil {
			return warmHit
		}
		s.logRetry("renaming a claimed warm instance to the owner's name failed", err, zap.String("instance", name),
			zap.String("warm", wn))
		return warmMiss
	}
	if s.warmHook != nil && s.warmHook("renamed") {
		return warmCrashed
	}
	s.log.Info("handed out a warm instance", zap.String("instance", name), zap.String("warm", wn))
	return warmHit
}

// followRename waits, in the background, for a hand-out's rename that
// outlived its create's answer, and then has the target started. Until it
// lands a get of the owner answers provisioning (renaming). One that fails
// is left as any failed rename is: the owner's next create or the pool's
// survey settles the claim, and a claim whose name another create holds
// is deleted. false: the process is stopping, and the rename is left to
// the next one's survey.
func (s *Service) followRename(name, wn string, op *incus.Operation) bool {
	s.warm.mu.Lock()
	s.warm.renaming[name]++
	s.warm.resuming[wn] = true // the survey leaves it to this follower
	s.warm.mu.Unlock()
	done := func() {
		s.warm.mu.Lock()
		if s.warm.renaming[name]--; s.warm.renaming[name] <= 0 {
			delete(s.warm.renaming, name)
		}
		delete(s.warm.resuming, wn)
		s.warm.mu.Unlock()
	}
	ok := s.own.spawn(func(ctx context.Context) {
		defer done()
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		_, err := s.incus.Wait(ctx, op)
		s.listingChanged()
		switch {
		case err == nil:
			s.log.Info("handed out a warm instance", zap.String("instance", name), zap.String("warm", wn))
			s.changes.note(name)
			s.own.kick(name)
		case errors.Is(err, incus.ErrConflict):
			s.discardWarm(wn, name)
		case ctx.Err() == nil:
			s.logRetry("renaming a claimed warm instance to the owner's name failed", err, zap.String("instance", name),
				zap.String("warm", wn))
		}
	})
	if !ok {
		done()
	}
	return ok
}

// resumeHandout carries on a hand-out to name that an earlier claimant (a
// process killed after its claim, or mid-rename) left: the claimed warm
// instance is renamed to name now, or, while an Incus operation (that
// claimant's rename) still holds it, the create waits for it (warmBusy).
// warmMiss: nothing is claimed for name. The caller holds the owner's lock
// and has seen no instance at name.
//
// A create must never send its own POST, or rename another warm instance,
// to a name that a claimed one may still be renamed to: Incus 6.0 checks the
// name before its rename operation runs, so a create landing in between
// makes both fail, and the rename leaves its storage moved under the
// owner's name with no instance (found by the kill matrix with a pool: the
// owner's every later create then failed, and its target vanished).
func (s *Service) resumeHandout(ctx context.Context, name string) (handoutResult, error) {
	claimed, err := s.claimsFor(ctx, name, false)
	if err != nil {
		return warmMiss, err
	}
	for _, w := range claimed {
		wn := w.Name
		s.warm.mu.Lock()
		ours := s.warm.taken[wn]
		s.warm.mu.Unlock()
		if ours {
			return warmBusy, nil // this process's own staged create renames it
		}
		if op, err := s.operationOn(ctx, wn); err != nil || op != nil {
			if op != nil {
				s.log.Info("a hand-out to the owner's name waits for an Incus task on its claimed warm instance",
					zap.String("instance", name), zap.String("warm", wn), zap.String("task", op.ID),
					zap.String("description", op.Description), zap.String("status", op.Status))
			}
			return warmBusy, err
		}
		s.log.Info("resuming a hand-out an earlier claimant left", zap.String("instance", name), zap.String("warm", wn))
		if r := s.renameClaimed(ctx, name, wn); r != warmMiss {
			return r, nil
		}
		// Not renamed, and nothing at the owner's name: only a warm
		// instance that is gone (swept, or renamed elsewhere) frees the
		// name for another create.
		if _, _, err := s.incus.GetInstance(ctx, wn); !errors.Is(err, incus.ErrNotFound) {
			return warmBusy, nil
		}
	}
	return warmMiss, nil
}

// resumeClaim finishes, in the background, a hand-out to name that its
// claimant left after the claim (a process killed, a rename that failed or
// outlived its create's answer). The claim is the owner's create recorded
// in Incus, and the create's answer (provisioning, without an id until the
// rename lands) promised the target: the runtime follows it with gets, not
// with another create, so waiting for one would leave the claim to be swept
// and the owner with nothing (the kill matrix with a pool found it in CI).
// A claim whose name another create holds is deleted: it carries the
// owner's ids and never returns to the pool.
//
// It says whether the claim is settled: handed out, or up for deletion.
func (s *Service) resumeClaim(ctx context.Context, wn, name string) (settled bool) {
	if !isOwnerName(name) {
		return true
	}
	unlock, err := s.own.request(ctx, name)
	if err != nil {
		return false
	}
	defer unlock()
	inst, err := s.lookup(ctx, name)
	switch {
	case err != nil:
		return false
	case inst != nil:
		s.deleteWarm(ctx, wn, func(w *incus.Instance) bool { return claimOf(w) == name })
		return true
	}
	r, err := s.resumeHandout(ctx, name)
	if err != nil || r != warmHit && r != warmRenaming {
		return false
	}
	s.changes.note(name)
	s.own.kick(name)
	return true
}

// claimsFor is the warm instances claimed for name, for a create (which
// resumes such a hand-out) and a close (which waits for it). Without a
// pool in the catalog none can be made, and none is looked for. Else they
// come from the observation cache while it is confirmed: at 10,000
// instances a filtered list makes Incus read every one, and every
// environment's close ends with a close that finds nothing and asks. A
// claim a live claimant wrote moments ago may not have reached the cache
// yet; its rename then lands under a name answered closed, which the
// closed memory handles (see closed.go). Otherwise, or when fresh, they
// come from Incus.
func (s *Service) claimsFor(ctx context.Context, name string, fresh bool) ([]incus.Instance, error) {
	if !s.poolsOffered() {
		return nil, nil
	}
	claimedFor := func(w *incus.Instance) bool { return isWarmName(w.Name) && claimOf(w) == name }
	if s.cache != nil && !fresh {
		if out, ok := s.cache.find(claimedFor); ok {
			return out, nil
		}
	}
	key, value := claimFilter(name)
	listed, err := s.incus.ListInstancesWithConfig(ctx, key, value)
	if err != nil {
		return nil, err
	}
	out := listed[:0]
	for i := range listed {
		if claimedFor(&listed[i]) {
			out = append(out, listed[i])
		}
	}
	return out, nil
}

// renamingTo says this process has a rename to name under way.
func (p *warmPool) renamingTo(name string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.renaming[name] > 0
}

// poolsOffered says a template of the catalog keeps a warm pool of stopped
// spares: only then can a claim or a hand-out's rename exist.
func (s *Service) poolsOffered() bool {
	for _, t := range s.catalog.Load().All() {
		if t.Stopped() {
			return true
		}
	}
	return false
}

// handable says a warm instance may be handed out for the template.
func handable(w *incus.Instance, templateID, recipe string) bool {
	if !isWarmName(w.Name) || w.Status != incus.InstanceStopped {
		return false
	}
	r := recordOf(w.Config, fWarm|fWarmRecipe|fWarmReady|fWarmClaim)
	return r.Warm == templateID && r.WarmRecipe == recipe && r.has(fWarmReady) && r.WarmClaim == ""
}

// finishHandout gives an unfinished hand-out (at the owner's name without
// the owner's metadata) the owner's metadata and devices, and takes the
// pool's keys off. Idempotent.
func (s *Service) finishHandout(ctx context.Context, inst *incus.Instance, p controller.CreateParams, t *templates.Template) error {
	set, err := s.ownerChange(p, t)
	if err != nil {
		return err
	}
	set.keys |= fPool | fWarmClaim // the pool's keys to none: removed
	set.to.WarmClaim = inst.Name
	devices := s.dialer.Devices(guest.Target{Instance: inst.Name, Port: t.DaemonPort})
	err = s.owned(ctx, inst.Name, func(ctx context.Context) error {
		return s.incus.PatchInstanceIf(ctx, inst.Name, set.config(), devices, "")
	})
	s.listingChanged()
	return err
}

// discardWarm deletes, in the background, a warm instance that a hand-out
// claimed and could not use, after checking that it still is that claim.
func (s *Service) discardWarm(wn, claimedFor string) {
	s.own.spawn(func(ctx context.Context) {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		s.deleteWarm(ctx, wn, func(w *incus.Instance) bool { return claimOf(w) == claimedFor })
	})
}

// warmRetire is the claim a survey writes on a ready spare it is to
// delete (a surplus one, or one its template's catalog entry no longer
// builds), so that no hand-out takes it any more. It is no owner's name.
const warmRetire = "retire"

// retireWarm claims a ready, unclaimed spare for deletion; the survey
// deletes it once retireGrace has passed. Deleting it at once could land
// between a claimant's claim and its rename (another replica's, whose
// conditional claim Incus may apply after the survey read the spare
// unclaimed), and a delete under a rename leaves the owner's name with a
// volume and no instance in Incus 6.0.4 (see warmSurvey). A claimant
// that read the spare before the retire has sent its rename within its
// method's budget; one that reads it after sees the retire and passes.
// Should both writes land, the later one holds: a claim that wins makes
// it that owner's hand-out, and a retire that wins leaves the claimant's
// rename to settle before the delete (the survey waits for any operation
// on the spare, and deletes only while it still carries the retire).
func (s *Service) retireWarm(ctx context.Context, wn string) {
	release, ok := s.warm.tryHold(wn)
	if !ok {
		return // this process is handing it out, or retiring it already
	}
	defer release()
	w, etag, err := s.incus.GetInstance(ctx, wn)
	if err != nil || !isWarmName(w.Name) || claimOf(w) != "" || w.Status != incus.InstanceStopped {
		return
	}
	set := change{keys: fWarmClaim | fWarmClaimAt, to: record{WarmClaim: warmRetire, WarmClaimAt: s.now()}}
	err = s.owned(ctx, wn, func(ctx context.Context) error {
		return s.incus.PatchInstanceConfigIf(ctx, wn, set.config(), etag)
	})
	s.listingChanged()
	if err != nil && ctx.Err() == nil {
		// A claimant came first (412), or Incus refused: the next survey
		// looks again.
		s.log.Debug("warm pool: retiring a spare failed", zap.String("instance", wn), zap.Error(err))
	}
}

// retireGrace is how long a retired spare stands before its delete: past
// the method budget of any claimant that read it before the retire, with
// room for clocks a few seconds apart.
func (s *Service) retireGrace() time.Duration { return s.cfg.MethodBudget + 5*time.Second }

// deleteWarm deletes a stopped warm instance that still passes check.
func (s *Service) deleteWarm(ctx context.Context, wn string, check func(*incus.Instance) bool) {
	w, _, err := s.incus.GetInstance(ctx, wn)
	if err != nil || !isWarmName(w.Name) || !check(w) || w.Status != incus.InstanceStopped {
		return
	}
	if claim := claimOf(w); claim != "" {
		s.log.Info("deleting a claimed warm instance", zap.String("warm", wn), zap.String("claim", claim))
	}
	err = s.owned(ctx, wn, func(ctx context.Context) error {
		op, err := s.incus.DeleteInstance(ctx, wn)
		if err == nil {
			_, err = s.wait(ctx, op, time.Minute)
		}
		return err
	})
	s.listingChanged()
	s.warm.forget(wn)
	if err != nil && !errors.Is(err, incus.ErrNotFound) {
		s.logRetry("deleting a warm instance failed; the pool retries", err, zap.String("instance", wn))
	}
}

// runWarm keeps the pools full until ctx ends: a full look at the
// project's listing every ReconcileInterval, and a refill from memory
// whenever a hand-out took an instance.
func (s *Service) runWarm(ctx context.Context) {
	t := time.NewTicker(s.cfg.ReconcileInterval)
	defer t.Stop()
	s.warmSurvey(ctx)
	for {
		s.warmFill()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.warmSurvey(ctx)
		case <-s.warm.kickc:
			// A hand-out just took an instance, and its start is under
			// way: a refill's create (disk writes, mostly) would slow it.
			if !clock.Sleep(ctx, warmRefillDelay) {
				return
			}
		}
	}
}

// warmWanted maps every slot the pools' sizes want filled to its template.
func (s *Service) warmWanted() map[string]*templates.Template {
	want := map[string]*templates.Template{}
	now := s.now()
	for _, t := range s.catalog.Load().All() {
		if t.Wire.Deprecated || !t.Stopped() {
			continue
		}
		for slot := range s.warmSize(t, now) {
			want[warmName(t.Wire.TemplateID, slot)] = t
		}
	}
	return want
}

// warmSlots maps every slot a pool may hold, up to its maximum, to its
// template: a spare in one and not wanted is kept until it has been idle
// for a shrink period.
func (s *Service) warmSlots() map[string]*templates.Template {
	slots := map[string]*templates.Template{}
	for _, t := range s.catalog.Load().All() {
		if t.Wire.Deprecated || !t.Stopped() {
			continue
		}
		for slot := range t.WarmMax {
			slots[warmName(t.Wire.TemplateID, slot)] = t
		}
	}
	return slots
}

// warmSize is how many spares of t this process wants at now.
func (s *Service) warmSize(t *templates.Template, now time.Time) int {
	return s.warm.demand.size(t, now, s.cfg.WarmBurstWindow, s.cfg.WarmShrinkAfter)
}

// warmSurvey reads the project's listing: what exists, what is ready, and
// what must go (a slot the catalog no longer wants, an instance built
// from another recipe); a create or a hand-out that ended with its
// process finishes here.
func (s *Service) warmSurvey(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	want, slots := s.warmWanted(), s.warmSlots()
	s.warm.mu.Lock()
	idle := len(slots) == 0 && s.warm.surveyed && !s.warm.seen
	s.warm.mu.Unlock()
	// Ready spares and stand-ins are surveyed while offered, and after,
	// while a listing found any.
	idle = idle && !s.readyOffered() && !s.ready.seen()
	if idle {
		return
	}
	list, err := s.instances(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Debug("warm pool: listing failed; retrying on the next round", zap.Error(err))
		}
		return
	}
	s.readySurvey(ctx, list)
	recipes := map[string]string{}
	known := map[string]bool{}
	var drop, retire, retired, ready, resume []incus.Instance
	s.warm.mu.Lock()
	busy := func(n string) bool { return s.warm.filling[n] || s.warm.taken[n] || s.warm.resuming[n] }
	for i := range list {
		w := list[i]
		if !isWarmName(w.Name) {
			continue
		}
		if busy(w.Name) {
			known[w.Name] = s.warm.known[w.Name]
			continue
		}
		t := slots[w.Name]
		if t != nil && recipes[t.Wire.TemplateID] == "" {
			recipes[t.Wire.TemplateID] = recipeOf(templateRequest("", t))
		}
		r := recordOf(w.Config, fPool|fWarmClaim|fWarmClaimAt)
		// Above the size wanted, and idle, ready and unclaimed, for a whole
		// shrink period: demand has gone, the pool shrinks.
		surplus := want[w.Name] == nil && r.has(fWarmReady) && s.now().Sub(r.WarmReady) >= s.cfg.WarmShrinkAfter
		switch {
		case r.WarmClaim == warmRetire:
			// Retired by a survey (this one's or another replica's): deleted
			// once no claimant that read it before the retire can still be
			// renaming it (see retireWarm).
			if at := r.WarmClaimAt; at.IsZero() || s.now().Sub(at) >= s.retireGrace() {
				retired = append(retired, w)
			}
			known[w.Name] = false
			continue
		case r.WarmClaim != "":
			// Never deleted here, however old: a claimant that is alive
			// but slow (a staged create on a loaded daemon renames seconds
			// after its claim) may be renaming it, and Incus 6.0.4 keeps a
			// rename's volume step when a delete removed the record under
			// it, which leaves the owner's name with a volume and no
			// instance, refusing every later create (CI: an owner's 136
			// creates all lost). A resume renames it onto the owner's
			// name, or deletes it once another instance holds that name,
			// where no rename can land.
			if !isOwnerName(r.WarmClaim) {
				drop = append(drop, w) // no owner's name: no rename can be on its way
			} else if at := r.WarmClaimAt; at.IsZero() || s.now().Sub(at) >= min(s.cfg.MethodBudget, s.cfg.WarmStale/2) {
				// Past its claimant's own method budget: a live claimant
				// has sent its rename by now, or never will.
				if r, backing := s.warm.resumeAfter[w.Name]; !backing || !s.now().Before(r.next) {
					resume = append(resume, w)
				}
			}
			// Claimed: not the pool's, but its name is taken until the
			// hand-out moves it, so the slot is not refilled meanwhile
			// (Incus would fail that create, and hold the name with it
			// while the resume waits for its operation to end).
			known[w.Name] = false
			continue
		case t == nil || r.Warm != t.Wire.TemplateID || r.WarmRecipe != recipes[t.Wire.TemplateID] || surplus:
			if r.has(fWarmReady) {
				// Ready spares are handed out: retired first, deleted later.
				retire = append(retire, w)
				known[w.Name] = false
				continue
			}
			drop = append(drop, w)
		case !r.has(fWarmReady):
			ready = append(ready, w)
		}
		known[w.Name] = r.has(fWarmReady) && r.WarmClaim == ""
	}
	s.warm.known = known
	where := map[string]string{}
	for n := range s.warm.filling { // not listed yet, maybe: where its create went
		where[n] = s.warm.where[n]
	}
	for i := range list {
		if isWarmName(list[i].Name) {
			where[list[i].Name] = memberOf(list[i].Location)
		}
	}
	s.warm.where = where
	s.warm.surveyed, s.warm.seen = true, len(known) > 0
	for wn := range s.warm.resumeAfter {
		if _, listed := known[wn]; !listed { // known holds every warm instance listed
			delete(s.warm.resumeAfter, wn)
		}
	}
	s.warm.mu.Unlock()
	for _, w := range drop {
		claim := claimOf(&w) // as listed: one written since keeps it
		s.deleteWarm(ctx, w.Name, func(now *incus.Instance) bool { return claimOf(now) == claim })
	}
	for _, w := range retire {
		s.retireWarm(ctx, w.Name)
	}
	for _, w := range retired {
		if op, err := s.operationOn(ctx, w.Name); err != nil || op != nil {
			continue // a late claimant's rename, maybe: the next survey looks again
		}
		s.deleteWarm(ctx, w.Name, func(now *incus.Instance) bool { return claimOf(now) == warmRetire })
	}
	for _, w := range ready {
		// Listed without its ready mark and created by no one here: a
		// create whose process ended. Ready once Incus has finished it.
		if op, err := s.operationOn(ctx, w.Name); err != nil || op != nil {
			continue
		}
		if err := s.patch(ctx, w.Name, change{keys: fWarmReady, to: record{WarmReady: s.now()}}.config()); err == nil {
			s.warm.mu.Lock()
			s.warm.known[w.Name] = true
			s.warm.mu.Unlock()
		}
	}
	s.warmGauge()
	// Each on its own: a resume waits for the owner's lock and the
	// rename, and the survey (the pool's ready marks, the refill) must
	// not wait for them.
	for _, w := range resume {
		wn, name := w.Name, claimOf(&w)
		s.warm.mu.Lock()
		s.warm.resuming[wn] = true
		s.warm.mu.Unlock()
		done := func() {
			s.warm.mu.Lock()
			delete(s.warm.resuming, wn)
			s.warm.mu.Unlock()
		}
		if !s.own.spawn(func(ctx context.Context) {
			defer done()
			ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			if settled := s.resumeClaim(ctx, wn, name); settled || ctx.Err() == nil {
				s.warm.resumed(wn, settled, s.now(), s.cfg.ReconcileInterval)
			}
		}) {
			done()
		}
	}
}

// warmFill starts a create for every slot not known to exist, within the
// bound on creates in flight, each template's backoff and the memory
// ceiling.
func (s *Service) warmFill() {
	want := s.warmWanted()
	names := make([]string, 0, len(want))
	for n := range want {
		names = append(names, n)
	}
	sort.Strings(names)
	held := s.warmMemoryHeld()
	heldBack := map[string]int{}
	defer func() { s.warmMetrics().heldBack(s.catalog.Load(), heldBack) }()
	s.readyFill(held, heldBack)
	for _, n := range names {
		t := want[n]
		s.warm.mu.Lock()
		skip := s.warm.filling[n] || s.warm.taken[n] || s.now().Before(s.warm.retryAt[t.Wire.TemplateID])
		_, exists := s.warm.known[n]
		s.warm.mu.Unlock()
		if skip || exists {
			continue
		}
		if !s.warmFits(t, held) {
			heldBack[t.Wire.TemplateID]++
			continue
		}
		select {
		case s.warm.sem <- struct{}{}:
		default:
			return // at the bound: the next round goes on
		}
		s.warm.mu.Lock()
		s.warm.filling[n] = true
		s.warm.where[n] = memberOf(t.Placement)
		s.warm.mu.Unlock()
		held[memberOf(t.Placement)] += warmMemory(t)
		if !s.own.spawn(func(wctx context.Context) { s.warmCreate(wctx, n, t) }) {
			<-s.warm.sem
			s.warm.mu.Lock()
			delete(s.warm.filling, n)
			s.warm.mu.Unlock()
			return
		}
	}
}

// warmCreate creates one slot and marks it ready.
func (s *Service) warmCreate(ctx context.Context, name string, t *templates.Template) {
	id, began := t.Wire.TemplateID, s.now()
	ok, exists := false, false
	defer func() {
		s.warm.mu.Lock()
		delete(s.warm.filling, name)
		if ok || exists {
			s.warm.known[name] = ok
		}
		s.warm.mu.Unlock()
		s.refillDone(id, began, ok, ok || exists, !ok && !exists)
	}()
	req := templateRequest(name, t)
	maps.Copy(req.Config, change{keys: fWarm | fWarmRecipe, to: record{Warm: id, WarmRecipe: recipeOf(templateRequest("", t))}}.config())
	req.Start = false
	op, err := s.incus.CreateInstance(ctx, req)
	if err == nil {
		_, err = s.wait(ctx, op, 5*time.Minute)
	}
	s.listingChanged()
	if errors.Is(err, incus.ErrConflict) {
		exists = true // another replica filled the slot
		return
	}
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("warm pool: creating a warm instance failed; backing off", zap.String("template", id), zap.String("instance", name), zap.Error(err))
		}
		return
	}
	for attempt := 0; ; attempt++ {
		err = s.patch(ctx, name, change{keys: fWarmReady, to: record{WarmReady: s.now()}}.config())
		if err == nil || attempt >= 5 || !clock.Sleep(ctx, 200*time.Millisecond) {
			break
		}
	}
	if err != nil {
		exists = true // the survey marks it ready
		return
	}
	ok = true
}

// refillDone ends one refill create of template id, begun at began
// (ok: it made a spare): settled clears the template's backoff, backoff
// doubles it (1 s to 1 min); then the create's place among those in
// flight is freed, the refill counted, and the next one kicked.
func (s *Service) refillDone(id string, began time.Time, ok, settled, backoff bool) {
	s.warm.mu.Lock()
	switch {
	case settled:
		delete(s.warm.delay, id)
		delete(s.warm.retryAt, id)
	case backoff:
		d := min(max(2*s.warm.delay[id], time.Second), time.Minute)
		s.warm.delay[id], s.warm.retryAt[id] = d, s.now().Add(d)
	}
	s.warm.mu.Unlock()
	<-s.warm.sem
	s.warmMetrics().refill(id, ok, s.now().Sub(began))
	s.warmGauge()
	s.warm.kick()
}

// warmGauge sets the pool size per template from what this process knows.
func (s *Service) warmGauge() {
	m := s.warmMetrics()
	if m == nil {
		return
	}
	sizes, wanted := map[string]int{}, map[string]int{}
	now := s.now()
	for _, t := range s.catalog.Load().All() {
		if t.Pooled() {
			sizes[t.Wire.TemplateID] = 0
			wanted[t.Wire.TemplateID] = s.warmSize(t, now)
		}
	}
	slots := s.warmSlots()
	s.warm.mu.Lock()
	for n, ready := range s.warm.known {
		if t := slots[n]; t != nil && ready {
			sizes[t.Wire.TemplateID]++
		}
	}
	s.warm.mu.Unlock()
	s.readyGauge(sizes)
	m.sizes(sizes, wanted)
}

func (s *Service) warmMetrics() *WarmMetrics { return s.cfg.WarmMetrics }

// The memory ceiling (Config.WarmMemoryMax): the memory the warm instances
// may hold on one cluster member, each counted at its template's
// resources.memoryBytes, which the provider's start refuses to leave
// unstated while the ceiling is set. A stopped spare holds none yet; the
// ceiling bounds what the pools commit the host to once spares are handed
// out and started, and what spares kept running or frozen would hold.

// warmMemory is what one warm instance of t is counted at.
func warmMemory(t *templates.Template) int64 {
	if r := t.Wire.Resources; r != nil && r.MemoryBytes != nil {
		return int64(*r.MemoryBytes)
	}
	return 0
}

// memberOf is a location or placement as the ceiling counts it: a member's
// name, or "" where Incus chooses (no placement, a cluster group) or there
// is one host.
func memberOf(location string) string {
	if location == "none" || strings.HasPrefix(location, "@") {
		return ""
	}
	return location
}

// warmMemoryHeld sums the memory of the warm instances known or being
// created, per member.
func (s *Service) warmMemoryHeld() map[string]int64 {
	held := map[string]int64{}
	if s.cfg.WarmMemoryMax <= 0 {
		return held
	}
	slots := s.warmSlots()
	s.warm.mu.Lock()
	defer s.warm.mu.Unlock()
	count := func(n string) {
		if t := slots[n]; t != nil {
			held[s.warm.where[n]] += warmMemory(t)
		}
	}
	for n := range s.warm.known {
		count(n)
	}
	for n := range s.warm.filling {
		if _, listed := s.warm.known[n]; !listed {
			count(n)
		}
	}
	s.readyMemoryHeld(held)
	return held
}

// warmFits says one more warm instance of t stays within the ceiling on
// its member; where Incus chooses the member, on the fullest one.
func (s *Service) warmFits(t *templates.Template, held map[string]int64) bool {
	if s.cfg.WarmMemoryMax <= 0 {
		return true
	}
	on := held[memberOf(t.Placement)]
	if memberOf(t.Placement) == "" {
		for _, n := range held {
			on = max(on, n)
		}
	}
	return on+warmMemory(t) <= s.cfg.WarmMemoryMax
}
