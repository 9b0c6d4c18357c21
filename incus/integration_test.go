package incus_test

// Tests against the real incusd (see internal/incustest for the gate and the
// throwaway project). Each test works in its own lsit-* project.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// create makes a stopped instance from the test image and waits for it.
func create(t *testing.T, ctx context.Context, c *incus.Client, name string) time.Duration {
	t.Helper()
	start := time.Now()
	op, err := c.CreateInstance(ctx, incus.InstancesPost{
		Name:   name,
		Source: incus.InstanceSource{Type: "image", Alias: incustest.Image(t)},
		Config: map[string]string{"user.lsit": "1"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if op.ID == "" {
		t.Fatalf("create returned no operation: %+v", op)
	}
	if _, err := c.Wait(ctx, op); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}

// state runs a state change to completion and returns how long it took.
func state(t *testing.T, ctx context.Context, c *incus.Client, name string, req incus.InstanceStatePut) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	op, err := c.UpdateInstanceState(ctx, name, req)
	if err != nil {
		return time.Since(start), err
	}
	_, err = c.Wait(ctx, op)
	return time.Since(start), err
}

func mustStatus(t *testing.T, ctx context.Context, c *incus.Client, name string, want incus.StatusCode) {
	t.Helper()
	st, err := c.GetInstanceState(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.StatusCode != want {
		t.Fatalf("%s: status %s (%d), want %d", name, st.Status, st.StatusCode, want)
	}
}

func TestIntegrationServer(t *testing.T) {
	c := incustest.Server(t)
	s, err := c.GetServer(ctxFor(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if s.Auth != "trusted" || s.Environment.Server != "incus" || s.Environment.ServerVersion == "" {
		t.Errorf("server %+v", s.Environment)
	}
	for _, ext := range []string{"operation_wait", "projects", "instances", "patch", "etag"} {
		if !s.HasExtension(ext) {
			t.Errorf("server lacks API extension %q", ext)
		}
	}
	t.Logf("Incus %s, driver %s %s", s.Environment.ServerVersion, s.Environment.Driver, s.Environment.DriverVersion)
}

// The full life of a container: create (stopped), start, freeze, unfreeze,
// clean stop with a timeout, force stop, delete.
func TestIntegrationLifecycle(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, 3*time.Minute)
	const name = "life"

	took := create(t, ctx, c, name)
	t.Logf("create (start:false) + wait: %s", took)
	inst, etag, err := c.GetInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if inst.StatusCode != incus.StatusStopped || inst.Type != "container" || inst.Project != c.Project() ||
		inst.Config["user.lsit"] != "1" || etag == "" || !slices.Contains(inst.Profiles, "default") {
		t.Fatalf("created instance %+v etag %q", inst, etag)
	}
	ex, err := c.GetInstanceExpanded(ctx, inst.Name)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := ex.ExpandedDevices["root"]; !ok {
		t.Errorf("default profile's root disk should apply in a features.profiles=false project: %v", ex.ExpandedDevices)
	}

	list, err := c.ListInstances(ctx)
	if err != nil || len(list) != 1 || list[0].Name != name {
		t.Fatalf("list: %v %v", list, err)
	}
	// The streamed listing decodes what the whole one does.
	kept, err := c.ListInstancesKept(ctx, func(inst *incus.Instance) *incus.Instance { return inst })
	if err != nil || len(kept) != 1 || kept[0].Name != name || kept[0].Status != list[0].Status ||
		kept[0].Config["user.lsit"] != "1" || !kept[0].CreatedAt.Equal(list[0].CreatedAt) {
		t.Fatalf("kept list: %+v %v, whole %+v", kept, err, list)
	}

	took, err = state(t, ctx, c, name, incus.InstanceStatePut{Action: "start"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("start: %s", took)
	st, err := c.GetInstanceState(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.StatusCode != incus.StatusRunning || st.Pid <= 0 {
		t.Fatalf("after start: %+v", st)
	}

	// Starting it again is accepted, and the operation fails.
	_, err = state(t, ctx, c, name, incus.InstanceStatePut{Action: "start"})
	var oe *incus.OperationError
	if !errors.As(err, &oe) || oe.StatusCode != incus.StatusFailure {
		t.Fatalf("second start: want a failed operation, got %v", err)
	}

	// A running instance cannot be deleted.
	_, err = c.DeleteInstance(ctx, name)
	var ie *incus.Error
	if !errors.As(err, &ie) || ie.Status != 400 || incus.IsRetryable(err) {
		t.Fatalf("delete while running: want 400, got %v", err)
	}

	took, err = state(t, ctx, c, name, incus.InstanceStatePut{Action: "freeze"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("freeze: %s", took)
	mustStatus(t, ctx, c, name, incus.StatusFrozen)

	took, err = state(t, ctx, c, name, incus.InstanceStatePut{Action: "unfreeze"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("unfreeze: %s", took)
	mustStatus(t, ctx, c, name, incus.StatusRunning)

	// A clean stop with a timeout. An init that handles SIGPWR stops; one
	// that ignores it makes the operation fail once the timeout is up and
	// leaves the instance running (Incus does not kill it).
	took, err = state(t, ctx, c, name, incus.InstanceStatePut{Action: "stop", Timeout: 20})
	switch {
	case err == nil:
		t.Logf("stop (timeout 20s, clean): %s", took)
		mustStatus(t, ctx, c, name, incus.StatusStopped)
		if _, err := state(t, ctx, c, name, incus.InstanceStatePut{Action: "start"}); err != nil {
			t.Fatal(err)
		}
	case errors.As(err, &oe):
		t.Logf("stop (timeout 20s): image ignored SIGPWR, operation failed after %s: %v", took, err)
		if took < 19*time.Second {
			t.Errorf("clean stop gave up after %s, before its 20s timeout", took)
		}
		mustStatus(t, ctx, c, name, incus.StatusRunning)
	default:
		t.Fatal(err)
	}

	took, err = state(t, ctx, c, name, incus.InstanceStatePut{Action: "stop", Force: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("force stop: %s", took)
	mustStatus(t, ctx, c, name, incus.StatusStopped)

	start := time.Now()
	op, err := c.DeleteInstance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wait(ctx, op); err != nil {
		t.Fatal(err)
	}
	t.Logf("delete + wait: %s", time.Since(start))

	_, _, err = c.GetInstance(ctx, name)
	if !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("after delete: want ErrNotFound, got %v", err)
	}
}

func TestIntegrationNotFound(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, 30*time.Second)

	_, _, err := c.GetInstance(ctx, "nope")
	if !errors.Is(err, incus.ErrNotFound) || incus.IsRetryable(err) {
		t.Fatalf("GetInstance: %v", err)
	}
	if !strings.Contains(err.Error(), `incus: get instance "nope"`) {
		t.Errorf("error lacks context: %v", err)
	}
	if _, err := c.GetInstanceState(ctx, "nope"); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("GetInstanceState: %v", err)
	}
	if _, err := c.DeleteInstance(ctx, "nope"); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("DeleteInstance: %v", err)
	}
	if _, err := c.UpdateInstanceState(ctx, "nope", incus.InstanceStatePut{Action: "start"}); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("UpdateInstanceState: %v", err)
	}
	if err := c.PatchInstanceConfig(ctx, "nope", map[string]string{"user.a": "1"}); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("PatchInstanceConfig: %v", err)
	}
	if _, err := c.GetOperation(ctx, "00000000-0000-0000-0000-000000000000"); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("GetOperation: %v", err)
	}
	_, err = c.Wait(ctx, &incus.Operation{ID: "00000000-0000-0000-0000-000000000000", StatusCode: incus.StatusRunning})
	if !errors.Is(err, incus.ErrOperationLost) || errors.Is(err, incus.ErrNotFound) {
		t.Errorf("Wait on unknown op: %v", err)
	}
	if _, err := c.GetProject(ctx, "lsit-does-not-exist"); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("GetProject: %v", err)
	}
	// Incus 6.0.4 does not check the project on list calls: a missing
	// project lists as empty (see ListInstances).
	if list, err := c.WithProject("lsit-does-not-exist").ListInstances(ctx); err != nil || len(list) != 0 {
		t.Errorf("ListInstances in a missing project: %v %v", list, err)
	}
	if _, err := c.WithProject("lsit-does-not-exist").CreateInstance(ctx, incus.InstancesPost{Name: "x", Source: incus.InstanceSource{Type: "none"}}); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("CreateInstance in a missing project: %v", err)
	}
}

// Creating a name that exists. Incus 6.0.4 accepts the second create (202)
// and fails its operation with "UNIQUE constraint failed: instances.project_id,
// instances.name"; newer releases refuse it at once. Either way the error
// matches ErrConflict, and the existing instance is left as it was.
func TestIntegrationDuplicateName(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, time.Minute)
	create(t, ctx, c, "dup")
	if err := c.PatchInstanceConfig(ctx, "dup", map[string]string{"user.mark": "first"}); err != nil {
		t.Fatal(err)
	}

	op, err := c.CreateInstance(ctx, incus.InstancesPost{
		Name:   "dup",
		Source: incus.InstanceSource{Type: "image", Alias: incustest.Image(t)},
	})
	where := "refused synchronously"
	if err == nil {
		where = "accepted, operation failed"
		_, err = c.Wait(ctx, op)
	}
	if err == nil {
		t.Fatal("second create of the same name succeeded")
	}
	if !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("want ErrConflict, got %v", err)
	}
	if incus.IsRetryable(err) {
		t.Errorf("a conflict is not retryable: %v", err)
	}
	t.Logf("duplicate name: %s: %v", where, err)

	inst, _, err := c.GetInstance(ctx, "dup")
	if err != nil {
		t.Fatal(err)
	}
	if inst.Config["user.mark"] != "first" || inst.StatusCode != incus.StatusStopped {
		t.Fatalf("existing instance disturbed: %+v", inst)
	}
	if _, err := state(t, ctx, c, "dup", incus.InstanceStatePut{Action: "start"}); err != nil {
		t.Fatalf("existing instance no longer starts: %v", err)
	}
}

// PATCH {"config": {...}} merges: keys not named are kept, including the
// volatile ones; an empty value removes a key.
func TestIntegrationPatchMerges(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, time.Minute)
	create(t, ctx, c, "patch")
	before, _, err := c.GetInstance(ctx, "patch")
	if err != nil {
		t.Fatal(err)
	}

	for _, set := range []map[string]string{{"user.a": "1"}, {"user.b": "2"}, {"user.b": "3", "user.c": "4"}} {
		if err := c.PatchInstanceConfig(ctx, "patch", set); err != nil {
			t.Fatal(err)
		}
	}
	after, _, err := c.GetInstance(ctx, "patch")
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"user.lsit": "1", "user.a": "1", "user.b": "3", "user.c": "4"} {
		if after.Config[k] != v {
			t.Errorf("config %s = %q, want %q", k, after.Config[k], v)
		}
	}
	for k, v := range before.Config {
		if strings.HasPrefix(k, "volatile.") && after.Config[k] != v {
			t.Errorf("PATCH changed %s: %q -> %q", k, v, after.Config[k])
		}
	}
	if !slices.Equal(after.Profiles, before.Profiles) {
		t.Errorf("PATCH of config changed profiles: %v -> %v", before.Profiles, after.Profiles)
	}

	if err := c.PatchInstanceConfig(ctx, "patch", map[string]string{"user.a": ""}); err != nil {
		t.Fatal(err)
	}
	after, _, _ = c.GetInstance(ctx, "patch")
	if _, ok := after.Config["user.a"]; ok || after.Config["user.b"] != "3" {
		t.Errorf("empty value should remove only that key: %v", after.Config)
	}
}

// PUT with If-Match: a stale ETag is refused with 412, a fresh one applies.
func TestIntegrationUpdateInstanceETag(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, time.Minute)
	create(t, ctx, c, "etag")

	inst, etag, err := c.GetInstance(ctx, "etag")
	if err != nil {
		t.Fatal(err)
	}
	// Someone else changes the instance in between.
	if err := c.PatchInstanceConfig(ctx, "etag", map[string]string{"user.other": "x"}); err != nil {
		t.Fatal(err)
	}
	put := inst.Writable()
	put.Config["user.mine"] = "y"
	put.Description = "mine"
	err = c.UpdateInstance(ctx, "etag", put, etag)
	if !errors.Is(err, incus.ErrPreconditionFailed) {
		t.Fatalf("stale ETag: want ErrPreconditionFailed, got %v", err)
	}
	if incus.IsRetryable(err) {
		t.Errorf("412 is not retryable as is: %v", err)
	}

	inst, etag, err = c.GetInstance(ctx, "etag")
	if err != nil {
		t.Fatal(err)
	}
	put = inst.Writable()
	put.Config["user.mine"] = "y"
	put.Description = "mine"
	if err := c.UpdateInstance(ctx, "etag", put, etag); err != nil {
		t.Fatal(err)
	}
	got, newTag, err := c.GetInstance(ctx, "etag")
	if err != nil {
		t.Fatal(err)
	}
	if got.Config["user.mine"] != "y" || got.Config["user.other"] != "x" || got.Description != "mine" || newTag == etag {
		t.Fatalf("after PUT: %v %q etag %q", got.Config, got.Description, newTag)
	}

	// A PUT is a replacement: dropping the volatile keys is refused, and the
	// refusal comes from the operation.
	err = c.UpdateInstance(ctx, "etag", incus.InstancePut{Config: map[string]string{"user.only": "1"}, Profiles: []string{"default"}}, "")
	var oe *incus.OperationError
	if !errors.As(err, &oe) {
		t.Fatalf("PUT without volatile keys: want a failed operation, got %v", err)
	}
	t.Logf("PUT without volatile keys: %v", err)
}

// A running operation shows in ListOperations, and Wait follows it across
// more than one server-side wait round. A clean stop of a frozen instance
// cannot complete (its processes cannot react), so it runs for exactly its
// timeout whatever the image's init does.
func TestIntegrationListOperationsAndLongWait(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, 2*time.Minute)
	create(t, ctx, c, "ops")
	if _, err := state(t, ctx, c, "ops", incus.InstanceStatePut{Action: "start"}); err != nil {
		t.Fatal(err)
	}
	if _, err := state(t, ctx, c, "ops", incus.InstanceStatePut{Action: "freeze"}); err != nil {
		t.Fatal(err)
	}

	const stopTimeout = 7 // longer than one wait round (5s)
	start := time.Now()
	op, err := c.UpdateInstanceState(ctx, "ops", incus.InstanceStatePut{Action: "stop", Timeout: stopTimeout})
	if err != nil {
		t.Fatal(err)
	}
	ops, err := c.ListOperations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, o := range ops {
		if o.ID == op.ID {
			found = true
			if o.StatusCode != incus.StatusRunning || o.Description != "Stopping instance" ||
				!slices.ContainsFunc(o.Resources["instances"], func(r string) bool { return strings.Contains(r, "/1.0/instances/ops") }) {
				t.Errorf("listed operation %+v", o)
			}
		}
	}
	if !found {
		t.Fatalf("operation %s not in ListOperations: %+v", op.ID, ops)
	}
	got, err := c.GetOperation(ctx, op.ID)
	if err != nil || got.ID != op.ID || got.Final() {
		t.Fatalf("GetOperation: %+v %v", got, err)
	}

	// Another project does not see it.
	other, err := incustest.Client(t).ListOperations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range other {
		if o.ID == op.ID {
			t.Errorf("operation %s leaked into another project's list", op.ID)
		}
	}

	final, err := c.Wait(ctx, op)
	took := time.Since(start)
	t.Logf("clean stop of a frozen instance (timeout %ds): %s: %v", stopTimeout, took, err)
	if took < (stopTimeout-1)*time.Second {
		t.Errorf("Wait returned after %s, before the operation's %ds could have run out", took, stopTimeout)
	}
	var oe *incus.OperationError
	if err == nil {
		// Tolerated, but then it must really have stopped.
		mustStatus(t, ctx, c, "ops", incus.StatusStopped)
	} else if !errors.As(err, &oe) || final == nil || final.StatusCode != incus.StatusFailure {
		t.Fatalf("want a failed operation, got %v (%+v)", err, final)
	}
}

func TestIntegrationImages(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, 30*time.Second)
	alias := incustest.Image(t)

	// The alias lives in the default project; features.images=false makes
	// it visible from the test project.
	fp, err := c.GetImageAlias(ctx, alias)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(fp) {
		t.Fatalf("fingerprint %q", fp)
	}
	img, err := c.GetImage(ctx, fp)
	if err != nil {
		t.Fatal(err)
	}
	if img.Fingerprint != fp || img.Size <= 0 || img.Architecture == "" ||
		!slices.ContainsFunc(img.Aliases, func(a incus.ImageAliasEntry) bool { return a.Name == alias }) {
		t.Fatalf("image %+v", img)
	}
	if short, err := c.GetImage(ctx, fp[:12]); err != nil || short.Fingerprint != fp {
		t.Errorf("fingerprint prefix: %v %v", short, err)
	}
	if _, err := c.GetImageAlias(ctx, "lsit-no-such-alias"); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("missing alias: %v", err)
	}
	if _, err := c.GetImage(ctx, strings.Repeat("0", 64)); !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("missing image: %v", err)
	}
}

func TestIntegrationProjects(t *testing.T) {
	c := incustest.Client(t) // its config is checked by incustest
	ctx := ctxFor(t, 30*time.Second)
	p, err := c.GetProject(ctx, c.Project())
	if err != nil {
		t.Fatal(err)
	}
	if p.Name != c.Project() || p.Config["features.images"] != "false" || p.Config["features.profiles"] != "false" {
		t.Fatalf("project %+v", p)
	}
	// Incus 6.0.4 answers a duplicate project with a 500 carrying a
	// UNIQUE-constraint message; it still matches ErrConflict.
	err = c.CreateProject(ctx, c.Project(), nil)
	if !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("duplicate project: want ErrConflict, got %v", err)
	}

	// A non-empty project is not deleted.
	create(t, ctx, c, "keep")
	err = c.DeleteProject(ctx, c.Project())
	if err == nil {
		t.Fatal("deleted a project that still has an instance")
	}
	t.Logf("delete non-empty project: %v", err)

	name := fmt.Sprintf("%s-tmp", c.Project())
	if err := c.CreateProject(ctx, name, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Only matters if the test failed before deleting it.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := c.ForceDeleteProject(ctx, name); err != nil && !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := c.DeleteProject(ctx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetProject(ctx, name); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
}

// TestIntegrationForceDeleteKeepsSharedProfile: a forced delete of a
// project that shares the default project's profiles (features.profiles
// false, as every test project here) must leave the default profile
// whole. Incus 6.0.4's own forced delete empties it (lxc/incus#2416), after
// which no instance can be created without a root device: this test's last
// create is what fails then.
func TestIntegrationForceDeleteKeepsSharedProfile(t *testing.T) {
	c := incustest.Client(t)
	ctx := ctxFor(t, 2*time.Minute)
	name := fmt.Sprintf("%s-shared", c.Project())
	if err := c.CreateProject(ctx, name, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		t.Fatal(err)
	}
	in := c.WithProject(name)
	create(t, ctx, in, "running")
	if _, err := state(t, ctx, in, "running", incus.InstanceStatePut{Action: "start"}); err != nil {
		t.Fatal(err)
	}
	create(t, ctx, in, "stopped")
	if err := c.ForceDeleteProject(ctx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetProject(ctx, name); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("after the forced delete: %v", err)
	}
	create(t, ctx, c, "after") // needs the default profile's root disk
}
