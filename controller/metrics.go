package controller

import (
	"sync/atomic"
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
	refused      *prometheus.CounterVec
	// budget is the decode budget the handler was given, read by the
	// gauge of bytes in decode.
	budget atomic.Pointer[jsonrpc.Budget]
}

// Reasons a controller request or connection is refused for capacity.
const (
	// RefusedConnectionLimit: a connection over MaxConnections, answered
	// 503 before the upgrade.
	RefusedConnectionLimit = "connectionLimit"
	// RefusedDecodeBudget: a request whose frame found no decode budget,
	// answered busy/capacityExhausted.
	RefusedDecodeBudget = "decodeBudget"
)

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
	m.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "incus_provider_controller_refused_total",
		Help: "Controller connections and requests refused for capacity: connectionLimit (HTTP 503 before the upgrade, over PROVIDER_MAX_CONTROL_CONNECTIONS), decodeBudget (busy/capacityExhausted, no room in PROVIDER_DECODE_BUDGET).",
	}, []string{"reason"})
	decodeBytes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "incus_provider_controller_decode_bytes",
		Help: "Bytes of large controller frames held in the decode budget now (read and not yet served).",
	}, func() float64 {
		if b := m.budget.Load(); b != nil {
			return float64(b.InUse())
		}
		return 0
	})
	reg.MustRegister(m.requests, m.latency, m.connections, m.unauthorized, m.refused, decodeBytes)
	for _, r := range []string{RefusedConnectionLimit, RefusedDecodeBudget} {
		m.refused.WithLabelValues(r)
	}
	// Pre-create the series dashboards rely on, so rates start at zero rather than absent.
	// Every kind too, so that an alert on internal or unavailable sees the
	// first one.
	for _, method := range append(Methods(), "unknown") {
		m.requests.WithLabelValues(method, "ok")
		for _, kind := range jsonrpc.Kinds() {
			m.requests.WithLabelValues(method, string(kind))
		}
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

func (m *Metrics) refuse(reason string) {
	if m != nil {
		m.refused.WithLabelValues(reason).Inc()
	}
}

// Refused is the refusals counter of one reason (for tests).
func (m *Metrics) Refused(reason string) prometheus.Counter { return m.refused.WithLabelValues(reason) }
