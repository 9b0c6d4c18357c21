package controller

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// Metrics are the controller plane's collectors, registered once.
type Metrics struct {
	requests     *prometheus.CounterVec
	latency      *prometheus.HistogramVec
	connections  prometheus.Gauge
	unauthorized prometheus.Counter
}

// NewMetrics registers the controller's collectors on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_controller_requests_total",
			Help: "Controller requests answered, by method and error kind (\"ok\" for success).",
		}, []string{"method", "kind"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_controller_request_duration_seconds",
			Help:    "Time from a controller request's arrival to its answer, by method.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"method"}),
		connections: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_controller_connections",
			Help: "Open controller connections.",
		}),
		unauthorized: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "incus_provider_controller_unauthorized_total",
			Help: "Controller connections refused with 401 for a missing or wrong credential.",
		}),
	}
	reg.MustRegister(m.requests, m.latency, m.connections, m.unauthorized)
	// Pre-create the series dashboards rely on, so rates start at zero rather than absent.
	for _, method := range append(Methods(), "unknown") {
		m.requests.WithLabelValues(method, "ok")
		m.latency.WithLabelValues(method)
	}
	return m
}

func (m *Metrics) observe(method string, kind jsonrpc.Kind, d time.Duration) {
	label := string(kind)
	if label == "" {
		label = "ok"
	}
	m.requests.WithLabelValues(method, label).Inc()
	m.latency.WithLabelValues(method).Observe(d.Seconds())
}
