// Package wake is the one wake of each target that every use of it shares:
// a data-route dial (routes) and a public ingress request (ingress) that
// find a target powered down, or running with a power-down pending, join
// the target's one flight, started by whichever came first.
//
// A flight holds a dial ticket in the relays.Registry until it settles, so
// no power-down starts under it; it wakes the target through
// targets.Service.Wake (a paused target unfrozen, a stopped or suspended
// one started, the use's request for running recorded right after) and
// probes the daemon at the same time, through the GuestDialer, with a
// data-plane initialize (internal/envd.Handshake): never a TCP connect,
// which a frozen guest's kernel accepts. Any well-formed answer proves the
// daemon there, versionMismatch or a result of another plane included. A
// flight goes on after the uses that asked for it were answered, within
// its budget, and settles on the daemon's answer or on a Refusal (waking,
// booting, gone, failed) that every use waiting on it is told.
//
// What the wake knows of a daemon outlives the flight: a target whose
// daemon a flight proved ready, and whose power has not changed since, is
// reached at once (Waker.Ready).
//
// The wake decides on targets.Route values only: it never reads an
// instance, and it reaches Incus only through targets.Service.
package wake
