package controller

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// The audit trail: one line for every controller call answered, saying
// who asked what of which target and how it ended. It names the owner and
// the target (identifiers, never secrets), the caller's address, the
// answer's kind and the time taken; never the credential, and never a
// payload (a display name or an idle policy is the owner's, not the log's).

type remoteKey struct{}

// withRemote carries the connection's peer address to the audit line.
func withRemote(ctx context.Context, addr string) context.Context {
	return context.WithValue(ctx, remoteKey{}, addr)
}

// auditedParams is what of a request's params the audit names: the owner
// of a create, the target of every other call. Any other member is left
// undecoded.
type auditedParams struct {
	Owner  *Owner     `json:"owner"`
	Target *TargetRef `json:"target"`
}

// audited wraps m so that every call it answers is logged to audit.
func audited(audit *zap.Logger, method string, m jsonrpc.Method) jsonrpc.Method {
	return func(ctx context.Context, raw json.RawMessage) (any, error) {
		start := time.Now()
		res, err := m(ctx, raw)
		owner, targetID := Owner{}, ""
		if r, ok := res.(TargetResult); ok {
			// An answer names its owner and target: the params, which the
			// method has decoded already, are read again only for a call
			// that has no such answer (an error, a template list).
			owner, targetID = r.Target.Owner, r.Target.TargetID
		} else {
			var p auditedParams
			_ = json.Unmarshal(raw, &p) // lenient: a malformed request is audited with what could be read
			switch {
			case p.Target != nil:
				owner, targetID = p.Target.Owner, p.Target.TargetID
			case p.Owner != nil:
				owner = *p.Owner
			}
		}
		outcome := "ok"
		if err != nil {
			outcome = "internal"
			var e *jsonrpc.Error
			if errors.As(err, &e) {
				outcome = string(e.Kind)
			}
		}
		remote, _ := ctx.Value(remoteKey{}).(string)
		audit.Info("controller call", zap.String("method", method), zap.String("universe", owner.UniverseID),
			zap.String("environment", owner.EnvironmentID), zap.String("target", targetID),
			zap.String("outcome", outcome), zap.Duration("took", time.Since(start)), zap.String("remote", remote))
		return res, err
	}
}
