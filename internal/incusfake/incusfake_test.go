package incusfake_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
)

const proj = "p1"

// start runs a fake for the test and a client of project p1 on it.
func start(t *testing.T, cfg incusfake.Config) (*incusfake.Server, *incus.Client) {
	t.Helper()
	cfg.Dir = t.TempDir()
	f, err := incusfake.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Error(err)
		}
	})
	f.SeedProject(proj, "", nil)
	c, err := incus.New(incus.Config{Socket: f.Socket(), Project: proj, CallTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return f, c
}

func manual() incusfake.Config { return incusfake.Config{ManualClock: true} }

// ctx bounds what a test waits for; a hang is a failure, not luck.
func ctx(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

// waitAsync runs Wait in the background, so that the test can move the
// manual clock while it waits.
func waitAsync(t *testing.T, c *incus.Client, op *incus.Operation) <-chan error {
	t.Helper()
	ch := make(chan error, 1)
	go func() {
		_, err := c.Wait(ctx(t), op)
		ch <- err
	}()
	return ch
}

func await(t *testing.T, f *incusfake.Server, what string, cond func() bool) {
	t.Helper()
	if err := f.Await(ctx(t), cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func mustInstance(t *testing.T, f *incusfake.Server, name string) incusfake.Instance {
	t.Helper()
	v, ok := f.Instance(proj, name)
	if !ok {
		t.Fatalf("instance %s missing", name)
	}
	return v
}

func TestCreateGetAndList(t *testing.T) {
	f, c := start(t, manual())
	op, err := c.CreateInstance(ctx(t), incus.InstancesPost{Name: "a", Source: incus.InstanceSource{Type: "none"},
		Config: map[string]string{"user.owner": "o1"}, Start: true})
	if err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.HeldBy != "create" || v.Status != incus.InstanceStopped {
		t.Fatalf("during its create: %+v", v)
	}
	done := waitAsync(t, c, op)
	f.Advance(incusfake.DefaultDuration)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	inst, etag, err := c.GetInstance(ctx(t), "a")
	if err != nil {
		t.Fatal(err)
	}
	if inst.Status != incus.InstanceRunning || inst.StatusCode != incus.StatusRunning || inst.Config["user.owner"] != "o1" {
		t.Fatalf("created: %+v", inst)
	}
	if v := mustInstance(t, f, "a"); etag != `"`+v.ETag+`"` || v.HeldBy != "" {
		t.Fatalf("ETag %s, fake holds %+v", etag, v)
	}
	list, err := c.ListInstances(ctx(t))
	if err != nil || len(list) != 1 || list[0].Name != "a" {
		t.Fatalf("list: %v %+v", err, list)
	}
	byOwner, err := c.ListInstancesWithConfig(ctx(t), "user.owner", "o1")
	if err != nil || len(byOwner) != 1 {
		t.Fatalf("filtered list: %v %+v", err, byOwner)
	}
	if none, err := c.ListInstancesWithConfig(ctx(t), "user.owner", "o2"); err != nil || len(none) != 0 {
		t.Fatalf("filtered list of nobody: %v %+v", err, none)
	}
	if found, err := c.FindInstance(ctx(t), "a"); err != nil || found == nil {
		t.Fatalf("find: %v %v", err, found)
	}
	if _, _, err := c.GetInstance(ctx(t), "nope"); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("missing instance: %v", err)
	}
	pid, _, err := c.LocatedInitPID(ctx(t), "a")
	if err != nil || pid <= 0 {
		t.Fatalf("init pid: %d %v", pid, err)
	}

	// Incus 6.0 takes a create for a taken name and fails its operation.
	op, err = c.CreateInstance(ctx(t), incus.InstancesPost{Name: "a", Source: incus.InstanceSource{Type: "none"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wait(ctx(t), op); !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("duplicate create: %v", err)
	}
	ws := f.Writes()
	if len(ws) != 2 || ws[0].Kind != incusfake.WriteCreate || ws[1].Kind != incusfake.WriteStart {
		t.Fatalf("writes: %+v", ws)
	}
}
