package incusfake

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"strings"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

type instance struct {
	project, name, typ  string
	arch, description   string
	config              map[string]string
	devices             map[string]map[string]string
	profiles            []string
	ephemeral, stateful bool
	status              incus.InstanceStatus
	created, lastUsed   time.Time
	pid                 int64
	ignoreShutdown      bool
	hold                *hold
	updating            int // config writes passed their checks, not yet applied
	location            string
}

// etag hashes the fields Incus hashes for an instance's ETag (its
// architecture, own config and devices, ephemeral flag and profiles): a
// change of any of them, volatile keys included, changes it.
func (i *instance) etag() string {
	raw, _ := json.Marshal([]any{i.arch, i.config, i.devices, i.ephemeral, i.profiles})
	sum := sha256.Sum256(raw)
	return hex.EncodeToString(sum[:])
}

func statusCode(st incus.InstanceStatus) incus.StatusCode {
	switch st {
	case incus.InstanceRunning, incus.InstanceReady:
		return incus.StatusRunning
	case incus.InstanceFrozen:
		return incus.StatusFrozen
	case incus.InstanceError:
		return incus.StatusError
	}
	return incus.StatusStopped
}

func cloneDevices(m map[string]map[string]string) map[string]map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]map[string]string, len(m))
	for k, v := range m {
		out[k] = maps.Clone(v)
	}
	return out
}

// instanceJSON is GET /1.0/instances/{name}, with the runtime state that
// ?recursion=1 adds.
type instanceJSON struct {
	incus.ExpandedInstance
	State *incus.InstanceState `json:"state,omitempty"`
}

func (i *instance) api(withState bool) instanceJSON {
	out := instanceJSON{ExpandedInstance: incus.ExpandedInstance{
		Instance: incus.Instance{
			Name: i.name, Type: i.typ, Status: i.status, StatusCode: statusCode(i.status),
			Description: i.description, Architecture: i.arch,
			Config: maps.Clone(i.config), Devices: cloneDevices(i.devices),
			Profiles: append([]string{}, i.profiles...), Stateful: i.stateful, Ephemeral: i.ephemeral,
			Location: i.location, Project: i.project, CreatedAt: i.created, LastUsedAt: i.lastUsed,
		},
		// Profiles are not modelled: expanded is the instance's own.
		ExpandedConfig:  maps.Clone(i.config),
		ExpandedDevices: cloneDevices(i.devices),
	}}
	if withState {
		st := i.state()
		out.State = &st
	}
	return out
}

func (i *instance) state() incus.InstanceState {
	st := incus.InstanceState{Status: i.status, StatusCode: statusCode(i.status), Pid: -1}
	if i.status.Running() || i.status == incus.InstanceFrozen {
		st.Pid, st.Processes = i.pid, 1
	}
	return st
}

// Seed is an instance put straight into the fake's state.
type Seed struct {
	Name        string
	Type        string               // default "container"
	Status      incus.InstanceStatus // default Stopped
	Config      map[string]string
	Devices     map[string]map[string]string
	Profiles    []string // nil: "default"
	Description string
	// IgnoreShutdown makes the guest ignore a graceful stop: the stop
	// fails at its timeout and keeps the instance held (as Incus 6.0.4
	// does) until a forced stop takes the hold over.
	IgnoreShutdown bool
}

// Seed puts instances into project (made when missing), replacing any of
// the same name, without events, operations or recorded writes.
func (s *Server) Seed(projectName string, seeds ...Seed) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.projects[projectName]
	if p == nil {
		p = &project{name: projectName, config: map[string]string{}, instances: map[string]*instance{}}
		s.projects[projectName] = p
	}
	for _, sd := range seeds {
		if sd.Name == "" || strings.Contains(sd.Name, "/") {
			return fmt.Errorf("incusfake: seed: bad instance name %q", sd.Name)
		}
		inst := &instance{
			project: projectName, name: sd.Name, typ: sd.Type, arch: "x86_64", description: sd.Description,
			config: maps.Clone(sd.Config), devices: cloneDevices(sd.Devices), profiles: sd.Profiles,
			status: sd.Status, created: s.clock.Now(), location: "none", ignoreShutdown: sd.IgnoreShutdown,
		}
		if inst.typ == "" {
			inst.typ = "container"
		}
		if inst.status == "" {
			inst.status = incus.InstanceStopped
		}
		switch inst.status {
		case incus.InstanceRunning, incus.InstanceStopped, incus.InstanceFrozen, incus.InstanceError:
		default:
			return fmt.Errorf("incusfake: seed %q: status %q is not one an instance rests in", sd.Name, sd.Status)
		}
		if inst.config == nil {
			inst.config = map[string]string{}
		}
		if inst.profiles == nil {
			inst.profiles = []string{"default"}
		}
		if inst.status != incus.InstanceStopped {
			s.pid++
			inst.pid = s.pid
		}
		p.instances[sd.Name] = inst
	}
	s.notify()
	return nil
}

// Instance is what the fake holds of one instance, read without HTTP.
type Instance struct {
	Project, Name string
	Status        incus.InstanceStatus
	Config        map[string]string
	Devices       map[string]map[string]string
	Profiles      []string
	ETag          string // unquoted, as GetInstance's is once trimmed
	// HeldBy is the action of the operation holding the instance ("start",
	// "stop", ...; "update" while a config write waits to apply), or "".
	HeldBy string
}

func (i *instance) view() Instance {
	v := Instance{Project: i.project, Name: i.name, Status: i.status, Config: maps.Clone(i.config),
		Devices: cloneDevices(i.devices), Profiles: append([]string(nil), i.profiles...), ETag: i.etag()}
	switch {
	case i.hold != nil:
		v.HeldBy = i.hold.action
	case i.updating > 0:
		v.HeldBy = "update"
	}
	return v
}

// Instance reads one instance of project.
func (s *Server) Instance(project, name string) (Instance, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.projects[project]
	if p == nil || p.instances[name] == nil {
		return Instance{}, false
	}
	return p.instances[name].view(), true
}

// Instances reads every instance of project, by name.
func (s *Server) Instances(project string) []Instance {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.projects[project]
	if p == nil {
		return nil
	}
	out := make([]Instance, 0, len(p.instances))
	for _, n := range sortedNames(p.instances) {
		out = append(out, p.instances[n].view())
	}
	return out
}

// find looks an instance up for a call; s.mu held. On failure it has
// answered the call already.
func (s *Server) find(w http.ResponseWriter, r *http.Request, name string) (*project, *instance) {
	p := s.projects[projectOf(r)]
	if p == nil {
		writeError(w, http.StatusNotFound, "Project not found")
		return nil, nil
	}
	inst := p.instances[name]
	if inst == nil {
		writeError(w, http.StatusNotFound, "Instance not found")
		return nil, nil
	}
	return p, inst
}

func (s *Server) getInstance(w http.ResponseWriter, r *http.Request, name string) {
	s.mu.Lock()
	_, inst := s.find(w, r, name)
	if inst == nil {
		s.mu.Unlock()
		return
	}
	body, etag := inst.api(r.URL.Query().Get("recursion") == "1"), inst.etag()
	s.mu.Unlock()
	writeSync(w, body, etag)
}

func (s *Server) getInstanceState(w http.ResponseWriter, r *http.Request, name string) {
	s.mu.Lock()
	_, inst := s.find(w, r, name)
	if inst == nil {
		s.mu.Unlock()
		return
	}
	st := inst.state()
	s.mu.Unlock()
	writeSync(w, st, "")
}

// listInstances lists a project; one that does not exist lists as empty,
// as Incus 6.0.4 does.
func (s *Server) listInstances(w http.ResponseWriter, r *http.Request) {
	terms, err := parseFilter(r.URL.Query().Get("filter"))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	recursive := r.URL.Query().Get("recursion") == "1"
	project := projectOf(r)
	s.mu.Lock()
	var full []instanceJSON
	urls := []string{}
	if p := s.projects[project]; p != nil {
		for _, n := range sortedNames(p.instances) {
			inst := p.instances[n]
			if !terms.match(inst) {
				continue
			}
			full = append(full, inst.api(false))
			urls = append(urls, instanceURL(project, n))
		}
	}
	s.mu.Unlock()
	if !recursive {
		writeSync(w, urls, "")
		return
	}
	if full == nil {
		full = []instanceJSON{}
	}
	writeSync(w, full, "")
}

// filter is the part of Incus's filter language the client speaks:
// "field eq value" terms joined by "and", on name, status, type,
// location and config.<key>.
type filter []filterTerm

type filterTerm struct {
	field, value string
	negate       bool
}

func parseFilter(raw string) (filter, error) {
	if strings.TrimSpace(raw) == "" {
		return nil, nil
	}
	var out filter
	for _, part := range strings.Split(raw, " and ") {
		f := strings.Fields(part)
		if len(f) != 3 || (f[1] != "eq" && f[1] != "ne") {
			return nil, fmt.Errorf("Invalid filter: %q", raw) //nolint:staticcheck // Incus's capitalised text
		}
		out = append(out, filterTerm{field: f[0], value: strings.Trim(f[2], `"'`), negate: f[1] == "ne"})
	}
	return out, nil
}

func (f filter) match(inst *instance) bool {
	for _, t := range f {
		var got string
		switch {
		case t.field == "name":
			got = inst.name
		case t.field == "status":
			got = strings.ToLower(string(inst.status))
			t.value = strings.ToLower(t.value)
		case t.field == "type":
			got = inst.typ
		case t.field == "location":
			got = inst.location
		case strings.HasPrefix(t.field, "config."):
			got = inst.config[strings.TrimPrefix(t.field, "config.")]
		case strings.HasPrefix(t.field, "expanded_config."):
			got = inst.config[strings.TrimPrefix(t.field, "expanded_config.")]
		default:
			return false
		}
		if (got == t.value) == t.negate {
			return false
		}
	}
	return true
}

// createInstance registers the instance at once, held by its create
// operation, as Incus has the record in its database while the image
// unpacks. A taken name is accepted and fails in the operation with the
// database's words, as Incus 6.0 does.
func (s *Server) createInstance(w http.ResponseWriter, r *http.Request) {
	var post incus.InstancesPost
	if err := decodeBody(r, &post); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if post.Name == "" || strings.Contains(post.Name, "/") {
		writeError(w, http.StatusBadRequest, "Invalid instance name")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	project := projectOf(r)
	p := s.projects[project]
	if p == nil {
		writeError(w, http.StatusNotFound, "Project not found")
		return
	}
	op := s.newOp(project, "Creating instance", post.Name)
	if p.instances[post.Name] != nil {
		s.failSoon(op, "Failed creating instance record: UNIQUE constraint failed: instances.project_id, instances.name")
		writeAsync(w, op.Operation)
		return
	}
	now := s.clock.Now()
	inst := &instance{
		project: project, name: post.Name, typ: post.Type, arch: "x86_64", description: post.Description,
		config: maps.Clone(post.Config), devices: cloneDevices(post.Devices), profiles: post.Profiles,
		status: incus.InstanceStopped, created: now, location: "none",
	}
	if inst.typ == "" {
		inst.typ = "container"
	}
	if inst.config == nil {
		inst.config = map[string]string{}
	}
	if inst.profiles == nil {
		inst.profiles = []string{"default"}
	}
	inst.config["volatile.uuid"] = fmt.Sprintf("00000000-0000-4000-9000-%012x", s.opSeq)
	p.instances[post.Name] = inst
	s.take(inst, "create", op, s.cfg.Durations.Create, func() string {
		s.lifecycle(project, "instance-created", instanceURL(project, inst.name), nil)
		s.record(WriteCreate, inst, "")
		if post.Start {
			s.started(inst, "instance-started")
		}
		return ""
	})
	writeAsync(w, op.Operation)
}

// started and stopped are what a successful start or stop leaves; Incus
// rewrites volatile keys as an instance moves, so its ETag changes too.
func (s *Server) started(inst *instance, action string) {
	inst.status = incus.InstanceRunning
	s.pid++
	inst.pid = s.pid
	inst.lastUsed = s.clock.Now()
	inst.config["volatile.last_state.power"] = "RUNNING"
	s.lifecycle(inst.project, action, instanceURL(inst.project, inst.name), nil)
	s.record(WriteStart, inst, "")
}

func (s *Server) stopped(inst *instance, action string) {
	inst.status = incus.InstanceStopped
	inst.pid = 0
	inst.config["volatile.last_state.power"] = "STOPPED"
	s.lifecycle(inst.project, action, instanceURL(inst.project, inst.name), nil)
	s.record(WriteStop, inst, "")
}

// shutdownFailed is what a graceful stop whose guest did not halt in time
// ends with.
const shutdownFailed = `Failed shutting down instance, status is "Running": context deadline exceeded`

// changeState starts a state change. Like Incus, it always answers with
// an operation once the instance exists; a refusal (busy, already in that
// state) is that operation's failure.
func (s *Server) changeState(w http.ResponseWriter, r *http.Request, name string) {
	var req incus.InstanceStatePut
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	desc, ok := map[incus.StateAction]string{incus.ActionStart: "Starting instance", incus.ActionStop: "Stopping instance",
		incus.ActionRestart: "Restarting instance", incus.ActionFreeze: "Freezing instance", incus.ActionUnfreeze: "Unfreezing instance"}[req.Action]
	if !ok {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("Unknown action %q", req.Action))
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	p, inst := s.find(w, r, name)
	if inst == nil {
		return
	}
	op := s.newOp(p.name, desc, name)
	d := s.cfg.Durations
	busy := busyText(inst, string(req.Action))
	switch req.Action {
	case incus.ActionStart:
		switch {
		case busy != "":
			s.failSoon(op, busy)
		case inst.status.Running() || inst.status == incus.InstanceFrozen:
			s.failSoon(op, "The instance is already running")
		default:
			// Incus records the power it starts to as the start begins,
			// and shows the instance Stopped until it ends: the ETag
			// changes first (measured 160 ms before Running).
			inst.config["volatile.last_state.power"] = "RUNNING"
			s.take(inst, "start", op, d.Start, func() string { s.started(inst, "instance-started"); return "" })
		}
	case incus.ActionStop:
		s.stop(inst, op, req)
	case incus.ActionRestart:
		switch {
		case busy != "":
			s.failSoon(op, busy)
		case !inst.status.Running():
			s.failSoon(op, "The instance isn't running")
		default:
			s.take(inst, "restart", op, d.Restart, func() string { s.started(inst, "instance-restarted"); return "" })
		}
	case incus.ActionFreeze:
		switch {
		case busy != "":
			s.failSoon(op, busy)
		case !inst.status.Running():
			s.failSoon(op, "The instance isn't running")
		default:
			s.take(inst, "freeze", op, d.Freeze, func() string {
				inst.status = incus.InstanceFrozen
				s.lifecycle(inst.project, "instance-paused", instanceURL(inst.project, inst.name), nil)
				s.record(WriteFreeze, inst, "")
				return ""
			})
		}
	case incus.ActionUnfreeze:
		switch {
		case busy != "":
			s.failSoon(op, busy)
		case inst.status != incus.InstanceFrozen:
			s.failSoon(op, "The instance is not frozen")
		default:
			s.take(inst, "unfreeze", op, d.Unfreeze, func() string {
				inst.status = incus.InstanceRunning
				s.lifecycle(inst.project, "instance-resumed", instanceURL(inst.project, inst.name), nil)
				s.record(WriteUnfreeze, inst, "")
				return ""
			})
		}
	}
	writeAsync(w, op.Operation)
}

// stop models Incus's stop lock: a stop that finds another stop holding
// the instance waits for it and ends with it, and a forced one takes a
// graceful stop's hold over (also one left behind by a graceful stop that
// failed its timeout); a graceful stop whose guest ignores it fails at
// its timeout and leaves its hold. s.mu held.
func (s *Server) stop(inst *instance, op *operation, req incus.InstanceStatePut) {
	d := s.cfg.Durations
	timeout := d.ShutdownTimeout
	if req.Timeout > 0 {
		timeout = time.Duration(req.Timeout) * time.Second
	}
	if h := inst.hold; h != nil && h.action == "stop" {
		h.joiners = append(h.joiners, op)
		switch {
		case req.Force && h.graceful:
			s.clock.stop(h.finish)
			h.graceful = false
			h.end = func() string { s.stopped(inst, "instance-stopped"); return "" }
			h.finish = s.clock.after(d.ForcedStop, func() { s.release(inst, h) })
		case h.finish == nil:
			// Nothing will end that stop by itself: this one fails at its
			// own timeout, as the one holding did.
			s.clock.after(timeout, func() {
				s.mu.Lock()
				defer s.mu.Unlock()
				s.finishOp(op, shutdownFailed)
			})
		}
		return
	}
	if busy := busyText(inst, "stop"); busy != "" {
		s.failSoon(op, busy)
		return
	}
	if inst.status == incus.InstanceStopped {
		s.failSoon(op, "The instance is already stopped")
		return
	}
	switch {
	case req.Force:
		s.take(inst, "stop", op, d.ForcedStop, func() string { s.stopped(inst, "instance-stopped"); return "" })
	case inst.ignoreShutdown:
		h := &hold{action: "stop", op: op, graceful: true,
			end: func() string { s.stopped(inst, "instance-shutdown"); return "" }}
		inst.hold = h
		s.clock.after(timeout, func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if inst.hold == h && h.op == op {
				h.op = nil // the hold stays, with no task behind it
				s.finishOp(op, shutdownFailed)
			}
		})
		s.notify()
	default:
		h := s.take(inst, "stop", op, d.Stop, func() string { s.stopped(inst, "instance-shutdown"); return "" })
		h.graceful = true
	}
}

// writeInstance is PATCH (merge; answered once applied) and PUT (replace;
// answered at once with an operation that ends once applied). The ETag is
// checked on arrival and the write applied ApplyDelay later, so another
// write checked meanwhile at the same ETag passes too.
func (s *Server) writeInstance(w http.ResponseWriter, r *http.Request, name string) {
	var body struct {
		Architecture *string                      `json:"architecture"`
		Config       map[string]string            `json:"config"`
		Devices      map[string]map[string]string `json:"devices"`
		Profiles     *[]string                    `json:"profiles"`
		Description  *string                      `json:"description"`
		Ephemeral    *bool                        `json:"ephemeral"`
		Stateful     *bool                        `json:"stateful"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	put := r.Method == http.MethodPut
	s.mu.Lock()
	p, inst := s.find(w, r, name)
	if inst == nil {
		s.mu.Unlock()
		return
	}
	if m := r.Header.Get("If-Match"); m != "" && unquote(m) != inst.etag() {
		s.mu.Unlock()
		writeError(w, http.StatusPreconditionFailed, fmt.Sprintf("ETag doesn't match: %s vs %s", inst.etag(), unquote(m)))
		return
	}
	if put {
		for k := range inst.config {
			if _, kept := body.Config[k]; strings.HasPrefix(k, "volatile.") && !kept {
				s.mu.Unlock()
				writeError(w, http.StatusBadRequest, fmt.Sprintf("Volatile key %q cannot be removed", k))
				return
			}
		}
	}
	// Config writes do not refuse one another: only an operation's hold
	// refuses them.
	if inst.hold != nil {
		msg := busyText(inst, "update")
		s.mu.Unlock()
		writeError(w, http.StatusInternalServerError, msg)
		return
	}
	inst.updating++
	s.pending++
	var op *operation
	if put {
		op = s.newOp(p.name, "Updating instance", name)
	}
	applied := make(chan struct{})
	s.clock.after(s.cfg.ApplyDelay, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		defer close(applied)
		inst.updating--
		s.pending--
		if p.instances[inst.name] == inst {
			if put {
				inst.config = maps.Clone(body.Config)
				if inst.config == nil {
					inst.config = map[string]string{}
				}
				inst.devices = cloneDevices(body.Devices)
				if body.Profiles != nil {
					inst.profiles = append([]string{}, *body.Profiles...)
				}
			} else {
				for k, v := range body.Config {
					if v == "" {
						delete(inst.config, k)
					} else {
						inst.config[k] = v
					}
				}
				for k, v := range body.Devices {
					if inst.devices == nil {
						inst.devices = map[string]map[string]string{}
					}
					inst.devices[k] = maps.Clone(v)
				}
				if body.Profiles != nil {
					inst.profiles = append([]string{}, *body.Profiles...)
				}
			}
			if body.Architecture != nil && *body.Architecture != "" {
				inst.arch = *body.Architecture
			}
			if body.Description != nil {
				inst.description = *body.Description
			}
			if body.Ephemeral != nil {
				inst.ephemeral = *body.Ephemeral
			}
			if body.Stateful != nil {
				inst.stateful = *body.Stateful
			}
			s.lifecycle(inst.project, "instance-updated", instanceURL(inst.project, inst.name), nil)
			kind := WritePatch
			if put {
				kind = WritePut
			}
			s.record(kind, inst, "")
		}
		s.finishOp(op, "")
		s.notify()
	})
	s.notify()
	var snap incus.Operation
	if put {
		snap = op.Operation // the clock may finish op once unlocked
	}
	s.mu.Unlock()
	if put {
		writeAsync(w, snap)
		return
	}
	s.answerApplied(w, r, applied)
}

// renameInstance checks a stopped instance and a free new name at once,
// and renames when its operation ends; a rename that finds the name taken
// then (another won the race) fails as Incus's database refuses it.
func (s *Server) renameInstance(w http.ResponseWriter, r *http.Request, name string) {
	var body struct {
		Name string `json:"name"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	p, inst := s.find(w, r, name)
	if inst == nil {
		return
	}
	newName := body.Name
	switch {
	case newName == "" || strings.Contains(newName, "/"):
		writeError(w, http.StatusBadRequest, "Invalid instance name")
		return
	case inst.status != incus.InstanceStopped:
		writeError(w, http.StatusBadRequest, "Renaming of running instance not allowed")
		return
	case p.instances[newName] != nil:
		writeError(w, http.StatusConflict, fmt.Sprintf("Name %q already in use", newName))
		return
	}
	s.operate(w, p, inst, "Renaming instance", "rename", s.cfg.Durations.Rename, func() string {
		if p.instances[newName] != nil {
			return "Failed renaming instance: UNIQUE constraint failed: instances.project_id, instances.name"
		}
		old := inst.name
		delete(p.instances, old)
		inst.name = newName
		p.instances[newName] = inst
		s.lifecycle(p.name, "instance-renamed", instanceURL(p.name, newName), map[string]any{"old_name": old})
		s.record(WriteRename, inst, old)
		return ""
	})
}

// deleteInstance refuses a running instance at once, as Incus does, and
// deletes when its operation ends.
func (s *Server) deleteInstance(w http.ResponseWriter, r *http.Request, name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, inst := s.find(w, r, name)
	if inst == nil {
		return
	}
	if inst.status.Running() || inst.status == incus.InstanceFrozen {
		writeError(w, http.StatusBadRequest, "Instance is running")
		return
	}
	s.operate(w, p, inst, "Deleting instance", "delete", s.cfg.Durations.Delete, func() string {
		delete(p.instances, inst.name)
		s.lifecycle(p.name, "instance-deleted", instanceURL(p.name, inst.name), nil)
		s.record(WriteDelete, inst, "")
		return ""
	})
}

// operate answers an operation of kind that holds inst for d and then
// applies end, or that fails at once, as Incus's does, when another
// operation holds inst.
func (s *Server) operate(w http.ResponseWriter, p *project, inst *instance, desc, kind string, d time.Duration, end func() string) {
	op := s.newOp(p.name, desc, inst.name)
	if busy := busyText(inst, kind); busy != "" {
		s.failSoon(op, busy)
	} else {
		s.take(inst, kind, op, d, end)
	}
	writeAsync(w, op.Operation)
}
