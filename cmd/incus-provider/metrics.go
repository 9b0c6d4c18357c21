package main

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

type incusMetrics struct {
	calls   *prometheus.CounterVec
	latency *prometheus.HistogramVec
}

func newIncusMetrics(reg prometheus.Registerer) *incusMetrics {
	m := &incusMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_incus_requests_total",
			Help: "Incus API calls, by operation and outcome.",
		}, []string{"operation", "status"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_incus_request_duration_seconds",
			Help:    "Incus API call latency, by operation.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"operation"}),
	}
	reg.MustRegister(m.calls, m.latency)
	return m
}

func (m *incusMetrics) observe(op, status string, d time.Duration) {
	m.calls.WithLabelValues(op, status).Inc()
	m.latency.WithLabelValues(op).Observe(d.Seconds())
}
