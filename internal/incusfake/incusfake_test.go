package incusfake_test

import (
	"context"
	"errors"
	"strings"
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

// Two writes read at one ETag both pass the check, because Incus checks
// on arrival and applies later; the one applied last wins. A third at
// that ETag, arriving after they applied, is refused.
func TestConditionalPatchBothPassLastWins(t *testing.T) {
	f, c := start(t, manual())
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Status: incus.InstanceRunning, Config: map[string]string{"user.k": "0"}}); err != nil {
		t.Fatal(err)
	}
	_, etag, err := c.GetInstance(ctx(t), "a")
	if err != nil {
		t.Fatal(err)
	}
	patch := func(v string) <-chan error {
		ch := make(chan error, 1)
		go func() { ch <- c.PatchInstanceConfigIf(ctx(t), "a", map[string]string{"user.k": v}, etag) }()
		return ch
	}
	first := patch("first")
	await(t, f, "the first write to pass its check", func() bool { return f.PendingWrites() == 1 })
	second := patch("second")
	await(t, f, "the second write to pass its check", func() bool { return f.PendingWrites() == 2 })
	if v := mustInstance(t, f, "a"); v.Config["user.k"] != "0" || v.HeldBy != "update" {
		t.Fatalf("applied before its delay: %+v", v)
	}
	f.Advance(incusfake.DefaultApplyDelay)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Config["user.k"] != "second" {
		t.Fatalf("last applied must win: %+v", v.Config)
	}
	ws := f.Writes()
	if len(ws) != 2 || ws[0].Config["user.k"] != "first" || ws[1].Config["user.k"] != "second" {
		t.Fatalf("writes: %+v", ws)
	}
	err = c.PatchInstanceConfigIf(ctx(t), "a", map[string]string{"user.k": "third"}, etag)
	if !errors.Is(err, incus.ErrPreconditionFailed) {
		t.Fatalf("a stale ETag: %v", err)
	}
	// A write without If-Match applies whatever the ETag.
	done := make(chan error, 1)
	go func() { done <- c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "", "user.j": "1"}) }()
	await(t, f, "the write to pass", func() bool { return f.PendingWrites() == 1 })
	f.Advance(incusfake.DefaultApplyDelay)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Config["user.j"] != "1" || v.Config["user.k"] != "" {
		t.Fatalf("merge and removal: %+v", v.Config)
	}
}

// A start holds the instance: config writes are refused at once (500,
// ErrBusy) and other state changes fail in their operation, until the
// start ends.
func TestBusyDuringStart(t *testing.T) {
	f, c := start(t, manual())
	if err := f.Seed(proj, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "start"})
	if err != nil {
		t.Fatal(err)
	}
	err = c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"})
	var ie *incus.Error
	if !errors.Is(err, incus.ErrBusy) || errors.Is(err, incus.ErrBusyStopping) || !errors.As(err, &ie) || ie.Status != 500 {
		t.Fatalf("a write during a start: %v", err)
	}
	if !strings.Contains(ie.Message, `Instance is busy running a "start" operation`) {
		t.Fatalf("busy text: %q", ie.Message)
	}
	freeze, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "freeze"})
	if err != nil {
		t.Fatal(err)
	}
	// The refusal is the operation's, made at once: no time needs to pass.
	if _, err := c.Wait(ctx(t), freeze); !errors.Is(err, incus.ErrBusy) {
		t.Fatalf("a freeze during a start: %v", err)
	}
	done := waitAsync(t, c, op)
	f.Advance(incusfake.DefaultDuration)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := patchNow(t, f, c, "a", map[string]string{"user.k": "v"}); err != nil {
		t.Fatalf("a write once the start ended: %v", err)
	}
}

// patchNow runs a patch on a manual clock: it passes, then the clock
// moves for it to apply.
func patchNow(t *testing.T, f *incusfake.Server, c *incus.Client, name string, set map[string]string) error {
	t.Helper()
	done := make(chan error, 1)
	n := len(f.Writes())
	go func() { done <- c.PatchInstanceConfig(ctx(t), name, set) }()
	for {
		select {
		case err := <-done:
			return err
		default:
		}
		await(t, f, "the patch to pass or end", func() bool { return f.PendingWrites() > 0 || len(done) > 0 })
		f.Advance(incusfake.DefaultApplyDelay)
		if len(f.Writes()) > n {
			return <-done
		}
	}
}

func TestBusyStoppingDuringAStop(t *testing.T) {
	f, c := start(t, manual())
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Status: incus.InstanceRunning}); err != nil {
		t.Fatal(err)
	}
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop", Timeout: 30})
	if err != nil {
		t.Fatal(err)
	}
	err = c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"})
	if !errors.Is(err, incus.ErrBusyStopping) || !errors.Is(err, incus.ErrBusy) {
		t.Fatalf("a write during a stop: %v", err)
	}
	done := waitAsync(t, c, op)
	f.Advance(incusfake.DefaultDuration)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Status != incus.InstanceStopped || v.Config["volatile.last_state.power"] != "STOPPED" {
		t.Fatalf("after the stop: %+v", v)
	}
	// Stopping a stopped instance fails its operation as Incus words it,
	// which targets reads as done (isAlreadyStopped).
	again, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop", Force: true})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Wait(ctx(t), again)
	var oe *incus.OperationError
	if !errors.As(err, &oe) || !strings.Contains(strings.ToLower(oe.Err), "already stopped") {
		t.Fatalf("stopping a stopped instance: %v", err)
	}
}

// A guest that ignores a graceful stop: the stop fails at its timeout and
// leaves its hold with no task behind it (as Incus 6.0.4 does), every
// write is refused as held by a stop, until a forced stop takes over.
func TestStrandedStopUntilForced(t *testing.T) {
	f, c := start(t, manual())
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Status: incus.InstanceRunning, IgnoreShutdown: true}); err != nil {
		t.Fatal(err)
	}
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop", Timeout: 30})
	if err != nil {
		t.Fatal(err)
	}
	done := waitAsync(t, c, op)
	f.Advance(29 * time.Second)
	if got, err := c.RefreshOperation(ctx(t), op); err != nil || got.Final() {
		t.Fatalf("before its timeout the stop runs: %+v %v", got, err)
	}
	f.Advance(time.Second)
	if err := <-done; err == nil || errors.Is(err, incus.ErrBusy) {
		t.Fatalf("a stop past its timeout fails: %v", err)
	}
	if v := mustInstance(t, f, "a"); v.Status != incus.InstanceRunning || v.HeldBy != "stop" {
		t.Fatalf("after the failed stop: %+v", v)
	}
	if ops, err := c.ListOperations(ctx(t)); err != nil || len(ops) != 0 {
		t.Fatalf("no task is left: %+v %v", ops, err)
	}
	if err := c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"}); !errors.Is(err, incus.ErrBusyStopping) {
		t.Fatalf("a write on the stranded hold: %v", err)
	}
	force, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop", Force: true})
	if err != nil {
		t.Fatal(err)
	}
	done = waitAsync(t, c, force)
	f.Advance(incusfake.DefaultDuration)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Status != incus.InstanceStopped || v.HeldBy != "" {
		t.Fatalf("after the forced stop: %+v", v)
	}
}

// A forced stop sent while a graceful one runs takes it over: both end
// when the forced one does.
func TestForcedStopTakesOverGraceful(t *testing.T) {
	f, c := start(t, incusfake.Config{ManualClock: true, Durations: incusfake.Durations{Stop: time.Minute}})
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Status: incus.InstanceRunning}); err != nil {
		t.Fatal(err)
	}
	graceful, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop"})
	if err != nil {
		t.Fatal(err)
	}
	forced, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop", Force: true})
	if err != nil {
		t.Fatal(err)
	}
	g, fo := waitAsync(t, c, graceful), waitAsync(t, c, forced)
	f.Advance(incusfake.DefaultDuration)
	if err := <-fo; err != nil {
		t.Fatal(err)
	}
	if err := <-g; err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Status != incus.InstanceStopped {
		t.Fatalf("%+v", v)
	}
}

func TestRename(t *testing.T) {
	f, c := start(t, manual())
	if err := f.Seed(proj, incusfake.Seed{Name: "run", Status: incus.InstanceRunning},
		incusfake.Seed{Name: "a"}, incusfake.Seed{Name: "b"}, incusfake.Seed{Name: "taken"}); err != nil {
		t.Fatal(err)
	}
	_, err := c.RenameInstance(ctx(t), "run", "x")
	var ie *incus.Error
	if !errors.As(err, &ie) || ie.Status != 400 || ie.Message != "Renaming of running instance not allowed" {
		t.Fatalf("renaming a running instance: %v", err)
	}
	if _, err := c.RenameInstance(ctx(t), "a", "taken"); !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("renaming onto a taken name: %v", err)
	}
	if _, err := c.RenameInstance(ctx(t), "gone", "y"); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("renaming a missing instance: %v", err)
	}
	// Two renames racing to one name both pass the check; at most one ends
	// with an instance under it.
	opA, err := c.RenameInstance(ctx(t), "a", "x")
	if err != nil {
		t.Fatal(err)
	}
	opB, err := c.RenameInstance(ctx(t), "b", "x")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"}); !errors.Is(err, incus.ErrBusy) {
		t.Fatalf("a write during a rename: %v", err)
	}
	da, db := waitAsync(t, c, opA), waitAsync(t, c, opB)
	f.Advance(incusfake.DefaultDuration)
	if err := <-da; err != nil {
		t.Fatal(err)
	}
	if err := <-db; !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("the rename that lost: %v", err)
	}
	if _, ok := f.Instance(proj, "a"); ok {
		t.Fatal("a is still there")
	}
	if _, ok := f.Instance(proj, "b"); !ok {
		t.Fatal("b is gone")
	}
	if ws := f.Writes(); len(ws) != 1 || ws[0].Kind != incusfake.WriteRename || ws[0].OldName != "a" || ws[0].Instance != "x" {
		t.Fatalf("writes: %+v", ws)
	}
}

// An operation is answered at once and ends later, by the fake's clock;
// it is listed while it runs.
func TestOperationEndsLater(t *testing.T) {
	f, c := start(t, incusfake.Config{ManualClock: true, Durations: incusfake.Durations{Start: 2 * time.Second}})
	if err := f.Seed(proj, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "start"})
	if err != nil {
		t.Fatal(err)
	}
	if op.Final() {
		t.Fatalf("answered final: %+v", op)
	}
	ops, err := c.ListOperations(ctx(t))
	if err != nil || len(ops) != 1 || ops[0].ID != op.ID || ops[0].Resources["instances"][0] != "/1.0/instances/a?project=p1" {
		t.Fatalf("listed: %+v %v", ops, err)
	}
	f.Advance(time.Second)
	if got, err := c.GetOperation(ctx(t), op.ID); err != nil || got.Final() {
		t.Fatalf("half way: %+v %v", got, err)
	}
	done := waitAsync(t, c, op)
	f.Advance(time.Second)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got, err := c.GetOperation(ctx(t), op.ID)
	if err != nil || got.StatusCode != incus.StatusSuccess || got.UpdatedAt.Sub(got.CreatedAt) != 2*time.Second {
		t.Fatalf("ended: %+v %v", got, err)
	}
	if ops, err := c.ListOperations(ctx(t)); err != nil || len(ops) != 0 {
		t.Fatalf("listed once ended: %+v %v", ops, err)
	}
	f.PruneOperations()
	if _, err := c.Wait(ctx(t), op); !errors.Is(err, incus.ErrOperationLost) {
		t.Fatalf("a pruned operation: %v", err)
	}
}

func TestDeleteRefusesRunning(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Status: incus.InstanceRunning}); err != nil {
		t.Fatal(err)
	}
	_, err := c.DeleteInstance(ctx(t), "a")
	var ie *incus.Error
	if !errors.As(err, &ie) || ie.Status != 400 || ie.Message != "Instance is running" {
		t.Fatalf("deleting a running instance: %v", err)
	}
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "stop", Force: true})
	if err == nil {
		_, err = c.Wait(ctx(t), op)
	}
	if err != nil {
		t.Fatal(err)
	}
	op, err = c.DeleteInstance(ctx(t), "a")
	if err == nil {
		_, err = c.Wait(ctx(t), op)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := f.Instance(proj, "a"); ok {
		t.Fatal("still there")
	}
}

// A PUT is checked on arrival and answered with an operation that ends
// once the write is applied; it must carry the volatile keys.
func TestPutInstance(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Config: map[string]string{"volatile.uuid": "u", "user.k": "1"}}); err != nil {
		t.Fatal(err)
	}
	inst, etag, err := c.GetInstance(ctx(t), "a")
	if err != nil {
		t.Fatal(err)
	}
	put := inst.Writable()
	delete(put.Config, "volatile.uuid")
	if err := c.UpdateInstance(ctx(t), "a", put, etag); err == nil {
		t.Fatal("a PUT dropping a volatile key was taken")
	}
	put = inst.Writable()
	put.Config["user.k"] = "2"
	if err := c.UpdateInstance(ctx(t), "a", put, etag); err != nil {
		t.Fatal(err)
	}
	if err := c.UpdateInstance(ctx(t), "a", put, etag); !errors.Is(err, incus.ErrPreconditionFailed) {
		t.Fatalf("a PUT at a stale ETag: %v", err)
	}
	if v := mustInstance(t, f, "a"); v.Config["user.k"] != "2" || v.Config["volatile.uuid"] != "u" {
		t.Fatalf("%+v", v.Config)
	}
}

func TestFreezeUnfreeze(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := f.Seed(proj, incusfake.Seed{Name: "a", Status: incus.InstanceRunning}, incusfake.Seed{Name: "s"}); err != nil {
		t.Fatal(err)
	}
	act := func(name string, action incus.StateAction) error {
		op, err := c.UpdateInstanceState(ctx(t), name, incus.InstanceStatePut{Action: action})
		if err != nil {
			return err
		}
		_, err = c.Wait(ctx(t), op)
		return err
	}
	if err := act("a", "freeze"); err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Status != incus.InstanceFrozen {
		t.Fatalf("%+v", v)
	}
	if err := act("a", "start"); err == nil {
		t.Fatal("starting a frozen instance was taken")
	}
	if err := act("a", "unfreeze"); err != nil {
		t.Fatal(err)
	}
	if err := act("s", "freeze"); err == nil {
		t.Fatal("freezing a stopped instance was taken")
	}
	if v := mustInstance(t, f, "a"); v.Status != incus.InstanceRunning {
		t.Fatalf("%+v", v)
	}
}
