// Package guest opens streams from the provider to the Lightspeed daemon that
// runs inside each guest (an Incus container) and listens only on the guest's
// own loopback, 127.0.0.1:PORT (DefaultPort unless configured otherwise).
//
// The relay, the readiness probe and the idle loop all go through one Dialer.
// Two host-local implementations exist; neither puts the daemon on any
// network, neither gives the guest a NIC:
//
//   - "netns" (NewNetns, the default, see DefaultKind): the socket is created
//     from inside the guest's network namespace. A goroutine locks itself to
//     its OS thread, opens /proc/PID/ns/net of the instance's init process,
//     setns(CLONE_NEWNET) and dials 127.0.0.1:PORT; the socket stays in the
//     guest's namespace. The goroutine never unlocks, so the thread, which is
//     now in a foreign namespace, exits with it and is never reused. No Incus
//     device is needed, so instance starts are not slowed down. Requirements:
//     the provider runs on the instance's host, in the same PID namespace as
//     incusd (the PID from the instance state must mean the same process
//     here), with CAP_SYS_ADMIN and CAP_SYS_PTRACE over the containers'
//     namespaces, in practice root in the initial user namespace.
//
//   - "proxy" (NewProxy): an Incus proxy device (see Devices) listens on a
//     host unix socket <socketDir>/<instance>.sock (mode 0600, owned by the
//     provider's uid/gid) and connects to 127.0.0.1:PORT inside the guest.
//     The provider only needs access to that directory, not root, but every
//     start of an instance carrying the device is about one second slower
//     (the forkproxy helper), which matters for wake-from-stopped. The device
//     must be present when the instance starts; give each daemon (Incus, LXD)
//     its own socketDir, since two devices with one path steal it from each
//     other without an error.
//
// Safety of netns. The dialer never falls back to the host: if the init PID is
// gone, or the namespace it names is the provider's own network namespace
// (the instance is stopped and the PID was reused by a host process, or the
// PID is meaningless in this PID namespace), the dial fails and no host socket
// is created. PIDs are cached per instance together with the process start
// time from /proc/PID/stat, so a reused PID is detected instead of dialled;
// a dial that fails in a way suggesting a stale PID (the process is gone, its
// start time changed, connection refused) looks the PID up once more and
// retries once. Call Forget when an instance stops, restarts or is deleted.
// A stopped instance reports PID 0 and yields an error matching
// ErrNotRunning.
//
// What a successful dial proves. Very little, by design of TCP: for a frozen
// (paused) guest the kernel still completes the handshake into the listen
// backlog of the daemon's socket, and for the proxy dialer the host side of
// the device accepts the unix connection before (and whether or not) the
// guest side connects. In both cases DialContext succeeds and then reads
// block until the guest is unfrozen, or the stream is closed. A guest whose
// loopback is still down (its init has not yet run `ip link set lo up`) fails
// with "network is unreachable". Readiness must therefore be proved by a
// protocol-level exchange with the daemon under a deadline; that is the
// caller's job, not this package's.
package guest
