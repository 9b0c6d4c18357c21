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
	"github.com/lightspeed-dev/incus-provider/internal/clock"
	"github.com/lightspeed-dev/incus-provider/wake"
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

// wakeRecord is one wake as the provider's own clock saw it (a
// wake.Trace, flattened): the offsets are from the dial's arrival,
// -1 for a time the trace does not have.
type wakeRecord struct {
	Instance  string `json:"instance"`
	From      string `json:"from"`
	ArrivedNs int64  `json:"arrivedNs"` // wall clock, shared with the parent
	Complete  bool   `json:"complete"`  // the starting dial was upgraded
	Wakes     int    `json:"wakes"`
	Probes    int    `json:"probes"`

	TotalNs    int64 `json:"totalNs"`
	IncusNs    int64 `json:"incusNs"`
	DaemonNs   int64 `json:"daemonNs"`
	ProviderNs int64 `json:"providerNs"`
	RecordNs   int64 `json:"recordNs"` // of IncusNs, the wait for the record after the daemon's answer
	PollGapNs  int64 `json:"pollGapNs"`

	FlyingAt, IncusStartAt, IncusEndAt, FirstProbeAt, AnsweredAt, SettledAt int64
	GuestDialAt, GuestUpgradedAt, UpgradedAt                                int64
}

func newWakeRecord(tr wake.Trace) wakeRecord {
	at := func(t time.Time) int64 {
		if t.IsZero() {
			return -1
		}
		return int64(t.Sub(tr.Arrived))
	}
	r := wakeRecord{Instance: tr.Instance, From: tr.From, ArrivedNs: tr.Arrived.UnixNano(), Wakes: tr.Wakes, Probes: len(tr.Probes),
		PollGapNs: int64(tr.PollGap()), FlyingAt: at(tr.Flying), IncusStartAt: at(tr.IncusStart), IncusEndAt: at(tr.IncusEnd),
		FirstProbeAt: -1, AnsweredAt: at(tr.Answered), SettledAt: at(tr.Settled), GuestDialAt: at(tr.GuestDialStart),
		GuestUpgradedAt: at(tr.GuestUpgraded), UpgradedAt: at(tr.Upgraded)}
	if len(tr.Probes) > 0 {
		r.FirstProbeAt = at(tr.Probes[0].Start)
	}
	if b, ok := tr.Breakdown(); ok {
		r.Complete = true
		r.TotalNs, r.IncusNs, r.DaemonNs, r.ProviderNs = int64(b.Total), int64(b.Incus), int64(b.Daemon), int64(b.Provider)
		r.RecordNs = int64(b.Record)
	}
	return r
}

// wakeTraces keeps the provider's last wake traces (GET /bench/wakes).
type wakeTraces struct {
	mu   sync.Mutex
	recs []wakeRecord
}

// record is the wake's trace hook: the flattening is done here, off
// the dial's way, since the hook runs once the relay has started.
func (w *wakeTraces) record(tr wake.Trace) {
	r := newWakeRecord(tr)
	w.mu.Lock()
	if len(w.recs) >= traceKeep {
		w.recs = slices.Delete(w.recs, 0, len(w.recs)-traceKeep+1)
	}
	w.recs = append(w.recs, r)
	w.mu.Unlock()
}

// ServeHTTP answers the wakes of ?instance= whose dial arrived at or
// after ?since= (Unix nanoseconds).
func (w *wakeTraces) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	since, _ := strconv.ParseInt(r.URL.Query().Get("since"), 10, 64)
	inst := r.URL.Query().Get("instance")
	w.mu.Lock()
	out := []wakeRecord{}
	for _, rec := range w.recs {
		if rec.Instance == inst && rec.ArrivedNs >= since {
			out = append(out, rec)
		}
	}
	w.mu.Unlock()
	_ = json.NewEncoder(rw).Encode(out)
}

// wakeSince fetches the provider's trace of the wake whose dial started at
// t0. The hook runs once the relay has started, which may be a moment
// after the client saw the upgrade: ask again briefly until it is there.
func (b *bench) wakeSince(ctx context.Context, t0 time.Time) (wakeRecord, error) {
	q := url.Values{"instance": {b.targetID}, "since": {strconv.FormatInt(t0.UnixNano(), 10)}}
	deadline := time.Now().Add(3 * time.Second)
	for {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		recs, err := b.getWakes(rctx, q)
		cancel()
		if err != nil {
			return wakeRecord{}, err
		}
		if len(recs) > 0 {
			return recs[0], nil
		}
		if time.Now().After(deadline) {
			return wakeRecord{}, fmt.Errorf("the provider reported no trace of the wake at %s", t0.Format(time.StampMicro))
		}
		if !clock.Sleep(ctx, 10*time.Millisecond) {
			return wakeRecord{}, ctx.Err()
		}
	}
}

func (b *bench) getWakes(ctx context.Context, q url.Values) ([]wakeRecord, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.addr+"/bench/wakes?"+q.Encode(), nil)
	if err != nil {
		return nil, err
	}
	req.Header = b.header()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("wake trace: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("wake trace: HTTP %d", resp.StatusCode)
	}
	var recs []wakeRecord
	if err := json.NewDecoder(resp.Body).Decode(&recs); err != nil {
		return nil, fmt.Errorf("wake trace: %w", err)
	}
	return recs, nil
}
