package targets

import (
	"sort"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/templates"
)

// Pools sized by demand. A template's pool keeps between warm (its
// minimum) and warmMax spares. The size wanted is the largest burst of
// creates of the template seen within one burst window (30 s) during the
// last shrink period (10 min), and a quarter more, within those bounds. A
// burst that drains the pool is followed by a bigger one; once no such
// burst has come for a shrink period, the size is the minimum again.
//
// Growth is this process's own reading: each replica counts the creates it
// answers, and fills the slots its own size wants (a slot is a name, so
// replicas never fill one twice). Shrinking is by idleness, which every
// replica reads alike from Incus: a spare above the size this process
// wants is deleted only once it has waited, ready and unclaimed, for a
// whole shrink period. A replica that still sees demand hands such a spare
// out long before, so replicas that disagree on the size delete and refill
// a slot at most once a shrink period.

// Defaults of Config.WarmBurstWindow and Config.WarmShrinkAfter.
const (
	DefaultWarmBurstWindow = 30 * time.Second
	DefaultWarmShrinkAfter = 10 * time.Minute
)

// demandKept bounds the arrivals kept per template. A burst larger than
// this is larger than any pool (templates.MaxWarm), so the size it asks is
// the maximum either way.
const demandKept = 8 * templates.MaxWarm

// demand is the creates of each pooled template, as this process answered
// them.
type demand struct {
	mu       sync.Mutex
	arrivals map[string][]time.Time // per template, oldest first, within the shrink period
}

// note counts one create of a new owner's target from the template.
func (d *demand) note(templateID string, at time.Time, keep time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.arrivals == nil {
		d.arrivals = map[string][]time.Time{}
	}
	a := append(d.arrivals[templateID], at)
	a = trimArrivals(a, at.Add(-keep))
	if len(a) > demandKept {
		a = a[len(a)-demandKept:]
	}
	d.arrivals[templateID] = a
}

// size is how many spares of t the pool wants at now.
func (d *demand) size(t *templates.Template, now time.Time, window, keep time.Duration) int {
	if !t.Pooled() {
		return 0
	}
	if t.WarmMax == t.Warm {
		return t.Warm
	}
	d.mu.Lock()
	burst := 0
	if a, ok := d.arrivals[t.Wire.TemplateID]; ok {
		a = trimArrivals(a, now.Add(-keep))
		d.arrivals[t.Wire.TemplateID] = a
		burst = largestBurst(a, window)
	}
	d.mu.Unlock()
	return min(max(t.Warm, (burst*5+3)/4), t.WarmMax)
}

// trimArrivals drops the arrivals before since; a is oldest first.
func trimArrivals(a []time.Time, since time.Time) []time.Time {
	i := sort.Search(len(a), func(i int) bool { return !a[i].Before(since) })
	return a[i:]
}

// largestBurst is the most arrivals within any span of window.
func largestBurst(a []time.Time, window time.Duration) int {
	most, first := 0, 0
	for last := range a {
		for a[last].Sub(a[first]) >= window {
			first++
		}
		most = max(most, last-first+1)
	}
	return most
}
