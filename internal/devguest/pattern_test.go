package devguest

import (
	"strings"
	"testing"
)

func TestGlobPattern(t *testing.T) {
	type probe struct {
		rel   string
		isDir bool
		want  bool
	}
	for _, tc := range []struct {
		pattern    string
		ignoreCase bool
		probes     []probe
	}{
		// Without "/", the name matches at any depth; "*" stays in one segment.
		{"*.go", false, []probe{{"main.go", false, true}, {"a/b/main.go", false, true}, {"main.go.txt", false, false}, {"a.go/x", false, false}}},
		{"?.txt", false, []probe{{"a.txt", false, true}, {"ab.txt", false, false}, {"d/é.txt", false, true}}},
		// A leading "/" anchors to the root; a "/" inside anchors too.
		{"/build", false, []probe{{"build", true, true}, {"src/build", true, false}}},
		{"src/*.go", false, []probe{{"src/a.go", false, true}, {"src/x/a.go", false, false}, {"lib/src/a.go", false, false}}},
		// "**" as a segment spans segments; elsewhere it is a plain "*".
		{"**/test", false, []probe{{"test", true, true}, {"a/b/test", true, true}, {"a/btest", true, false}}},
		{"a/**/z", false, []probe{{"a/z", false, true}, {"a/b/c/z", false, true}, {"b/a/z", false, false}}},
		{"docs/**", false, []probe{{"docs/a", false, true}, {"docs/a/b.md", false, true}, {"docs", true, false}}},
		{"a**b", false, []probe{{"axxb", false, true}, {"a/x/b", false, false}}},
		// Classes, negated classes, ranges, escapes and alternations.
		{"[abc].md", false, []probe{{"a.md", false, true}, {"d.md", false, false}}},
		{"[!abc].md", false, []probe{{"a.md", false, false}, {"d.md", false, true}}},
		{"file[0-9]", false, []probe{{"file7", false, true}, {"filex", false, false}}},
		{"[]x]", false, []probe{{"]", false, true}, {"x", false, true}, {"y", false, false}}},
		{`\*.txt`, false, []probe{{"*.txt", false, true}, {"a.txt", false, false}}},
		{"*.{go,rs}", false, []probe{{"a.go", false, true}, {"b.rs", false, true}, {"c.py", false, false}}},
		{"{src,lib/**}/*.c", false, []probe{{"src/a.c", false, true}, {"lib/x/y/a.c", false, true}, {"other/a.c", false, false}}},
		{"a,b", false, []probe{{"a,b", false, true}}},
		{"(x)+.$", false, []probe{{"(x)+.$", false, true}, {"xx.$", false, false}}},
		// A trailing "/" matches directories only.
		{"out/", false, []probe{{"out", true, true}, {"out", false, false}, {"a/out", true, true}}},
		// ignoreCase folds case.
		{"*.MD", true, []probe{{"readme.md", false, true}}},
		{"*.MD", false, []probe{{"readme.md", false, false}}},
	} {
		g, err := compileGlob(tc.pattern, tc.ignoreCase)
		if err != nil {
			t.Errorf("compileGlob(%q): %v", tc.pattern, err)
			continue
		}
		for _, p := range tc.probes {
			name := p.rel[strings.LastIndexByte(p.rel, '/')+1:]
			if got := g.matches(p.rel, name, p.isDir); got != p.want {
				t.Errorf("%q matches %q (dir %v) = %v, want %v", tc.pattern, p.rel, p.isDir, got, p.want)
			}
		}
	}

	for _, bad := range []string{"", "/", "[abc", "a{b", "a}b", `a\`, "[a/b]", strings.Repeat("a", MaxPatternBytes+1)} {
		if _, err := compileGlob(bad, false); err == nil {
			t.Errorf("compileGlob(%q) compiled", bad)
		}
	}
}

func TestIgnoreRules(t *testing.T) {
	rules := func(dir string, lines ...string) *ignoreRules {
		rs := &ignoreRules{dir: dir}
		for _, l := range lines {
			if g := ignoreLine(l); g != nil {
				rs.rules = append(rs.rules, g)
			}
		}
		return rs
	}
	stack := []*ignoreRules{
		rules("", "# a comment", "", "*.log", "!keep.log", "/tmp/", "build/  ", `\#hash`),
		rules("sub", "*.txt", "!*.log"),
	}
	for _, tc := range []struct {
		rel   string
		isDir bool
		want  bool
	}{
		{"a.log", false, true},
		{"keep.log", false, false},
		{"tmp", true, true},
		{"tmp", false, false},
		{"x/tmp", true, false},
		{"x/build", true, true},
		{"#hash", false, true},
		{"sub/a.txt", false, true},
		{"sub/deep/a.txt", false, true},
		{"sub/a.log", false, false}, // the deeper file re-includes it
		{"a.txt", false, false},
	} {
		name := tc.rel[strings.LastIndexByte(tc.rel, '/')+1:]
		if got := ignored(stack, tc.rel, name, tc.isDir); got != tc.want {
			t.Errorf("ignored(%q, dir %v) = %v, want %v", tc.rel, tc.isDir, got, tc.want)
		}
	}
}
