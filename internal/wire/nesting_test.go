package wire_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// nested is an array nesting depth levels deep around a 1.
func nested(depth int) string {
	return strings.Repeat("[", depth) + "1" + strings.Repeat("]", depth)
}

func TestNesting(t *testing.T) {
	for _, c := range []struct {
		doc   string
		depth int
	}{
		{`1`, 0}, {` "s" `, 0}, {`null`, 0}, {`-0.5e+3`, 0},
		{`{}`, 1}, {`[]`, 1}, {`{"a":1}`, 1}, {`[[]]`, 2}, {`{"a":[1,{"b":{}}]}`, 4},
		{`[{"a":"]}"},[]]`, 2},
		// Past encoding/json's 10,000 levels: still JSON, and measured.
		{nested(10001), 10001},
		{strings.Repeat(`{"a":`, 70000) + `1` + strings.Repeat(`}`, 70000), 70000},
	} {
		got, err := wire.Nesting([]byte(c.doc))
		if err != nil || got != c.depth {
			t.Errorf("Nesting(%.40q) = %d, %v; want %d", c.doc, got, err, c.depth)
		}
	}
	for _, doc := range []string{
		``, ` `, `[`, `]`, `[1,]`, `{"a":1,}`, `{"a"}`, `{1:2}`, `[1 2]`, `{"a":1 "b":2}`, `01x`, `-`, `1.`, `1e`,
		`"\x"`, `"\u12g4"`, "\"a\x01\"", `"open`, `tru`, `nul`, `[}`, `{]`, `{"a":[}`,
		nested(10001)[1:], // one ']' too many
	} {
		if _, err := wire.Nesting([]byte(doc)); err == nil || json.Valid([]byte(doc)) {
			t.Errorf("Nesting(%.40q): want an error (json.Valid %v), got %v", doc, json.Valid([]byte(doc)), err)
		}
	}
	var trailing *wire.TrailingDataError
	if _, err := wire.Nesting([]byte(`{} {}`)); !errors.As(err, &trailing) || trailing.Offset != 3 {
		t.Errorf("Nesting of two values: %v, want trailing data at byte 3", err)
	}
}

// Depth is judged as a refusal of its own, never as "not valid JSON", and
// counted from the value Decode is given.
func TestDecodeRefusesDeepValuesByName(t *testing.T) {
	var v any
	if err := wire.Decode([]byte(nested(wire.MaxDepth)), &v); err != nil {
		t.Fatalf("at the limit: %v", err)
	}
	for _, depth := range []int{wire.MaxDepth + 1, 10000, 10001, 100000} {
		err := wire.Decode([]byte(nested(depth)), &v)
		var fe *wire.FieldError
		if !errors.As(err, &fe) || fe.Path != "" || strings.Contains(fe.Problem, "not valid JSON") ||
			!strings.Contains(fe.Problem, "64") || !strings.Contains(fe.Problem, "nested") {
			t.Errorf("depth %d: %v; want a refusal naming the depth and the limit", depth, err)
		}
	}
	if err := wire.Decode([]byte(nested(12)+" x"), &v); err == nil || !strings.Contains(err.Error(), "data after the JSON value") {
		t.Errorf("trailing data: %v", err)
	}
}

// An envelope gets the one level its payload sits below it.
func TestDecodeEnvelopeAllowsItsPayloadsLevel(t *testing.T) {
	type envelope struct {
		Result json.RawMessage `json:"result"`
	}
	frame := `{"result":` + nested(wire.MaxDepth) + `}`
	var env envelope
	if err := wire.Decode([]byte(frame), &env); err == nil {
		t.Fatal("Decode counts the envelope's level against the payload's limit; want it refused")
	}
	if err := wire.DecodeEnvelope([]byte(frame), &env); err != nil {
		t.Fatalf("DecodeEnvelope of a payload at the limit: %v", err)
	}
	var v any
	if err := wire.Decode(env.Result, &v); err != nil {
		t.Fatalf("the payload itself: %v", err)
	}
	if err := wire.DecodeEnvelope([]byte(`{"result":`+nested(wire.MaxDepth+1)+`}`), &env); err == nil {
		t.Fatal("DecodeEnvelope of a payload past the limit: want a refusal")
	}
}

func TestSplit(t *testing.T) {
	members, isObject, err := wire.Split([]byte(` {"id":7, "p":` + nested(20000) + ` ,"a\u0062":{"x":[]},"id":"again"} `))
	if err != nil || !isObject {
		t.Fatalf("Split: %v %v", isObject, err)
	}
	want := []struct {
		name, value string
		depth       int
	}{{"id", `7`, 0}, {"p", nested(20000), 20000}, {"ab", `{"x":[]}`, 2}, {"id", `"again"`, 0}}
	if len(members) != len(want) {
		t.Fatalf("members: %d, want %d", len(members), len(want))
	}
	for i, w := range want {
		m := members[i]
		if m.Name != w.name || string(m.Value) != w.value || m.Depth != w.depth {
			t.Errorf("member %d: %q %.30s depth %d; want %q %.30s depth %d", i, m.Name, m.Value, m.Depth, w.name, w.value, w.depth)
		}
	}
	for _, doc := range []string{`[{"a":1}]`, `"s"`, `{}`} {
		members, isObject, err := wire.Split([]byte(doc))
		if err != nil || len(members) != 0 || isObject != (doc == `{}`) {
			t.Errorf("Split(%s) = %v %v %v", doc, members, isObject, err)
		}
	}
	if _, _, err := wire.Split([]byte(`{"a":1`)); err == nil {
		t.Error("Split of a cut object: want an error")
	}
}

func TestSplitNamed(t *testing.T) {
	members, unknown, isObject, err := wire.SplitNamed([]byte(` {"id":7, "zz":1, "p":`+nested(30)+` ,"a\u0062":{"x":[]},"\u0069d":"again"} `), "id", "p")
	if err != nil || !isObject || unknown == nil || *unknown != "zz" {
		t.Fatalf("SplitNamed: %v %v %v", isObject, unknown, err)
	}
	if len(members) != 2 || members[0].Name != "id" || string(members[0].Value) != `"again"` || members[1].Name != "p" || members[1].Depth != 30 {
		t.Fatalf("SplitNamed: members %+v; want id as last sent, then p", members)
	}
	for _, doc := range []string{`[{"a":1}]`, `"s"`, `{}`} {
		members, unknown, isObject, err := wire.SplitNamed([]byte(doc), "a")
		if err != nil || len(members) != 0 || unknown != nil || isObject != (doc == `{}`) {
			t.Errorf("SplitNamed(%s) = %v %v %v %v", doc, members, unknown, isObject, err)
		}
	}
	if _, _, _, err := wire.SplitNamed([]byte(`{"a":1`), "a"); err == nil {
		t.Error("SplitNamed of a cut object: want an error")
	}
}

// An envelope of 1.3 million members (15 MiB) costs SplitNamed nothing but
// the names it keeps; Split would hold every member.
func TestSplitNamedAllocatesOnlyWhatItKeeps(t *testing.T) {
	var b bytes.Buffer
	b.WriteString(`{"id":1,"method":"m"`)
	for i := range 1_300_000 {
		b.WriteString(`,"a` + strconv.Itoa(i) + `":0`)
	}
	b.WriteString(`,"id":2,"params":{}}`)
	allocated := testing.AllocsPerRun(1, func() {
		members, unknown, _, err := wire.SplitNamed(b.Bytes(), "jsonrpc", "id", "method", "params")
		if err != nil || unknown == nil || *unknown != "a0" || len(members) != 3 || string(members[0].Value) != "2" {
			t.Fatalf("SplitNamed: %v %v %v", members, unknown, err)
		}
	})
	if allocated > 10 {
		t.Fatalf("SplitNamed made %.0f allocations for an envelope of 1.3 million members; want a handful", allocated)
	}
}

// Nesting agrees with encoding/json on what is JSON (within the 10,000
// levels encoding/json reads), and on the depth.
func FuzzNesting(f *testing.F) {
	for _, seed := range []string{`{"a":[1,{"b":"\u00e9\n"}],"c":-1.5e-3}`, `[[[]]]`, `{"a":}`, `"\xff"`, `[1,]`, `0`, ` `, `{} x`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		depth, err := wire.Nesting(data)
		if valid := json.Valid(data) && strictUnicode(data); valid != (err == nil) {
			t.Fatalf("Nesting(%q) = %v; json.Valid and strictUnicode say %v", data, err, valid)
		}
		if err != nil {
			return
		}
		var v any
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber() // 1e400 is JSON, though no float64
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
		if want := tokenDepth(t, data); depth != want {
			t.Fatalf("Nesting(%q) = %d, want %d", data, depth, want)
		}
		members, isObject, err := wire.Split(data)
		obj, wantObject := v.(map[string]any)
		if err != nil || isObject != wantObject {
			t.Fatalf("Split(%q): %v %v", data, isObject, err)
		}
		named, unknown, namedObject, err := wire.SplitNamed(data, "a", "b")
		if err != nil || namedObject != isObject {
			t.Fatalf("SplitNamed(%q): %v %v", data, namedObject, err)
		}
		// SplitNamed keeps, of Split's members, the last of each name it
		// was given, and names the first other one.
		last := map[string]wire.Member{}
		var firstOther *string
		counts := map[string]int{}
		for _, m := range members {
			counts[m.Name]++
			if m.Name == "a" || m.Name == "b" {
				last[m.Name] = m
			} else if firstOther == nil {
				firstOther = &m.Name
			}
		}
		for _, m := range named {
			if want := counts[m.Name] > 1; m.Repeated != want {
				t.Fatalf("SplitNamed(%q): %q marked repeated %v, sent %d times", data, m.Name, m.Repeated, counts[m.Name])
			}
		}
		if len(named) != len(last) || (unknown == nil) != (firstOther == nil) || unknown != nil && *unknown != *firstOther {
			t.Fatalf("SplitNamed(%q) = %v, %v; Split's members give %v, %v", data, named, unknown, last, firstOther)
		}
		for _, m := range named {
			if w := last[m.Name]; string(w.Value) != string(m.Value) || w.Depth != m.Depth {
				t.Fatalf("SplitNamed(%q): %q is %q, want %q", data, m.Name, m.Value, w.Value)
			}
		}
		for _, m := range members {
			if !json.Valid(m.Value) {
				t.Fatalf("member %q of %q: value %q is not JSON", m.Name, data, m.Value)
			}
			if _, ok := obj[m.Name]; !ok || tokenDepth(t, m.Value) != m.Depth {
				t.Fatalf("member %q of %q: depth %d of %q", m.Name, data, m.Depth, m.Value)
			}
		}
	})
}

var (
	surrogatePair = regexp.MustCompile(`\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}`)
	surrogate     = regexp.MustCompile(`\\u[dD][89a-fA-F][0-9a-fA-F]{2}`)
)

// strictUnicode is an oracle, written another way than the scanner, for
// text whose strings are Unicode: valid UTF-8, and every \u escape of a
// UTF-16 surrogate half of a pair. Escaped backslashes are blanked first,
// so that what is left of a backslash and a u is an escape.
func strictUnicode(data []byte) bool {
	if !utf8.Valid(data) {
		return false
	}
	s := strings.ReplaceAll(string(data), `\\`, "__")
	s = surrogatePair.ReplaceAllString(s, "")
	return !surrogate.MatchString(s)
}

// tokenDepth is the depth encoding/json's tokenizer sees; unlike a decoded
// value, it keeps every member of an object with a repeated name.
func tokenDepth(t *testing.T, data []byte) int {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	depth, most := 0, 0
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return most
		}
		if err != nil {
			t.Fatalf("tokens of %q: %v", data, err)
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
			most = max(most, depth)
		case json.Delim('}'), json.Delim(']'):
			depth--
		}
	}
}
