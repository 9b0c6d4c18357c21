package targets

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// Staged creates. While a template keeps a warm pool, hand-outs rename
// instances onto owners' names, and Incus 6.0.4 does not keep a rename and
// a create of one name apart: it renames the volume before the record and
// keeps the volume's rename when the record's fails, so a create landing
// in between leaves the name with a volume and no instance, and every
// later create of it fails ("UNIQUE constraint failed" on the storage
// volume; measured with the incus CLI alone: 2 of 6 concurrent pairs). Two
// renames to one name settle cleanly (8 of 8). So while pools exist, no
// create is sent to an owner's name: the owner's instance is created,
// stopped, under a staging name of its own that already carries the
// owner's metadata and a claim for the owner's name, and is then renamed
// there as a hand-out's warm instance is. A staged instance is a claimed
// warm instance in every other respect: a get or a close of the owner sees
// the claim as a create on its way, a crash leaves it to the pool's survey
// (which resumes the rename once its create has ended), and one is deleted
// only once another instance holds the owner's name.

// stagesCreates says a hand-out may rename onto an owner's name: this
// catalog keeps a pool, or the project holds warm instances (another
// replica's catalog keeps one, say during a rolling change of it).
func (s *Service) stagesCreates() bool {
	if s.poolsOffered() {
		return true
	}
	s.warm.mu.Lock()
	defer s.warm.mu.Unlock()
	return s.warm.seen
}

// stagingName is a name for one staged create for the owner's name: in
// the pool's name space (Name never produces it), never a slot's, and
// carrying a tag of the owner's name (stagedFor) before random digits, so
// that a close can tell a staged create that may be its owner's while
// Incus has not written its record yet.
func stagingName(templateID, name string) string {
	var b [2]byte
	_, _ = rand.Read(b[:])
	return warmStem(templateID) + stagingMark + ownerTag(name) + hex.EncodeToString(b[:])
}

// ownerTag is 6 hex digits of the owner's name's digest: two owners share
// one in 16 million, which costs a close a wait, never a wrong answer.
func ownerTag(name string) string {
	h := sha256.Sum256([]byte("lightspeed/staging/" + name))
	return hex.EncodeToString(h[:3])
}

// isStagingName says a name is a staged create's (see stagingName).
func isStagingName(name string) bool {
	return strings.HasPrefix(name, warmPrefix) && len(name) >= warmStemLen+len(stagingMark) &&
		name[warmStemLen:warmStemLen+len(stagingMark)] == stagingMark
}

// stagingMark follows the stem in a staging name.
const stagingMark = "-s"

// stagedFor says a staging name may be a staged create for name.
func stagedFor(wn, name string) bool {
	return isStagingName(wn) && strings.HasPrefix(wn[warmStemLen+len(stagingMark):], ownerTag(name))
}

// createStaged answers the create of a new owner while pools exist (see
// above). The caller holds the owner's lock and has seen no instance and
// no claim at name.
func (s *Service) createStaged(ctx context.Context, name string, p controller.CreateParams, tmpl *templates.Template) (controller.Observation, error) {
	req, err := s.instanceRequest(name, p, tmpl)
	if err != nil {
		return controller.Observation{}, err
	}
	wn := stagingName(tmpl.Wire.TemplateID, name)
	req.Name, req.Start = wn, false
	maps.Copy(req.Config, change{keys: fWarmClaim | fWarmClaimAt, to: record{WarmClaim: name, WarmClaimAt: s.now()}}.config())
	// This process renames it itself, and its survey must not.
	release := s.warm.hold(wn)
	op, err := s.incus.CreateInstance(ctx, req)
	s.listingChanged()
	if err != nil {
		release()
		// A create that landed with its answer lost is a claim like any
		// other: the owner's next create or the survey finishes it.
		return controller.Observation{}, s.incusError("creating the instance", err)
	}
	s.log.Info("creating an instance for an owner under a staging name", zap.String("instance", name),
		zap.String("staging", wn), zap.String("template", p.TemplateID))
	s.creates.start(name)
	done := make(chan struct{})
	if !s.own.spawn(func(ctx context.Context) {
		defer close(done)
		defer release()
		defer s.creates.end(name)
		s.finishStaged(ctx, name, wn, op)
	}) {
		release()
		s.creates.end(name)
		return controller.Observation{}, jsonrpc.Unavailable(retryAfter, "The provider is shutting down; retry shortly.")
	}
	wait := time.NewTimer(answerWait(ctx, s.cfg.AnswerWithin))
	defer wait.Stop()
	select {
	case <-done:
	case <-wait.C:
	case <-ctx.Done():
	}
	inst, err := s.lookup(ctx, name)
	if err != nil || inst == nil {
		// No record at the name yet, so no id: the runtime asks again, and
		// the claim answers provisioning until the rename lands.
		return creating(p.Owner), nil
	}
	if err := checkOwned(inst, p.Owner); err != nil {
		return controller.Observation{}, err
	}
	s.kickAndWait(ctx, name)
	if after, err := s.lookup(ctx, name); err == nil && after != nil {
		inst = after
	}
	return s.observe(inst, p.Owner), nil
}

// finishStaged waits for a staged create and renames it to the owner's
// name; the reconciler then starts it like any created instance.
func (s *Service) finishStaged(ctx context.Context, name, wn string, op *incus.Operation) {
	_, err := s.wait(ctx, op, 5*time.Minute)
	if ctx.Err() != nil {
		return // shutting down: the next process's survey resumes it
	}
	if err != nil {
		// Nothing was answered with an id: the owner's next create tries
		// again, and whatever Incus left of this one goes.
		s.log.Error("a staged create failed; the owner's next create tries again", zap.String("instance", name),
			zap.String("staging", wn), zap.Error(err))
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		s.deleteWarm(dctx, wn, func(w *incus.Instance) bool { return claimOf(w) == name })
		return
	}
	if s.warmHook != nil && s.warmHook("staged") {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	switch s.renameClaimed(rctx, name, wn) {
	case warmHit:
		s.changes.note(name)
		s.own.kick(name)
	case warmLost:
		// Another replica's create holds the name: its instance is the
		// owner's target, and this one was deleted.
		s.own.kick(name)
	case warmRenaming:
		// followRename starts it once the rename lands.
	default:
		s.log.Info("a staged create's rename is left to the pool's survey", zap.String("instance", name), zap.String("staging", wn))
	}
}
