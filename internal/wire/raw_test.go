package wire_test

import (
	"bytes"
	"errors"
	"reflect"
	"runtime"
	"strconv"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// agree decodes data both ways and fails unless they give the same value or
// the same refusal, word for word.
func agree(t *testing.T, data []byte) {
	t.Helper()
	var raw, generic fuzzDoc
	errRaw := wire.Decode(data, &raw)
	errGeneric := wire.DecodeGeneric(data, &generic)
	var deep *wire.FieldError
	if errors.As(errGeneric, &deep) && deep.Problem == "is nested too deep" {
		return // the limit's own wording is Decode's; nesting_test.go holds it
	}
	var repeated *wire.FieldError
	if errors.As(errRaw, &repeated) && repeated.Problem == "is sent more than once" {
		// The generic form keeps the last of a repeated name: it cannot
		// see the repetition. That the text repeats a name is checked
		// where the generic path is not the oracle (TestRepeatedNames).
		return
	}
	switch {
	case (errRaw == nil) != (errGeneric == nil):
		t.Fatalf("%q: from the text %v, generic %v", data, errRaw, errGeneric)
	case errRaw != nil:
		if errRaw.Error() != errGeneric.Error() {
			t.Fatalf("%q: refused differently:\n from the text: %v\n generic:       %v", data, errRaw, errGeneric)
		}
	case !reflect.DeepEqual(raw, generic):
		t.Fatalf("%q: decoded differently:\n from the text: %#v\n generic:       %#v", data, raw, generic)
	}
}

func TestDecodeFromTextAgreesWithGeneric(t *testing.T) {
	for _, data := range []string{
		`{}`, ` { } `, `[]`, `null`, `1`, `"s"`, `true`,
		`{"owner":{"universeId":"u1","environmentId":"env_1"},"items":[{"b":"x","n":4294967295}]}`,
		`{"owner":{"universeId":"u1","environmentId":"env_1","zz":1,"aa":2}}`,
		`{"zz":1,"owner":null,"aa":2}`,
		`{"owner":null}`, `{"owner":[]}`, `{"owner":"x"}`, `{"owner":{}}`,
		`{"items":[{"b":"x"},{"b":1}]}`, `{"items":[null]}`, `{"items":{}}`, `{"items":[]}`,
		`{"counts":{"b":1,"a":"x"}}`, `{"counts":{"a":1,"a":2}}`, `{"counts":{"a":null}}`, `{"counts":[]}`,
		`{"bytes":9007199254740992}`, `{"bytes":-1}`, `{"bytes":1.5}`, `{"bytes":"1"}`, `{"bytes":true}`, `{"bytes":{}}`,
		`{"atMs":-9007199254740992}`, `{"small":128}`, `{"small":-128}`, `{"ratio":"x"}`, `{"ratio":1e400}`,
		`{"flag":1}`, `{"flag":false}`, `{"message":""}`, `{"message":"\u0000"}`, `{"message":"a\u00e9\ud83d\ude00"}`,
		"{\"message\":\"\xff\xfe\"}", "{\"\xff\":1}", `{"\u006eame":"n"}`, `{"n\u0061me":"x","name":"y"}`,
		`{"states":["running","stopped"]}`, `{"states":[1]}`,
		`{"idle":{"pauseAfterMs":5,"stopAfterMs":4}}`, `{"idle":{"pauseAfterMs":null}}`,
		`{"raw":{"z":[1,2.5,"s"],"a":12345678901234567890,"b":"<&>"}}`, `{"raw":null}`, `{"raw": [ 1 , 2 ] }`,
		`{"raws":{"k":"v","j":null}}`, `{"any":[1,"a",{"b":false}]}`, `{"any":{"x":null}}`, `{"any":null}`,
		`{"name":"n","name":"m"}`, `{"name":""}`, `{"owner":{"universeId":"u1","environmentId":"env_1"},"owner":1}`,
	} {
		agree(t, []byte(data))
	}
}

func FuzzDecodeFromTextAgreesWithGeneric(f *testing.F) {
	for _, seed := range []string{
		`{"owner":{"universeId":"u1","environmentId":"env_1"},"items":[{"b":"x","n":4294967295}]}`,
		`{"counts":{"a":1,"b":2},"bytes":9007199254740991,"atMs":-9007199254740991,"small":-128}`,
		`{"raw":{"deep":[1,2,{"x":null}]},"raws":{"k":"v"},"any":[1,"a",{"b":false}]}`,
		`{"zz":1,"owner":null,"aa":2}`, `{"\u006eame":"n"}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) { agree(t, data) })
}

// TestDecodeDoesNotMaterialiseUnknownMembers is issue 12's frame: a params
// object of 1.3 million members, 15 MiB. It is refused for its first
// unknown member in byte order, having built none of them: the generic path
// took 221 MiB of heap to say the same.
func TestDecodeDoesNotMaterialiseUnknownMembers(t *testing.T) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i := range 1_300_000 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"a` + strconv.Itoa(1_300_000-i) + `":0`)
	}
	b.WriteString(`,"owner":{"universeId":"u1","environmentId":"env_1"}}`)
	data := b.Bytes()
	for _, shape := range []struct {
		name string
		data []byte
		path string
	}{
		{"at the top", data, "a1"},
		{"one level down", append(append([]byte(`{"owner":`), data...), '}'), "owner.a1"},
	} {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		var v fuzzDoc
		err := wire.Decode(shape.data, &v)
		runtime.ReadMemStats(&after)
		var fe *wire.FieldError
		if !errors.As(err, &fe) || fe.Path != shape.path || fe.Problem != "is not a known member" {
			t.Fatalf("%s: got %v, want %s refused as not a known member", shape.name, err, shape.path)
		}
		allocated := after.TotalAlloc - before.TotalAlloc
		t.Logf("%s: %d bytes of text refused with %d KiB allocated", shape.name, len(shape.data), allocated>>10)
		if allocated > 1<<20 {
			t.Fatalf("%s: %d bytes allocated to refuse it; want at most 1 MiB", shape.name, allocated)
		}
	}
}
