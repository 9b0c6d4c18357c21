// Package testrig assembles a provider's parts on the real Incus for
// integration tests: a templates catalog resolved against the test image,
// and the GuestDialer. It exists so that every package's integration
// tests build the provider the same way main does.
package testrig

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// Catalog loads a templates file from body, in which every {{image}} stands
// for the test image alias, and resolves it against client.
func Catalog(t testing.TB, client *incus.Client, image, body string) *templates.Catalog {
	t.Helper()
	path := filepath.Join(t.TempDir(), "templates.yaml")
	if err := os.WriteFile(path, []byte(strings.ReplaceAll(body, "{{image}}", image)), 0o600); err != nil {
		t.Fatal(err)
	}
	cat, err := templates.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := cat.Resolve(ctx, client); err != nil {
		t.Fatal(err)
	}
	return cat
}

// EnvDialer picks the GuestDialer of the integration tests: netns (the
// default) or proxy, so that the suite runs with both against LXD.
const EnvDialer = "INCUS_PROVIDER_TEST_DIALER"

// GuestDialer is the tests' GuestDialer (EnvDialer), finding each
// instance's init PID through client.
func GuestDialer(t testing.TB, client *incus.Client) guest.Dialer {
	t.Helper()
	return GuestDialerOf(t, client, os.Getenv(EnvDialer))
}

// GuestDialerOf is GuestDialer of the kind named (empty: netns), for a test
// about one dialer's own behaviour.
func GuestDialerOf(t testing.TB, client *incus.Client, kind string) guest.Dialer {
	t.Helper()
	switch kind {
	case "":
		kind = guest.KindNetns
	case guest.KindNetns, guest.KindProxy:
	default:
		t.Fatalf("testrig: %s=%q: use netns or proxy", EnvDialer, kind)
	}
	// Short: a unix socket path holds at most 107 bytes, and t.TempDir's
	// names carry the test's.
	dir, err := os.MkdirTemp("", "lsp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	d, err := guest.New(kind, guest.Options{Lookup: client.InitPID, SocketDir: dir})
	if err != nil {
		t.Fatal(fmt.Errorf("testrig: %s dialer: %w", kind, err))
	}
	return d
}
