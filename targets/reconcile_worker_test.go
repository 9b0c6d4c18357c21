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
