// Package idle holds the idle policy (its validation and the due-action
// rule) and the loop that applies it to running targets.
package idle

import (
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// Policy names when an idle target is powered down or closed. It is a wire
// type (template/list, target/create) and is stored as JSON in the
// instance's metadata.
type Policy struct {
	PauseAfterMs   *uint64 `json:"pauseAfterMs,omitempty"`
	SuspendAfterMs *uint64 `json:"suspendAfterMs,omitempty"`
	StopAfterMs    *uint64 `json:"stopAfterMs,omitempty"`
	CloseAfterMs   *uint64 `json:"closeAfterMs,omitempty"`
}

// Action is what the policy asks of a target, in escalating order.
type Action int

// Actions in the order the spec escalates them.
const (
	ActionNone Action = iota
	ActionPause
	ActionSuspend
	ActionStop
	ActionClose
)

func (a Action) String() string {
	switch a {
	case ActionPause:
		return "pause"
	case ActionSuspend:
		return "suspend"
	case ActionStop:
		return "stop"
	case ActionClose:
		return "close"
	default:
		return "none"
	}
}

type stage struct {
	member    string
	threshold *uint64
	action    Action
}

func (p *Policy) stages() []stage {
	return []stage{
		{"pauseAfterMs", p.PauseAfterMs, ActionPause},
		{"suspendAfterMs", p.SuspendAfterMs, ActionSuspend},
		{"stopAfterMs", p.StopAfterMs, ActionStop},
		{"closeAfterMs", p.CloseAfterMs, ActionClose},
	}
}

// CheckWire applies the spec's rules: at least one threshold, each positive
// (and below 2^53, which the decoder enforces), non-decreasing in the order
// pause, suspend, stop, close.
func (p *Policy) CheckWire() *wire.FieldError {
	var last *stage
	set := 0
	for _, s := range p.stages() {
		if s.threshold == nil {
			continue
		}
		set++
		if *s.threshold == 0 {
			return &wire.FieldError{Path: s.member, Problem: "must be positive"}
		}
		if *s.threshold > wire.MaxSafeInteger {
			return &wire.FieldError{Path: s.member, Problem: "must be below 2^53"}
		}
		if last != nil && *s.threshold < *last.threshold {
			return &wire.FieldError{Path: s.member, Problem: "must not be smaller than " + last.member}
		}
		st := s
		last = &st
	}
	if set == 0 {
		return &wire.FieldError{Problem: "must set at least one of pauseAfterMs, suspendAfterMs, stopAfterMs, closeAfterMs"}
	}
	return nil
}
