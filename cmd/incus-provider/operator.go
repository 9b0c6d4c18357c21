package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// The operator's commands read the Incus the provider uses, with the
// provider's own settings, and decode each instance with the provider's own
// code (targets.Inspect): there is no second source of truth. A close is
// asked of the running provider over its controller plane, as a runtime
// asks it, so that the instance's one owner carries it out.

// operatorBudget bounds a list or a show: every Incus call shares it.
const operatorBudget = 30 * time.Second

// closeWait bounds how long `targets close` follows a close it asked.
const closeWait = 2 * time.Minute

const targetsUsage = `usage: incus-provider targets list [--json]
       incus-provider targets show TARGET_ID|UNIVERSE/ENVIRONMENT [--json]
       incus-provider targets close TARGET_ID|UNIVERSE/ENVIRONMENT
(with the provider's own settings in the environment)`

// runTargets answers `incus-provider targets ...`.
func runTargets(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	fail := func(code int, format string, a ...any) int {
		_, _ = fmt.Fprintf(stderr, "incus-provider: "+format+"\n", a...)
		return code
	}
	if len(args) == 0 {
		return fail(exitBadSetting, "targets needs a command\n%s", targetsUsage)
	}
	cmd, rest := args[0], args[1:]
	asJSON := false
	var operands []string
	for _, a := range rest {
		switch {
		case a == "--json" && cmd != "close":
			asJSON = true
		case strings.HasPrefix(a, "-"):
			return fail(exitBadSetting, "targets %s does not take %q\n%s", cmd, a, targetsUsage)
		default:
			operands = append(operands, a)
		}
	}
	want := map[string]int{"list": 0, "show": 1, "close": 1}
	n, known := want[cmd]
	if !known || len(operands) != n {
		return fail(exitBadSetting, "targets %s: wrong command or operands\n%s", strings.Join(args, " "), targetsUsage)
	}
	cfg, err := loadConfig(environ)
	if err != nil {
		printRefusals(stderr, "incus-provider: ", err)
		return exitBadSetting
	}
	client, err := incus.New(cfg.incusConfig())
	if err != nil {
		return fail(exitBadSetting, "incus client (%s): %v", incusWhere(cfg), err)
	}
	switch cmd {
	case "list":
		return listTargets(ctx, cfg, client, asJSON, stdout, stderr)
	case "show":
		return showTarget(ctx, cfg, client, operands[0], asJSON, stdout, stderr)
	default:
		return closeTarget(ctx, cfg, client, operands[0], stdout, stderr)
	}
}

func listTargets(ctx context.Context, cfg config, client *incus.Client, asJSON bool, stdout, stderr io.Writer) int {
	ctx, cancel := context.WithTimeout(ctx, operatorBudget)
	defer cancel()
	list, err := client.ListInstances(ctx)
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "incus-provider: list the instances of project %s (%s): %v\n", cfg.IncusProject, incusWhere(cfg), err)
		return exitFailed
	}
	views := []targets.View{}
	for i := range list {
		if v, ok := targets.Inspect(&list[i]); ok {
			views = append(views, v)
		}
	}
	sort.Slice(views, func(i, j int) bool { return views[i].CreatedAt.Before(views[j].CreatedAt) })
	if asJSON {
		return writeJSON(stdout, stderr, views)
	}
	now := time.Now()
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "TARGET\tOWNER\tTEMPLATE\tPHASE\tPOWER\tINTENT\tIDLE\tRELAYS\tINGRESS\tAGE\tLOCATION")
	for _, v := range views {
		_, _ = fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", v.TargetID, ownerWord(v.Owner),
			dash(v.Template), v.Observation.Phase, dash(string(v.Observation.Power)), dash(v.Intent), since(v.IdleSince, now),
			len(v.Relays), dash(ingressWord(v)), since(v.CreatedAt, now), dash(v.Location))
	}
	_ = tw.Flush()
	_, _ = fmt.Fprintf(stdout, "%d targets in project %s\n", len(views), cfg.IncusProject)
	return 0
}

func showTarget(ctx context.Context, cfg config, client *incus.Client, which string, asJSON bool, stdout, stderr io.Writer) int {
	ctx, cancel := context.WithTimeout(ctx, operatorBudget)
	defer cancel()
	v, code := findTarget(ctx, cfg, client, which, stderr)
	if code != 0 {
		return code
	}
	if asJSON {
		return writeJSON(stdout, stderr, v)
	}
	now := time.Now()
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	line := func(k, val string) { _, _ = fmt.Fprintf(tw, "%s\t%s\n", k, val) }
	line("target", v.TargetID)
	line("owner", ownerWord(v.Owner))
	line("template", dash(v.Template))
	line("image", dash(v.Image))
	line("display name", dash(v.DisplayName))
	line("phase", string(v.Observation.Phase))
	line("power", dash(string(v.Observation.Power)))
	line("message", dash(v.Observation.Message))
	line("incus status", v.Status)
	line("location", dash(v.Location))
	intent := dash(v.Intent)
	if v.Intent != "" {
		intent += " (asked " + when(v.IntentAt, now) + " by " + dash(v.IntentBy) + ")"
	}
	line("recorded power", intent)
	line("idle since", when(v.IdleSince, now))
	var relays []string
	for _, l := range v.Relays {
		relays = append(relays, l.Replica+" until "+when(l.Until, now))
	}
	line("open relays", dash(strings.Join(relays, ", ")))
	line("ingress", dash(ingressWord(v)))
	line("from a warm pool", map[bool]string{true: "yes", false: "no"}[v.FromPool])
	line("created", when(v.CreatedAt, now))
	line("first booted", when(v.BootedAt, now))
	line("closing since", when(v.ClosingFrom, now))
	_ = tw.Flush()
	return 0
}

// closeTarget asks the running provider to close the target, as a runtime
// would, and follows the close until it is closed or closeWait passes.
func closeTarget(ctx context.Context, cfg config, client *incus.Client, which string, stdout, stderr io.Writer) int {
	readCtx, cancel := context.WithTimeout(ctx, operatorBudget)
	v, code := findTarget(readCtx, cfg, client, which, stderr)
	cancel()
	if code != 0 {
		return code
	}
	if v.Owner == (controller.Owner{}) {
		_, _ = fmt.Fprintf(stderr, "incus-provider: the record of %s, which names its owner, is out of reach (member %s does not answer): close it by UNIVERSE/ENVIRONMENT, or once the member is back\n", v.TargetID, dash(v.Location))
		return exitFailed
	}
	ctx, cancel = context.WithTimeout(ctx, closeWait)
	defer cancel()
	rpc, url, err := dialController(ctx, cfg)
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "incus-provider: the provider at %s does not answer (%v); a close is carried out by the running provider, which owns the target: start it, or run this where PROVIDER_LISTEN reaches it\n", url, err)
		return exitFailed
	}
	defer func() { _ = rpc.Close() }()
	ref := controller.TargetRef{Owner: v.Owner, TargetID: v.TargetID}
	var last controller.Observation
	for {
		var res controller.TargetResult
		err := rpc.Call(ctx, controller.MethodTargetClose, controller.TargetParams{Target: ref}, &res)
		obs := res.Target
		var rpcErr *jsonrpc.Error
		switch {
		case errors.As(err, &rpcErr) && rpcErr.Kind == jsonrpc.KindUnavailable:
			_, _ = fmt.Fprintf(stdout, "unavailable, asking again: %s\n", rpcErr.Message)
		case err != nil:
			_, _ = fmt.Fprintf(stderr, "incus-provider: target/close of %s: %v\n", v.TargetID, err)
			return exitFailed
		default:
			if obs.Phase != last.Phase || obs.Message != last.Message {
				_, _ = fmt.Fprintf(stdout, "%s: %s%s\n", v.TargetID, obs.Phase, map[bool]string{true: " (" + obs.Message + ")", false: ""}[obs.Message != ""])
			}
			last = obs
			if obs.Phase == controller.PhaseClosed {
				return 0
			}
		}
		select {
		case <-ctx.Done():
			_, _ = fmt.Fprintf(stderr, "incus-provider: %s is not closed after %v (last seen %s); the provider goes on closing it\n", v.TargetID, closeWait, last.Phase)
			return exitFailed
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// ownerWord is an owner as the operator names it; "?" where only the
// instance's record, out of reach, could tell it.
func ownerWord(o controller.Owner) string {
	if o == (controller.Owner{}) {
		return "?"
	}
	return o.UniverseID + "/" + o.EnvironmentID
}

// findTarget reads one target by id or by owner (UNIVERSE/ENVIRONMENT).
func findTarget(ctx context.Context, cfg config, client *incus.Client, which string, stderr io.Writer) (targets.View, int) {
	name := which
	var asked controller.Owner
	if u, e, ok := strings.Cut(which, "/"); ok {
		if u == "" || e == "" || strings.Contains(e, "/") {
			_, _ = fmt.Fprintf(stderr, "incus-provider: %q is neither a target id nor UNIVERSE/ENVIRONMENT\n", which)
			return targets.View{}, exitBadSetting
		}
		asked = controller.Owner{UniverseID: u, EnvironmentID: e}
		name = targets.Name(asked)
	}
	// Listed, not fetched: the list still answers, without the record,
	// while the member holding the instance does not.
	inst, err := client.FindInstance(ctx, name)
	switch {
	case err == nil && inst == nil:
		_, _ = fmt.Fprintf(stderr, "incus-provider: project %s holds no target %s\n", cfg.IncusProject, which)
		return targets.View{}, exitFailed
	case err != nil:
		_, _ = fmt.Fprintf(stderr, "incus-provider: read %s (%s): %v\n", name, incusWhere(cfg), err)
		return targets.View{}, exitFailed
	}
	v, ok := targets.Inspect(inst)
	if !ok {
		_, _ = fmt.Fprintf(stderr, "incus-provider: instance %s of project %s is not a target (no owner's record, or a warm spare)\n", name, cfg.IncusProject)
		return targets.View{}, exitFailed
	}
	if v.Owner == (controller.Owner{}) && asked != (controller.Owner{}) {
		// Unreadable, but under the name only this owner's target has.
		v.Owner, v.Observation.Owner = asked, asked
	}
	return v, 0
}

// dialController opens the provider's controller plane with its own
// settings (listener, TLS, credential) and initializes it.
func dialController(ctx context.Context, cfg config) (*jsonrpc.Client, string, error) {
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	url := "ws://" + cfg.Listen + "/control"
	switch {
	case strings.HasPrefix(cfg.Listen, "unix:"):
		path := strings.TrimPrefix(cfg.Listen, "unix:")
		d.NetDialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var nd net.Dialer
			return nd.DialContext(ctx, "unix", path)
		}
		url = "ws://localhost/control"
	case cfg.tlsCert != nil:
		url = "wss://" + cfg.Listen + "/control"
		// The provider's own certificate is trusted beside the system's
		// roots: a self-signed one then verifies, for the names it has.
		roots, err := x509.SystemCertPool()
		if err != nil {
			roots = x509.NewCertPool()
		}
		if leaf, err := x509.ParseCertificate(cfg.tlsCert.Certificate[0]); err == nil {
			roots.AddCert(leaf)
		}
		host, _, _ := net.SplitHostPort(cfg.Listen)
		if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
			host = "localhost"
			url = "wss://" + net.JoinHostPort("127.0.0.1", portOf(cfg.Listen)) + "/control"
		}
		d.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, ServerName: host}
	default:
		if host, port, err := net.SplitHostPort(cfg.Listen); err == nil && (host == "" || net.ParseIP(host).IsUnspecified()) {
			url = "ws://" + net.JoinHostPort("127.0.0.1", port) + "/control"
		}
	}
	h := http.Header{}
	if cfg.credential.Enabled() {
		raw, err := os.ReadFile(cfg.CredentialFile)
		if err != nil {
			return nil, url, fmt.Errorf("read PROVIDER_CREDENTIAL_FILE: %w", err)
		}
		h.Set("Authorization", "Bearer "+strings.TrimSpace(string(raw)))
	}
	ws, resp, err := d.DialContext(ctx, url, h)
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		return nil, url, err
	}
	rpc := jsonrpc.NewClient(ws)
	var init controller.InitializeResult
	err = rpc.Call(ctx, "initialize", controller.InitializeParams{ProtocolVersion: controller.ProtocolVersion,
		ClientInfo: controller.BuildInfo{Name: "incus-provider targets", Version: buildinfo.Read().Version}}, &init)
	if err != nil {
		_ = rpc.Close()
		return nil, url, fmt.Errorf("initialize: %w", err)
	}
	return rpc, url, nil
}

func portOf(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	return port
}

func writeJSON(stdout, stderr io.Writer, v any) int {
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		_, _ = fmt.Fprintf(stderr, "incus-provider: write JSON: %v\n", err)
		return exitFailed
	}
	return 0
}

func ingressWord(v targets.View) string {
	switch {
	case v.IngressLabel == "":
		return ""
	case v.IngressOn:
		return v.IngressLabel + " (routed)"
	default:
		return v.IngressLabel + " (not routed)"
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// since is the time from t to now, to the second; "-" for no instant.
func since(t, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return now.Sub(t).Round(time.Second).String()
}

// when is t in UTC with the time since; "-" for no instant.
func when(t, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339) + " (" + since(t, now) + " ago)"
}
