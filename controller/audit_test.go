package controller_test

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// auditBackend answers a create with a target and refuses a close.
type auditBackend struct{ controller.Backend }

func (auditBackend) CreateTarget(_ context.Context, p controller.CreateParams) (controller.Observation, error) {
	return controller.Observation{TargetID: "ls-0123456789abcdef0123", Owner: p.Owner, Phase: controller.PhaseProvisioning}, nil
}

func (auditBackend) CloseTarget(context.Context, controller.TargetRef) (controller.Observation, error) {
	return controller.Observation{}, jsonrpc.Unavailable(500, "Incus does not answer.")
}

// TestEveryCallIsAudited: a line per call answered, naming the method, the
// owner, the target, the outcome's kind and the caller; never a payload
// (the display name) nor the credential.
func TestEveryCallIsAudited(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := controller.NewHandler(ctx, controller.Options{Backend: auditBackend{}, Audit: zap.New(core)})
	srv := httptest.NewServer(h)
	defer srv.Close()
	ws, resp, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(srv.URL, "http")+"/control", nil)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	rpc := jsonrpc.NewClient(ws)
	defer rpc.Close()
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	defer ccancel()
	if err := rpc.Call(cctx, "initialize", controller.InitializeParams{ProtocolVersion: controller.ProtocolVersion, ClientInfo: controller.BuildInfo{Name: "t"}}, nil); err != nil {
		t.Fatal(err)
	}
	owner := controller.Owner{UniverseID: "u-audit", EnvironmentID: "env-1"}
	if err := rpc.Call(cctx, controller.MethodTargetCreate, controller.CreateParams{Owner: owner, TemplateID: "dev-small", DisplayName: "secret project name"}, nil); err != nil {
		t.Fatal(err)
	}
	_ = rpc.Call(cctx, controller.MethodTargetClose, controller.TargetParams{Target: controller.TargetRef{Owner: owner, TargetID: "ls-0123456789abcdef0123"}}, nil)

	entries := logs.FilterMessage("controller call").All()
	if len(entries) != 2 {
		t.Fatalf("%d audit lines for 2 calls: %v", len(entries), entries)
	}
	want := []map[string]any{
		{"method": "target/create", "universe": "u-audit", "environment": "env-1", "target": "ls-0123456789abcdef0123", "outcome": "ok"},
		{"method": "target/close", "universe": "u-audit", "environment": "env-1", "target": "ls-0123456789abcdef0123", "outcome": "unavailable"},
	}
	for i, e := range entries {
		fields := e.ContextMap()
		for k, v := range want[i] {
			if fields[k] != v {
				t.Errorf("line %d: %s = %v, want %v (%v)", i, k, fields[k], v, fields)
			}
		}
		if r, _ := fields["remote"].(string); !strings.HasPrefix(r, "127.0.0.1:") {
			t.Errorf("line %d names no caller: %v", i, fields)
		}
		for _, v := range fields {
			if s, ok := v.(string); ok && strings.Contains(s, "secret project name") {
				t.Errorf("line %d carries the payload: %v", i, fields)
			}
		}
	}
}
