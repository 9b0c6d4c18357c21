package conformance

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// Config says which controller to check and how.
type Config struct {
	// URL is the controller: ws://host[:port]/path, wss://…, or
	// unix:///absolute/socket/path.
	URL string
	// Credential is the provider's bearer credential; empty when the
	// provider runs without one (the credential check is then skipped).
	Credential string
	// TemplateID is the template targets are created from. Empty picks the
	// first template/list entry that is not deprecated.
	TemplateID string
	// UniverseID is the universe of every owner the suite invents
	// (default "conformance").
	UniverseID string
	// Timeout bounds each dial and each answer (default 30 s).
	Timeout time.Duration
	// AnswerBound is the longest answer the suite takes as the contract's
	// "a few seconds" (default 10 s).
	AnswerBound time.Duration
	// SettleTimeout bounds the wait for a target to become active, and for
	// a close to reach closed (default 60 s).
	SettleTimeout time.Duration
	// PollInterval is the pause between two observations while waiting
	// (default 500 ms).
	PollInterval time.Duration
	// IdleAfter is the threshold of the idle policy the idle-obligations
	// check gives its target (default 2 s).
	IdleAfter time.Duration
	// IdleGrace is how long past that threshold the provider may take to
	// apply it: the idle-obligations check watches windows of IdleAfter
	// plus IdleGrace (default 30 s).
	IdleGrace time.Duration
	// UnixRequestPath is the HTTP request path sent over a unix:// socket,
	// whose URL names only the socket (default "/control").
	UnixRequestPath string
	// RouteBase is the provider's data route base: ws:// or wss://, a
	// host, an optional path not ending in "/". Empty: derived from URL as
	// the runtime derives it (scheme, host and port, then /routes); a
	// unix:// controller has none, and the data route checks skip.
	RouteBase string
	// TLSConfig is used for wss:// (nil: the system's roots).
	TLSConfig *tls.Config
	// Checks, when not empty, names the checks to run (see CheckNames).
	Checks []string
}

// Defaults of the optional Config fields.
const (
	DefaultUniverseID      = "conformance"
	DefaultTimeout         = 30 * time.Second
	DefaultAnswerBound     = 10 * time.Second
	DefaultSettleTimeout   = 60 * time.Second
	DefaultPollInterval    = 500 * time.Millisecond
	DefaultIdleAfter       = 2 * time.Second
	DefaultIdleGrace       = 30 * time.Second
	DefaultUnixRequestPath = "/control"
)

// Validate reports the first problem of the configuration, as a sentence.
func (c Config) Validate() error {
	_, err := c.normalized()
	return err
}

func (c Config) normalized() (Config, error) {
	if c.UniverseID == "" {
		c.UniverseID = DefaultUniverseID
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.AnswerBound <= 0 {
		c.AnswerBound = DefaultAnswerBound
	}
	if c.SettleTimeout <= 0 {
		c.SettleTimeout = DefaultSettleTimeout
	}
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.IdleAfter <= 0 {
		c.IdleAfter = DefaultIdleAfter
	}
	if c.IdleGrace <= 0 {
		c.IdleGrace = DefaultIdleGrace
	}
	if c.UnixRequestPath == "" {
		c.UnixRequestPath = DefaultUnixRequestPath
	}
	if c.URL == "" {
		return c, errors.New("the controller URL is required (ws://…, wss://… or unix:///path)")
	}
	u, err := url.Parse(c.URL)
	if err != nil {
		return c, fmt.Errorf("the controller URL %q does not parse: %w", c.URL, err)
	}
	switch u.Scheme {
	case "ws", "wss":
		if u.Host == "" {
			return c, fmt.Errorf("the controller URL %q names no host", c.URL)
		}
	case "unix":
		if u.Host != "" || !strings.HasPrefix(u.Path, "/") {
			return c, fmt.Errorf("the controller URL %q must be unix:///absolute/path (three slashes)", c.URL)
		}
	default:
		return c, fmt.Errorf("the controller URL %q must start with ws://, wss:// or unix://", c.URL)
	}
	if c.RouteBase == "" && u.Scheme != "unix" {
		c.RouteBase = u.Scheme + "://" + u.Host + "/routes"
	} else if c.RouteBase != "" {
		if problem := routeBaseProblem(c.RouteBase); problem != "" {
			return c, fmt.Errorf("the data route base %q %s", c.RouteBase, problem)
		}
		if u.Scheme == "wss" && strings.HasPrefix(c.RouteBase, "ws://") {
			return c, fmt.Errorf("the data route base %q is ws:// for a wss:// controller: the credential would travel in cleartext", c.RouteBase)
		}
	}
	if !strings.HasPrefix(c.UnixRequestPath, "/") {
		return c, fmt.Errorf("the unix request path %q must start with /", c.UnixRequestPath)
	}
	if problem := wire.CheckGrammar(wire.GrammarLightspeedID, c.UniverseID); problem != "" {
		return c, fmt.Errorf("the universe id %s", problem)
	}
	if c.TemplateID != "" {
		if problem := wire.CheckGrammar(wire.GrammarOpaque, c.TemplateID); problem != "" {
			return c, fmt.Errorf("the template id %s", problem)
		}
	}
	if strings.ContainsAny(c.Credential, "\r\n") {
		return c, errors.New("the credential must be one line")
	}
	names := CheckNames()
	for _, n := range c.Checks {
		if !slices.Contains(names, n) {
			return c, fmt.Errorf("there is no check %q; the checks are %s", n, strings.Join(names, ", "))
		}
	}
	return c, nil
}

// routeBaseProblem says what is wrong with a data route base, as the
// contract defines one; empty when nothing is.
func routeBaseProblem(base string) string {
	u, err := url.Parse(base)
	switch {
	case err != nil:
		return "does not parse: " + err.Error()
	case u.Scheme != "ws" && u.Scheme != "wss" || !strings.HasPrefix(base, u.Scheme+"://"):
		return "must start with ws:// or wss:// (lowercase)"
	case u.Host == "":
		return "names no host"
	case u.User != nil:
		return "carries user information"
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || strings.ContainsAny(base, "?#"):
		return "carries a query or a fragment"
	case strings.HasSuffix(u.Path, "/"):
		return "ends with /"
	}
	return ""
}

// Result is the outcome of one check. A check that neither passed nor was
// skipped failed; Detail says why (or, on a pass, what was seen).
type Result struct {
	Name string
	// Rule is the contract's section and sentence the check enforces.
	Rule    string
	Passed  bool
	Skipped bool
	Detail  string
}

// Failed reports a check that neither passed nor was skipped.
func (r Result) Failed() bool { return !r.Passed && !r.Skipped }

// String is the line a runner prints: PASS, FAIL or SKIP, the name, and
// the detail; a failure names the contract's rule on a second line.
func (r Result) String() string {
	line := r.verdict()
	if r.Failed() && r.Rule != "" {
		line += "\n    contract " + r.Rule
	}
	return line
}

func (r Result) verdict() string {
	verdict := "PASS"
	switch {
	case r.Skipped:
		verdict = "SKIP"
	case !r.Passed:
		verdict = "FAIL"
	}
	if r.Detail == "" {
		return verdict + " " + r.Name
	}
	return verdict + " " + r.Name + ": " + r.Detail
}

// Summary is the closing line: "N passed, N failed" and ", N skipped" when
// any check was skipped.
func Summary(results []Result) string {
	var passed, failed, skipped int
	for _, r := range results {
		switch {
		case r.Skipped:
			skipped++
		case r.Passed:
			passed++
		default:
			failed++
		}
	}
	line := fmt.Sprintf("%d passed, %d failed", passed, failed)
	if skipped > 0 {
		line += fmt.Sprintf(", %d skipped", skipped)
	}
	return line
}
