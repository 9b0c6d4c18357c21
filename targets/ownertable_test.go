package targets

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A look a write asks for soon is not held back by a retry due much later
// (a run's backoff): the earlier of the two wins, and a retry due sooner
// than the look is kept.
func TestSoonBringsALaterRetryForward(t *testing.T) {
	var mu sync.Mutex
	runs := map[string][]time.Time{}
	w := newOwner(func(_ context.Context, name string) next {
		mu.Lock()
		defer mu.Unlock()
		runs[name] = append(runs[name], time.Now())
		return settled
	})
	defer w.stop()
	start := time.Now()
	w.mu.Lock()
	w.retryLocked("late", time.Minute)
	w.retryLocked("early", 50*time.Millisecond)
	w.mu.Unlock()
	w.soon("late", 100*time.Millisecond)
	w.soon("early", 10*time.Second)
	deadline := time.Now().Add(5 * time.Second)
	for {
		mu.Lock()
		late, early := runs["late"], runs["early"]
		mu.Unlock()
		if len(late) > 0 && len(early) > 0 {
			if d := late[0].Sub(start); d > 2*time.Second {
				t.Fatalf("the look asked for in 100 ms ran after %v: the minute's retry held it back", d)
			}
			if d := early[0].Sub(start); d > 2*time.Second {
				t.Fatalf("the retry due in 50 ms ran after %v: the later look replaced it", d)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("runs after 5 s: late %d, early %d; want one each (the look asked for in 100 ms waits for the minute's retry)", len(late), len(early))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A look asked for while a run is under way comes when it was asked for,
// once: not as a second run straight after, which would read the instance
// again for nothing.
func TestSoonDuringARunLooksOnceWhenAsked(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var runs []time.Time
	w := newOwner(func(ctx context.Context, _ string) next {
		mu.Lock()
		runs = append(runs, time.Now())
		first := len(runs) == 1
		mu.Unlock()
		if first {
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return settled
	})
	defer w.stop()
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(runs)
	}
	w.kick("x")
	for deadline := time.Now().Add(5 * time.Second); count() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first run never started")
		}
	}
	const look = 400 * time.Millisecond
	asked := time.Now()
	w.soon("x", look)
	close(release)
	// Before the look is due no second run may start, however slow the
	// machine: a slow one only makes runs later.
	time.Sleep(look / 2)
	if n := count(); n != 1 {
		t.Fatalf("%d runs before the look asked for was due; want the first only", n)
	}
	for deadline := time.Now().Add(5 * time.Second); count() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the look asked for during the run never came")
		}
	}
	mu.Lock()
	second := runs[1]
	mu.Unlock()
	if second.Before(asked.Add(look)) {
		t.Fatalf("the second run came %v after the look was asked for, before the %v asked", second.Sub(asked), look)
	}
	time.Sleep(look)
	if n := count(); n != 2 {
		t.Fatalf("%d runs; want the first and the one look", n)
	}
}

// At most max converges run at once; every name kicked runs, and each
// kick's channel closes once a run after it ended.
func TestWorkerRunsAtMostMaxAtOnce(t *testing.T) {
	const bound, names = 3, 12
	var mu sync.Mutex
	running, most := 0, 0
	ran := map[string]int{}
	release := make(chan struct{})
	w := newOwnerOf(bound, func(ctx context.Context, name string) next {
		mu.Lock()
		running++
		most = max(most, running)
		ran[name]++
		mu.Unlock()
		select {
		case <-release:
		case <-ctx.Done():
		}
		mu.Lock()
		running--
		mu.Unlock()
		return settled
	})
	defer w.stop()
	var dones []<-chan struct{}
	for i := range names {
		dones = append(dones, w.kick("n"+string(rune('a'+i))))
	}
	// A kick of a queued name is covered by its one run to come.
	if again := w.kick("n" + string(rune('a'+names-1))); again != dones[names-1] {
		t.Fatal("a kick of a queued name asked for a second run")
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := running
		mu.Unlock()
		if n == bound {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d converges under way with %d names kicked, want %d", n, names, bound)
		}
	}
	close(release)
	for i, d := range dones {
		select {
		case <-d:
		case <-time.After(5 * time.Second):
			t.Fatalf("the kick of name %d was never covered by a run", i)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if most > bound {
		t.Errorf("%d converges ran at once, want at most %d", most, bound)
	}
	for name, n := range ran {
		if n != 1 {
			t.Errorf("%s ran %d times for its kicks, want once", name, n)
		}
	}
	if len(ran) != names {
		t.Errorf("%d names ran, want %d", len(ran), names)
	}
}

// A name kicked again during each of its runs goes to the back of the
// queue while others wait: one busy name does not starve the rest.
func TestWorkerABusyNameDoesNotStarveTheQueue(t *testing.T) {
	var mu sync.Mutex
	var order []string
	var w *owners
	w = newOwnerOf(1, func(_ context.Context, name string) next {
		mu.Lock()
		order = append(order, name)
		n := len(order)
		mu.Unlock()
		if name == "busy" && n < 50 {
			w.kick("busy")
		}
		return settled
	})
	defer w.stop()
	w.mu.Lock() // both kicks land before any run ends
	w.kickLocked("busy")
	other := w.kickLocked("other")
	w.mu.Unlock()
	select {
	case <-other:
	case <-time.After(5 * time.Second):
		t.Fatal("the other name never ran")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(order) < 2 || order[1] != "other" {
		t.Fatalf("runs %v: the queued name should run right after the busy one's first run", order[:min(len(order), 5)])
	}
}

// Stopping the worker answers the kicks of names still queued.
func TestWorkerStopAnswersQueuedKicks(t *testing.T) {
	block := make(chan struct{})
	w := newOwnerOf(1, func(ctx context.Context, _ string) next {
		select {
		case <-block:
		case <-ctx.Done():
		}
		return settled
	})
	w.kick("running")
	queued := w.kick("queued")
	w.stop()
	select {
	case <-queued:
	default:
		t.Fatal("a queued kick was left unanswered by stop")
	}
}

// A name whose steps fail is looked at again after a backoff that doubles
// with each failure in a row, up to its bound, and starts over after a
// step that does not fail. A reconcile pass's nudge does not cut a backoff
// short; a method's kick does. Only lower bounds on time are checked: a
// slow machine makes runs later, never earlier.
func TestWorkerBacksOffANameThatFails(t *testing.T) {
	var mu sync.Mutex
	var runs []time.Time
	failing := 4
	w := newOwnerOf(1, func(_ context.Context, _ string) next {
		mu.Lock()
		defer mu.Unlock()
		runs = append(runs, time.Now())
		if len(runs) <= failing {
			return failedStep
		}
		return settled
	})
	defer w.stop()
	w.failFirst, w.failMost = 40*time.Millisecond, 200*time.Millisecond
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(runs)
	}
	await := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); count() < n; time.Sleep(2 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d runs after 10 s; want %d", count(), n)
			}
		}
	}
	idle := func() {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
			w.mu.Lock()
			k := w.keys["x"]
			busy := k != nil && k.job != nil
			w.mu.Unlock()
			if !busy {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("the name's run never ended")
			}
		}
	}
	w.kick("x")
	await(failing + 1)
	idle()
	mu.Lock()
	for i, least := range []time.Duration{40, 80, 160, 200} {
		if gap := runs[i+1].Sub(runs[i]); gap < least*time.Millisecond {
			t.Errorf("run %d came %v after failure %d; the backoff is %v", i+2, gap, i+1, least*time.Millisecond)
		}
	}
	mu.Unlock()
	left := w.failures("x").n
	if left != 0 {
		t.Fatalf("after a step that did not fail the name still counts %d failures", left)
	}

	// The count starts over: the next failure waits failFirst again, and
	// a nudge inside that backoff does not run the name.
	mu.Lock()
	failing = len(runs) + 1
	mu.Unlock()
	w.mu.Lock()
	w.failFirst, w.failMost = 400*time.Millisecond, time.Second
	w.mu.Unlock()
	before := count()
	<-w.kick("x")
	if n := w.failures("x").n; n != 1 {
		t.Errorf("one failure after a success counts %d", n)
	}
	failedAt := time.Now()
	w.nudge("x")
	time.Sleep(100 * time.Millisecond)
	if n := count(); n != before+1 && time.Since(failedAt) < 400*time.Millisecond {
		t.Fatalf("a nudge ran the name inside its backoff (%d runs)", n)
	}
	// A kick is a caller waiting: it runs now.
	<-w.kick("x")
	if n := count(); n != before+2 {
		t.Fatalf("%d runs after the kick; want %d", n, before+2)
	}
}

// A wake waiting for an instance's turn goes before the records and moves
// that were waiting already (a dial's latency is the only one a user
// sees), and wakes among themselves, like the rest, go in the order they
// came.
func TestTurnGoesToAWakeFirst(t *testing.T) {
	o := newOwnerOf(1, func(context.Context, string) next { return settled })
	defer o.stop()
	release, waited, err := o.take(t.Context(), "x", false)
	if err != nil || waited {
		t.Fatalf("a free turn: waited %v, %v", waited, err)
	}
	var mu sync.Mutex
	var order []string
	var wg sync.WaitGroup
	queued := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			o.mu.Lock()
			got := len(o.keys["x"].turn.waiting)
			o.mu.Unlock()
			if got == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d waiting for the turn after 5 s; want %d", got, n)
			}
		}
	}
	for i, w := range []struct {
		who    string
		urgent bool
	}{{"record-1", false}, {"record-2", false}, {"wake-1", true}, {"move-3", false}, {"wake-2", true}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rel, waited, err := o.take(t.Context(), "x", w.urgent)
			if err != nil || !waited {
				t.Errorf("%s: waited %v, %v", w.who, waited, err)
				return
			}
			mu.Lock()
			order = append(order, w.who)
			mu.Unlock()
			rel()
		}()
		queued(i + 1) // each waits before the next comes
	}
	release()
	wg.Wait()
	want := []string{"wake-1", "wake-2", "record-1", "record-2", "move-3"}
	if len(order) != len(want) {
		t.Fatalf("turns went to %v; want %v", order, want)
	}
	for i := range want {
		if order[i] != want[i] {
			t.Fatalf("turns went to %v; want %v", order, want)
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.keys) != 0 {
		t.Fatalf("%d entries left once nothing is held", len(o.keys))
	}
}

// Dozens of instances, each taken by many writers and requests at once,
// some of whose waits end before their turn (a method's bound): nobody
// shares an instance's turn or request, every wait ends, a turn handed to
// a waiter just as its wait ended goes on to the next, and no entry is
// left once all is done.
func TestTurnOneAtATimeUnderManyWaiters(t *testing.T) {
	rng := seeded(t)
	const names, takers, rounds = 40, 8, 30
	o := newOwnerOf(4, func(context.Context, string) next { return settled })
	defer o.stop()
	inside := make([]atomic.Int32, 2*names)
	seeds := make([]uint64, names*takers)
	for i := range seeds {
		seeds[i] = rng.Uint64()
	}
	var wg sync.WaitGroup
	var cut, took atomic.Int64
	deadline := time.Now().Add(20 * time.Second)
	for n := range names {
		name := fmt.Sprintf("t-%02d", n)
		for i := range takers {
			r := rand.New(rand.NewPCG(seeds[n*takers+i], 1))
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range rounds {
					if time.Now().After(deadline) {
						t.Error("the rounds outlived 20 s")
						return
					}
					ctx, cancel := context.WithTimeout(t.Context(), time.Duration(r.IntN(3000))*time.Microsecond)
					var rel func()
					var err error
					slot := n
					switch r.IntN(3) {
					case 0:
						rel, err = o.request(ctx, name)
						slot = names + n
					default:
						rel, _, err = o.take(ctx, name, r.IntN(4) == 0)
					}
					cancel()
					if err != nil {
						cut.Add(1)
						continue
					}
					if v := inside[slot].Add(1); v != 1 {
						t.Errorf("%s: %d holders at once", name, v)
					}
					took.Add(1)
					time.Sleep(time.Duration(r.IntN(200)) * time.Microsecond)
					inside[slot].Add(-1)
					rel()
					rel() // a second release does nothing
				}
			}()
		}
	}
	wg.Wait()
	if cut.Load() == 0 || took.Load() == 0 {
		t.Fatalf("took %d, cut short %d: the test staged too little", took.Load(), cut.Load())
	}
	t.Logf("%d turns and requests taken, %d waits cut short", took.Load(), cut.Load())
	o.mu.Lock()
	left := len(o.keys)
	o.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d entries left once nothing is held", left)
	}
	for n := range names {
		name := fmt.Sprintf("t-%02d", n)
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		rel, waited, err := o.take(ctx, name, false)
		cancel()
		if err != nil || waited {
			t.Fatalf("%s afterwards: waited %v, %v", name, waited, err)
		}
		rel()
	}
}

// A converge and the turn live in one entry: a name whose converge runs,
// waits or backs off keeps it, and it is dropped once none does.
func TestOwnerEntryLivesWhileAnyPartIsUsed(t *testing.T) {
	fail := make(chan bool, 1)
	o := newOwnerOf(2, func(context.Context, string) next {
		if <-fail {
			return failedStep
		}
		return settled
	})
	defer o.stop()
	o.failFirst = time.Hour
	entries := func() int {
		o.mu.Lock()
		defer o.mu.Unlock()
		return len(o.keys)
	}
	fail <- true
	<-o.kick("x")
	if f := o.failures("x"); f.n != 1 || entries() != 1 {
		t.Fatalf("after a failed step: %d failures, %d entries", f.n, entries())
	}
	rel, _, err := o.take(t.Context(), "x", false)
	if err != nil {
		t.Fatal(err)
	}
	rel()
	if entries() != 1 {
		t.Fatal("releasing the turn dropped an entry whose converge backs off")
	}
	fail <- false
	<-o.kick("x")
	if f := o.failures("x"); f.n != 0 || entries() != 0 {
		t.Fatalf("after a step that did not fail: %d failures, %d entries", f.n, entries())
	}
}

// Optional work under the turn (owners.yielding) ends when a wake asks
// for the turn, and only then: a plain waiter lets it finish; a section
// opened while a wake already waits ends at once; a section within
// another ends with it; and the holder's release forgets the section.
func TestYieldingEndsForAnUrgentWaiterOnly(t *testing.T) {
	w := newOwner(func(context.Context, string) next { return settled })
	defer w.stop()
	ctx := context.Background()
	take := func(urgent bool) (func(), chan struct{}) {
		got := make(chan struct{})
		var release func()
		go func() {
			var err error
			release, _, err = w.take(ctx, "n", urgent)
			if err != nil {
				t.Error(err)
			}
			close(got)
		}()
		return func() { <-got; release() }, got
	}
	waiting := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			w.mu.Lock()
			k := w.keys["n"]
			have := k != nil && len(k.turn.waiting) == n
			w.mu.Unlock()
			if have {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("never %d waiting for the turn", n)
			}
		}
	}

	release, _, err := w.take(ctx, "n", false)
	if err != nil {
		t.Fatal(err)
	}
	outer, doneOuter := w.yielding(ctx, "n")
	inner, doneInner := w.yielding(outer, "n")
	plain, plainGot := take(false)
	waiting(1)
	if outer.Err() != nil || inner.Err() != nil {
		t.Fatal("a plain waiter ended the holder's optional work")
	}
	wake, wakeGot := take(true)
	waiting(2)
	if outer.Err() == nil || inner.Err() == nil {
		t.Fatalf("a wake's wait left the optional work going: outer %v, inner %v", outer.Err(), inner.Err())
	}
	doneInner()
	late, doneLate := w.yielding(ctx, "n")
	if late.Err() == nil {
		t.Fatal("a section opened while a wake waits did not end at once")
	}
	doneLate()
	doneOuter()
	release()
	select {
	case <-wakeGot:
	case <-time.After(5 * time.Second):
		t.Fatal("the wake never got the turn")
	}
	select {
	case <-plainGot:
		t.Fatal("the plain waiter went before the wake")
	default:
	}
	// The wake holds the turn now: a section of its own is not ended by
	// the plain waiter behind it.
	mine, doneMine := w.yielding(ctx, "n")
	if mine.Err() != nil {
		t.Fatal("the new holder's section ended with no wake waiting")
	}
	doneMine()
	wake()
	plain()
}
