package ingress

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Wake outcomes, the values of the wake histogram's outcome label.
const (
	wakeReady   = "ready"   // the target answered within the hold
	wakeWaking  = "waking"  // the hold ran out: 503 with Retry-After
	wakeGone    = "gone"    // the target went away meanwhile: 404
	wakeFailed  = "failed"  // the target is broken: 502
	wakeAborted = "aborted" // the client went away first
)

var statusClasses = []string{"1xx", "2xx", "3xx", "4xx", "5xx"}

// Metrics are the edge's collectors. No label carries a host or target.
type Metrics struct {
	requests *prometheus.CounterVec
	wakes    *prometheus.HistogramVec
	open     prometheus.Gauge
	bytes    *prometheus.CounterVec
	toGuest  prometheus.Counter
	toClient prometheus.Counter
}

// NewMetrics registers the edge's collectors on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_ingress_requests_total",
			Help: "Public ingress requests answered, by status class (1xx counts WebSocket upgrades).",
		}, []string{"class"}),
		wakes: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_ingress_wake_duration_seconds",
			Help:    "Time a public ingress request waited for its powered-down target, by outcome.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2, 3, 4, 5},
		}, []string{"outcome"}),
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_ingress_upstream_connections",
			Help: "Connections open from the edge to guests' ingress ports.",
		}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_ingress_bytes_total",
			Help: "Bytes the edge carried on upstream connections, by direction (to_guest, to_client).",
		}, []string{"direction"}),
	}
	for _, c := range statusClasses {
		m.requests.WithLabelValues(c)
	}
	for _, o := range []string{wakeReady, wakeWaking, wakeGone, wakeFailed, wakeAborted} {
		m.wakes.WithLabelValues(o)
	}
	m.toGuest, m.toClient = m.bytes.WithLabelValues("to_guest"), m.bytes.WithLabelValues("to_client")
	reg.MustRegister(m.requests, m.wakes, m.open, m.bytes)
	return m
}

func (m *Metrics) request(status int) {
	if m == nil {
		return
	}
	i := status/100 - 1
	if i < 0 || i >= len(statusClasses) {
		i = 4
	}
	m.requests.WithLabelValues(statusClasses[i]).Inc()
}

func (m *Metrics) wake(outcome string, d time.Duration) {
	if m != nil {
		m.wakes.WithLabelValues(outcome).Observe(d.Seconds())
	}
}

func (m *Metrics) opened(delta float64) {
	if m != nil {
		m.open.Add(delta)
	}
}

func (m *Metrics) carried(toGuest bool, n int) {
	if m == nil || n <= 0 {
		return
	}
	if toGuest {
		m.toGuest.Add(float64(n))
	} else {
		m.toClient.Add(float64(n))
	}
}
