// Package incus is a small typed client for the Incus REST API: the calls the
// provider makes, nothing more.
//
// Every call takes a context.Context and runs under a deadline: the earlier of
// the context's own deadline and Config.CallTimeout. Calls that Incus runs in
// the background (instance create, state changes, delete, full update) return
// an *Operation; Wait follows it to its final state. Errors are *Error (a
// failed HTTP call or an Incus error response) or *OperationError (an
// operation that ended in Failure or Cancelled), both usable with errors.Is
// against ErrNotFound, ErrConflict and ErrPreconditionFailed.
//
// A client reaches Incus through its unix socket, or over HTTPS through one
// or several endpoints (the members of a cluster), failing over from one to
// the next within bounded time; see Client for the rules. A call no endpoint
// answered matches ErrUnreachable; a write that was sent and never answered
// matches ErrOutcomeUnknown.
//
// The package never logs. Config.Observe, when set, is told the name, outcome
// and duration of every call, and Config.ObserveEndpoint of every attempt on
// one endpoint; Client.Endpoints says what is known of each endpoint.
package incus
