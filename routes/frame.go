package routes

import "github.com/lightspeed-dev/incus-provider/internal/wsframe"

// Close codes the relay sends itself (RFC 6455, section 7.4.1), for callers
// of GoAway; the frame rules themselves live in internal/wsframe.
const (
	CloseNormal        = wsframe.CloseNormal
	CloseGoingAway     = wsframe.CloseGoingAway
	CloseProtocolError = wsframe.CloseProtocolError
	CloseTooBig        = wsframe.CloseTooBig
)
