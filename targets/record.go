package targets

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// The provider keeps no database: what it knows of a target is on the
// target's instance, in the user.lightspeed.* config keys below, and the
// power requests Incus could not take yet are on the project (see
// pendingstore.go). This file is the only one that names those keys or
// reads and writes their values: recordOf decodes them into a record, and
// a change encodes a write of them, so that the encoding of every key has
// one reader and one writer. What is on an instance is read by every
// build of the provider, older and newer, so the encoding never changes
// without a new schema.
//
// Everything here is readable by the guest through /dev/incus, so nothing
// secret is ever stored in these keys.
const (
	keySchema      = "user.lightspeed.schema"
	keyUniverse    = "user.lightspeed.universe"
	keyEnvironment = "user.lightspeed.environment"
	keyTemplate    = "user.lightspeed.template"
	keyImage       = "user.lightspeed.image"
	keyDisplayName = "user.lightspeed.display_name"
	keyIdle        = "user.lightspeed.idle"
	keyDaemonPort  = "user.lightspeed.daemon_port"
	keyCreatedAt   = "user.lightspeed.created_at_ms"
	keyBooted      = "user.lightspeed.booted_at_ms"
	keyClosing     = "user.lightspeed.closing_since_ms"
	keyFailure     = "user.lightspeed.failure"
	// KeyIdleSince is exported for the idle loop's end-to-end test, which
	// reads the instance as an outside party would.
	KeyIdleSince = "user.lightspeed.idle_since_ms"

	keyPower   = "user.lightspeed.power"
	keyPowerAt = "user.lightspeed.power_at_ms"
	keyPowerBy = "user.lightspeed.power_by"
	// keyPowerDone is the power_at_ms of the power-down Incus carried out
	// last (see State.Intent): a target running under it was woken since.
	keyPowerDone = "user.lightspeed.power_done_ms"

	keyIngressLabel  = "user.lightspeed.ingress_label"
	keyIngressRouted = "user.lightspeed.ingress_routed"
	keyIngressPort   = "user.lightspeed.ingress_port"

	keyWarm        = "user.lightspeed.warm"
	keyWarmRecipe  = "user.lightspeed.warm_recipe"
	keyWarmReady   = "user.lightspeed.warm_ready_ms"
	keyWarmClaim   = "user.lightspeed.warm_claim"
	keyWarmClaimAt = "user.lightspeed.warm_claim_ms"
	// keyWarmMaker is the replica that made a ready spare, the only one
	// that hands it out; keyStandin, on a stand-in at an owner's name, the
	// ready spare that is the owner's target (see ready.go).
	keyWarmMaker = "user.lightspeed.warm_maker"
	keyStandin   = "user.lightspeed.standin"

	// keyRelayPrefix and a replica's id name that replica's relay lease
	// (see leases.go).
	keyRelayPrefix = "user.lightspeed.relays."

	// keyReplicaPrefix and a replica's id name, on the project, until when
	// that replica's word stands (see ready.go).
	keyReplicaPrefix = "user.lightspeed.replica."

	// keyPendingPrefix and an instance's name name, on the project, a
	// power request kept for that instance (see pendingstore.go).
	keyPendingPrefix = "user.lightspeed.pending_power."
)

// schemaVersion is what keySchema holds on every target.
const schemaVersion = "1"

// fields names some of a record's keys: the ones a decode reads, the ones
// a change writes, the ones a read found present.
type fields uint32

const (
	fSchema fields = 1 << iota
	// fOwner is the universe and environment keys.
	fOwner
	fTemplate
	fImage
	fDisplayName
	fIdle
	fDaemonPort
	fCreatedAt
	fBooted
	fClosing
	fFailure
	fIdleSince
	// fIntent is the power, power_at_ms and power_by keys: an intent is
	// read and written whole.
	fIntent
	// fPowerDone is the power-down carried out (keyPowerDone).
	fPowerDone
	fIngressLabel
	fIngressRouted
	fIngressPort
	fWarm
	fWarmRecipe
	fWarmReady
	fWarmClaim
	fWarmClaimAt
	fWarmMaker
	fStandin
	// fRelays is every replica's relay lease.
	fRelays
	fLast

	// fAll is every key of an instance.
	fAll = fLast - 1
	// fPool marks an instance of a warm pool; a claim takes it off.
	fPool = fWarm | fWarmRecipe | fWarmReady
	// fState is what StateOf reads.
	fState = fBooted | fClosing | fFailure | fIntent | fPowerDone
	// fOwned is what ownerOf reads: a ready spare is its owner's by its
	// claim, and a stand-in is no one's target.
	fOwned = fSchema | fOwner | fWarmClaim | fStandin
)

// record is an instance's user.lightspeed.* keys, typed. A key that is
// absent, or empty, reads as the field's zero value, and so does a value
// that does not decode (an instant, a port); has still reports such a key
// present, as the provider has always read a close, a ready mark, an
// idle-since instant or a lease by presence alone. An intent whose power is
// none of the protocol's is no intent at all: zero, and not present.
type record struct {
	Schema      string
	Owner       controller.Owner
	Template    string
	Image       string
	DisplayName string
	// Idle is the idle policy recorded at create; IdleErr is why a
	// recorded one does not decode. idleJSON is its text, which is what is
	// written: set both with setIdle.
	Idle     *idlepolicy.Policy
	IdleErr  error
	idleJSON string
	// DaemonPort is the guest daemon's port, 0 unless a port (1-65535).
	DaemonPort int
	CreatedAt  time.Time
	// Booted is when the instance first ran; before it, a stopped
	// instance is still being provisioned (and the reconciler starts it).
	Booted time.Time
	// Closing is when a close was recorded (has(fClosing) says whether
	// one was): the reconciler stops and deletes the instance, and
	// resumes that after a restart.
	Closing time.Time
	// Failure is why the provider gave up on the instance.
	Failure string
	// IdleSince is the instant idleness began for a target the provider
	// powered down, so its idle clock runs on while it cannot answer.
	IdleSince time.Time
	// Intent is the power last asked (see intent.go); zero unless its
	// power is one of the protocol's.
	Intent Intent
	// PowerDone is the At of the power-down intent Incus carried out last
	// (zero when none is known to be).
	PowerDone     time.Time
	IngressLabel  string
	IngressRouted bool
	// IngressPort is the guest port the edge reaches, 0 unless a port.
	IngressPort int
	// Warm is the template a warm instance was built for, WarmRecipe the
	// digest of what it was built from, WarmReady when Incus finished
	// creating it, and WarmClaim the owner's name a hand-out renames it
	// to, claimed at WarmClaimAt (see warm.go).
	Warm        string
	WarmRecipe  string
	WarmReady   time.Time
	WarmClaim   string
	WarmClaimAt time.Time
	// WarmMaker is the replica that made a ready spare; Standin, on a
	// stand-in, the ready spare it names (see ready.go).
	WarmMaker string
	Standin   string
	// Relays are the replicas' relay leases, by replica id, to when each
	// stands (zero: present, but no instant). Nil when there are none.
	Relays map[string]time.Time

	present fields
}

// has says whether any key of f was present (non-empty) when the record
// was read. Only the keys the decode was asked for are known.
func (r record) has(f fields) bool { return r.present&f != 0 }

// idleSinceIs says the recorded idle-since instant is t (zero: none is
// recorded). A recorded value that is no instant is never t.
func (r *record) idleSinceIs(t time.Time) bool {
	if t.IsZero() {
		return !r.has(fIdleSince)
	}
	return r.IdleSince.Equal(t)
}

// recordOf decodes the keys of want from an instance's config. It reads
// only those, one lookup each (the relay leases take a pass over the
// config), so the paths that read every instance of a project pay for the
// keys they use.
func recordOf(config map[string]string, want fields) (r record) {
	// r is the named result, filled in place: a local returned by value
	// was copied out whole, which doubled the cost of a one-key read.
	str := func(f fields, key string, dst *string) {
		if want&f != 0 {
			if v := config[key]; v != "" {
				r.present |= f
				*dst = v
			}
		}
	}
	ms := func(f fields, key string, dst *time.Time) {
		if want&f != 0 {
			if v := config[key]; v != "" {
				r.present |= f
				*dst, _ = parseMs(v)
			}
		}
	}
	port := func(f fields, key string, dst *int) {
		if want&f != 0 {
			if v := config[key]; v != "" {
				r.present |= f
				*dst = parsePort(v)
			}
		}
	}
	str(fSchema, keySchema, &r.Schema)
	if want&fOwner != 0 {
		r.Owner = controller.Owner{UniverseID: config[keyUniverse], EnvironmentID: config[keyEnvironment]}
		if r.Owner.UniverseID != "" || r.Owner.EnvironmentID != "" {
			r.present |= fOwner
		}
	}
	str(fTemplate, keyTemplate, &r.Template)
	str(fImage, keyImage, &r.Image)
	str(fDisplayName, keyDisplayName, &r.DisplayName)
	str(fIdle, keyIdle, &r.idleJSON)
	if r.idleJSON != "" {
		r.Idle, r.IdleErr = policyOf(r.idleJSON)
	}
	port(fDaemonPort, keyDaemonPort, &r.DaemonPort)
	ms(fCreatedAt, keyCreatedAt, &r.CreatedAt)
	ms(fBooted, keyBooted, &r.Booted)
	ms(fClosing, keyClosing, &r.Closing)
	str(fFailure, keyFailure, &r.Failure)
	ms(fIdleSince, KeyIdleSince, &r.IdleSince)
	ms(fPowerDone, keyPowerDone, &r.PowerDone)
	if want&fIntent != 0 {
		r.Intent = intentFrom(config[keyPower], config[keyPowerAt], config[keyPowerBy])
		if r.Intent.Power != "" {
			r.present |= fIntent
		}
	}
	str(fIngressLabel, keyIngressLabel, &r.IngressLabel)
	if want&fIngressRouted != 0 {
		if v := config[keyIngressRouted]; v != "" {
			r.present |= fIngressRouted
			r.IngressRouted = v == "true"
		}
	}
	port(fIngressPort, keyIngressPort, &r.IngressPort)
	str(fWarm, keyWarm, &r.Warm)
	str(fWarmRecipe, keyWarmRecipe, &r.WarmRecipe)
	ms(fWarmReady, keyWarmReady, &r.WarmReady)
	str(fWarmClaim, keyWarmClaim, &r.WarmClaim)
	ms(fWarmClaimAt, keyWarmClaimAt, &r.WarmClaimAt)
	str(fWarmMaker, keyWarmMaker, &r.WarmMaker)
	str(fStandin, keyStandin, &r.Standin)
	if want&fRelays != 0 {
		for k, v := range config {
			id, ok := strings.CutPrefix(k, keyRelayPrefix)
			if !ok || v == "" {
				continue
			}
			if r.Relays == nil {
				r.Relays = map[string]time.Time{}
			}
			r.Relays[id], _ = parseMs(v)
			r.present |= fRelays
		}
	}
	return
}

// intentFrom decodes the intent keys: a power that is none of the
// protocol's is no intent at all.
func intentFrom(power, at, by string) Intent {
	p := controller.Power(power)
	switch p {
	case controller.PowerRunning, controller.PowerPaused, controller.PowerSuspended, controller.PowerStopped:
	default:
		return Intent{}
	}
	t, _ := parseMs(at)
	return Intent{Power: p, At: t, By: Requester(by)}
}

// setIdle records p as the idle policy to write.
func (r *record) setIdle(p *idlepolicy.Policy) error {
	raw, err := json.Marshal(p)
	if err != nil {
		return fmt.Errorf("encode idle policy: %w", err)
	}
	r.Idle, r.IdleErr, r.idleJSON = p, nil, string(raw)
	return nil
}

// change is a write of some of an instance's keys: each key of keys is
// set to its value in to. A zero value (no instant, "", 0, false) is
// written as the empty string, which Incus's PATCH takes as removing the
// key: a change removes a key by naming it with a zero value. A create
// names only the keys it has values for (see ownerChange).
type change struct {
	keys fields
	to   record
}

// empty says the change writes nothing.
func (c change) empty() bool { return c.keys == 0 }

// config encodes the change as the config map Incus takes.
func (c change) config() map[string]string {
	if c.keys == 0 {
		return nil
	}
	out := make(map[string]string, 8)
	r := &c.to
	str := func(f fields, key, v string) {
		if c.keys&f != 0 {
			out[key] = v
		}
	}
	ms := func(f fields, key string, t time.Time) {
		if c.keys&f != 0 {
			out[key] = msText(t)
		}
	}
	port := func(f fields, key string, p int) {
		if c.keys&f != 0 {
			out[key] = ""
			if p != 0 {
				out[key] = strconv.Itoa(p)
			}
		}
	}
	str(fSchema, keySchema, r.Schema)
	str(fOwner, keyUniverse, r.Owner.UniverseID)
	str(fOwner, keyEnvironment, r.Owner.EnvironmentID)
	str(fTemplate, keyTemplate, r.Template)
	str(fImage, keyImage, r.Image)
	str(fDisplayName, keyDisplayName, r.DisplayName)
	str(fIdle, keyIdle, r.idleJSON)
	port(fDaemonPort, keyDaemonPort, r.DaemonPort)
	ms(fCreatedAt, keyCreatedAt, r.CreatedAt)
	ms(fBooted, keyBooted, r.Booted)
	ms(fClosing, keyClosing, r.Closing)
	str(fFailure, keyFailure, r.Failure)
	ms(fIdleSince, KeyIdleSince, r.IdleSince)
	str(fIntent, keyPower, string(r.Intent.Power))
	ms(fIntent, keyPowerAt, r.Intent.At)
	str(fIntent, keyPowerBy, string(r.Intent.By))
	ms(fPowerDone, keyPowerDone, r.PowerDone)
	str(fIngressLabel, keyIngressLabel, r.IngressLabel)
	if c.keys&fIngressRouted != 0 {
		out[keyIngressRouted] = ""
		if r.IngressRouted {
			out[keyIngressRouted] = "true"
		}
	}
	port(fIngressPort, keyIngressPort, r.IngressPort)
	str(fWarm, keyWarm, r.Warm)
	str(fWarmRecipe, keyWarmRecipe, r.WarmRecipe)
	ms(fWarmReady, keyWarmReady, r.WarmReady)
	str(fWarmClaim, keyWarmClaim, r.WarmClaim)
	ms(fWarmClaimAt, keyWarmClaimAt, r.WarmClaimAt)
	str(fWarmMaker, keyWarmMaker, r.WarmMaker)
	str(fStandin, keyStandin, r.Standin)
	if c.keys&fRelays != 0 {
		for id, until := range r.Relays {
			out[keyRelayPrefix+id] = msText(until)
		}
	}
	return out
}

// applyTo makes config what Incus makes of it once the change is written.
func (c change) applyTo(config map[string]string) { applyPatch(config, c.config()) }

// applyPatch applies an instance PATCH's config to config: an empty value
// removes its key.
func applyPatch(config, set map[string]string) {
	for k, v := range set {
		if v == "" {
			delete(config, k)
		} else {
			config[k] = v
		}
	}
}

// changeOf reads a config PATCH back as a change: every key it names,
// with its value (empty: removed). Keys that are not the record's are
// left out, and a field of several keys (the owner, the intent) is
// written whole. The project keeps the keys a power request is written
// with this way (see pendingstore.go): only ever the idle-since instant.
func changeOf(set map[string]string) change {
	var keys fields
	for k := range set {
		keys |= fieldOf(k)
	}
	c := change{keys: keys, to: recordOf(set, keys)}
	for k, v := range set {
		// A lease's removal is an entry with no instant; the decode
		// skipped it as absent.
		if id, ok := strings.CutPrefix(k, keyRelayPrefix); ok && v == "" {
			if c.to.Relays == nil {
				c.to.Relays = map[string]time.Time{}
			}
			c.to.Relays[id] = time.Time{}
		}
	}
	return c
}

// fieldOf is the field a key is part of; 0 for none.
func fieldOf(key string) fields {
	switch key {
	case keySchema:
		return fSchema
	case keyUniverse, keyEnvironment:
		return fOwner
	case keyTemplate:
		return fTemplate
	case keyImage:
		return fImage
	case keyDisplayName:
		return fDisplayName
	case keyIdle:
		return fIdle
	case keyDaemonPort:
		return fDaemonPort
	case keyCreatedAt:
		return fCreatedAt
	case keyBooted:
		return fBooted
	case keyClosing:
		return fClosing
	case keyFailure:
		return fFailure
	case KeyIdleSince:
		return fIdleSince
	case keyPower, keyPowerAt, keyPowerBy:
		return fIntent
	case keyPowerDone:
		return fPowerDone
	case keyIngressLabel:
		return fIngressLabel
	case keyIngressRouted:
		return fIngressRouted
	case keyIngressPort:
		return fIngressPort
	case keyWarm:
		return fWarm
	case keyWarmRecipe:
		return fWarmRecipe
	case keyWarmMaker:
		return fWarmMaker
	case keyStandin:
		return fStandin
	case keyWarmReady:
		return fWarmReady
	case keyWarmClaim:
		return fWarmClaim
	case keyWarmClaimAt:
		return fWarmClaimAt
	}
	if strings.HasPrefix(key, keyRelayPrefix) {
		return fRelays
	}
	return 0
}

// config is the intent's keys as written.
func (in Intent) config() map[string]string {
	return change{keys: fIntent, to: record{Intent: in}}.config()
}

// leaseKey is one replica's relay lease key. A reconcile pass looks for
// this replica's own lease on every instance: the key is made once, and the
// look is one lookup.
type leaseKey string

func leaseKeyOf(replica string) leaseKey { return leaseKey(keyRelayPrefix + replica) }

// heldIn says the lease is on an instance's config, whatever its value.
func (k leaseKey) heldIn(config map[string]string) bool { return config[string(k)] != "" }

// claimFilter is the Incus list filter (key, value) that selects the warm
// instances claimed for name.
func claimFilter(name string) (key, value string) { return keyWarmClaim, name }

// msString is an instant as the keys hold it: Unix milliseconds, in
// decimal.
func msString(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// msText is msString, with no instant written empty.
func msText(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return msString(t)
}

// parseMs reads msString's text; anything but a positive count is no
// instant.
func parseMs(s string) (time.Time, bool) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return time.Time{}, false
	}
	return time.UnixMilli(n), true
}

// parsePort reads a port; 0 for anything that is not one.
func parsePort(s string) int {
	p, err := strconv.Atoi(s)
	if err != nil || p <= 0 || p > 65535 {
		return 0
	}
	return p
}

// Recorded policies are few distinct strings (a template default, or what a
// create named), so decoding each once spares the listing of thousands of
// targets thousands of strict decodes. The cache is bounded; past the bound
// a policy is decoded every time.
var (
	policyCache     sync.Map // raw JSON → *idlepolicy.Policy
	policyCacheSize atomic.Int64
)

const policyCacheMax = 4096

func policyOf(raw string) (*idlepolicy.Policy, error) {
	if p, ok := policyCache.Load(raw); ok {
		return p.(*idlepolicy.Policy), nil
	}
	var p idlepolicy.Policy
	if err := wire.Decode([]byte(raw), &p); err != nil {
		return nil, err
	}
	if policyCacheSize.Load() < policyCacheMax {
		if _, loaded := policyCache.LoadOrStore(raw, &p); !loaded {
			policyCacheSize.Add(1)
		}
	}
	return &p, nil
}

// The project's keys: one power request kept for an instance, as JSON,
// under keyPendingPrefix and the instance's name. The project is written
// whole (see editProject), so a request is removed by leaving its key out.

// storedPending is a pending request as the project's config keeps it.
// Extra is the instance keys written with the intent, as a config PATCH.
type storedPending struct {
	Power controller.Power  `json:"power"`
	By    Requester         `json:"by"`
	AtMs  int64             `json:"atMs"`
	Extra map[string]string `json:"extra,omitempty"`
}

func encodePending(w pendingWrite) string {
	raw, _ := json.Marshal(storedPending{Power: w.intent.Power, By: w.intent.By, AtMs: w.intent.At.UnixMilli(), Extra: w.extra.config()})
	return string(raw)
}

func decodePending(v string) (pendingWrite, bool) {
	var sp storedPending
	if err := json.Unmarshal([]byte(v), &sp); err != nil || sp.Power == "" || sp.AtMs <= 0 {
		return pendingWrite{}, false
	}
	return pendingWrite{intent: Intent{Power: sp.Power, By: sp.By, At: time.UnixMilli(sp.AtMs)}, extra: changeOf(sp.Extra)}, true
}

// pendingIn reads the request the project's config keeps for name:
// present says its key is there at all, ok that it decodes.
func pendingIn(config map[string]string, name string) (w pendingWrite, present, ok bool) {
	v, present := config[keyPendingPrefix+name]
	if !present {
		return pendingWrite{}, false, false
	}
	w, ok = decodePending(v)
	return w, true, ok
}

// putPending keeps w for name in the project's config.
func putPending(config map[string]string, name string, w pendingWrite) {
	config[keyPendingPrefix+name] = encodePending(w)
}

// dropPending removes name's request from the project's config.
func dropPending(config map[string]string, name string) {
	delete(config, keyPendingPrefix+name)
}

// pendingAll reads every request the project's config keeps, by instance;
// bad are those that do not decode, with their text.
func pendingAll(config map[string]string) (kept map[string]pendingWrite, bad map[string]string) {
	for k, v := range config {
		name, ok := strings.CutPrefix(k, keyPendingPrefix)
		if !ok {
			continue
		}
		w, ok := decodePending(v)
		if !ok {
			if bad == nil {
				bad = map[string]string{}
			}
			bad[name] = v
			continue
		}
		if kept == nil {
			kept = map[string]pendingWrite{}
		}
		kept[name] = w
	}
	return kept, bad
}

// replicaWords reads the replicas' words from a project's config: until
// when each stands (see ready.go).
func replicaWords(config map[string]string) map[string]time.Time {
	out := map[string]time.Time{}
	for k, v := range config {
		if id, ok := strings.CutPrefix(k, keyReplicaPrefix); ok {
			out[id], _ = parseMs(v)
		}
	}
	return out
}

// putReplicaWord writes a replica's word into a project's config, and takes
// out every word that lapsed before lapsed.
func putReplicaWord(config map[string]string, id string, until, lapsed time.Time) {
	for k, v := range config {
		if _, ok := strings.CutPrefix(k, keyReplicaPrefix); ok {
			if at, ok := parseMs(v); !ok || at.Before(lapsed) {
				delete(config, k)
			}
		}
	}
	config[keyReplicaPrefix+id] = msText(until)
}
