package wake

import (
	"testing"
	"time"
)

// Breakdown divides a dial's time by what it waited on, for every shape
// of flight: the parts add up to the whole, and what the relay waited on
// Incus for (the action, then the record) is Incus's however early the
// daemon answered.
func TestBreakdownOfEveryShape(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	relay := func(tr Trace, from int) Trace {
		tr.GuestDialStart, tr.GuestDialed, tr.GuestUpgraded, tr.Upgraded = ms(from), ms(from+1), ms(from+2), ms(from+3)
		return tr
	}
	for _, tc := range []struct {
		name string
		tr   Trace
		want Breakdown
	}{{
		// A thawed guest answers at 15 ms, Incus reports the unfreeze and
		// the record lands at 40 ms; the relay dials then.
		name: "paused, the daemon answering before the record",
		tr:   relay(Trace{Arrived: ms(0), Flying: ms(1), IncusStart: ms(1), IncusEnd: ms(40), Answered: ms(15), Probes: []ProbeAttempt{{Start: ms(2), End: ms(15), Answered: true}}}, 41),
		want: Breakdown{Total: 44 * time.Millisecond, Incus: 39 * time.Millisecond, Record: 25 * time.Millisecond, Daemon: 2 * time.Millisecond, Provider: 3 * time.Millisecond},
	}, {
		// A start ends at 300 ms; probing starts at 301 ms, and the daemon
		// answers at 450 ms.
		name: "stopped, the daemon booting after the start",
		tr:   relay(Trace{Arrived: ms(0), Flying: ms(1), IncusStart: ms(1), IncusEnd: ms(300), Answered: ms(450), Probes: []ProbeAttempt{{Start: ms(301), End: ms(350)}, {Start: ms(400), End: ms(450), Answered: true}}}, 451),
		want: Breakdown{Total: 454 * time.Millisecond, Incus: 299 * time.Millisecond, Daemon: 151 * time.Millisecond, Provider: 4 * time.Millisecond},
	}, {
		// The flight went on without the call's end (IncusEnd zero).
		name: "the call still running at the answer",
		tr:   relay(Trace{Arrived: ms(0), Flying: ms(1), IncusStart: ms(1), Answered: ms(20), Probes: []ProbeAttempt{{Start: ms(2), End: ms(20), Answered: true}}}, 21),
		want: Breakdown{Total: 24 * time.Millisecond, Incus: 19 * time.Millisecond, Daemon: 2 * time.Millisecond, Provider: 3 * time.Millisecond},
	}, {
		name: "a probe only",
		tr:   relay(Trace{Arrived: ms(0), Flying: ms(1), Answered: ms(5), Probes: []ProbeAttempt{{Start: ms(2), End: ms(5), Answered: true}}}, 6),
		want: Breakdown{Total: 9 * time.Millisecond, Daemon: 5 * time.Millisecond, Provider: 4 * time.Millisecond},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := tc.tr.Breakdown()
			if !ok {
				t.Fatal("no breakdown")
			}
			if got != tc.want {
				t.Fatalf("breakdown %+v, want %+v", got, tc.want)
			}
			if got.Incus+got.Daemon+got.Provider != got.Total || got.Record > got.Incus {
				t.Fatalf("the parts do not add up: %+v", got)
			}
		})
	}
	if _, ok := (&Trace{Arrived: ms(0), Answered: ms(5)}).Breakdown(); ok {
		t.Fatal("a breakdown of a dial never upgraded")
	}
}
