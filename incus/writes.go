package incus

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"sync"
)

// Write is what a client tells its write watchers: an instance of Project
// that a write may have changed. Op is the operation the write started,
// when it started one; Done says the operation has ended (a Wait on it
// returned), and then Op names it.
type Write struct {
	Project  string
	Instance string
	Op       string
	Done     bool
}

// writeWatchers are told of every instance a client's write may have
// changed. They are shared by a client and its WithProject copies.
type writeWatchers struct {
	mu   sync.Mutex
	next int
	fns  map[int]func(Write)
}

// WatchWrites has fn told, after every write this client (or a WithProject
// copy) makes to an instance, whatever its outcome, which instance of which
// project it was (the one the path names, and the name a create or rename
// gives) and the operation it started, and again when a Wait on that
// operation ends. It is how a cache of what Incus holds never answers
// older than a change its own process just made. fn must be cheap and
// must not call the client. The returned func stops the watching.
func (c *Client) WatchWrites(fn func(Write)) (stop func()) {
	w := c.writes
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fns == nil {
		w.fns = map[int]func(Write){}
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

func (w *writeWatchers) tell(project string, names []string, op string, done bool) {
	if len(names) == 0 {
		return
	}
	w.mu.Lock()
	fns := make([]func(Write), 0, len(w.fns))
	for _, fn := range w.fns {
		fns = append(fns, fn)
	}
	w.mu.Unlock()
	for _, fn := range fns {
		for _, n := range names {
			fn(Write{Project: project, Instance: n, Op: op, Done: done})
		}
	}
}

// startedOp is the ID of the operation an answer started, if any.
func startedOp(resp *response) string {
	if resp == nil || resp.Type != "async" {
		return ""
	}
	return operationID(resp.Operation)
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
