package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
)

// dialRecord is one dial the provider made through its GuestDialer: the
// wake path's probes and its relay, each an exec for a remote guest.
type dialRecord struct {
	Instance string `json:"instance"`
	StartNs  int64  `json:"startNs"` // wall clock, shared with the parent
	TookNs   int64  `json:"tookNs"`
	Err      string `json:"err,omitempty"`
}

// traceKeep bounds the dials a tracingDialer remembers.
const traceKeep = 4096

// tracingDialer records every dial of the provider's GuestDialer, so that
// the benchmark can say how a wake spent its time (GET /bench/dials).
type tracingDialer struct {
	guest.Dialer
	mu   sync.Mutex
	recs []dialRecord
}

func (d *tracingDialer) DialContext(ctx context.Context, t guest.Target) (net.Conn, error) {
	start := time.Now()
	c, err := d.Dialer.DialContext(ctx, t)
	r := dialRecord{Instance: t.Instance, StartNs: start.UnixNano(), TookNs: int64(time.Since(start))}
	if err != nil {
		r.Err = err.Error()
	}
	d.mu.Lock()
	if len(d.recs) >= traceKeep {
		d.recs = slices.Delete(d.recs, 0, len(d.recs)-traceKeep+1)
	}
	d.recs = append(d.recs, r)
	d.mu.Unlock()
	return c, err
}

// ServeHTTP answers the dials of ?instance= that started at or after
// ?since= (Unix nanoseconds).
func (d *tracingDialer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	since, _ := strconv.ParseInt(r.URL.Query().Get("since"), 10, 64)
	inst := r.URL.Query().Get("instance")
	d.mu.Lock()
	out := []dialRecord{}
	for _, rec := range d.recs {
		if rec.Instance == inst && rec.StartNs >= since {
			out = append(out, rec)
		}
	}
	d.mu.Unlock()
	_ = json.NewEncoder(w).Encode(out)
}

// wakeDials is how the provider dialled during one wake, from the route
// dial's start: the failed dials (for exec into a frozen guest, Incus
// refuses the exec), then the successful ones (the readiness probe, then
// the relay).
type wakeDials struct {
	failed int
	// ok are the successful dials' starts and durations, in order.
	okAt, okTook []time.Duration
	upgraded     time.Duration // the route dial's whole latency
}

// dialsSince fetches the provider's dials of the target since t0.
func (b *bench) dialsSince(ctx context.Context, t0 time.Time, upgraded time.Duration) (wakeDials, error) {
	q := url.Values{"instance": {b.targetID}, "since": {strconv.FormatInt(t0.UnixNano(), 10)}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.addr+"/bench/dials?"+q.Encode(), nil)
	if err != nil {
		return wakeDials{}, err
	}
	req.Header = b.header()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return wakeDials{}, fmt.Errorf("dial trace: %w", err)
	}
	defer resp.Body.Close()
	var recs []dialRecord
	if err := json.NewDecoder(resp.Body).Decode(&recs); err != nil {
		return wakeDials{}, fmt.Errorf("dial trace: %w", err)
	}
	wd := wakeDials{upgraded: upgraded}
	for _, r := range recs {
		at := time.Duration(r.StartNs - t0.UnixNano())
		if at > upgraded {
			continue // after the upgrade: not this wake's
		}
		if r.Err != "" {
			wd.failed++
			continue
		}
		wd.okAt = append(wd.okAt, at)
		wd.okTook = append(wd.okTook, time.Duration(r.TookNs))
	}
	return wd, nil
}
