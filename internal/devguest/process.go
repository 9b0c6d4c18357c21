package devguest

import (
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// proc is one process handle: a root started in its own process group, its
// combined output stream, and its state.
type proc struct {
	id   string
	pgid int // the root's pid; the root leads its own group

	mu        sync.Mutex
	outStart  uint64 // stream offset of out[0]
	out       []byte
	outLimit  int
	outEOF    bool
	changed   chan struct{} // closed and replaced whenever output or state changes
	exited    bool          // the root exited and its output settled
	exit      *ProcessExit
	stoppedBy string
	leftovers *Leftovers
	rootDone  bool // the root has been reaped
	groupLive bool // after rootDone: members of the group live on
	cursor    uint64
	stdin     *inputQueue
	timers    []*time.Timer
}

// notifyLocked wakes every waiter; p.mu is held.
func (p *proc) notifyLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// procTable holds the daemon's process handles.
type procTable struct {
	mu       sync.Mutex
	byID     map[string]*proc
	order    []string            // start order, for eviction
	expired  map[string]struct{} // evicted ids, answered notFound (expired)
	expOrder []string
	limit    int
}

const maxExpiredRemembered = 4096

func (t *procTable) lookup(id string) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p, ok := t.byID[id]; ok {
		return p, nil
	}
	if _, ok := t.expired[id]; ok {
		return nil, jsonrpc.WithReason(jsonrpc.KindNotFound, "expired", "The process %s was evicted to make room for newer ones; its output is gone.", id)
	}
	return nil, jsonrpc.Errorf(jsonrpc.KindNotFound, "No process %s is known to this daemon instance.", id)
}

// reserve makes room for a new handle, evicting the oldest exited one when full.
func (t *procTable) reserveLocked(id string) error {
	if _, ok := t.byID[id]; ok {
		return jsonrpc.Errorf(jsonrpc.KindAlreadyExists, "A process %s already exists; choose another processId.", id)
	}
	if len(t.byID) < t.limit {
		return nil
	}
	for i, old := range t.order {
		p := t.byID[old]
		p.mu.Lock()
		exited := p.exited
		p.mu.Unlock()
		if !exited {
			continue
		}
		delete(t.byID, old)
		t.order = append(t.order[:i:i], t.order[i+1:]...)
		t.expired[old] = struct{}{}
		t.expOrder = append(t.expOrder, old)
		if len(t.expOrder) > maxExpiredRemembered {
			delete(t.expired, t.expOrder[0])
			t.expOrder = t.expOrder[1:]
		}
		return nil
	}
	e := jsonrpc.WithReason(jsonrpc.KindBusy, "capacityExhausted", "All %d process handles belong to running processes; wait for one to exit.", t.limit)
	retry := uint64(1000)
	e.RetryAfterMs = &retry
	return e
}

func (t *procTable) counts() (retained int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.byID)
}

func (t *procTable) all() []*proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*proc, 0, len(t.byID))
	for _, p := range t.byID {
		out = append(out, p)
	}
	return out
}
