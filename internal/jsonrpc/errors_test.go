package jsonrpc_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// The spec's table of kinds and codes, copied by hand.
var specCodes = map[jsonrpc.Kind]int{
	"parseError": -32700, "invalidRequest": -32600, "methodNotFound": -32601, "invalidParams": -32602,
	"internal": -32603, "notInitialized": -32002, "permissionDenied": -32003, "notFound": -32004,
	"versionMismatch": -32005, "capabilityUnavailable": -32006, "failedPrecondition": -32007,
	"busy": -32008, "alreadyExists": -32009, "payloadTooLarge": -32013, "deadlineExceeded": -32015,
	"expired": -32016, "aborted": -32017, "processFailed": -32018, "unavailable": -32019,
}

func TestKindsAndCodesMatchTheSpec(t *testing.T) {
	kinds := jsonrpc.Kinds()
	if len(kinds) != len(specCodes) {
		t.Fatalf("%d kinds, the spec has %d", len(kinds), len(specCodes))
	}
	for _, k := range kinds {
		want, ok := specCodes[k]
		if !ok {
			t.Errorf("kind %q is not in the spec", k)
		}
		if k.Code() != want {
			t.Errorf("%s has code %d, the spec says %d", k, k.Code(), want)
		}
	}
	if got := jsonrpc.Kind("bogus").Code(); got != -32603 {
		t.Errorf("an unknown kind's code is %d", got)
	}
}

func TestErrorConstructorsOnTheWire(t *testing.T) {
	cases := []struct {
		err  *jsonrpc.Error
		want string
	}{
		{jsonrpc.Errorf(jsonrpc.KindNotInitialized, "call %s first", "initialize"),
			`{"code":-32002,"message":"call initialize first","data":{"kind":"notInitialized"}}`},
		{jsonrpc.InvalidParams("jobs[0].dependsOn", "bad %d", 1),
			`{"code":-32602,"message":"bad 1","data":{"kind":"invalidParams","field":"jobs[0].dependsOn"}}`},
		{jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "ownerMismatch", "not yours"),
			`{"code":-32007,"message":"not yours","data":{"kind":"failedPrecondition","reason":"ownerMismatch"}}`},
		{jsonrpc.WithReason(jsonrpc.KindBusy, "requestLimit", "wait"),
			`{"code":-32008,"message":"wait","data":{"kind":"busy","reason":"requestLimit"}}`},
		{jsonrpc.Unavailable(2000, "incus is away"),
			`{"code":-32019,"message":"incus is away","data":{"kind":"unavailable","retryAfterMs":2000}}`},
		{jsonrpc.Unavailable(0, "now"),
			`{"code":-32019,"message":"now","data":{"kind":"unavailable","retryAfterMs":0}}`},
		{jsonrpc.CapabilityUnavailable("power", "no power"),
			`{"code":-32006,"message":"no power","data":{"kind":"capabilityUnavailable","capability":"power"}}`},
		{&jsonrpc.Error{Kind: jsonrpc.KindNotFound},
			`{"code":-32004,"message":"notFound","data":{"kind":"notFound"}}`},
		{&jsonrpc.Error{Kind: "bogus", Message: "m", Reason: "r"},
			`{"code":-32603,"message":"m","data":{"kind":"internal"}}`},
		{&jsonrpc.Error{},
			`{"code":-32603,"message":"internal","data":{"kind":"internal"}}`},
	}
	for _, tc := range cases {
		got, err := json.Marshal(tc.err)
		if err != nil || string(got) != tc.want {
			t.Errorf("Marshal(%+v) = %s %v\n want %s", tc.err, got, err, tc.want)
		}
		var back jsonrpc.Error
		if err := json.Unmarshal(got, &back); err != nil {
			t.Errorf("Unmarshal(%s): %v", got, err)
		}
	}
}

func TestErrorMessagesAreBounded(t *testing.T) {
	for _, msg := range []string{
		strings.Repeat("a", jsonrpc.MaxMessageLen),
		strings.Repeat("a", jsonrpc.MaxMessageLen+1),
		strings.Repeat("€", 2000),
		strings.Repeat("a", 4094) + "€",
		strings.Repeat("\xff", 5000),
		"ok \xff\xfe then " + strings.Repeat("é", 3000),
	} {
		raw, err := json.Marshal(jsonrpc.Errorf(jsonrpc.KindNotFound, "%s", msg))
		if err != nil {
			t.Fatal(err)
		}
		var back jsonrpc.Error
		if err := json.Unmarshal(raw, &back); err != nil {
			t.Fatal(err)
		}
		if len(back.Message) > jsonrpc.MaxMessageLen || !utf8.ValidString(back.Message) || back.Message == "" {
			t.Errorf("a %d-byte message arrives as %d bytes (valid UTF-8: %v)", len(msg), len(back.Message), utf8.ValidString(back.Message))
		}
		if len(msg) <= jsonrpc.MaxMessageLen && utf8.ValidString(msg) && back.Message != msg {
			t.Errorf("a message within the limit was changed")
		}
		if len(msg) > jsonrpc.MaxMessageLen && utf8.ValidString(msg) && !strings.HasSuffix(back.Message, "…") {
			t.Errorf("a cut message does not say so")
		}
	}
}

func TestErrorDecodingIsStrict(t *testing.T) {
	for _, raw := range []string{
		`{"code":-32004,"message":"m","data":{"kind":"notFound","reason":"expired"}}`,
		`{"code":-32602,"message":"m","data":{"kind":"invalidParams","field":"a[1].b","ceiling":9007199254740991}}`,
		`{"code":-32013,"message":"m","data":{"kind":"payloadTooLarge","limitBytes":16777216,"limitEntries":4096}}`,
	} {
		var e jsonrpc.Error
		if err := json.Unmarshal([]byte(raw), &e); err != nil {
			t.Errorf("Unmarshal(%s): %v", raw, err)
		}
		again, _ := json.Marshal(&e)
		if string(again) != raw {
			t.Errorf("round trip %s → %s", raw, again)
		}
	}
	for raw, path := range map[string]string{
		`{"code":-32600,"message":"m","data":{"kind":"notFound"}}`:                       "code",
		`{"code":-32004,"message":"m","data":{"kind":"lost"}}`:                           "data.kind",
		`{"code":-32004,"message":"m","data":{"kind":"notFound","hint":"x"}}`:            "data.hint",
		`{"code":-32004,"message":"m","data":{"kind":"notFound"},"extra":1}`:             "extra",
		`{"code":-32004,"message":"m"}`:                                                  "data",
		`{"code":-32004,"message":"m","data":{}}`:                                        "data.kind",
		`{"code":-32004,"data":{"kind":"notFound"}}`:                                     "message",
		`{"code":-32004,"message":null,"data":{"kind":"notFound"}}`:                      "message",
		`{"code":-32602,"message":"m","data":{"kind":"invalidParams","ceiling":null}}`:   "data.ceiling",
		`{"code":-32602,"message":"m","data":{"kind":"invalidParams","ceiling":-1}}`:     "data.ceiling",
		`{"code":-32008,"message":"m","data":{"kind":"busy","retryAfterMs":1.5}}`:        "data.retryAfterMs",
		`{"code":-32005,"message":"m","data":{"kind":"versionMismatch","expected":"4"}}`: "data.expected",
		`{"code":-32004.0,"message":"m","data":{"kind":"notFound"}}`:                     "code",
	} {
		var e jsonrpc.Error
		err := json.Unmarshal([]byte(raw), &e)
		var fe *wire.FieldError
		if !errors.As(err, &fe) || fe.Path != path {
			t.Errorf("Unmarshal(%s) = %v, want a refusal at %s", raw, err, path)
		}
	}
}

func TestFromFieldError(t *testing.T) {
	e := jsonrpc.FromFieldError(&wire.FieldError{Path: "owner.environmentId", Problem: "is required"})
	if e.Kind != jsonrpc.KindInvalidParams || e.Field != "owner.environmentId" || e.Message != "The member owner.environmentId is required." {
		t.Errorf("%+v", e)
	}
	e = jsonrpc.FromFieldError(&wire.FieldError{Problem: "must be an object, not an array"})
	if e.Field != "" || e.Message != "The params must be an object, not an array." {
		t.Errorf("%+v", e)
	}
	e = jsonrpc.FromFieldError(errors.New("odd"))
	if e.Kind != jsonrpc.KindInvalidParams || e.Field != "" {
		t.Errorf("%+v", e)
	}
}
