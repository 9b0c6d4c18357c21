package targets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/internal/ingressurl"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/relays"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// DefaultCacheCorrection is Config.CacheCorrection's default.
const DefaultCacheCorrection = time.Minute

// Config tunes the service; zero values take the defaults.
type Config struct {
	// GracefulStop bounds a close's graceful stop before it is forced.
	GracefulStop time.Duration
	// ReconcileInterval is the period of the full reconcile pass.
	ReconcileInterval time.Duration
	// AnswerWithin bounds how long a method waits on Incus before it answers
	// with the transitional observation; the work goes on in the background.
	AnswerWithin time.Duration
	// StartAttempts is how often the reconciler tries to start a new
	// instance before it records it as failed.
	StartAttempts int
	// MethodBudget bounds every controller method from its start to its
	// answer, whatever Incus does: every Incus call it makes inherits the
	// deadline (default AnswerWithin + 1 s).
	MethodBudget time.Duration
	// Replica names this process among the replicas serving one project
	// (see leases.go); default a random id. Replicas is how many share the
	// project (default 1): each keeps its share of a pool of ready spares
	// (see ready.go).
	Replica  string
	Replicas int
	// IngressBase is the public base of the ingress edge; nil serves no
	// public ingress (the methods answer capabilityUnavailable).
	IngressBase *ingressurl.Base
	// WarmMetrics counts the warm pools' work (see warm.go); nil counts nothing.
	WarmMetrics *WarmMetrics
	// WarmStale bounds how long the pool's survey leaves a claimed warm
	// instance to its claimant: at half of it, or at the method budget if
	// sooner, the survey resumes the hand-out itself (default 1 min).
	WarmStale time.Duration
	// NoCache turns the observation cache off (see cache.go): every read
	// goes to Incus. CacheMetrics, when set, records the cache's work.
	NoCache      bool
	CacheMetrics *CacheMetrics
	// WarmBurstWindow and WarmShrinkAfter size the pools by demand (see
	// warmsize.go): the span a burst of creates is counted over, and how
	// long a burst keeps a pool large and a spare above the size waits
	// before it is deleted (defaults 30 s and 10 min).
	WarmBurstWindow, WarmShrinkAfter time.Duration
	// WarmMemoryMax bounds the memory the warm instances may hold on one
	// member, each counted at its template's memoryBytes (see warm.go);
	// 0 sets no bound.
	WarmMemoryMax int64
	// CacheCorrection is the period of the cache's correcting full list
	// (default 1 min). Events keep the cache true; the list is for an event
	// lost with no gap the stream shows (a cluster member's link to the
	// others dropping), and it costs a decode of the whole project: 32 MiB
	// of JSON at 10,000 instances, most of an idle provider's CPU if it
	// were listed every reconcile interval.
	CacheCorrection time.Duration
}

func (c *Config) defaults() {
	if c.GracefulStop <= 0 {
		c.GracefulStop = 10 * time.Second
	}
	if c.ReconcileInterval <= 0 {
		c.ReconcileInterval = 10 * time.Second
	}
	if c.AnswerWithin <= 0 {
		c.AnswerWithin = 1500 * time.Millisecond
	}
	if c.StartAttempts <= 0 {
		c.StartAttempts = 3
	}
	if c.MethodBudget <= 0 {
		c.MethodBudget = c.AnswerWithin + time.Second
	}
	if c.WarmStale <= 0 {
		c.WarmStale = time.Minute
	}
	if c.WarmBurstWindow <= 0 {
		c.WarmBurstWindow = DefaultWarmBurstWindow
	}
	if c.WarmShrinkAfter <= 0 {
		c.WarmShrinkAfter = DefaultWarmShrinkAfter
	}
	if c.CacheCorrection <= 0 {
		c.CacheCorrection = DefaultCacheCorrection
	}
}

// Service implements controller.Backend on Incus.
type Service struct {
	incus *incus.Client
	// catalog is swapped whole by SetCatalog (a SIGHUP reload); each
	// method reads it once.
	catalog atomic.Pointer[templates.Catalog]
	dialer  guest.Dialer
	log     *zap.Logger
	cfg     Config
	now     func() time.Time

	// own is each instance's one owner in this process: its turn to act
	// in Incus, its converge and its request (see owner.go).
	own *owners
	// waking are the requests for running that a wake acted on and is
	// recording now, by instance (see Wake, PowerDownPending).
	waking  byName[time.Time]
	listing listing
	// relays is the process's relay registry: no power-down without it.
	relays *relays.Registry
	// failMu guards lockedSince.
	failMu sync.Mutex
	// lockedSince is when an instance was first seen refusing writes with
	// no task on it (see strandedLock).
	lockedSince map[string]time.Time
	// progress is what the power moves this process carries out wait for.
	progress progressTable
	// pending are power requests answered but not yet recorded (see
	// pendingTable); projectMu orders this process's writes of the copy
	// the project's config keeps (see pendingstore.go).
	pending pendingTable
	// written are intents this process wrote, checked again once settled
	// (see written.go).
	written   writtenTable
	projectMu sync.Mutex
	// kept tells whether the power requests the project keeps (see
	// pendingstore.go) have been read once since the reconciler started.
	kept keptKnown
	// creates are the creates this process answered and still follows.
	creates createTable
	// closed are the names this process answered closed (see closed.go).
	closed closedTable
	// changes tells the idle loop which targets this process changed (see idle.go).
	changes changeFeed
	// leases are this replica's relay leases on instances (see leases.go),
	// and leaseKey names this replica's.
	leases   leaseTable
	leaseKey leaseKey
	// ingress maps the edge's labels to routed targets (see ingress.go).
	ingress ingressIndex
	// ingressChanges are the instances whose cached record changed, for
	// the ingress index (see followIngress).
	ingressChanges changeFeed
	// warm is this process's view of the warm pools (see warm.go), and
	// ready its ready spares (see ready.go).
	warm  warmPool
	ready readyPool
	// warmHook, set by tests only, is called at each step of a hand-out
	// (true stops it there as a crash would), and where a get has read an
	// owner's name empty ("get-absent"), the window a rename can land in.
	warmHook func(stage string) bool
	// cache answers reads while Incus's event stream keeps it current; nil
	// when turned off (see cache.go).
	cache *obsCache
}

// New builds the service. Call Run to start its reconciler. The relay
// registry is the one the process's data routes enter every relay in: the
// service consults it before every power-down.
func New(client *incus.Client, catalog *templates.Catalog, dialer guest.Dialer, reg *relays.Registry, log *zap.Logger, cfg Config) (*Service, error) {
	if client == nil || catalog == nil || dialer == nil || reg == nil {
		return nil, errors.New("targets: the Incus client, catalog, guest dialer and relay registry are all required")
	}
	cfg.defaults()
	if cfg.Replica == "" {
		cfg.Replica = RandomReplica()
	}
	if !ValidReplica(cfg.Replica) {
		return nil, fmt.Errorf("targets: replica id %q: use 1 to 32 lowercase letters, digits and dashes, starting with a letter or digit", cfg.Replica)
	}
	if log == nil {
		log = zap.NewNop()
	}
	s := &Service{incus: client, dialer: dialer, relays: reg, log: log, cfg: cfg, now: time.Now,
		lockedSince: map[string]time.Time{}}
	s.kept.known = make(chan struct{})
	s.leases.expires, s.leases.kicked = map[string]time.Time{}, map[string]time.Time{}
	s.leaseKey = leaseKeyOf(cfg.Replica)
	s.ingress.init()
	s.warm.init()
	s.ready.init()
	s.own = newOwner(s.converge)
	s.catalog.Store(catalog)
	cfg.WarmMetrics.Start(catalog)
	if !cfg.NoCache {
		s.cache = newObsCache(client, log.Named("cache"), cfg.CacheMetrics, cfg.CacheCorrection, func(name string) {
			s.changes.note(name)
			if s.IngressEnabled() { // else no one reads the feed
				s.ingressChanges.note(name)
			}
		})
		s.cache.onConfirm = s.listingChanged
	}
	return s, nil
}

// SetCatalog replaces the templates offered from now on, resolved and
// checked by the caller. Targets made from a template the new catalog no
// longer has keep what their instance recorded (see powerStates).
func (s *Service) SetCatalog(c *templates.Catalog) {
	if c != nil {
		s.catalog.Store(c)
		s.cfg.WarmMetrics.Start(c)
		s.warm.kick()
	}
}

var _ controller.Backend = (*Service)(nil)

// retryAfter is what an unavailable answer asks the runtime to wait.
const retryAfter = 2000

// incusError turns a failed Incus call into the protocol's answer.
func (s *Service) incusError(what string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) || incus.IsRetryable(err) {
		return jsonrpc.Unavailable(retryAfter, "Incus did not answer while %s; retry shortly.", what)
	}
	s.log.Error("incus call failed", zap.String("while", what), zap.Error(err))
	return jsonrpc.Errorf(jsonrpc.KindInternal, "Incus refused a call while %s; the provider's log has the details.", what)
}

// observeMargin is what a method's budget keeps back, after waiting for
// background work, to read what Incus then shows and answer.
const observeMargin = 500 * time.Millisecond

// budget bounds a method: every Incus call it makes inherits the deadline.
func (s *Service) budget(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.MethodBudget)
}

// answerWait is how long a method may still wait for background work: at
// most `most`, and never into the margin its budget keeps for answering.
func answerWait(ctx context.Context, most time.Duration) time.Duration {
	dl, ok := ctx.Deadline()
	if !ok {
		return most
	}
	return max(min(most, time.Until(dl)-observeMargin), 0)
}

// kickAndWait converges name and waits for that step within what the
// method may still wait.
func (s *Service) kickAndWait(ctx context.Context, name string) {
	wait := time.NewTimer(answerWait(ctx, s.cfg.AnswerWithin))
	defer wait.Stop()
	select {
	case <-s.own.kick(name):
	case <-wait.C:
	}
}

// lockTarget takes the owner's lock within the method's budget.
func (s *Service) lockTarget(ctx context.Context, name string) (func(), error) {
	unlock, err := s.own.request(ctx, name)
	if err != nil {
		return nil, jsonrpc.Unavailable(retryAfter, "Another request for this target is still waiting on Incus; retry shortly.")
	}
	return unlock, nil
}

// ListTemplates answers template/list: every universe sees the whole catalog.
func (s *Service) ListTemplates(_ context.Context, _ string) ([]controller.Template, error) {
	return s.catalog.Load().Wire(), nil
}

// lookup reads the instance at name from Incus; nil without error when
// there is none. What it reads is offered to the observation cache, so the
// cache never answers older than what this process has seen.
func (s *Service) lookup(ctx context.Context, name string) (*incus.Instance, error) {
	at := s.cache.mark(name)
	inst, err := s.lookupIncus(ctx, name)
	if err == nil {
		s.cache.offer(name, at, inst)
	}
	return inst, err
}

func (s *Service) lookupIncus(ctx context.Context, name string) (*incus.Instance, error) {
	gctx, cancel := context.WithTimeout(ctx, getAttempt(ctx))
	inst, _, err := s.incus.GetInstance(gctx, name)
	cancel()
	if errors.Is(err, incus.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		if ctx.Err() == nil && memberTrouble(err) {
			// On a cluster, a GET is answered by the member that holds the
			// instance: while that member is down it is refused, hangs or
			// fails. The cluster's list still knows the instance (status
			// Error, its member as location), which reads as unknown.
			if found, ferr := s.incus.FindInstance(ctx, name); ferr == nil && found != nil && found.Status == incus.InstanceError {
				return found, nil
			}
		}
		return nil, err
	}
	return inst, nil
}

// getAttempt bounds one instance GET: a member that does not answer must
// leave time, within the caller's deadline, to ask the cluster's list.
func getAttempt(ctx context.Context) time.Duration {
	const most = 1500 * time.Millisecond
	if dl, ok := ctx.Deadline(); ok {
		return min(most, max(time.Until(dl)/2, 50*time.Millisecond))
	}
	return most
}

// memberTrouble says an instance GET failed on Incus's side rather than
// with an answer about the instance: a server error, no connection, or no
// answer in time.
func memberTrouble(err error) bool {
	var e *incus.Error
	if errors.As(err, &e) {
		return e.Status == 0 || e.Status >= 500
	}
	return errors.Is(err, context.DeadlineExceeded)
}

func ownerMismatch(id string) error {
	return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "ownerMismatch",
		"The target %s does not belong to this owner; a target is reached only through its own owner.", id)
}

// checkOwned refuses an instance whose recorded owner is not the caller.
func checkOwned(inst *incus.Instance, owner controller.Owner) error {
	if (unreadable(inst) || unfinishedHandout(inst)) && inst.Name == Name(owner) {
		return nil
	}
	got, ok := ownerOf(inst)
	if !ok || got != owner {
		return ownerMismatch(inst.Name)
	}
	return nil
}

// resolve finds the owner's instance. A targetId other than the owner's own
// name is checked for another owner's target (ownerMismatch) before anything
// else, and is otherwise not the owner's: notFound.
func (s *Service) resolve(ctx context.Context, ref controller.TargetRef) (name string, inst *incus.Instance, err error) {
	return s.resolveWith(ctx, ref, s.lookup)
}

// resolveWith is resolve reading instances with read (lookup, or the
// cache's read for a pure read).
func (s *Service) resolveWith(ctx context.Context, ref controller.TargetRef,
	read func(context.Context, string) (*incus.Instance, error)) (name string, inst *incus.Instance, err error) {
	name = Name(ref.Owner)
	if isReadyName(ref.TargetID) {
		// A ready spare handed out: its claim names its owner.
		other, err := read(ctx, ref.TargetID)
		if err != nil {
			return "", nil, s.incusError("looking up a target", err)
		}
		if other != nil {
			if got, ours := ownerOf(other); ours {
				if got != ref.Owner {
					return "", nil, ownerMismatch(ref.TargetID)
				}
				return other.Name, other, nil
			}
		}
		return "", nil, jsonrpc.Errorf(jsonrpc.KindNotFound, "This provider holds no target %q for this owner.", ref.TargetID)
	}
	if ref.TargetID != "" && ref.TargetID != name {
		if looksLikeTargetID(ref.TargetID) {
			other, err := read(ctx, ref.TargetID)
			if err != nil {
				return "", nil, s.incusError("looking up a target", err)
			}
			if other != nil {
				if _, ours := ownerOf(other); ours {
					return "", nil, ownerMismatch(ref.TargetID)
				}
			}
		}
		return "", nil, jsonrpc.Errorf(jsonrpc.KindNotFound, "This provider holds no target %q for this owner.", ref.TargetID)
	}
	inst, err = read(ctx, name)
	if err != nil {
		return "", nil, s.incusError("looking up the owner's target", err)
	}
	if inst != nil && standinOf(inst) != "" {
		target, st, err := s.follow(ctx, ref.Owner, inst, read)
		if err != nil {
			return "", nil, s.incusError("looking up the owner's target", err)
		}
		if st != standinHeld {
			return name, nil, nil // a hand-out under way, or nothing (see getNothing)
		}
		return target.Name, target, nil
	}
	if inst != nil {
		if err := checkOwned(inst, ref.Owner); err != nil {
			return "", nil, err
		}
	}
	return name, inst, nil
}

// GetTarget is a pure read. It answers from the observation cache, but a
// notFound or an ownerMismatch only once Incus confirms it (readSure).
func (s *Service) GetTarget(ctx context.Context, ref controller.TargetRef) (controller.Observation, error) {
	ctx, cancel := s.budget(ctx)
	defer cancel()
	name, inst, err := s.resolveWith(ctx, ref, s.readFor(ref.Owner))
	if err != nil {
		return controller.Observation{}, err
	}
	if inst == nil {
		return s.getNothing(ctx, ref, name)
	}
	return s.observe(inst, ref.Owner), nil
}

// notHeld is the notFound of an owner for whom this provider holds nothing.
func notHeld() error {
	return jsonrpc.Errorf(jsonrpc.KindNotFound, "This provider holds no target for this owner.")
}

// getNothing answers a get that read no instance under the owner's name.
// notFound fails a provisioning environment at once, so it is kept for an
// owner for whom nothing is on its way: a create this process answered
// before Incus wrote its record (under load the record can take seconds),
// or a warm hand-out whose rename has not landed, is provisioning, as the
// create's own answer said. Incus's list of operations is not asked: it
// cannot tell a create from the delete of a target just closed without
// reading a human description, and a closed target must not read as
// provisioning.
//
// The name was read before the claims, so a hand-out's rename can land
// between the two reads: the name read empty and the claim is gone (CI
// answered notFound so, for an owner whose hand-out had just landed). The
// claims are therefore read from Incus, never the cache (which can lag a
// claim's write or run ahead of the name's read), and the name is read
// again after them: no claim at one instant and no instance at a later one
// is an owner nothing is on its way to. Both reads are on the rare path
// of an absence.
func (s *Service) getNothing(ctx context.Context, ref controller.TargetRef, name string) (controller.Observation, error) {
	if s.warmHook != nil {
		s.warmHook("get-absent")
	}
	pending := s.creates.following(name) || s.warm.renamingTo(name)
	if !pending && !s.poolsOffered() && !s.readyOffered() && !s.ready.seen() {
		return controller.Observation{}, notHeld()
	}
	if !pending {
		claimed, err := s.claimsFor(ctx, name, true)
		if err != nil {
			return controller.Observation{}, s.incusError("checking for a hand-out in progress", err)
		}
		pending = len(claimed) > 0
	}
	_, inst, st, err := s.atOwnersName(ctx, name, ref.Owner)
	switch {
	case err != nil:
		return controller.Observation{}, s.incusError("looking up the owner's target", err)
	case st == standinPending:
		return controller.Observation{TargetID: ref.TargetID, Owner: ref.Owner, Phase: controller.PhaseProvisioning,
			Message: "Handing out a ready spare."}, nil
	case st == standinStale:
		return controller.Observation{}, notHeld()
	case inst != nil:
		if err := checkOwned(inst, ref.Owner); err != nil {
			return controller.Observation{}, err
		}
		return s.observe(inst, ref.Owner), nil
	}
	if !pending {
		return controller.Observation{}, notHeld()
	}
	// No record yet, so no id: the runtime, which has none either, asks
	// again (an id it holds is answered back, the one thing it can be).
	return controller.Observation{TargetID: ref.TargetID, Owner: ref.Owner, Phase: controller.PhaseProvisioning,
		Message: "The instance is being created; Incus holds no record of it yet."}, nil
}

// CreateTarget is idempotent per owner: the owner's existing target is
// observed without any policy check; otherwise the template's policy applies
// and Incus creates and starts the instance in the background.
func (s *Service) CreateTarget(ctx context.Context, p controller.CreateParams) (controller.Observation, error) {
	ctx, cancel := s.budget(ctx)
	defer cancel()
	name := Name(p.Owner)
	unlock, err := s.lockTarget(ctx, name)
	if err != nil {
		return controller.Observation{}, err
	}
	defer unlock()
	tmpl, ok := s.catalog.Load().Get(p.TemplateID)
	read := s.lookup
	if ok && tmpl.Ready() {
		// From the cache: a hand-out's first write is the stand-in's
		// create, which Incus refuses while anything holds the name, and
		// that refusal is answered from Incus (answerAt).
		read = s.read
	}
	inst, err := read(ctx, name)
	if err != nil {
		return controller.Observation{}, s.incusError("looking up the owner's target", err)
	}
	if inst != nil && standinOf(inst) != "" {
		// A hand-out of a ready spare: finished, left unfinished, or stale.
		target, r := s.resumeReady(ctx, name, inst, p)
		switch r {
		case warmHit:
			return s.observe(target, p.Owner), nil
		case warmCrashed:
			return controller.Observation{}, jsonrpc.Unavailable(retryAfter, "The provider stopped while handing out a ready spare; retry shortly.")
		case warmMiss:
			inst = nil // the stale stand-in is gone: a hand-out or a create follows
		default:
			return handingOut(p.Owner), nil
		}
	}
	if inst == nil && s.creates.following(name) {
		// This process sent a create for the name whose instance Incus has
		// not recorded there yet. Another would race it: a staged one is a
		// second instance for the owner (24 owners racing a pool of one,
		// asking again every 100 ms, made up to three each), and each adds
		// to a loaded daemon's work. The create under way answers later.
		return creating(p.Owner), nil
	}
	if inst == nil && s.poolsOffered() {
		if inst, err = s.afterEarlierTask(ctx, name); err != nil {
			return controller.Observation{}, err
		}
	}
	if inst != nil {
		if err := checkOwned(inst, p.Owner); err != nil {
			return controller.Observation{}, err
		}
		if unfinishedHandout(inst) {
			return s.answerHandout(ctx, name, p)
		}
		return s.observe(inst, p.Owner), nil
	}
	var refusal error
	switch {
	case !ok:
		refusal = jsonrpc.Errorf(jsonrpc.KindNotFound, "No template %q is offered; template/list names the ones this provider serves.", p.TemplateID)
	case tmpl.Wire.Deprecated:
		refusal = jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "templateDeprecated",
			"The template %q is deprecated and creates no new targets; choose another from template/list.", p.TemplateID)
	}
	if refusal != nil {
		return s.refuseUnlessHeld(ctx, name, p.Owner, refusal)
	}
	// What this create puts under the name is the owner's, whatever an
	// earlier close was answered.
	s.closed.forget(name)
	switch r, err := s.resumeHandout(ctx, name); {
	case err != nil:
		return controller.Observation{}, s.incusError("looking for a hand-out to the owner's name", err)
	case r == warmRenaming:
		return handingOut(p.Owner), nil
	case r == warmHit, r == warmLost, r == warmBusy:
		return s.answerHandout(ctx, name, p)
	}
	if tmpl.Pooled() {
		// Counted before the hand-out: a create that drains the pool
		// makes it grow at once, not at the next one.
		s.warm.demand.note(tmpl.Wire.TemplateID, s.now(), s.cfg.WarmShrinkAfter)
		s.warmGauge()
		s.warm.kick()
	}
	if tmpl.Ready() {
		switch r, inst := s.handoutReady(ctx, name, p, tmpl); r {
		case warmHit:
			s.warmMetrics().handout(tmpl.Wire.TemplateID, true)
			return s.observe(inst, p.Owner), nil
		case warmLost:
			return s.answerAt(ctx, name, p.Owner)
		case warmCrashed:
			return controller.Observation{}, jsonrpc.Unavailable(retryAfter, "The provider stopped while handing out a ready spare; retry shortly.")
		}
	}
	switch s.handout(ctx, name, p, tmpl) {
	case warmRenaming:
		// The method's time is spent: no look at Incus to answer it.
		s.warmMetrics().handout(tmpl.Wire.TemplateID, true)
		return handingOut(p.Owner), nil
	case warmHit:
		s.warmMetrics().handout(tmpl.Wire.TemplateID, true)
		return s.answerHandout(ctx, name, p)
	case warmLost, warmBusy:
		return s.answerHandout(ctx, name, p)
	case warmCrashed:
		return controller.Observation{}, jsonrpc.Unavailable(retryAfter, "The provider stopped while handing out a warm instance; retry shortly.")
	}
	if tmpl.Pooled() {
		s.warmMetrics().handout(tmpl.Wire.TemplateID, false)
	}
	if s.stagesCreates() {
		// A hand-out may rename onto this name at any time: see staged.go.
		return s.createStaged(ctx, name, p, tmpl)
	}
	req, err := s.instanceRequest(name, p, tmpl)
	if err != nil {
		return controller.Observation{}, err
	}
	op, err := s.incus.CreateInstance(ctx, req)
	s.listingChanged()
	if err != nil {
		// Created-but-answer-lost and lost races both end here: whatever
		// Incus now holds under the name is the answer.
		again, lerr := s.lookup(ctx, name)
		if lerr == nil && again != nil && standinOf(again) != "" {
			return s.answerAt(ctx, name, p.Owner)
		}
		if lerr == nil && again != nil {
			if err := checkOwned(again, p.Owner); err != nil {
				return controller.Observation{}, err
			}
			return s.observe(again, p.Owner), nil
		}
		return controller.Observation{}, s.incusError("creating the instance", err)
	}
	s.log.Info("creating an instance for an owner", zap.String("instance", name), zap.String("template", p.TemplateID))
	// The create is followed from now on: should it fail after this answer,
	// the owner is not left with an id that answers notFound.
	s.creates.start(name)
	// An id is answered only once Incus holds the instance record, so that
	// a get, a close or a restart that follows the answer finds it; until
	// then the answer carries none (the contract allows an asynchronous
	// create to answer without an id) and the runtime asks again.
	recorded, err := s.awaitRecord(ctx, name, op)
	s.changes.note(name) // counted at once, not at the next listing
	if !s.own.spawn(func(ctx context.Context) { s.finishCreate(ctx, name, op, req, recorded) }) {
		s.creates.end(name)
	}
	if err != nil {
		return controller.Observation{}, err
	}
	o := creating(p.Owner)
	if recorded {
		o.TargetID = name
	}
	return o, nil
}

// answerAt answers a create that lost the owner's name to another create:
// what that one put there, the owner's target or a stand-in leading to it.
func (s *Service) answerAt(ctx context.Context, name string, owner controller.Owner) (controller.Observation, error) {
	_, target, _, err := s.atOwnersName(ctx, name, owner)
	if err != nil {
		return controller.Observation{}, s.incusError("looking up the owner's target", err)
	}
	if target == nil {
		return handingOut(owner), nil
	}
	if err := checkOwned(target, owner); err != nil {
		return controller.Observation{}, err
	}
	return s.observe(target, owner), nil
}

// handingOut answers a create whose hand-out's rename has not landed: no
// id yet, and the runtime asks again.
func handingOut(o controller.Owner) controller.Observation {
	return controller.Observation{Owner: o, Phase: controller.PhaseProvisioning, Message: "Handing out a warm instance."}
}

// creating is the answer to a create whose instance Incus has not recorded
// at the owner's name yet: no id, and the runtime asks again.
func creating(owner controller.Owner) controller.Observation {
	return controller.Observation{Owner: owner, Phase: controller.PhaseProvisioning, Message: "Creating and starting the instance."}
}

// refuseUnlessHeld answers a create that the template's policy refuses,
// for an owner with no instance found: unless Incus is still creating the
// owner's instance, sent by an earlier create this or another process
// answered (a process restarted meanwhile, with the template deprecated
// by then, met one on a loaded machine: Incus records an instance only
// once its create task runs). The owner then holds a target, and no
// creation policy applies to it: its observation is the answer. The
// check runs only before a refusal, which is rare.
func (s *Service) refuseUnlessHeld(ctx context.Context, name string, owner controller.Owner, refusal error) (controller.Observation, error) {
	if s.poolsOffered() {
		return controller.Observation{}, refusal // afterEarlierTask has waited out any task already
	}
	inst, err := s.afterEarlierTask(ctx, name)
	if err != nil {
		return controller.Observation{}, err
	}
	if inst == nil {
		return controller.Observation{}, refusal
	}
	if standinOf(inst) != "" {
		return s.answerAt(ctx, name, owner)
	}
	if err := checkOwned(inst, owner); err != nil {
		return controller.Observation{}, err
	}
	return s.observe(inst, owner), nil
}

// afterEarlierTask lets an Incus task already on the owner's name end
// before a create sends anything there, and answers what it left there.
// Such a task is a create an earlier request sent (from a process killed
// since, or another replica) whose record Incus has not written yet. A
// hand-out renaming a warm instance onto the name then lands in between,
// and Incus 6.0 fails both: the create is reverted, and the owner's
// volume record stays behind without an instance, refusing every later
// create of the name (found by the kill matrix with a pool: a target
// answered with an id, then notFound for good). Without a pool no rename
// can land there, and a create sent on top of another only fails, so the
// check (a list of Incus's tasks, which costs a loaded daemon time out of
// the create's budget) is made only when a template has a pool. The wait
// is the answer bound's; a task that outlives it is answered unavailable,
// and the runtime asks again.
func (s *Service) afterEarlierTask(ctx context.Context, name string) (*incus.Instance, error) {
	op, err := s.operationOn(ctx, name)
	if err != nil {
		return nil, s.incusError("checking for a task on the owner's name", err)
	}
	if op == nil {
		return nil, nil
	}
	s.log.Info("a create waits for an earlier task on the owner's name", zap.String("instance", name),
		zap.String("task", op.ID), zap.String("description", op.Description))
	// An error is that create failing, which frees the name again.
	if recorded, _ := s.awaitRecord(ctx, name, op); !recorded {
		if op, err := s.operationOn(ctx, name); err != nil || op != nil {
			return nil, jsonrpc.Unavailable(retryAfter, "Incus is still working on an earlier request for this target; retry shortly.")
		}
	}
	inst, err := s.lookup(ctx, name)
	if err != nil {
		return nil, s.incusError("looking up the owner's target", err)
	}
	return inst, nil
}

// awaitRecord waits, within the answer bound, for the instance to exist or
// the create operation to end; recorded says Incus holds the record.
func (s *Service) awaitRecord(ctx context.Context, name string, op *incus.Operation) (recorded bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, answerWait(ctx, s.cfg.AnswerWithin))
	defer cancel()
	for delay := 10 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		inst, err := s.lookup(ctx, name)
		if err == nil && inst != nil {
			// A stand-in there is another create's (a hand-out's, see
			// ready.go): this one fails, and the owner's next create
			// follows the stand-in.
			return standinOf(inst) == "", nil
		}
		if cur, err := s.incus.RefreshOperation(ctx, op); err == nil && cur.Final() {
			if again, _ := s.lookup(ctx, name); again != nil {
				return standinOf(again) == "", nil
			}
			if cur.StatusCode >= incus.StatusFailure {
				if other, oerr := s.operationOn(ctx, name); oerr == nil && other != nil {
					// Another create of the owner's name (another
					// replica's, sent a moment apart) holds it, and
					// Incus refused this one: routine, and that one
					// decides.
					s.log.Info("a create lost the owner's name to another create under way", zap.String("instance", name),
						zap.String("task", other.ID), zap.String("incus", cur.Err))
					return false, jsonrpc.Unavailable(retryAfter, "Incus is still working on an earlier request for this target; retry shortly.")
				}
				s.log.Error("instance create failed", zap.String("instance", name), zap.String("incus", cur.Err))
				return false, jsonrpc.Unavailable(retryAfter, "Incus could not create the instance; the provider's log has the details. Retry shortly.")
			}
			return false, nil
		}
		select {
		case <-ctx.Done():
			// Still going: Incus finishes the operation whatever we do, and
			// the owner's next create or get observes it.
			return false, nil
		case <-time.After(delay):
		}
	}
}

// finishCreate follows a create this process answered until Incus is done
// with it. Should it fail and leave no instance after its id was handed out
// (idGiven), while the owner has not asked for a close, it records the
// failure on an empty instance under the owner's name, so that the id
// answers failed with a message rather than notFound (which would fail the
// environment for nothing), and a close removes it like any target. An
// answer without an id leaves nothing to record: the runtime asks again.
func (s *Service) finishCreate(ctx context.Context, name string, op *incus.Operation, req incus.InstancesPost, idGiven bool) {
	defer s.creates.end(name)
	_, err := s.wait(ctx, op, 5*time.Minute)
	if ctx.Err() != nil {
		return // shutting down: Incus goes on, and the next process observes it
	}
	if err == nil {
		s.own.kick(name)
		return
	}
	unlock, lockErr := s.own.request(ctx, name)
	if lockErr != nil {
		return
	}
	defer unlock()
	inst, lerr := s.lookup(ctx, name)
	switch {
	case lerr != nil:
		s.log.Error("a create failed and its outcome cannot be read", zap.String("instance", name), zap.Error(err), zap.NamedError("read", lerr))
		return
	case inst != nil:
		s.own.kick(name) // another create won the name, or it exists all the same
		return
	case !idGiven:
		s.log.Warn("a create answered without an id failed; the owner's next create tries again",
			zap.String("instance", name), zap.Error(err))
		return
	case s.creates.closeAsked(name):
		return
	}
	s.log.Error("a create failed after its answer; recording the failure on the owner's name",
		zap.String("instance", name), zap.Error(err))
	config := make(map[string]string, len(req.Config)+1)
	for k, v := range req.Config {
		if strings.HasPrefix(k, "user.") {
			config[k] = v
		}
	}
	maps.Copy(config, change{keys: fFailure, to: record{Failure: "Incus could not create the instance; the provider's log has the details."}}.config())
	rec, cerr := s.incus.CreateInstance(ctx, incus.InstancesPost{Name: name, Type: req.Type,
		Source: incus.InstanceSource{Type: "none"}, Config: config, Profiles: req.Profiles, Target: req.Target})
	if cerr == nil {
		_, cerr = s.wait(ctx, rec, time.Minute)
	}
	s.listingChanged()
	if cerr != nil && !errors.Is(cerr, incus.ErrConflict) {
		s.log.Error("recording a failed create failed: the owner's target answers notFound",
			zap.String("instance", name), zap.Error(cerr))
	}
}

// createTable holds the creates this process answered and still follows,
// and whether a close was asked of one meanwhile.
type createTable struct {
	mu sync.Mutex
	m  map[string]bool // name → a close was asked
}

func (t *createTable) start(name string) {
	t.mu.Lock()
	if t.m == nil {
		t.m = map[string]bool{}
	}
	t.m[name] = false
	t.mu.Unlock()
}

func (t *createTable) end(name string) {
	t.mu.Lock()
	delete(t.m, name)
	t.mu.Unlock()
}

// askClose notes a close of a followed create; false when none is followed.
func (t *createTable) askClose(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.m[name]; !ok {
		return false
	}
	t.m[name] = true
	return true
}

// following says this process follows a create of name.
func (t *createTable) following(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.m[name]
	return ok
}

func (t *createTable) closeAsked(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[name]
}

// answerHandout answers the create of an owner whose name holds an
// instance from the pool (or one another create put there meanwhile):
// the hand-out is finished, the instance started within the answer bound,
// and what Incus then shows is the answer.
func (s *Service) answerHandout(ctx context.Context, name string, p controller.CreateParams) (controller.Observation, error) {
	inst, err := s.lookup(ctx, name)
	if err != nil {
		return controller.Observation{}, s.incusError("looking up the owner's target", err)
	}
	if inst == nil {
		// The rename is still under way: no id yet, and the runtime asks again.
		return handingOut(p.Owner), nil
	}
	if err := checkOwned(inst, p.Owner); err != nil {
		return controller.Observation{}, err
	}
	if unfinishedHandout(inst) {
		tmpl, ok := s.catalog.Load().Get(recordOf(inst.Config, fWarm).Warm)
		if !ok {
			tmpl, ok = s.catalog.Load().Get(p.TemplateID)
		}
		if !ok {
			return controller.Observation{}, jsonrpc.Errorf(jsonrpc.KindNotFound, "No template %q is offered; template/list names the ones this provider serves.", p.TemplateID)
		}
		if err := s.finishHandout(ctx, inst, p, tmpl); err != nil {
			return controller.Observation{}, s.incusError("finishing the hand-out of a warm instance", err)
		}
	}
	s.changes.note(name)
	s.kickAndWait(ctx, name)
	after, err := s.lookup(ctx, name)
	if err != nil {
		// The instance is at the owner's name with the owner's metadata:
		// the create is under way whatever this answer says.
		s.logRetry("observing a hand-out failed; answering provisioning", err, zap.String("instance", name))
		return controller.Observation{TargetID: name, Owner: p.Owner, Phase: controller.PhaseProvisioning,
			Message: "Handing out a warm instance."}, nil
	}
	if after == nil {
		return handingOut(p.Owner), nil
	}
	return s.observe(after, p.Owner), nil
}

func (s *Service) instanceRequest(name string, p controller.CreateParams, t *templates.Template) (incus.InstancesPost, error) {
	req := templateRequest(name, t)
	owner, err := s.ownerChange(p, t)
	if err != nil {
		return incus.InstancesPost{}, err
	}
	maps.Copy(req.Config, owner.config())
	for k, d := range s.dialer.Devices(guest.Target{Instance: name, Port: t.DaemonPort}) {
		req.Devices[k] = d
	}
	req.Start = true
	return req, nil
}

// ownerChange writes the owner's metadata and first intent for a new
// target: into a create, or onto a warm instance a hand-out claims.
func (s *Service) ownerChange(p controller.CreateParams, t *templates.Template) (change, error) {
	c := change{
		keys: fIntent | fOwned | fTemplate | fImage | fDaemonPort | fCreatedAt,
		to: record{
			Intent:     Intent{Power: controller.PowerRunning, At: s.now(), By: ByCreate},
			Schema:     schemaVersion,
			Owner:      p.Owner,
			Template:   t.Wire.TemplateID,
			Image:      t.Fingerprint,
			DaemonPort: t.DaemonPort,
			CreatedAt:  s.now(),
		},
	}
	if p.DisplayName != "" {
		c.keys |= fDisplayName
		c.to.DisplayName = p.DisplayName
	}
	policy := p.Idle
	if policy == nil {
		policy = t.Wire.Idle
	}
	if policy != nil {
		if err := c.to.setIdle(policy); err != nil {
			return change{}, err
		}
		c.keys |= fIdle
	}
	return c, nil
}

// templateRequest is the template's part of an instance create: what every
// instance of it is built from, apart from its owner (and the guest
// dialer's devices, which are named for the instance). The warm pool
// builds its instances from it.
func templateRequest(name string, t *templates.Template) incus.InstancesPost {
	config := map[string]string{}
	devices := map[string]map[string]string{}
	if r := t.Wire.Resources; r != nil {
		if r.VCPUs != nil {
			config["limits.cpu"] = strconv.FormatUint(uint64(*r.VCPUs), 10)
		}
		if r.MemoryBytes != nil {
			config["limits.memory"] = strconv.FormatUint(*r.MemoryBytes, 10) + "B"
		}
		if r.DiskBytes != nil {
			devices["root"] = map[string]string{"type": "disk", "path": "/", "pool": t.StoragePool,
				"size": strconv.FormatUint(*r.DiskBytes, 10) + "B"}
		}
	}
	for _, pw := range t.Wire.PowerStates {
		if pw == controller.PowerSuspended {
			config["migration.stateful"] = "true"
		}
	}
	return incus.InstancesPost{
		Name:     name,
		Type:     t.InstanceType,
		Source:   incus.InstanceSource{Type: "image", Fingerprint: t.Fingerprint},
		Config:   config,
		Devices:  devices,
		Profiles: t.Profiles,
		Target:   t.Placement,
	}
}

// CloseTarget records the close in the instance's metadata and lets the
// reconciler stop and delete it, answering closing until nothing remains.
func (s *Service) CloseTarget(ctx context.Context, ref controller.TargetRef) (controller.Observation, error) {
	ctx, cancel := s.budget(ctx)
	defer cancel()
	name := Name(ref.Owner)
	if ref.TargetID != "" && ref.TargetID != name {
		// Another owner's id is refused; an id that is no one's does not stop
		// the owner's own target from being closed.
		if _, _, err := s.resolve(ctx, ref); err != nil {
			var rpcErr *jsonrpc.Error
			if errors.As(err, &rpcErr) && rpcErr.Kind != jsonrpc.KindNotFound {
				return controller.Observation{}, err
			}
		}
		ref.TargetID = ""
	}
	// A close is answered closing only once it is recorded on the
	// instance: a create still under way has no record to carry it yet, and
	// a closing answer held only in memory would let that create finish
	// into a running target no one closes (this process may stop before
	// it, or the create may be another process's). So the close waits,
	// within its answer bound, for the record or for the create to end.
	patience := time.Now().Add(answerWait(ctx, s.cfg.AnswerWithin))
	var unlock func()
	var err error
	var inst *incus.Instance
	for delay := 10 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		unlock, err = s.lockTarget(ctx, name)
		if err != nil {
			return controller.Observation{}, err
		}
		if _, inst, err = s.resolve(ctx, ref); err != nil {
			unlock()
			return controller.Observation{}, err
		}
		if inst != nil {
			break
		}
		if dropped, err := s.closeStandin(ctx, name, ref.Owner); err != nil || dropped {
			unlock()
			if err != nil {
				return controller.Observation{}, s.incusError("closing a hand-out's stand-in", err)
			}
			continue
		}
		// A create this process follows that fails now must not leave a
		// record of its failure behind a close answered closed.
		following := s.creates.askClose(name)
		unlock()
		pending := following
		if !pending {
			if pending, err = s.arriving(ctx, name); err != nil {
				return controller.Observation{}, s.incusError("checking for a create in progress", err)
			}
		}
		if !pending {
			s.closed.note(name, s.now())
			return controller.Observation{Owner: ref.Owner, Phase: controller.PhaseClosed}, nil
		}
		if time.Now().Add(delay).After(patience) || !clock.Sleep(ctx, delay) {
			return controller.Observation{}, jsonrpc.Unavailable(retryAfter,
				"The instance is still being created or handed out and holds no record yet to carry the close; retry shortly.")
		}
	}
	// The owner's target: the instance at the owner's name, or the spare
	// a stand-in there leads to (which a close deletes before the stand-in).
	lock := name
	name = inst.Name
	// Public ingress goes first: the edge answers the host 404 from now on,
	// whatever the stop and delete take.
	s.ingress.closing(name)
	rec := recordOf(inst.Config, fClosing|fIngressRouted)
	if !rec.has(fClosing) || unfinishedHandout(inst) {
		c := change{keys: fClosing, to: record{Closing: s.now()}}
		if unfinishedHandout(inst) {
			// The owner's name holds a hand-out that stopped before the
			// owner's metadata: it gets what makes it the owner's target,
			// so the reconciler deletes it like one.
			c.keys |= fOwned
			c.to.Schema, c.to.Owner = schemaVersion, ref.Owner
		}
		if rec.has(fIngressRouted) {
			c.keys |= fIngressRouted // to not routed: removed
		}
		set := c.config()
		err := s.patch(ctx, name, set)
		if errors.Is(err, incus.ErrBusy) {
			// An operation holds the instance and the server refuses
			// config changes until it ends (LXD keeps a start running
			// until the instance's devices are up): the close waits for
			// it, within the method's budget.
			if err = s.settle(ctx, name); err == nil {
				err = s.patch(ctx, name, set)
			}
		}
		if err != nil {
			unlock()
			return controller.Observation{}, s.incusError("recording the close", err)
		}
		s.log.Info("recorded a close", zap.String("instance", name))
		// Again after the write: a reconcile pass that listed before it must
		// not put the route back.
		s.ingress.drop(name)
	}
	unlock()
	s.changes.note(name)
	s.kickAndWait(ctx, name)
	after, err := s.lookup(ctx, name)
	if err != nil {
		// The close is recorded: the reconciler carries it out whatever
		// this answer says, so it is closing, not unavailable (a refusal
		// the runtime would take for a close that did not happen).
		s.logRetry("observing a recorded close failed; answering closing", err, zap.String("instance", name))
		recorded := *inst
		recorded.Config = maps.Clone(inst.Config)
		if !rec.has(fClosing) {
			change{keys: fClosing, to: record{Closing: s.now()}}.applyTo(recorded.Config)
		}
		return s.observe(&recorded, ref.Owner), nil
	}
	if after == nil {
		// Gone: closed, unless another create or hand-out is still on its
		// way to the name (another replica's, which lost the name to the
		// target just deleted and would now win it).
		if pending, perr := s.arriving(ctx, lock); perr != nil || pending {
			if name != lock && perr == nil {
				// The stand-in is what is left: it goes last.
				s.dropStandin(ctx, lock, name)
				if at, lerr := s.lookup(ctx, lock); lerr == nil && at == nil {
					s.closed.note(lock, s.now())
					return controller.Observation{TargetID: name, Owner: ref.Owner, Phase: controller.PhaseClosed}, nil
				}
			}
			return controller.Observation{TargetID: name, Owner: ref.Owner, Phase: controller.PhaseClosing,
				Message: "Waiting for a create of this target under way in Incus to end, to close what it leaves."}, nil
		}
		s.closed.note(lock, s.now())
		return controller.Observation{TargetID: name, Owner: ref.Owner, Phase: controller.PhaseClosed}, nil
	}
	return s.observe(after, ref.Owner), nil
}

// createPending reports an Incus operation still creating the named
// instance (or starting it, or any other on it).
func (s *Service) createPending(ctx context.Context, name string) (bool, error) {
	op, err := s.operationOn(ctx, name)
	return op != nil, err
}

// arriving says an instance may still appear at name, though a read
// found none: an Incus operation on the name (a create), a warm hand-out
// claimed for it (whose rename Incus lists under the warm name only), or
// an instance there after all. The operations are listed before the name
// is read again, which closes the gap in which a create finishes between
// the first read and the listing.
func (s *Service) arriving(ctx context.Context, name string) (bool, error) {
	ops, err := s.incus.ListOperations(ctx)
	if err != nil {
		return false, err
	}
	if opOn(ops, name) != nil {
		return true, nil
	}
	if claimed, err := s.handoutPending(ctx, name); err != nil || claimed {
		return claimed, err
	}
	if claimed, err := s.claimInFlight(ctx, ops, name); err != nil || claimed {
		return claimed, err
	}
	again, err := s.lookup(ctx, name)
	return again != nil, err
}

// claimInFlight says a warm instance with an Incus task under way (a
// staged create, a spare's create, a hand-out's rename) is claimed for
// name. The observation cache hears of an instance
// another replica is creating only once Incus tells, which can be after
// its create has run for seconds; a close that answered closed meanwhile
// would have the claim's rename land a target under a name answered
// closed, which only the answering process's memory closes (closed.go)
// and which a kill of that process would leave running (found by
// TestClusterWarmRacesAndAKill). The tasks are few, so each such instance
// is read from Incus.
func (s *Service) claimInFlight(ctx context.Context, ops []incus.Operation, name string) (bool, error) {
	if !s.stagesCreates() { // no pool in the catalog, and none seen in Incus
		return false, nil
	}
	seen := map[string]bool{}
	for _, op := range ops {
		if op.Held() {
			continue
		}
		for _, urls := range op.Resources {
			for _, u := range urls {
				wn, ok := strings.CutPrefix(u, "/1.0/instances/")
				if !ok {
					continue
				}
				wn, _, _ = strings.Cut(wn, "?")
				if !isWarmName(wn) || seen[wn] {
					continue
				}
				seen[wn] = true
				w, _, err := s.incus.GetInstance(ctx, wn)
				switch {
				case errors.Is(err, incus.ErrNotFound):
					// Renamed or deleted a moment ago, or a create that has
					// not written its record yet, which Incus does only
					// after the image's first unpack into the pool (many
					// seconds for a large image). Only a staged create is
					// created with a claim (a pool slot is claimed by a
					// write to its record), and its name carries a tag of
					// its owner's: one that may be this owner's counts as
					// claimed. Counting every one held closes of owners
					// with nothing for all of a first unpack.
					if stagedFor(wn, name) {
						return true, nil
					}
				case err != nil:
					return false, err
				case claimOf(w) == name:
					return true, nil
				}
			}
		}
	}
	return false, nil
}

// operationOn is an unfinished Incus task on the named instance, if any.
// Sessions (an exec the guest dialer holds open) are not counted: they end
// when their client lets go, not on their own.
func (s *Service) operationOn(ctx context.Context, name string) (*incus.Operation, error) {
	ops, err := s.incus.ListOperations(ctx)
	if err != nil {
		return nil, err
	}
	return opOn(ops, name), nil
}

// opOn is the unfinished task of ops on the named instance, if any.
func opOn(ops []incus.Operation, name string) *incus.Operation {
	want := "/1.0/instances/" + name
	for i, op := range ops { // ListOperations lists unfinished ones only
		if op.Held() {
			continue
		}
		for _, urls := range op.Resources {
			for _, u := range urls {
				if u == want || (len(u) > len(want) && u[:len(want)+1] == want+"?") {
					return &ops[i]
				}
			}
		}
	}
	return nil
}

// settle waits, within ctx, until no Incus operation holds the instance
// (at most three in a row: a start can follow a create).
func (s *Service) settle(ctx context.Context, name string) error {
	_, err := s.settled(ctx, name)
	return err
}

// settled is settle, saying whether it waited for any task.
func (s *Service) settled(ctx context.Context, name string) (waited bool, err error) {
	for range 3 {
		op, err := s.operationOn(ctx, name)
		if err != nil || op == nil {
			return waited, err
		}
		waited = true
		if _, err := s.incus.Wait(ctx, op); err != nil && ctx.Err() != nil {
			return waited, err
		}
	}
	return waited, nil
}
