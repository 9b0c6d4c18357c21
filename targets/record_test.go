package targets

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// fullRecord has a value in every field, each at the millisecond the keys
// keep.
func fullRecord(t *testing.T) record {
	t.Helper()
	at := func(s int) time.Time { return time.UnixMilli(1_700_000_000_000 + int64(s)*1000) }
	ms := uint64(3_600_000)
	r := record{
		Schema:        schemaVersion,
		Owner:         controller.Owner{UniverseID: "u-1", EnvironmentID: "env-1"},
		Template:      "t1",
		Image:         strings.Repeat("ab", 32),
		DisplayName:   "my env",
		DaemonPort:    19091,
		CreatedAt:     at(1),
		Booted:        at(2),
		Closing:       at(3),
		Failure:       "it broke",
		IdleSince:     at(4),
		Intent:        Intent{Power: controller.PowerPaused, At: at(5), By: ByIdle},
		PowerDone:     at(5),
		IngressLabel:  "abcdefghijklmnopqrstuvwxyz",
		IngressRouted: true,
		IngressPort:   8080,
		Warm:          "t1",
		WarmRecipe:    "0123456789abcdef",
		WarmReady:     at(6),
		WarmClaim:     "ls-0123456789abcdef0123",
		WarmClaimAt:   at(7),
		WarmMaker:     "r-a",
		Standin:       "lsr-0123456789abcdef0123",
		Relays:        map[string]time.Time{"r-a": at(8), "r-b": at(9)},
	}
	if err := r.setIdle(&idlepolicy.Policy{PauseAfterMs: &ms}); err != nil {
		t.Fatal(err)
	}
	return r
}

// eachField calls fn with every field of fAll, one at a time.
func eachField(fn func(f fields)) {
	for f := fields(1); f < fLast; f <<= 1 {
		fn(f)
	}
}

// Every field survives its own write and read, alone and all together, and
// a read reports each key it found present.
func TestRecordRoundTrips(t *testing.T) {
	want := fullRecord(t)
	want.present = fAll
	got := recordOf(change{keys: fAll, to: want}.config(), fAll)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decode(encode(x)) differs:\n got %+v\nwant %+v", got, want)
	}
	eachField(func(f fields) {
		config := change{keys: f, to: want}.config()
		if len(config) == 0 {
			t.Errorf("field %#x writes no key", f)
		}
		for k := range config {
			if fieldOf(k) != f {
				t.Errorf("field %#x writes %s, which reads back as field %#x", f, k, fieldOf(k))
			}
		}
		alone := recordOf(config, f)
		if !alone.has(f) || alone.present != f {
			t.Errorf("field %#x: present %#x after its own write", f, alone.present)
		}
		// Each field, read alone, is what the full record holds for it.
		if whole := recordOf(change{keys: fAll, to: want}.config(), f); !reflect.DeepEqual(whole, alone) {
			t.Errorf("field %#x reads differently from a config with every key:\n%+v\n%+v", f, whole, alone)
		}
		// And nothing else is read.
		other := recordOf(config, fAll&^f)
		if !reflect.DeepEqual(other, record{}) {
			t.Errorf("field %#x's keys read as other fields: %+v", f, other)
		}
	})
	// A change read back from the map it writes is the same change, and
	// so is one that removes every key.
	for _, c := range []change{{keys: fAll, to: want}, {keys: fAll, to: record{Relays: map[string]time.Time{"r-a": {}}}}} {
		if back := changeOf(c.config()); back.keys != fAll || !maps.Equal(back.config(), c.config()) {
			t.Fatalf("changeOf(config) is not the change: keys %#x, %v", back.keys, back.config())
		}
	}
}

// The keys and their text are what every earlier build wrote and read: a
// target created by one build is read by the next, and the other way
// round. Any change here is a schema change.
func TestRecordWireIsUnchanged(t *testing.T) {
	wire := map[string]string{
		"user.lightspeed.schema":           "1",
		"user.lightspeed.universe":         "u-1",
		"user.lightspeed.environment":      "env-1",
		"user.lightspeed.template":         "t1",
		"user.lightspeed.image":            strings.Repeat("ab", 32),
		"user.lightspeed.display_name":     "my env",
		"user.lightspeed.idle":             `{"pauseAfterMs":3600000}`,
		"user.lightspeed.daemon_port":      "19091",
		"user.lightspeed.created_at_ms":    "1700000001000",
		"user.lightspeed.booted_at_ms":     "1700000002000",
		"user.lightspeed.closing_since_ms": "1700000003000",
		"user.lightspeed.failure":          "it broke",
		"user.lightspeed.idle_since_ms":    "1700000004000",
		"user.lightspeed.power":            "paused",
		"user.lightspeed.power_at_ms":      "1700000005000",
		"user.lightspeed.power_by":         "idle",
		"user.lightspeed.power_done_ms":    "1700000005000",
		"user.lightspeed.ingress_label":    "abcdefghijklmnopqrstuvwxyz",
		"user.lightspeed.ingress_routed":   "true",
		"user.lightspeed.ingress_port":     "8080",
		"user.lightspeed.warm":             "t1",
		"user.lightspeed.warm_recipe":      "0123456789abcdef",
		"user.lightspeed.warm_ready_ms":    "1700000006000",
		"user.lightspeed.warm_claim":       "ls-0123456789abcdef0123",
		"user.lightspeed.warm_claim_ms":    "1700000007000",
		"user.lightspeed.warm_maker":       "r-a",
		"user.lightspeed.standin":          "lsr-0123456789abcdef0123",
		"user.lightspeed.relays.r-a":       "1700000008000",
		"user.lightspeed.relays.r-b":       "1700000009000",
	}
	want := fullRecord(t)
	if got := (change{keys: fAll, to: want}).config(); !maps.Equal(got, wire) {
		t.Fatalf("the encoding changed:\n got %v\nwant %v", got, wire)
	}
	want.present = fAll
	if got := recordOf(wire, fAll); !reflect.DeepEqual(got, want) {
		t.Fatalf("the decoding changed:\n got %+v\nwant %+v", got, want)
	}
	if KeyIdleSince != "user.lightspeed.idle_since_ms" || schemaVersion != "1" {
		t.Fatal("the idle-since key or the schema changed")
	}

	// The project's copy of a power request kept for an instance.
	w := pendingWrite{intent: Intent{Power: controller.PowerStopped, At: time.UnixMilli(1_700_000_000_000), By: BySetPower},
		extra: change{keys: fIdleSince, to: record{IdleSince: time.UnixMilli(1_700_000_000_000)}}}
	project := map[string]string{"other": "kept"}
	putPending(project, "ls-0123456789abcdef0123", w)
	wantProject := map[string]string{"other": "kept",
		"user.lightspeed.pending_power.ls-0123456789abcdef0123": `{"power":"stopped","by":"setPower","atMs":1700000000000,"extra":{"user.lightspeed.idle_since_ms":"1700000000000"}}`}
	if !maps.Equal(project, wantProject) {
		t.Fatalf("the stored request's encoding changed: %v", project)
	}
	back, present, ok := pendingIn(project, "ls-0123456789abcdef0123")
	if !present || !ok || !sameIntent(back.intent, w.intent) || !maps.Equal(back.extra.config(), w.extra.config()) {
		t.Fatalf("the stored request does not read back: %+v %v %v", back, present, ok)
	}
	// A request with no extra keys stores none (SetPower running).
	if got := encodePending(pendingWrite{intent: w.intent}); got != `{"power":"stopped","by":"setPower","atMs":1700000000000}` {
		t.Fatalf("a request without extra keys stores %s", got)
	}
	dropPending(project, "ls-0123456789abcdef0123")
	if !maps.Equal(project, map[string]string{"other": "kept"}) {
		t.Fatalf("a dropped request's key stays: %v", project)
	}
}

// A change naming a key with its zero value writes the empty string,
// which is how an Incus PATCH removes a key; applying it removes the key.
func TestRecordChangeRemovesZeroValues(t *testing.T) {
	full := change{keys: fAll, to: fullRecord(t)}.config()
	clear := change{keys: fAll &^ fRelays}.config()
	for k, v := range clear {
		if v != "" {
			t.Errorf("%s: a zero value writes %q", k, v)
		}
	}
	if len(clear) != len(full)-2 {
		t.Errorf("%d keys removed of %d", len(clear), len(full)-2)
	}
	leases := change{keys: fRelays, to: record{Relays: map[string]time.Time{"r-a": {}}}}.config()
	if !maps.Equal(leases, map[string]string{keyRelayPrefix + "r-a": ""}) {
		t.Errorf("removing a lease writes %v", leases)
	}
	config := maps.Clone(full)
	change{keys: fAll &^ fRelays}.applyTo(config)
	change{keys: fRelays, to: record{Relays: map[string]time.Time{"r-a": {}}}}.applyTo(config)
	if !maps.Equal(config, map[string]string{keyRelayPrefix + "r-b": full[keyRelayPrefix+"r-b"]}) {
		t.Errorf("after removing every key but one lease: %v", config)
	}
	if got := recordOf(config, fAll&^fRelays); !reflect.DeepEqual(got, record{}) {
		t.Errorf("removed keys still read: %+v", got)
	}
	if (change{}).config() != nil || !(change{}).empty() {
		t.Error("an empty change writes something")
	}
}

// Values that do not decode read as the code has always read them: an
// instant that is no positive count of milliseconds is no instant (but its
// key is present), a port out of range is none, a power that is none of
// the protocol's is no intent, and an empty value is no key.
func TestRecordReadsGarbageAsBefore(t *testing.T) {
	for _, bad := range []string{"0", "-5", "abc", "1.5", " 12", "99999999999999999999"} {
		config := map[string]string{keyCreatedAt: bad, keyBooted: bad, keyClosing: bad, KeyIdleSince: bad,
			keyWarmReady: bad, keyWarmClaimAt: bad, keyRelayPrefix + "r-a": bad,
			keyPower: "running", keyPowerAt: bad, keyPowerBy: "use"}
		r := recordOf(config, fAll)
		for _, at := range []time.Time{r.CreatedAt, r.Booted, r.Closing, r.IdleSince, r.WarmReady, r.WarmClaimAt, r.Intent.At, r.Relays["r-a"]} {
			if !at.IsZero() {
				t.Errorf("%q reads as the instant %v", bad, at)
			}
		}
		if want := fCreatedAt | fBooted | fClosing | fIdleSince | fWarmReady | fWarmClaimAt | fRelays | fIntent; r.present != want {
			t.Errorf("%q: present %#x, want %#x", bad, r.present, want)
		}
		if r.Intent.Power != controller.PowerRunning || r.Intent.By != ByUse {
			t.Errorf("%q as power_at_ms loses the intent: %+v", bad, r.Intent)
		}
		if _, ok := parseMs(bad); ok {
			t.Errorf("parseMs(%q) reads an instant", bad)
		}
		if st := stateOf(&incus.Instance{Status: incus.InstanceStopped}, &r); st.Phase != controller.PhaseClosing || st.Booted {
			t.Errorf("%q: a close is read by presence and a boot by its instant: %+v", bad, st)
		}
		if foreignLeases(r.Relays, "r-self", time.Now()) != 0 {
			t.Errorf("a lease of %q counts as live", bad)
		}
		if r.idleSinceIs(time.Time{}) || r.idleSinceIs(time.UnixMilli(5)) {
			t.Errorf("idle-since %q reads as some instant", bad)
		}
	}
	for _, bad := range []string{"0", "-1", "65536", "abc", "80x"} {
		r := recordOf(map[string]string{keyDaemonPort: bad, keyIngressPort: bad}, fAll)
		if r.DaemonPort != 0 || r.IngressPort != 0 {
			t.Errorf("port %q reads as %d, %d", bad, r.DaemonPort, r.IngressPort)
		}
	}
	r := recordOf(map[string]string{keyPower: "flying", keyPowerAt: "1700000000000", keyPowerBy: "use",
		keyIngressRouted: "yes", keyIdle: `{"pauseAfterMs":-1}`, keySchema: ""}, fAll)
	if r.Intent != (Intent{}) || r.has(fIntent) {
		t.Errorf("an unknown power is an intent: %+v", r.Intent)
	}
	if r.IngressRouted || !r.has(fIngressRouted) {
		t.Errorf("ingress_routed=yes: routed %v, present %v", r.IngressRouted, r.has(fIngressRouted))
	}
	if r.Idle != nil || r.IdleErr == nil {
		t.Errorf("an idle policy that does not decode: %+v, %v", r.Idle, r.IdleErr)
	}
	if r.has(fSchema) {
		t.Error("an empty value reads as a key")
	}
	if got := recordOf(map[string]string{KeyIdleSince: "1700000000000"}, fIdleSince); !got.idleSinceIs(time.UnixMilli(1_700_000_000_000)) || got.idleSinceIs(time.Time{}) {
		t.Error("a recorded idle-since is not the instant it holds")
	}
	if got := recordOf(nil, fAll); !reflect.DeepEqual(got, record{}) || !got.idleSinceIs(time.Time{}) {
		t.Errorf("no config reads as %+v", got)
	}
	if kept, bad := pendingAll(map[string]string{keyPendingPrefix + "a": "{", keyPendingPrefix + "b": `{"power":"","atMs":5}`,
		keyPendingPrefix + "c": `{"power":"running","by":"use","atMs":5}`, "user.other": "x"}); len(kept) != 1 || len(bad) != 2 || bad["a"] != "{" {
		t.Errorf("stored requests: kept %v, bad %v", kept, bad)
	}
	if _, present, ok := pendingIn(map[string]string{keyPendingPrefix + "a": ""}, "a"); !present || ok {
		t.Error("an empty stored request is not present and undecodable")
	}
}

// Only record.go names the keys or reads an instance's config: every other
// file of the package goes through recordOf and change.
func TestOnlyRecordReadsTheKeys(t *testing.T) {
	fset := token.NewFileSet()
	rec, err := parser.ParseFile(fset, "record.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	for _, d := range rec.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, spec := range g.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				if i < len(vs.Values) {
					if lit, ok := vs.Values[i].(*ast.BasicLit); ok && strings.HasPrefix(lit.Value, `"user.lightspeed.`) {
						keys[name.Name] = true
					}
				}
			}
		}
	}
	if len(keys) < 25 {
		t.Fatalf("found only %d key constants in record.go", len(keys))
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, name := range files {
		if name == "record.go" || strings.HasSuffix(name, "_test.go") {
			continue
		}
		checked++
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if i := strings.Index(string(src), "user.lightspeed."); i >= 0 {
			t.Errorf("%s:%d names a key: only record.go does", name, 1+strings.Count(string(src[:i]), "\n"))
		}
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		written := map[ast.Expr]bool{}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.AssignStmt:
				if n.Tok == token.ASSIGN {
					for _, lhs := range n.Lhs {
						written[lhs] = true
					}
				}
			case *ast.IndexExpr:
				if sel, ok := n.X.(*ast.SelectorExpr); ok && sel.Sel.Name == "Config" && !written[n] {
					t.Errorf("%s: reads a Config map directly: decode it with recordOf", fset.Position(n.Pos()))
				}
			case *ast.Ident:
				if keys[n.Name] {
					t.Errorf("%s: uses the key %s: only record.go does", fset.Position(n.Pos()), n.Name)
				}
			}
			return true
		})
	}
	if checked < 15 {
		t.Fatalf("checked only %d files", checked)
	}
}
