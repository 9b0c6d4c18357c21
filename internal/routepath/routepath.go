// Package routepath reads and writes the path of a data route,
// {prefix}/{universeId}/{environmentId}/{targetId}, each segment
// percent-encoded on its own. It is the routes package's parser, apart so
// that it can be fuzzed in a test binary of its own size: go test -fuzz
// walks every coverage counter of the binary on each execution, and the
// routes binary has some 70,000 of them. For the same reason it does not
// import net/http for the two statuses it names.
package routepath

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// The HTTP statuses of a refusal (http.StatusNotFound, http.StatusBadRequest).
const (
	StatusNotFound   = 404
	StatusBadRequest = 400
)

// IDs are what a data route's path names.
type IDs struct {
	UniverseID    string
	EnvironmentID string
	TargetID      string
}

// Error is a path that is not a data route. Status is the HTTP status to
// answer it with (404 for a path of the wrong shape, 400 for segments that
// do not decode to ids); the message is a sentence.
type Error struct {
	Status  int
	Message string
}

func (e *Error) Error() string { return e.Message }

// Parse reads a data route from a request's escaped path (as
// url.URL.EscapedPath returns it): prefix, then exactly three non-empty
// segments, each percent-decoded on its own, so an encoded "/" stays inside
// its segment. The universe and environment ids must match the Lightspeed
// id grammar, the target id must be 1 to 255 bytes without control
// characters. A refusal is an *Error.
func Parse(prefix, escapedPath string) (IDs, error) {
	rest, ok := strings.CutPrefix(escapedPath, prefix+"/")
	if !ok {
		return IDs{}, &Error{Status: StatusNotFound,
			Message: fmt.Sprintf("Not a data route: data routes are %s/{universeId}/{environmentId}/{targetId}.", prefix)}
	}
	segs := strings.Split(rest, "/")
	if len(segs) != 3 || segs[0] == "" || segs[1] == "" || segs[2] == "" {
		return IDs{}, &Error{Status: StatusNotFound,
			Message: fmt.Sprintf("Not a data route: data routes are %s/{universeId}/{environmentId}/{targetId}, three non-empty segments.", prefix)}
	}
	names := [3]string{"universeId", "environmentId", "targetId"}
	var dec [3]string
	for i, s := range segs {
		v, err := url.PathUnescape(s)
		if err != nil {
			return IDs{}, &Error{Status: StatusBadRequest,
				Message: fmt.Sprintf("The %s segment of the data route is not validly percent-encoded.", names[i])}
		}
		grammar := wire.GrammarLightspeedID
		if i == 2 {
			grammar = wire.GrammarOpaque
		}
		if problem := wire.CheckGrammar(grammar, v); problem != "" {
			return IDs{}, &Error{Status: StatusBadRequest,
				Message: fmt.Sprintf("The %s segment of the data route %s.", names[i], problem)}
		}
		dec[i] = v
	}
	return IDs{UniverseID: dec[0], EnvironmentID: dec[1], TargetID: dec[2]}, nil
}

// Format is the escaped path of a data route under prefix: each segment
// percent-encoded, everything but RFC 3986 unreserved characters escaped,
// so that no proxy or client normalises it into another route.
func Format(prefix string, ids IDs) string {
	return prefix + "/" + escapeSegment(ids.UniverseID) + "/" + escapeSegment(ids.EnvironmentID) + "/" + escapeSegment(ids.TargetID)
}

func escapeSegment(s string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}
