package targets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// The pending store. A power request answered while an Incus operation
// holds the instance (a graceful stop, a start) cannot be written on the
// instance until the operation ends: Incus refuses an instance's config
// changes meanwhile. Held in memory only, a provider killed in that window
// lost an answered request (the kill matrix found it: a setPower running
// answered during a stop, and the target ended stopped). So the request is
// written where Incus does accept writes then, the project's config, under
// a key of the instance's (see record.go), and kept there until it is on
// the instance (or outranked, or the instance gone). Every reconcile pass
// reads the project once and takes every stored request back into memory,
// so a process started after the kill, or another replica, finishes it.
//
// Incus 6.0.4 writes a project whole (its PATCH replaces the config, as a
// PUT does), so each write is a read and an ETag-conditional PUT, made one
// at a time in this process. The keys are few and short-lived: only
// requests waiting on an operation are there.

// sameIntent compares intents as the store keeps them: to the millisecond.
func sameIntent(a, b Intent) bool {
	return a.Power == b.Power && a.By == b.By && a.At.UnixMilli() == b.At.UnixMilli()
}

func (s *Service) projectName() string {
	if p := s.incus.Project(); p != "" {
		return p
	}
	return "default"
}

// storePending writes w to the project unless a newer request for name is
// stored already.
func (s *Service) storePending(ctx context.Context, name string, w pendingWrite) error {
	return s.editProject(ctx, func(cfg map[string]string) bool {
		if cur, _, ok := pendingIn(cfg, name); ok && !w.intent.At.After(cur.intent.At) {
			return false
		}
		putPending(cfg, name, w)
		return true
	})
}

// clearPending removes name's stored request if it is still w.
func (s *Service) clearPending(ctx context.Context, name string, w pendingWrite) {
	err := s.editProject(ctx, func(cfg map[string]string) bool {
		got, present, ok := pendingIn(cfg, name)
		if !present {
			return false
		}
		if ok && !sameIntent(got.intent, w.intent) {
			return false // a newer one is stored: it is flushed in its turn
		}
		dropPending(cfg, name)
		return true
	})
	if err != nil && ctx.Err() == nil {
		// Harmless: the next pass takes it back, finds it outranked or
		// recorded, and clears it again.
		s.log.Debug("clearing a stored power request failed", zap.String("instance", name), zap.Error(err))
	}
}

// editProject applies edit to the project's config and writes it back
// unless edit says nothing changed, retrying on a concurrent write.
func (s *Service) editProject(ctx context.Context, edit func(map[string]string) bool) error {
	s.projectMu.Lock()
	defer s.projectMu.Unlock()
	project := s.projectName()
	for attempt := 0; ; attempt++ {
		p, etag, err := s.incus.GetProjectETag(ctx, project)
		if err != nil {
			return err
		}
		cfg := maps.Clone(p.Config)
		if cfg == nil {
			cfg = map[string]string{}
		}
		if !edit(cfg) {
			return nil
		}
		err = s.incus.UpdateProjectIf(ctx, project, p.Description, cfg, etag)
		if !errors.Is(err, incus.ErrPreconditionFailed) || attempt >= 5 {
			return err
		}
	}
}

// adoptStoredPending takes name's request from the project into memory
// when it asks for another power than power and is newer than what memory
// holds, and says whether it did. A read that fails adopts nothing: the
// pass restores it later, as it restores every stored request.
func (s *Service) adoptStoredPending(ctx context.Context, name string, power controller.Power) bool {
	p, err := s.incus.GetProject(ctx, s.projectName())
	if err != nil {
		s.log.Debug("reading a stored power request failed", zap.String("instance", name), zap.Error(err))
		return false
	}
	w, _, ok := pendingIn(p.Config, name)
	if !ok || w.intent.Power == power {
		return false
	}
	if cur, held := s.pending.get(name); held && !w.intent.At.After(cur.intent.At) {
		return false
	}
	s.pending.put(name, w)
	return true
}

// restorePending takes every request the project stores back into memory
// and has the reconciler flush it.
func (s *Service) restorePending(ctx context.Context) {
	p, err := s.incus.GetProject(ctx, s.projectName())
	if err != nil {
		if ctx.Err() == nil {
			s.log.Debug("reading stored power requests failed; retrying on the next pass", zap.Error(err))
		}
		return
	}
	defer s.kept.read()
	kept, bad := pendingAll(p.Config)
	for name, v := range bad {
		s.log.Warn("a stored power request does not decode; dropping it", zap.String("instance", name), zap.String("value", v))
		s.clearPending(ctx, name, pendingWrite{})
	}
	for name, w := range kept {
		if cur, ok := s.pending.get(name); ok && !w.intent.At.After(cur.intent.At) {
			continue
		}
		s.pending.put(name, w)
		s.own.kick(name)
	}
}

// strandedAfter is how long an instance may refuse writes with no Incus
// task on it before its lock is taken for a stranded one.
const strandedAfter = 3 * time.Second

// strandedLock frees an instance a dead process's graceful stop left
// locked (the caller saw a write refused for a stop's hold). Incus 6.0.4 keeps a graceful stop's lock on the instance after
// the stop's task failed its timeout (the guest ignored the halt): with no
// task listed, every write is refused ("busy running a stop operation")
// for as long as no forced stop comes (measured: over a minute; a forced
// stop frees it at once). The process that sent the stop forces it after
// its grace; one killed before that leaves the instance so, and a request
// kept for it could never be recorded. Once the refusal has lasted
// strandedAfter with no task on the instance, the stop is forced, as its
// sender would have; the kept request is then recorded, and carried out.
func (s *Service) strandedLock(ctx context.Context, name string) {
	if op, err := s.operationOn(ctx, name); err != nil || op != nil {
		s.failMu.Lock()
		delete(s.lockedSince, name)
		s.failMu.Unlock()
		return
	}
	s.failMu.Lock()
	since, ok := s.lockedSince[name]
	if !ok {
		s.lockedSince[name] = s.now()
	}
	s.failMu.Unlock()
	if !ok || s.now().Sub(since) < strandedAfter {
		return
	}
	s.log.Warn("an instance refuses writes with no Incus task on it (a graceful stop's lock left behind); forcing the stop",
		zap.String("instance", name))
	err := s.act(ctx, name, incus.InstanceStatePut{Action: incus.ActionStop, Force: true}, time.Minute)
	s.failMu.Lock()
	delete(s.lockedSince, name)
	s.failMu.Unlock()
	if err != nil && !isAlreadyStopped(err) && ctx.Err() == nil {
		s.logRetry("forcing a stranded stop failed; retrying", err, zap.String("instance", name))
	}
}

// keptKnown is whether this process has read the project's kept requests
// since its reconciler started. A use (a dial, an ingress request) that
// finds its target running, with no power-down recorded on the instance
// nor held in memory, is relayed without a write; a request a killed
// process kept on the project is older than that use, yet once restored
// it would be carried out over it, and the use's answer lost (the kill
// matrix: a dial relayed 1.4 s into a fresh process, its target paused
// afterwards by the request the previous process had kept). So such a use
// waits, within its own bound, for the first read. A service whose
// reconciler never runs restores nothing, and is not waited for.
type keptKnown struct {
	started atomic.Bool
	once    sync.Once
	known   chan struct{}
}

// read marks the kept requests read (and taken into memory).
func (k *keptKnown) read() { k.once.Do(func() { close(k.known) }) }

// wait returns once the kept requests are known, or with ctx's error.
func (k *keptKnown) wait(ctx context.Context) error {
	if !k.started.Load() {
		return nil
	}
	select {
	case <-k.known:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("targets: the power requests kept on the project are not read yet: %w", ctx.Err())
	}
}
