package incusfault

import (
	"fmt"
	"net/http"
	"path"
	"strings"
	"time"
)

// Fault is what the proxy does to a request that a Rule matches.
//
// A GET (or HEAD, OPTIONS) without a body whose pooled connection closes
// with no answer is sent again once, on a new connection, by net/http
// itself: a Refuse or DropResponse limited to Times: 1 is then absorbed
// below the incus client, which sees only the replay's answer. A request on
// a fresh connection, and any write, is never replayed.
type Fault int

const (
	// Refuse closes the client's connection as soon as the request is read,
	// without forwarding it: the client sees EOF or a connection reset.
	Refuse Fault = iota + 1

	// BlackHole reads the request and never answers. The connection stays
	// open until the client gives up (its context ends), the proxy closes,
	// or the rule is removed; a request still held when its rule is removed
	// goes on to Incus, as a daemon that was hung and recovers would serve
	// its backlog.
	BlackHole

	// Delay holds the request for Rule.Delay, then forwards it. A client
	// that gives up during the delay is not forwarded.
	Delay

	// Fail answers Rule.Status (default 500) with an Incus-shaped error
	// body carrying Rule.Message, without forwarding.
	Fail

	// DropResponse forwards the request, waits for Incus to answer (so the
	// request has taken effect, or its operation has started), then closes
	// the client's connection without passing the answer on: the client
	// sees a transport error for a call that did happen.
	DropResponse

	// Linger holds the request for Rule.Delay, then forwards it even if
	// its client has hung up meanwhile: a daemon slow to take a request
	// still carries it out after the process that sent it was killed, as
	// Incus under load does with a create still in its handler (no
	// operation listed yet). The answer goes to the client if it is still
	// there.
	Linger
)

func (f Fault) String() string {
	switch f {
	case Refuse:
		return "refuse"
	case BlackHole:
		return "black-hole"
	case Delay:
		return "delay"
	case Fail:
		return "fail"
	case DropResponse:
		return "drop-response"
	case Linger:
		return "linger"
	}
	return fmt.Sprintf("Fault(%d)", int(f))
}

// Rule says which requests get a fault.
type Rule struct {
	// Method is the HTTP method to match; empty matches any.
	Method string

	// Path is a pattern on the request path (see Match); empty matches any.
	Path string

	// Query, when set, must occur as a substring of the raw query string,
	// e.g. "project=lsit-1a2b3c4d" or "recursion=1".
	Query string

	Fault Fault

	// Times limits the fault to the next Times matching requests (those
	// that also pass Probability); 0 means no limit. A spent rule stays
	// until it is removed, so that its Hits can still be read.
	Times int

	// Probability in (0, 1) applies the fault to that share of matching
	// requests, drawn from the proxy's seeded generator (Config.Seed);
	// 0 or 1 means every matching request.
	Probability float64

	// Delay is how long Delay and Linger hold a request.
	Delay time.Duration

	// Status and Message are what Fail answers: Status defaults to 500 and
	// must lie in 400–599; Message defaults to a sentence naming the rule.
	Status  int
	Message string
}

// check reports what is wrong with a rule, or "".
func (r Rule) check() string {
	switch r.Fault {
	case Refuse, BlackHole, DropResponse:
	case Delay, Linger:
		if r.Delay <= 0 {
			return fmt.Sprintf("a %s rule needs a positive Delay", r.Fault)
		}
	case Fail:
		if r.Status != 0 && (r.Status < 400 || r.Status > 599) {
			return fmt.Sprintf("Fail answers an error status (400–599), not %d", r.Status)
		}
	default:
		return fmt.Sprintf("unknown fault %v", r.Fault)
	}
	if r.Times < 0 {
		return fmt.Sprintf("Times must not be negative, not %d", r.Times)
	}
	if r.Probability < 0 || r.Probability > 1 {
		return fmt.Sprintf("Probability must lie in [0, 1], not %v", r.Probability)
	}
	if err := checkPattern(r.Path); err != nil {
		return err.Error()
	}
	return ""
}

func (r Rule) matches(req *http.Request) bool {
	return (r.Method == "" || strings.EqualFold(r.Method, req.Method)) &&
		Match(r.Path, req.URL.Path) &&
		(r.Query == "" || strings.Contains(req.URL.RawQuery, r.Query))
}

func (r Rule) String() string {
	s := r.Fault.String() + " " + r.Method + " " + r.Path
	if r.Query != "" {
		s += "?…" + r.Query + "…"
	}
	return s
}

// Match reports whether an HTTP request path matches pattern. The pattern
// is matched segment by segment ("/"-separated): each segment as by
// path.Match, so "*" stands for exactly one segment
// ("/1.0/instances/*/state"), and a last segment "**" stands for any number
// of further segments, none included ("/1.0/instances/**" matches
// "/1.0/instances" and everything below it). An empty pattern matches any
// path. A malformed pattern matches nothing (Add refuses one).
func Match(pattern, p string) bool {
	if pattern == "" {
		return true
	}
	return matchSegments(strings.Split(pattern, "/"), strings.Split(p, "/"))
}

func matchSegments(pat, segs []string) bool {
	for i, ps := range pat {
		if ps == "**" && i == len(pat)-1 {
			return true
		}
		if i >= len(segs) {
			return false
		}
		if ok, err := path.Match(ps, segs[i]); err != nil || !ok {
			return false
		}
	}
	return len(segs) == len(pat)
}

func checkPattern(pattern string) error {
	segs := strings.Split(pattern, "/")
	for i, s := range segs {
		if strings.Contains(s, "**") && (s != "**" || i != len(segs)-1) {
			return fmt.Errorf("pattern %q: ** stands only as the whole last segment", pattern)
		}
		if _, err := path.Match(s, ""); err != nil {
			return fmt.Errorf("pattern %q: segment %q: %w", pattern, s, err)
		}
	}
	return nil
}
