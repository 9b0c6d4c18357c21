package provider_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
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
	w := watchEvents(r.t, r.client, func(action, _ string) (string, bool) { return "", action == "instance-resumed" })
	return func() map[string]int {
		byInstance := w(within, func(seen map[string]map[string]int) bool {
			for _, n := range want {
				if seen[n][""] == 0 {
					return false
				}
			}
			return true
		})
		counts := map[string]int{}
		for n, by := range byInstance {
			counts[n] = by[""]
		}
		return counts
	}
}

// watchLifecycle counts, from now on, the lifecycle events Incus sends for
// one instance of client's project, by action. The subscription is made
// before it returns. The returned function waits (at most within) until
// done says the counts are complete, then stops and answers them.
func watchLifecycle(t *testing.T, client *incus.Client, instance string) func(within time.Duration, done func(map[string]int) bool) map[string]int {
	t.Helper()
	w := watchEvents(t, client, func(action, name string) (string, bool) { return action, name == instance })
	return func(within time.Duration, done func(map[string]int) bool) map[string]int {
		return w(within, func(seen map[string]map[string]int) bool { return done(seen[instance]) })[instance]
	}
}

// watchEvents counts client's project's lifecycle events from now on, per
// instance and by the key keep gives each (events keep refuses are not
// counted). The subscription is made before it returns, so nothing after
// the call is missed. The returned function waits, at most within, until
// done says the counts are complete, stops the subscription and answers
// them; it runs again at the test's end, if no one called it.
func watchEvents(t *testing.T, client *incus.Client, keep func(action, instance string) (string, bool)) func(within time.Duration, done func(map[string]map[string]int) bool) map[string]map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	stream, err := client.ListenEvents(ctx, incus.EventLifecycle)
	cancel()
	if err != nil {
		t.Fatalf("subscribing to Incus's lifecycle events: %v", err)
	}
	project := client.Project()
	var (
		mu     sync.Mutex
		counts = map[string]map[string]int{}
		seen   = make(chan struct{}, 1)
		ended  = make(chan struct{})
	)
	go func() {
		defer close(ended)
		for {
			ev, err := stream.Next()
			if err != nil {
				if !errors.Is(err, incus.ErrMalformedEvent) {
					return
				}
				continue
			}
			if ev.Lifecycle == nil {
				continue
			}
			names, _ := ev.Instances(project)
			mu.Lock()
			for _, n := range names {
				if key, ok := keep(ev.Lifecycle.Action, n); ok {
					if counts[n] == nil {
						counts[n] = map[string]int{}
					}
					counts[n][key]++
				}
			}
			mu.Unlock()
			select {
			case seen <- struct{}{}:
			default:
			}
		}
	}()
	var once sync.Once
	var result map[string]map[string]int
	stop := func(within time.Duration, done func(map[string]map[string]int) bool) map[string]map[string]int {
		once.Do(func() {
			complete := func() bool {
				mu.Lock()
				defer mu.Unlock()
				return done(counts)
			}
			bound := time.After(within)
		wait:
			for !complete() {
				select {
				case <-seen:
				case <-ended:
					break wait
				case <-bound:
					break wait
				}
			}
			_ = stream.Close()
			<-ended
			mu.Lock()
			result = map[string]map[string]int{}
			for n, by := range counts {
				result[n] = maps.Clone(by)
			}
			mu.Unlock()
		})
		return result
	}
	t.Cleanup(func() { stop(0, func(map[string]map[string]int) bool { return true }) })
	return stop
}
