package controller

import (
	"strconv"

	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// ProtocolVersion is the controller plane's number, matched exactly.
const ProtocolVersion = 4

// Plane is the name the handshake answers with.
const Plane = "controller"

// BuildInfo describes a peer's build: descriptive only, never an authority.
type BuildInfo = buildinfo.Peer

// InitializeParams opens a controller connection.
type InitializeParams struct {
	ProtocolVersion uint32    `json:"protocolVersion"`
	ClientInfo      BuildInfo `json:"clientInfo"`
}

// Capabilities lists the optional method families this build serves.
type Capabilities struct {
	Power   bool `json:"power,omitempty"`
	Ingress bool `json:"ingress,omitempty"`
}

// InitializeResult answers initialize.
type InitializeResult struct {
	ProtocolVersion uint32       `json:"protocolVersion"`
	Plane           string       `json:"plane" wire:"enum=controller"`
	ServerInfo      BuildInfo    `json:"serverInfo"`
	Capabilities    Capabilities `json:"capabilities"`
}

// Owner is the Lightspeed environment a target serves.
type Owner struct {
	UniverseID    string `json:"universeId" wire:"lsid"`
	EnvironmentID string `json:"environmentId" wire:"lsid"`
}

// TargetRef names a target by owner, and by id when the caller knows it.
type TargetRef struct {
	Owner    Owner  `json:"owner"`
	TargetID string `json:"targetId,omitempty" wire:"opaque"`
}

// Power is a target's power state while it is active.
type Power string

// The power states.
const (
	PowerRunning   Power = "running"
	PowerPaused    Power = "paused"
	PowerSuspended Power = "suspended"
	PowerStopped   Power = "stopped"
)

// Phase is a target's lifecycle phase.
type Phase string

// The phases.
const (
	PhaseProvisioning Phase = "provisioning"
	PhaseActive       Phase = "active"
	PhaseClosing      Phase = "closing"
	PhaseClosed       Phase = "closed"
	PhaseFailed       Phase = "failed"
	PhaseUnknown      Phase = "unknown"
)

// Resources are a template's fixed sizes in provider-neutral units.
type Resources struct {
	VCPUs       *uint32 `json:"vcpus,omitempty"`
	MemoryBytes *uint64 `json:"memoryBytes,omitempty"`
	DiskBytes   *uint64 `json:"diskBytes,omitempty"`
}

// Template is what a universe may create targets from.
type Template struct {
	TemplateID    string             `json:"templateId" wire:"opaque"`
	DisplayName   string             `json:"displayName" wire:"text"`
	Description   string             `json:"description,omitempty" wire:"text"`
	PowerStates   []Power            `json:"powerStates,omitempty"`
	PublicIngress bool               `json:"publicIngress,omitempty"`
	Idle          *idlepolicy.Policy `json:"idle,omitempty"`
	Deprecated    bool               `json:"deprecated,omitempty"`
	Resources     *Resources         `json:"resources,omitempty"`
	Metadata      map[string]string  `json:"metadata,omitempty"`
}

// CheckWire refuses a power state the protocol does not name, and a repeated one.
func (t *Template) CheckWire() *wire.FieldError {
	seen := map[Power]bool{}
	for i, p := range t.PowerStates {
		if problem := wire.CheckGrammar(powerGrammar, string(p)); problem != "" {
			return &wire.FieldError{Path: indexPath("powerStates", i), Problem: problem}
		}
		if seen[p] {
			return &wire.FieldError{Path: indexPath("powerStates", i), Problem: "repeats " + string(p)}
		}
		seen[p] = true
	}
	return nil
}

const powerGrammar = "enum=running|paused|suspended|stopped"

// TemplateListParams asks for the templates a universe may use.
type TemplateListParams struct {
	UniverseID string `json:"universeId" wire:"lsid"`
}

// TemplateListResult lists them; an empty list is omitted.
type TemplateListResult struct {
	Templates []Template `json:"templates,omitempty"`
}

// CreateParams asks for the owner's target.
type CreateParams struct {
	Owner       Owner              `json:"owner"`
	TemplateID  string             `json:"templateId" wire:"opaque"`
	DisplayName string             `json:"displayName,omitempty" wire:"text"`
	Idle        *idlepolicy.Policy `json:"idle,omitempty"`
}

// TargetParams is the params of target/get, target/close and the ingress methods.
type TargetParams struct {
	Target TargetRef `json:"target"`
}

// SetPowerParams asks for a power state.
type SetPowerParams struct {
	Target TargetRef `json:"target"`
	Power  Power     `json:"power" wire:"enum=running|paused|suspended|stopped"`
}

// Ingress is realized public ingress.
type Ingress struct {
	Endpoint string `json:"endpoint" wire:"url"`
}

// Observation is what the infrastructure shows of a target.
type Observation struct {
	TargetID string   `json:"targetId,omitempty" wire:"opaque"`
	Owner    Owner    `json:"owner"`
	Phase    Phase    `json:"phase" wire:"enum=provisioning|active|closing|closed|failed|unknown"`
	Power    Power    `json:"power,omitempty" wire:"enum=running|paused|suspended|stopped"`
	Message  string   `json:"message,omitempty" wire:"text"`
	Ingress  *Ingress `json:"ingress,omitempty"`
}

// CheckWire enforces that power is present exactly when the phase is
// active, and that targetId is absent only where the contract lets it be:
// while provisioning (before an id exists) and once closed.
func (o *Observation) CheckWire() *wire.FieldError {
	if (o.Phase == PhaseActive) != (o.Power != "") {
		return &wire.FieldError{Path: "power", Problem: "must be present exactly when phase is active"}
	}
	if o.TargetID == "" && o.Phase != PhaseProvisioning && o.Phase != PhaseClosed {
		return &wire.FieldError{Path: "targetId", Problem: "must be present unless phase is provisioning or closed"}
	}
	return nil
}

// TargetResult is the answer of every target and ingress method.
type TargetResult struct {
	Target Observation `json:"target"`
}

func indexPath(member string, i int) string {
	return member + "[" + strconv.Itoa(i) + "]"
}
