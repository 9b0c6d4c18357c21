package provider_test

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

// What "woken once" means, told two ways. Incus's own count is the
// instance-resumed events of the rig's project: each is an unfreeze Incus
// carried out. The provider's count is its wake flights, by the power the
// flight read at its start: a flight from paused or stopped is one that
// acts; a flight from running only records the use's request for running
// over a power-down still recorded (a record a loaded Incus let time out
// is written again by the next use) and probes the daemon, and Incus
// shows nothing of it.

// flights are the wake flights the provider finished since the rig
// started, keyed "from/outcome", from its own metric.
func (r *rig) flights() map[string]int {
	r.t.Helper()
	out := map[string]int{}
	for _, m := range r.series("incus_provider_route_wake_duration_seconds", nil) {
		var from, outcome string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "from":
				from = l.GetValue()
			case "outcome":
				outcome = l.GetValue()
			}
		}
		if n := int(m.GetHistogram().GetSampleCount()); n > 0 {
			out[from+"/"+outcome] += n
		}
	}
	return out
}

// flightsSince is after less before, without the keys that did not move.
func flightsSince(before, after map[string]int) map[string]int {
	out := map[string]int{}
	for k, n := range after {
		if d := n - before[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}

// fromPowerDown counts the flights of fs that began from a powered-down
// read (the ones that act on Incus).
func fromPowerDown(fs map[string]int) int {
	n := 0
	for k, c := range fs {
		if !strings.HasPrefix(k, "running/") {
			n += c
		}
	}
	return n
}

func describeFlights(fs map[string]int) string {
	if len(fs) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(fs)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, fs[k]))
	}
	return strings.Join(parts, ", ")
}

// resumes counts the instance-resumed events Incus sends for the rig's
// project from now on, by instance. The subscription is made before it
// returns, so nothing after the call is missed. The returned function
// waits (at most within) until each of want was resumed at least once,
// stops the subscription and returns the counts; events still on their
// way for other instances are not waited for.
func (r *rig) resumes(want []string, within time.Duration) func() map[string]int {
	r.t.Helper()
	stream, err := r.client.ListenEvents(r.ctx(), incus.EventLifecycle)
	if err != nil {
		r.t.Fatalf("subscribing to Incus's lifecycle events: %v", err)
	}
	project := r.client.Project()
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		seen   = make(chan struct{}, 1)
		done   = make(chan struct{})
	)
	go func() {
		defer close(done)
		for {
			ev, err := stream.Next()
			if err != nil {
				if !errors.Is(err, incus.ErrMalformedEvent) {
					return
				}
				continue
			}
			if ev.Lifecycle == nil || ev.Lifecycle.Action != "instance-resumed" {
				continue
			}
			names, _ := ev.Instances(project)
			mu.Lock()
			for _, n := range names {
				counts[n]++
			}
			mu.Unlock()
			select {
			case seen <- struct{}{}:
			default:
			}
		}
	}()
	allSeen := func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, w := range want {
			if counts[w] == 0 {
				return false
			}
		}
		return true
	}
	var once sync.Once
	var result map[string]int
	stop := func() map[string]int {
		once.Do(func() {
			bound := time.After(within)
		wait:
			for !allSeen() {
				select {
				case <-seen:
				case <-done:
					break wait
				case <-bound:
					break wait
				}
			}
			_ = stream.Close()
			<-done
			mu.Lock()
			result = maps.Clone(counts)
			mu.Unlock()
		})
		return result
	}
	r.t.Cleanup(func() { stop() })
	return stop
}
