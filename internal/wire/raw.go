package wire

import (
	"bytes"
	"encoding/json"
	"reflect"
	"sort"
	"unicode/utf8"
)

// Decoding from the text itself.
//
// Decode used to parse the whole value into encoding/json's generic form
// (map[string]any, []any, json.Number) and then assign it. That costs
// about fifteen bytes of heap per byte of text for an object of many small
// members, before a single member is checked: a 15 MiB params object of
// 1.3 million members took 221 MiB to refuse for its first unknown member,
// and eight of them at once took the provider past 1.5 GB.
//
// assignRaw walks the text along the destination's type instead, on text
// that Nesting has already proved to be one valid JSON value. A struct
// looks its members' names up without materialising any of them and keeps
// only the last occurrence of each known one, so an object of any number of
// unknown members costs one pass and the name it reports. Values are built
// only where the destination holds them. Destinations that keep a value as
// it is (an interface, a json.RawMessage) still take encoding/json's
// generic form of that value alone, so what they hold is unchanged.
//
// The refusals are the generic path's, word for word: the same member is
// named (the first unknown one in byte order, the first failing field in
// declaration order, elements in order, map keys in byte order).

// assignRaw is assign for raw, one valid JSON value without surrounding
// white space.
func assignRaw(path string, raw []byte, dst reflect.Value) *FieldError {
	if dst.Type() == rawMessageType && canonical(raw) {
		dst.SetBytes(bytes.Clone(raw)) // what the slow path below would build
		return nil
	}
	if dst.Type() == rawMessageType || dst.Kind() == reflect.Interface {
		generic, fe := genericOf(path, raw)
		if fe != nil {
			return fe
		}
		return assign(path, generic, dst)
	}
	if raw[0] == 'n' {
		return &FieldError{Path: path, Problem: "must not be null"}
	}
	switch dst.Kind() {
	case reflect.Pointer:
		elem := reflect.New(dst.Type().Elem())
		if fe := assignRaw(path, raw, elem.Elem()); fe != nil {
			return fe
		}
		dst.Set(elem)
		return nil
	case reflect.Struct:
		if raw[0] != '{' {
			return typeErrorRaw(path, "an object", raw)
		}
		if fe := assignStructRaw(path, raw, dst); fe != nil {
			return fe
		}
	case reflect.String:
		if raw[0] != '"' {
			return typeErrorRaw(path, "a string", raw)
		}
		dst.SetString(unquote(raw))
	case reflect.Bool:
		switch raw[0] {
		case 't':
			dst.SetBool(true)
		case 'f':
			dst.SetBool(false)
		default:
			return typeErrorRaw(path, "a boolean", raw)
		}
	case reflect.Uint64, reflect.Uint32, reflect.Uint16, reflect.Uint8, reflect.Uint:
		n, fe := unsignedOf(path, scalarOf(raw))
		if fe != nil {
			return fe
		}
		if limit := uintLimit(dst.Kind()); n > limit {
			return &FieldError{Path: path, Problem: "must be at most " + formatUint(limit)}
		}
		dst.SetUint(n)
	case reflect.Int64, reflect.Int32, reflect.Int, reflect.Int16, reflect.Int8:
		n, fe := signedOf(path, scalarOf(raw))
		if fe != nil {
			return fe
		}
		if dst.OverflowInt(n) {
			return &FieldError{Path: path, Problem: "is out of range"}
		}
		dst.SetInt(n)
	case reflect.Float64, reflect.Float32:
		f, fe := floatOf(path, scalarOf(raw))
		if fe != nil {
			return fe
		}
		dst.SetFloat(f)
	case reflect.Slice:
		if raw[0] != '[' {
			return typeErrorRaw(path, "an array", raw)
		}
		n := 0
		if err := eachElement(raw, func([]byte) *FieldError { n++; return nil }); err != nil {
			return err
		}
		out := reflect.MakeSlice(dst.Type(), n, n)
		i := 0
		if fe := eachElement(raw, func(item []byte) *FieldError {
			fe := assignRaw(indexed(path, i), item, out.Index(i))
			i++
			return fe
		}); fe != nil {
			return fe
		}
		dst.Set(out)
	case reflect.Map:
		if dst.Type().Key().Kind() != reflect.String {
			return &FieldError{Path: path, Problem: "has an unsupported key type"}
		}
		if raw[0] != '{' {
			return typeErrorRaw(path, "an object", raw)
		}
		// The destination holds every member, so they are all needed.
		obj := map[string][]byte{}
		if fe := eachMember(raw, func(name, value []byte) *FieldError {
			k := unquote(name)
			if _, seen := obj[k]; seen {
				return repeatedMember(path, k)
			}
			obj[k] = value
			return nil
		}); fe != nil {
			return fe
		}
		keys := make([]string, 0, len(obj))
		for k := range obj {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		out := reflect.MakeMapWithSize(dst.Type(), len(obj))
		for _, k := range keys {
			elem := reflect.New(dst.Type().Elem()).Elem()
			if fe := assignRaw(join(path, k), obj[k], elem); fe != nil {
				return fe
			}
			out.SetMapIndex(reflect.ValueOf(k).Convert(dst.Type().Key()), elem)
		}
		dst.Set(out)
	default:
		return &FieldError{Path: path, Problem: "has an unsupported type " + dst.Type().String()}
	}
	return check(path, dst)
}

func assignStructRaw(path string, raw []byte, dst reflect.Value) *FieldError {
	info := structInfoOf(dst.Type())
	values := make([][]byte, len(info.fields))
	// The first unknown name in byte order, held as the text's own bytes
	// (a copy only for a name with escapes), so that a long run of unknown
	// members allocates nothing whatever their order.
	var unknown []byte
	seenUnknown := false
	if fe := eachMember(raw, func(name, value []byte) *FieldError {
		bare := name[1 : len(name)-1]
		if !plain(name) {
			bare = []byte(unquote(name))
		}
		if i, known := info.byName[string(bare)]; known {
			if values[i] != nil {
				return repeatedMember(path, string(bare))
			}
			values[i] = value
		} else if !seenUnknown || bytes.Compare(bare, unknown) < 0 {
			unknown, seenUnknown = bare, true
		}
		return nil
	}); fe != nil {
		return fe
	}
	if seenUnknown {
		return &FieldError{Path: join(path, string(unknown)), Problem: "is not a known member"}
	}
	for i, f := range info.fields {
		fieldPath := join(path, f.name)
		if values[i] == nil {
			if f.required {
				return &FieldError{Path: fieldPath, Problem: "is required"}
			}
			continue
		}
		field := dst.FieldByIndex(f.index)
		if fe := assignRaw(fieldPath, values[i], field); fe != nil {
			return fe
		}
		if f.grammar != "" {
			if fe := checkGrammarOf(fieldPath, f.grammar, field); fe != nil {
				return fe
			}
		}
	}
	return nil
}

// genericOf is encoding/json's generic form of one value, for destinations
// that keep it as it is.
func genericOf(path string, raw []byte) (any, *FieldError) {
	// encoding/json keeps the last of a repeated name without a word.
	if fe := firstRepeated(path, raw); fe != nil {
		return nil, fe
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var generic any
	if err := dec.Decode(&generic); err != nil {
		return nil, &FieldError{Path: path, Problem: "is not valid JSON: " + err.Error()}
	}
	return generic, nil
}

// repeatedMember refuses an object that names one member twice. JSON
// leaves the meaning of that open; encoding/json keeps the last, other
// decoders the first or refuse, so two peers could act on two different
// values of one message. Strict decoding refuses it, at every depth.
func repeatedMember(path, name string) *FieldError {
	return &FieldError{Path: join(path, name), Problem: "is sent more than once"}
}

// firstRepeated finds, in a value about to be kept whole, the first object
// (depth first, in byte order) that names a member twice. Its cost is that
// of the value's names, which the caller builds anyway.
func firstRepeated(path string, raw []byte) *FieldError {
	switch raw[0] {
	case '{':
		var seen map[string]struct{}
		return eachMember(raw, func(name, value []byte) *FieldError {
			k := unquote(name)
			if _, dup := seen[k]; dup {
				return repeatedMember(path, k)
			}
			if seen == nil {
				seen = map[string]struct{}{}
			}
			seen[k] = struct{}{}
			return firstRepeated(join(path, k), value)
		})
	case '[':
		i := 0
		return eachElement(raw, func(item []byte) *FieldError {
			fe := firstRepeated(indexed(path, i), item)
			i++
			return fe
		})
	}
	return nil
}

// scalarOf stands in for a value where a number is wanted: the number
// itself as encoding/json's UseNumber has it, or a value of the same JSON
// type for a refusal to name.
func scalarOf(raw []byte) any {
	switch raw[0] {
	case '{':
		return map[string]any(nil)
	case '[':
		return []any(nil)
	case '"':
		return ""
	case 't', 'f':
		return true
	case 'n':
		return nil
	}
	return json.Number(raw)
}

func typeErrorRaw(path, want string, raw []byte) *FieldError {
	return &FieldError{Path: path, Problem: "must be " + want + ", not " + DescribeJSON(raw)}
}

// plain says whether a quoted string needs no unescaping: no escapes, and
// valid UTF-8 (encoding/json turns invalid bytes into U+FFFD).
func plain(quoted []byte) bool {
	return bytes.IndexByte(quoted, '\\') < 0 && utf8.Valid(quoted)
}

// unquote is a JSON string's value, as encoding/json decodes it.
func unquote(quoted []byte) string {
	if plain(quoted) {
		return string(quoted[1 : len(quoted)-1])
	}
	var s string
	_ = json.Unmarshal(quoted, &s) // a valid JSON string always unquotes
	return s
}

// eachMember calls f with each member of the object raw, in the order
// sent: its name as quoted and its value, without white space around them.
func eachMember(raw []byte, f func(name, value []byte) *FieldError) *FieldError {
	s := scanner{data: raw, i: 1}
	s.space()
	if s.i < len(raw) && raw[s.i] == '}' {
		return nil
	}
	for {
		s.space()
		start := s.i
		if err := s.str(); err != nil {
			return invalid(err)
		}
		name := raw[start:s.i]
		s.space()
		s.i++ // the colon
		value, err := s.next()
		if err != nil {
			return invalid(err)
		}
		if fe := f(name, value); fe != nil {
			return fe
		}
		s.space()
		if s.i >= len(raw) || raw[s.i] != ',' {
			return nil // the closing brace
		}
		s.i++
	}
}

// eachElement calls f with each element of the array raw, in order.
func eachElement(raw []byte, f func(item []byte) *FieldError) *FieldError {
	s := scanner{data: raw, i: 1}
	s.space()
	if s.i < len(raw) && raw[s.i] == ']' {
		return nil
	}
	for {
		item, err := s.next()
		if err != nil {
			return invalid(err)
		}
		if fe := f(item); fe != nil {
			return fe
		}
		s.space()
		if s.i >= len(raw) || raw[s.i] != ',' {
			return nil // the closing bracket
		}
		s.i++
	}
}

// next scans the value at the scanner's position and returns its text.
func (s *scanner) next() ([]byte, error) {
	s.space()
	start := s.i
	s.depth = 0
	if err := s.value(); err != nil {
		return nil, err
	}
	return s.data[start:s.i], nil
}

// invalid cannot happen on text Nesting accepted; it is there so that a
// defect refuses rather than misreads.
func invalid(err error) *FieldError {
	return &FieldError{Problem: "is not valid JSON: " + err.Error()}
}

// trimSpace drops JSON white space around a value.
func trimSpace(data []byte) []byte {
	isSpace := func(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
	for len(data) > 0 && isSpace(data[0]) {
		data = data[1:]
	}
	for len(data) > 0 && isSpace(data[len(data)-1]) {
		data = data[:len(data)-1]
	}
	return data
}
