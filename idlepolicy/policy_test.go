package idlepolicy

import (
	"errors"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

func ms(v uint64) *uint64 { return &v }

func TestCheckWireThroughTheDecoder(t *testing.T) {
	cases := []struct {
		name, body string
		field      string // "" when the policy is valid
		problem    string
	}{
		{"one threshold", `{"pauseAfterMs": 1}`, "", ""},
		{"all four, equal", `{"pauseAfterMs": 5, "suspendAfterMs": 5, "stopAfterMs": 5, "closeAfterMs": 5}`, "", ""},
		{"spec example", `{"pauseAfterMs": 600000, "stopAfterMs": 3600000, "closeAfterMs": 86400000}`, "", ""},
		{"close only", `{"closeAfterMs": 9007199254740991}`, "", ""},
		{"gaps are fine", `{"suspendAfterMs": 10, "closeAfterMs": 20}`, "", ""},
		{"empty", `{}`, "", "must set at least one"},
		{"zero pause", `{"pauseAfterMs": 0}`, "pauseAfterMs", "must be positive"},
		{"zero close", `{"pauseAfterMs": 1, "closeAfterMs": 0}`, "closeAfterMs", "must be positive"},
		{"2^53", `{"stopAfterMs": 9007199254740992}`, "stopAfterMs", "below 2^53"},
		{"negative", `{"pauseAfterMs": -1}`, "pauseAfterMs", "must not be negative"},
		{"fraction", `{"pauseAfterMs": 1.5}`, "pauseAfterMs", "whole number"},
		{"string", `{"pauseAfterMs": "10"}`, "pauseAfterMs", "must be a whole number"},
		{"null", `{"pauseAfterMs": null}`, "pauseAfterMs", "must not be null"},
		{"unknown member", `{"pauseAfterMs": 1, "hibernateAfterMs": 2}`, "hibernateAfterMs", "not a known member"},
		{"suspend before pause", `{"pauseAfterMs": 10, "suspendAfterMs": 9}`, "suspendAfterMs", "must not be smaller than pauseAfterMs"},
		{"stop before suspend", `{"suspendAfterMs": 10, "stopAfterMs": 9}`, "stopAfterMs", "must not be smaller than suspendAfterMs"},
		{"close before stop", `{"stopAfterMs": 10, "closeAfterMs": 9}`, "closeAfterMs", "must not be smaller than stopAfterMs"},
		{"close before pause across gaps", `{"pauseAfterMs": 10, "closeAfterMs": 9}`, "closeAfterMs", "must not be smaller than pauseAfterMs"},
		{"stop before pause across a gap", `{"pauseAfterMs": 10, "stopAfterMs": 3, "closeAfterMs": 20}`, "stopAfterMs", "must not be smaller than pauseAfterMs"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var p Policy
			err := wire.Decode([]byte(c.body), &p)
			if c.problem == "" {
				if err != nil {
					t.Fatalf("want valid, got %v", err)
				}
				return
			}
			var fe *wire.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("want a field error, got %v", err)
			}
			if fe.Path != c.field || !strings.Contains(fe.Problem, c.problem) {
				t.Fatalf("want %q %q, got %q %q", c.field, c.problem, fe.Path, fe.Problem)
			}
		})
	}
}

// TestCheckWireNamesTheFieldInsideAParent shows the path a caller of
// target/create sees.
func TestCheckWireNamesTheFieldInsideAParent(t *testing.T) {
	var params struct {
		Idle *Policy `json:"idle,omitempty"`
	}
	err := wire.Decode([]byte(`{"idle": {"pauseAfterMs": 5, "stopAfterMs": 4}}`), &params)
	var fe *wire.FieldError
	if !errors.As(err, &fe) || fe.Path != "idle.stopAfterMs" {
		t.Fatalf("want idle.stopAfterMs, got %v", err)
	}
	err = wire.Decode([]byte(`{"idle": {}}`), &params)
	if !errors.As(err, &fe) || fe.Path != "idle" {
		t.Fatalf("want idle, got %v", err)
	}
}

func TestDueAction(t *testing.T) {
	full := &Policy{PauseAfterMs: ms(10), SuspendAfterMs: ms(20), StopAfterMs: ms(30), CloseAfterMs: ms(40)}
	spec := &Policy{PauseAfterMs: ms(600000), StopAfterMs: ms(3600000), CloseAfterMs: ms(86400000)}
	equal := &Policy{PauseAfterMs: ms(10), StopAfterMs: ms(10), CloseAfterMs: ms(10)}
	stopOnly := &Policy{StopAfterMs: ms(10)}
	closeOnly := &Policy{CloseAfterMs: ms(10)}
	all := StagePause | StageSuspend | StageStop
	container := StagePause | StageStop
	cases := []struct {
		name   string
		p      *Policy
		idle   uint64
		stages Stages
		at     Action
		want   Action
	}{
		{"nil policy", nil, 1 << 40, all, ActionNone, ActionNone},
		{"below every threshold", full, 9, all, ActionNone, ActionNone},
		{"exactly the pause threshold", full, 10, all, ActionNone, ActionPause},
		{"between pause and suspend", full, 19, all, ActionNone, ActionPause},
		{"suspend reached", full, 20, all, ActionNone, ActionSuspend},
		{"stop reached", full, 35, all, ActionNone, ActionStop},
		{"close reached", full, 40, all, ActionNone, ActionClose},
		{"far beyond", full, 1 << 52, all, ActionNone, ActionClose},
		{"most escalated wins over lower ones", spec, 3600000, container, ActionNone, ActionStop},
		{"spec example paused at ten minutes", spec, 600000, container, ActionNone, ActionPause},
		{"spec example closed at a day", spec, 86400000, container, ActionNone, ActionClose},
		{"unsupported suspend falls back to pause", full, 25, container, ActionNone, ActionPause},
		{"unsupported suspend, stop reached", full, 30, container, ActionNone, ActionStop},
		{"no stop state: pause is the most", full, 35, StagePause, ActionNone, ActionPause},
		{"no power states: nothing until close", full, 35, 0, ActionNone, ActionNone},
		{"no power states: close always qualifies", full, 40, 0, ActionNone, ActionClose},
		{"close only", closeOnly, 10, 0, ActionNone, ActionClose},
		{"stop only, not offered", stopOnly, 100, StagePause, ActionNone, ActionNone},
		{"equal thresholds: the most escalated", equal, 10, container, ActionNone, ActionClose},
		{"equal thresholds without stop state", &Policy{PauseAfterMs: ms(10), StopAfterMs: ms(10)}, 10, StagePause, ActionNone, ActionPause},
		{"already paused, pause due: nothing", full, 15, all, ActionPause, ActionNone},
		{"paused, suspend due: further", full, 20, all, ActionPause, ActionSuspend},
		{"paused, stop due: further", full, 30, all, ActionPause, ActionStop},
		{"suspended, stop due: further", full, 30, all, ActionSuspend, ActionStop},
		{"stopped, pause due: not further", full, 15, all, ActionStop, ActionNone},
		{"stopped, suspend due: not further", full, 25, all, ActionStop, ActionNone},
		{"stopped, close due: further", full, 40, all, ActionStop, ActionClose},
		{"stopped by hand without a pause state, close due", closeOnly, 10, 0, ActionStop, ActionClose},
		{"paused, only pause offered, far beyond", &Policy{PauseAfterMs: ms(1), StopAfterMs: ms(2)}, 1000, StagePause, ActionPause, ActionNone},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := c.p.DueAction(c.idle, c.stages, c.at); got != c.want {
				t.Fatalf("DueAction(%d, %b, %s) = %s, want %s", c.idle, c.stages, c.at, got, c.want)
			}
		})
	}
}

func TestNextThreshold(t *testing.T) {
	full := &Policy{PauseAfterMs: ms(10), SuspendAfterMs: ms(20), StopAfterMs: ms(30), CloseAfterMs: ms(40)}
	container := StagePause | StageStop
	cases := []struct {
		name   string
		p      *Policy
		idle   uint64
		stages Stages
		at     Action
		want   uint64
		ok     bool
	}{
		{"nil", nil, 0, container, ActionNone, 0, false},
		{"running, fresh", full, 0, container, ActionNone, 10, true},
		{"running, pause reached: stop next (suspend not offered)", full, 10, container, ActionNone, 30, true},
		{"paused: stop next", full, 12, container, ActionPause, 30, true},
		{"paused early: still stop next, not pause", full, 2, container, ActionPause, 30, true},
		{"stopped: close next", full, 31, container, ActionStop, 40, true},
		{"past close", full, 40, container, ActionStop, 0, false},
		{"nothing offered: close", full, 0, 0, ActionNone, 40, true},
		{"no close and at the top", &Policy{PauseAfterMs: ms(5)}, 6, container, ActionPause, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, ok := c.p.NextThreshold(c.idle, c.stages, c.at)
			if got != c.want || ok != c.ok {
				t.Fatalf("NextThreshold = %d %v, want %d %v", got, ok, c.want, c.ok)
			}
		})
	}
}

// TestNextThresholdAgreesWithDueAction checks, over a grid, that nothing
// becomes due strictly between a probe and the threshold it schedules.
func TestNextThresholdAgreesWithDueAction(t *testing.T) {
	policies := []*Policy{
		{PauseAfterMs: ms(10), SuspendAfterMs: ms(20), StopAfterMs: ms(30), CloseAfterMs: ms(40)},
		{PauseAfterMs: ms(10), StopAfterMs: ms(10), CloseAfterMs: ms(25)},
		{SuspendAfterMs: ms(7)},
		{CloseAfterMs: ms(3)},
	}
	for pi, p := range policies {
		for stages := Stages(0); stages < 8; stages++ {
			for at := ActionNone; at < ActionClose; at++ {
				for idle := uint64(0); idle < 50; idle++ {
					if p.DueAction(idle, stages, at) != ActionNone {
						continue
					}
					next, ok := p.NextThreshold(idle, stages, at)
					for later := idle + 1; later < 60; later++ {
						due := p.DueAction(later, stages, at) != ActionNone
						if due && (!ok || later < next) {
							t.Fatalf("policy %d stages %b at %s idle %d: due at %d before next threshold %d (%v)", pi, stages, at, idle, later, next, ok)
						}
						if ok && later == next && !due {
							t.Fatalf("policy %d stages %b at %s idle %d: next threshold %d is not due", pi, stages, at, idle, next)
						}
					}
				}
			}
		}
	}
}
