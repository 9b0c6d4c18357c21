package incus

import "time"

// SetEventKeepalive shrinks the event stream's keep-alive for a test and
// returns what restores it.
func SetEventKeepalive(ping, silence time.Duration) (restore func()) {
	p, s := eventPing, eventSilence
	eventPing, eventSilence = ping, silence
	return func() { eventPing, eventSilence = p, s }
}
