package relays

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"
)

// fakeConn is a relay that ends when told to go away, unless it is stubborn.
type fakeConn struct {
	stubborn bool
	mu       sync.Mutex
	told     []int
	done     chan struct{}
	once     sync.Once
	killed   bool
}

func newFake(stubborn bool) *fakeConn {
	return &fakeConn{stubborn: stubborn, done: make(chan struct{})}
}

func (f *fakeConn) GoAway(code int, _, _ string) {
	f.mu.Lock()
	f.told = append(f.told, code)
	f.mu.Unlock()
	if !f.stubborn {
		f.end()
	}
}

func (f *fakeConn) Kill(string) {
	f.mu.Lock()
	f.killed = true
	f.mu.Unlock()
	f.end()
}

func (f *fakeConn) end()                  { f.once.Do(func() { close(f.done) }) }
func (f *fakeConn) Done() <-chan struct{} { return f.done }

// open enters a relay of instance as the data routes do.
func open(t *testing.T, g *Registry, instance string, c *fakeConn) {
	t.Helper()
	tk, quiet := g.Enter(instance, time.Now())
	if tk == nil {
		t.Fatalf("Enter held off (quiet %v)", quiet != nil)
	}
	tk.Adopt(c)
	go func() { <-c.Done(); g.Remove(instance, c) }()
}

func TestQuiesceYieldsToAnyUse(t *testing.T) {
	g := New(time.Second)
	tk, _ := g.Enter("a", time.Now())
	if _, ok := g.Quiesce("a"); ok {
		t.Fatal("Quiesce succeeded with a dial in progress")
	}
	tk.Leave()
	release, ok := g.Quiesce("a")
	if !ok {
		t.Fatal("Quiesce failed with nothing open")
	}
	if tk, quiet := g.Enter("a", time.Now()); tk != nil || quiet == nil {
		t.Fatal("a dial was let in during a power-down")
	}
	release()
	if tk, _ := g.Enter("a", time.Now()); tk == nil {
		t.Fatal("a dial was held off after the power-down")
	}
}

func TestDrainClosesRelaysAndWaitsForDials(t *testing.T) {
	g := New(200 * time.Millisecond)
	polite, stubborn := newFake(false), newFake(true)
	open(t, g, "a", polite)
	open(t, g, "a", stubborn)
	pending, _ := g.Enter("a", time.Now()) // a dial still waking the target
	var seen []int
	var mu sync.Mutex
	result := make(chan int, 1)
	var release func()
	go func() {
		var left int
		release, left, _ = g.Drain(context.Background(), "a", "powering down", time.Time{}, func(n int) {
			mu.Lock()
			seen = append(seen, n)
			mu.Unlock()
		})
		result <- left
	}()
	// The dial becomes a relay during the drain: it is told to go away too.
	time.Sleep(50 * time.Millisecond)
	late := newFake(false)
	pending.Adopt(late)
	go func() { <-late.Done(); g.Remove("a", late) }()
	select {
	case left := <-result:
		if left != 0 {
			t.Fatalf("Drain left %d open", left)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Drain did not end")
	}
	defer release()
	for _, c := range []*fakeConn{polite, stubborn, late} {
		if len(c.told) != 1 || c.told[0] != GoingAway {
			t.Fatalf("a relay was told %v, want one going-away", c.told)
		}
	}
	if !stubborn.killed || polite.killed {
		t.Fatal("only the relay that did not end in time is killed")
	}
	if g.Open("a") != 0 {
		t.Fatalf("Open = %d after the drain", g.Open("a"))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) == 0 || seen[0] != 3 || seen[len(seen)-1] != 0 {
		t.Fatalf("onWait saw %v, want from 3 down to 0", seen)
	}
	if tk, quiet := g.Enter("a", time.Now()); tk != nil || quiet == nil {
		t.Fatal("a dial was let in before release")
	}
}

func TestDrainGivesUpWithCtxAndJoinIsAdmitted(t *testing.T) {
	g := New(time.Second)
	tk, _ := g.Enter("a", time.Now())
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		release, left, _ := g.Drain(ctx, "a", "powering down", time.Time{}, nil)
		defer release()
		if left != 2 {
			t.Errorf("left %d, want the dial and its wake", left)
		}
	}()
	time.Sleep(20 * time.Millisecond)
	// The admitted dial's wake joins it even while the drain holds dials off.
	wake := tk.Join()
	<-done
	wake.Leave()
	tk.Leave()
	if g.Open("a") != 0 {
		t.Fatalf("Open = %d", g.Open("a"))
	}
	if tk, _ := g.Enter("a", time.Now()); tk == nil {
		t.Fatal("released drain still holds dials off")
	}
}

// A use that arrived after the power-down was asked outranks it: Drain
// tells nothing to go away and answers that use's arrival; a use from
// before the request (or from its own millisecond) loses as ever.
func TestDrainYieldsToAUseAfterTheRequest(t *testing.T) {
	asked := time.UnixMilli(1_700_000_000_000)
	for _, tc := range []struct {
		name      string
		arrived   time.Duration // after asked
		outranked bool
	}{
		{"before the request", -time.Second, false},
		{"in the request's millisecond", 900 * time.Microsecond, false},
		{"after the request", 2 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := New(50 * time.Millisecond)
			var told sync.Map
			g.OnPowerChange(func(instance string) {
				n, _ := told.LoadOrStore(instance, new(int))
				*n.(*int)++ // the hooks run on the caller of Drain and of release
			})
			toldOf := func() int {
				n, ok := told.Load("a")
				if !ok {
					return 0
				}
				return *n.(*int)
			}
			old := newFake(false)
			tk, _ := g.Enter("a", asked.Add(-time.Hour))
			tk.Adopt(old)
			go func() { <-old.Done(); g.Remove("a", old) }()
			c := newFake(false)
			at := asked.Add(tc.arrived)
			tk, _ = g.Enter("a", at)
			tk.Adopt(c)
			go func() { <-c.Done(); g.Remove("a", c) }()
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			release, left, outranked := g.Drain(ctx, "a", "powering down", asked, nil)
			if tc.outranked {
				release()
				if !outranked.Equal(at) || left != 2 {
					t.Fatalf("outranked %v, left %d; want %v and both relays left", outranked, left, at)
				}
				select {
				case <-c.Done():
					t.Fatal("the newer use's relay was told to go away")
				case <-old.Done():
					t.Fatal("a relay was told to go away although the power-down is outranked")
				default:
				}
				// No power changed: the readiness the routes proved holds.
				if n := toldOf(); n != 0 {
					t.Fatalf("the power-change hooks were told %d times of an outranked drain, want none", n)
				}
				return
			}
			if !outranked.IsZero() || left != 0 {
				t.Fatalf("outranked %v, left %d; want drained", outranked, left)
			}
			if n := toldOf(); n != 0 {
				t.Fatalf("the hooks were told %d times before the release, want none while every dial is held", n)
			}
			release()
			if n := toldOf(); n != 1 {
				t.Fatalf("the hooks were told %d times of a drain that went on, want once", n)
			}
		})
	}
}

// EndedSince tells an idle reading from a relay or a dial that ended after
// it was asked for, whichever way the use ended.
func TestEndedSinceTellsAReadingARelayOvertook(t *testing.T) {
	g := New(time.Second)
	before := time.Now()
	if g.EndedSince("a", before) {
		t.Fatal("nothing ended yet")
	}
	tk, _ := g.Enter("a", time.Now())
	c := newFake(false)
	tk.Adopt(c)
	if g.EndedSince("a", before) {
		t.Fatal("a relay still open has not ended (Open says it is open)")
	}
	g.Remove("a", c)
	after := time.Now()
	if !g.EndedSince("a", before) {
		t.Fatal("a relay that ended after the reading was asked for must overtake it")
	}
	if g.EndedSince("a", after.Add(time.Nanosecond)) || g.EndedSince("b", before) || g.EndedSince("a", time.Time{}) {
		t.Fatal("a reading asked for after the end, another instance's, or no reading, is not overtaken")
	}
	dial, _ := g.Enter("b", time.Now())
	dial.Leave()
	if !g.EndedSince("b", before) {
		t.Fatal("a dial that ended without relaying may have woken the guest: it overtakes too")
	}
	if !g.EndedSince("c", time.Now().Add(-endedMemory-time.Minute)) {
		t.Fatal("a reading older than what is kept counts as overtaken")
	}
}

// The memory of ended relays is swept as it grows, keeping what a fresh
// reading can still need.
func TestEndedMemoryIsSwept(t *testing.T) {
	g := New(time.Second)
	for i := range 1000 {
		tk, _ := g.Enter("i"+strconv.Itoa(i), time.Now())
		tk.Leave()
	}
	g.mu.Lock()
	for name := range g.ended {
		g.ended[name] = time.Now().Add(-endedMemory - time.Second)
	}
	g.mu.Unlock()
	for i := range 2000 {
		tk, _ := g.Enter("j"+strconv.Itoa(i), time.Now())
		tk.Leave()
	}
	g.mu.Lock()
	n := len(g.ended)
	g.mu.Unlock()
	if n > 2000 {
		t.Fatalf("%d ended relays kept; the 1,000 past the memory must be swept", n)
	}
	if !g.EndedSince("j1999", time.Now().Add(-time.Minute)) {
		t.Fatal("a fresh end was swept")
	}
}
