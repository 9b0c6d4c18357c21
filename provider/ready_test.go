package provider_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/routes"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// readyTemplates keeps three frozen spares of the dev guest.
const readyTemplates = `templates:
  - templateId: ready
    displayName: ready guest
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    warm: 3
    warmMax: 3
    warmState: frozen
`

// The keys a test reads as an outside party would.
const (
	standinKey   = "user.lightspeed.standin"
	warmClaimKey = "user.lightspeed.warm_claim"
	warmReadyKey = "user.lightspeed.warm_ready_ms"
)

// spares lists the ready spares in the pool: started, frozen, unclaimed.
func (r *rig) spares() []incus.Instance {
	r.t.Helper()
	list, err := r.client.ListInstances(r.ctx())
	if err != nil {
		r.t.Fatal(err)
	}
	var out []incus.Instance
	for _, inst := range list {
		if strings.HasPrefix(inst.Name, "lsr-") && inst.Config[warmReadyKey] != "" && inst.Config[warmClaimKey] == "" {
			out = append(out, inst)
		}
	}
	return out
}

// awaitSpares waits until the pool holds n frozen spares.
func (r *rig) awaitSpares(n int, most time.Duration) {
	r.t.Helper()
	deadline := time.Now().Add(most)
	for {
		sp := r.spares()
		frozen := 0
		for _, inst := range sp {
			if inst.Status == incus.InstanceFrozen {
				frozen++
			}
		}
		if frozen >= n {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("the pool never held %d frozen spares (holds %d, %d frozen)", n, len(sp), frozen)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestReadySparesOnIncus: on the real Incus and the dev guest, a create
// from a pool of frozen spares answers active and running at once, under
// the spare's name; the owner's stand-in locks its name; each handed-out
// guest's daemon answers through its data route with an identity of its
// own; a handed-out target pauses and wakes like any other; a burst of
// owners at once each end with one target; and closes leave nothing of
// theirs, stand-ins included.
func TestReadySparesOnIncus(t *testing.T) {
	r := newRig(t, rigOptions{templates: readyTemplates, image: incustest.Image(t)})
	r.awaitSpares(3, 3*time.Minute)
	var owners []controller.Owner
	var handed []routes.Route
	ids := map[string]bool{}
	for i := range 3 {
		owner := controller.Owner{UniverseID: "u-ready", EnvironmentID: fmt.Sprintf("one-%d", i)}
		owners = append(owners, owner)
		began := time.Now()
		obs, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: "ready"})
		took := time.Since(began)
		if err != nil {
			t.Fatal(err)
		}
		if obs.Phase != controller.PhaseActive || obs.Power != controller.PowerRunning || !strings.HasPrefix(obs.TargetID, "lsr-") {
			t.Fatalf("a create from the pool answered %+v, want active and running under a spare's name", obs)
		}
		t.Logf("create %d → active: %s", i, took.Round(time.Millisecond))
		if st := r.status(obs.TargetID); st != incus.InstanceRunning {
			t.Fatalf("the handed-out spare is %s in Incus, want Running", st)
		}
		lock, _, err := r.client.GetInstance(r.ctx(), targets.Name(owner))
		if err != nil || lock.Config[standinKey] != obs.TargetID || lock.Status != incus.InstanceStopped {
			t.Fatalf("the owner's name holds %+v (%v), want a stopped stand-in naming %s", lock, err, obs.TargetID)
		}
		route := routeOf(owner, obs.TargetID)
		id := r.daemonID(route)
		if ids[id] {
			t.Fatalf("two handed-out spares answer with one daemonInstanceId %q", id)
		}
		ids[id] = true
		handed = append(handed, route)
	}

	// Paused and woken by a dial, as any target.
	r.power(handed[0], controller.PowerPaused)
	ws := r.mustUpgrade(handed[0])
	_ = ws.Close()

	// A burst while the pool refills: every owner ends with one target,
	// and asking again answers it.
	const burst = 10
	got := make([]string, burst)
	var wg sync.WaitGroup
	for i := range burst {
		owner := controller.Owner{UniverseID: "u-ready", EnvironmentID: fmt.Sprintf("burst-%d", i)}
		owners = append(owners, owner)
		wg.Go(func() {
			deadline := time.Now().Add(3 * time.Minute)
			for time.Now().Before(deadline) {
				obs, err := callOn(r.connect(), "target/create", controller.CreateParams{Owner: owner, TemplateID: "ready"})
				if err == nil && obs.TargetID != "" {
					got[i] = obs.TargetID
					return
				}
				time.Sleep(200 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	for i, id := range got {
		if id == "" {
			t.Fatalf("burst owner %d was never answered an id", i)
		}
		o := r.until(owners[3+i], "active and running", 3*time.Minute, func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning
		})
		if o.TargetID != id {
			t.Fatalf("burst owner %d was answered %s, then observed as %s", i, id, o.TargetID)
		}
	}
	r.checkOneTargetEach(owners)

	r.closeEach(owners...)
	list, err := r.client.ListInstances(r.ctx())
	if err != nil {
		t.Fatal(err)
	}
	for _, inst := range list {
		if inst.Config["user.lightspeed.universe"] != "" || inst.Config[warmClaimKey] != "" {
			t.Fatalf("after every close Incus still holds %s (config %v)", inst.Name, inst.Config)
		}
	}
}

// checkOneTargetEach checks in Incus that each owner's name holds one
// instance: its target, or a stand-in naming a spare claimed for it; and
// that no claimed spare is under no stand-in.
func (r *rig) checkOneTargetEach(owners []controller.Owner) {
	r.t.Helper()
	list, err := r.client.ListInstances(r.ctx())
	if err != nil {
		r.t.Fatal(err)
	}
	byName := map[string]incus.Instance{}
	for _, inst := range list {
		byName[inst.Name] = inst
	}
	locked := map[string]bool{}
	for _, o := range owners {
		at, ok := byName[targets.Name(o)]
		if !ok {
			r.t.Fatalf("owner %s has nothing at its name", o.EnvironmentID)
		}
		if sn := at.Config[standinKey]; sn != "" {
			spare, ok := byName[sn]
			if !ok || spare.Config[warmClaimKey] != at.Name || spare.Config["user.lightspeed.environment"] != o.EnvironmentID {
				r.t.Fatalf("owner %s's stand-in names %s, which is not claimed for it (%v)", o.EnvironmentID, sn, spare.Config)
			}
			locked[sn] = true
		}
	}
	for _, inst := range list {
		if claim := inst.Config[warmClaimKey]; strings.HasPrefix(inst.Name, "lsr-") && claim != "" && !locked[inst.Name] {
			r.t.Fatalf("spare %s is claimed for %s under no stand-in", inst.Name, claim)
		}
	}
}

// daemonID dials the route and answers its daemon's identity.
func (r *rig) daemonID(route routes.Route) string {
	r.t.Helper()
	d := r.dial(route)
	if d.Conn == nil {
		r.t.Fatalf("the route of %s refused: %+v after %s", route.TargetID, d.Refusal, d.Elapsed)
	}
	defer func() { _ = d.Conn.Close() }()
	return daemonInstanceID(r.t, d.Conn)
}

// daemonInstanceID runs the data-plane initialize and returns the daemon's
// identity.
func daemonInstanceID(t *testing.T, ws *websocket.Conn) string {
	t.Helper()
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer func() { _ = ws.SetReadDeadline(time.Time{}) }()
	req := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":5,"clientInfo":{"name":"image-test"}}}`
	if err := ws.WriteMessage(websocket.TextMessage, []byte(req)); err != nil {
		t.Fatal(err)
	}
	_, data, err := ws.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		Result struct {
			DaemonInstanceID string `json:"daemonInstanceId"`
		} `json:"result"`
	}
	if err := json.Unmarshal(data, &answer); err != nil || answer.Result.DaemonInstanceID == "" {
		t.Fatalf("initialize answered %s (%v)", data, err)
	}
	return answer.Result.DaemonInstanceID
}
