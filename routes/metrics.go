package routes

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Dial outcomes, the values of the outcome label.
const (
	OutcomeUpgraded     = "upgraded"
	OutcomeWaking       = "waking"
	OutcomeBooting      = "booting"
	OutcomeGone         = "gone"
	OutcomeFailed       = "failed"
	OutcomeUnauthorized = "unauthorized"
	OutcomeRefusedOwner = "refused_owner"
	OutcomeShed         = "shed"
	OutcomeMalformed    = "malformed"         // not a data route, or not a WebSocket handshake
	OutcomeAborted      = "aborted"           // the runtime went away before its upgrade
	OutcomeUnavailable  = "incus_unavailable" // Incus did not answer the fence (a 503 booting)
)

// Outcomes lists every dial outcome, in the order dashboards show them.
func Outcomes() []string {
	return []string{OutcomeUpgraded, OutcomeWaking, OutcomeBooting, OutcomeGone, OutcomeFailed,
		OutcomeUnauthorized, OutcomeRefusedOwner, OutcomeShed, OutcomeMalformed, OutcomeAborted, OutcomeUnavailable}
}

// Metrics are the data routes' collectors. None carries a per-target label.
type Metrics struct {
	dials         *prometheus.CounterVec
	dialLatency   *prometheus.HistogramVec
	held          prometheus.Gauge
	heldMax       prometheus.Gauge
	open          prometheus.Gauge
	closed        *prometheus.CounterVec
	relayBytes    *prometheus.CounterVec
	relayMessages *prometheus.CounterVec
	bytes         [2]prometheus.Counter // by source side: 0 runtime → guest, 1 guest → runtime
	messages      [2]prometheus.Counter
}

// NewMetrics registers the data routes' collectors on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := newMetrics()
	reg.MustRegister(m.dials, m.dialLatency, m.held, m.heldMax, m.open, m.closed, m.relayBytes, m.relayMessages)
	return m
}

func newMetrics() *Metrics {
	m := &Metrics{
		dials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_route_dials_total",
			Help: "Data route dials, by outcome (upgraded, or why not).",
		}, []string{"outcome"}),
		dialLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_route_dial_duration_seconds",
			Help:    "Time from a data route request's arrival to its upgrade or refusal, by outcome.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2, 3, 4, 5},
		}, []string{"outcome"}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_route_dials_held",
			Help: "Data route dials held now while their target wakes or its daemon starts.",
		}),
		heldMax: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_route_dials_held_max",
			Help: "The most data route dials held at once; a dial beyond it is refused at once (PROVIDER_ROUTE_MAX_HELD).",
		}),
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_relays_open",
			Help: "Data connections relayed now.",
		}),
		closed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_relays_closed_total",
			Help: "Relays ended, by reason (normal, peer_gone, idle, power_down, shutdown, too_big, protocol_error, close_timeout).",
		}, []string{"reason"}),
	}
	m.relayBytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "incus_provider_relay_bytes_total",
		Help: "Bytes relayed on data connections (frame headers included), by direction.",
	}, []string{"direction"})
	m.relayMessages = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "incus_provider_relay_messages_total",
		Help: "Data messages (text or binary, however fragmented) relayed on data connections, by direction.",
	}, []string{"direction"})
	m.bytes[0] = m.relayBytes.WithLabelValues(DirToGuest)
	m.bytes[1] = m.relayBytes.WithLabelValues(DirToRuntime)
	m.messages[0] = m.relayMessages.WithLabelValues(DirToGuest)
	m.messages[1] = m.relayMessages.WithLabelValues(DirToRuntime)
	for _, o := range Outcomes() {
		m.dials.WithLabelValues(o)
		m.dialLatency.WithLabelValues(o)
	}
	for _, r := range []string{"normal", "peer_gone", "idle", "power_down", "shutdown", "too_big", "protocol_error", "close_timeout"} {
		m.closed.WithLabelValues(r)
	}
	return m
}

func (m *Metrics) dial(outcome string, d time.Duration) {
	if m == nil {
		return
	}
	m.dials.WithLabelValues(outcome).Inc()
	m.dialLatency.WithLabelValues(outcome).Observe(d.Seconds())
}

func (m *Metrics) setHeldMax(n int) {
	if m != nil {
		m.heldMax.Set(float64(n))
	}
}

func (m *Metrics) heldAdd(n int) {
	if m != nil {
		m.held.Add(float64(n))
	}
}

func (m *Metrics) relayOpened() {
	if m != nil {
		m.open.Inc()
	}
}

func (m *Metrics) relayClosed(reason string) {
	if m != nil {
		m.open.Dec()
		m.closed.WithLabelValues(reason).Inc()
	}
}

type nopCounter struct{}

func (nopCounter) Add(float64) {}

// direction returns the byte and message counters of traffic read from side.
func (m *Metrics) direction(side int) (bytes, messages counter) {
	if m == nil {
		return nopCounter{}, nopCounter{}
	}
	return m.bytes[side], m.messages[side]
}
