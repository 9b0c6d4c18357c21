package wake

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Wake outcomes, the values of the outcome label.
const (
	outcomeReady = "ready"
	// The daemon answered initialize, but not with a data-plane success of
	// this version (versionMismatch, another plane): its uses are served
	// all the same, so that the runtime sees the answer.
	outcomeIncompatible = "incompatible"
	outcomeFailed       = "failed"
	outcomeGaveUp       = "gave_up"
	outcomeCancelled    = "cancelled"
	// A power change asked after the use replaced its request for running.
	outcomeSuperseded = "superseded"
	// The replica that wakes the target woke it, and its daemon answered
	// (Options.Elsewhere).
	outcomeElsewhere = "elsewhere"
)

// Metrics are the wake's collectors. None carries a per-target label.
type Metrics struct {
	wakes *prometheus.HistogramVec
}

// NewMetrics registers the wake's collectors on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := newMetrics()
	reg.MustRegister(m.wakes)
	return m
}

func newMetrics() *Metrics {
	m := &Metrics{
		// The name is the data routes' own: the wake was theirs before the
		// public ingress shared it, and dashboards and alerts read it.
		wakes: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_route_wake_duration_seconds",
			Help:    "Time from the start of a wake (or readiness probe) to the daemon answering, by the power the target started from and the outcome (ready, incompatible: answered initialize but not as a data plane of this version, failed, gave_up, cancelled, superseded, elsewhere: the replica that wakes the target woke it and its daemon answered).",
			Buckets: []float64{.01, .025, .05, .075, .1, .15, .25, .5, 1, 2, 5, 10, 30},
		}, []string{"from", "outcome"}),
	}
	// Wakes exist from the start, so that increase() counts the first
	// wake from each power rather than missing it.
	for _, from := range []string{"running", "paused", "stopped", "suspended"} {
		for _, o := range []string{outcomeReady, outcomeIncompatible, outcomeFailed, outcomeGaveUp, outcomeCancelled, outcomeSuperseded, outcomeElsewhere} {
			m.wakes.WithLabelValues(from, o)
		}
	}
	return m
}

func (m *Metrics) wake(from, outcome string, d time.Duration) {
	if m == nil {
		return
	}
	m.wakes.WithLabelValues(from, outcome).Observe(d.Seconds())
}
