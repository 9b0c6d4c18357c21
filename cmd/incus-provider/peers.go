package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// peerMetrics count forwarded dials on both sides. The member label is a
// configured peer's member (bounded by PROVIDER_PEERS) or a member with no
// peer, which the cluster bounds.
type peerMetrics struct {
	dials  *prometheus.CounterVec
	served *prometheus.CounterVec
	open   prometheus.Gauge
}

func newPeerMetrics(reg prometheus.Registerer, peers map[string]string) *peerMetrics {
	m := &peerMetrics{
		dials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_peer_dials_total",
			Help: "Dials of guests on other cluster members, by member and outcome: forwarded (through that member's replica), guest_refused (the replica reached the guest, which refused), fallback (exec, because the replica was unreachable, refused, or the guest had moved), no_peer (exec: no replica configured for the member).",
		}, []string{"member", "outcome"}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "incus_provider_peer_served_total",
			Help: "Dials forwarded to this replica by the others, by outcome: forwarded, guest_refused, dial_failed, refused (no valid proof of the shared secret, or not a forwarding request).",
		}, []string{"outcome"}),
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "incus_provider_peer_connections",
			Help: "Forwarded connections this replica holds open for the other replicas.",
		}),
	}
	reg.MustRegister(m.dials, m.served, m.open)
	// Every series an alert reads exists before its first event.
	for member := range peers {
		for _, o := range guest.ForwardOutcomes {
			m.dials.WithLabelValues(member, o)
		}
	}
	for _, o := range guest.ForwardServerOutcomes {
		m.served.WithLabelValues(o)
	}
	return m
}

// peerLog rate-limits what forwarding failures log: one line per member a
// minute, since an unreachable peer fails every dial.
type peerLog struct {
	log  *zap.Logger
	mu   sync.Mutex
	last map[string]time.Time
}

func (p *peerLog) once(key string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.last[key]; ok && time.Since(t) < time.Minute {
		return false
	}
	if p.last == nil {
		p.last = map[string]time.Time{}
	}
	p.last[key] = time.Now()
	return true
}

func (p *peerLog) client(m *peerMetrics) func(member, outcome string, reason error) {
	return func(member, outcome string, reason error) {
		m.dials.WithLabelValues(member, outcome).Inc()
		// Keyed by member alone: a reason names the instance, and a key per
		// instance would grow without bound.
		if outcome == guest.ForwardFallback && reason != nil && p.once("dial "+member) {
			p.log.Warn("a guest on another member is dialled through exec, not through its member's replica",
				zap.String("member", member), zap.Error(reason))
		}
	}
}

func (p *peerLog) server(m *peerMetrics) func(outcome string, reason error) {
	return func(outcome string, reason error) {
		m.served.WithLabelValues(outcome).Inc()
		if outcome == guest.ForwardRefused && p.once("refused") {
			p.log.Warn("refused a forwarded dial (logged once a minute)", zap.Error(reason))
		}
	}
}

// servePeers binds PROVIDER_PEER_LISTEN and serves the other replicas'
// dials of this member's guests, and their wakes of the targets this
// replica wakes (wake), until ctx ends.
func servePeers(ctx context.Context, cfg config, member string, client *incus.Client, secrets *guest.PeerSecrets, m *peerMetrics, pl *peerLog,
	wake func(context.Context, guest.WakeRequest) (guest.WakeAnswer, error)) (func() error, error) {
	if member == "" {
		return nil, errors.New("PROVIDER_PEER_LISTEN serves this replica's member's guests to the others, but no member is known: set PROVIDER_INCUS_MEMBER")
	}
	srv, err := guest.NewForwardServer(guest.ForwardServerOptions{
		Member: member, Secrets: secrets,
		Local:   guest.NewNetns(guest.OnMember(member, client.LocatedInitPID)),
		Observe: pl.server(m),
		Opened:  func(d int) { m.open.Add(float64(d)) },
		Wake:    wake,
	})
	if err != nil {
		return nil, err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", cfg.PeerListen)
	if err != nil {
		return nil, fmt.Errorf("PROVIDER_PEER_LISTEN=%q cannot be bound: %w", cfg.PeerListen, err)
	}
	return func() error { return srv.Serve(ctx, ln) }, nil
}

// peerLines is one /readyz line per peer: where it is and whether dials
// reach it.
func peerLines(d guest.Dialer) string {
	var b strings.Builder
	for _, p := range guest.Peers(d) {
		if p.Down {
			fmt.Fprintf(&b, "peer %s at %s: unreachable, its guests are dialled through exec: %s\n", p.Member, p.Address, p.Reason)
			continue
		}
		fmt.Fprintf(&b, "peer %s at %s: in use\n", p.Member, p.Address)
	}
	return b.String()
}
