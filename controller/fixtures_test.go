package controller_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// fixtureDir holds one fixture per controller method, named after the
// method with "." for "/": a valid params object, a valid response and a
// typed error, as the contract's "Contract documents" section describes.
const fixtureDir = "../fixtures/controller"

// fixture is a fixture file; all three members are required.
type fixture struct {
	Params   json.RawMessage `json:"params"`
	Response json.RawMessage `json:"response"`
	Error    json.RawMessage `json:"error"`
}

// wireTypes are each method's params and result types.
var wireTypes = map[string]struct{ params, result func() any }{
	controller.MethodInitialize:    {func() any { return new(controller.InitializeParams) }, func() any { return new(controller.InitializeResult) }},
	controller.MethodTemplateList:  {func() any { return new(controller.TemplateListParams) }, func() any { return new(controller.TemplateListResult) }},
	controller.MethodTargetCreate:  {func() any { return new(controller.CreateParams) }, func() any { return new(controller.TargetResult) }},
	controller.MethodTargetGet:     {func() any { return new(controller.TargetParams) }, func() any { return new(controller.TargetResult) }},
	controller.MethodTargetSet:     {func() any { return new(controller.SetPowerParams) }, func() any { return new(controller.TargetResult) }},
	controller.MethodTargetClose:   {func() any { return new(controller.TargetParams) }, func() any { return new(controller.TargetResult) }},
	controller.MethodIngressEnsure: {func() any { return new(controller.TargetParams) }, func() any { return new(controller.TargetResult) }},
	controller.MethodIngressRemove: {func() any { return new(controller.TargetParams) }, func() any { return new(controller.TargetResult) }},
}

func fixtureName(method string) string { return strings.ReplaceAll(method, "/", ".") + ".json" }

func TestEveryFixtureNamesAMethod(t *testing.T) {
	entries, err := os.ReadDir(fixtureDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if e.IsDir() || !ok {
			t.Errorf("%s/%s is not a method fixture (want <method with . for />.json)", fixtureDir, e.Name())
			continue
		}
		method := strings.ReplaceAll(name, ".", "/")
		if !slices.Contains(controller.Methods(), method) {
			t.Errorf("%s names %s, which is not a controller method (controller.Methods: %v)", e.Name(), method, controller.Methods())
		}
	}
}

func TestEveryMethodHasAFixtureThatDecodesStrictly(t *testing.T) {
	for _, method := range controller.Methods() {
		t.Run(method, func(t *testing.T) {
			types, ok := wireTypes[method]
			if !ok {
				t.Fatalf("this test knows no wire types for %s; add them to wireTypes", method)
			}
			raw, err := os.ReadFile(filepath.Join(fixtureDir, fixtureName(method)))
			if err != nil {
				t.Fatalf("%s has no fixture: %v", method, err)
			}
			var f fixture
			if err := wire.Decode(raw, &f); err != nil {
				t.Fatalf("%s: %v", fixtureName(method), err)
			}

			params := types.params()
			if err := wire.Decode(f.Params, params); err != nil {
				t.Errorf("params do not decode strictly: %v", err)
			} else {
				sameJSON(t, "params", f.Params, params)
			}

			result := types.result()
			if err := wire.Decode(f.Response, result); err != nil {
				t.Errorf("response does not decode strictly: %v", err)
			} else {
				sameJSON(t, "response", f.Response, result)
			}

			var e jsonrpc.Error
			if err := json.Unmarshal(f.Error, &e); err != nil {
				t.Fatalf("error does not decode strictly: %v", err)
			}
			if problem := typedFieldProblem(&e); problem != "" {
				t.Errorf("error: %s", problem)
			}
			sameJSON(t, "error", f.Error, &e)
		})
	}
}

// typedFieldProblem checks what the error's kind requires beyond decoding.
func typedFieldProblem(e *jsonrpc.Error) string {
	switch {
	case e.Message == "":
		return "the message is empty"
	case len(e.Message) > jsonrpc.MaxMessageLen:
		return "the message is over 4096 bytes"
	case e.Kind == jsonrpc.KindFailedPrecondition && e.Reason == "":
		return "failedPrecondition needs data.reason"
	case e.Kind == jsonrpc.KindVersionMismatch && (e.Expected == nil || e.Received == nil):
		return "versionMismatch needs data.expected and data.received"
	case e.Kind == jsonrpc.KindCapabilityUnavailable && e.Capability == "":
		return "capabilityUnavailable needs data.capability"
	}
	return ""
}

// sameJSON requires v to encode back to the fixture's JSON: nothing the
// fixture says is dropped, and nothing (such as a false flag) is spelled
// that the encoder would omit.
func sameJSON(t *testing.T, what string, want json.RawMessage, v any) {
	t.Helper()
	got, err := json.Marshal(v)
	if err != nil {
		t.Errorf("%s does not encode: %v", what, err)
		return
	}
	var a, b any
	if err := json.Unmarshal(want, &a); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(got, &b); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		var compact bytes.Buffer
		_ = json.Compact(&compact, want)
		t.Errorf("%s does not survive a decode and encode:\nfixture: %s\nencoded: %s", what, compact.String(), got)
	}
}
