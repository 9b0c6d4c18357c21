package targets

import (
	"context"
	"sync"
	"testing"
	"time"
)

// A look a write asks for soon is not held back by a retry due much later
// (a run's backoff): the earlier of the two wins, and a retry due sooner
// than the look is kept.
func TestSoonBringsALaterRetryForward(t *testing.T) {
	var mu sync.Mutex
	runs := map[string][]time.Time{}
	w := newWorker(func(_ context.Context, name string) time.Duration {
		mu.Lock()
		defer mu.Unlock()
		runs[name] = append(runs[name], time.Now())
		return 0
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
	w := newWorker(func(ctx context.Context, _ string) time.Duration {
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
		return 0
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
