package targets

import "sync"

// byName holds one record per instance name, safe for concurrent use. The
// tables built on it say when a record may replace or remove another.
type byName[V any] struct {
	mu sync.Mutex
	m  map[string]V
}

func (t *byName[V]) get(name string) (V, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[name]
	return v, ok
}

// putUnless stores v under name unless the record there keeps its place
// (keep nil: it never does).
func (t *byName[V]) putUnless(name string, v V, keep func(cur V) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if cur, ok := t.m[name]; ok && keep != nil && keep(cur) {
		return
	}
	if t.m == nil {
		t.m = map[string]V{}
	}
	t.m[name] = v
}

// dropIf removes name's record if match says so (match nil: whatever it
// is), and says whether it did.
func (t *byName[V]) dropIf(name string, match func(cur V) bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	cur, ok := t.m[name]
	if !ok || (match != nil && !match(cur)) {
		return false
	}
	delete(t.m, name)
	return true
}
