package wire

import (
	"bytes"
	"unicode/utf8"
)

// A json.RawMessage destination holds its value in canonical form: what
// json.Marshal makes of encoding/json's generic form of it (compact, object
// members sorted by name with the last of a repeated name kept, strings
// escaped as encoding/json escapes them, numbers as sent). Building that
// form decodes the value into maps and back; for the idle loop's probes
// (a small object per answer, a thousand answers a second at 10,000
// targets) that was a third of the decode. Most values arrive already in
// canonical form, since most senders are encoding/json, so canonical says
// when the text may be kept as it is. It answers false whenever it is not
// sure; the slow path then decides.

// canonical says whether raw, one valid JSON value without white space
// around it (as Nesting proved), is already its own canonical form.
func canonical(raw []byte) bool {
	end, ok := canonicalValue(raw, 0)
	return ok && end == len(raw)
}

// canonicalValue checks the value starting at raw[i] and returns where it
// ends.
func canonicalValue(raw []byte, i int) (int, bool) {
	if i >= len(raw) {
		return i, false
	}
	switch c := raw[i]; {
	case c == '{':
		return canonicalObject(raw, i)
	case c == '[':
		return canonicalArray(raw, i)
	case c == '"':
		return canonicalString(raw, i)
	case c == 't':
		return literal(raw, i, "true")
	case c == 'f':
		return literal(raw, i, "false")
	case c == 'n':
		return literal(raw, i, "null")
	case c == '-' || (c >= '0' && c <= '9'):
		// A number is kept as sent (json.Number); its grammar is Nesting's.
		for i < len(raw) && isNumberByte(raw[i]) {
			i++
		}
		return i, true
	}
	return i, false
}

func canonicalObject(raw []byte, i int) (int, bool) {
	i++ // {
	if i < len(raw) && raw[i] == '}' {
		return i + 1, true
	}
	var prev []byte
	for first := true; ; first = false {
		start := i
		end, ok := canonicalString(raw, i)
		if !ok {
			return end, false
		}
		// Names strictly increasing, byte by byte, as json.Marshal sorts a
		// map's keys: a repeated name or another order is rewritten.
		name := raw[start+1 : end-1]
		if !first && bytes.Compare(prev, name) >= 0 {
			return end, false
		}
		prev = name
		if end >= len(raw) || raw[end] != ':' {
			return end, false
		}
		if i, ok = canonicalValue(raw, end+1); !ok {
			return i, false
		}
		if i >= len(raw) {
			return i, false
		}
		switch raw[i] {
		case ',':
			i++
		case '}':
			return i + 1, true
		default:
			return i, false
		}
	}
}

func canonicalArray(raw []byte, i int) (int, bool) {
	i++ // [
	if i < len(raw) && raw[i] == ']' {
		return i + 1, true
	}
	for {
		var ok bool
		if i, ok = canonicalValue(raw, i); !ok || i >= len(raw) {
			return i, false
		}
		switch raw[i] {
		case ',':
			i++
		case ']':
			return i + 1, true
		default:
			return i, false
		}
	}
}

// canonicalString accepts a string json.Marshal writes back byte for byte:
// no escape (encoding/json may choose another), nothing it escapes (<, >,
// & and the line and paragraph separators) and valid UTF-8 (it writes
// U+FFFD for an invalid byte).
func canonicalString(raw []byte, i int) (int, bool) {
	if i >= len(raw) || raw[i] != '"' {
		return i, false
	}
	i++
	start := i
	for i < len(raw) {
		c := raw[i]
		switch {
		case c == '"':
			return i + 1, utf8.Valid(raw[start:i])
		case c == '\\' || c == '<' || c == '>' || c == '&' || c < 0x20:
			return i, false
		case c == 0xE2 && i+2 < len(raw) && raw[i+1] == 0x80 && (raw[i+2] == 0xA8 || raw[i+2] == 0xA9):
			return i, false
		}
		i++
	}
	return i, false
}

func literal(raw []byte, i int, word string) (int, bool) {
	if !bytes.HasPrefix(raw[i:], []byte(word)) {
		return i, false
	}
	return i + len(word), true
}

func isNumberByte(c byte) bool {
	return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'
}
