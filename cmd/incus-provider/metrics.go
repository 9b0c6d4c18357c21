package main

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/buildinfo"
)

type incusMetrics struct {
	calls    *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	attempts *prometheus.CounterVec
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
		// The endpoint label is one of the configured endpoints (a
		// cluster member's host:port, or "unix"): bounded by INCUS_URL.
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_incus_endpoint_requests_total",
			Help: "Attempts of Incus API calls on each configured endpoint, by outcome (ok, not_found, conflict, error, transport, timeout, not_ready, canceled).",
		}, []string{"endpoint", "status"}),
	}
	reg.MustRegister(m.calls, m.latency, m.attempts)
	// Every call's every status from the start: an alert's rate() then
	// sees the first failure, which a series born with it would hide.
	for _, op := range incus.Operations() {
		m.latency.WithLabelValues(op)
		for _, st := range incus.CallStatuses() {
			m.calls.WithLabelValues(op, st)
		}
	}
	return m
}

// watchAttempts starts each configured endpoint's attempt counter at zero
// for every status.
func (m *incusMetrics) watchAttempts(client *incus.Client) {
	for _, ep := range client.Endpoints() {
		for _, st := range incus.AttemptStatuses() {
			m.attempts.WithLabelValues(ep.Label, st)
		}
	}
}

// registerBuildInfo exposes the build as a constant 1 with labels, the
// usual way to show and join on the running version.
func registerBuildInfo(reg prometheus.Registerer) {
	bi := buildinfo.Read()
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "incus_provider_build_info",
		Help: "Always 1; its labels say which build runs: version, revision (git), goversion and target.",
		ConstLabels: prometheus.Labels{"version": bi.Version, "revision": bi.GitSha, "goversion": bi.GoVersion,
			"target": bi.Target},
	}, func() float64 { return 1 }))
}

func (m *incusMetrics) observe(op, status string, d time.Duration) {
	m.calls.WithLabelValues(op, status).Inc()
	m.latency.WithLabelValues(op).Observe(d.Seconds())
}

func (m *incusMetrics) observeEndpoint(endpoint, _, status string, _ time.Duration) {
	m.attempts.WithLabelValues(endpoint, status).Inc()
}

// watchEndpoints exposes each configured endpoint's health, read from the
// client at scrape time.
func watchEndpoints(reg prometheus.Registerer, client *incus.Client) {
	for i, st := range client.Endpoints() {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "incus_provider_incus_endpoint_up",
			Help:        "1 while the Incus endpoint has not failed since it last answered, 0 while calls set it aside.",
			ConstLabels: prometheus.Labels{"endpoint": st.Label},
		}, func() float64 {
			if client.Endpoints()[i].Healthy {
				return 1
			}
			return 0
		}))
	}
}

// registerLimits exposes the ceilings the settings put on this process, so
// that alerts and panels compare what is used with what is allowed without
// a copy of the settings: limit is listener_connections
// (PROVIDER_MAX_CONNECTIONS), controller_connections
// (PROVIDER_MAX_CONTROL_CONNECTIONS) and, unless it is off, memory_bytes
// (PROVIDER_MEMORY_LIMIT, the Go runtime's soft limit).
func registerLimits(reg prometheus.Registerer, cfg config) {
	limits := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "incus_provider_limit",
		Help: "A ceiling the settings put on this process, by limit: listener_connections (PROVIDER_MAX_CONNECTIONS), controller_connections (PROVIDER_MAX_CONTROL_CONNECTIONS), memory_bytes (PROVIDER_MEMORY_LIMIT; absent when off).",
	}, []string{"limit"})
	reg.MustRegister(limits)
	limits.WithLabelValues("listener_connections").Set(float64(cfg.MaxConnections))
	limits.WithLabelValues("controller_connections").Set(float64(cfg.MaxControl))
	if cfg.memoryLimitBytes > 0 {
		limits.WithLabelValues("memory_bytes").Set(float64(cfg.memoryLimitBytes))
	}
}
