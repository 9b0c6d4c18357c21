package wire

import (
	"encoding/json"
	"fmt"
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
			if s.depth == 1 && s.members && s.topObject {
				s.found = append(s.found, Member{Name: s.name, Value: json.RawMessage(s.data[s.start:s.i]), Depth: s.since - 1})
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
		// A valid JSON string always unquotes.
		_ = json.Unmarshal(s.data[start:s.i], &s.name)
	}
	s.space()
	if s.i >= len(s.data) || s.data[s.i] != ':' {
		return s.fail("after a member name")
	}
	s.i++
	return nil
}

// str scans a string starting at its opening quote. Like encoding/json, it
// takes any byte from 0x20 up (invalid UTF-8 included) as string content.
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
				s.i++
				for range 4 {
					if s.i >= len(s.data) || !isHex(s.data[s.i]) {
						return s.fail("in a \\u escape")
					}
					s.i++
				}
			default:
				return s.fail("in a string escape")
			}
		default:
			s.i++
		}
	}
	return s.fail("in a string")
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
