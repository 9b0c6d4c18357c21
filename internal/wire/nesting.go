package wire

import (
	"encoding/json"
	"fmt"
	"unicode/utf8"
)

// MaxDepth is how deeply a value that Decode accepts may nest arrays and
// objects: 1 for {"a":1}, 2 for {"a":[1]}. No message of the protocol comes
// near it (the fixtures' deepest params or result nest four levels), so a
// deeper value is a defect or an attack, and refusing it by name keeps it
// from costing the decoder's recursion. A message that carries such a value one level down
// (a JSON-RPC envelope around its params or result) gets one level more:
// see DecodeEnvelope.
const MaxDepth = 64

// Member is one member of a JSON object, as Split found it.
type Member struct {
	Name  string
	Value json.RawMessage // as sent, without the white space around it
	Depth int             // how deeply Value nests arrays and objects (0: a scalar)
	// Repeated says that SplitNamed saw this name more than once; Value is
	// the last. Split returns every occurrence and leaves it false.
	Repeated bool
}

// Nesting checks that data is exactly one JSON value (white space around it
// allowed) and reports how deeply it nests arrays and objects. It has no
// depth limit of its own: encoding/json refuses more than 10,000 levels as
// if the text were not JSON at all, and a caller that wants to tell "too
// deep" from "not JSON" must not lean on it.
func Nesting(data []byte) (int, error) {
	s := scanner{data: data}
	if err := s.run(); err != nil {
		return 0, err
	}
	return s.deepest, nil
}

// Split is Nesting that also returns, when data is an object, its members
// in the order sent (a repeated name as often as it was sent), each with
// its own depth. For any other value members is nil and isObject false.
func Split(data []byte) (members []Member, isObject bool, err error) {
	s := scanner{data: data, members: true}
	if err := s.run(); err != nil {
		return nil, false, err
	}
	return s.found, s.topObject, nil
}

// SplitNamed is Split for a reader that knows the names it can use (a
// JSON-RPC envelope's): members holds only those, each once, as last sent;
// unknown is the first other name sent (nil when there is none, or when
// data is not an object). Whatever data holds, it allocates no more than the
// named members: an object of a million members costs one pass, where Split
// would return a million of them. unknown is nil when every name was named
// (the empty name is a name like any other).
func SplitNamed(data []byte, names ...string) (members []Member, unknown *string, isObject bool, err error) {
	if names == nil {
		names = []string{} // keep nothing, rather than everything
	}
	s := scanner{data: data, members: true, keep: names, found: make([]Member, 0, len(names))}
	if err := s.run(); err != nil {
		return nil, nil, false, err
	}
	if s.seenOther {
		unknown = &s.unknown
	}
	return s.found, unknown, s.topObject, nil
}

// TrailingDataError is Nesting's refusal of a valid JSON value followed by
// more than white space.
type TrailingDataError struct{ Offset int }

func (e *TrailingDataError) Error() string {
	return fmt.Sprintf("data after the JSON value, at byte %d", e.Offset)
}

// scanner is an iterative JSON validator: one bit of stack per level (is
// this level an object?), so that depth costs neither recursion nor more
// than an eighth of a byte per level.
type scanner struct {
	data    []byte
	i       int
	stack   []uint64
	depth   int
	deepest int

	members   bool // record the top-level object's members
	topObject bool
	found     []Member
	name      string // of the top-level member being scanned
	start     int    // where its value starts
	since     int    // deepest level reached within it

	keep      []string // when set, record only members of these names (SplitNamed)
	recording bool     // the member being scanned is to be recorded
	unknown   string   // the first name sent that keep does not hold
	seenOther bool
}

func (s *scanner) fail(what string) error {
	if s.i >= len(s.data) {
		return fmt.Errorf("unexpected end of JSON input (%s)", what)
	}
	return fmt.Errorf("invalid character %q at byte %d, %s", s.data[s.i], s.i, what)
}

func (s *scanner) space() {
	for s.i < len(s.data) {
		switch s.data[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) push(object bool) {
	if s.depth/64 == len(s.stack) {
		s.stack = append(s.stack, 0)
	}
	word, bit := s.depth/64, uint(s.depth%64)
	if object {
		s.stack[word] |= 1 << bit
	} else {
		s.stack[word] &^= 1 << bit
	}
	s.depth++
	s.deepest = max(s.deepest, s.depth)
	s.since = max(s.since, s.depth)
}

func (s *scanner) inObject() bool {
	d := s.depth - 1
	return s.stack[d/64]&(1<<uint(d%64)) != 0
}

func (s *scanner) run() error {
	s.space()
	if err := s.value(); err != nil {
		return err
	}
	s.space()
	if s.i < len(s.data) {
		return &TrailingDataError{Offset: s.i}
	}
	return nil
}

// value scans one value, nested ones included, without recursion.
func (s *scanner) value() error {
	for {
		// Expecting a value.
		s.space()
		if s.depth == 1 && s.members && s.topObject {
			s.start, s.since = s.i, 1
		}
		if s.i >= len(s.data) {
			return s.fail("looking for a value")
		}
		switch c := s.data[s.i]; {
		case c == '{' || c == '[':
			if s.depth == 0 && c == '{' {
				s.topObject = true
			}
			s.i++
			s.push(c == '{')
			s.space()
			if s.i < len(s.data) && (s.data[s.i] == '}' && c == '{' || s.data[s.i] == ']' && c == '[') {
				s.i++
				s.depth--
				break // an empty container is a whole value
			}
			if c == '{' {
				if err := s.key(); err != nil {
					return err
				}
			}
			continue
		case c == '"':
			if err := s.str(); err != nil {
				return err
			}
		case c == '-' || c >= '0' && c <= '9':
			if err := s.number(); err != nil {
				return err
			}
		case c == 't':
			if err := s.literal("true"); err != nil {
				return err
			}
		case c == 'f':
			if err := s.literal("false"); err != nil {
				return err
			}
		case c == 'n':
			if err := s.literal("null"); err != nil {
				return err
			}
		default:
			return s.fail("looking for a value")
		}

		// A value ended; close every container that ends with it.
		for {
			if s.depth == 0 {
				return nil
			}
			if s.depth == 1 && s.members && s.topObject && s.recording {
				s.record(Member{Name: s.name, Value: json.RawMessage(s.data[s.start:s.i]), Depth: s.since - 1})
			}
			s.space()
			if s.i >= len(s.data) {
				return s.fail("after a value in an array or object")
			}
			object := s.inObject()
			c := s.data[s.i]
			if c == ',' {
				s.i++
				if object {
					if err := s.key(); err != nil {
						return err
					}
				}
				break
			}
			if object && c == '}' || !object && c == ']' {
				s.i++
				s.depth--
				continue
			}
			return s.fail("after a value in an array or object")
		}
	}
}

// key scans `"name" :` inside an object.
func (s *scanner) key() error {
	s.space()
	if s.i >= len(s.data) || s.data[s.i] != '"' {
		return s.fail("looking for a member name")
	}
	start := s.i
	if err := s.str(); err != nil {
		return err
	}
	if s.depth == 1 && s.members && s.topObject {
		s.named(s.data[start:s.i])
	}
	s.space()
	if s.i >= len(s.data) || s.data[s.i] != ':' {
		return s.fail("after a member name")
	}
	s.i++
	return nil
}

// named notes the name of the top-level member about to be scanned, and
// whether to record it.
func (s *scanner) named(quoted []byte) {
	if s.keep == nil {
		s.name, s.recording = unquote(quoted), true
		return
	}
	bare := quoted[1 : len(quoted)-1]
	if !plain(quoted) {
		bare = []byte(unquote(quoted))
	}
	for _, n := range s.keep {
		if n == string(bare) {
			s.name, s.recording = n, true
			return
		}
	}
	s.recording = false
	if !s.seenOther {
		s.unknown, s.seenOther = string(bare), true
	}
}

// record keeps a member: every one for Split, the last of each name for
// SplitNamed.
func (s *scanner) record(m Member) {
	if s.keep != nil {
		for i := range s.found {
			if s.found[i].Name == m.Name {
				m.Repeated = true
				s.found[i] = m
				return
			}
		}
	}
	s.found = append(s.found, m)
}

// str scans a string starting at its opening quote. Unlike encoding/json,
// which turns them into U+FFFD without a word, it refuses invalid UTF-8
// and a \u escape of a UTF-16 surrogate that is not half of a pair: RFC
// 8259 says JSON text is Unicode, and a peer that reads the same frame
// strictly (serde_json, for one) refuses both, so a value this side
// accepted would be read differently, or not at all, on the other.
func (s *scanner) str() error {
	s.i++
	for s.i < len(s.data) {
		c := s.data[s.i]
		switch {
		case c == '"':
			s.i++
			return nil
		case c < 0x20:
			return s.fail("in a string")
		case c == '\\':
			s.i++
			if s.i >= len(s.data) {
				return s.fail("in a string escape")
			}
			switch s.data[s.i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i++
			case 'u':
				if err := s.escapedRune(); err != nil {
					return err
				}
			default:
				return s.fail("in a string escape")
			}
		case c < utf8.RuneSelf:
			s.i++
		default:
			r, size := utf8.DecodeRune(s.data[s.i:])
			if r == utf8.RuneError && size == 1 {
				return fmt.Errorf("invalid UTF-8 byte 0x%02x at byte %d, in a string", c, s.i)
			}
			s.i += size
		}
	}
	return s.fail("in a string")
}

// escapedRune scans a \u escape (the scanner at its u) and, for the first
// half of a UTF-16 surrogate pair, the second half that must follow it.
func (s *scanner) escapedRune() error {
	at := s.i - 1
	v, err := s.hex4()
	if err != nil {
		return err
	}
	switch {
	case v >= 0xDC00 && v <= 0xDFFF:
		return loneSurrogate(v, at)
	case v < 0xD800 || v > 0xDBFF:
		return nil
	}
	if s.i+1 >= len(s.data) || s.data[s.i] != '\\' || s.data[s.i+1] != 'u' {
		return loneSurrogate(v, at)
	}
	s.i++
	low, err := s.hex4()
	if err != nil {
		return err
	}
	if low < 0xDC00 || low > 0xDFFF {
		return loneSurrogate(v, at)
	}
	return nil
}

func loneSurrogate(v rune, at int) error {
	return fmt.Errorf("a lone UTF-16 surrogate \\u%04x at byte %d, in a string: it is no Unicode character", v, at)
}

// hex4 reads the four hex digits after a u (the scanner at the u).
func (s *scanner) hex4() (rune, error) {
	s.i++
	var v rune
	for range 4 {
		if s.i >= len(s.data) || !isHex(s.data[s.i]) {
			return 0, s.fail("in a \\u escape")
		}
		v = v<<4 | hexValue(s.data[s.i])
		s.i++
	}
	return v, nil
}

func hexValue(c byte) rune {
	switch {
	case c <= '9':
		return rune(c - '0')
	case c >= 'a':
		return rune(c-'a') + 10
	default:
		return rune(c-'A') + 10
	}
}

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

func (s *scanner) digits() int {
	n := 0
	for s.i < len(s.data) && s.data[s.i] >= '0' && s.data[s.i] <= '9' {
		s.i++
		n++
	}
	return n
}

// number scans -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) number() error {
	if s.data[s.i] == '-' {
		s.i++
	}
	if s.i < len(s.data) && s.data[s.i] == '0' {
		s.i++
	} else if s.digits() == 0 {
		return s.fail("in a number")
	}
	if s.i < len(s.data) && s.data[s.i] == '.' {
		s.i++
		if s.digits() == 0 {
			return s.fail("after a decimal point")
		}
	}
	if s.i < len(s.data) && (s.data[s.i] == 'e' || s.data[s.i] == 'E') {
		s.i++
		if s.i < len(s.data) && (s.data[s.i] == '+' || s.data[s.i] == '-') {
			s.i++
		}
		if s.digits() == 0 {
			return s.fail("in an exponent")
		}
	}
	return nil
}

func (s *scanner) literal(word string) error {
	for j := 0; j < len(word); j++ {
		if s.i >= len(s.data) || s.data[s.i] != word[j] {
			return s.fail("in literal " + word)
		}
		s.i++
	}
	return nil
}
