package wire_test

import (
	"encoding/json"
	"errors"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

type owner struct {
	UniverseID    string `json:"universeId" wire:"lsid"`
	EnvironmentID string `json:"environmentId" wire:"lsid"`
}

type entry struct {
	B string  `json:"b"`
	N *uint32 `json:"n,omitempty"`
}

type doc struct {
	Owner  owner             `json:"owner"`
	Items  []entry           `json:"items,omitempty"`
	Count  uint32            `json:"count,omitempty"`
	Flag   bool              `json:"flag,omitempty"`
	Note   *string           `json:"note"` // a pointer is optional even without omitempty
	Meta   map[string]uint32 `json:"meta,omitempty"`
	Raw    json.RawMessage   `json:"raw,omitempty"`
	Any    any               `json:"any,omitempty"`
	Phase  string            `json:"phase,omitempty" wire:"enum=active|closed"`
	Nested *owner            `json:"nested,omitempty"`
}

// fieldError decodes input into a fresh *T and returns the refusal, failing
// the test when there is none or when it is not a *wire.FieldError.
func fieldError[T any](t *testing.T, input string) *wire.FieldError {
	t.Helper()
	var v T
	err := wire.Decode([]byte(input), &v)
	if err == nil {
		t.Fatalf("Decode(%s) accepted it as %+v", input, v)
	}
	var fe *wire.FieldError
	if !errors.As(err, &fe) {
		t.Fatalf("Decode(%s) = %T %v, want a *wire.FieldError", input, err, err)
	}
	if fe.Problem == "" {
		t.Fatalf("Decode(%s) refused without a problem: %+v", input, fe)
	}
	return fe
}

func decodes[T any](t *testing.T, input string) T {
	t.Helper()
	var v T
	if err := wire.Decode([]byte(input), &v); err != nil {
		t.Fatalf("Decode(%s): %v", input, err)
	}
	return v
}

const okOwner = `"owner":{"universeId":"u1","environmentId":"env_1"}`

func TestDecodeAcceptsAWellFormedDocument(t *testing.T) {
	got := decodes[doc](t, `{`+okOwner+`,"items":[{"b":"x"},{"b":"y","n":7}],"count":3,"flag":true,"note":"hi",
		"meta":{"k":1},"raw":{"z":[1,2.5,"s"],"a":12345678901234567890},"any":{"x":[1,"y"]},"phase":"closed","nested":`+`{"universeId":"u","environmentId":"e"}}`)
	seven := uint32(7)
	note := "hi"
	want := doc{
		Owner: owner{"u1", "env_1"},
		Items: []entry{{B: "x"}, {B: "y", N: &seven}},
		Count: 3, Flag: true, Note: &note,
		Meta:   map[string]uint32{"k": 1},
		Raw:    json.RawMessage(`{"a":12345678901234567890,"z":[1,2.5,"s"]}`),
		Any:    map[string]any{"x": []any{json.Number("1"), "y"}},
		Phase:  "closed",
		Nested: &owner{"u", "e"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %#v\nwant %#v", got, want)
	}
}

func TestDecodeRefusals(t *testing.T) {
	cases := []struct {
		name, input, path, problem string
	}{
		{"unknown top-level member", `{` + okOwner + `,"extra":1}`, "extra", "not a known member"},
		{"unknown nested member", `{"owner":{"universeId":"u","environmentId":"e","x":1}}`, "owner.x", "not a known member"},
		{"unknown member in an array element", `{` + okOwner + `,"items":[{"b":"1"},{"b":"2"},{"b":"3","c":true}]}`, "items[2].c", "not a known member"},
		{"members match case-sensitively", `{"owner":{"UniverseId":"u","environmentId":"e"}}`, "owner.UniverseId", "not a known member"},
		{"missing required member", `{"owner":{"universeId":"u"}}`, "owner.environmentId", "is required"},
		{"missing required object", `{}`, "owner", "is required"},
		{"missing required in array element", `{` + okOwner + `,"items":[{"b":"1"},{}]}`, "items[1].b", "is required"},
		{"null top level", `null`, "", "must not be null"},
		{"null required member", `{"owner":null}`, "owner", "must not be null"},
		{"null optional member", `{` + okOwner + `,"count":null}`, "count", "must not be null"},
		{"null pointer member", `{` + okOwner + `,"note":null}`, "note", "must not be null"},
		{"null in an array", `{` + okOwner + `,"items":[{"b":"1"},null]}`, "items[1]", "must not be null"},
		{"null inside a pointer's object", `{` + okOwner + `,"items":[{"b":"1","n":null}]}`, "items[0].n", "must not be null"},
		{"null map value", `{` + okOwner + `,"meta":{"a":1,"b":null}}`, "meta.b", "must not be null"},
		{"null interface", `{` + okOwner + `,"any":null}`, "any", "must not be null"},
		{"null nested in an interface", `{` + okOwner + `,"any":{"a":[1,{"b":null}]}}`, "any.a[1].b", "must not be null"},
		// Found by reviewing FuzzDecode: encoding/json refuses these, and a
		// float64 member already did.
		{"number past float64 in an interface", `{` + okOwner + `,"any":1e400}`, "any", "is not a representable number"},
		{"number past float64 nested in an interface", `{` + okOwner + `,"any":{"a":[1,{"b":-1e400}]}}`, "any.a[1].b", "is not a representable number"},
		{"string for object", `{"owner":"u1"}`, "owner", "must be an object, not a string"},
		{"array for object", `{"owner":[]}`, "owner", "must be an object, not an array"},
		{"number for string", `{"owner":{"universeId":1,"environmentId":"e"}}`, "owner.universeId", "must be a string, not a number"},
		{"string for bool", `{` + okOwner + `,"flag":"true"}`, "flag", "must be a boolean, not a string"},
		{"number for bool", `{` + okOwner + `,"flag":1}`, "flag", "must be a boolean"},
		{"string for number", `{` + okOwner + `,"count":"3"}`, "count", "must be a whole number"},
		{"object for array", `{` + okOwner + `,"items":{}}`, "items", "must be an array, not an object"},
		{"array for map", `{` + okOwner + `,"meta":[]}`, "meta", "must be an object, not an array"},
		{"wrong map value type", `{` + okOwner + `,"meta":{"a":true}}`, "meta.a", "must be a whole number"},
		{"top level array", `[]`, "", "must be an object, not an array"},
		{"enum outside", `{` + okOwner + `,"phase":"open"}`, "phase", "must be one of active, closed"},
		{"enum empty", `{` + okOwner + `,"phase":""}`, "phase", "must be one of"},
		{"grammar in nested pointer", `{` + okOwner + `,"nested":{"universeId":"-u","environmentId":"e"}}`, "nested.universeId", "must match"},
		{"grammar in required member", `{"owner":{"universeId":"u","environmentId":""}}`, "owner.environmentId", "must match"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fe := fieldError[doc](t, tc.input)
			if fe.Path != tc.path || !strings.Contains(fe.Problem, tc.problem) {
				t.Fatalf("refusal %q (path %q), want path %q and a problem containing %q", fe.Error(), fe.Path, tc.path, tc.problem)
			}
			if tc.path != "" && !strings.HasPrefix(fe.Error(), tc.path+": ") {
				t.Fatalf("Error() = %q, want it to start with the path", fe.Error())
			}
		})
	}
}

func TestDecodeOptionality(t *testing.T) {
	type knobs struct {
		Required  string   `json:"required"`
		ReqNum    uint32   `json:"reqNum"`
		ReqFlag   bool     `json:"reqFlag"`
		ReqList   []string `json:"reqList"`
		OptString string   `json:"optString,omitempty"`
		OptZero   uint64   `json:"optZero,omitzero"`
		OptPtr    *uint64  `json:"optPtr"`
		Skipped   string   `json:"-"`
		unexp     string
	}
	got := decodes[knobs](t, `{"required":"","reqNum":0,"reqFlag":false,"reqList":[]}`)
	if got.OptPtr != nil || got.OptString != "" || got.ReqList == nil || len(got.ReqList) != 0 || got.unexp != "" {
		t.Fatalf("got %+v", got)
	}
	for _, member := range []string{"required", "reqNum", "reqFlag", "reqList"} {
		full := map[string]any{"required": "", "reqNum": 0, "reqFlag": false, "reqList": []string{}}
		delete(full, member)
		raw, _ := json.Marshal(full)
		fe := fieldError[knobs](t, string(raw))
		if fe.Path != member || fe.Problem != "is required" {
			t.Errorf("without %s: %v", member, fe)
		}
	}
	// A member the struct skips is not part of the wire.
	for _, member := range []string{"-", "Skipped", "unexp"} {
		fe := fieldError[knobs](t, `{"required":"","reqNum":0,"reqFlag":false,"reqList":[],"`+member+`":"x"}`)
		if fe.Path != member {
			t.Errorf("member %s: %v", member, fe)
		}
	}
	// An untagged exported field is named as encoding/json names it.
	type untagged struct{ Name string }
	if got := decodes[untagged](t, `{"Name":"x"}`); got.Name != "x" {
		t.Fatalf("got %+v", got)
	}
}

func TestDecodeIntegers(t *testing.T) {
	type nums struct {
		U64 uint64  `json:"u64,omitempty"`
		U32 uint32  `json:"u32,omitempty"`
		U16 uint16  `json:"u16,omitempty"`
		U8  uint8   `json:"u8,omitempty"`
		U   uint    `json:"u,omitempty"`
		I64 int64   `json:"i64,omitempty"`
		I32 int32   `json:"i32,omitempty"`
		I8  int8    `json:"i8,omitempty"`
		I   int     `json:"i,omitempty"`
		F   float64 `json:"f,omitempty"`
	}
	accepted := []struct {
		input string
		want  nums
	}{
		{`{"u64":9007199254740991}`, nums{U64: 1<<53 - 1}},
		{`{"u64":0}`, nums{}},
		{`{"u":9007199254740991}`, nums{U: 1<<53 - 1}},
		{`{"u32":4294967295}`, nums{U32: math.MaxUint32}},
		{`{"u16":65535}`, nums{U16: math.MaxUint16}},
		{`{"u8":255}`, nums{U8: 255}},
		{`{"i64":9007199254740991}`, nums{I64: 1<<53 - 1}},
		{`{"i64":-9007199254740991}`, nums{I64: -(1<<53 - 1)}},
		{`{"i64":-1}`, nums{I64: -1}},
		{`{"i32":2147483647}`, nums{I32: math.MaxInt32}},
		{`{"i32":-2147483648}`, nums{I32: math.MinInt32}},
		{`{"i8":-128}`, nums{I8: -128}},
		{`{"i":-5}`, nums{I: -5}},
		{`{"f":2.5}`, nums{F: 2.5}},
		{`{"f":1e3}`, nums{F: 1000}},
		{`{"f":-0.25}`, nums{F: -0.25}},
	}
	for _, tc := range accepted {
		if got := decodes[nums](t, tc.input); got != tc.want {
			t.Errorf("Decode(%s) = %+v, want %+v", tc.input, got, tc.want)
		}
	}
	refused := []struct{ input, path, problem string }{
		{`{"u64":9007199254740992}`, "u64", "below 2^53"},
		{`{"u64":18446744073709551615}`, "u64", "below 2^53"},
		{`{"u64":18446744073709551616}`, "u64", "below 2^53"},
		{`{"u":9007199254740992}`, "u", "below 2^53"},
		{`{"u64":-1}`, "u64", "must not be negative"},
		{`{"u32":-1}`, "u32", "must not be negative"},
		{`{"u64":-0}`, "u64", "must not be negative"},
		{`{"u64":1.5}`, "u64", "whole number"},
		{`{"u64":1.0}`, "u64", "whole number"},
		{`{"u64":1e3}`, "u64", "whole number"},
		{`{"u64":1E3}`, "u64", "whole number"},
		{`{"u64":10e-1}`, "u64", "whole number"},
		{`{"i64":2.5}`, "i64", "whole number"},
		{`{"i64":-1e2}`, "i64", "whole number"},
		{`{"u32":4294967296}`, "u32", "at most 4294967295"},
		{`{"u16":65536}`, "u16", "at most 65535"},
		{`{"u8":256}`, "u8", "at most 255"},
		{`{"i64":9007199254740992}`, "i64", "between -2^53 and 2^53"},
		{`{"i64":-9007199254740992}`, "i64", "between -2^53 and 2^53"},
		{`{"i64":9223372036854775807}`, "i64", "between -2^53 and 2^53"},
		{`{"i64":-9223372036854775809}`, "i64", "between -2^53 and 2^53"},
		{`{"i32":2147483648}`, "i32", "out of range"},
		{`{"i32":-2147483649}`, "i32", "out of range"},
		{`{"i8":128}`, "i8", "out of range"},
		{`{"u64":"1"}`, "u64", "must be a whole number, not a string"},
		{`{"u64":true}`, "u64", "must be a whole number, not a boolean"},
		{`{"f":"1"}`, "f", "must be a number, not a string"},
	}
	for _, tc := range refused {
		fe := fieldError[nums](t, tc.input)
		if fe.Path != tc.path || !strings.Contains(fe.Problem, tc.problem) {
			t.Errorf("Decode(%s) refused with %q, want path %q and %q", tc.input, fe.Error(), tc.path, tc.problem)
		}
	}
}

func TestDecodeWholeInput(t *testing.T) {
	type small struct {
		A uint32 `json:"a"`
	}
	for _, input := range []string{` {"a":1} `, "{\"a\":1}\n", "\t{\"a\":1}\r\n"} {
		if got := decodes[small](t, input); got.A != 1 {
			t.Errorf("Decode(%q) = %+v", input, got)
		}
	}
	for _, input := range []string{`{"a":1} {"a":2}`, `{"a":1}]`, `{"a":1}}`, `{"a":1} x`, `{"a":1},`, `{"a":1}"`, `{"a":1} 1`} {
		fe := fieldError[small](t, input)
		if fe.Path != "" || !strings.Contains(fe.Problem, "data after the JSON value") {
			t.Errorf("Decode(%q) refused with %v, want trailing data", input, fe)
		}
	}
	for _, input := range []string{``, ` `, `{`, `{"a":}`, `{"a":1,}`, `{'a':1}`, `{"a":01}`, `{"a":NaN}`, "\xff"} {
		fe := fieldError[small](t, input)
		if fe.Path != "" || !strings.Contains(fe.Problem, "not valid JSON") {
			t.Errorf("Decode(%q) refused with %v, want invalid JSON", input, fe)
		}
	}
}

func TestDecodeNeedsAPointer(t *testing.T) {
	var v struct{}
	for _, target := range []any{v, nil, (*struct{})(nil)} {
		err := wire.Decode([]byte(`{}`), target)
		if err == nil {
			t.Errorf("Decode into %T accepted", target)
		}
		var fe *wire.FieldError
		if errors.As(err, &fe) {
			t.Errorf("Decode into %T: a misuse is not a wire refusal: %v", target, err)
		}
	}
}

func TestDecodeMapsAndRaw(t *testing.T) {
	type withMaps struct {
		Labels map[string]string          `json:"labels,omitempty" wire:"info"`
		Deep   map[string]map[string]bool `json:"deep,omitempty"`
		Raws   map[string]json.RawMessage `json:"raws,omitempty"`
		Keyed  map[int]string             `json:"keyed,omitempty"`
	}
	got := decodes[withMaps](t, `{"labels":{"b":"2","a":"1"},"deep":{"x":{"y":true}},"raws":{"r":[1, 2]}}`)
	want := withMaps{
		Labels: map[string]string{"a": "1", "b": "2"},
		Deep:   map[string]map[string]bool{"x": {"y": true}},
		Raws:   map[string]json.RawMessage{"r": json.RawMessage(`[1,2]`)},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %#v", got)
	}
	if fe := fieldError[withMaps](t, `{"deep":{"x":{"y":"yes"}}}`); fe.Path != "deep.x.y" {
		t.Errorf("nested map path: %v", fe)
	}
	if fe := fieldError[withMaps](t, `{"labels":{"a":""}}`); fe.Path != "labels.a" || !strings.Contains(fe.Problem, "1 to 256 bytes") {
		t.Errorf("grammar on map values: %v", fe)
	}
	if fe := fieldError[withMaps](t, `{"keyed":{"1":"a"}}`); fe.Path != "keyed" || !strings.Contains(fe.Problem, "key type") {
		t.Errorf("map with int keys: %v", fe)
	}
	// A raw message keeps numbers exactly, beyond what float64 holds.
	type rawHolder struct {
		R json.RawMessage `json:"r"`
	}
	r := decodes[rawHolder](t, `{"r": 123456789012345678901234567890}`)
	if string(r.R) != `123456789012345678901234567890` {
		t.Fatalf("raw number = %s", r.R)
	}
	// A raw message is the one place a null may stand (a JSON-RPC id may be
	// null); whoever decodes it later applies the rules.
	if r := decodes[rawHolder](t, `{"r": null}`); string(r.R) != `null` {
		t.Fatalf("raw null = %s", r.R)
	}
	if r := decodes[rawHolder](t, `{"r": {"a": [null]}}`); string(r.R) != `{"a":[null]}` {
		t.Fatalf("raw with a null inside = %s", r.R)
	}
	r = decodes[rawHolder](t, `{"r": "a\u00e9\n"}`)
	var s string
	if err := json.Unmarshal(r.R, &s); err != nil || s != "aé\n" {
		t.Fatalf("raw string = %s (%v)", r.R, err)
	}
}

func TestDecodeInterfaces(t *testing.T) {
	type holder struct {
		Any any          `json:"any"`
		Err error        `json:"err,omitempty"`
		Str fmtStringer  `json:"str,omitempty"`
		Arr [2]string    `json:"arr,omitempty"`
		Ch  chan<- int   `json:"ch,omitempty"`
		Fn  func() error `json:"fn,omitempty"`
	}
	got := decodes[holder](t, `{"any":[1,"two",{"three":true}]}`)
	if !reflect.DeepEqual(got.Any, []any{json.Number("1"), "two", map[string]any{"three": true}}) {
		t.Fatalf("any = %#v", got.Any)
	}
	// A non-empty interface or an unsupported kind is refused, never a panic.
	for _, member := range []string{"err", "str", "arr", "ch", "fn"} {
		fe := fieldError[holder](t, `{"any":1,"`+member+`":"x"}`)
		if fe.Path != member || !strings.Contains(fe.Problem, "unsupported type") {
			t.Errorf("%s: %v", member, fe)
		}
	}
}

type fmtStringer interface{ String() string }

func TestDecodeValueFromYAMLShapes(t *testing.T) {
	type cfg struct {
		Port   uint16            `json:"port"`
		Bytes  uint64            `json:"bytes,omitempty"`
		At     int64             `json:"atMs,omitempty"`
		Ratio  float64           `json:"ratio,omitempty"`
		Names  []string          `json:"names,omitempty"`
		Labels map[string]string `json:"labels,omitempty"`
	}
	var got cfg
	err := wire.DecodeValue(map[string]any{
		"port": 8080, "bytes": uint64(1<<53 - 1), "atMs": int64(-5), "ratio": 0.5,
		"names": []any{"a", "b"}, "labels": map[string]any{"k": "v"},
	}, &got)
	want := cfg{Port: 8080, Bytes: 1<<53 - 1, At: -5, Ratio: 0.5, Names: []string{"a", "b"}, Labels: map[string]string{"k": "v"}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("DecodeValue = %+v, %v", got, err)
	}
	// YAML gives whole floats for "3.0"; they are whole numbers.
	if err := wire.DecodeValue(map[string]any{"port": float64(3), "ratio": 2}, &got); err != nil || got.Port != 3 || got.Ratio != 2 {
		t.Fatalf("whole float: %+v %v", got, err)
	}
	refused := []struct {
		value   any
		path    string
		problem string
	}{
		{map[string]any{"port": 1.5}, "port", "whole number"},
		{map[string]any{"port": math.NaN()}, "port", "whole number"},
		{map[string]any{"port": math.Inf(1)}, "port", "whole number"},
		{map[string]any{"port": -1}, "port", "must not be negative"},
		{map[string]any{"port": int64(-1)}, "port", "must not be negative"},
		{map[string]any{"port": float64(-2)}, "port", "must not be negative"},
		{map[string]any{"port": 65536}, "port", "at most 65535"},
		{map[string]any{"port": 1, "bytes": uint64(1 << 53)}, "bytes", "below 2^53"},
		{map[string]any{"port": 1, "bytes": float64(1 << 53)}, "bytes", "below 2^53"},
		{map[string]any{"port": 1, "bytes": 1e300}, "bytes", "below 2^53"},
		{map[string]any{"port": 1, "atMs": uint64(math.MaxUint64)}, "atMs", "between -2^53 and 2^53"},
		{map[string]any{"port": 1, "atMs": -(1 << 53)}, "atMs", "between -2^53 and 2^53"},
		{map[string]any{"port": "80"}, "port", "not a string"},
		{map[string]any{"port": 1, "names": []any{"a", nil}}, "names[1]", "must not be null"},
		{map[string]any{"port": 1, "names": []any{"a", 2}}, "names[1]", "must be a string, not a number"},
		{map[string]any{"port": 1, "labels": map[string]any{"k": nil}}, "labels.k", "must not be null"},
		{map[string]any{"port": 1, "other": 1}, "other", "not a known member"},
		{map[string]any{}, "port", "is required"},
		{nil, "", "must not be null"},
		{[]any{}, "", "must be an object, not an array"},
	}
	for _, tc := range refused {
		var v cfg
		err := wire.DecodeValue(tc.value, &v)
		var fe *wire.FieldError
		if !errors.As(err, &fe) || fe.Path != tc.path || !strings.Contains(fe.Problem, tc.problem) {
			t.Errorf("DecodeValue(%#v) = %v, want path %q and %q", tc.value, err, tc.path, tc.problem)
		}
	}
	if err := wire.DecodeValue(map[string]any{}, cfg{}); err == nil {
		t.Error("DecodeValue into a non-pointer accepted")
	}
}

// policy has a rule that spans members, like the idle policy.
type policy struct {
	PauseAfterMs *uint64 `json:"pauseAfterMs,omitempty"`
	StopAfterMs  *uint64 `json:"stopAfterMs,omitempty"`
}

func (p *policy) CheckWire() *wire.FieldError {
	switch {
	case p.PauseAfterMs == nil && p.StopAfterMs == nil:
		return &wire.FieldError{Problem: "must set at least one threshold"}
	case p.PauseAfterMs != nil && p.StopAfterMs != nil && *p.StopAfterMs < *p.PauseAfterMs:
		return &wire.FieldError{Path: "stopAfterMs", Problem: "must not be smaller than pauseAfterMs"}
	}
	return nil
}

// names checks its elements as a whole and names one by index.
type names []string

func (n names) CheckWire() *wire.FieldError {
	seen := map[string]bool{}
	for i, s := range n {
		if seen[s] {
			return &wire.FieldError{Path: "[" + strconv.Itoa(i) + "]", Problem: "repeats " + s}
		}
		seen[s] = true
	}
	return nil
}

func TestCheckerPathsAreRelative(t *testing.T) {
	type tmpl struct {
		Idle   *policy           `json:"idle,omitempty"`
		Ladder []policy          `json:"ladder,omitempty"`
		Names  names             `json:"names,omitempty"`
		ByName map[string]policy `json:"byName,omitempty"`
	}
	type catalog struct {
		Templates []tmpl `json:"templates"`
	}
	cases := []struct{ input, path, problem string }{
		{`{"templates":[{},{"idle":{}}]}`, "templates[1].idle", "at least one"},
		{`{"templates":[{"idle":{"pauseAfterMs":5,"stopAfterMs":4}}]}`, "templates[0].idle.stopAfterMs", "smaller"},
		{`{"templates":[{"ladder":[{"pauseAfterMs":1},{"pauseAfterMs":2,"stopAfterMs":1}]}]}`, "templates[0].ladder[1].stopAfterMs", "smaller"},
		{`{"templates":[{"names":["a","b","a"]}]}`, "templates[0].names[2]", "repeats a"},
		{`{"templates":[{"byName":{"x":{}}}]}`, "templates[0].byName.x", "at least one"},
	}
	for _, tc := range cases {
		fe := fieldError[catalog](t, tc.input)
		if fe.Path != tc.path || !strings.Contains(fe.Problem, tc.problem) {
			t.Errorf("Decode(%s) = %q (path %q), want path %q", tc.input, fe.Error(), fe.Path, tc.path)
		}
	}
	// At the top level the checker's own path is the whole path.
	if fe := fieldError[policy](t, `{}`); fe.Path != "" || fe.Error() != "must set at least one threshold" {
		t.Errorf("top level: %q", fe.Error())
	}
	if fe := fieldError[policy](t, `{"pauseAfterMs":2,"stopAfterMs":1}`); fe.Path != "stopAfterMs" {
		t.Errorf("top level member: %q", fe.Error())
	}
	// The checker runs only after its members decoded.
	if fe := fieldError[catalog](t, `{"templates":[{"idle":{"pauseAfterMs":-1}}]}`); fe.Path != "templates[0].idle.pauseAfterMs" || !strings.Contains(fe.Problem, "negative") {
		t.Errorf("member before checker: %v", fe)
	}
	got := decodes[catalog](t, `{"templates":[{"idle":{"stopAfterMs":9}}]}`)
	if got.Templates[0].Idle == nil || *got.Templates[0].Idle.StopAfterMs != 9 {
		t.Fatalf("got %+v", got)
	}
}

// valueChecker has a value receiver; it runs as well.
type valueChecker struct {
	N uint32 `json:"n"`
}

func (v valueChecker) CheckWire() *wire.FieldError {
	if v.N%2 == 1 {
		return &wire.FieldError{Path: "n", Problem: "must be even"}
	}
	return nil
}

func TestValueReceiverChecker(t *testing.T) {
	type outer struct {
		V  valueChecker   `json:"v"`
		VS []valueChecker `json:"vs,omitempty"`
		VP *valueChecker  `json:"vp,omitempty"`
	}
	for input, path := range map[string]string{
		`{"v":{"n":1}}`:                             "v.n",
		`{"v":{"n":2},"vs":[{"n":2},{"n":3}]}`:      "vs[1].n",
		`{"v":{"n":2},"vp":{"n":5}}`:                "vp.n",
		`{"v":{"n":2},"vs":[{"n":4}],"vp":{"n":7}}`: "vp.n",
	} {
		if fe := fieldError[outer](t, input); fe.Path != path {
			t.Errorf("Decode(%s) = %v, want path %s", input, fe, path)
		}
	}
	decodes[outer](t, `{"v":{"n":2},"vs":[{"n":4}],"vp":{"n":0}}`)
}

func TestEmbeddedStructsAreFlattened(t *testing.T) {
	type base struct {
		Name string `json:"name" wire:"info"`
		Kind string `json:"kind,omitempty"`
	}
	type withBase struct {
		base
		Kind string `json:"kind"` // shadows base.Kind, as in encoding/json
		Port uint16 `json:"port,omitempty"`
	}
	got := decodes[withBase](t, `{"name":"n","kind":"k","port":1}`)
	if got.Name != "n" || got.Kind != "k" || got.base.Kind != "" || got.Port != 1 {
		t.Fatalf("got %+v", got)
	}
	// What encoding/json writes, wire reads back.
	raw, _ := json.Marshal(got)
	if again := decodes[withBase](t, string(raw)); again != got {
		t.Fatalf("round trip %s → %+v", raw, again)
	}
	if fe := fieldError[withBase](t, `{"kind":"k"}`); fe.Path != "name" || fe.Problem != "is required" {
		t.Errorf("embedded required: %v", fe)
	}
	if fe := fieldError[withBase](t, `{"name":"","kind":"k"}`); fe.Path != "name" {
		t.Errorf("embedded grammar: %v", fe)
	}
	if fe := fieldError[withBase](t, `{"name":"n"}`); fe.Path != "kind" {
		t.Errorf("outer required member shadowing an optional one: %v", fe)
	}
	if fe := fieldError[withBase](t, `{"name":"n","kind":"k","base":{}}`); fe.Path != "base" {
		t.Errorf("embedded struct as a member: %v", fe)
	}
	// A tagged embedded struct is an ordinary member.
	type Base struct {
		Name string `json:"name"`
	}
	type tagged struct {
		Base `json:"base"`
	}
	if got := decodes[tagged](t, `{"base":{"name":"n"}}`); got.Name != "n" {
		t.Fatalf("tagged embedded: %+v", got)
	}
}

func TestGrammarTags(t *testing.T) {
	type tagged struct {
		ID      string    `json:"id,omitempty" wire:"lsid"`
		Target  string    `json:"targetId,omitempty" wire:"opaque"`
		Name    *string   `json:"name,omitempty" wire:"info"`
		Message string    `json:"message,omitempty" wire:"text"`
		URL     string    `json:"endpoint,omitempty" wire:"url"`
		Power   string    `json:"power,omitempty" wire:"enum=running|paused"`
		States  []string  `json:"powerStates,omitempty" wire:"enum=running|paused"`
		Ptrs    []*string `json:"ptrs,omitempty" wire:"opaque"`
	}
	decodes[tagged](t, `{"id":"u1","targetId":"ls-1","name":"n","message":"a\nb\tc","endpoint":"https://x","power":"paused","powerStates":["running","paused"],"ptrs":["a"]}`)
	cases := []struct{ input, path, problem string }{
		{`{"id":"_u"}`, "id", "must match"},
		{`{"targetId":""}`, "targetId", "1 to 255 bytes"},
		{`{"name":""}`, "name", "1 to 256 bytes"},
		{`{"name":"a\u0007"}`, "name", "control characters"},
		{`{"message":"a\rb"}`, "message", "control characters"},
		{`{"endpoint":""}`, "endpoint", "1 to 2048"},
		{`{"power":"running "}`, "power", "one of running, paused"},
		{`{"powerStates":["running","off"]}`, "powerStates[1]", "one of running, paused"},
		{`{"ptrs":["a",""]}`, "ptrs[1]", "1 to 255 bytes"},
	}
	for _, tc := range cases {
		fe := fieldError[tagged](t, tc.input)
		if fe.Path != tc.path || !strings.Contains(fe.Problem, tc.problem) {
			t.Errorf("Decode(%s) = %q, want path %q and %q", tc.input, fe.Error(), tc.path, tc.problem)
		}
	}
	// A grammar on a type that holds no string is a defect, named as one.
	type misuse struct {
		N uint32 `json:"n" wire:"opaque"`
	}
	if fe := fieldError[misuse](t, `{"n":1}`); fe.Path != "n" || !strings.Contains(fe.Problem, "defect") {
		t.Errorf("grammar on a number: %v", fe)
	}
	type unknownGrammar struct {
		S string `json:"s" wire:"nonsense"`
	}
	if fe := fieldError[unknownGrammar](t, `{"s":"x"}`); !strings.Contains(fe.Problem, "unknown grammar") {
		t.Errorf("unknown grammar: %v", fe)
	}
}

func TestFieldErrorText(t *testing.T) {
	if got := (&wire.FieldError{Path: "a[2].b", Problem: "is required"}).Error(); got != "a[2].b: is required" {
		t.Errorf("Error() = %q", got)
	}
	if got := (&wire.FieldError{Problem: "has data after the JSON value"}).Error(); got != "has data after the JSON value" {
		t.Errorf("Error() = %q", got)
	}
}

func TestDecodeLeavesAbsentMembersAlone(t *testing.T) {
	// Decode fills what is present; a caller reusing a value must start from zero.
	// This pins encoding/json's behaviour, which wire shares.
	type opt struct {
		A string `json:"a,omitempty"`
		B string `json:"b,omitempty"`
	}
	v := opt{B: "old"}
	if err := wire.Decode([]byte(`{"a":"new"}`), &v); err != nil || v.A != "new" || v.B != "old" {
		t.Fatalf("got %+v %v", v, err)
	}
}

// TestRepeatedNames: a name sent twice in one object is refused by name, at
// any depth and in any destination, where encoding/json keeps the last.
// Each case is decoded once as written and once with the repetition taken
// out, which must pass: the refusal is the repetition's alone.
func TestRepeatedNames(t *testing.T) {
	for _, c := range []struct{ repeated, once, path string }{
		{`{"name":"a","name":"b"}`, `{"name":"b"}`, "name"},
		{`{"name":"a","n\u0061me":"b"}`, `{"name":"b"}`, "name"},
		{`{"owner":{"universeId":"u","environmentId":"e","universeId":"v"}}`, `{"owner":{"universeId":"v","environmentId":"e"}}`, "owner.universeId"},
		{`{"items":[{"b":"x"},{"b":"x","b":"y"}]}`, `{"items":[{"b":"x"},{"b":"y"}]}`, "items[1].b"},
		{`{"counts":{"a":1,"a":2}}`, `{"counts":{"a":2}}`, "counts.a"},
		{`{"raw":{"x":[{"k":1,"k":2}]}}`, `{"raw":{"x":[{"k":2}]}}`, "raw.x[0].k"},
		{`{"raws":{"j":{"a":1,"a":1}}}`, `{"raws":{"j":{"a":1}}}`, "raws.j.a"},
		{`{"any":{"b":false,"b":true}}`, `{"any":{"b":true}}`, "any.b"},
	} {
		var v fuzzDoc
		if err := wire.Decode([]byte(c.once), &v); err != nil {
			t.Fatalf("%s: %v", c.once, err)
		}
		err := wire.Decode([]byte(c.repeated), &v)
		var fe *wire.FieldError
		if !errors.As(err, &fe) || fe.Path != c.path || fe.Problem != "is sent more than once" {
			t.Errorf("%s: got %v, want %s refused as sent more than once", c.repeated, err, c.path)
		}
	}
}

// TestStringsAreUnicode: invalid UTF-8 and a lone surrogate escape are
// refused, where encoding/json makes U+FFFD of them; a surrogate pair is
// one character.
func TestStringsAreUnicode(t *testing.T) {
	for _, c := range []struct {
		doc  string
		want string // the message decoded, or "" for a refusal
	}{
		{`{"message":"a\ud83d\ude00b"}`, "a\U0001F600b"},
		{`{"message":"\uFFFD"}`, "\uFFFD"},
		{`{"message":"\\ud800"}`, `\ud800`},
		{`{"message":"a\ud800b"}`, ""},
		{`{"message":"a\udc00b"}`, ""},
		{`{"message":"\ud800\ud800"}`, ""},
		{`{"message":"\ud800\u0041"}`, ""},
		{`{"message":"\ude00\ud83d"}`, ""},
		{`{"message":"\ud83d"}`, ""},
		{"{\"message\":\"a\xffb\"}", ""},
		{"{\"message\":\"\xed\xa0\x80\"}", ""}, // a surrogate, encoded in UTF-8
		{"{\"m\xc3\":1}", ""},
	} {
		var v fuzzDoc
		err := wire.Decode([]byte(c.doc), &v)
		switch {
		case c.want == "" && err == nil:
			t.Errorf("%q: accepted as %q, want a refusal", c.doc, v.Message)
		case c.want != "" && (err != nil || v.Message != c.want):
			t.Errorf("%q: got %q, %v; want %q", c.doc, v.Message, err, c.want)
		case c.want == "" && !strings.Contains(err.Error(), "is not valid JSON"):
			t.Errorf("%q: refused as %v, want not valid JSON", c.doc, err)
		}
	}
}
