package provider_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// These tests run the provider against the three-member cluster of
// deploy/dev/incus-cluster-up.sh (make test brings it up), as a provider on
// the first member: Incus over HTTPS with the cluster certificate pinned,
// guests on its own member through netns and on the others through exec.

const clusterTemplates = `templates:
  - templateId: on-lsm1
    displayName: guest on member lsm1
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm1
  - templateId: on-lsm2
    displayName: guest on member lsm2
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm2
  - templateId: on-lsm3
    displayName: guest on member lsm3
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm3
  - templateId: idle-lsm3
    displayName: guest on lsm3 paused after 1.5 s idle
    powerStates: [running, paused, stopped]
    idle: {pauseAfterMs: 1500}
    imageAlias: {{image}}
    placement: lsm3
`

// countingDialer counts the dials that went its way.
type countingDialer struct {
	guest.Dialer
	n atomic.Int64
}

func (d *countingDialer) DialContext(ctx context.Context, t guest.Target) (net.Conn, error) {
	d.n.Add(1)
	return d.Dialer.DialContext(ctx, t)
}

// memberDialers are the two halves of the cluster rig's dialer, for tests
// that check which way a guest was reached.
var memberDialers = map[*testing.T][2]*countingDialer{}

func newMemberDialer(t *testing.T, member string, client *incus.Client) guest.Dialer {
	t.Helper()
	local, err := guest.New(guest.KindNetns, guest.Options{Lookup: client.InitPID})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := guest.New(guest.KindExec, guest.Options{Exec: func(ctx context.Context, instance string, argv []string) (net.Conn, error) {
		return client.ExecStream(ctx, instance, argv)
	}})
	if err != nil {
		t.Fatal(err)
	}
	l, r := &countingDialer{Dialer: local}, &countingDialer{Dialer: remote}
	memberDialers[t] = [2]*countingDialer{l, r}
	t.Cleanup(func() { delete(memberDialers, t) })
	return guest.NewMember(member, l, r)
}

func TestClusterGuestsOnEveryMember(t *testing.T) {
	cl := incustest.Cluster(t)
	r := newRig(t, rigOptions{cluster: cl})
	halves := memberDialers[t]
	for i, member := range cl.Members {
		local0, remote0 := halves[0].n.Load(), halves[1].n.Load()
		route := r.create("on-"+member, "on-"+member)
		inst, _, err := r.client.GetInstance(r.ctx(), route.TargetID)
		if err != nil {
			t.Fatal(err)
		}
		if inst.Location != member {
			t.Fatalf("template on-%s placed its instance on %q", member, inst.Location)
		}
		for name, d := range inst.ExpandedDevices {
			if d["type"] == "nic" {
				t.Fatalf("%s has a network device %q: its daemon must be reachable by the provider's path alone", inst.Name, name)
			}
		}
		// Relay, then wake from paused and from stopped, each through a
		// route dial, on this member.
		ws := r.mustUpgrade(route)
		_ = ws.Close()
		for _, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
			r.power(route, p)
			d := r.dial(route)
			if d.Conn == nil {
				t.Fatalf("%s, %s: route refused: %+v after %s", member, p, d.Refusal, d.Elapsed)
			}
			initialize(t, d.Conn)
			_ = d.Conn.Close()
			t.Logf("member %s: dial of a %s target answered in %s", member, p, d.Elapsed)
		}
		local, remote := halves[0].n.Load()-local0, halves[1].n.Load()-remote0
		if i == 0 && (local == 0 || remote != 0) {
			t.Fatalf("the provider's own member's guest was dialled %d times through netns and %d through exec; want netns only", local, remote)
		}
		if i > 0 && (remote == 0 || local != 0) {
			t.Fatalf("member %s's guest was dialled %d times through netns and %d through exec; want exec only", member, local, remote)
		}
	}

	// The idle loop reaches a guest on another member and applies its policy.
	route := r.create("idle-on-lsm3", "idle-lsm3")
	start := time.Now()
	r.until(route.Owner, "paused by its idle policy", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused
	})
	t.Logf("idle pause on lsm3 after %s", time.Since(start))
}
