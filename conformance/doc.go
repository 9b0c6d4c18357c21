// Package conformance is the conformance suite of the Lightspeed
// environment protocol for providers (controller plane, protocol version
// 4, and the data routes that serve data plane 5), written as a Go package
// that any provider can be run against, whatever language it is written
// in. It only speaks the wire: it dials a controller URL (ws://, wss:// or
// unix:///path) and the data route base, with the bearer credential when
// the provider uses one, and checks what a black box can of the contract
// (CheckNames lists the checks, CheckRule the sentence each enforces):
//
//   - the handshake, the envelope's framing and strict decoding, one
//     message per frame, pipelining and busy, pings, the 16 MiB limit both
//     ways, the credential's 401, and the shape of every error answer;
//   - template/list, per-owner create idempotency and templateDeprecated,
//     a pure target/get, owner fencing, close by owner, target/setPower,
//     capabilityUnavailable, public ingress, and answers within a bound;
//   - data routes: the relay, typed refusals with Retry-After, fencing,
//     410 once closed, and the wake of a powered-down target's dial;
//   - the provider obligations a black box can observe: no power-down
//     while a relay is open or a process runs, the idle policy applied,
//     and a target closed for idleness reported closed or notFound.
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
