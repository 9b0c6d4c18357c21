package devguest

import (
	"bufio"
	"errors"
	"io"
	"os"
	"path"
	"regexp"
	"strings"
	"syscall"
)

// MaxPatternBytes bounds one include or exclude pattern and fs/searchText's
// regular expression.
const MaxPatternBytes = 4096

// globPattern is one compiled pattern of the walk grammar: gitignore-style
// globs over TreePaths relative to a walk's root (or, for an ignore file,
// to the directory holding it).
type globPattern struct {
	re       *regexp.Regexp
	anchored bool // matched against the whole relative path, not the name
	dirOnly  bool // a trailing "/": matches directories only
	negate   bool // a leading "!" (ignore files only): re-includes
}

// matches says whether the pattern selects the entry at rel (a relative
// path with "/" separators) whose last segment is name.
func (g *globPattern) matches(rel, name string, isDir bool) bool {
	if g.dirOnly && !isDir {
		return false
	}
	if g.anchored {
		return g.re.MatchString(rel)
	}
	return g.re.MatchString(name)
}

// compileGlob compiles one pattern. "*" and "?" match within a segment,
// "**" as a whole segment spans any number of segments (elsewhere it is a
// plain "*"), "[...]" is a character class ("[!...]" or "[^...]" negates it;
// it never matches "/"), "{a,b}" is an alternation whose branches are
// patterns themselves, and "\" takes the next character literally. A
// pattern without "/" (apart from a trailing one) matches the name at any
// depth; a leading "/", or a "/" inside, anchors it to the root. A trailing
// "/" restricts it to directories.
func compileGlob(pattern string, ignoreCase bool) (*globPattern, error) {
	if pattern == "" {
		return nil, errors.New("is empty")
	}
	if len(pattern) > MaxPatternBytes {
		return nil, errors.New("is longer than 4096 bytes")
	}
	g := &globPattern{}
	p := pattern
	if strings.HasSuffix(p, "/") && !strings.HasSuffix(p, `\/`) {
		g.dirOnly = true
		p = strings.TrimSuffix(p, "/")
	}
	if strings.HasPrefix(p, "/") {
		g.anchored = true
		p = p[1:]
	} else {
		g.anchored = strings.Contains(p, "/")
	}
	if p == "" {
		return nil, errors.New("names no entry (it is only slashes)")
	}
	body, err := globRegexp(p)
	if err != nil {
		return nil, err
	}
	prefix := "^(?:"
	if ignoreCase {
		prefix = "(?i)" + prefix
	}
	re, err := regexp.Compile(prefix + body + ")$")
	if err != nil {
		return nil, errors.New("does not compile: " + err.Error())
	}
	g.re = re
	return g, nil
}

// globRegexp translates a glob (without its anchoring and directory marks)
// into the body of a regular expression.
func globRegexp(p string) (string, error) {
	var b strings.Builder
	braces := 0
	segmentStart := func(i int) bool { return i == 0 || p[i-1] == '/' || (braces > 0 && (p[i-1] == '{' || p[i-1] == ',')) }
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch c {
		case '\\':
			if i+1 == len(p) {
				return "", errors.New("ends with an unfinished escape \\")
			}
			i++
			b.WriteString(regexp.QuoteMeta(p[i : i+1]))
		case '*':
			if i+1 < len(p) && p[i+1] == '*' {
				end := i + 2
				for end < len(p) && p[end] == '*' {
					end++
				}
				whole := segmentStart(i) && (end == len(p) || p[end] == '/' || (braces > 0 && (p[end] == ',' || p[end] == '}')))
				switch {
				case whole && end < len(p) && p[end] == '/':
					// "**/": any number of leading segments, none included.
					b.WriteString(`(?:.*/)?`)
					i = end
				case whole:
					b.WriteString(`.*`)
					i = end - 1
				default:
					b.WriteString(`[^/]*`)
					i = end - 1
				}
				continue
			}
			b.WriteString(`[^/]*`)
		case '?':
			b.WriteString(`[^/]`)
		case '[':
			class, n, err := globClass(p[i:])
			if err != nil {
				return "", err
			}
			b.WriteString(class)
			i += n - 1
		case '{':
			braces++
			b.WriteString(`(?:`)
		case ',':
			if braces > 0 {
				b.WriteString(`|`)
			} else {
				b.WriteString(`,`)
			}
		case '}':
			if braces == 0 {
				return "", errors.New("closes a } that was not opened")
			}
			braces--
			b.WriteString(`)`)
		default:
			b.WriteString(regexp.QuoteMeta(p[i : i+1]))
		}
	}
	if braces > 0 {
		return "", errors.New("leaves a { unclosed")
	}
	return b.String(), nil
}

// globClass translates the character class at the start of p and returns it
// with the number of bytes it spans.
func globClass(p string) (string, int, error) {
	var b strings.Builder
	i := 1
	b.WriteString("[")
	if i < len(p) && (p[i] == '!' || p[i] == '^') {
		b.WriteString("^/")
		i++
	}
	first := true
	for ; i < len(p); i++ {
		c := p[i]
		switch {
		case c == ']' && !first:
			b.WriteString("]")
			return b.String(), i + 1, nil
		case c == '/':
			return "", 0, errors.New("has a / inside a character class")
		case c == '-' && !first && i+1 < len(p) && p[i+1] != ']':
			b.WriteString("-") // a range
		case c == '\\' && i+1 < len(p):
			i++
			b.WriteString(classByte(p[i]))
		default:
			b.WriteString(classByte(c))
		}
		first = false
	}
	return "", 0, errors.New("leaves a [ unclosed")
}

// classByte writes one byte of a class literally: RE2 takes any ASCII
// punctuation after a backslash as itself. Other bytes, including those of a
// multi-byte rune, go through as they are.
func classByte(c byte) string {
	alnum := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
	if c < 0x80 && c > ' ' && !alnum {
		return `\` + string(rune(c))
	}
	return string([]byte{c})
}

// ignoreRules are the patterns of the ignore files of one directory, in
// file order: the last that matches decides.
type ignoreRules struct {
	dir   string // the directory's TreePath ("" for the root)
	rules []*globPattern
}

// maxIgnoreFileBytes bounds how much of one ignore file is read.
const maxIgnoreFileBytes = 1 << 20

// readIgnoreRules reads .gitignore and then .ignore in the directory at abs
// (whose TreePath is rel). Missing or unreadable files, and lines that do
// not compile, add nothing: a walk never fails over an ignore file.
func readIgnoreRules(abs, rel string) *ignoreRules {
	var rules []*globPattern
	for _, name := range []string{".gitignore", ".ignore"} {
		f, err := os.OpenFile(path.Join(abs, name), os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
		if err != nil {
			continue
		}
		if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
			_ = f.Close()
			continue
		}
		sc := bufio.NewScanner(io.LimitReader(f, maxIgnoreFileBytes))
		sc.Buffer(make([]byte, 0, 4096), MaxPatternBytes+2)
		for sc.Scan() {
			if g := ignoreLine(sc.Text()); g != nil {
				rules = append(rules, g)
			}
		}
		// Opened read-only: nothing is lost if its close fails.
		_ = f.Close()
	}
	if len(rules) == 0 {
		return nil
	}
	return &ignoreRules{dir: rel, rules: rules}
}

// ignoreLine compiles one line of an ignore file, or returns nil for a
// blank line, a comment or a line that does not compile.
func ignoreLine(line string) *globPattern {
	line = strings.TrimSuffix(line, "\r")
	// Trailing spaces are dropped unless escaped.
	for strings.HasSuffix(line, " ") && !strings.HasSuffix(line, `\ `) {
		line = line[:len(line)-1]
	}
	if line == "" || line[0] == '#' {
		return nil
	}
	negate := false
	switch {
	case line[0] == '!':
		negate = true
		line = line[1:]
	case strings.HasPrefix(line, `\!`), strings.HasPrefix(line, `\#`):
		line = line[1:]
	}
	g, err := compileGlob(line, false)
	if err != nil {
		return nil
	}
	g.negate = negate
	return g
}

// ignored says whether the deepest ignore rules with an opinion on the
// entry at rel ignore it.
func ignored(stack []*ignoreRules, rel, name string, isDir bool) bool {
	for i := len(stack) - 1; i >= 0; i-- {
		rs := stack[i]
		sub := rel
		if rs.dir != "" {
			var below bool
			if sub, below = strings.CutPrefix(rel, rs.dir+"/"); !below {
				continue // not a directory above the entry
			}
		}
		for j := len(rs.rules) - 1; j >= 0; j-- {
			if g := rs.rules[j]; g.matches(sub, name, isDir) {
				return !g.negate
			}
		}
	}
	return false
}
