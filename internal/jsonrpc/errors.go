package jsonrpc

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// Kind is an error's authoritative type: receivers branch on it, never on
// the numeric code or the message.
type Kind string

// The protocol's error kinds, each with the code the spec fixes for it.
const (
	KindParseError            Kind = "parseError"
	KindInvalidRequest        Kind = "invalidRequest"
	KindMethodNotFound        Kind = "methodNotFound"
	KindInvalidParams         Kind = "invalidParams"
	KindInternal              Kind = "internal"
	KindNotInitialized        Kind = "notInitialized"
	KindPermissionDenied      Kind = "permissionDenied"
	KindNotFound              Kind = "notFound"
	KindVersionMismatch       Kind = "versionMismatch"
	KindCapabilityUnavailable Kind = "capabilityUnavailable"
	KindFailedPrecondition    Kind = "failedPrecondition"
	KindBusy                  Kind = "busy"
	KindAlreadyExists         Kind = "alreadyExists"
	KindPayloadTooLarge       Kind = "payloadTooLarge"
	KindDeadlineExceeded      Kind = "deadlineExceeded"
	KindExpired               Kind = "expired"
	KindAborted               Kind = "aborted"
	KindProcessFailed         Kind = "processFailed"
	KindUnavailable           Kind = "unavailable"
)

var codes = map[Kind]int{
	KindParseError:            -32700,
	KindInvalidRequest:        -32600,
	KindMethodNotFound:        -32601,
	KindInvalidParams:         -32602,
	KindInternal:              -32603,
	KindNotInitialized:        -32002,
	KindPermissionDenied:      -32003,
	KindNotFound:              -32004,
	KindVersionMismatch:       -32005,
	KindCapabilityUnavailable: -32006,
	KindFailedPrecondition:    -32007,
	KindBusy:                  -32008,
	KindAlreadyExists:         -32009,
	KindPayloadTooLarge:       -32013,
	KindDeadlineExceeded:      -32015,
	KindExpired:               -32016,
	KindAborted:               -32017,
	KindProcessFailed:         -32018,
	KindUnavailable:           -32019,
}

// Kinds lists every kind, for tests and metrics that must cover them all.
func Kinds() []Kind {
	out := make([]Kind, 0, len(codes))
	for k := range codes {
		out = append(out, k)
	}
	return out
}

// Code is the JSON-RPC code the spec fixes for a kind (internal's for an unknown one).
func (k Kind) Code() int {
	if c, ok := codes[k]; ok {
		return c
	}
	return codes[KindInternal]
}

// MaxMessageLen bounds an error message; longer text is cut at a rune boundary.
const MaxMessageLen = 4096

// Error is a protocol error: a kind, a sentence a person can act on, and the
// kind's typed fields. Fields that do not belong to the kind stay empty.
type Error struct {
	Kind         Kind
	Message      string
	Field        string  // invalidParams
	Ceiling      *uint64 // invalidParams
	Reason       string  // permissionDenied, notFound, capabilityUnavailable (as capability), failedPrecondition, busy, aborted
	Expected     *uint64 // versionMismatch
	Received     *uint64 // versionMismatch
	Capability   string  // capabilityUnavailable
	RetryAfterMs *uint64 // busy, unavailable
	LimitBytes   *uint64 // payloadTooLarge
	LimitEntries *uint64 // payloadTooLarge
}

func (e *Error) Error() string { return string(e.Kind) + ": " + e.Message }

// Errorf makes an error of a kind with no typed fields.
func Errorf(kind Kind, format string, args ...any) *Error {
	return &Error{Kind: kind, Message: fmt.Sprintf(format, args...)}
}

// InvalidParams names the wire path of the offending member.
func InvalidParams(field, format string, args ...any) *Error {
	return &Error{Kind: KindInvalidParams, Field: field, Message: fmt.Sprintf(format, args...)}
}

// WithReason makes an error whose kind carries a reason (notFound,
// failedPrecondition, permissionDenied, busy, aborted).
func WithReason(kind Kind, reason, format string, args ...any) *Error {
	return &Error{Kind: kind, Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// Unavailable says a dependency is unreachable and when to try again.
func Unavailable(retryAfter uint64, format string, args ...any) *Error {
	return &Error{Kind: KindUnavailable, RetryAfterMs: &retryAfter, Message: fmt.Sprintf(format, args...)}
}

// CapabilityUnavailable names the capability family the request needs.
func CapabilityUnavailable(capability, format string, args ...any) *Error {
	return &Error{Kind: KindCapabilityUnavailable, Capability: capability, Message: fmt.Sprintf(format, args...)}
}

// FromFieldError turns a strict-decoding refusal into invalidParams.
func FromFieldError(err error) *Error {
	var fe *wire.FieldError
	if errors.As(err, &fe) {
		if fe.Path == "" {
			return InvalidParams("", "The params %s.", fe.Problem)
		}
		return InvalidParams(fe.Path, "The member %s %s.", fe.Path, fe.Problem)
	}
	return InvalidParams("", "The params do not decode: %v.", err)
}

// ErrorData is an error object's data: the kind and its typed fields.
type ErrorData struct {
	Kind         Kind    `json:"kind"`
	Field        string  `json:"field,omitempty"`
	Ceiling      *uint64 `json:"ceiling,omitempty"`
	Reason       string  `json:"reason,omitempty"`
	Expected     *uint64 `json:"expected,omitempty"`
	Received     *uint64 `json:"received,omitempty"`
	Capability   string  `json:"capability,omitempty"`
	RetryAfterMs *uint64 `json:"retryAfterMs,omitempty"`
	LimitBytes   *uint64 `json:"limitBytes,omitempty"`
	LimitEntries *uint64 `json:"limitEntries,omitempty"`
}

// ErrorObject is the protocol's error object as it goes on the wire, also
// where a result carries one for a part that failed (a daemon's fs/scan
// root).
type ErrorObject struct {
	Code    int       `json:"code"`
	Message string    `json:"message"`
	Data    ErrorData `json:"data"`
}

// MarshalJSON renders the JSON-RPC error object.
func (e *Error) MarshalJSON() ([]byte, error) {
	return json.Marshal(e.Object())
}

// Object is e as the error object a peer reads: a kind the protocol does
// not define goes out as internal, and the message is made valid UTF-8 and
// cut to the limit.
func (e *Error) Object() ErrorObject {
	// Invalid UTF-8 would be re-encoded as U+FFFD (three bytes per bad byte)
	// and could push the message the peer reads past the limit.
	msg := strings.ToValidUTF8(e.Message, "\uFFFD")
	if _, known := codes[e.Kind]; !known {
		// A kind the protocol does not define would reach the peer as a code
		// and a kind that disagree; it is a defect, so it goes out as one.
		if msg == "" {
			msg = string(KindInternal)
		}
		return ErrorObject{Code: KindInternal.Code(), Message: cut(msg, MaxMessageLen), Data: ErrorData{Kind: KindInternal}}
	}
	if msg == "" {
		msg = string(e.Kind)
	}
	return ErrorObject{
		Code:    e.Kind.Code(),
		Message: cut(msg, MaxMessageLen),
		Data: ErrorData{
			Kind: e.Kind, Field: e.Field, Ceiling: e.Ceiling, Reason: e.Reason,
			Expected: e.Expected, Received: e.Received, Capability: e.Capability,
			RetryAfterMs: e.RetryAfterMs, LimitBytes: e.LimitBytes, LimitEntries: e.LimitEntries,
		},
	}
}

// UnmarshalJSON reads an error object strictly; the kind decides, the code is checked against it.
func (e *Error) UnmarshalJSON(data []byte) error {
	var obj ErrorObject
	if err := wire.Decode(data, &obj); err != nil {
		return err
	}
	if _, known := codes[obj.Data.Kind]; !known {
		return &wire.FieldError{Path: "data.kind", Problem: fmt.Sprintf("names an unknown kind %q", obj.Data.Kind)}
	}
	if obj.Code != obj.Data.Kind.Code() {
		return &wire.FieldError{Path: "code", Problem: fmt.Sprintf("is %d, but kind %s has code %d", obj.Code, obj.Data.Kind, obj.Data.Kind.Code())}
	}
	d := obj.Data
	*e = Error{Kind: d.Kind, Message: obj.Message, Field: d.Field, Ceiling: d.Ceiling, Reason: d.Reason,
		Expected: d.Expected, Received: d.Received, Capability: d.Capability, RetryAfterMs: d.RetryAfterMs,
		LimitBytes: d.LimitBytes, LimitEntries: d.LimitEntries}
	return nil
}

func cut(s string, most int) string {
	if len(s) <= most {
		return s
	}
	const ellipsis = "…"
	n := most - len(ellipsis)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + ellipsis
}

func u64(v uint64) *uint64 { return &v }
