package wake

import "time"

// Trace is how one flight (a wake and its readiness probe) and the
// data-route dial that started it spent their time, as the provider saw
// it: every field is read from the provider's own clock, so that a
// benchmark can tell what the provider costs from what Incus and the guest
// daemon cost, which no figure taken from outside can.
//
// Options.Trace receives one per flight that ends with the daemon
// answering. The relay's fields are the starting dial's, which the data
// routes fill in; they stay zero when that dial stopped waiting before the
// flight settled, or was not upgraded (Upgraded is zero then, and
// Breakdown says so), and for a flight an ingress request started.
//
// Breakdown divides the starting dial's time, from Arrived to Upgraded, in
// three:
//
//   - Incus: the time inside Targets.Wake, from IncusStart to IncusEnd:
//     the unfreeze or start and its operation wait, then the record of
//     the use's request for running, which the relay waits for even when
//     the daemon answered first (a thawed guest answers before Incus
//     reports the unfreeze). Record is the part of it after the daemon's
//     answer. When the call still ran as the daemon answered and the
//     flight went on without it (IncusEnd zero), up to Answered.
//   - Daemon: waiting for the daemon once Incus is done, from IncusEnd (or
//     from the first probe's start when probing began later, as it does
//     after a start, or when there was no wake) to Answered, with the
//     probes that failed and the pauses between them, since a daemon that
//     does not listen yet is what they wait on; plus the relay's guest
//     dial and WebSocket handshake (GuestDialStart to GuestUpgraded).
//   - Provider: the rest, what the provider itself adds: taking the dial
//     to the flight, starting the wake, starting the probe after a start,
//     settling, opening the relay and writing the upgrade.
type Trace struct {
	Instance string
	// From is the power the flight woke the target from (paused,
	// stopped, running when it only probed a booting daemon).
	From string
	// Arrived is when the dial that started the flight arrived.
	Arrived time.Time
	// Flying is when the flight held its ticket and began.
	Flying time.Time
	// IncusStart and IncusEnd bound the Targets.Wake calls: the first
	// one's start, the last one's end. IncusEnd is zero when the daemon
	// answered while the last call still ran.
	IncusStart, IncusEnd time.Time
	// Wakes counts the Targets.Wake calls (more than one only when a
	// wake failed or a running target's power-down had to be replaced).
	Wakes int
	// Probes are every readiness probe attempt, in order; the last one
	// answered.
	Probes []ProbeAttempt
	// Answered is when the daemon answered the probe.
	Answered time.Time
	// Settled is when the flight published its result to the dials.
	Settled time.Time
	// GuestDialStart, GuestDialed and GuestUpgraded time the relay's own
	// connection to the daemon: the GuestDialer's dial and its WebSocket
	// handshake.
	GuestDialStart, GuestDialed, GuestUpgraded time.Time
	// Upgraded is when the dial's upgrade (101) was written.
	Upgraded time.Time
}

// ProbeAttempt is one readiness probe: a GuestDialer dial and a
// data-plane initialize.
type ProbeAttempt struct {
	Start, End time.Time
	// Answered: the daemon answered initialize (any answer; see probeUntil).
	Answered bool
}

// Breakdown is a Trace divided as its comment defines.
type Breakdown struct {
	Total, Incus, Daemon, Provider time.Duration
	// Record is the part of Incus after the daemon answered: the relay
	// waiting for Targets.Wake's record (and the end of the unfreeze's
	// operation), which a crash must not lose.
	Record time.Duration
}

// Breakdown divides the trace; false when the starting dial was not
// upgraded, so that there is no whole to divide.
func (t *Trace) Breakdown() (Breakdown, bool) {
	if t.Upgraded.IsZero() || t.Answered.IsZero() || t.GuestUpgraded.IsZero() {
		return Breakdown{}, false
	}
	var b Breakdown
	b.Total = t.Upgraded.Sub(t.Arrived)
	var incusDone time.Time
	if !t.IncusStart.IsZero() {
		incusDone = t.IncusEnd
		if incusDone.IsZero() {
			incusDone = t.Answered
		}
		b.Incus = max(0, incusDone.Sub(t.IncusStart))
		b.Record = max(0, incusDone.Sub(t.Answered))
	}
	waitFrom := incusDone
	if len(t.Probes) > 0 && t.Probes[0].Start.After(waitFrom) {
		waitFrom = t.Probes[0].Start
	}
	b.Daemon = max(0, t.Answered.Sub(waitFrom)) + max(0, t.GuestUpgraded.Sub(t.GuestDialStart))
	b.Provider = b.Total - b.Incus - b.Daemon
	return b, true
}

// PollGap is the pause before the answered probe, after the one that
// failed last: Breakdown counts it as the daemon's, yet part of it is the
// probe's backoff outlasting the daemon's boot, so it is the most the
// provider's polling may have added.
func (t *Trace) PollGap() time.Duration {
	n := len(t.Probes)
	if n < 2 {
		return 0
	}
	return max(0, t.Probes[n-1].Start.Sub(t.Probes[n-2].End))
}

// wakeCall records a Targets.Wake call; end is zero while it still runs.
func (t *Trace) wakeCall(start, end time.Time) {
	if t.IncusStart.IsZero() {
		t.IncusStart = start
	}
	t.IncusEnd = end
	t.Wakes++
}

// probe records a probe attempt.
func (t *Trace) probe(start, end time.Time, answered bool) {
	t.Probes = append(t.Probes, ProbeAttempt{Start: start, End: end, Answered: answered})
	if answered {
		t.Answered = end
	}
}
