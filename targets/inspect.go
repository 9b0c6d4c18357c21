package targets

import (
	"sort"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// View is what an operator is shown of one target: everything its
// instance records, decoded by the same code the provider decides with,
// and the observation a runtime's target/get would be given. It is read
// from Incus, the one source of truth; no process's memory adds to it.
type View struct {
	TargetID    string                 `json:"targetId"`
	Owner       controller.Owner       `json:"owner"`
	Template    string                 `json:"templateId"`
	Image       string                 `json:"image,omitempty"`
	DisplayName string                 `json:"displayName,omitempty"`
	Observation controller.Observation `json:"observation"`
	// Status is Incus's own status; Location the cluster member (empty
	// on a standalone Incus).
	Status   string `json:"incusStatus"`
	Location string `json:"location,omitempty"`
	// Intent is the power recorded as wanted, with when and by whom it
	// was asked (empty when none is).
	Intent      string    `json:"intent,omitempty"`
	IntentAt    time.Time `json:"intentAt,omitzero"`
	IntentBy    string    `json:"intentBy,omitempty"`
	CreatedAt   time.Time `json:"createdAt,omitzero"`
	BootedAt    time.Time `json:"bootedAt,omitzero"`
	ClosingFrom time.Time `json:"closingSince,omitzero"`
	// IdleSince is when idleness began for a target the provider powered
	// down (its idle clock runs on while it cannot answer).
	IdleSince time.Time `json:"idleSince,omitzero"`
	// Relays are the replicas that hold a relay lease on the target (a
	// relay open through them), each to when it stands.
	Relays       []RelayLease `json:"relays,omitempty"`
	IngressLabel string       `json:"ingressLabel,omitempty"`
	IngressOn    bool         `json:"ingressRouted,omitempty"`
	// FromPool says the target was handed out from a warm pool.
	FromPool bool `json:"fromPool,omitempty"`
}

// RelayLease is one replica's lease on a target.
type RelayLease struct {
	Replica string    `json:"replica"`
	Until   time.Time `json:"until,omitzero"`
}

// Inspect reads an instance as an operator's view of a target. ok is false
// for an instance that is not a target: another program's, a warm spare
// not yet handed out, a copy under a name its metadata does not derive.
// An instance under a target's name on a cluster member that does not
// answer is listed by Incus without its record: it is shown, unknown and
// with its member, and with no owner, which only its record could tell.
func Inspect(inst *incus.Instance) (v View, ok bool) {
	r := recordOf(inst.Config, fAll)
	owner, ok := r.owner(inst.Name)
	if !ok && unreadable(inst) && looksLikeTargetID(inst.Name) {
		return View{TargetID: inst.Name, Observation: observation(inst, controller.Owner{}, stateOf(inst, &r), nil, time.Time{}),
			Status: string(inst.Status), Location: inst.Location}, true
	}
	if !ok {
		return View{}, false
	}
	st := stateOf(inst, &r)
	v = View{
		TargetID: inst.Name, Owner: owner, Template: r.Template, Image: r.Image, DisplayName: r.DisplayName,
		Observation: observation(inst, owner, st, nil, time.Time{}),
		Status:      string(inst.Status), Location: inst.Location,
		Intent: string(r.Intent.Power), IntentAt: r.Intent.At, IntentBy: string(r.Intent.By),
		CreatedAt: r.CreatedAt, BootedAt: r.Booted, ClosingFrom: r.Closing, IdleSince: r.IdleSince,
		IngressLabel: r.IngressLabel, IngressOn: r.IngressRouted, FromPool: r.has(fWarmClaim),
	}
	for replica, until := range r.Relays {
		v.Relays = append(v.Relays, RelayLease{Replica: replica, Until: until})
	}
	sort.Slice(v.Relays, func(i, j int) bool { return v.Relays[i].Replica < v.Relays[j].Replica })
	return v, true
}
