package wire_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// fuzzDoc exercises every path of the decoder: nested structs, pointers,
// slices, maps, raw messages, interfaces, grammars, every integer width, a
// checker, and an embedded struct.
type fuzzDoc struct {
	fuzzEmbedded
	Owner   *owner                     `json:"owner,omitempty"`
	Items   []entry                    `json:"items,omitempty"`
	Counts  map[string]uint32          `json:"counts,omitempty"`
	Bytes   uint64                     `json:"bytes,omitempty"`
	AtMs    int64                      `json:"atMs,omitempty"`
	Small   int8                       `json:"small,omitempty"`
	Ratio   float64                    `json:"ratio,omitempty"`
	Flag    bool                       `json:"flag,omitempty"`
	Message string                     `json:"message,omitempty" wire:"text"`
	States  []string                   `json:"states,omitempty" wire:"enum=running|paused"`
	Idle    *policy                    `json:"idle,omitempty"`
	Raw     json.RawMessage            `json:"raw,omitempty"`
	Raws    map[string]json.RawMessage `json:"raws,omitempty"`
	Any     any                        `json:"any,omitempty"`
}

type fuzzEmbedded struct {
	Name string `json:"name,omitempty" wire:"info"`
}

func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		`{}`,
		`{"owner":{"universeId":"u1","environmentId":"env_1"},"items":[{"b":"x","n":4294967295}]}`,
		`{"counts":{"a":1,"b":2},"bytes":9007199254740991,"atMs":-9007199254740991,"small":-128}`,
		`{"bytes":9007199254740992}`,
		`{"ratio":1e308,"flag":true,"message":"a\nb\tc","states":["running","paused"]}`,
		`{"idle":{"pauseAfterMs":5,"stopAfterMs":4}}`,
		`{"raw":{"deep":[1,2,{"x":null}]},"raws":{"k":"v"},"any":[1,"a",{"b":false}]}`,
		`{"name":"n","any":{"x":null}}`,
		`{"any":1e400}`,
		`{"any":[1.0,-0,1e-400,12345678901234567890]}`,
		`{"raw":{"a":1,"a":[2]},"raws":{"k":"<\u00e9>"}}`,
		`{"items":[null]}`,
		`{"owner":{"universeId":"u","environmentId":"e","extra":1}}`,
		`{} {}`,
		`{"bytes":1.0}`,
		`{"bytes":-0}`,
		`{"message":"\u0000"}`,
		`[1,2,3]`,
		`"str"`,
		`null`,
		``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var v fuzzDoc
		err := wire.Decode(data, &v)
		if err != nil {
			var fe *wire.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("refusal is %T, not a *wire.FieldError: %v", err, err)
			}
			if fe.Problem == "" {
				t.Fatalf("refusal without a problem: %+v", fe)
			}
			return
		}
		// Accepted: it was one valid JSON value, without a null anywhere
		// outside a raw message.
		if !json.Valid(data) {
			t.Fatalf("accepted invalid JSON %q", data)
		}
		var generic any
		dec := json.NewDecoder(strings.NewReader(string(data)))
		dec.UseNumber()
		if err := dec.Decode(&generic); err != nil {
			t.Fatal(err)
		}
		if path, found := nullOutsideRaw(generic, ""); found {
			t.Fatalf("accepted a null at %q in %q", path, data)
		}
		// encoding/json accepts it too, and decodes the same value (with
		// UseNumber, as wire keeps numbers in an interface; compared as JSON
		// values, since wire re-encodes a raw message).
		var std fuzzDoc
		if err := json.Unmarshal(data, &std); err != nil {
			t.Fatalf("encoding/json refuses what wire accepted (%q): %v", data, err)
		}
		std = fuzzDoc{}
		dec = json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		if err := dec.Decode(&std); err != nil {
			t.Fatal(err)
		}
		if w, s := jsonValue(t, v), jsonValue(t, std); !reflect.DeepEqual(w, s) {
			t.Fatalf("wire and encoding/json decode %q differently:\n%#v\n%#v", data, w, s)
		}
		// What we accepted, re-encoded, decodes to the same value.
		again, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		var w fuzzDoc
		if err := wire.Decode(again, &w); err != nil {
			t.Fatalf("re-encoded %s does not decode: %v", again, err)
		}
		// (Compared encoded: an empty list and an absent one are the same on the wire.)
		if twice, _ := json.Marshal(w); string(twice) != string(again) {
			t.Fatalf("round trip changed the value:\n%s\n%s", again, twice)
		}
	})
}

// jsonValue is v encoded and read back as a generic JSON value.
func jsonValue(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("encode %#v: %v", v, err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var generic any
	if err := dec.Decode(&generic); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return generic
}

// nullOutsideRaw looks for a null that wire should have refused: anywhere
// except inside "raw" and "raws", which it keeps as they are.
func nullOutsideRaw(v any, path string) (string, bool) {
	switch x := v.(type) {
	case nil:
		return path, true
	case map[string]any:
		for k, item := range x {
			if path == "" && (k == "raw" || k == "raws") {
				continue
			}
			if p, found := nullOutsideRaw(item, path+"."+k); found {
				return p, true
			}
		}
	case []any:
		for _, item := range x {
			if p, found := nullOutsideRaw(item, path+"[]"); found {
				return p, true
			}
		}
	}
	return "", false
}
