// Package templates loads the provider's template catalog: the wire
// templates a universe may create targets from, and what building each one's
// Incus instance needs (image, instance type, profiles, daemon port).
// Callers never choose any of these; the operator does, in this file.
package templates

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// Entry is one template as the file states it: the spec's template fields
// plus the instance recipe.
type Entry struct {
	controller.Template
	// ImageAlias is resolved once at start-up and pinned by fingerprint.
	ImageAlias       string `json:"imageAlias,omitempty" wire:"opaque"`
	ImageFingerprint string `json:"imageFingerprint,omitempty" wire:"opaque"`
	// InstanceType is "container" (default) or "virtual-machine".
	InstanceType string   `json:"instanceType,omitempty" wire:"enum=container|virtual-machine"`
	Profiles     []string `json:"profiles,omitempty"`
	// DaemonPort is the guest daemon's port on the guest loopback
	// (guest.DefaultPort when omitted).
	DaemonPort uint16 `json:"daemonPort,omitempty"`
	// IngressPort is the one guest port public ingress may reach.
	IngressPort uint16 `json:"ingressPort,omitempty"`
	// StoragePool holds the root disk when resources.diskBytes sizes it.
	StoragePool string `json:"storagePool,omitempty" wire:"opaque"`
	// Placement puts the template's instances on one cluster member
	// ("lsm2") or a cluster group ("@gpu"), Incus's target parameter; empty
	// lets Incus's scheduler place each one.
	Placement string `json:"placement,omitempty" wire:"opaque"`
	// Warm is how many instances of the template are kept created ahead,
	// stopped and without an owner, for target/create to hand out: the
	// pool's minimum.
	Warm uint32 `json:"warm,omitempty"`
	// WarmMax is the most the pool grows to when creates come faster than
	// Warm covers (see targets/warmsize.go); omitted, the pool stays at Warm.
	WarmMax uint32 `json:"warmMax,omitempty"`
	// WarmState is how a warm instance waits: "stopped" (the default:
	// never started, handed out by a rename and a start), or "frozen" or
	// "running" (started once, handed out with no start and no rename; see
	// targets/ready.go).
	WarmState string `json:"warmState,omitempty" wire:"enum=stopped|frozen|running"`
}

// MaxWarm bounds a template's warm pool: each warm instance holds a root
// filesystem and an Incus record while nobody uses it, and refilling a
// larger pool would contend with the creates it is meant to speed up. A
// bigger pool is capacity planning, not a head start.
const MaxWarm = 64

// CheckWire states the rules that span members.
func (e *Entry) CheckWire() *wire.FieldError {
	if fe := e.Template.CheckWire(); fe != nil {
		return fe
	}
	if (e.ImageAlias == "") == (e.ImageFingerprint == "") {
		return &wire.FieldError{Path: "imageAlias", Problem: "or imageFingerprint must be set, and not both"}
	}
	if e.ImageFingerprint != "" && !isFingerprint(e.ImageFingerprint) {
		return &wire.FieldError{Path: "imageFingerprint", Problem: "must be a full 64-character lowercase hex SHA-256 (a prefix could match another image)"}
	}
	if e.PublicIngress != (e.IngressPort != 0) {
		return &wire.FieldError{Path: "ingressPort", Problem: "must be set exactly when publicIngress is true"}
	}
	if e.IngressPort != 0 && e.IngressPort == e.daemonPort() {
		return &wire.FieldError{Path: "ingressPort", Problem: "must differ from daemonPort: public ingress never reaches the guest daemon"}
	}
	for _, p := range e.PowerStates {
		if p == controller.PowerSuspended && e.instanceType() != "virtual-machine" {
			return &wire.FieldError{Path: "powerStates", Problem: "cannot include suspended for a container: a stateful stop needs a virtual machine with migration.stateful, and CRIU-based container checkpoints are not offered"}
		}
	}
	if e.Resources != nil && e.Resources.DiskBytes != nil && e.StoragePool == "" {
		return &wire.FieldError{Path: "storagePool", Problem: "is required when resources.diskBytes sizes the root disk"}
	}
	if e.Warm > MaxWarm {
		return &wire.FieldError{Path: "warm", Problem: fmt.Sprintf("must be from 0 to %d: a warm pool holds idle instances, and a larger one is capacity planning", MaxWarm)}
	}
	if e.WarmMax > MaxWarm {
		return &wire.FieldError{Path: "warmMax", Problem: fmt.Sprintf("must be from 0 to %d: a warm pool holds idle instances, and a larger one is capacity planning", MaxWarm)}
	}
	if e.WarmMax != 0 && e.WarmMax < e.Warm {
		return &wire.FieldError{Path: "warmMax", Problem: "must be at least warm, the pool's minimum"}
	}
	if e.WarmState != "" && e.WarmState != WarmStopped && e.instanceType() != "container" {
		return &wire.FieldError{Path: "warmState", Problem: "may be frozen or running only for a container: a virtual machine's spare is tested stopped only"}
	}
	if (e.Warm > 0 || e.WarmMax > 0) && e.Deprecated {
		return &wire.FieldError{Path: "warm", Problem: "must be 0 for a deprecated template, which creates no new targets to hand a warm instance to"}
	}
	if e.Placement != "" && !placement.MatchString(e.Placement) {
		return &wire.FieldError{Path: "placement", Problem: "must name a cluster member (such as m2) or a cluster group after an @ (such as @gpu)"}
	}
	for i, p := range e.Profiles {
		if problem := wire.CheckGrammar(wire.GrammarOpaque, p); problem != "" {
			return &wire.FieldError{Path: fmt.Sprintf("profiles[%d]", i), Problem: problem}
		}
	}
	return nil
}

// placement is what Incus takes as a target: a member's host name, or @ and
// a cluster group's name.
var placement = regexp.MustCompile(`^@?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)

func (e *Entry) daemonPort() uint16 {
	if e.DaemonPort == 0 {
		return guest.DefaultPort
	}
	return e.DaemonPort
}

func (e *Entry) instanceType() string {
	if e.InstanceType == "" {
		return "container"
	}
	return e.InstanceType
}

func isFingerprint(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, r := range s {
		if (r < '0' || r > '9') && (r < 'a' || r > 'f') {
			return false
		}
	}
	return true
}

type file struct {
	Templates []Entry `json:"templates"`
}

// Template is one catalog entry ready to build instances from.
type Template struct {
	Wire         controller.Template
	Fingerprint  string // pinned image
	ImageAlias   string // what the operator named, if an alias
	InstanceType string
	Profiles     []string
	DaemonPort   int
	IngressPort  int
	StoragePool  string
	Placement    string // Incus's target: a member, @group, or empty
	Warm         int    // instances kept created ahead, at least (see Entry.Warm)
	WarmMax      int    // and at most, as demand asks: Warm or more
	WarmState    string // how a spare waits: WarmStopped, WarmFrozen or WarmRunning
}

// How a template's spares wait (Entry.WarmState).
const (
	WarmStopped = "stopped"
	WarmFrozen  = "frozen"
	WarmRunning = "running"
)

// Pooled says the template keeps a warm pool, of any size.
func (t *Template) Pooled() bool { return t.WarmMax > 0 }

// Stopped says the template's spares wait stopped and are handed out by a
// rename (targets/warm.go).
func (t *Template) Stopped() bool { return t.Pooled() && t.WarmState == WarmStopped }

// Ready says the template's spares wait started (frozen or running) and
// are handed out under a stand-in lock (targets/ready.go).
func (t *Template) Ready() bool { return t.Pooled() && t.WarmState != WarmStopped }

// Catalog is the loaded, validated set of templates.
type Catalog struct {
	list []*Template
	byID map[string]*Template
	path string
}

// Load reads and validates a JSON or YAML templates file. A refusal is one
// sentence naming the file, the template and the member.
func Load(path string) (*Catalog, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("templates file %s cannot be read: %w", path, err)
	}
	// JSON is YAML, so one parser serves both; it also refuses repeated keys.
	var generic any
	if err := yaml.Unmarshal(raw, &generic); err != nil {
		return nil, fmt.Errorf("templates file %s is neither valid YAML nor JSON: %w", path, err)
	}
	var f file
	if err := wire.DecodeValue(normalizeYAML(generic), &f); err != nil {
		return nil, refusal(path, generic, err)
	}
	return build(path, f)
}

func build(path string, f file) (*Catalog, error) {
	if len(f.Templates) == 0 {
		return nil, fmt.Errorf("templates file %s lists no templates; add at least one under templates", path)
	}
	c := &Catalog{byID: map[string]*Template{}, path: path}
	for i := range f.Templates {
		e := f.Templates[i]
		if _, dup := c.byID[e.TemplateID]; dup {
			return nil, fmt.Errorf("templates file %s: template %q (templates[%d]) repeats a templateId; each must be unique", path, e.TemplateID, i)
		}
		profiles := e.Profiles
		if len(profiles) == 0 {
			profiles = []string{"default"}
		}
		wireForm := e.Template
		// The contract omits absent options and empty collections: a file
		// that writes resources: {} states nothing, and the listing says
		// nothing either.
		if r := wireForm.Resources; r != nil && r.VCPUs == nil && r.MemoryBytes == nil && r.DiskBytes == nil {
			wireForm.Resources = nil
		}
		t := &Template{
			Wire:         wireForm,
			Fingerprint:  e.ImageFingerprint,
			ImageAlias:   e.ImageAlias,
			InstanceType: e.instanceType(),
			Profiles:     profiles,
			DaemonPort:   int(e.daemonPort()),
			IngressPort:  int(e.IngressPort),
			StoragePool:  e.StoragePool,
			Placement:    e.Placement,
			Warm:         int(e.Warm),
			WarmMax:      int(max(e.Warm, e.WarmMax)),
			WarmState:    cmp.Or(e.WarmState, WarmStopped),
		}
		c.byID[e.TemplateID] = t
		c.list = append(c.list, t)
	}
	return c, nil
}

// refusal names the file, the template (by id when it could be read) and the member.
func refusal(path string, generic any, err error) error {
	var fe *wire.FieldError
	if !errors.As(err, &fe) {
		return fmt.Errorf("templates file %s is refused: %w", path, err)
	}
	which := ""
	var index int
	if n, _ := fmt.Sscanf(fe.Path, "templates[%d]", &index); n == 1 {
		which = fmt.Sprintf("template #%d", index)
		if id := templateIDAt(generic, index); id != "" {
			which = fmt.Sprintf("template %q", id)
		}
		return fmt.Errorf("templates file %s: %s: member %s %s", path, which, fe.Path, fe.Problem)
	}
	return fmt.Errorf("templates file %s: member %s %s", path, fe.Path, fe.Problem)
}

func templateIDAt(generic any, index int) string {
	top, _ := generic.(map[string]any)
	list, _ := top["templates"].([]any)
	if index < 0 || index >= len(list) {
		return ""
	}
	entry, _ := list[index].(map[string]any)
	id, _ := entry["templateId"].(string)
	return id
}

// normalizeYAML turns YAML's decoded shapes into the JSON shapes wire expects.
func normalizeYAML(v any) any {
	switch t := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, val := range t {
			out[k] = normalizeYAML(val)
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, val := range t {
			out[i] = normalizeYAML(val)
		}
		return out
	default:
		return v
	}
}

// ImageResolver is what Resolve needs from Incus.
type ImageResolver interface {
	GetImageAlias(ctx context.Context, alias string) (fingerprint string, err error)
	ImageExists(ctx context.Context, fingerprint string) (bool, error)
}

// Resolve pins every alias to its current fingerprint and checks that every
// image is present, so a target is always built from what start-up saw.
func (c *Catalog) Resolve(ctx context.Context, r ImageResolver) error {
	for _, t := range c.list {
		if t.ImageAlias != "" {
			fp, err := r.GetImageAlias(ctx, t.ImageAlias)
			if err != nil {
				return fmt.Errorf("templates file %s: template %q: image alias %q cannot be resolved in Incus: %w", c.path, t.Wire.TemplateID, t.ImageAlias, err)
			}
			t.Fingerprint = fp
		} else {
			ok, err := r.ImageExists(ctx, t.Fingerprint)
			if err != nil {
				return fmt.Errorf("templates file %s: template %q: image %s cannot be checked in Incus: %w", c.path, t.Wire.TemplateID, t.Fingerprint, err)
			}
			if !ok {
				return fmt.Errorf("templates file %s: template %q: image %s is not in Incus; import it or fix imageFingerprint", c.path, t.Wire.TemplateID, t.Fingerprint)
			}
		}
		if t.Wire.Metadata == nil {
			t.Wire.Metadata = map[string]string{}
		}
		t.Wire.Metadata["imageFingerprint"] = t.Fingerprint
		t.Wire.Metadata["instanceType"] = t.InstanceType
	}
	return nil
}

// Get finds a template by id.
func (c *Catalog) Get(id string) (*Template, bool) {
	t, ok := c.byID[id]
	return t, ok
}

// All lists the templates in file order.
func (c *Catalog) All() []*Template { return c.list }

// Wire lists the templates as template/list answers them.
func (c *Catalog) Wire() []controller.Template {
	out := make([]controller.Template, 0, len(c.list))
	for _, t := range c.list {
		out = append(out, t.Wire)
	}
	return out
}

// Host is what the Incus host can do for the catalog, as start-up reads it
// from the server description (GET /1.0).
type Host struct {
	// Server names the server in refusals, such as "Incus 6.0.4".
	Server string
	// VirtualMachines says the server runs virtual machines: its instance
	// drivers include qemu.
	VirtualMachines bool
	// StatefulStop says a virtual machine's execution state can be saved
	// by a stateful stop: the server runs virtual machines and knows the
	// migration.stateful setting (API extension migration_stateful) that
	// the provider sets on the instances of a template offering suspended.
	StatefulStop bool
}

// HostOf reads the host's facts from its server description.
func HostOf(srv *incus.Server) Host {
	h := Host{Server: strings.TrimSpace(srv.Environment.Server + " " + srv.Environment.ServerVersion)}
	if h.Server == "" {
		h.Server = "the Incus server"
	}
	// environment.driver lists the instance drivers, such as "lxc | qemu".
	for _, d := range strings.Split(srv.Environment.Driver, "|") {
		if strings.TrimSpace(d) == "qemu" {
			h.VirtualMachines = true
		}
	}
	h.StatefulStop = h.VirtualMachines && srv.HasExtension("migration_stateful")
	return h
}

// CheckHost refuses, at start-up, a template whose targets the host cannot
// serve as the template promises: a virtual machine on a host without
// virtual machines, or the power state suspended on a host that cannot do
// a stateful stop. The refusal is one sentence naming the file and the
// template.
func (c *Catalog) CheckHost(h Host) error {
	for _, t := range c.list {
		if slices.Contains(t.Wire.PowerStates, controller.PowerSuspended) && !h.StatefulStop {
			why := "it runs no virtual machines"
			if h.VirtualMachines {
				why = "it lacks migration.stateful (API extension migration_stateful)"
			}
			return fmt.Errorf("templates file %s: template %q offers the power state suspended, but %s cannot do a stateful stop here (%s); remove suspended from its powerStates",
				c.path, t.Wire.TemplateID, h.Server, why)
		}
		if t.InstanceType == "virtual-machine" && !h.VirtualMachines {
			return fmt.Errorf("templates file %s: template %q is a virtual machine, but %s cannot run virtual machines here (no qemu driver); use a container template or another host",
				c.path, t.Wire.TemplateID, h.Server)
		}
	}
	return nil
}

// Placer is what CheckPlacement asks Incus (incus.Client).
type Placer interface {
	ListClusterMembers(ctx context.Context) ([]incus.ClusterMember, error)
	ClusterGroupExists(ctx context.Context, name string) (bool, error)
}

// CheckPlacement refuses, at start-up, a template placed on a member or a
// cluster group the cluster does not have, or placed at all on a server
// that is no cluster: otherwise every create of it would fail, one owner at
// a time. The refusal is one sentence naming the file and the template.
func (c *Catalog) CheckPlacement(ctx context.Context, clustered bool, p Placer) error {
	var members []incus.ClusterMember
	listed := false
	for _, t := range c.list {
		if t.Placement == "" {
			continue
		}
		if !clustered {
			return fmt.Errorf("templates file %s: template %q has placement %q, but Incus here is not a cluster; remove placement", c.path, t.Wire.TemplateID, t.Placement)
		}
		if group, ok := strings.CutPrefix(t.Placement, "@"); ok {
			found, err := p.ClusterGroupExists(ctx, group)
			if err != nil {
				return fmt.Errorf("templates file %s: template %q: checking cluster group %q: %w", c.path, t.Wire.TemplateID, group, err)
			}
			if !found {
				return fmt.Errorf("templates file %s: template %q is placed on the cluster group %q, which the cluster does not have (incus cluster group list)", c.path, t.Wire.TemplateID, group)
			}
			continue
		}
		if !listed {
			var err error
			if members, err = p.ListClusterMembers(ctx); err != nil {
				return fmt.Errorf("templates file %s: template %q: listing cluster members: %w", c.path, t.Wire.TemplateID, err)
			}
			listed = true
		}
		if !slices.ContainsFunc(members, func(m incus.ClusterMember) bool { return m.ServerName == t.Placement }) {
			names := make([]string, 0, len(members))
			for _, m := range members {
				names = append(names, m.ServerName)
			}
			return fmt.Errorf("templates file %s: template %q is placed on the member %q, which the cluster does not have (members: %s)", c.path, t.Wire.TemplateID, t.Placement, strings.Join(names, ", "))
		}
	}
	return nil
}
