package incusfault_test

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
)

func TestMatch(t *testing.T) {
	for _, c := range []struct {
		pattern, path string
		want          bool
	}{
		{"", "/1.0/anything", true},
		{"/1.0", "/1.0", true},
		{"/1.0", "/1.0/instances", false},
		{"/1.0/instances/*/state", "/1.0/instances/ls-1/state", true},
		{"/1.0/instances/*/state", "/1.0/instances/ls-1", false},
		{"/1.0/instances/*/state", "/1.0/instances/a/b/state", false},
		{"/1.0/instances/*", "/1.0/instances/ls-1", true},
		{"/1.0/instances/*", "/1.0/instances", false},
		{"/1.0/instances/**", "/1.0/instances", true},
		{"/1.0/instances/**", "/1.0/instances/x/state", true},
		{"/1.0/instances/**", "/1.0/instancesx", false},
		{"/1.0/operations/*/wait", "/1.0/operations/0b1f-22/wait", true},
		{"/1.0/instances/ls-?", "/1.0/instances/ls-1", true},
		{"/1.0/[", "/1.0/[", false},
	} {
		if got := incusfault.Match(c.pattern, c.path); got != c.want {
			t.Errorf("Match(%q, %q) = %v, want %v", c.pattern, c.path, got, c.want)
		}
	}
}

// A rule that cannot mean anything is refused at once rather than never
// firing.
func TestAddRefusesMalformedRules(t *testing.T) {
	p, err := incusfault.Start(t.Context(), incusfault.Config{Upstream: t.TempDir() + "/none.sock"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, c := range []struct {
		rule incusfault.Rule
		want string
	}{
		{incusfault.Rule{Path: "/1.0"}, "unknown fault"},
		{incusfault.Rule{Fault: incusfault.Delay}, "positive Delay"},
		{incusfault.Rule{Fault: incusfault.Linger}, "linger rule needs a positive Delay"},
		{incusfault.Rule{Fault: incusfault.Fail, Status: 200}, "400–599"},
		{incusfault.Rule{Fault: incusfault.Refuse, Times: -1}, "Times"},
		{incusfault.Rule{Fault: incusfault.Refuse, Probability: 1.5}, "Probability"},
		{incusfault.Rule{Fault: incusfault.Refuse, Path: "/1.0/**/state"}, "last segment"},
		{incusfault.Rule{Fault: incusfault.Refuse, Path: "/1.0/["}, "syntax error"},
	} {
		got := func() (msg string) {
			defer func() { msg, _ = recover().(string) }()
			p.Add(c.rule)
			return ""
		}()
		if !strings.Contains(got, c.want) {
			t.Errorf("Add(%+v): panic %q, want one saying %q", c.rule, got, c.want)
		}
	}
}

// Start must never take over a path that is already a socket: pointed at
// the Incus socket by mistake, it would unlink the daemon's.
func TestStartKeepsAnExistingSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if p, err := incusfault.Start(t.Context(), incusfault.Config{Socket: path}); err == nil {
		p.Close()
		t.Fatal("Start on an existing socket: want an error")
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the existing socket is gone: %v", err)
	}
}
