package wire

import (
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"unicode/utf8"
)

// Grammars a `wire:"…"` tag can name. Each one is a rule of the protocol's
// "Encoding conventions".
const (
	// GrammarLightspeedID is the general grammar of Lightspeed-assigned ids
	// (universe and environment ids): ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$.
	GrammarLightspeedID = "lsid"
	// GrammarOpaque is a provider-assigned id (targetId, templateId): 1 to
	// 255 bytes without control characters.
	GrammarOpaque = "opaque"
	// GrammarInfo is a build fact (clientInfo/serverInfo members): 1 to 256
	// bytes without control characters.
	GrammarInfo = "info"
	// GrammarText is descriptive text: 1 to 1024 bytes, no control characters
	// other than line feed and tab.
	GrammarText = "text"
	// GrammarURL is an absolute http or https URL of at most 2048 bytes
	// (such as a realized ingress endpoint).
	GrammarURL = "url"
)

var lightspeedID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$`)

// CheckGrammar returns "" when s satisfies the named grammar, otherwise the
// problem as the end of a sentence ("must be …").
func CheckGrammar(grammar, s string) string {
	if values, ok := strings.CutPrefix(grammar, "enum="); ok {
		for _, v := range strings.Split(values, "|") {
			if s == v {
				return ""
			}
		}
		return fmt.Sprintf("must be one of %s, not %q", strings.ReplaceAll(values, "|", ", "), clip(s))
	}
	switch grammar {
	case GrammarLightspeedID:
		if !lightspeedID.MatchString(s) {
			return fmt.Sprintf("must match ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$, not %q", clip(s))
		}
	case GrammarOpaque:
		return bounded(s, 255, false)
	case GrammarInfo:
		return bounded(s, 256, false)
	case GrammarText:
		return bounded(s, 1024, true)
	case GrammarURL:
		if s == "" || len(s) > 2048 {
			return "must be a URL of 1 to 2048 bytes"
		}
		if u, err := url.Parse(s); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return "must be an absolute http or https URL"
		}
		return bounded(s, 2048, false)
	default:
		return "has an unknown grammar " + grammar + " (a defect in this build)"
	}
	return ""
}

func bounded(s string, maxBytes int, allowLineBreaks bool) string {
	if s == "" || len(s) > maxBytes {
		return fmt.Sprintf("must be 1 to %d bytes long, not %d", maxBytes, len(s))
	}
	if !utf8.ValidString(s) {
		return "must be valid UTF-8"
	}
	for _, r := range s {
		if allowLineBreaks && (r == '\n' || r == '\t') {
			continue
		}
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return "must not contain control characters"
		}
	}
	return ""
}

// clip keeps a refused value short enough to quote in a message.
func clip(s string) string {
	const most = 64
	if len(s) <= most {
		return s
	}
	cut := most
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
