package targets

import (
	"sync"
	"time"
)

// A close answered closed ends the runtime's close loop for good: it never
// asks again, and an environment id is never reused. Yet an instance may
// still land under that owner's name afterwards. A create Incus takes only
// after its sender gave up on it (still in a loaded daemon's handler, so no
// operation lists it yet, when the close looked; or sent by a process killed
// right after) becomes a running machine no one will ever close. The kill
// matrix found it in CI: a create cut by one kill, the close answered closed
// by the next process, the create landing after.
//
// So a process remembers, for closedMemory, the names it answered closed,
// and its reconciler closes any instance that appears under one unless a
// create this process accepted since put it there. The memory is in the
// process: the process that answered closed is the one that must keep its
// word, and the window it covers (a request in flight in Incus) is seconds
// long. A kill of that very process within the window leaves the gap open;
// closing it needs a durable record of every closed answer, which the
// provider keeps no store for.

// closedMemory is how long a closed answer is remembered: far beyond how
// long Incus holds a request before it starts its operation (milliseconds
// when idle, seconds under load), and short enough that the memory stays
// small.
const closedMemory = 10 * time.Minute

// closedMost bounds the memory's size: at the runtime's close rate of a busy
// installation it holds ten minutes many times over (each entry is a name
// and a time, under 100 bytes).
const closedMost = 100_000

type closedEntry struct {
	name string
	at   time.Time
}

// closedTable is the names this process answered closed, oldest first.
type closedTable struct {
	mu    sync.Mutex
	at    map[string]time.Time
	order []closedEntry // by time; an entry whose name was noted again since, or forgotten, is skipped
}

// note remembers that name was answered closed at now.
func (t *closedTable) note(name string, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.at == nil {
		t.at = map[string]time.Time{}
	}
	t.at[name] = now
	t.order = append(t.order, closedEntry{name, now})
	t.prune(now)
}

// forget drops name: a create of the owner's own, accepted after its closed
// answer, is the owner's to keep.
func (t *closedTable) forget(name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.at, name)
}

// has says name was answered closed within closedMemory before now.
func (t *closedTable) has(name string, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	at, ok := t.at[name]
	return ok && now.Sub(at) < closedMemory
}

// prune drops what is past closedMemory, and the oldest beyond closedMost.
// The order slice is compacted once half of it is dead, so every entry is
// copied a bounded number of times.
func (t *closedTable) prune(now time.Time) {
	drop := 0
	for drop < len(t.order) {
		e := t.order[drop]
		live, ok := t.at[e.name]
		current := ok && live.Equal(e.at)
		if current && now.Sub(e.at) < closedMemory && len(t.at) <= closedMost {
			break
		}
		if current {
			delete(t.at, e.name)
		}
		drop++
	}
	t.order = t.order[drop:]
	if len(t.order) > 2*len(t.at)+64 {
		kept := make([]closedEntry, 0, len(t.at))
		for _, e := range t.order {
			if live, ok := t.at[e.name]; ok && live.Equal(e.at) {
				kept = append(kept, e)
			}
		}
		t.order = kept
	}
}
