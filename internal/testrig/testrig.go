// Package testrig assembles a provider's parts on the real Incus for
// integration tests: a templates catalog resolved against the test image,
// and the netns GuestDialer. It exists so that every package's integration
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

// NetnsDialer is the default GuestDialer, finding each instance's init PID
// through client.
func NetnsDialer(t testing.TB, client *incus.Client) guest.Dialer {
	t.Helper()
	d, err := guest.New(guest.KindNetns, guest.Options{Lookup: client.InitPID, SocketDir: t.TempDir()})
	if err != nil {
		t.Fatal(fmt.Errorf("testrig: netns dialer: %w", err))
	}
	return d
}
