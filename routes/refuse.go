package routes

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/wake"
)

// The bounds the contract names for data routes (x-lightspeed-data-route).
const (
	// MaxHold is MAX_DATA_ROUTE_HOLD_MS: the longest a dial may be held
	// before it is upgraded or refused.
	MaxHold = 5 * time.Second
	// RetryAfterMax is RETRY_AFTER_MAX_SECS.
	RetryAfterMax = 60
)

// statusOf is the HTTP status the contract fixes for a refusal's state.
func statusOf(s wake.State) int {
	switch s {
	case wake.StateWaking, wake.StateBooting:
		return http.StatusServiceUnavailable
	case wake.StateGone:
		return http.StatusGone
	case wake.StateFailed:
		return http.StatusConflict
	}
	return http.StatusInternalServerError
}

// retryAfterSeconds is the Retry-After value of a 503: whole seconds from
// 1 to 60, rounded up.
func retryAfterSeconds(d time.Duration) int {
	s := int((d + time.Second - 1) / time.Second)
	return max(1, min(RetryAfterMax, s))
}

// refusalBody is the refusal's JSON body.
func refusalBody(r *wake.Refusal) []byte {
	body := struct {
		State   wake.State `json:"state"`
		Message string     `json:"message,omitempty"`
	}{State: r.State}
	if r.State == wake.StateFailed {
		body.Message = cleanText(r.Message)
		if body.Message == "" {
			body.Message = wake.DefaultFailedMessage
		}
	}
	b, _ := json.Marshal(body)
	return b
}

// writeRefusal answers a dial that is not upgraded: the status the
// refusal's state names, the typed JSON body (the message only with
// wake.StateFailed, which requires one), and Retry-After on a 503, in
// whole seconds from 1 to 60. It is an HTTP answer, never a JSON-RPC
// message.
func writeRefusal(w http.ResponseWriter, r *wake.Refusal) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	status := statusOf(r.State)
	if status == http.StatusServiceUnavailable {
		h.Set("Retry-After", strconv.Itoa(retryAfterSeconds(r.RetryAfter)))
	}
	body := refusalBody(r)
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

func refuse(state wake.State, retry time.Duration) *wake.Refusal {
	return &wake.Refusal{State: state, RetryAfter: retry}
}
