// Package idlepolicy is the idle policy as the controller plane carries it:
// the wire type, its validation, and the rule that says which power-down
// stage is due after how long idle. It knows nothing of power-state names
// or of the loop that applies it (package idle), so that the controller's
// wire types, and with them the conformance suite meant for any provider,
// carry the policy without linking in the idle loop and its guest dialer.
package idlepolicy

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

// Stages is the set of power-down stages a template supports, read from
// its powerStates by idle.StagesOf (the names are the controller plane's,
// which this package cannot import). Close needs no power state and always
// qualifies.
type Stages uint8

// The power-down stages.
const (
	StagePause Stages = 1 << iota
	StageSuspend
	StageStop
)

// Allows says whether the stage acting as a may be taken: close always,
// a power-down only when the template offers its power state.
func (s Stages) Allows(a Action) bool {
	switch a {
	case ActionPause:
		return s&StagePause != 0
	case ActionSuspend:
		return s&StageSuspend != 0
	case ActionStop:
		return s&StageStop != 0
	case ActionClose:
		return true
	}
	return false
}

// DueAction is what the policy asks of a target that has been idle for
// idleForMs and stands at level `at` (ActionNone while running, else the
// action that powered it down): the most escalated stage whose threshold
// idleForMs has reached and which supported allows (close always
// qualifies), but only when it goes further than `at`; otherwise
// ActionNone. A nil policy asks nothing.
func (p *Policy) DueAction(idleForMs uint64, supported Stages, at Action) Action {
	if p == nil {
		return ActionNone
	}
	due := ActionNone
	for _, s := range p.stages() {
		if s.threshold != nil && idleForMs >= *s.threshold && supported.Allows(s.action) {
			due = s.action // stages run in escalating order: the last one reached wins
		}
	}
	if due <= at {
		return ActionNone
	}
	return due
}

// NextThreshold is the smallest idleForMs above the given one at which
// DueAction could ask something of a target at level `at`: the lowest
// threshold beyond idleForMs of a supported stage that goes further than
// `at`. ok is false when no later stage can ever become due.
func (p *Policy) NextThreshold(idleForMs uint64, supported Stages, at Action) (ms uint64, ok bool) {
	if p == nil {
		return 0, false
	}
	for _, s := range p.stages() {
		if s.threshold == nil || *s.threshold <= idleForMs || s.action <= at || !supported.Allows(s.action) {
			continue
		}
		if !ok || *s.threshold < ms {
			ms, ok = *s.threshold, true
		}
	}
	return ms, ok
}
