package routes

import (
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/routepath"
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
type PathError = routepath.Error

// ParsePath reads a data route from a request's escaped path (as
// url.URL.EscapedPath returns it): prefix, then exactly three non-empty
// segments, each percent-decoded on its own, so an encoded "/" stays inside
// its segment. The universe and environment ids must match the Lightspeed
// id grammar, the target id must be 1 to 255 bytes without control
// characters. A refusal is a *PathError. The parser is
// internal/routepath's, which its fuzz target holds to the contract.
func ParsePath(prefix, escapedPath string) (Route, error) {
	ids, err := routepath.Parse(prefix, escapedPath)
	if err != nil {
		return Route{}, err
	}
	return Route{Owner: controller.Owner{UniverseID: ids.UniverseID, EnvironmentID: ids.EnvironmentID}, TargetID: ids.TargetID}, nil
}

// Path is the escaped path of a data route under prefix: each segment
// percent-encoded, everything but RFC 3986 unreserved characters escaped.
func Path(prefix string, r Route) string {
	return routepath.Format(prefix, routepath.IDs{UniverseID: r.Owner.UniverseID, EnvironmentID: r.Owner.EnvironmentID, TargetID: r.TargetID})
}
