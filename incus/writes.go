package incus

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"sync"
)

// writeWatchers are told of every instance a client's write may have
// changed. They are shared by a client and its WithProject copies.
type writeWatchers struct {
	mu   sync.Mutex
	next int
	fns  map[int]func(project, instance string)
}

// WatchWrites has fn told, after every write this client (or a WithProject
// copy) makes to an instance, whatever its outcome, which instance of which
// project it was: the one the path names, the name a create or rename
// gives, and when an operation Wait follows ends, every instance it lists.
// It is how a cache of what Incus holds never answers older than a change
// its own process just made. fn must be cheap and must not call the
// client. The returned func stops the watching.
func (c *Client) WatchWrites(fn func(project, instance string)) (stop func()) {
	w := c.writes
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fns == nil {
		w.fns = map[int]func(string, string){}
	}
	id := w.next
	w.next++
	w.fns[id] = fn
	return func() {
		w.mu.Lock()
		delete(w.fns, id)
		w.mu.Unlock()
	}
}

func (w *writeWatchers) tell(project string, names []string) {
	if len(names) == 0 {
		return
	}
	w.mu.Lock()
	fns := make([]func(string, string), 0, len(w.fns))
	for _, fn := range w.fns {
		fns = append(fns, fn)
	}
	w.mu.Unlock()
	for _, fn := range fns {
		for _, n := range names {
			fn(project, n)
		}
	}
}

// wroteInstances names the instances a write request may change. An exec
// changes nothing of the instance record and is left out: the exec dialer
// makes one per relayed connection.
func wroteInstances(r request) []string {
	if r.method == http.MethodGet || r.method == http.MethodHead || !r.scoped {
		return nil
	}
	rest, ok := strings.CutPrefix(r.path, "/1.0/instances")
	if !ok {
		return nil
	}
	var names []string
	if rest == "" {
		if post, ok := r.body.(InstancesPost); ok {
			names = append(names, post.Name)
		}
		return names
	}
	seg, sub, _ := strings.Cut(strings.TrimPrefix(rest, "/"), "/")
	name, err := url.PathUnescape(seg)
	if err != nil || name == "" || sub == "exec" {
		return nil
	}
	names = append(names, name)
	if r.method == http.MethodPost && sub == "" && r.body != nil {
		// A rename (or a move) names the instance's new name in its body.
		var body struct {
			Name string `json:"name"`
		}
		if raw, err := json.Marshal(r.body); err == nil && json.Unmarshal(raw, &body) == nil && body.Name != "" && body.Name != name {
			names = append(names, body.Name)
		}
	}
	return names
}

// opInstances names the instances of project p an operation lists.
func opInstances(op *Operation, p string) []string {
	if op == nil {
		return nil
	}
	var names []string
	for _, u := range op.Resources["instances"] {
		if name, mine, ok := instanceOfPath(u, "", p); ok && mine {
			names = append(names, name)
		}
	}
	return names
}
