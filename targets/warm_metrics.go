package targets

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/templates"
)

// WarmMetrics counts the warm pools' work. The template label is bounded by
// the catalog: only templates with a warm pool have series, each from zero.
// A nil *WarmMetrics counts nothing.
type WarmMetrics struct {
	handouts *prometheus.CounterVec
	refills  *prometheus.CounterVec
	size     *prometheus.GaugeVec
	wanted   *prometheus.GaugeVec
	handoutT *prometheus.HistogramVec
	refillT  *prometheus.HistogramVec
	held     *prometheus.GaugeVec

	mu   sync.Mutex
	last map[string]bool // the templates the size gauge has a series for
}

// The outcomes of a new owner's create of a template with a warm pool, and
// of a refill.
const (
	warmOutcomeHit    = "hit"
	warmOutcomeMiss   = "miss"
	warmOutcomeOK     = "ok"
	warmOutcomeFailed = "failed"
)

// NewWarmMetrics registers the warm pool metrics on reg.
func NewWarmMetrics(reg prometheus.Registerer) *WarmMetrics {
	m := &WarmMetrics{
		handouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_warm_handouts_total",
			Help: "Creates of a new owner's target from a template with a warm pool, by outcome: hit (a warm instance was handed out) or miss (created from the image).",
		}, []string{"template", "outcome"}),
		refills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_warm_refills_total",
			Help: "Warm instances this process created to refill a pool, by outcome (ok, failed).",
		}, []string{"template", "outcome"}),
		size: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "incus_provider_warm_instances",
			Help: "Warm instances ready to be handed out, per template, as this process last saw them.",
		}, []string{"template"}),
		wanted: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "incus_provider_warm_wanted",
			Help: "The size this process wants each pool at: the largest burst of creates within the burst window during the shrink period, and a quarter more, between the template's warm and warmMax.",
		}, []string{"template"}),
		handoutT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_warm_handout_seconds",
			Help:    "Time of a hand-out that gave the owner a warm instance: from its claim to the instance at the owner's name.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5},
		}, []string{"template"}),
		refillT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "incus_provider_warm_refill_seconds",
			Help:    "Time of a refill that succeeded: from its create to the warm instance marked ready.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"template"}),
		held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "incus_provider_warm_held_back",
			Help: "Warm instances a pool wants and this process did not create at its last refill round because PROVIDER_WARM_MEMORY_MAX would be exceeded.",
		}, []string{"template"}),
	}
	reg.MustRegister(m.handouts, m.refills, m.size, m.wanted, m.handoutT, m.refillT, m.held)
	return m
}

// Start makes every series of the catalog's pools exist at zero, so that
// increase() counts the first hit, miss or refill.
func (m *WarmMetrics) Start(c *templates.Catalog) {
	if m == nil || c == nil {
		return
	}
	for _, t := range c.All() {
		if !t.Pooled() {
			continue
		}
		id := t.Wire.TemplateID
		m.handouts.WithLabelValues(id, warmOutcomeHit)
		m.handouts.WithLabelValues(id, warmOutcomeMiss)
		m.refills.WithLabelValues(id, warmOutcomeOK)
		m.refills.WithLabelValues(id, warmOutcomeFailed)
		m.size.WithLabelValues(id)
		m.wanted.WithLabelValues(id).Set(float64(t.Warm))
		m.handoutT.WithLabelValues(id)
		m.refillT.WithLabelValues(id)
		m.held.WithLabelValues(id)
	}
}

func (m *WarmMetrics) handout(template string, hit bool) {
	if m == nil {
		return
	}
	outcome := warmOutcomeMiss
	if hit {
		outcome = warmOutcomeHit
	}
	m.handouts.WithLabelValues(template, outcome).Inc()
}

// refill counts a refill; took is its time when it succeeded.
func (m *WarmMetrics) refill(template string, ok bool, took time.Duration) {
	if m == nil {
		return
	}
	outcome := warmOutcomeFailed
	if ok {
		outcome = warmOutcomeOK
		m.refillT.WithLabelValues(template).Observe(took.Seconds())
	}
	m.refills.WithLabelValues(template, outcome).Inc()
}

// handedOut records the time of a hand-out that gave a warm instance.
func (m *WarmMetrics) handedOut(template string, took time.Duration) {
	if m == nil {
		return
	}
	m.handoutT.WithLabelValues(template).Observe(took.Seconds())
}

// sizes sets the pools' gauges (ready spares, and the size wanted) for the
// templates given and removes the series of templates that no longer keep
// a pool.
func (m *WarmMetrics) sizes(by, wanted map[string]int) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for id := range m.last {
		if _, ok := by[id]; !ok {
			m.size.DeleteLabelValues(id)
			m.wanted.DeleteLabelValues(id)
			m.handoutT.DeleteLabelValues(id)
			m.refillT.DeleteLabelValues(id)
			m.held.DeleteLabelValues(id)
		}
	}
	m.last = make(map[string]bool, len(by))
	for id, n := range by {
		m.size.WithLabelValues(id).Set(float64(n))
		m.wanted.WithLabelValues(id).Set(float64(wanted[id]))
		m.last[id] = true
	}
}

// heldBack sets, for every pooled template of the catalog, how many spares
// the last refill round held back at the memory ceiling.
func (m *WarmMetrics) heldBack(c *templates.Catalog, by map[string]int) {
	if m == nil || c == nil {
		return
	}
	for _, t := range c.All() {
		if t.Pooled() {
			m.held.WithLabelValues(t.Wire.TemplateID).Set(float64(by[t.Wire.TemplateID]))
		}
	}
}
