package idle

import (
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/idlepolicy"
)

// Metrics are the idle loop's collectors. A nil *Metrics records nothing.
type Metrics struct {
	probes        *prometheus.CounterVec
	probeDuration prometheus.Histogram
	actions       *prometheus.CounterVec
	passDuration  prometheus.Histogram
	targets       *prometheus.GaugeVec
	byMember      *prometheus.GaugeVec

	// oldest is the earliest PhaseSince among the targets in each passing
	// phase (zero: none), set by the loop and read at scrape.
	oldestMu sync.Mutex
	oldest   map[controller.Phase]time.Time
}

// passingPhases are the phases a target only passes through: one that
// stays in them is stuck, whatever the number of others passing.
var passingPhases = []controller.Phase{controller.PhaseProvisioning, controller.PhaseClosing}

// The label values the targets gauge always carries, so that a phase or
// power that empties goes to zero instead of keeping its last value.
var (
	gaugePhases = []controller.Phase{controller.PhaseProvisioning, controller.PhaseActive, controller.PhaseClosing,
		controller.PhaseClosed, controller.PhaseFailed, controller.PhaseUnknown}
	gaugePowers = []controller.Power{controller.PowerRunning, controller.PowerPaused, controller.PowerSuspended, controller.PowerStopped}
)

// NewMetrics registers the idle loop's collectors on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_idle_probes_total",
			Help: "env/getIdle probes of running targets' daemons, by outcome (ok, unreachable, handshake_failed, timeout, malformed, error).",
		}, []string{"outcome"}),
		probeDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "incus_provider_idle_probe_duration_seconds",
			Help:    "Time one idle probe took: env/getIdle, plus dial and handshake when the target had no open session.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}),
		actions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_idle_actions_total",
			Help: "Idle actions the loop took or tried, by action (pause, suspend, stop, close) and result (ok, failed, stale, relay_open).",
		}, []string{"action", "result"}),
		passDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "incus_provider_idle_pass_duration_seconds",
			Help:    "Time for every target running at a pass's start to be probed once.",
			Buckets: []float64{1, 2.5, 5, 10, 15, 20, 25, 30, 45, 60, 120, 300},
		}),
		targets: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "incus_provider_targets",
			Help: "The provider's targets as the latest inventory listing saw them, by phase and power (power \"none\" unless active).",
		}, []string{"phase", "power"}),
	}
	m.byMember = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "incus_provider_targets_by_member",
		Help: "On an Incus cluster, the provider's targets by the member holding them and phase, as the latest inventory listing saw them (unknown: the member does not answer).",
	}, []string{"member", "phase"})
	reg.MustRegister(m.probes, m.probeDuration, m.actions, m.passDuration, m.targets, m.byMember)
	m.oldest = map[controller.Phase]time.Time{}
	for _, ph := range passingPhases {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "incus_provider_targets_oldest_seconds",
			Help:        "How long the oldest target in a passing phase (provisioning: since its create; closing: since its close was recorded) has been in it; 0 when none is.",
			ConstLabels: prometheus.Labels{"phase": string(ph)},
		}, func() float64 { return m.oldestAge(ph, time.Now()) }))
	}
	for _, o := range []string{OutcomeOK, OutcomeUnreachable, OutcomeHandshake, OutcomeTimeout, OutcomeMalformed, OutcomeError} {
		m.probes.WithLabelValues(o)
	}
	for _, a := range []idlepolicy.Action{idlepolicy.ActionPause, idlepolicy.ActionSuspend, idlepolicy.ActionStop, idlepolicy.ActionClose} {
		for _, r := range []string{ResultOK, ResultFailed, ResultStale, ResultRelayOpen} {
			m.actions.WithLabelValues(a.String(), r)
		}
	}
	m.inventory(nil)
	return m
}

func (m *Metrics) probed(outcome string, took time.Duration) {
	if m == nil {
		return
	}
	m.probes.WithLabelValues(outcome).Inc()
	m.probeDuration.Observe(took.Seconds())
}

func (m *Metrics) acted(a idlepolicy.Action, result string) {
	if m == nil {
		return
	}
	m.actions.WithLabelValues(a.String(), result).Inc()
}

func (m *Metrics) passed(d time.Duration) {
	if m == nil {
		return
	}
	m.passDuration.Observe(d.Seconds())
}

func (m *Metrics) oldestAge(ph controller.Phase, now time.Time) float64 {
	m.oldestMu.Lock()
	defer m.oldestMu.Unlock()
	since := m.oldest[ph]
	if since.IsZero() {
		return 0
	}
	return max(now.Sub(since).Seconds(), 0)
}

// setOldest replaces the oldest instants with those of ts.
func (m *Metrics) setOldest(ts []Target) {
	if m == nil {
		return
	}
	next := map[controller.Phase]time.Time{}
	for i := range ts {
		m.olderOf(next, &ts[i])
	}
	m.oldestMu.Lock()
	m.oldest = next
	m.oldestMu.Unlock()
}

// olderOf takes t into oldest if it is in a passing phase and older.
func (m *Metrics) olderOf(oldest map[controller.Phase]time.Time, t *Target) {
	if t.PhaseSince.IsZero() || !slices.Contains(passingPhases, t.Phase) {
		return
	}
	if cur, ok := oldest[t.Phase]; !ok || t.PhaseSince.Before(cur) {
		oldest[t.Phase] = t.PhaseSince
	}
}

// isOldest says whether t holds its phase's oldest instant.
func (m *Metrics) isOldest(t *Target) bool {
	if m == nil {
		return false
	}
	m.oldestMu.Lock()
	defer m.oldestMu.Unlock()
	return !t.PhaseSince.IsZero() && m.oldest[t.Phase].Equal(t.PhaseSince)
}

// gaugeKey is the targets gauge's series for a target: power is "none"
// unless the target is active.
func gaugeKey(t *Target) (phase, power string) {
	if t.Phase != controller.PhaseActive || t.Power == "" {
		return string(t.Phase), "none"
	}
	return string(t.Phase), string(t.Power)
}

// move takes one target's count from the series of from to those of to
// (either nil: a target that appears or goes).
func (m *Metrics) move(from, to *Target) {
	if m == nil {
		return
	}
	for _, c := range []struct {
		t     *Target
		delta float64
	}{{from, -1}, {to, 1}} {
		if c.t == nil {
			continue
		}
		m.targets.WithLabelValues(gaugeKey(c.t)).Add(c.delta)
		if c.delta > 0 {
			m.oldestMu.Lock()
			m.olderOf(m.oldest, c.t)
			m.oldestMu.Unlock()
		}
		if c.t.Location != "" && c.t.Location != "none" {
			m.byMember.WithLabelValues(c.t.Location, string(c.t.Phase)).Add(c.delta)
		}
	}
}

// inventory sets the targets gauge from a listing.
func (m *Metrics) inventory(ts []Target) {
	if m == nil {
		return
	}
	type key struct {
		phase controller.Phase
		power controller.Power
	}
	counts := map[key]int{}
	type place struct {
		member string
		phase  controller.Phase
	}
	placed := map[place]int{}
	members := map[string]bool{}
	for _, t := range ts {
		if t.Location != "" && t.Location != "none" {
			placed[place{t.Location, t.Phase}]++
			members[t.Location] = true
		}
		k := key{t.Phase, t.Power}
		if t.Phase != controller.PhaseActive || t.Power == "" {
			k.power = "none"
		}
		counts[k]++
	}
	for _, ph := range gaugePhases {
		if ph == controller.PhaseActive {
			for _, pw := range gaugePowers {
				m.targets.WithLabelValues(string(ph), string(pw)).Set(float64(counts[key{ph, pw}]))
			}
			continue
		}
		m.targets.WithLabelValues(string(ph), "none").Set(float64(counts[key{ph, "none"}]))
	}
	// Members come and go with the cluster: the series are rebuilt from each
	// listing, every phase of a member that holds a target set (zero too).
	m.byMember.Reset()
	for member := range members {
		for _, ph := range gaugePhases {
			m.byMember.WithLabelValues(member, string(ph)).Set(float64(placed[place{member, ph}]))
		}
	}
}
