package routes

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/wire"
)

// DefaultPrefix is the path under which data routes are served: the
// runtime's derived data route base is the controller's origin followed by
// "/routes".
const DefaultPrefix = "/routes"

// Route is what a data route's path names.
type Route struct {
	Owner    controller.Owner
	TargetID string
}

// PathError is a path that is not a data route. Status is the HTTP status to
// answer it with (404 for a path of the wrong shape, 400 for segments that
// do not decode to ids); the message is a sentence.
type PathError struct {
	Status  int
	Message string
}

func (e *PathError) Error() string { return e.Message }

// ParsePath reads a data route from a request's escaped path (as
// url.URL.EscapedPath returns it): prefix, then exactly three non-empty
// segments, each percent-decoded on its own, so an encoded "/" stays inside
// its segment. The universe and environment ids must match the Lightspeed
// id grammar, the target id must be 1 to 255 bytes without control
// characters.
func ParsePath(prefix, escapedPath string) (Route, error) {
	rest, ok := strings.CutPrefix(escapedPath, prefix+"/")
	if !ok {
		return Route{}, &PathError{Status: http.StatusNotFound,
			Message: fmt.Sprintf("Not a data route: data routes are %s/{universeId}/{environmentId}/{targetId}.", prefix)}
	}
	segs := strings.Split(rest, "/")
	if len(segs) != 3 || segs[0] == "" || segs[1] == "" || segs[2] == "" {
		return Route{}, &PathError{Status: http.StatusNotFound,
			Message: fmt.Sprintf("Not a data route: data routes are %s/{universeId}/{environmentId}/{targetId}, three non-empty segments.", prefix)}
	}
	names := [3]string{"universeId", "environmentId", "targetId"}
	var dec [3]string
	for i, s := range segs {
		v, err := url.PathUnescape(s)
		if err != nil {
			return Route{}, &PathError{Status: http.StatusBadRequest,
				Message: fmt.Sprintf("The %s segment of the data route is not validly percent-encoded.", names[i])}
		}
		grammar := wire.GrammarLightspeedID
		if i == 2 {
			grammar = wire.GrammarOpaque
		}
		if problem := wire.CheckGrammar(grammar, v); problem != "" {
			return Route{}, &PathError{Status: http.StatusBadRequest,
				Message: fmt.Sprintf("The %s segment of the data route %s.", names[i], problem)}
		}
		dec[i] = v
	}
	return Route{Owner: controller.Owner{UniverseID: dec[0], EnvironmentID: dec[1]}, TargetID: dec[2]}, nil
}

// Path is the escaped path of a data route under prefix: each segment
// percent-encoded, everything but RFC 3986 unreserved characters escaped.
func Path(prefix string, r Route) string {
	return prefix + "/" + escapeSegment(r.Owner.UniverseID) + "/" + escapeSegment(r.Owner.EnvironmentID) + "/" + escapeSegment(r.TargetID)
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
