package incus

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"
)

// The endpoint order and cool-down rules, under random calls that overlap
// and end in random ways. INCUS_TEST_SEED replays a run.
func TestEndpointOrderRandomized(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("INCUS_TEST_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("INCUS_TEST_SEED=%q: %v", s, err)
		}
		seed = n
	}
	t.Logf("seed %d (INCUS_TEST_SEED=%d replays it)", seed, seed)
	rnd := rand.New(rand.NewPCG(seed, 0x1ce))

	for run := range 20 {
		clock := newFakeClock()
		set := &endpointSet{coolMin: time.Second, coolMax: 30 * time.Second, now: clock.now}
		n := 1 + rnd.IntN(4)
		for i := range n {
			set.list = append(set.list, &endpoint{index: i, label: strconv.Itoa(i)})
		}
		type call struct {
			picks []pick
			write bool
		}
		var inFlight []call
		probing := map[int]bool{} // endpoint index → a call in flight holds its probe

		for step := range 300 {
			where := fmt.Sprintf("run %d (%d endpoints) step %d", run, n, step)
			write := rnd.IntN(3) == 0
			before := set.states()
			picks := set.order(!write)
			checkOrder(t, where, set, before, picks, write, clock.now())
			for _, p := range picks {
				if p.probe {
					if probing[p.ep.index] {
						t.Fatalf("%s: endpoint %d handed to two probing calls at once", where, p.ep.index)
					}
					probing[p.ep.index] = true
				}
			}
			inFlight = append(inFlight, call{picks, write})

			// Settle a random call in flight: each pick fails, succeeds
			// (and the call ends) or is left unused.
			for len(inFlight) > 0 && rnd.IntN(3) != 0 {
				k := rnd.IntN(len(inFlight))
				c := inFlight[k]
				inFlight = append(inFlight[:k], inFlight[k+1:]...)
				ended := false
				for _, p := range c.picks {
					prev := stateOf(set, p.ep.index)
					switch {
					case ended:
						p.release()
					case rnd.IntN(3) == 0:
						set.succeeded(p)
						ended = true
						if st := stateOf(set, p.ep.index); !st.Healthy || st.Failures != 0 || !st.RetryAt.IsZero() {
							t.Fatalf("%s: after a success %+v", where, st)
						}
					default:
						set.failed(p, errors.New("boom"))
						st := stateOf(set, p.ep.index)
						if st.Failures != prev.Failures && st.Failures != prev.Failures+1 {
							t.Fatalf("%s: failures went from %d to %d", where, prev.Failures, st.Failures)
						}
						if st.Failures == prev.Failures+1 {
							want := min(time.Second<<(st.Failures-1), 30*time.Second)
							if st.Failures > 6 {
								want = 30 * time.Second
							}
							if got := st.RetryAt.Sub(clock.now()); got != want {
								t.Fatalf("%s: failure %d set a cool-down of %s, want %s", where, st.Failures, got, want)
							}
						}
					}
					if p.probe {
						probing[p.ep.index] = false
					}
				}
			}
			clock.advance(time.Duration(rnd.IntN(4000)) * time.Millisecond)
		}
		for _, c := range inFlight {
			for _, p := range c.picks {
				p.release()
			}
		}
	}
}

func stateOf(s *endpointSet, i int) EndpointState { return s.states()[i] }

// checkOrder holds a call's order to the rules of endpointSet.order.
func checkOrder(t *testing.T, where string, set *endpointSet, before []EndpointState, picks []pick, write bool, now time.Time) {
	t.Helper()
	if len(picks) != len(set.list) {
		t.Fatalf("%s: %d picks for %d endpoints", where, len(picks), len(set.list))
	}
	seen := map[int]bool{}
	phase := 0 // 0 probes, 1 healthy, 2 cooling
	lastIndex, lastRetry := -1, time.Time{}
	for _, p := range picks {
		i := p.ep.index
		if seen[i] {
			t.Fatalf("%s: endpoint %d twice", where, i)
		}
		seen[i] = true
		st := before[i]
		var ph int
		switch {
		case p.probe:
			ph = 0
			if write || st.Healthy || now.Before(st.RetryAt) {
				t.Fatalf("%s: probe of %+v (write %v)", where, st, write)
			}
		case st.Healthy:
			ph = 1
		default:
			ph = 2
		}
		if len(set.list) == 1 {
			continue
		}
		if ph < phase {
			t.Fatalf("%s: %v after a later kind of endpoint", where, st)
		}
		if ph != phase {
			phase, lastIndex, lastRetry = ph, -1, time.Time{}
		}
		switch ph {
		case 0, 1:
			if i < lastIndex {
				t.Fatalf("%s: out of configured order: %d after %d", where, i, lastIndex)
			}
			lastIndex = i
		case 2:
			if st.RetryAt.Before(lastRetry) {
				t.Fatalf("%s: cooling endpoints out of retry order", where)
			}
			lastRetry = st.RetryAt
		}
	}
}

// Calls in flight when a member dies all fail on it; that is one failure,
// not one per call.
func TestConcurrentFailuresCountOnce(t *testing.T) {
	clock := newFakeClock()
	set := &endpointSet{coolMin: time.Second, coolMax: 30 * time.Second, now: clock.now}
	set.list = []*endpoint{{label: "a"}, {index: 1, label: "b"}}
	var picks []pick
	for range 20 {
		picks = append(picks, set.order(true)[0])
	}
	for _, p := range picks {
		set.failed(p, errors.New("connection refused"))
	}
	if st := set.states()[0]; st.Failures != 1 || st.RetryAt.Sub(clock.now()) != time.Second {
		t.Fatalf("%+v", st)
	}
}
