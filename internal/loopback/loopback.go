// Package loopback hands tests addresses on 127.0.0.1.
package loopback

import (
	"context"
	"net"
	"testing"
)

// FreeAddr is a loopback host:port that nothing listens on now: the kernel
// gave it out and it was closed again. A test binds it next (a provider's
// listener) or dials it to be refused (a member that is down).
func FreeAddr(t testing.TB) string {
	t.Helper()
	var lc net.ListenConfig
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}
