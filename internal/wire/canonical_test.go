package wire

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

// slowCanonical is the canonical form built the long way: the generic
// decode and json.Marshal, as a json.RawMessage destination had it before.
func slowCanonical(t *testing.T, raw []byte) []byte {
	t.Helper()
	generic, fe := genericOf("", raw)
	if fe != nil && fe.Problem == "is sent more than once" {
		return nil // refused, so there is no canonical form
	}
	if fe != nil {
		t.Fatalf("%q: %v", raw, fe)
	}
	out, err := json.Marshal(generic)
	if err != nil {
		t.Fatalf("%q: %v", raw, err)
	}
	return out
}

// checkCanonical holds canonical to the slow path: whatever it keeps as
// sent is what the slow path builds, and what the slow path builds it
// keeps, unless the text holds what canonical leaves to the slow path.
func checkCanonical(t *testing.T, raw []byte) {
	t.Helper()
	if _, err := Nesting(raw); err != nil {
		return
	}
	raw = trimSpace(raw)
	slow := slowCanonical(t, raw)
	if slow == nil {
		if canonical(raw) {
			t.Fatalf("canonical kept %q, which names a member twice", raw)
		}
		return
	}
	if canonical(raw) && !bytes.Equal(slow, raw) {
		t.Fatalf("canonical kept %q, but its canonical form is %q", raw, slow)
	}
	if !canonical(slow) && !bytes.ContainsAny(slow, `\<>&`) && !bytes.Contains(slow, []byte("\u2028")) && !bytes.Contains(slow, []byte("\u2029")) {
		t.Fatalf("canonical refused %q, which is its own canonical form", slow)
	}
}

func TestCanonicalAgreesWithTheSlowPath(t *testing.T) {
	for _, s := range []string{
		`{}`, `[]`, `""`, `null`, `true`, `false`, `0`, `-0`, `1e400`, `12345678901234567890`, `1.50`, `1E+2`,
		`{"a":1,"b":2}`, `{"b":1,"a":2}`, `{"a":1,"a":2}`, `{"a":{"b":[1,{"c":null}]},"b":"x"}`,
		`{ "a":1}`, `[1, 2]`, `{"a" :1}`, `"a\nb"`, `"\u00e9"`, `"é"`, `"<b>"`, `"a&b"`, "\"\u2028\"", "\"\xff\"",
		`{"":1,"a":2}`, `{"a":1,"":2}`, `{"ab":1,"a":2}`, `{"a":1,"ab":2}`, `["a","a"]`, `{"é":1,"z":2}`, `{"z":1,"é":2}`,
		`{"idleForMs":1200,"sessionCount":0,"streamCount":2}`,
	} {
		checkCanonical(t, []byte(s))
	}
	for _, c := range []struct {
		raw  string
		want bool
	}{
		{`{"a":1,"b":[true,null,"x"]}`, true},
		{`{"idleForMs":1200,"sessionCount":0}`, true},
		{`{"b":1,"a":2}`, false},
		{`{"a":1,"a":1}`, false},
		{`{"a": 1}`, false},
		{`"a\"b"`, false},
	} {
		if got := canonical([]byte(c.raw)); got != c.want {
			t.Errorf("canonical(%s) = %v, want %v", c.raw, got, c.want)
		}
	}
}

// Random values of the shapes a JSON-RPC answer carries, built and
// printed in many ways.
func TestCanonicalOnRandomValues(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	for range 20000 {
		checkCanonical(t, []byte(randomJSON(r, 0)))
	}
}

func randomJSON(r *rand.Rand, depth int) string {
	pick := r.IntN(9)
	if depth > 3 {
		pick = r.IntN(5)
	}
	sp := func() string { return [...]string{"", "", "", " ", "\n"}[r.IntN(5)] }
	switch pick {
	case 0:
		return [...]string{"null", "true", "false"}[r.IntN(3)]
	case 1:
		return [...]string{"0", "-0", "17", "-3.25", "1e9", "1E-7", "12345678901234567890123", "0.10"}[r.IntN(8)]
	case 2, 3:
		return randomString(r)
	case 4:
		return strconv.Itoa(r.IntN(1 << 20))
	case 5, 6:
		n := r.IntN(5)
		var b strings.Builder
		b.WriteString("{" + sp())
		for i := range n {
			if i > 0 {
				b.WriteString("," + sp())
			}
			b.WriteString(randomString(r) + sp() + ":" + sp() + randomJSON(r, depth+1))
		}
		b.WriteString(sp() + "}")
		return b.String()
	default:
		n := r.IntN(5)
		var b strings.Builder
		b.WriteString("[" + sp())
		for i := range n {
			if i > 0 {
				b.WriteString("," + sp())
			}
			b.WriteString(randomJSON(r, depth+1))
		}
		b.WriteString(sp() + "]")
		return b.String()
	}
}

func randomString(r *rand.Rand) string {
	parts := []string{"a", "b", "ab", "z", "idleForMs", "Count", "é", "<", "&", `\"`, `\n`, `\u0041`, `\u00e9`, "\u2028", "\x7f", "日本", `\/`}
	var b strings.Builder
	b.WriteByte('"')
	for range r.IntN(4) {
		b.WriteString(parts[r.IntN(len(parts))])
	}
	b.WriteByte('"')
	return b.String()
}

func FuzzCanonical(f *testing.F) {
	for _, s := range []string{`{"a":1,"b":[true,null]}`, `{"b":1,"a":2}`, `"<"`, `"\u00e9"`, `[1, 2]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) { checkCanonical(t, data) })
}
