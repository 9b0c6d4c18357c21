package incustest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// recorder stands in for a testing.TB to see how the gate ends a test.
type recorder struct {
	testing.TB
	fatal, skip string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
	runtime.Goexit()
}
func (r *recorder) Skipf(format string, args ...any) {
	r.skip = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func gateOutcome(t *testing.T) *recorder {
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Server(r)
	}()
	<-done
	return r
}

func TestGateWithoutDaemon(t *testing.T) {
	t.Setenv(EnvSocket, t.TempDir()+"/no.sock")

	t.Setenv(EnvRequire, "")
	if r := gateOutcome(t); r.skip == "" || r.fatal != "" || !strings.Contains(r.skip, EnvRequire) {
		t.Errorf("no daemon, not required: want a skip naming %s, got skip %q fatal %q", EnvRequire, r.skip, r.fatal)
	}

	t.Setenv(EnvRequire, "1")
	if r := gateOutcome(t); r.fatal == "" || r.skip != "" {
		t.Errorf("no daemon, required: want fatal, got skip %q fatal %q", r.skip, r.fatal)
	}
}

// Client gives each test its own project and removes it, with whatever was
// left running in it, when the test ends.
func TestClientProjectLifecycle(t *testing.T) {
	var project string
	t.Run("inner", func(t *testing.T) {
		c := Client(t)
		project = c.Project()
		if !strings.HasPrefix(project, ProjectPrefix) {
			t.Fatalf("project %q", project)
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		op, err := c.CreateInstance(ctx, incus.InstancesPost{
			Name: "left-running", Source: incus.InstanceSource{Type: "image", Alias: Image(t)}, Start: true,
		})
		if err == nil {
			_, err = c.Wait(ctx, op)
		}
		if err != nil {
			t.Fatal(err)
		}
		// Left running on purpose: cleanup must deal with it.
	})
	if project == "" {
		return // skipped: no daemon
	}
	root := Server(t)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := root.GetProject(ctx, project); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("project %s still there after cleanup: %v", project, err)
	}
}
