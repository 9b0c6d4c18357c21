package conformance

import (
	"strings"
	"testing"
)

func TestParseFrame(t *testing.T) {
	good := []struct{ frame, id string }{
		{`{"jsonrpc":"2.0","id":7,"result":{}}`, "7"},
		{`{"jsonrpc":"2.0","id":"probe-1","result":{"a":1}}`, `"probe-1"`},
		{`{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"no","data":{"kind":"parseError"}}}`, "null"},
	}
	for _, g := range good {
		f, problem := parseFrame([]byte(g.frame))
		if problem != "" {
			t.Errorf("parseFrame(%s): %s", g.frame, problem)
			continue
		}
		if f.id != g.id {
			t.Errorf("parseFrame(%s).id = %s, want %s", g.frame, f.id, g.id)
		}
	}
	bad := map[string]string{
		`{"jsonrpc":"2.0","id":1,"method":"x"}`:                         "names a method",
		`{"jsonrpc":"2.0","id":1,"result":{},"extra":1}`:                "unknown envelope member",
		`{"jsonrpc":"1.0","id":1,"result":{}}`:                          `not "2.0"`,
		`{"jsonrpc":"2.0","result":{}}`:                                 "no id",
		`{"jsonrpc":"2.0","id":1.5,"result":{}}`:                        "not an integer",
		`{"jsonrpc":"2.0","id":1}`:                                      "exactly one",
		`{"jsonrpc":"2.0","id":1,"result":{},"error":{}}`:               "exactly one",
		`{"jsonrpc":"2.0","id":1,"result":null}`:                        "result is null",
		`{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"data":{}}}`:    "data.kind",
		`[{"jsonrpc":"2.0","id":1,"result":{}}]`:                        "not one JSON object",
		`{"jsonrpc":"2.0","id":1,"result":{}} {"jsonrpc":"2.0","id":2}`: "not one JSON object",
	}
	for frame, want := range bad {
		if _, problem := parseFrame([]byte(frame)); !strings.Contains(problem, want) {
			t.Errorf("parseFrame(%s) = %q, want a problem saying %q", frame, problem, want)
		}
	}
}

func TestErrorProblem(t *testing.T) {
	ok := []string{
		`{"code":-32004,"message":"unknown process id: p1","data":{"kind":"notFound","reason":"expired"}}`,
		`{"code":-32602,"message":"bad","data":{"kind":"invalidParams","field":"target.owner.extra"}}`,
		`{"code":-32005,"message":"v","data":{"kind":"versionMismatch","expected":4,"received":3}}`,
		`{"code":-32006,"message":"c","data":{"kind":"capabilityUnavailable","capability":"power"}}`,
		`{"code":-32007,"message":"p","data":{"kind":"failedPrecondition","reason":"ownerMismatch"}}`,
		`{"code":-32600,"message":"` + strings.Repeat("x", 4096) + `","data":{"kind":"invalidRequest"}}`,
	}
	for _, raw := range ok {
		if p := errorProblem([]byte(raw)); p != "" {
			t.Errorf("errorProblem(%s) = %q, want none", clip(raw, 100), p)
		}
	}
	bad := map[string]string{
		`{"code":-32603,"message":"m","data":{"kind":"notFound"}}`:                                       "code",
		`{"code":-32004,"message":"m","data":{"kind":"gone"}}`:                                           "unknown kind",
		`{"code":-32004,"message":"m"}`:                                                                  "data",
		`{"code":-32004,"message":"m","data":{"kind":"notFound","extra":1}}`:                             "extra",
		`{"code":-32004,"message":"m","data":{"kind":"notFound"},"extra":1}`:                             "extra",
		`{"code":-32007,"message":"m","data":{"kind":"failedPrecondition"}}`:                             "reason",
		`{"code":-32005,"message":"m","data":{"kind":"versionMismatch","expected":4}}`:                   "received",
		`{"code":-32006,"message":"m","data":{"kind":"capabilityUnavailable"}}`:                          "capability",
		`{"code":-32600,"message":"` + strings.Repeat("x", 4097) + `","data":{"kind":"invalidRequest"}}`: "4096",
	}
	for raw, want := range bad {
		if p := errorProblem([]byte(raw)); !strings.Contains(p, want) {
			t.Errorf("errorProblem(%s) = %q, want a problem mentioning %q", clip(raw, 100), p, want)
		}
	}
}

func TestLooseErrorKeepsTheKindOfAMalformedError(t *testing.T) {
	e := looseError([]byte(`{"code":-32603,"message":"m","data":{"kind":"notFound"}}`))
	if e == nil || e.Kind != "notFound" {
		t.Fatalf("looseError = %+v, want kind notFound", e)
	}
}
