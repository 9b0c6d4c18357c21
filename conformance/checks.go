package conformance

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// checks are the suite, in the order it runs them. error-answers runs last
// because it also reviews every error answer the earlier checks received.
var checks = []check{
	{"handshake", `§Handshake: "Before a successful initialize, any other request is answered with notInitialized, and notifications are dropped." … "A second initialize after a successful one is invalidRequest."`,
		checkHandshake},
	{"framing", `§Envelope: "A notification has no id and is never answered, not even with an error." … "The connection stays open after every framing error."`,
		checkFraming},
	{"strict-envelope", `§Decoding: "Every params, response, and message type on the three planes decodes strictly: an unknown member is refused."`,
		checkStrictEnvelope},
	{"one-frame", `§Envelope: "Each WebSocket text frame holds exactly one JSON-RPC message."`,
		checkOneFrame},
	{"pipelining", `§Pipelining and cancellation: "Servers accept at least 16 requests in flight per connection" … "Beyond it, a server answers busy with reason requestLimit at once."`,
		checkPipelining},
	{"ping", `§Liveness: "The daemon, providers, and the gateway answer pings" … "A server answers pings even while it is busy writing responses."`,
		checkPing},
	{"message-limit", `§Limits: "Every message, and therefore every frame, is at most 16 MiB (16,777,216 bytes) on every hop. Each reader and writer configures that limit explicitly."`,
		checkMessageLimit},
	{"response-limit", `§Limits: "A server whose response would exceed it answers payloadTooLarge for the same id instead."`,
		checkResponseLimit},
	{"credential", `§Transport and credential: "the provider compares it in constant time and answers HTTP 401 before the upgrade when it is missing or wrong."`,
		checkCredential},
	{"strict-params", `§Errors: "invalidParams: Params do not decode, a value is out of range … field is the wire path of the offending member."`,
		checkStrictParams},
	{"template-list", `§Templates: "A template has a templateId, a non-empty displayName, and these optional fields."`,
		checkTemplateList},
	{"create-idempotency", `§Methods, target/create: "Idempotent per owner. If the provider already holds a target for the owner, answer its observation." … "Otherwise apply policy" (failedPrecondition templateDeprecated)`,
		checkCreateIdempotency},
	{"pure-get", `§Methods, target/get: "A pure read: it never creates, starts, or changes anything."`,
		checkPureGet},
	{"owner-fencing", `§Ownership: "A target that belongs to another owner is refused with failedPrecondition (ownerMismatch)."`,
		checkOwnerFencing},
	{"close-by-owner", `§Methods, target/close: "Answer closing while it runs, closed once nothing remains, and closed without targetId when the provider holds nothing for the owner. Idempotent."`,
		checkCloseByOwner},
	{"set-power", `§Methods, target/setPower: "Move the target to one of its template's powerStates. A target already there, or moving there, is observed without action. Answer promptly with the transitional observation."`,
		checkSetPower},
	{"capability-unavailable", `§initialize: "A controller that receives an optional method it does not serve answers capabilityUnavailable."`,
		checkCapabilityUnavailable},
	{"ingress", `§Methods, ingress/ensure: "Route the template's public ingress to the target. Idempotent."; ingress/remove: "Stop routing public ingress to a target that stays."`,
		checkIngress},
	{"data-route", `§Data routes: "The provider serves the data plane unchanged on that route, under the liveness rule and the message limit above, and refuses a route whose owner does not own the target." (each segment percent-encoded; 401 without the credential; 410 gone once closed)`,
		checkDataRoute},
	{"route-wake", `§Data routes: "A dial of a powered-down target's data route wakes the target." … "The provider may hold the dial for at most 5 seconds" … "Every 503 carries Retry-After in whole seconds, from 1 to 60."`,
		checkRouteWake},
	{"idle-obligations", `§Provider obligations: "3. decides idleness from the daemon's env/getIdle, so running processes, jobs, and leftover process groups keep the target awake; 4. never powers a target down while it relays a data connection to it"; §Idle policy: "The provider runs the clock."`,
		checkIdleObligations},
	{"idle-close", `§Provider obligations: "5. reports closed, or notFound from target/get, for a target it removed on its own, such as by a lifetime limit or an idle closeAfterMs"; §Idle policy: "close always qualifies."`,
		checkIdleClose},
	{"bounded-calls", `§Bounded calls: "Every method answers within a bounded time, a few seconds. Slow work … continues in the background, and the runtime follows it with target/get."`,
		checkBoundedCalls},
	{"error-answers", `§Errors: "An error is a JSON-RPC error object. Its code is fixed by its kind, and its data carries the kind and its typed fields." … "A message is at most 4096 bytes."`,
		checkErrorAnswers},
}

// checkHandshake: the four handshake rules, and the response's shape.
func checkHandshake(ctx context.Context, r *checkRun) {
	c := r.mustConnect(ctx)
	defer c.close()
	list := controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID}
	// An owner nothing is created for: the server is not initialized.
	ref := controller.TargetRef{Owner: controller.Owner{UniverseID: r.s.cfg.UniverseID, EnvironmentID: "lsconf-" + r.s.runID + "-uninitialized"}}

	f := r.rt(ctx, c, "template/list before initialize", controller.MethodTemplateList, list)
	r.wantError(f, jsonrpc.KindNotInitialized, "template/list before initialize")

	if err := c.notify(ctx, controller.MethodTemplateList, list); err != nil {
		r.fatalf("send a notification before initialize: %v", err)
	}
	f = r.rt(ctx, c, "the request after a notification sent before initialize (the notification must be dropped unanswered)", controller.MethodTargetGet, getParams(ref))
	r.wantError(f, jsonrpc.KindNotInitialized, "target/get before initialize")

	f = r.rt(ctx, c, "initialize with protocolVersion 3", controller.MethodInitialize, initializeParams(3))
	if e := r.errorAnswer(f, jsonrpc.KindVersionMismatch, "initialize with protocolVersion 3"); e != nil {
		if e.Expected == nil || *e.Expected != controller.ProtocolVersion {
			r.failf("versionMismatch: data.expected is %s, want %d", optional(e.Expected), controller.ProtocolVersion)
		}
		if e.Received == nil || *e.Received != 3 {
			r.failf("versionMismatch: data.received is %s, want 3", optional(e.Received))
		}
	}
	f = r.rt(ctx, c, "template/list after versionMismatch", controller.MethodTemplateList, list)
	r.wantError(f, jsonrpc.KindNotInitialized, "template/list after versionMismatch (the connection stays open and uninitialized)")

	f = r.rt(ctx, c, "initialize without protocolVersion", controller.MethodInitialize, map[string]any{"clientInfo": clientInfo})
	r.wantInvalidParams(f, "initialize without protocolVersion", "protocolVersion")

	f = r.rt(ctx, c, "initialize with protocolVersion 4 after the refusals", controller.MethodInitialize, initializeParams(controller.ProtocolVersion))
	if f.rpcErr != nil {
		r.fatalf("initialize with protocolVersion %d after the refusals: %s", controller.ProtocolVersion, describeErr(f.rpcErr))
	}
	var init controller.InitializeResult
	if err := wire.Decode(f.result, &init); err != nil {
		r.failf("the initialize result does not decode strictly: %v (result: %s)", err, clip(string(f.result), 300))
	}
	var members map[string]json.RawMessage
	_ = json.Unmarshal(f.result, &members)
	if caps := members["capabilities"]; !strings.HasPrefix(strings.TrimSpace(string(caps)), "{") {
		r.failf("the initialize result's capabilities is not an object: %s", clip(string(caps), 100))
	}
	if init.Plane != controller.Plane {
		r.failf("the initialize result names plane %q, want %q", init.Plane, controller.Plane)
	}
	if init.ProtocolVersion != controller.ProtocolVersion {
		r.failf("the initialize result names protocolVersion %d, want %d", init.ProtocolVersion, controller.ProtocolVersion)
	}
	if init.ServerInfo.Name == "" {
		r.failf("the initialize result has no serverInfo.name")
	}

	f = r.rt(ctx, c, "a second initialize", controller.MethodInitialize, initializeParams(controller.ProtocolVersion))
	r.wantError(f, jsonrpc.KindInvalidRequest, "a second initialize")

	f = r.rt(ctx, c, "template/list after the handshake", controller.MethodTemplateList, list)
	if f.rpcErr != nil {
		r.failf("template/list after a successful initialize: %s", describeErr(f.rpcErr))
	}
	r.notef("server %s %s, capabilities power=%t ingress=%t", init.ServerInfo.Name, init.ServerInfo.Version,
		init.Capabilities.Power, init.Capabilities.Ingress)
}

func optional(v *uint64) string {
	if v == nil {
		return "absent"
	}
	return fmt.Sprint(*v)
}

// checkFraming: every framing error has its answer, and the connection
// stays open after each; notifications are never answered.
func checkFraming(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	listParams := fmt.Sprintf(`{"universeId":%q}`, r.s.cfg.UniverseID)
	request := func(id string) string {
		return fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"method":"template/list","params":%s}`, id, listParams)
	}
	probe := func(after string) { r.probeServes(ctx, c, after) }
	cases := []struct {
		what   string
		binary bool
		frame  string
		kind   jsonrpc.Kind
		ids    []string // the ids the answer may carry
	}{
		{"a binary frame", true, request("1001"), jsonrpc.KindInvalidRequest, []string{"null"}},
		{"a batch", false, "[" + request("1002") + "]", jsonrpc.KindInvalidRequest, []string{"null"}},
		{"a frame that is not JSON", false, `{"jsonrpc":"2.0","id":1003,"method":`, jsonrpc.KindParseError, []string{"null"}},
		{`jsonrpc "1.0"`, false, strings.Replace(request("1004"), `"2.0"`, `"1.0"`, 1), jsonrpc.KindInvalidRequest, []string{"1004", "null"}},
		{"an unknown envelope member", false, strings.TrimSuffix(request("1005"), "}") + `,"extra":true}`, jsonrpc.KindInvalidRequest, []string{"1005", "null"}},
		{"an id that is neither an integer nor a string", false, request("true"), jsonrpc.KindInvalidRequest, []string{"null"}},
		{"params as an array", false, fmt.Sprintf(`{"jsonrpc":"2.0","id":1007,"method":"template/list","params":[%q]}`, r.s.cfg.UniverseID), jsonrpc.KindInvalidParams, []string{"1007"}},
	}
	for _, tc := range cases {
		var err error
		if tc.binary {
			err = c.send(ctx, websocket.BinaryMessage, []byte(tc.frame))
		} else {
			err = c.sendText(ctx, tc.frame)
		}
		if err != nil {
			r.fatalf("%s: %v", tc.what, err)
		}
		f, err := c.next(ctx, tc.what)
		if err != nil {
			r.fatalf("%s: %v", tc.what, err)
		}
		r.wantError(f, tc.kind, tc.what)
		if !slices.Contains(tc.ids, f.id) {
			r.failf("%s: the answer carries id %s, want %s", tc.what, f.id, strings.Join(tc.ids, " or "))
		}
		probe(tc.what)
	}
	notifications := []struct{ what, frame string }{
		{"a notification", fmt.Sprintf(`{"jsonrpc":"2.0","method":"template/list","params":%s}`, listParams)},
		{"a notification of an unknown method", `{"jsonrpc":"2.0","method":"conformance/unknown"}`},
		{"a malformed notification (jsonrpc \"1.0\", a method, no id)", fmt.Sprintf(`{"jsonrpc":"1.0","method":"template/list","params":%s}`, listParams)},
	}
	for _, n := range notifications {
		if err := c.sendText(ctx, n.frame); err != nil {
			r.fatalf("%s: %v", n.what, err)
		}
		// The next frame must answer the probe: the notification has none.
		probe(n.what + " (it must not be answered)")
	}
	r.notef("%d framing errors answered and %d notifications dropped, the connection open throughout", len(cases), len(notifications))
}

// probeServes shows that c still serves, and that nothing was answered in
// between: the next frame must answer a template/list under a string id.
func (r *checkRun) probeServes(ctx context.Context, c *conn, after string) {
	listParams := fmt.Sprintf(`{"universeId":%q}`, r.s.cfg.UniverseID)
	id := fmt.Sprintf("probe-%d", c.newID())
	if err := c.request(ctx, id, controller.MethodTemplateList, json.RawMessage(listParams)); err != nil {
		r.fatalf("after %s: %v", after, err)
	}
	quoted, _ := json.Marshal(id)
	f, err := c.expectID(ctx, controller.MethodTemplateList, string(quoted))
	if err != nil {
		r.fatalf("after %s the connection no longer serves: %v", after, err)
	}
	if f.rpcErr != nil {
		r.failf("after %s, template/list answered %s", after, describeErr(f.rpcErr))
	}
}

// checkStrictEnvelope: the contract's strict decoding, on the envelope and
// on params, where a lenient JSON reader gives in: a member named twice
// (encoding/json and many others keep the last), text that is not
// Unicode (invalid UTF-8, a lone UTF-16 surrogate: many readers make
// U+FFFD of it), the id -0, and a second initialize whose params are not
// an object. Each is refused, or answered, as a strict peer would, and the
// connection serves on.
func checkStrictEnvelope(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	listParams := fmt.Sprintf(`{"universeId":%q}`, r.s.cfg.UniverseID)
	list := func(head string) string {
		return fmt.Sprintf(`{"jsonrpc":"2.0",%s,"method":"template/list","params":%s}`, head, listParams)
	}
	cases := []struct {
		what  string
		frame string
		kinds []jsonrpc.Kind // any of them
		ids   []string       // the ids the answer may carry
	}{
		{"an id sent twice", list(`"id":2001,"id":2002`), []jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"null"}},
		{"a method sent twice", fmt.Sprintf(`{"jsonrpc":"2.0","id":2003,"method":"template/list","method":"template/list","params":%s}`, listParams),
			[]jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"2003", "null"}},
		{"params sent twice", fmt.Sprintf(`{"jsonrpc":"2.0","id":2004,"method":"template/list","params":%s,"params":%s}`, listParams, listParams),
			[]jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"2004", "null"}},
		{"a params member sent twice", fmt.Sprintf(`{"jsonrpc":"2.0","id":2005,"method":"template/list","params":{"universeId":%q,"universeId":%q}}`, r.s.cfg.UniverseID, r.s.cfg.UniverseID),
			[]jsonrpc.Kind{jsonrpc.KindInvalidParams, jsonrpc.KindInvalidRequest}, []string{"2005", "null"}},
		{"an id holding a lone UTF-16 surrogate", list(`"id":"a\ud800b"`), []jsonrpc.Kind{jsonrpc.KindParseError, jsonrpc.KindInvalidRequest}, []string{"null"}},
		{"an id holding invalid UTF-8", list("\"id\":\"a\xffb\""), []jsonrpc.Kind{jsonrpc.KindParseError, jsonrpc.KindInvalidRequest}, []string{"null"}},
		{"a second initialize with params that are not an object", `{"jsonrpc":"2.0","id":2006,"method":"initialize","params":[]}`,
			[]jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"2006"}},
		// A request has an integer or string id (§Envelope).
		{"a fractional id", list(`"id":1.5`), []jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"null"}},
		{"an object id", list(`"id":{}`), []jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"null"}},
		{"an array id", list(`"id":[2007]`), []jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"null"}},
		{"a null id", list(`"id":null`), []jsonrpc.Kind{jsonrpc.KindInvalidRequest}, []string{"null"}},
	}
	for _, tc := range cases {
		if err := c.sendText(ctx, tc.frame); err != nil {
			r.fatalf("%s: %v", tc.what, err)
		}
		f, err := c.next(ctx, tc.what)
		if err != nil {
			r.fatalf("%s: %v", tc.what, err)
		}
		switch {
		case f.rpcErr == nil:
			r.failf("%s: answered a result under id %s; want %s", tc.what, f.id, kindsText(tc.kinds))
		case !slices.Contains(tc.kinds, f.rpcErr.Kind):
			r.failf("%s: answered %s; want %s", tc.what, describeErr(f.rpcErr), kindsText(tc.kinds))
		case !slices.Contains(tc.ids, f.id):
			r.failf("%s: the answer carries id %s, want %s", tc.what, f.id, strings.Join(tc.ids, " or "))
		}
		r.probeServes(ctx, c, tc.what)
	}
	// The id -0 is the integer 0: its answer carries 0.
	if err := c.sendText(ctx, list(`"id":-0`)); err != nil {
		r.fatalf("the id -0: %v", err)
	}
	f, err := c.next(ctx, "the id -0")
	if err != nil {
		r.fatalf("the id -0: %v", err)
	}
	// The client reads ids by value, as a peer does; the text is what a
	// peer comparing ids as sent would trip on.
	var members map[string]json.RawMessage
	if f.rpcErr != nil || json.Unmarshal(f.raw, &members) != nil {
		r.failf("the id -0: want a result, got %s", f)
	} else if got := string(members["id"]); got != "0" {
		r.failf("the id -0 was answered with id %s; want 0, the integer it is", got)
	}
	// Ids of every allowed shape come back as sent.
	allowed := []string{`-7`, `""`, `"é ✓ lsconform"`, `9007199254740991`}
	for _, id := range allowed {
		if err := c.sendText(ctx, list(`"id":`+id)); err != nil {
			r.fatalf("the id %s: %v", id, err)
		}
		f, err := c.next(ctx, "the id "+id)
		if err != nil {
			r.fatalf("the id %s: %v", id, err)
		}
		var members map[string]json.RawMessage
		var got, want any
		switch {
		case f.rpcErr != nil:
			r.failf("the id %s, an allowed one, was refused: %s", id, describeErr(f.rpcErr))
		case json.Unmarshal(f.raw, &members) != nil || json.Unmarshal(members["id"], &got) != nil || json.Unmarshal([]byte(id), &want) != nil:
			r.failf("the id %s: the answer does not decode", id)
		case got != want:
			r.failf("the id %s was answered with id %s", id, members["id"])
		}
	}
	r.notef("%d malformed envelopes refused, the id -0 answered as 0, %d allowed ids echoed, the connection open throughout", len(cases), len(allowed))
}

func kindsText(kinds []jsonrpc.Kind) string {
	out := make([]string, len(kinds))
	for i, k := range kinds {
		out[i] = string(k)
	}
	return strings.Join(out, " or ")
}

// checkCredential: the bearer credential is required before the upgrade.
func checkCredential(ctx context.Context, r *checkRun) {
	cred := r.s.cfg.Credential
	if cred == "" {
		r.skipf("no credential is configured, so the provider is taken to run without one")
	}
	refused := func(what string, h http.Header) {
		ws, status, err := r.s.dial(ctx, h)
		if err == nil {
			_ = ws.Close()
			r.failf("%s: the controller upgraded the connection; want HTTP 401 before the upgrade", what)
			return
		}
		if status == 0 {
			r.failf("%s: %v; want HTTP 401", what, err)
			return
		}
		if status != http.StatusUnauthorized {
			r.failf("%s: HTTP %d, want 401", what, status)
		}
	}
	refused("no Authorization header", http.Header{})
	refused("a wrong credential", http.Header{"Authorization": {"Bearer " + cred + "-wrong"}})
	refused("the credential under the Basic scheme", http.Header{"Authorization": {"Basic " + cred}})
	c, _, err := r.s.open(ctx, r.name)
	if err != nil {
		r.fatalf("with the right credential: %v", err)
	}
	c.close()
	r.notef("401 without, with a wrong and with a non-Bearer credential; the right one upgrades")
}

// checkStrictParams: params decode strictly, and a refusal names the member.
func checkStrictParams(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	owner := r.owner("strict")
	ownerJSON := fmt.Sprintf(`{"universeId":%q,"environmentId":%q}`, owner.UniverseID, owner.EnvironmentID)
	var gets, creates int
	get := func(what, params string, fields ...string) {
		gets++
		f := r.rt(ctx, c, what, controller.MethodTargetGet, json.RawMessage(params))
		r.wantInvalidParams(f, "target/get with "+what, fields...)
	}
	get("an unknown member in target.owner", fmt.Sprintf(`{"target":{"owner":{"universeId":%q,"environmentId":%q,"extra":1}}}`, owner.UniverseID, owner.EnvironmentID), "target.owner.extra")
	get("an unknown top-level member", fmt.Sprintf(`{"target":{"owner":%s},"extra":true}`, ownerJSON), "extra")
	get("a null targetId", fmt.Sprintf(`{"target":{"owner":%s,"targetId":null}}`, ownerJSON), "target.targetId")
	get("an environmentId outside the id grammar", fmt.Sprintf(`{"target":{"owner":{"universeId":%q,"environmentId":"-not an id-"}}}`, owner.UniverseID), "target.owner.environmentId")
	get("no target", `{}`, "target")

	tmpl := r.template(ctx)
	create := func(what, policy string, fields ...string) {
		creates++
		params := fmt.Sprintf(`{"owner":%s,"templateId":%q,"idle":%s}`, ownerJSON, tmpl.id, policy)
		f := r.rt(ctx, c, what, controller.MethodTargetCreate, json.RawMessage(params))
		r.wantInvalidParams(f, "target/create with "+what, fields...)
	}
	create("idle.pauseAfterMs 2^53", `{"pauseAfterMs":9007199254740992}`, "idle.pauseAfterMs")
	create("idle.pauseAfterMs 2^64", `{"pauseAfterMs":18446744073709551616}`, "idle.pauseAfterMs")
	create("an idle policy that sets no threshold", `{}`, "idle")
	create("a zero idle threshold", `{"pauseAfterMs":0}`, "idle.pauseAfterMs")
	create("decreasing idle thresholds", `{"pauseAfterMs":600000,"stopAfterMs":60000}`, "idle.stopAfterMs", "idle.pauseAfterMs")
	create("a null idle policy", `null`, "idle")

	f := r.rt(ctx, c, "target/get after the refused creates", controller.MethodTargetGet, getParams(controller.TargetRef{Owner: owner}))
	r.wantError(f, jsonrpc.KindNotFound, "target/get after the refused creates (a refused create creates nothing)")
	r.notef("%d malformed target/get and %d malformed target/create params refused as invalidParams naming the member", gets, creates)
}

// checkTemplateList: the templates decode strictly, each with an id and a name.
func checkTemplateList(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	f := r.rt(ctx, c, "template/list", controller.MethodTemplateList, controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID})
	if f.rpcErr != nil {
		r.fatalf("template/list: %s", describeErr(f.rpcErr))
	}
	var list controller.TemplateListResult
	if err := wire.Decode(f.result, &list); err != nil {
		r.fatalf("the template/list result does not decode strictly: %v (result: %s)", err, clip(string(f.result), 300))
	}
	seen := map[string]bool{}
	var ids []string
	for i, t := range list.Templates {
		if t.TemplateID == "" {
			r.failf("templates[%d] has no templateId", i)
		}
		if t.DisplayName == "" {
			r.failf("templates[%d] (%s) has no displayName", i, t.TemplateID)
		}
		if seen[t.TemplateID] {
			r.failf("templates[%d] repeats the templateId %q", i, t.TemplateID)
		}
		seen[t.TemplateID] = true
		id := t.TemplateID
		if t.Deprecated {
			id += " (deprecated)"
		}
		ids = append(ids, id)
	}
	f = r.rt(ctx, c, "template/list without universeId", controller.MethodTemplateList, json.RawMessage(`{}`))
	r.wantInvalidParams(f, "template/list without universeId", "universeId")
	if len(ids) == 0 {
		r.notef("template/list offers universe %s no template", r.s.cfg.UniverseID)
		return
	}
	r.notef("template/list offers %s", strings.Join(ids, ", "))
}

// checkCreateIdempotency: one target per owner however often and however
// concurrently it is created.
func checkCreateIdempotency(ctx context.Context, r *checkRun) {
	tmpl := r.template(ctx)
	c, _ := r.mustOpen(ctx)
	defer c.close()
	owner := r.owner("create")
	params := controller.CreateParams{Owner: owner, TemplateID: tmpl.id, DisplayName: "Lightspeed conformance",
		Idle: &idlepolicy.Policy{PauseAfterMs: u64(600_000), CloseAfterMs: u64(86_400_000)}}

	first := r.mustTarget(ctx, c, "the first target/create", controller.MethodTargetCreate, params, owner)
	if first.Phase != controller.PhaseProvisioning && first.Phase != controller.PhaseActive {
		r.failf("the first target/create answered phase %s, want provisioning (or active)", first.Phase)
	}
	targetID := first.TargetID
	same := func(what string, obs controller.Observation) {
		switch {
		case obs.TargetID == "":
		case targetID == "":
			targetID = obs.TargetID
		case obs.TargetID != targetID:
			r.failf("%s answered target id %q, but an earlier answer for the same owner was %q", what, obs.TargetID, targetID)
		}
	}
	creates := 2
	same("the second target/create", r.mustTarget(ctx, c, "the second target/create", controller.MethodTargetCreate, params, owner))

	const concurrent = 8
	batch := make([]any, concurrent)
	for i := range batch {
		batch[i] = params
	}
	creates += concurrent
	frames, err := c.pipeline(ctx, controller.MethodTargetCreate, batch)
	if err != nil {
		r.fatalf("%d pipelined target/create: %v", concurrent, err)
	}
	for i, f := range frames {
		what := fmt.Sprintf("pipelined target/create %d of %d", i+1, concurrent)
		if f.rpcErr != nil {
			r.failf("%s: %s", what, describeErr(f.rpcErr))
			continue
		}
		var res controller.TargetResult
		if err := wire.Decode(f.result, &res); err != nil {
			r.failf("%s: the result does not decode strictly: %v", what, err)
			continue
		}
		if res.Target.Owner != owner {
			r.failf("%s: the observation names another owner", what)
		}
		same(what, res.Target)
	}

	stranger := r.owner("create-unknown-template")
	f := r.rt(ctx, c, "target/create with an unknown template", controller.MethodTargetCreate,
		controller.CreateParams{Owner: stranger, TemplateID: "lsconf-no-such-template-" + r.s.runID})
	r.wantError(f, jsonrpc.KindNotFound, "target/create with an unknown template")
	f = r.rt(ctx, c, "target/get after the refused create", controller.MethodTargetGet, getParams(controller.TargetRef{Owner: stranger}))
	r.wantError(f, jsonrpc.KindNotFound, "target/get for the owner whose create named an unknown template")

	if tmpl.deprecated != "" {
		fresh := r.owner("create-deprecated")
		what := fmt.Sprintf("target/create from the deprecated template %q for an owner with nothing", tmpl.deprecated)
		f := r.rt(ctx, c, what, controller.MethodTargetCreate, controller.CreateParams{Owner: fresh, TemplateID: tmpl.deprecated})
		if e := r.errorAnswer(f, jsonrpc.KindFailedPrecondition, what); e != nil && e.Reason != "templateDeprecated" {
			r.failf("%s: failedPrecondition with reason %q, want templateDeprecated", what, e.Reason)
		}
		f = r.rt(ctx, c, "target/get after the refused create", controller.MethodTargetGet, getParams(controller.TargetRef{Owner: fresh}))
		r.wantError(f, jsonrpc.KindNotFound, "target/get for the owner whose create named a deprecated template")
	}

	active := r.waitActive(ctx, c, controller.TargetRef{Owner: owner}, targetID)
	same("target/get", active)
	creates++
	same("target/create after the target became active", r.mustTarget(ctx, c, "target/create after the target became active", controller.MethodTargetCreate, params, owner))
	if tmpl.deprecated != "" {
		// The owner already holds a target: its observation is the answer,
		// with no creation policy applied (deprecation included).
		again := params
		again.TemplateID = tmpl.deprecated
		creates++
		f := r.rt(ctx, c, "target/create naming a deprecated template for an owner that holds a target", controller.MethodTargetCreate, again)
		if f.rpcErr != nil {
			r.failf("target/create for an owner that already holds a target, naming the deprecated template %q: %s (the existing target's observation is the answer; no creation policy applies)", tmpl.deprecated, describeErr(f.rpcErr))
		} else {
			var res controller.TargetResult
			if err := wire.Decode(f.result, &res); err != nil {
				r.failf("target/create naming a deprecated template: the result does not decode strictly: %v", err)
			} else {
				same("target/create naming a deprecated template", res.Target)
			}
		}
	}
	r.notef("target %s: first answer %s, the same target for %d creates (%d of them pipelined), then active/%s", targetID, first.Phase, creates, concurrent, active.Power)
}

func u64(v uint64) *uint64 { return &v }

// checkPureGet: target/get never creates, and by owner and by id agree.
func checkPureGet(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	empty := r.owner("get-empty")
	for i := 1; i <= 2; i++ {
		what := fmt.Sprintf("target/get %d of an owner with nothing", i)
		f := r.rt(ctx, c, what, controller.MethodTargetGet, getParams(controller.TargetRef{Owner: empty}))
		r.wantError(f, jsonrpc.KindNotFound, what)
	}
	what := "target/get of an owner with nothing, naming an unknown target id"
	f := r.rt(ctx, c, what, controller.MethodTargetGet, getParams(controller.TargetRef{Owner: empty, TargetID: "lsconf-none-" + r.s.runID}))
	r.wantError(f, jsonrpc.KindNotFound, what)
	closed := r.mustTarget(ctx, c, "target/close after the gets", controller.MethodTargetClose, getParams(controller.TargetRef{Owner: empty}), empty)
	if closed.Phase != controller.PhaseClosed || closed.TargetID != "" {
		r.failf("target/close of an owner that was only ever read answered %s with target id %q: a target/get created something", closed.Phase, closed.TargetID)
	}

	owner, active := r.createActive(ctx, c, "get")
	ref := controller.TargetRef{Owner: owner}
	byOwner := r.mustTarget(ctx, c, "target/get by owner", controller.MethodTargetGet, getParams(ref), owner)
	ref.TargetID = active.TargetID
	byID := r.mustTarget(ctx, c, "target/get by target id", controller.MethodTargetGet, getParams(ref), owner)
	if a, b := summary(byOwner), summary(byID); a != b {
		r.failf("target/get by owner observed %s, by target id %s", a, b)
	}
	r.notef("notFound twice without creating; target %s observed alike by owner and by id", active.TargetID)
}

// summary is what two observations of one unchanged target agree on.
func summary(o controller.Observation) string {
	s := fmt.Sprintf("id %q phase %s power %q", o.TargetID, o.Phase, o.Power)
	if o.Ingress != nil {
		s += " ingress " + o.Ingress.Endpoint
	}
	return s
}

// checkOwnerFencing: another owner's target id reaches nothing.
func checkOwnerFencing(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	owner, active := r.createActive(ctx, c, "fence")
	id := active.TargetID
	stranger := r.owner("fence-stranger")
	cousin := r.adopt(controller.Owner{UniverseID: "lsconf-other-" + r.s.runID, EnvironmentID: owner.EnvironmentID})
	cases := []struct {
		what   string
		method string
		owner  controller.Owner
	}{
		{"target/get by another owner naming this target's id", controller.MethodTargetGet, stranger},
		{"target/close by another owner naming this target's id", controller.MethodTargetClose, stranger},
		{"target/get by the same environment id in another universe", controller.MethodTargetGet, cousin},
		{"target/close by the same environment id in another universe", controller.MethodTargetClose, cousin},
	}
	for _, tc := range cases {
		f := r.rt(ctx, c, tc.what, tc.method, getParams(controller.TargetRef{Owner: tc.owner, TargetID: id}))
		if e := r.errorAnswer(f, jsonrpc.KindFailedPrecondition, tc.what); e != nil && e.Reason != "ownerMismatch" {
			r.failf("%s: failedPrecondition with reason %q, want ownerMismatch", tc.what, e.Reason)
		}
	}
	for _, ref := range []controller.TargetRef{{Owner: owner}, {Owner: owner, TargetID: id}} {
		after := r.mustTarget(ctx, c, "target/get by the rightful owner after the refusals", controller.MethodTargetGet, getParams(ref), owner)
		if after.Phase != controller.PhaseActive || after.TargetID != id {
			r.failf("after the refused calls the rightful owner observes %s; want it untouched (%s)", summary(after), summary(active))
		}
	}
	r.notef("target %s refused to %d foreign calls and still active", id, len(cases))
}

// checkCloseByOwner: close by owner, with and without the id, repeated.
func checkCloseByOwner(ctx context.Context, r *checkRun) {
	c, _ := r.mustOpen(ctx)
	defer c.close()
	owner, active := r.createActive(ctx, c, "close")
	id := active.TargetID
	first := r.mustTarget(ctx, c, "target/close by owner", controller.MethodTargetClose, getParams(controller.TargetRef{Owner: owner}), owner)
	if first.Phase != controller.PhaseClosing && first.Phase != controller.PhaseClosed {
		r.failf("target/close by owner answered phase %s, want closing or closed", first.Phase)
	}
	if first.TargetID != "" && first.TargetID != id {
		r.failf("target/close by owner answered target id %q, want %q", first.TargetID, id)
	}
	withID := controller.TargetRef{Owner: owner, TargetID: id}
	if _, err := r.s.closeUntilClosed(ctx, c, withID); err != nil {
		r.fatalf("target/close with the target id until closed: %s", describeErr(err))
	}
	for _, ref := range []controller.TargetRef{withID, {Owner: owner}} {
		what := "target/close repeated by owner"
		if ref.TargetID != "" {
			what = "target/close repeated with the target id"
		}
		again := r.mustTarget(ctx, c, what, controller.MethodTargetClose, getParams(ref), owner)
		if again.Phase != controller.PhaseClosed {
			r.failf("%s answered phase %s, want closed", what, again.Phase)
		}
	}
	for _, ref := range []controller.TargetRef{{Owner: owner}, withID} {
		what := "target/get by owner after the close"
		if ref.TargetID != "" {
			what = "target/get by target id after the close"
		}
		f := r.rt(ctx, c, what, controller.MethodTargetGet, getParams(ref))
		if f.rpcErr != nil {
			r.wantError(f, jsonrpc.KindNotFound, what)
			continue
		}
		var res controller.TargetResult
		if err := wire.Decode(f.result, &res); err != nil {
			r.failf("%s: the result does not decode strictly: %v", what, err)
		} else if res.Target.Phase != controller.PhaseClosed {
			r.failf("%s observed phase %s, want notFound or closed", what, res.Target.Phase)
		}
	}
	never := r.owner("close-never")
	for i := 1; i <= 2; i++ {
		what := fmt.Sprintf("target/close %d of an owner that never had a target", i)
		obs := r.mustTarget(ctx, c, what, controller.MethodTargetClose, getParams(controller.TargetRef{Owner: never}), never)
		if obs.Phase != controller.PhaseClosed || obs.TargetID != "" {
			r.failf("%s answered phase %s with target id %q; want closed without a target id", what, obs.Phase, obs.TargetID)
		}
	}
	r.notef("target %s: first close answered %s, then closed on repetition; an owner with nothing closes at once", id, first.Phase)
}

// checkCapabilityUnavailable: an optional method the controller does not
// advertise answers capabilityUnavailable naming its capability.
func checkCapabilityUnavailable(ctx context.Context, r *checkRun) {
	c, init := r.mustOpen(ctx)
	defer c.close()
	ref := controller.TargetRef{Owner: r.owner("capabilities")}
	optional := []struct {
		method, capability string
		advertised         bool
		params             any
	}{
		{controller.MethodTargetSet, "power", init.Capabilities.Power, controller.SetPowerParams{Target: ref, Power: controller.PowerRunning}},
		{controller.MethodIngressEnsure, "ingress", init.Capabilities.Ingress, getParams(ref)},
		{controller.MethodIngressRemove, "ingress", init.Capabilities.Ingress, getParams(ref)},
	}
	var tested []string
	for _, o := range optional {
		if o.advertised {
			continue
		}
		tested = append(tested, o.method)
		what := o.method + " while " + o.capability + " is not advertised"
		f := r.rt(ctx, c, what, o.method, o.params)
		if e := r.errorAnswer(f, jsonrpc.KindCapabilityUnavailable, what); e != nil && e.Capability != o.capability {
			r.failf("%s: data.capability is %q, want %q", what, e.Capability, o.capability)
		}
	}
	if len(tested) == 0 {
		r.skipf("the controller advertises power and ingress, so no optional method is unavailable")
	}
	r.notef("%s answered capabilityUnavailable", strings.Join(tested, ", "))
}

// checkBoundedCalls reviews every answer the earlier checks waited for,
// one request at a time: none may take more than a few seconds
// (Config.AnswerBound).
// It runs after the checks that create, move and close targets.
func checkBoundedCalls(ctx context.Context, r *checkRun) {
	if _, _, _, n := r.s.slow.snapshot(); n == 0 {
		// Run alone: one answer of its own to review.
		c, _ := r.mustOpen(ctx)
		r.rt(ctx, c, "template/list", controller.MethodTemplateList, controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID})
		c.close()
	}
	took, method, check, n := r.s.slow.snapshot()
	if took > r.s.cfg.AnswerBound {
		r.failf("%s (in check %s) answered after %v; every method answers within a few seconds (this suite allows %v)", method, check, took.Round(time.Millisecond), r.s.cfg.AnswerBound)
		return
	}
	r.notef("the slowest of %d answers took %v (%s, in check %s)", n, took.Round(time.Millisecond), method, check)
}

// checkErrorAnswers provokes one error of every kind a controller can be
// made to answer without a target, then reviews every error answer of the
// run: the code its kind fixes, data.kind, a message of at most 4096 bytes
// and the kind's typed fields.
func checkErrorAnswers(ctx context.Context, r *checkRun) {
	c := r.mustConnect(ctx)
	defer c.close()
	ref := controller.TargetRef{Owner: r.owner("errors")}
	// Each answer's shape is checked as it arrives (see conn.next) and
	// reviewed with all the others below.
	provoke := func(kind jsonrpc.Kind, what string, f *frame) { r.wantError(f, kind, what) }
	raw := func(what, text string) *frame {
		if err := c.sendText(ctx, text); err != nil {
			r.fatalf("%s: %v", what, err)
		}
		f, err := c.next(ctx, what)
		if err != nil {
			r.fatalf("%s: %v", what, err)
		}
		return f
	}
	provoke(jsonrpc.KindNotInitialized, "template/list before initialize",
		r.rt(ctx, c, "template/list before initialize", controller.MethodTemplateList, controller.TemplateListParams{UniverseID: r.s.cfg.UniverseID}))
	provoke(jsonrpc.KindVersionMismatch, "initialize with protocolVersion 99",
		r.rt(ctx, c, "initialize with protocolVersion 99", controller.MethodInitialize, initializeParams(99)))
	provoke(jsonrpc.KindInvalidParams, "initialize without protocolVersion",
		r.rt(ctx, c, "initialize without protocolVersion", controller.MethodInitialize, map[string]any{"clientInfo": clientInfo}))
	var init controller.InitializeResult
	if err := c.call(ctx, controller.MethodInitialize, initializeParams(controller.ProtocolVersion), &init); err != nil {
		r.fatalf("initialize: %s", describeErr(err))
	}
	provoke(jsonrpc.KindParseError, "a frame that is not JSON", raw("a frame that is not JSON", "this is not JSON"))
	provoke(jsonrpc.KindInvalidRequest, "an empty batch", raw("an empty batch", "[]"))
	provoke(jsonrpc.KindMethodNotFound, "an unknown method",
		r.rt(ctx, c, "an unknown method", "target/conformanceUnknown", map[string]any{}))
	provoke(jsonrpc.KindInvalidParams, "target/get without target",
		r.rt(ctx, c, "target/get without target", controller.MethodTargetGet, map[string]any{}))
	provoke(jsonrpc.KindNotFound, "target/get of an owner with nothing",
		r.rt(ctx, c, "target/get of an owner with nothing", controller.MethodTargetGet, getParams(ref)))
	if !init.Capabilities.Power {
		provoke(jsonrpc.KindCapabilityUnavailable, "target/setPower without the power capability",
			r.rt(ctx, c, "target/setPower without the power capability", controller.MethodTargetSet, controller.SetPowerParams{Target: ref, Power: controller.PowerStopped}))
	}
	seen, problems := r.s.errs.snapshot()
	for _, p := range problems {
		r.failf("%s", p)
	}
	r.notef("%d error answers received in this run, each with its kind's code, data.kind, a bounded message and its typed fields", seen)
}
