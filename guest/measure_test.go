//go:build linux

package guest

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"
)

// TestMeasure measures what decides DefaultKind. It runs only with
// GUESTDIAL_MEASURE=1:
//
//	GUESTDIAL_MEASURE=1 go test -count=1 -v -run Measure ./guest/
//
// GUESTDIAL_MEASURE_STARTS (default 15) starts per variant,
// GUESTDIAL_MEASURE_DIALS (default 300) dials per dialer.
//
// Two containers from the test image: "m-plain" without devices (reached with
// netns) and "m-proxy" with the proxy device (reached with proxy). For each
// start: the start call (REST API: PUT state, wait for the operation), then
// the time from the start request to the first successful dial and to the
// first answer from the guest's httpd. Then `incus start` through the CLI, as
// the design notes measured it. Then per-dial latency with both running.
func TestMeasure(t *testing.T) {
	if os.Getenv("GUESTDIAL_MEASURE") != "1" {
		t.Skip("set GUESTDIAL_MEASURE=1 to measure (takes about a minute)")
	}
	f := needIncus(t)
	starts := envInt("GUESTDIAL_MEASURE_STARTS", 15)
	dials := envInt("GUESTDIAL_MEASURE_DIALS", 300)
	netns, proxy := f.dialers(t)

	plain := f.newInstance(t, "m-plain", false)
	withProxy := f.newInstance(t, "m-proxy", false, proxy)
	variants := []struct {
		label string
		tg    Target
		d     Dialer
	}{
		{"no device, netns dialer", plain, netns},
		{"proxy device, proxy dialer", withProxy, proxy},
	}
	// Warm up: the first start of a container does one-off work (idmap of
	// the root filesystem).
	for _, v := range variants {
		f.setState(t, v.tg.Instance, "start")
		waitID(t, v.d, v.tg, v.tg.Instance, 30*time.Second)
		f.setState(t, v.tg.Instance, "stop")
	}

	type series struct{ start, firstDial, firstAnswer, cli durations }
	res := make([]series, len(variants))
	for range starts {
		for i, v := range variants {
			v.d.Forget(v.tg.Instance)
			t0 := time.Now()
			f.setState(t, v.tg.Instance, "start")
			res[i].start = append(res[i].start, time.Since(t0))
			dialAt, answerAt := firstContact(t, v.d, v.tg, t0)
			res[i].firstDial = append(res[i].firstDial, dialAt)
			res[i].firstAnswer = append(res[i].firstAnswer, answerAt)
			f.setState(t, v.tg.Instance, "stop")
		}
	}
	for range starts {
		for i, v := range variants {
			t0 := time.Now()
			if _, err := incusCLI("start", "--project", f.project, v.tg.Instance); err != nil {
				t.Fatal(err)
			}
			res[i].cli = append(res[i].cli, time.Since(t0))
			f.setState(t, v.tg.Instance, "stop")
		}
	}
	for i, v := range variants {
		t.Logf("%-27s start (REST, op done)        %s", v.label, res[i].start)
		t.Logf("%-27s start (`incus start` CLI)    %s", v.label, res[i].cli)
		t.Logf("%-27s start request->first dial   %s", v.label, res[i].firstDial)
		t.Logf("%-27s start request->first answer %s", v.label, res[i].firstAnswer)
	}

	// Per-dial latency, both guests running and answering.
	for _, v := range variants {
		f.setState(t, v.tg.Instance, "start")
		waitID(t, v.d, v.tg, v.tg.Instance, 30*time.Second)
	}
	ctx := context.Background()
	// busybox httpd listens with a backlog of 9: a burst of connections
	// overflows it and later SYNs wait for the 1 s retransmit. Each series
	// therefore starts with both guests answering, and dials are spaced by an
	// untimed 2 ms pause.
	measure := func(label string, fn func() error) {
		for _, v := range variants {
			waitID(t, v.d, v.tg, v.tg.Instance, 30*time.Second)
		}
		var ds durations
		for range dials {
			t0 := time.Now()
			if err := fn(); err != nil {
				t.Fatalf("%s: %v", label, err)
			}
			ds = append(ds, time.Since(t0))
			time.Sleep(2 * time.Millisecond)
		}
		t.Logf("%-44s %s", label, ds)
	}
	dialClose := func(d Dialer, tg Target) func() error {
		return func() error {
			c, err := d.DialContext(ctx, tg)
			if err != nil {
				return err
			}
			return c.Close()
		}
	}
	roundTrip := func(d Dialer, tg Target) func() error {
		return func() error {
			_, err := fetchID(ctx, d, tg)
			return err
		}
	}
	measure("netns dial (PID cached)", dialClose(netns, plain))
	measure("netns dial (PID looked up each time, REST)", func() error {
		netns.Forget(plain.Instance)
		return dialClose(netns, plain)()
	})
	measure("proxy dial", dialClose(proxy, withProxy))
	measure("netns dial + HTTP GET /id", roundTrip(netns, plain))
	measure("proxy dial + HTTP GET /id", roundTrip(proxy, withProxy))
	measure("netns dial + GET, proxy-device instance", roundTrip(netns, withProxy))
	x := f.execDialer(t)
	measure("exec dial (Incus API, nc in the guest)", dialClose(x, plain))
	measure("exec dial + HTTP GET /id", roundTrip(x, plain))
}

// firstContact polls d from the moment the start request was sent (t0)
// and returns when the first dial succeeded and when the guest first
// answered a request.
func firstContact(t *testing.T, d Dialer, tg Target, t0 time.Time) (dialAt, answerAt time.Duration) {
	t.Helper()
	deadline := t0.Add(30 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c, err := d.DialContext(ctx, tg)
		cancel()
		if err == nil {
			if dialAt == 0 {
				dialAt = time.Since(t0)
			}
			if id, err := httpGet(c, "/id", time.Second); err == nil && id == tg.Instance {
				return dialAt, time.Since(t0)
			}
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("%s: no answer within 30s of the start request", tg)
	return 0, 0
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
