package incusfake

import (
	"maps"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// WriteKind names a change the fake applied.
type WriteKind string

// The kinds of applied writes.
const (
	WriteCreate        WriteKind = "create"
	WriteStart         WriteKind = "start"
	WriteStop          WriteKind = "stop"
	WriteFreeze        WriteKind = "freeze"
	WriteUnfreeze      WriteKind = "unfreeze"
	WriteRename        WriteKind = "rename"
	WriteDelete        WriteKind = "delete"
	WritePatch         WriteKind = "patch"
	WritePut           WriteKind = "put"
	WriteProjectCreate WriteKind = "project-create"
	WriteProjectUpdate WriteKind = "project-update"
	WriteProjectDelete WriteKind = "project-delete"
)

// Write is one change the fake applied (not one it was asked for: a
// refused or failed request leaves none), for tests to check invariants
// over the whole history.
type Write struct {
	Seq  int // from 1, in the order applied
	At   time.Time
	Kind WriteKind
	// Project and Instance name what was written; Instance is empty for a
	// project's writes, and a rename's new name (OldName its old one).
	Project, Instance, OldName string
	// Status and Config are the instance's (a project's config for its
	// writes) once the write was applied.
	Status incus.InstanceStatus
	Config map[string]string
}

// record appends an instance's write; s.mu held.
func (s *Server) record(kind WriteKind, inst *instance, oldName string) {
	s.writes = append(s.writes, Write{Seq: len(s.writes) + 1, At: s.clock.Now(), Kind: kind,
		Project: inst.project, Instance: inst.name, OldName: oldName, Status: inst.status, Config: maps.Clone(inst.config)})
}

func (s *Server) recordProject(kind WriteKind, p *project) {
	s.writes = append(s.writes, Write{Seq: len(s.writes) + 1, At: s.clock.Now(), Kind: kind,
		Project: p.name, Config: maps.Clone(p.config)})
}

// Writes is every write applied so far, in order.
func (s *Server) Writes() []Write {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Write(nil), s.writes...)
}

// PendingWrites counts config writes (instances' and projects') that
// passed their checks and wait to be applied: a test staging two writes at
// one ETag waits for both to be pending before letting them apply.
func (s *Server) PendingWrites() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pending
}
