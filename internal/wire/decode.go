// Package wire decodes protocol JSON strictly and names the offending member.
//
// encoding/json is lenient in ways the protocol forbids: it ignores unknown
// members, turns null into a zero value, and accepts 2^53 and beyond even though
// a JavaScript peer cannot represent them. It is also strict in one way JSON is
// not: past 10,000 levels of nesting it calls valid JSON invalid; here depth
// has a limit of its own, MaxDepth, refused by name. Every params, response and
// configuration object in this project goes through Decode instead, so a
// refusal always carries the wire path of the member at fault (such as
// `owner.environmentId` or `templates[2].idle.pauseAfterMs`).
//
// The struct's json tags are the contract: a field whose tag has `omitempty`,
// or whose type is a pointer, is optional; every other field is required. A
// `wire:"…"` tag adds a grammar check to a string (see the Grammar constants)
// or restricts it to an enumeration (`wire:"enum=a|b|c"`).
package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// MaxSafeInteger is the largest integer every peer can carry exactly: past
// 2^53 a JavaScript number stops being an integer, so the protocol keeps every
// value below it and a decoder refuses rather than rounds.
const MaxSafeInteger = 1<<53 - 1

// FieldError is a refusal of one member. Path is empty when the value as a
// whole is at fault.
type FieldError struct {
	Path    string
	Problem string
}

func (e *FieldError) Error() string {
	if e.Path == "" {
		return e.Problem
	}
	return e.Path + ": " + e.Problem
}

// Checker is implemented by types whose validity spans several members (an
// idle policy's ordering, say). CheckWire runs after the members decoded, and
// a returned FieldError's Path is relative to the value.
type Checker interface {
	CheckWire() *FieldError
}

// Decode parses one JSON value from data into v (a non-nil pointer),
// strictly. A value nesting arrays and objects deeper than MaxDepth is
// refused as such, not as invalid JSON.
func Decode(data []byte, v any) error { return decode(data, v, MaxDepth) }

// DecodeEnvelope is Decode for a message whose payload sits one level down
// in json.RawMessage members and is decoded on its own afterwards (a
// JSON-RPC response around its result or error). It allows MaxDepth+1
// levels, so that every payload Decode accepts fits in its envelope, and
// leaves the payload's own limit to the payload's Decode.
func DecodeEnvelope(data []byte, v any) error { return decode(data, v, MaxDepth+1) }

func decode(data []byte, v any, most int) error {
	depth, err := Nesting(data)
	var trailing *TrailingDataError
	switch {
	case errors.As(err, &trailing):
		return &FieldError{Problem: "has data after the JSON value"}
	case err != nil:
		return &FieldError{Problem: "is not valid JSON: " + err.Error()}
	case depth > most:
		return &FieldError{Problem: fmt.Sprintf("is nested %d levels deep in arrays and objects, past the limit of %d", depth, most)}
	}
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		return fmt.Errorf("wire: Decode needs a non-nil pointer, got %T", v)
	}
	// From the text, along v's type: see raw.go.
	if fe := assignRaw("", trimSpace(data), rv.Elem()); fe != nil {
		return fe
	}
	return nil
}

// DecodeValue assigns an already parsed value (from encoding/json with
// UseNumber, or from a YAML decoder) into v, strictly.
func DecodeValue(generic any, v any) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		return fmt.Errorf("wire: DecodeValue needs a non-nil pointer, got %T", v)
	}
	if fe := assign("", generic, rv.Elem()); fe != nil {
		return fe
	}
	return nil
}

var rawMessageType = reflect.TypeFor[json.RawMessage]()

func indexed(path string, i int) string { return path + "[" + strconv.Itoa(i) + "]" }

func formatUint(n uint64) string { return strconv.FormatUint(n, 10) }

func join(path, member string) string {
	if member == "" {
		return path
	}
	if path == "" {
		return member
	}
	return path + "." + member
}

func assign(path string, generic any, dst reflect.Value) *FieldError {
	// A RawMessage carries any JSON value verbatim for a later decoder (a
	// JSON-RPC id may be null), so only it may hold null.
	if generic == nil && dst.Type() != rawMessageType {
		return &FieldError{Path: path, Problem: "must not be null"}
	}
	if dst.Type() == rawMessageType {
		raw, err := json.Marshal(generic)
		if err != nil {
			return &FieldError{Path: path, Problem: "cannot be re-encoded: " + err.Error()}
		}
		dst.SetBytes(raw)
		return nil
	}
	switch dst.Kind() {
	case reflect.Pointer:
		elem := reflect.New(dst.Type().Elem())
		if fe := assign(path, generic, elem.Elem()); fe != nil {
			return fe
		}
		dst.Set(elem)
		return nil
	case reflect.Struct:
		obj, ok := generic.(map[string]any)
		if !ok {
			return typeError(path, "an object", generic)
		}
		if fe := assignStruct(path, obj, dst); fe != nil {
			return fe
		}
	case reflect.String:
		s, ok := generic.(string)
		if !ok {
			return typeError(path, "a string", generic)
		}
		dst.SetString(s)
	case reflect.Bool:
		b, ok := generic.(bool)
		if !ok {
			return typeError(path, "a boolean", generic)
		}
		dst.SetBool(b)
	case reflect.Uint64, reflect.Uint32, reflect.Uint16, reflect.Uint8, reflect.Uint:
		n, fe := unsignedOf(path, generic)
		if fe != nil {
			return fe
		}
		if limit := uintLimit(dst.Kind()); n > limit {
			return &FieldError{Path: path, Problem: "must be at most " + formatUint(limit)}
		}
		dst.SetUint(n)
	case reflect.Int64, reflect.Int32, reflect.Int, reflect.Int16, reflect.Int8:
		n, fe := signedOf(path, generic)
		if fe != nil {
			return fe
		}
		if dst.OverflowInt(n) {
			return &FieldError{Path: path, Problem: "is out of range"}
		}
		dst.SetInt(n)
	case reflect.Float64, reflect.Float32:
		f, fe := floatOf(path, generic)
		if fe != nil {
			return fe
		}
		dst.SetFloat(f)
	case reflect.Slice:
		arr, ok := generic.([]any)
		if !ok {
			return typeError(path, "an array", generic)
		}
		out := reflect.MakeSlice(dst.Type(), len(arr), len(arr))
		for i, item := range arr {
			if fe := assign(indexed(path, i), item, out.Index(i)); fe != nil {
				return fe
			}
		}
		dst.Set(out)
	case reflect.Map:
		if dst.Type().Key().Kind() != reflect.String {
			return &FieldError{Path: path, Problem: "has an unsupported key type"}
		}
		obj, ok := generic.(map[string]any)
		if !ok {
			return typeError(path, "an object", generic)
		}
		out := reflect.MakeMapWithSize(dst.Type(), len(obj))
		for _, k := range sortedKeys(obj) {
			elem := reflect.New(dst.Type().Elem()).Elem()
			if fe := assign(join(path, k), obj[k], elem); fe != nil {
				return fe
			}
			out.SetMapIndex(reflect.ValueOf(k).Convert(dst.Type().Key()), elem)
		}
		dst.Set(out)
	case reflect.Interface:
		if nested, problem := keptProblem(path, generic); problem != "" {
			return &FieldError{Path: nested, Problem: problem}
		}
		value := reflect.ValueOf(generic)
		if !value.Type().AssignableTo(dst.Type()) {
			return &FieldError{Path: path, Problem: "has an unsupported type " + dst.Type().String()}
		}
		dst.Set(value)
	default:
		return &FieldError{Path: path, Problem: "has an unsupported type " + dst.Type().String()}
	}
	return check(path, dst)
}

// checkerType is the Checker interface's type, for mayCheck.
var checkerType = reflect.TypeFor[Checker]()

// checkers caches, per type, whether a value of it or its pointer is a
// Checker: asking through Interface boxes the value, and check runs on
// every value decoded (a tenth of an idle probe's decode).
var checkers sync.Map // reflect.Type -> bool

func mayCheck(t reflect.Type) bool {
	if v, ok := checkers.Load(t); ok {
		return v.(bool)
	}
	may := t.Implements(checkerType) || reflect.PointerTo(t).Implements(checkerType)
	checkers.Store(t, may)
	return may
}

func check(path string, dst reflect.Value) *FieldError {
	if dst.Kind() != reflect.Interface && !mayCheck(dst.Type()) {
		return nil
	}
	var c Checker
	if dst.CanAddr() {
		if cc, ok := dst.Addr().Interface().(Checker); ok {
			c = cc
		}
	}
	if c == nil {
		if cc, ok := dst.Interface().(Checker); ok {
			c = cc
		}
	}
	if c == nil {
		return nil
	}
	if fe := c.CheckWire(); fe != nil {
		rel := fe.Path
		if strings.HasPrefix(rel, "[") {
			// An element of the value itself, such as "[2].x" from a slice type.
			return &FieldError{Path: path + rel, Problem: fe.Problem}
		}
		return &FieldError{Path: join(path, rel), Problem: fe.Problem}
	}
	return nil
}

// keptProblem finds what a destination that keeps a generic value as it is
// (an interface) must still refuse, as every other destination does: a
// null, or a number past float64's range, which no peer can carry. It
// returns the nested member's path and the problem ("" when there is none).
func keptProblem(path string, generic any) (string, string) {
	switch v := generic.(type) {
	case nil:
		return path, "must not be null"
	case json.Number:
		if _, err := v.Float64(); err != nil {
			return path, "is not a representable number"
		}
	case map[string]any:
		for _, k := range sortedKeys(v) {
			member := path + "." + k
			if path == "" {
				member = k
			}
			if p, problem := keptProblem(member, v[k]); problem != "" {
				return p, problem
			}
		}
	case []any:
		for i, item := range v {
			if p, problem := keptProblem(fmt.Sprintf("%s[%d]", path, i), item); problem != "" {
				return p, problem
			}
		}
	}
	return "", ""
}

func assignStruct(path string, obj map[string]any, dst reflect.Value) *FieldError {
	info := structInfoOf(dst.Type())
	for _, k := range sortedKeys(obj) {
		if _, known := info.byName[k]; !known {
			return &FieldError{Path: join(path, k), Problem: "is not a known member"}
		}
	}
	for _, f := range info.fields {
		value, present := obj[f.name]
		fieldPath := join(path, f.name)
		if !present {
			if f.required {
				return &FieldError{Path: fieldPath, Problem: "is required"}
			}
			continue
		}
		field := dst.FieldByIndex(f.index)
		if fe := assign(fieldPath, value, field); fe != nil {
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

// checkGrammarOf applies a `wire` tag to a string, or to every string that a
// pointer, slice, array or map of strings holds (each named by its own path).
func checkGrammarOf(path, grammar string, v reflect.Value) *FieldError {
	switch v.Kind() {
	case reflect.String:
		if problem := CheckGrammar(grammar, v.String()); problem != "" {
			return &FieldError{Path: path, Problem: problem}
		}
	case reflect.Pointer:
		if !v.IsNil() {
			return checkGrammarOf(path, grammar, v.Elem())
		}
	case reflect.Slice, reflect.Array:
		for i := range v.Len() {
			if fe := checkGrammarOf(fmt.Sprintf("%s[%d]", path, i), grammar, v.Index(i)); fe != nil {
				return fe
			}
		}
	case reflect.Map:
		keys := v.MapKeys()
		sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
		for _, k := range keys {
			if fe := checkGrammarOf(path+"."+k.String(), grammar, v.MapIndex(k)); fe != nil {
				return fe
			}
		}
	default:
		return &FieldError{Path: path, Problem: "carries a wire grammar, but a " + v.Type().String() + " holds no string (a defect in this build)"}
	}
	return nil
}

type fieldInfo struct {
	name     string
	index    []int
	required bool
	grammar  string
}

type structInfo struct {
	fields []fieldInfo
	byName map[string]int
}

var structCache sync.Map // reflect.Type → *structInfo

func structInfoOf(t reflect.Type) *structInfo {
	if cached, ok := structCache.Load(t); ok {
		return cached.(*structInfo)
	}
	info := &structInfo{byName: map[string]int{}}
	collectFields(t, nil, info)
	structCache.Store(t, info)
	return info
}

// collectFields lists a struct's members; an untagged embedded struct
// contributes its own members, as encoding/json flattens it.
func collectFields(t reflect.Type, prefix []int, info *structInfo) {
	// A struct's own members come first and shadow an embedded struct's
	// members of the same name, as in encoding/json.
	var embedded [][]int
	for i := range t.NumField() {
		sf := t.Field(i)
		index := append(append([]int(nil), prefix...), i)
		tag := sf.Tag.Get("json")
		if sf.Anonymous && tag == "" && sf.Type.Kind() == reflect.Struct {
			embedded = append(embedded, index)
			continue
		}
		if !sf.IsExported() || tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if name == "" {
			name = sf.Name
		}
		optional := sf.Type.Kind() == reflect.Pointer
		for _, o := range strings.Split(opts, ",") {
			if o == "omitempty" || o == "omitzero" {
				optional = true
			}
		}
		if _, shadowed := info.byName[name]; shadowed {
			continue
		}
		info.byName[name] = len(info.fields)
		info.fields = append(info.fields, fieldInfo{name: name, index: index, required: !optional, grammar: sf.Tag.Get("wire")})
	}
	for _, index := range embedded {
		collectFields(t.FieldByIndex(index[len(prefix):]).Type, index, info)
	}
}

func sortedKeys(obj map[string]any) []string {
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func typeError(path, want string, got any) *FieldError {
	return &FieldError{Path: path, Problem: "must be " + want + ", not " + Describe(got)}
}

// Describe names the JSON type of a parsed value, as refusals quote it.
func Describe(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case map[string]any:
		return "an object"
	case []any:
		return "an array"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	case json.Number, int, int64, uint64, float64:
		return "a number"
	default:
		return fmt.Sprintf("%T", v)
	}
}

// DescribeJSON names the JSON type of a raw value as Describe names a parsed
// one, from its first byte: a raw value may nest too deep to be parsed.
func DescribeJSON(raw []byte) string {
	v := bytes.TrimLeft(raw, " \t\r\n")
	if len(v) == 0 {
		return "nothing"
	}
	switch v[0] {
	case '{':
		return Describe(map[string]any{})
	case '[':
		return Describe([]any{})
	case '"':
		return Describe("")
	case 't', 'f':
		return Describe(true)
	case 'n':
		return Describe(nil)
	}
	return Describe(json.Number(""))
}

func uintLimit(k reflect.Kind) uint64 {
	switch k {
	case reflect.Uint32:
		return math.MaxUint32
	case reflect.Uint16:
		return math.MaxUint16
	case reflect.Uint8:
		return math.MaxUint8
	default:
		return MaxSafeInteger
	}
}

// integerText returns the decimal text of an integer value from either JSON or YAML.
func integerText(path string, generic any) (string, *FieldError) {
	switch n := generic.(type) {
	case json.Number:
		s := n.String()
		if strings.ContainsAny(s, ".eE") {
			return "", &FieldError{Path: path, Problem: "must be a whole number, not " + s}
		}
		return s, nil
	case int:
		return strconv.Itoa(n), nil
	case int64:
		return strconv.FormatInt(n, 10), nil
	case uint64:
		return strconv.FormatUint(n, 10), nil
	case float64:
		if n != math.Trunc(n) || math.IsInf(n, 0) {
			return "", &FieldError{Path: path, Problem: "must be a whole number"}
		}
		return strconv.FormatFloat(n, 'f', 0, 64), nil
	default:
		return "", typeError(path, "a whole number", generic)
	}
}

func unsignedOf(path string, generic any) (uint64, *FieldError) {
	s, fe := integerText(path, generic)
	if fe != nil {
		return 0, fe
	}
	if strings.HasPrefix(s, "-") {
		return 0, &FieldError{Path: path, Problem: "must not be negative"}
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n > MaxSafeInteger {
		return 0, &FieldError{Path: path, Problem: "must be below 2^53 (9007199254740992)"}
	}
	return n, nil
}

func signedOf(path string, generic any) (int64, *FieldError) {
	s, fe := integerText(path, generic)
	if fe != nil {
		return 0, fe
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n > MaxSafeInteger || n < -MaxSafeInteger {
		return 0, &FieldError{Path: path, Problem: "must lie strictly between -2^53 and 2^53"}
	}
	return n, nil
}

func floatOf(path string, generic any) (float64, *FieldError) {
	switch n := generic.(type) {
	case json.Number:
		f, err := n.Float64()
		if err != nil {
			return 0, &FieldError{Path: path, Problem: "is not a representable number"}
		}
		return f, nil
	case int:
		return float64(n), nil
	case int64:
		return float64(n), nil
	case uint64:
		return float64(n), nil
	case float64:
		return n, nil
	default:
		return 0, typeError(path, "a number", generic)
	}
}
