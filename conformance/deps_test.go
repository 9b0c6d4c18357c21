package conformance

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
)

// The suite is meant for any provider's controller, so neither it nor
// lsconform may link this provider's own parts: the idle loop and the guest
// dialer (netns, proxy devices) above all, which controller's wire types
// once pulled in through the idle policy. go list answers from the source,
// so an import added anywhere below the suite fails here.
func TestSuiteLinksNoProviderInternals(t *testing.T) {
	const module = "github.com/lightspeed-dev/incus-provider/"
	forbidden := []string{"guest", "idle", "targets", "incus", "routes", "templates"}
	cmd := exec.CommandContext(t.Context(), "go", "list", "-deps", "-f", "{{.ImportPath}}", ".", "../cmd/lsconform")
	out, err := cmd.Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			t.Fatalf("go list -deps: %v\n%s", err, exit.Stderr)
		}
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) == 0 {
		t.Fatal("go list -deps listed nothing")
	}
	for _, dep := range deps {
		rel, ok := strings.CutPrefix(dep, module)
		if !ok {
			continue
		}
		for _, f := range forbidden {
			if rel == f || strings.HasPrefix(rel, f+"/") {
				t.Errorf("the conformance suite depends on %s", dep)
			}
		}
	}
}
