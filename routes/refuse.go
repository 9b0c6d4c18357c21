package routes

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// The bounds the contract names for data routes (x-lightspeed-data-route).
const (
	// MaxHold is MAX_DATA_ROUTE_HOLD_MS: the longest a dial may be held
	// before it is upgraded or refused.
	MaxHold = 5 * time.Second
	// RetryAfterMax is RETRY_AFTER_MAX_SECS.
	RetryAfterMax = 60
)

// State tags a refusal body.
type State string

// The provider's refusal states.
const (
	StateWaking  State = "waking"  // 503: resuming from a powered-down state
	StateBooting State = "booting" // 503: running, the daemon does not answer yet
	StateGone    State = "gone"    // 410: the target no longer exists
	StateFailed  State = "failed"  // 409: broken beyond the provider's recovery
)

// Status is the HTTP status the contract fixes for the state.
func (s State) Status() int {
	switch s {
	case StateWaking, StateBooting:
		return http.StatusServiceUnavailable
	case StateGone:
		return http.StatusGone
	case StateFailed:
		return http.StatusConflict
	}
	return http.StatusInternalServerError
}

// Refusal is a typed answer to a dial that is not upgraded.
type Refusal struct {
	State State
	// Message is sent only with StateFailed (required there).
	Message string
	// RetryAfter is sent with every 503, clamped to 1..60 whole seconds.
	RetryAfter time.Duration
}

func (r *Refusal) Error() string {
	s := "data route refused: " + string(r.State)
	if r.Message != "" {
		s += ": " + r.Message
	}
	return s
}

// defaultFailedMessage stands in for a failure the observation did not explain.
const defaultFailedMessage = "The target is broken beyond the provider's recovery."

// retryAfterSeconds is the Retry-After value of a 503: whole seconds from
// 1 to 60, rounded up.
func retryAfterSeconds(d time.Duration) int {
	s := int((d + time.Second - 1) / time.Second)
	return max(1, min(RetryAfterMax, s))
}

// Body is the refusal's JSON body.
func (r *Refusal) Body() []byte {
	body := struct {
		State   State  `json:"state"`
		Message string `json:"message,omitempty"`
	}{State: r.State}
	if r.State == StateFailed {
		body.Message = cleanText(r.Message)
		if body.Message == "" {
			body.Message = defaultFailedMessage
		}
	}
	b, _ := json.Marshal(body)
	return b
}

// Write answers the refusal: the status its state names, the typed JSON
// body, and Retry-After on a 503. It is an HTTP answer, never a JSON-RPC
// message.
func (r *Refusal) Write(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	status := r.State.Status()
	if status == http.StatusServiceUnavailable {
		h.Set("Retry-After", strconv.Itoa(retryAfterSeconds(r.RetryAfter)))
	}
	body := r.Body()
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// cleanText makes s valid descriptive text: 1 to 1024 bytes of UTF-8
// without control characters other than line feed and tab ("" when nothing
// is left).
func cleanText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	var b strings.Builder
	for _, r := range s {
		control := r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0)
		if !control || r == '\n' || r == '\t' {
			if b.Len()+utf8.RuneLen(r) > 1024 {
				break
			}
			b.WriteRune(r)
		}
	}
	return strings.TrimSpace(b.String())
}

func refuse(state State, retry time.Duration) *Refusal {
	return &Refusal{State: state, RetryAfter: retry}
}
