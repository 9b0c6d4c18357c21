package wire_test

import (
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

func TestCheckGrammarBoundaries(t *testing.T) {
	type grammarCase struct {
		grammar string
		value   string
		ok      bool
	}
	var cases []grammarCase
	add := func(grammar string, ok bool, values ...string) {
		for _, v := range values {
			cases = append(cases, grammarCase{grammar, v, ok})
		}
	}
	// Lightspeed ids: ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$.
	add(wire.GrammarLightspeedID, true, "a", "Z", "0", "env_1", "u1.x:y-z_", "a"+strings.Repeat("_", 127), strings.Repeat("9", 128))
	add(wire.GrammarLightspeedID, false, "", "a"+strings.Repeat("b", 128), "_a", "-a", ".a", ":a", "a b", "a/b", "a\n", "\na", "é", "a\x00", "a+b")
	// Opaque provider ids: 1 to 255 bytes, no control characters.
	add(wire.GrammarOpaque, true, "x", strings.Repeat("x", 255), "ls-3f2a", "with space", "é", "ümlaut/..:", strings.Repeat("é", 127)+"x")
	add(wire.GrammarOpaque, false, "", strings.Repeat("x", 256), strings.Repeat("é", 128), "a\nb", "a\tb", "a\rb", "\x00", "a\x1f", "a\x7f", "a\u0085", "a\u009f", "\xff\xfe")
	// Build facts: 1 to 256 bytes, no control characters.
	add(wire.GrammarInfo, true, "n", strings.Repeat("n", 256), "0.5.0", "x86_64-unknown-linux-gnu")
	add(wire.GrammarInfo, false, "", strings.Repeat("n", 257), "v\n1", "v\t1", "\x1b[31m")
	// Text: 1 to 1024 bytes, no control characters other than line feed and tab.
	add(wire.GrammarText, true, "t", strings.Repeat("t", 1024), "line\nline", "col\tcol", "\n", "\t", "¡olé!", strings.Repeat("\n", 1024))
	add(wire.GrammarText, false, "", strings.Repeat("t", 1025), "a\r\nb", "a\x00", "a\x0b", "a\x0c", "a\x7f", "a\u0080", "bad \xc3")
	// URLs: at most 2048 bytes (and not empty), no control characters.
	long := "https://example.com/" + strings.Repeat("p", 2048-len("https://example.com/"))
	add(wire.GrammarURL, true, "https://acorn.env.example.com", "http://h:8080/p?q=1", long)
	add(wire.GrammarURL, false, "", long+"p", "https://x/\n", "https://x/\t", "ftp://x/", "/relative/path", "example.com", "https://", "javascript:alert(1)", "HTTPS//x")
	// Enumerations.
	add("enum=running|paused", true, "running", "paused")
	add("enum=running|paused", false, "", "Running", "run", "running|paused", "paused ", "stopped")
	add("enum=only", true, "only")
	add("enum=only", false, "", "Only")

	for _, tc := range cases {
		problem := wire.CheckGrammar(tc.grammar, tc.value)
		if (problem == "") != tc.ok {
			t.Errorf("CheckGrammar(%q, %q) = %q, want ok=%v", tc.grammar, clipForLog(tc.value), problem, tc.ok)
		}
		if !tc.ok && !strings.HasPrefix(problem, "must") {
			t.Errorf("CheckGrammar(%q, %q) = %q, want a sentence ending that starts with \"must\"", tc.grammar, clipForLog(tc.value), problem)
		}
	}
	if problem := wire.CheckGrammar("bogus", "x"); !strings.Contains(problem, "unknown grammar") {
		t.Errorf("unknown grammar: %q", problem)
	}
}

func TestCheckGrammarQuotesShortly(t *testing.T) {
	// A refused value is quoted, but never at length: a 1 MiB id does not make
	// a 1 MiB error message.
	for _, grammar := range []string{wire.GrammarLightspeedID, "enum=a|b"} {
		problem := wire.CheckGrammar(grammar, strings.Repeat("é", 1<<19))
		if problem == "" || len(problem) > 300 {
			t.Errorf("%s: %d-byte problem", grammar, len(problem))
		}
		if !strings.Contains(problem, "…") {
			t.Errorf("%s: %q does not mark the cut", grammar, problem)
		}
	}
	for _, grammar := range []string{wire.GrammarOpaque, wire.GrammarInfo, wire.GrammarText, wire.GrammarURL} {
		if problem := wire.CheckGrammar(grammar, strings.Repeat("x", 1<<20)); problem == "" || len(problem) > 300 {
			t.Errorf("%s: %q", grammar, problem)
		}
	}
}

func clipForLog(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
