// Package conformance is the controller-plane conformance suite of the
// Lightspeed environment protocol (controller plane, protocol version 4),
// written as a Go package that any provider controller can be run against,
// whatever language the provider is written in. It only speaks the wire: it
// dials a controller URL (ws://, wss:// or unix:///path), with the bearer
// credential when the provider uses one, and checks what the contract's
// "Conformance" section lists:
//
//   - the handshake rules (notInitialized, versionMismatch, an omitted
//     protocolVersion, a repeated initialize, the response's shape);
//   - the envelope's framing rules (binary frames, batches, non-JSON,
//     malformed envelopes, params by position, notifications);
//   - the credential refusal (HTTP 401 before the upgrade);
//   - strict decoding of params, idle policies included;
//   - template/list;
//   - per-owner create idempotency, pure target/get, owner fencing, close by
//     owner and its repetition, strict decoding of every observation;
//   - capabilityUnavailable for optional methods the controller does not
//     advertise;
//   - the shape of every error answer (code fixed by kind, data.kind,
//     message length, the kind's typed fields).
//
// Run runs every check and returns one Result each; RunT runs them as
// subtests of a Go test; cmd/lsconform runs them from a shell. Each check
// invents its own owners (environment ids carry a random per-run suffix), so
// runs against a shared provider never collide, and closes every owner it
// used, waiting until the controller answers closed, even when the check
// fails.
//
// The package also holds the data-route helpers the contract names:
// CheckRefusal checks a refused data route's typed answer, and DialRoute
// dials a route and checks that a refusal arrived within the hold bound.
package conformance
