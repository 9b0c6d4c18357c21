// Package routes serves the data routes of the environment protocol:
// /routes/{universeId}/{environmentId}/{targetId}, one per target, each
// segment percent-decoded. A dial is handled in this order:
//
//  1. Credential: the provider's bearer credential (401 before the upgrade).
//  2. Path: three segments that decode to a universe id, an environment id
//     (the Lightspeed id grammar) and a target id (1 to 255 bytes without
//     control characters); anything else is refused without touching Incus.
//     So is a request that is not a WebSocket handshake.
//  3. Fence: targets.Service.ResolveRoute. A target id that is not the
//     owner's own target reaches nothing: it is refused (410 gone) without a
//     single Incus call, whatever that target's state.
//  4. Wake: a dial that finds its target powered down (or running with a
//     power-down pending) joins the target's one wake (package wake, a
//     "flight" shared with every other dial and public ingress request of
//     it): a paused target is unfrozen, a stopped one started (a suspended
//     one restored), through targets.Service.Wake; the dial is held while
//     the target resumes and its daemon starts answering, proved by a
//     data-plane initialize on the provider's own connection, never by a
//     TCP connect. Any well-formed answer to that initialize proves the
//     daemon there, versionMismatch or a result of another plane included:
//     the dial is relayed, so that the runtime's own handshake meets the
//     answer and fails the environment naming both versions. A running
//     target whose daemon was proved ready, and whose power has not changed
//     since, is dialed at once.
//  5. Refuse: everything from the request's arrival to the upgrade or the
//     refusal, Incus calls included, is bounded by the hold (5 s at most,
//     MaxHold). A dial that cannot be upgraded in time gets the spec's typed
//     answer: 503 {"state":"waking"} or {"state":"booting"} with Retry-After
//     (1 to 60 s), 410 {"state":"gone"}, or 409 {"state":"failed"}. Dials
//     held at once are capped; a dial past the cap is refused with a 503 at
//     once (and the wake it asked for still starts).
//  6. Relay: the provider opens its own WebSocket to the guest daemon first
//     (a hand-written client handshake, so no byte the daemon sends after it
//     is lost in a library's buffer), then answers the runtime's handshake,
//     and from then on copies the byte stream both ways, reading only frame
//     headers: no extension is negotiated on either hop, client frames stay
//     masked toward the guest and server frames unmasked toward the runtime.
//     Headers are enough to enforce the 16 MiB message limit (summed over a
//     fragmented message, in both directions), to see close frames, and to
//     count every frame, ping and pong included, as activity. An idle relay
//     is closed no sooner than its idle timeout (60 s at least). Either side
//     closing closes the other with a proper close frame.
//
// Every dial and relay is entered in the process's relays.Registry, which
// the targets consult before any power-down: its Quiesce (the idle loop's)
// and Drain (an explicit setPower's) hold off new dials while a target is
// powered down, so a dial can never end up relaying to a guest that is
// being frozen. A dial is a request for running: Wake records it with the
// dial's arrival, so a power change asked after the dial wins over it.
//
// What this package may touch: the HTTP request and its hijacked connection;
// Incus only through targets.Service (ResolveRoute reads one target into a
// targets.Route, which is all the package decides on) and the wake (which
// records a request for running and carries it out); guests only through
// the guest.Dialer it is given. It never edits instance metadata itself and
// never dials any address of its own choosing.
package routes
