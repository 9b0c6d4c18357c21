package main

import (
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
)

// refusals collects every refused setting of one start, so that an
// operator fixes them all in one edit rather than one per restart. Each is
// one sentence naming the variable, the value and what is allowed; a
// variable is refused once, by the first check that finds it wrong (a
// value that did not parse is not then refused again as its zero value).
type refusals struct {
	lines []string
	named map[string]bool
}

func (r *refusals) add(name, value, want string) {
	r.addLine(name, fmt.Sprintf("%s=%q is not valid: %s", name, value, want))
}

// addLine records a sentence about name, unless name was refused already.
func (r *refusals) addLine(name, line string) {
	if r.named[name] {
		return
	}
	if r.named == nil {
		r.named = map[string]bool{}
	}
	r.named[name] = true
	r.lines = append(r.lines, line)
}

func (r *refusals) refused(name string) bool { return r.named[name] }

// err is nil when nothing was refused.
func (r *refusals) err() error {
	if len(r.lines) == 0 {
		return nil
	}
	return &configError{lines: slices.Clone(r.lines)}
}

// configError is every refusal of one start, one sentence a line.
type configError struct{ lines []string }

func (e *configError) Error() string { return strings.Join(e.lines, "\n") }

// printRefusals writes each refusal of a configuration on a line of its
// own after prefix, so that one edit fixes them all.
func printRefusals(w io.Writer, prefix string, err error) {
	for line := range strings.SplitSeq(err.Error(), "\n") {
		_, _ = fmt.Fprintln(w, prefix+line)
	}
}

// incusOwnVariables are the variables Incus's own programs read (the
// daemon, the incus client). The provider reads none of them, but an
// operator's shell or an Incus host's environment may well hold them, so
// they are not taken for a mistyped setting of ours. From the Incus
// source's getenv calls (6.x).
var incusOwnVariables = []string{
	"INCUS_AGENT_PATH", "INCUS_ALIASES", "INCUS_CACHE", "INCUS_CLUSTER_UPDATE", "INCUS_CONF",
	"INCUS_DEVMONITOR_DIR", "INCUS_DIR", "INCUS_DOCUMENTATION", "INCUS_EXEC_PATH", "INCUS_GLOBAL_CONF",
	"INCUS_IDMAPPED_MOUNTS_DISABLE", "INCUS_INSECURE_TLS", "INCUS_LXC_HOOK", "INCUS_LXC_TEMPLATE_CONFIG",
	"INCUS_REMOTE", "INCUS_SECURITY_APPARMOR", "INCUS_SECURITY_SELINUX", "INCUS_SKIP_INSTANCE_TYPES",
	"INCUS_UI", "INCUS_USBIDS_PATH",
}

// unknownVariables refuses every PROVIDER_* or INCUS_* variable in environ
// (as os.Environ gives it) that is not a setting: a misspelt one would
// otherwise be ignored, and its default (no credential, say) served in its
// place. Incus's own variables pass.
func unknownVariables(environ []string, r *refusals) {
	var known []string
	for _, s := range settings() {
		known = append(known, s.Name)
	}
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "PROVIDER_") && !strings.HasPrefix(name, "INCUS_") {
			continue
		}
		if slices.Contains(known, name) || slices.Contains(incusOwnVariables, name) {
			continue
		}
		line := name + " is set, and is not a setting of incus-provider"
		if near := nearest(name, known); near != "" {
			line += "; did you mean " + near + "?"
		} else {
			line += "; unset it (incus-provider --help lists every setting)"
		}
		r.addLine(name, line)
	}
}

// nearest is the known name closest to name by edit distance, if it is
// close enough to be a slip of the fingers (at most a third of its length).
func nearest(name string, known []string) string {
	best, bestD := "", len(name)/3+1
	for _, k := range known {
		if d := editDistance(name, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

// editDistance counts the insertions, deletions, substitutions and swaps
// of adjacent letters that turn a into b (optimal string alignment).
func editDistance(a, b string) int {
	prev2 := make([]int, len(b)+1)
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}

// loopbackOnly says a listener setting reaches this host alone: a unix
// socket, or a host that is localhost or a loopback address. An empty
// host, an unspecified address or any other name reaches further.
func loopbackOnly(addr string) bool {
	if strings.HasPrefix(addr, "unix:") {
		return true
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
