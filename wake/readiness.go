package wake

import (
	"sync"
	"time"
)

// readiness remembers the running instances whose daemon answered a
// data-plane initialize, so that their uses cost no extra round trip. It
// is forgotten on every power change the provider makes or sees, and when a
// use finds the daemon silent.
type readiness struct {
	mu      sync.Mutex
	ready   map[string]struct{}
	unready map[string]time.Time // since when a probe of the instance has gone unanswered
	// down holds the instances last seen powered down, so that a dial
	// Incus cannot answer for is told the likelier truth (waking).
	down map[string]struct{}
	// odd holds, per instance, the last answer to initialize that was not
	// a compatible success, as already logged: it outlives power changes so
	// that a daemon of another version is logged once, not once per wake.
	odd map[string]string
}

func newReadiness() *readiness {
	return &readiness{ready: map[string]struct{}{}, unready: map[string]time.Time{}, down: map[string]struct{}{}, odd: map[string]string{}}
}

// oddAnswer records an incompatible answer of the instance's daemon and
// says whether it differs from the one recorded last (and so is news).
func (r *readiness) oddAnswer(instance, answer string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.odd[instance] == answer {
		return false
	}
	r.odd[instance] = answer
	return true
}

// compatible records that the instance's daemon answered a compatible
// success, so that a later incompatible answer is news again.
func (r *readiness) compatible(instance string) {
	r.mu.Lock()
	delete(r.odd, instance)
	r.mu.Unlock()
}

// seen records whether the instance was last seen powered down.
func (r *readiness) seen(instance string, poweredDown bool) {
	r.mu.Lock()
	if poweredDown {
		r.down[instance] = struct{}{}
	} else {
		delete(r.down, instance)
	}
	r.mu.Unlock()
}

func (r *readiness) lastDown(instance string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.down[instance]
	return ok
}

func (r *readiness) ok(instance string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.ready[instance]
	return ok
}

func (r *readiness) mark(instance string) {
	r.mu.Lock()
	r.ready[instance] = struct{}{}
	delete(r.unready, instance)
	r.mu.Unlock()
}

func (r *readiness) forget(instance string) {
	r.mu.Lock()
	delete(r.ready, instance)
	r.mu.Unlock()
}

// silent records a probe that found no answer and says for how long the
// daemon has been silent.
func (r *readiness) silent(instance string, now time.Time) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	since, ok := r.unready[instance]
	if !ok {
		r.unready[instance] = now
		return 0
	}
	return now.Sub(since)
}

func (r *readiness) silentSince(instance string) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	since, ok := r.unready[instance]
	return since, ok
}

// drop forgets everything about an instance that is gone.
func (r *readiness) drop(instance string) {
	r.mu.Lock()
	delete(r.ready, instance)
	delete(r.unready, instance)
	delete(r.down, instance)
	delete(r.odd, instance)
	r.mu.Unlock()
}
