package incusfake

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// operation is a background task as Incus keeps one: answered at once
// with its ID, final later.
type operation struct {
	incus.Operation
	project string
	done    chan struct{} // closed once final
}

// newOp registers a running task of project on the named instances and
// announces it; s.mu held.
func (s *Server) newOp(project, description string, instances ...string) *operation {
	s.opSeq++
	now := s.clock.Now()
	var res []string
	for _, n := range instances {
		res = append(res, instanceURL(project, n))
	}
	op := &operation{
		Operation: incus.Operation{
			ID:          fmt.Sprintf("00000000-0000-4000-8000-%012x", s.opSeq),
			Class:       "task",
			Description: description,
			Status:      "Running",
			StatusCode:  incus.StatusRunning,
			Resources:   map[string][]string{"instances": res},
			Metadata:    map[string]any{},
			Location:    "none",
			CreatedAt:   now,
			UpdatedAt:   now,
		},
		project: project,
		done:    make(chan struct{}),
	}
	s.ops[op.ID] = op
	s.opEvent(op)
	s.notify()
	return op
}

// finishOp makes op final: Success when errText is empty, else Failure
// with that text; s.mu held. A final op is left as it is.
func (s *Server) finishOp(op *operation, errText string) {
	if op == nil || op.Final() {
		return
	}
	op.Status, op.StatusCode = "Success", incus.StatusSuccess
	if errText != "" {
		op.Status, op.StatusCode, op.Err = "Failure", incus.StatusFailure, errText
	}
	op.UpdatedAt = s.clock.Now()
	close(op.done)
	s.finished = append(s.finished, op.ID)
	for len(s.finished) > maxFinished {
		delete(s.ops, s.finished[0])
		s.finished = s.finished[1:]
	}
	s.opEvent(op)
	s.notify()
}

// failSoon fails op from the clock at once rather than within the call
// that started it, so that the call answers a running operation, as
// Incus does when the task itself refuses.
func (s *Server) failSoon(op *operation, errText string) {
	s.clock.after(0, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.finishOp(op, errText)
	})
}

// instanceURL is an instance's API path as Incus lists it in operation
// resources and event sources: ?project= outside the default project.
func instanceURL(project, name string) string {
	u := "/1.0/instances/" + url.PathEscape(name)
	if project != incus.DefaultProject {
		u += "?project=" + url.QueryEscape(project)
	}
	return u
}

// PruneOperations forgets every final operation, as Incus does a while
// after they end: a wait on one then finds nothing (ErrOperationLost).
func (s *Server) PruneOperations() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range s.finished {
		delete(s.ops, id)
	}
	s.finished = nil
	s.notify()
}

// Operations lists every operation the fake still knows, final ones
// included, oldest first.
func (s *Server) Operations() []incus.Operation {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]incus.Operation, 0, len(s.ops))
	for _, op := range s.ops {
		out = append(out, op.Operation)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// RunningOperations counts the operations not yet final.
func (s *Server) RunningOperations() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, op := range s.ops {
		if !op.Final() {
			n++
		}
	}
	return n
}

func (s *Server) listOperations(w http.ResponseWriter, r *http.Request) {
	project := projectOf(r)
	recursive := r.URL.Query().Get("recursion") == "1"
	s.mu.Lock()
	full := map[string][]incus.Operation{}
	urls := map[string][]string{}
	for _, op := range s.ops {
		if op.project != project {
			continue
		}
		key := strings.ToLower(op.Status)
		full[key] = append(full[key], op.Operation)
		urls[key] = append(urls[key], "/1.0/operations/"+op.ID)
	}
	s.mu.Unlock()
	if recursive {
		for _, ops := range full {
			sort.Slice(ops, func(i, j int) bool { return ops[i].ID < ops[j].ID })
		}
		writeSync(w, full, "")
		return
	}
	writeSync(w, urls, "")
}

func (s *Server) lookupOp(id string) (*operation, incus.Operation, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	op, ok := s.ops[id]
	if !ok {
		return nil, incus.Operation{}, false
	}
	return op, op.Operation, true
}

func (s *Server) getOperation(w http.ResponseWriter, id string) {
	_, snap, ok := s.lookupOp(id)
	if !ok {
		writeError(w, http.StatusNotFound, "Operation not found")
		return
	}
	writeSync(w, snap, "")
}

// waitOperation sends the 200 header before it waits, as Incus does, so
// that what the wait comes to (the operation failed, the wait's own
// timeout ran out) is an error envelope under 200.
func (s *Server) waitOperation(w http.ResponseWriter, r *http.Request, id string) {
	op, _, ok := s.lookupOp(id)
	if !ok {
		writeError(w, http.StatusNotFound, "Operation not found")
		return
	}
	timeout := -1
	if v := r.URL.Query().Get("timeout"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			writeError(w, http.StatusBadRequest, "Invalid timeout")
			return
		}
		timeout = n
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_ = http.NewResponseController(w).Flush()
	// The wait's timeout is the transport's pacing, not the model's time:
	// it runs on the wall clock even when the fake's clock is manual.
	var expired <-chan time.Time
	if timeout >= 0 {
		t := time.NewTimer(time.Duration(timeout) * time.Second)
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-op.done:
	case <-expired:
		writeJSONBody(w, envelope{Type: "error", ErrorCode: http.StatusGatewayTimeout, Error: "Operation wait timed out"})
		return
	case <-r.Context().Done():
		return
	case <-s.done:
		return
	}
	s.mu.Lock()
	snap := op.Operation
	s.mu.Unlock()
	if snap.StatusCode != incus.StatusSuccess {
		writeJSONBody(w, envelope{Type: "error", ErrorCode: http.StatusBadRequest, Error: snap.Err, Metadata: snap})
		return
	}
	writeJSONBody(w, envelope{Type: "sync", Status: "Success", StatusCode: http.StatusOK, Metadata: snap})
}

func writeJSONBody(w http.ResponseWriter, v any) {
	_ = json.NewEncoder(w).Encode(v)
}

// hold is an instance taken by an operation: while it lasts, other
// changes of the instance are refused as busy.
type hold struct {
	action string
	op     *operation // nil once its operation failed and left it held (a stranded stop)
	finish *timer     // ends the hold successfully; nil while nothing will
	// end is what ending it does to the instance: "" for success, else
	// the operation's failure.
	end func() string
	// joiners are stops that came while a stop held the instance: Incus
	// has them wait for that stop, and they end as it ends.
	joiners []*operation
	// graceful says the hold is a graceful stop, which a forced stop may
	// take over.
	graceful bool
}

// busyText is Incus's refusal of action while another operation holds the
// instance, or "" when nothing does.
func busyText(inst *instance, action string) string {
	held := ""
	switch {
	case inst.hold != nil:
		held = inst.hold.action
	case inst.updating > 0:
		held = "update"
	default:
		return ""
	}
	return fmt.Sprintf("Failed to create instance %s operation: Instance is busy running a %q operation", action, held)
}

// take holds inst for action on behalf of op for d, then runs end and
// finishes op (and any joiners) successfully; s.mu held.
func (s *Server) take(inst *instance, action string, op *operation, d time.Duration, end func() string) *hold {
	h := &hold{action: action, op: op, end: end}
	inst.hold = h
	h.finish = s.clock.after(d, func() { s.release(inst, h) })
	s.notify()
	return h
}

// release ends h successfully if it still holds inst.
func (s *Server) release(inst *instance, h *hold) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if inst.hold != h {
		return
	}
	inst.hold = nil
	msg := h.end()
	s.finishOp(h.op, msg)
	for _, j := range h.joiners {
		s.finishOp(j, msg)
	}
	s.notify()
}
