package incusfake_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
)

// events reads a stream in the background until it ends.
func events(t *testing.T, f *incusfake.Server, c *incus.Client) (<-chan incus.Event, <-chan error, *incus.EventStream) {
	t.Helper()
	s, err := c.ListenEvents(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	await(t, f, "the stream to be registered", func() bool { return f.EventStreams() == 1 })
	evs, ended := make(chan incus.Event, 64), make(chan error, 1)
	go func() {
		for {
			ev, err := s.Next()
			if err != nil {
				ended <- err
				return
			}
			evs <- ev
		}
	}()
	return evs, ended, s
}

func next(t *testing.T, evs <-chan incus.Event) incus.Event {
	t.Helper()
	select {
	case ev := <-evs:
		return ev
	case <-ctx(t).Done():
		t.Fatal("no event came")
	}
	return incus.Event{}
}

// lifecycleOf skips operation events to the next lifecycle event.
func lifecycleOf(t *testing.T, evs <-chan incus.Event) *incus.LifecycleEvent {
	t.Helper()
	for {
		if ev := next(t, evs); ev.Lifecycle != nil {
			return ev.Lifecycle
		}
	}
}

func TestEvents(t *testing.T) {
	f, c := start(t, manual())
	if err := f.Seed(proj, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	evs, _, _ := events(t, f, c)
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "start"})
	if err != nil {
		t.Fatal(err)
	}
	ev := next(t, evs)
	if ev.Operation == nil || ev.Operation.ID != op.ID || ev.Operation.Final() || ev.Project != proj {
		t.Fatalf("the operation's first event: %+v", ev)
	}
	if names, ok := ev.Instances(proj); !ok || len(names) != 1 || names[0] != "a" {
		t.Fatalf("it names: %v %v", names, ok)
	}
	f.Advance(incusfake.DefaultDuration)
	if l := next(t, evs).Lifecycle; l == nil || l.Action != "instance-started" || l.Source != "/1.0/instances/a?project=p1" {
		t.Fatalf("lifecycle: %+v", l)
	}
	if ev := next(t, evs); ev.Operation == nil || ev.Operation.StatusCode != incus.StatusSuccess {
		t.Fatalf("the operation's end: %+v", ev)
	}

	// Lost events: while dropping, a change is not told; once dropping
	// stops, the next change is.
	f.DropEvents(true)
	if err := patchNow(t, f, c, "a", map[string]string{"user.k": "lost"}); err != nil {
		t.Fatal(err)
	}
	if f.EventsDropped() != 1 {
		t.Fatalf("dropped %d", f.EventsDropped())
	}
	f.DropEvents(false)
	if err := f.Seed(proj, incusfake.Seed{Name: "b"}); err != nil {
		t.Fatal(err)
	}
	rop, err := c.RenameInstance(ctx(t), "b", "c")
	if err != nil {
		t.Fatal(err)
	}
	done := waitAsync(t, c, rop)
	f.Advance(incusfake.DefaultDuration)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	l := lifecycleOf(t, evs)
	if l.Action != "instance-renamed" || l.Context["old_name"] != "b" {
		t.Fatalf("the first lifecycle event after the loss: %+v", l)
	}
}

func TestEventsCut(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	_, ended, _ := events(t, f, c)
	if n := f.CutEvents(); n != 1 {
		t.Fatalf("cut %d streams", n)
	}
	select {
	case err := <-ended:
		if errors.Is(err, incus.ErrMalformedEvent) {
			t.Fatalf("a cut reads as a bad frame: %v", err)
		}
	case <-ctx(t).Done():
		t.Fatal("the stream did not end")
	}
}

func TestFaultRefuse(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := f.Seed(proj, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	h := f.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: "GET", Path: "/1.0/instances/*", Times: 2,
		Status: 404, Message: "Instance not found"})
	for i := range 2 {
		if _, _, err := c.GetInstance(ctx(t), "a"); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if _, _, err := c.GetInstance(ctx(t), "a"); err != nil {
		t.Fatalf("after the refusals: %v", err)
	}
	if h.Hits() != 2 {
		t.Fatalf("hits %d", h.Hits())
	}
	// A refused write leaves nothing.
	// Skip lets the first matching calls through; Times counts from there.
	h = f.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: "GET", Path: "/1.0/instances/*", Skip: 2, Times: 1,
		Status: 404, Message: "Instance not found"})
	for i := range 2 {
		if _, _, err := c.GetInstance(ctx(t), "a"); err != nil {
			t.Fatalf("skipped call %d: %v", i, err)
		}
	}
	if _, _, err := c.GetInstance(ctx(t), "a"); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("the call after the skipped ones: %v", err)
	}
	if _, _, err := c.GetInstance(ctx(t), "a"); err != nil || h.Hits() != 1 {
		t.Fatalf("after the one refusal: %v, hits %d", err, h.Hits())
	}

	f.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: "PATCH", Times: 1})
	var ie *incus.Error
	if err := c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"}); !errors.As(err, &ie) || ie.Status != 500 {
		t.Fatalf("refused write: %v", err)
	}
	if len(f.Writes()) != 0 {
		t.Fatalf("writes: %+v", f.Writes())
	}
}

func TestFaultHang(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := f.Seed(proj, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	h := f.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: "PATCH", Path: "/1.0/instances/a"})
	done := make(chan error, 1)
	go func() { done <- c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"}) }()
	<-h.Hit()
	if f.PendingWrites() != 0 || len(f.Writes()) != 0 {
		t.Fatal("a held call was served")
	}
	h.Release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Config["user.k"] != "v" {
		t.Fatalf("%+v", v)
	}

	// A caller that gives up while held: nothing of its call is done.
	h2 := f.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: "PATCH"})
	cctx, cancel := context.WithCancel(ctx(t))
	go func() { done <- c.PatchInstanceConfig(cctx, "a", map[string]string{"user.k": "w"}) }()
	<-h2.Hit()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("given up: %v", err)
	}
	h2.Remove()
	if err := c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.j": "x"}); err != nil {
		t.Fatal(err)
	}
	if v := mustInstance(t, f, "a"); v.Config["user.k"] != "v" || v.Config["user.j"] != "x" {
		t.Fatalf("%+v", v.Config)
	}
}

// The write is applied, the answer never comes: the client cannot know.
func TestFaultDropResponse(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := f.Seed(proj, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	f.Inject(incusfake.Fault{Kind: incusfake.DropResponse, Method: "PATCH", Times: 1})
	err := c.PatchInstanceConfig(ctx(t), "a", map[string]string{"user.k": "v"})
	if !errors.Is(err, incus.ErrOutcomeUnknown) {
		t.Fatalf("dropped answer: %v", err)
	}
	if v := mustInstance(t, f, "a"); v.Config["user.k"] != "v" {
		t.Fatalf("the write was not applied: %+v", v.Config)
	}
	// A state change whose answer is lost still runs its operation.
	f.Inject(incusfake.Fault{Kind: incusfake.DropResponse, Method: "PUT", Path: "/1.0/instances/*/state", Times: 1})
	if _, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "start"}); !errors.Is(err, incus.ErrOutcomeUnknown) {
		t.Fatalf("dropped start: %v", err)
	}
	await(t, f, "the start to end", func() bool { v, _ := f.Instance(proj, "a"); return v.Status == incus.InstanceRunning })
}

func TestFaultLatency(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	const extra = 50 * time.Millisecond
	h := f.Inject(incusfake.Fault{Kind: incusfake.Latency, Path: "/1.0", Latency: extra})
	began := time.Now()
	if _, err := c.GetServer(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(began); took < extra || h.Hits() != 1 {
		t.Fatalf("took %s, hits %d", took, h.Hits())
	}
}

func TestProjects(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	if err := c.CreateProject(ctx(t), "p2", map[string]string{"features.profiles": "false"}); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateProject(ctx(t), "p2", nil); !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("a second create: %v", err)
	}
	p, etag, err := c.GetProjectETag(ctx(t), "p2")
	if err != nil {
		t.Fatal(err)
	}
	cfg := p.Config
	cfg["user.pending.a"] = "1"
	if err := c.UpdateProjectIf(ctx(t), "p2", p.Description, cfg, etag); err != nil {
		t.Fatal(err)
	}
	if err := c.UpdateProjectIf(ctx(t), "p2", p.Description, map[string]string{}, etag); !errors.Is(err, incus.ErrPreconditionFailed) {
		t.Fatalf("a stale project ETag: %v", err)
	}
	if got, _, _ := f.Project("p2"); got["user.pending.a"] != "1" || got["features.profiles"] != "false" {
		t.Fatalf("config %v", got)
	}
	if err := f.Seed("p2", incusfake.Seed{Name: "x"}); err != nil {
		t.Fatal(err)
	}
	if err := c.DeleteProject(ctx(t), "p2"); err == nil || errors.Is(err, incus.ErrConflict) {
		t.Fatalf("deleting a project in use: %v", err)
	}
	if err := c.ForceDeleteProject(ctx(t), "p2"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetProject(ctx(t), "p2"); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("deleted project: %v", err)
	}
	// A project with its own profiles is force-deleted in one call.
	if err := c.CreateProject(ctx(t), "p3", map[string]string{"features.profiles": "true"}); err != nil {
		t.Fatal(err)
	}
	if err := f.Seed("p3", incusfake.Seed{Name: "y", Status: incus.InstanceRunning}); err != nil {
		t.Fatal(err)
	}
	if err := c.ForceDeleteProject(ctx(t), "p3"); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := f.Project("p3"); ok {
		t.Fatal("p3 is still there")
	}
}

// Close ends hung calls, waits and streams, and leaves no goroutine of
// its own behind.
func TestCloseEndsEverything(t *testing.T) {
	cfg := incusfake.Config{Dir: t.TempDir(), ManualClock: true}
	f, err := incusfake.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c, err := incus.New(incus.Config{Socket: f.Socket(), CallTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Seed(incus.DefaultProject, incusfake.Seed{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	s, err := c.ListenEvents(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	op, err := c.UpdateInstanceState(ctx(t), "a", incus.InstanceStatePut{Action: "start"})
	if err != nil {
		t.Fatal(err)
	}
	h := f.Inject(incusfake.Fault{Kind: incusfake.Hang, Method: "GET", Path: "/1.0/instances/a"})
	errs := make(chan error, 3)
	go func() { _, err := c.Wait(ctx(t), op); errs <- fmt.Errorf("wait: %w", err) }()
	go func() { _, _, err := c.GetInstance(ctx(t), "a"); errs <- fmt.Errorf("get: %w", err) }()
	go func() {
		for {
			if _, err := s.Next(); err != nil {
				errs <- fmt.Errorf("next: %w", err)
				return
			}
		}
	}()
	<-h.Hit()
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := <-errs; errors.Unwrap(err) == nil {
			t.Fatalf("a call outlived Close: %v", err)
		}
	}
}

// Dozens of owners at once, each creating, starting, writing, stopping
// and deleting its own instance, under -race; the history shows each
// owner's writes in order and nothing left behind.
func TestManyOwners(t *testing.T) {
	f, c := start(t, incusfake.Config{})
	const owners = 40
	var wg sync.WaitGroup
	errs := make(chan error, owners)
	for i := range owners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- owner(ctx(t), c, fmt.Sprintf("o%d", i))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if left := f.Instances(proj); len(left) != 0 {
		t.Fatalf("left behind: %+v", left)
	}
	seen := map[string][]incusfake.WriteKind{}
	for _, w := range f.Writes() {
		seen[w.Instance] = append(seen[w.Instance], w.Kind)
	}
	want := fmt.Sprint([]incusfake.WriteKind{incusfake.WriteCreate, incusfake.WriteStart, incusfake.WritePatch, incusfake.WriteStop, incusfake.WriteDelete})
	for i := range owners {
		if got := fmt.Sprint(seen[fmt.Sprintf("o%d", i)]); got != want {
			t.Errorf("owner %d: %s", i, got)
		}
	}
}

func owner(ctx context.Context, c *incus.Client, name string) error {
	wait := func(op *incus.Operation, err error) error {
		if err != nil {
			return err
		}
		_, err = c.Wait(ctx, op)
		return err
	}
	if err := wait(c.CreateInstance(ctx, incus.InstancesPost{Name: name, Source: incus.InstanceSource{Type: "none"},
		Config: map[string]string{"user.owner": name}, Start: true})); err != nil {
		return fmt.Errorf("%s: create: %w", name, err)
	}
	_, etag, err := c.GetInstance(ctx, name)
	if err != nil {
		return err
	}
	if err := c.PatchInstanceConfigIf(ctx, name, map[string]string{"user.power": "on"}, etag); err != nil {
		return fmt.Errorf("%s: patch: %w", name, err)
	}
	if err := wait(c.UpdateInstanceState(ctx, name, incus.InstanceStatePut{Action: "stop", Force: true})); err != nil {
		return fmt.Errorf("%s: stop: %w", name, err)
	}
	if err := wait(c.DeleteInstance(ctx, name)); err != nil {
		return fmt.Errorf("%s: delete: %w", name, err)
	}
	return nil
}
