package incustest

import (
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
)

// FaultProxy starts a fault proxy in front of the test Incus (Socket),
// logging to the test, and closes it when the test ends: a close that
// fails (a request still held) fails the test.
func FaultProxy(t testing.TB) *incusfault.Proxy {
	t.Helper()
	p, err := incusfault.Start(t.Context(), incusfault.Config{Upstream: Socket(), Logf: t.Logf})
	if err != nil {
		t.Fatalf("incustest: fault proxy: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}
