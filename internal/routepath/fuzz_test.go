package routepath_test

import (
	"errors"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/routepath"
)

// fuzzPrefixes are the data route prefixes FuzzParsePath tries: the default
// (routes.DefaultPrefix), none at all, a deeper one, and one that ends with
// "/" (which a configured base never does, but the parser must still be
// consistent about).
var fuzzPrefixes = []string{"/routes", "", "/a/b", "/routes/"}

var segmentNames = [3]string{"universeId", "environmentId", "targetId"}

// FuzzParsePath checks Parse against the contract ("Data routes"), with an
// oracle of its own for every rule, from two directions:
//
//   - an arbitrary escaped path: it parses exactly when the oracle says it is
//     prefix/{universeId}/{environmentId}/{targetId} with each segment
//     percent-decoding (RFC 3986: "%" and two hex digits is that octet, any
//     other byte itself) to a valid id, and then to the oracle's ids; parsed
//     ids round-trip through Format, and every other encoding of the same ids
//     parses to the same ids; a refusal is an *Error, 404 for the wrong shape
//     and 400 naming the first bad segment otherwise, with a one-sentence
//     message.
//   - arbitrary ids: Format encodes them with nothing but RFC 3986
//     unreserved characters and %XX, and Parse gives back the same ids, or
//     refuses the first segment that is not a valid id.
func FuzzParsePath(f *testing.F) {
	for _, seed := range []struct {
		prefix  uint8
		path    string
		u, e, t string
	}{
		{0, "/routes/u1/env_1/ls-0123456789abcdef0123", "u1", "env_1", "ls-0123456789abcdef0123"},
		{0, "/routes/u%31/e%3A2/a%2Fb", "u:1", "e.2", "a/b"},
		{0, "/routes/U.1/E-2/t%20x", "U", "E", "t x"},
		{0, "/routes/u/e/%C3%A9t%C3%A9", "u", "e", "été"},
		{0, "/routes/u/e/%zz", "_u", "e", "t"},
		{0, "/routes/u/e/%4", "u", "", "t"},
		{0, "/routes/u/e/t%00", "u", "e", "t\x00"},
		{0, "/routes/u/e/%FF", "u", "e", "\xff"},
		{0, "/routes/u/e/t%C2%85", "u", "e", "t\u0085"},
		{0, "/routes/u//t", "u", "e", ""},
		{0, "/routes/u/e/t/x", "u", "e", "t/x"},
		{0, "/routesx/u/e/t", "u/x", "e", "t"},
		{1, "/u/e/t", "u", "e", "t"},
		{2, "/a/b/u/e/t", strings.Repeat("u", 128), "e", strings.Repeat("t", 255)},
		{3, "/routes//u/e/t", strings.Repeat("u", 129), "e", strings.Repeat("t", 256)},
	} {
		f.Add(seed.prefix, seed.path, seed.u, seed.e, seed.t)
	}
	f.Fuzz(func(t *testing.T, which uint8, path, universe, environment, target string) {
		prefix := fuzzPrefixes[int(which)%len(fuzzPrefixes)]
		checkPath(t, prefix, path)

		r := routepath.IDs{UniverseID: universe, EnvironmentID: environment, TargetID: target}
		escaped := routepath.Format(prefix, r)
		if !strings.HasPrefix(escaped, prefix+"/") {
			t.Fatalf("Format(%q, %+v) = %q does not start with the prefix", prefix, r, escaped)
		}
		segs := strings.Split(escaped[len(prefix)+1:], "/")
		if len(segs) != 3 {
			t.Fatalf("Format(%q, %+v) = %q has %d segments", prefix, r, escaped, len(segs))
		}
		for i, want := range []string{universe, environment, target} {
			if !canonical(segs[i]) {
				t.Fatalf("Format(%q, %+v): segment %q is not RFC 3986 unreserved characters and %%XX", prefix, r, segs[i])
			}
			if got, ok := refUnescape(segs[i]); !ok || got != want {
				t.Fatalf("Format(%q, %+v): segment %q decodes to %q, want %q", prefix, r, segs[i], got, want)
			}
		}
		// Format only ever makes the right shape, so a refusal is about the
		// first id that is not valid; an empty one is a missing segment.
		got, err := routepath.Parse(prefix, escaped)
		bad := -1
		for i, id := range []string{universe, environment, target} {
			if !refValidID(i, id) {
				bad = i
				break
			}
		}
		empty := universe == "" || environment == "" || target == ""
		switch {
		case bad < 0:
			if err != nil || got != r {
				t.Fatalf("Format(%q, %+v) = %q parses to %+v, %v", prefix, r, escaped, got, err)
			}
		case empty:
			checkRefusal(t, prefix, escaped, err, routepath.StatusNotFound, "")
		default:
			checkRefusal(t, prefix, escaped, err, routepath.StatusBadRequest, segmentNames[bad])
		}
	})
}

// checkPath parses an arbitrary escaped path and holds the answer to the
// oracle.
func checkPath(t *testing.T, prefix, path string) {
	t.Helper()
	got, err := routepath.Parse(prefix, path)
	rest, shaped := strings.CutPrefix(path, prefix+"/")
	segs := strings.Split(rest, "/")
	if !shaped || len(segs) != 3 || segs[0] == "" || segs[1] == "" || segs[2] == "" {
		checkRefusal(t, prefix, path, err, routepath.StatusNotFound, "")
		return
	}
	var ids [3]string
	for i, s := range segs {
		id, ok := refUnescape(s)
		if !ok || !refValidID(i, id) {
			checkRefusal(t, prefix, path, err, routepath.StatusBadRequest, segmentNames[i])
			return
		}
		ids[i] = id
	}
	want := routepath.IDs{UniverseID: ids[0], EnvironmentID: ids[1], TargetID: ids[2]}
	if err != nil || got != want {
		t.Fatalf("Parse(%q, %q) = %+v, %v; want %+v", prefix, path, got, err, want)
	}
	// The canonical encoding and an encoding of every byte (in lower-case
	// hex) name the same route.
	for _, again := range []string{
		routepath.Format(prefix, got),
		prefix + "/" + encodeAll(ids[0]) + "/" + encodeAll(ids[1]) + "/" + encodeAll(ids[2]),
	} {
		if r, err := routepath.Parse(prefix, again); err != nil || r != got {
			t.Fatalf("Parse(%q, %q) = %+v; %q, the same route encoded otherwise, parses to %+v, %v", prefix, path, got, again, r, err)
		}
	}
}

// checkRefusal holds a refusal to the contract: an *Error with the
// status, whose message is one sentence naming the segment at fault (or,
// for a 404, the data route shape under prefix).
func checkRefusal(t *testing.T, prefix, path string, err error, status int, segment string) {
	t.Helper()
	var pe *routepath.Error
	if !errors.As(err, &pe) {
		t.Fatalf("Parse(%q, %q): got %T %v, want an *Error %d", prefix, path, err, err, status)
	}
	if pe.Status != status {
		t.Fatalf("Parse(%q, %q): status %d (%s), want %d", prefix, path, pe.Status, pe.Message, status)
	}
	if pe.Error() != pe.Message {
		t.Fatalf("Parse(%q, %q): Error() %q is not the message %q", prefix, path, pe.Error(), pe.Message)
	}
	if !oneSentence(pe.Message) {
		t.Fatalf("Parse(%q, %q): message %q is not one sentence", prefix, path, pe.Message)
	}
	if segment != "" && !strings.Contains(pe.Message, "The "+segment+" segment") {
		t.Fatalf("Parse(%q, %q): message %q does not name the %s segment", prefix, path, pe.Message, segment)
	}
	if segment == "" && !strings.Contains(pe.Message, prefix+"/{universeId}/{environmentId}/{targetId}") {
		t.Fatalf("Parse(%q, %q): message %q does not show the shape of a data route", prefix, path, pe.Message)
	}
}

// oneSentence: valid UTF-8 without control characters, a capital first, a
// full stop last, and short enough that no refused input is echoed whole
// (a quoted id is clipped to 64 bytes, which %q may quadruple).
func oneSentence(s string) bool {
	if s == "" || len(s) > 512 || !utf8.ValidString(s) || !strings.HasSuffix(s, ".") {
		return false
	}
	first, _ := utf8.DecodeRuneInString(s)
	if !unicode.IsUpper(first) {
		return false
	}
	return !strings.ContainsFunc(s, unicode.IsControl)
}

// refUnescape is RFC 3986 percent-decoding: "%" and two hex digits is the
// octet they spell, any other byte stands for itself.
func refUnescape(s string) (string, bool) {
	var b []byte
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b = append(b, s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", false
		}
		hi, ok1 := hexValue(s[i+1])
		lo, ok2 := hexValue(s[i+2])
		if !ok1 || !ok2 {
			return "", false
		}
		b = append(b, hi<<4|lo)
		i += 2
	}
	return string(b), true
}

func hexValue(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// unreserved is RFC 3986's unreserved set: ALPHA / DIGIT / "-" / "." / "_" / "~".
func unreserved(c byte) bool {
	return strings.IndexByte("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~", c) >= 0
}

// canonical: only unreserved characters and %XX with upper-case hex, and no
// unreserved character percent-encoded.
func canonical(seg string) bool {
	for i := 0; i < len(seg); i++ {
		c := seg[i]
		if unreserved(c) {
			continue
		}
		if c != '%' || i+2 >= len(seg) {
			return false
		}
		hi, lo := seg[i+1], seg[i+2]
		if !strings.ContainsRune("0123456789ABCDEF", rune(hi)) || !strings.ContainsRune("0123456789ABCDEF", rune(lo)) {
			return false
		}
		if v, _ := refUnescape(seg[i : i+3]); unreserved(v[0]) {
			return false
		}
		i += 2
	}
	return true
}

// encodeAll percent-encodes every byte, in lower-case hex.
func encodeAll(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		b.WriteString("%" + string("0123456789abcdef"[s[i]>>4]) + string("0123456789abcdef"[s[i]&15]))
	}
	return b.String()
}

// refValidID: the universe and environment ids (segments 0 and 1) are
// Lightspeed ids, ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$; the target id is
// opaque, 1 to 255 bytes of UTF-8 without control characters (C0, DEL, C1).
func refValidID(segment int, id string) bool {
	if segment < 2 {
		if id == "" || len(id) > 128 {
			return false
		}
		for i := 0; i < len(id); i++ {
			c := id[i]
			alnum := 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9'
			if !alnum && (i == 0 || strings.IndexByte("_.:-", c) < 0) {
				return false
			}
		}
		return true
	}
	if id == "" || len(id) > 255 || !utf8.ValidString(id) {
		return false
	}
	for _, r := range id {
		if r < 0x20 || r == 0x7f || 0x80 <= r && r < 0xa0 {
			return false
		}
	}
	return true
}
