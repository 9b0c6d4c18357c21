// Package clock holds the one context-aware sleep the provider's packages
// share, so that every wait between polls ends as soon as its caller gives
// up and leaves no timer behind.
package clock

import (
	"context"
	"time"
)

// Sleep waits d, or until ctx ends, whichever is first; it reports whether
// d passed, false when ctx ended first. The timer is stopped on the way
// out, so that a wait its caller gave up on leaves nothing pending.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
