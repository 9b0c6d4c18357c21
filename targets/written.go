package targets

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// Intents this process wrote are looked at again once their write has
// settled. Incus checks a PATCH's ETag before it applies the write, not
// with it: two replicas that read one ETag can both pass the check, and
// the write applied last stays, whatever its request's time. Within one
// process the instance's turn (owner.go) orders a name's writes; across replicas, an
// older request applied over a newer one would be carried out, and the
// newer one lost. So the replica that wrote the newer one reads the
// instance again writtenFirstLook and writtenLastLook after its write, and
// records its request again should an older one be on the instance.
// (Only the newer request's writer can tell: to the older one's writer,
// its own value looks right.) A write Incus still holds in flight past
// writtenLastLook escapes the check; none was seen near that long.
const (
	writtenFirstLook = time.Second
	writtenLastLook  = 5 * time.Second
)

// writtenIntent is an intent this process wrote, and when.
type writtenIntent struct {
	intent Intent
	at     time.Time
}

// writtenTable holds the intents written and not yet settled, by name.
type writtenTable struct{ byName[writtenIntent] }

func (t *writtenTable) put(name string, in Intent, now time.Time) {
	t.putUnless(name, writtenIntent{intent: in, at: now}, nil)
}

// drop forgets name's entry if it is still w (a newer write keeps its own).
func (t *writtenTable) drop(name string, w writtenIntent) {
	t.dropIf(name, func(cur writtenIntent) bool { return cur == w })
}

func (t *writtenTable) forget(name string) { t.dropIf(name, nil) }

// lookIn is how soon name's written intent is due to be looked at again
// (0: nothing written, or due now).
func (t *writtenTable) lookIn(name string, now time.Time) time.Duration {
	w, ok := t.get(name)
	if !ok {
		return 0
	}
	age := now.Sub(w.at)
	switch {
	case age < writtenFirstLook:
		return writtenFirstLook - age
	case age < writtenLastLook:
		return writtenLastLook - age
	}
	return 0
}

// wrote records a write of in on name and asks the reconciler to look at
// it once it has settled.
func (s *Service) wrote(name string, in Intent) {
	s.written.put(name, in, time.Now())
	s.own.soon(name, writtenFirstLook)
}

// rewriteOvertaken records again the intent this process wrote on inst
// when an older request is on the instance now, and says whether it did.
// An entry whose write has settled is dropped.
func (s *Service) rewriteOvertaken(ctx context.Context, inst *incus.Instance) bool {
	name := inst.Name
	w, ok := s.written.get(name)
	if !ok {
		return false
	}
	st := StateOf(inst)
	recorded := st.Intent
	// An older request for the same power overtakes nothing: the target
	// goes where this one asked.
	overtaken := st.Phase == controller.PhaseActive && recorded.Power != "" && recorded.Power != w.intent.Power &&
		recorded.At.Before(w.intent.At.Truncate(time.Millisecond))
	if !overtaken {
		if time.Since(w.at) >= writtenLastLook {
			s.written.drop(name, w)
		}
		return false
	}
	s.log.Warn("an older power request was applied over a newer one this process recorded; recording the newer one again",
		zap.String("instance", name), zap.String("recorded", string(recorded.Power)), zap.Time("recorded_at", recorded.At),
		zap.String("newer", string(w.intent.Power)), zap.Time("newer_at", w.intent.At))
	_, wrote, err := s.want(ctx, name, w.intent, change{}, nil)
	switch {
	case errors.Is(err, ErrSuperseded):
		s.written.drop(name, w) // newer still than this one: not ours to mend
	case err != nil:
		s.logRetry("recording the newer power request again failed; the reconciler retries", err,
			zap.String("instance", name))
	}
	return wrote
}
