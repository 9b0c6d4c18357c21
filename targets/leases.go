package targets

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"regexp"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Replicas coordinate their data connections through Incus alone. Each
// replica that relays a connection to a target keeps a lease on the
// instance, a key of its own that holds the lease's expiry (record.Relays),
// renewed while it relays and removed when it stops. A
// power-down by any replica waits (explicit) or yields (idle) while another
// replica's lease is live, and a replica that relays to a target whose
// recorded power is an explicit power-down closes its relays first, with
// going-away frames (its own reconciler drives the request at once), which
// ends its lease. A replica that dies leaves a
// lease that expires by itself.
const (
	// leaseTTL is how long a lease stands unrenewed: how long a dead
	// replica's relays hold off power-downs at most.
	leaseTTL = 30 * time.Second
	// leaseRenew is how often a live lease is written again.
	leaseRenew = 10 * time.Second
	// leaseWatch is how often a replica reads the targets it relays to, to
	// see another replica's power-down: the longest a setPower through
	// another replica waits for this one to start closing.
	leaseWatch = 500 * time.Millisecond
)

// replicaName is what a replica id may be: it becomes part of a key.
var replicaName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)

// ValidReplica says whether id can name a replica.
func ValidReplica(id string) bool { return replicaName.MatchString(id) }

// RandomReplica is a fresh replica id, for a process not given one.
func RandomReplica() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return "r" + hex.EncodeToString(b)
}

// foreignLeases counts the live leases other replicas hold, of an
// instance's leases (record.Relays).
func foreignLeases(leases map[string]time.Time, self string, now time.Time) int {
	n := 0
	for id, until := range leases {
		if id != self && until.After(now) {
			n++
		}
	}
	return n
}

// leaseChange writes this replica's lease on an instance: until when it
// stands, or none to remove it.
func (s *Service) leaseChange(until time.Time) change {
	return change{keys: fRelays, to: record{Relays: map[string]time.Time{s.cfg.Replica: until}}}
}

// leaseTable is what this replica last wrote of its own leases.
type leaseTable struct {
	mu      sync.Mutex
	expires map[string]time.Time
	// kicked is the power-down request last handed to the reconciler, by
	// instance.
	kicked map[string]time.Time
}

// runLeases keeps this replica's leases true and hands a target another
// replica powers down to this replica's reconciler, which closes its relays
// first. It ends with ctx, and then removes
// the leases it holds (best effort, bounded).
func (s *Service) runLeases(ctx context.Context) {
	t := time.NewTicker(leaseWatch)
	defer t.Stop()
	for {
		s.leaseRound(ctx)
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Second)
			s.dropLeases(dctx, nil)
			cancel()
			return
		case <-t.C:
		case <-s.relays.Opened():
		}
	}
}

func (s *Service) leaseRound(ctx context.Context) {
	open := s.relays.Instances()
	held := make(map[string]bool, len(open))
	for _, name := range open {
		held[name] = true
		if !looksLikeTargetID(name) {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		s.leaseOne(rctx, name)
		cancel()
	}
	s.dropLeases(ctx, held)
}

// leaseOne renews the lease on one relayed target, or, when its recorded
// power is an explicit power-down, has this replica carry that out (which
// closes its relays) instead.
func (s *Service) leaseOne(ctx context.Context, name string) {
	// From the observation cache when it answers: another replica's
	// power-down is a config write, whose event sends this read to Incus
	// until the cache has read it again.
	inst, err := s.read(ctx, name)
	if err != nil || inst == nil {
		return
	}
	st := StateOf(inst)
	if st.Phase == controller.PhaseActive && st.Intent.Power != "" && st.Intent.Power != controller.PowerRunning && st.Intent.By != ByIdle {
		// An explicit power-down, most likely through another replica:
		// this replica's own reconciler carries it out now rather than at
		// its next pass, and that first closes this replica's relays (then
		// the lease goes). Once per request, so its retries keep their
		// backoff.
		s.leases.mu.Lock()
		seen := s.leases.kicked[name].Equal(st.Intent.At)
		s.leases.kicked[name] = st.Intent.At
		s.leases.mu.Unlock()
		if !seen {
			s.own.kick(name)
		}
		return
	}
	now := s.now()
	s.leases.mu.Lock()
	exp, ok := s.leases.expires[name]
	s.leases.mu.Unlock()
	if ok && exp.Sub(now) > leaseTTL-leaseRenew {
		return
	}
	next := now.Add(leaseTTL)
	if err := s.patch(ctx, name, s.leaseChange(next).config()); err != nil {
		s.log.Debug("writing a relay lease failed; retrying", zap.String("instance", name), zap.Error(err))
		return
	}
	s.leases.mu.Lock()
	s.leases.expires[name] = next
	s.leases.mu.Unlock()
}

// dropLeases removes this replica's leases on targets it no longer relays
// to (every lease when held is nil).
func (s *Service) dropLeases(ctx context.Context, held map[string]bool) {
	s.leases.mu.Lock()
	var drop []string
	for name := range s.leases.expires {
		if !held[name] {
			drop = append(drop, name)
		}
	}
	for name := range s.leases.kicked {
		if !held[name] {
			delete(s.leases.kicked, name)
		}
	}
	s.leases.mu.Unlock()
	for _, name := range drop {
		if ctx.Err() != nil {
			return
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := s.patch(rctx, name, s.leaseChange(time.Time{}).config())
		cancel()
		if err != nil && !errors.Is(err, incus.ErrNotFound) {
			s.log.Debug("removing a relay lease failed; retrying", zap.String("instance", name), zap.Error(err))
			continue
		}
		s.leases.mu.Lock()
		delete(s.leases.expires, name)
		s.leases.mu.Unlock()
	}
}

// forgetStaleLease removes a lease of this replica's name that this process
// did not write and does not hold: one an earlier run of the same replica
// left when it was killed. Other replicas ignore it once expired; this
// keeps it from lingering on the instance.
func (s *Service) forgetStaleLease(ctx context.Context, inst *incus.Instance) {
	if !s.leaseKey.heldIn(inst.Config) || s.relays.Open(inst.Name) > 0 {
		return
	}
	s.leases.mu.Lock()
	_, ours := s.leases.expires[inst.Name]
	s.leases.mu.Unlock()
	if ours {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := s.patch(rctx, inst.Name, s.leaseChange(time.Time{}).config()); err != nil && !errors.Is(err, incus.ErrNotFound) {
		s.log.Debug("removing an earlier run's relay lease failed; retrying on the next pass", zap.String("instance", inst.Name), zap.Error(err))
	}
}
