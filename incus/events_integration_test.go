package incus_test

import (
	"context"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// The stream's keep-alive must be answered: a stream that sees no event
// for many silences in a row stays up, and still delivers the next event.
// The silence is shrunk from 30 s to 2 s, not further: beside stress-ng
// on this 2-core machine, a 400 ms silence once passed without incusd's
// pong, and the stream was taken for dead though nothing was wrong. An
// unanswered keep-alive still ends the stream 2 s in, well inside the
// 8 s the test waits.
func TestIntegrationEventsKeepAliveAndDeliver(t *testing.T) {
	c := incustest.Client(t)
	defer incus.SetEventKeepalive(200*time.Millisecond, 2*time.Second)()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	s, err := c.ListenEvents(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	got := make(chan incus.Event, 16)
	ended := make(chan error, 1)
	go func() {
		for {
			ev, err := s.Next()
			if err != nil {
				ended <- err
				return
			}
			got <- ev
		}
	}()
	select {
	case err := <-ended:
		t.Fatalf("the stream ended while idle, through four silences' worth of pings: %v", err)
	case ev := <-got:
		t.Fatalf("an event in an empty project: %+v", ev)
	case <-time.After(8 * time.Second):
	}
	op, err := c.CreateInstance(ctx, incus.InstancesPost{Name: "ev1", Source: incus.InstanceSource{Type: "none"}})
	if err == nil {
		_, err = c.Wait(ctx, op)
	}
	if err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case err := <-ended:
			t.Fatalf("the stream ended before the create's event: %v", err)
		case ev := <-got:
			names, ok := ev.Instances(c.Project())
			if ok && ev.Lifecycle != nil && ev.Lifecycle.Action == "instance-created" && len(names) == 1 && names[0] == "ev1" {
				return
			}
		case <-ctx.Done():
			t.Fatal("no instance-created event for ev1")
		}
	}
}
