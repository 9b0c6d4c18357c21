package incusfake

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"strings"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// etag hashes what Incus hashes for a project's ETag: its description and
// config.
func (p *project) etag() string {
	raw, _ := json.Marshal([]any{p.description, p.config})
	sum := sha256.Sum256(raw)
	return hex.EncodeToString(sum[:])
}

func (p *project) api() incus.Project {
	used := []string{}
	for _, n := range sortedNames(p.instances) {
		used = append(used, instanceURL(p.name, n))
	}
	return incus.Project{Name: p.name, Description: p.description, Config: maps.Clone(p.config), UsedBy: used}
}

func projectURL(name string) string { return "/1.0/projects/" + url.PathEscape(name) }

// SeedProject makes or replaces a project's description and config,
// keeping its instances, without events or recorded writes.
func (s *Server) SeedProject(name, description string, config map[string]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.projects[name]
	if p == nil {
		p = &project{name: name, instances: map[string]*instance{}}
		s.projects[name] = p
	}
	p.description, p.config = description, maps.Clone(config)
	if p.config == nil {
		p.config = map[string]string{}
	}
	s.notify()
}

// Project reads a project's config and ETag without HTTP.
func (s *Server) Project(name string) (config map[string]string, etag string, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.projects[name]
	if p == nil {
		return nil, "", false
	}
	return maps.Clone(p.config), p.etag(), true
}

func (s *Server) getProject(w http.ResponseWriter, name string) {
	s.mu.Lock()
	p := s.projects[name]
	if p == nil {
		s.mu.Unlock()
		writeError(w, http.StatusNotFound, "Project not found")
		return
	}
	body, etag := p.api(), p.etag()
	s.mu.Unlock()
	writeSync(w, body, etag)
}

func (s *Server) createProject(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name        string            `json:"name"`
		Description string            `json:"description"`
		Config      map[string]string `json:"config"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if body.Name == "" || strings.Contains(body.Name, "/") {
		writeError(w, http.StatusBadRequest, "Invalid project name")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.projects[body.Name] != nil {
		writeError(w, http.StatusConflict, fmt.Sprintf("Project %q already exists", body.Name))
		return
	}
	p := &project{name: body.Name, description: body.Description, config: maps.Clone(body.Config), instances: map[string]*instance{}}
	if p.config == nil {
		p.config = map[string]string{}
	}
	s.projects[body.Name] = p
	s.lifecycle(p.name, "project-created", projectURL(p.name), nil)
	s.recordProject(WriteProjectCreate, p)
	s.notify()
	writeSync(w, map[string]any{}, "")
}

// writeProject replaces a project's description and config (PUT), or
// what the body names of them (PATCH: a config given replaces the whole
// config, as Incus 6.0.4 was measured to do). Like an instance's, the
// ETag is checked on arrival and the write applied ApplyDelay later.
func (s *Server) writeProject(w http.ResponseWriter, r *http.Request, name string) {
	var body struct {
		Description *string           `json:"description"`
		Config      map[string]string `json:"config"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	put := r.Method == http.MethodPut
	s.mu.Lock()
	p := s.projects[name]
	if p == nil {
		s.mu.Unlock()
		writeError(w, http.StatusNotFound, "Project not found")
		return
	}
	if m := r.Header.Get("If-Match"); m != "" && unquote(m) != p.etag() {
		s.mu.Unlock()
		writeError(w, http.StatusPreconditionFailed, fmt.Sprintf("ETag doesn't match: %s vs %s", p.etag(), unquote(m)))
		return
	}
	s.pending++
	applied := make(chan struct{})
	s.clock.after(s.cfg.ApplyDelay, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		defer close(applied)
		s.pending--
		if s.projects[name] == p {
			if put || body.Config != nil {
				p.config = maps.Clone(body.Config)
				if p.config == nil {
					p.config = map[string]string{}
				}
			}
			if put || body.Description != nil {
				p.description = ""
				if body.Description != nil {
					p.description = *body.Description
				}
			}
			s.lifecycle(p.name, "project-updated", projectURL(p.name), nil)
			s.recordProject(WriteProjectUpdate, p)
		}
		s.notify()
	})
	s.notify()
	s.mu.Unlock()
	s.answerApplied(w, r, applied)
}

// deleteProject deletes an empty project; ?force=true deletes what it
// holds first (running instances are killed), within the one call.
func (s *Server) deleteProject(w http.ResponseWriter, r *http.Request, name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.projects[name]
	if p != nil && name != incus.DefaultProject && r.URL.Query().Get("force") == "true" {
		for _, n := range sortedNames(p.instances) {
			inst := p.instances[n]
			if inst.hold != nil || inst.updating > 0 {
				writeError(w, http.StatusInternalServerError, busyText(inst, "delete"))
				return
			}
		}
		for _, n := range sortedNames(p.instances) {
			inst := p.instances[n]
			delete(p.instances, n)
			s.lifecycle(p.name, "instance-deleted", instanceURL(p.name, n), nil)
			s.record(WriteDelete, inst, "")
		}
	}
	switch {
	case p == nil:
		writeError(w, http.StatusNotFound, "Project not found")
		return
	case name == incus.DefaultProject:
		writeError(w, http.StatusForbidden, "The 'default' project cannot be deleted")
		return
	case len(p.instances) > 0:
		writeError(w, http.StatusInternalServerError, "Only empty projects can be removed.")
		return
	}
	delete(s.projects, name)
	s.lifecycle(name, "project-deleted", projectURL(name), nil)
	s.recordProject(WriteProjectDelete, p)
	s.notify()
	writeSync(w, map[string]any{}, "")
}

// answerApplied answers a write once it is applied. A caller that goes
// away does not stop the write, as in Incus; nor is it answered.
func (s *Server) answerApplied(w http.ResponseWriter, r *http.Request, applied <-chan struct{}) {
	select {
	case <-applied:
		writeSync(w, map[string]any{}, "")
	case <-r.Context().Done():
	case <-s.done:
	}
}
