// Package targets maps the controller plane's targets onto Incus instances:
// one instance per owner, named deterministically from the owner, carrying
// its ownership and intent in config keys on the instance (record.go), so
// the provider keeps no database. It implements controller.Backend and runs
// the reconciler that drives every instance to where its metadata says it
// should be (booted, at its recorded power, or deleted once closing), which
// is how a restarted provider finishes what it started. StateOf is the one
// reading of an instance that decisions use; observations are written from
// it for people. Power-downs consult the process's relays.Registry, given
// to New.
package targets

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"regexp"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// namePrefix marks every instance this provider names; the rest of a name
// is a digest, so no tenant id ever appears in Incus names or logs.
const namePrefix = "ls-"

// nameKind separates this derivation from any other use of the same hash
// (the older provider used other kinds), so names can never collide across them.
const nameKind = "lightspeed/controller-v4/target"

var namePattern = regexp.MustCompile(`^ls-[0-9a-f]{20}$`)

// Name derives the owner's instance name: "ls-" and 20 hex digits (80 bits)
// of SHA-256 over the kind and each id, each id length-prefixed so that
// ("a","bc") and ("ab","c") differ. The name is the lock: Incus lets exactly
// one create of it win, across goroutines, processes and replicas.
func Name(o controller.Owner) string {
	h := sha256.New()
	h.Write([]byte(nameKind))
	for _, part := range []string{o.UniverseID, o.EnvironmentID} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write([]byte(part))
	}
	return namePrefix + hex.EncodeToString(h.Sum(nil)[:10])
}

// looksLikeTargetID says whether an id could be one of our targets: an
// owner's name, or a ready spare's (see ready.go); anything else is
// answered notFound without asking Incus about someone else's instance.
func looksLikeTargetID(id string) bool { return namePattern.MatchString(id) || isReadyName(id) }

// isOwnerName says a name is one Name derives: an owner's lock.
func isOwnerName(name string) bool { return namePattern.MatchString(name) }

// ownerOf reads an instance's owner. ok is false for an instance that is not
// one of ours: missing metadata, or a name that its metadata does not derive
// (a renamed copy or clone is never taken for a target). A ready spare
// handed out is its owner's by its claim, which names the owner's name
// (where the stand-in locks it); a stand-in is a lock, never a target.
func ownerOf(inst *incus.Instance) (controller.Owner, bool) {
	r := recordOf(inst.Config, fOwned)
	return r.owner(inst.Name)
}

// owner is ownerOf on a record decoded with fOwned, of the instance name.
func (r *record) owner(name string) (controller.Owner, bool) {
	o := r.Owner
	if r.Schema == "" || o.UniverseID == "" || o.EnvironmentID == "" || r.Standin != "" {
		return controller.Owner{}, false
	}
	if n := Name(o); n != name && (!isReadyName(name) || r.WarmClaim != n) {
		return controller.Owner{}, false
	}
	return o, true
}

// unreadable says Incus listed the instance without its configuration: on a
// cluster, the member holding it does not answer, and the list carries only
// its name, member and status Error. Its recorded owner cannot be read then;
// an instance at an owner's derived name is taken for that owner's target
// for observing it (unknown), never for changing it: every write reads the
// instance afresh, and fails while the member is down.
func unreadable(inst *incus.Instance) bool {
	return inst.Status == incus.InstanceError && recordOf(inst.Config, fSchema).Schema == ""
}

// DaemonPort is the guest daemon's port recorded on the instance.
func DaemonPort(inst *incus.Instance) int { return recordOf(inst.Config, fDaemonPort).DaemonPort }
